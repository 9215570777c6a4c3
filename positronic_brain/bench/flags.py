"""A benchmark's flags, made from the fields of its config dataclass.

``positronic-brain bench KIND`` has one subcommand per benchmark. Each takes the shared
flags (``add_shared``: ``--quick``, ``--json``, ``--out``, ``--report``, ``--model``,
``--device``) and its own, one per field of its config (and of ``Workers``, where it runs
in parallel) that carries a help string (``types.option``), as the cache flags are made
(``options``). A field's metadata may also hold ``quick`` (its value under ``--quick``:
``preset`` sets it, the help shows it), ``read`` (text -> value, for a flag the field's
type does not say how to read) and ``repeat`` (the name of a second, repeatable flag
whose items ``read`` takes too: ``--param`` beside ``--params``). A flag of another
benchmark is refused by argparse, in one line.

A flag not given is None in the parsed args and its field keeps its default (or its
``quick`` value): ``config`` builds the config from the flags given, ``command_line``
writes them back as the command that reproduces the run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any

from .. import options
from ..model import resolve_device
from ..scorers import user
from ..types import UserError, option, require
from . import common
from .grid import Pool, check_address
from .result import Journal

MODEL, DEVICE = "smollm2", "cpu"  # the shared --model and --device unless given
SHARED = ("quick", "json", "out", "report", "model", "device")  # every benchmark's flags


@dataclass(frozen=True)
class Workers:
    """How many processes measure in parallel (``common.jobs``): a flag of the benchmarks
    whose runs are independent, not part of what they measure."""

    jobs: int | None = option(None, "items (bench passkey: trials, bench ruler: samples) "
                              "in parallel, one single-thread process each (default: CPU "
                              "cores)")
    ray: str | None = option(None, "measure on a Ray cluster: auto (the one this machine "
                             "has joined), local (one started for this run) or HOST:PORT; "
                             "--jobs: its actors (default: one per CPU of the cluster); "
                             "needs the ray extra", metavar="ADDRESS")
    resume: bool = option(False, "keep the items an interrupted run with this --out and "
                          "the same config finished (its items.jsonl) and measure the rest")


@dataclass(frozen=True)
class Flag(options.Option):
    """One benchmark flag: an option (its ``name``, the ``field`` of ``owner`` it sets, ...)
    with its value under ``--quick``, its reader and its repeatable twin, where it has them."""

    quick: Any = None  # None: the default under --quick too
    read: Any = None  # text (and the repeat flag's items) -> value; True: the flag alone
    repeat: str | None = None
    bare: bool = False  # the flag may be given alone (``read`` then takes True)


def flags_of(classes) -> list[Flag]:
    """The flags of the fields of ``classes`` that carry a help string, in field order."""
    return [f for cls in classes for f in options.options_of(cls, Flag)]


def names(classes) -> list[str]:
    """Every flag's name (a ``repeat`` flag's after its field's)."""
    return [n for f in flags_of(classes) for n in (f.name, f.repeat) if n]


# --- values -----------------------------------------------------------------------------------

def preset(cls, quick: bool, **kw):
    """``cls(**kw)``; with ``quick``, each field's ``quick`` value where ``kw`` does not
    set the field."""
    if not quick:
        return cls(**kw)
    fast = {f.name: f.metadata["quick"] for f in dataclasses.fields(cls) if "quick" in f.metadata}
    return cls(quick=True, **{**fast, **kw})


def scorers(text: str) -> tuple[str, ...]:
    """``--policies a,b``: scorer names, a file of your own made absolute; each may name a
    per-head allocation, ``NAME@ALLOCATION`` (``cell_policy``)."""
    return tuple(user.absolute(p.strip()) for p in text.split(","))


def cell_policy(label: str) -> dict[str, str]:
    """A grid's policy, ``NAME`` or ``NAME@ALLOCATION`` (``tova@head``: tova with each
    (layer, KV head) keeping its own tokens, at the same K/V memory), as cache options."""
    name, _, kind = label.partition("@")
    return {"policy": name} | ({"allocation": kind} if kind else {})


def scorer_names(labels) -> tuple[str, ...]:
    """The scorers a grid's policies (``cell_policy``'s labels) name."""
    return tuple(cell_policy(p)["policy"] for p in labels)


def policy_label(cache) -> str:
    """The grid's label of the cache parameters ``cache``: ``cell_policy``'s inverse."""
    kind = cache.allocation.kind
    return cache.scorer.name + (f"@{kind}" if cache.allocation.per_head else "")


EVERY = "all"  # ``recall_policies``: every policy of the grid


def recall_policies(text: str | bool) -> tuple[str, ...]:
    """A grid's ``--recall``: the policies that also run with recall (``NAME@ALLOCATION``
    per head), or (the flag alone, or ``all``) every policy of the grid: ``(EVERY,)``."""
    if text is True or text.strip() == EVERY:
        return (EVERY,)
    named = scorers(text)
    require(named and EVERY not in named, f"--recall takes comma-separated policies, or "
            f"{EVERY} (or nothing) for every policy, got {text!r}")
    return named


def policies(text: str) -> tuple[str, ...]:
    """``--policies a,b``: ``scorers``, ``none`` (no cell: the full cache only) left out."""
    return tuple(p for p in scorers(text) if p != "none")


def cache_options(text: str | None, items: list[str] | None) -> tuple[tuple[str, Any], ...]:
    """``--params K=V,...`` and ``--param NAME=VALUE`` items: cache options of every run
    (flat name -> value), sorted."""
    given = options.typed(options.pairs(text or "", "--params"))
    fixed = sorted({"budget", "policy", "repair", "positions", "recall", "param",
                    "allocation"} & set(given))
    require(not fixed, f"--params: {', '.join(fixed)} is the benchmark's own axis"
            + (" (--param NAME=VALUE)" if "param" in fixed else "")
            + (" (--policies NAME@ALLOCATION)" if "allocation" in fixed else ""))
    if items:
        given["param"] = tuple(items)
    return tuple(sorted(given.items()))


def _read(f: Flag, args):
    """Field ``f``'s value from the flags given (its own and its ``repeat`` one)."""
    text = getattr(args, f.name)
    if f.repeat:
        return f.read(text, getattr(args, f.repeat))
    if f.read:
        return f.read(text)
    if f.hint is bool and f.default is False:  # a switch: given or not
        return text
    if typing.get_origin(f.hint) is tuple:
        return _items(text, f)
    return text  # argparse read it (``_kind``)


def _items(text: str, f: Flag) -> tuple:
    """A comma-separated list: of the field's item type (int, float or text), each one of
    its ``choices`` where it has them; anything else a one-line UserError."""
    kind = typing.get_args(f.hint)[0]
    try:
        items = tuple(kind(t.strip()) for t in text.split(",") if t.strip())
    except ValueError:
        what = {int: "integers", float: "numbers"}[kind]
        raise UserError(f"{f.flag} takes comma-separated {what}, got {text!r}") from None
    bad = [x for x in items if f.choices and x not in f.choices]
    require(items and not bad, f"{f.flag}: {'unknown ' + repr(bad[0]) if bad else 'empty list'}"
            + (f"; expected some of {', '.join(map(str, f.choices))}" if f.choices else ""))
    return items


def given(args, classes) -> dict[str, Any]:
    """The fields of ``classes`` set by the flags given (field -> value)."""
    return {f.field: _read(f, args) for f in flags_of(classes)
            if getattr(args, f.name) is not None or (f.repeat and getattr(args, f.repeat))}


def config(cls, args):
    """A benchmark's config ``cls`` from its parsed flags: ``--model``, ``--device``
    (resolved), ``--quick`` (``preset``) and its own flags given, checked."""
    kw = {"model": args.model, "device": str(resolve_device(args.device))}
    return cls.preset(args.quick, **kw, **given(args, (cls,)))


# --- the CLI ----------------------------------------------------------------------------------

def add_shared(p: argparse.ArgumentParser, model_help: str) -> None:
    """The flags every benchmark takes."""
    p.add_argument("--quick", action="store_true",
                   help="fewer, smaller measurements (make bench)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of tables")
    p.add_argument("--out", default=None,
                   help="folder for report.md, results.json and the PNG plots")
    p.add_argument("--report", default=None,
                   help="also write the report into this shared document (e.g. "
                   "docs/BENCHMARKS.md), as its own section between markers")
    p.add_argument("--model", default=MODEL, help=model_help)
    p.add_argument("--device", default=DEVICE,
                   help="cpu (default: a report names its machine), cuda, cuda:N or auto")


def add_flags(p: argparse.ArgumentParser, classes, title: str) -> None:
    """A flag per field of ``classes`` with a help string, in a group titled ``title``;
    each None unless given."""
    fs = flags_of(classes)
    if not fs:
        return
    g = p.add_argument_group(title)
    for f in fs:
        kind, listed = _kind(f), typing.get_origin(f.hint) is tuple  # a list: _items checks
        g.add_argument(f.flag, dest=f.name, default=None, help=f.help + _defaults(f)
                       + (f" (of {', '.join(f.choices)})" if listed and f.choices else ""),
                       **({} if "action" in kind else {
                           "choices": None if listed else f.choices,
                           "metavar": f.metavar or ("LIST" if listed and f.choices else None)}),
                       **kind)
        if f.repeat:
            g.add_argument(f"--{f.repeat}", action="append", default=None,
                           metavar="NAME=VALUE", help=options.CHOOSERS[f.repeat].help)


def _kind(f: Flag) -> dict:
    """argparse reads a number; the rest is text until ``config`` reads it."""
    hint = f.hint
    if hint is bool and f.default is False:
        return {"action": "store_const", "const": True}
    if f.bare:  # a value, or the flag alone (True: written back alone, as a switch)
        return {"nargs": "?", "const": True}
    if typing.get_origin(hint) in (typing.Union, UnionType):  # ``int | None``: an int
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return {"type": hint} if hint in (int, float) and f.read is None else {}


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _defaults(f: Flag) -> str:
    """`` (default 50; --quick 8)``: the field's default and, if another, its quick value."""
    if f.default is None or f.default == ():
        return ""
    quick = ("" if f.quick is None or f.quick == f.default
             else f"; --quick {_text(f.quick)}")
    return f" (default {_text(f.default)}{quick})"


def command_line(bench: str, args, classes) -> str:
    """The ``positronic-brain bench`` command that reproduces a run (``--resume`` left
    out): ``--quick``, then in the order of the config's fields, each flag given (``--model`` and ``--device`` unless
    at their defaults), then ``--out`` and ``--report``."""
    shared = {"model": MODEL, "device": DEVICE}
    own = {f.field: f for f in flags_of(classes) if f.field != "resume"}  # not what it measures
    pairs: list[tuple[str, Any]] = []
    for cls in classes:
        for fd in dataclasses.fields(cls):
            if fd.name in shared:
                pairs.append((fd.name, shared[fd.name]))
            elif fd.name in own:
                pairs += [(own[fd.name].name, None)] + [(own[fd.name].repeat, None)] * bool(
                    own[fd.name].repeat)
    return common.command_line(bench, args, (*pairs, ("out", None), ("report", None)))


def main(args, bench) -> int:
    """``bench KIND``, any benchmark: its config from the flags given (checked before the
    slow part), the ``--out`` folder made, the run, then its tables (or one JSON object) and
    files (``common.emit``). ``bench`` is the benchmark's module: ``FLAGS`` (its config
    first), ``run(cfg, command[, pool])``, ``tables``, ``plots``, ``report_md``
    and, where its report's section is not its name, ``section(cfg)``; where what a row
    measures changed, ``MEASURES`` (in the journal's first line, so that ``--resume``
    refuses a journal of the rows before). A benchmark whose
    flags include ``Workers`` measures a grid of items, each a ``ROW``, in a ``grid.Pool``
    (processes or a Ray cluster), kept in a journal (``result.Journal``) in the ``--out``
    folder so that ``--resume`` can go on with it."""
    cfg = config(bench.FLAGS[0], args)
    resume = getattr(args, "resume", None)
    require(not resume or args.out is not None,
            "--resume needs --out (the folder of the run to go on with)")
    require(not resume or Path(args.out).is_dir(),
            f"--resume: no folder {args.out} (the --out of the run to go on with)")
    out = common.out_dir(args)
    pool = {}
    if Workers in bench.FLAGS:
        if args.ray is not None:
            check_address(args.ray)
        jobs = None if args.ray and args.jobs is None else common.jobs(args)
        journal = None
        if out is not None:
            head = {"benchmark": args.kind, "config": dataclasses.asdict(cfg),
                    **({"measures": bench.MEASURES} if hasattr(bench, "MEASURES") else {})}
            journal = Journal(out / "items.jsonl", json.loads(json.dumps(head)),
                              bool(args.resume), bench.ROW)
        pool["pool"] = Pool(jobs, journal, args.ray)
    res = bench.run(cfg, command_line(args.kind, args, bench.FLAGS), **pool)
    journal = pool["pool"].journal if pool else None
    if journal is not None and journal.earlier != 0.0:  # a resumed run: its parts before
        res.earlier_s = journal.earlier
        res.elapsed_s += journal.earlier or 0.0
    section = bench.section(cfg) if hasattr(bench, "section") else args.kind
    common.emit(res, args, out, section, bench.plots, bench.report_md, bench.tables)
    return 0
