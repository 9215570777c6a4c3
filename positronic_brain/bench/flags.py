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
import typing
from dataclasses import dataclass
from types import UnionType
from typing import Any

from .. import options
from ..model import resolve_device
from ..scorers import user
from ..types import option, require
from . import common

MODEL, DEVICE = "smollm2", "cpu"  # the shared --model and --device unless given
SHARED = ("quick", "json", "out", "report", "model", "device")  # every benchmark's flags


@dataclass(frozen=True)
class Workers:
    """How many processes measure in parallel (``common.jobs``): a flag of the benchmarks
    whose runs are independent, not part of what they measure."""

    jobs: int | None = option(None, "runs (bench passkey: trials) in parallel, one "
                              "single-thread process each (default: CPU cores)")


@dataclass(frozen=True)
class Flag(options.Option):
    """One benchmark flag: an option (its ``name``, the ``field`` of ``owner`` it sets, ...)
    with its value under ``--quick``, its reader and its repeatable twin, where it has them."""

    quick: Any = None  # None: the default under --quick too
    read: Any = None  # text (and the repeat flag's items) -> value
    repeat: str | None = None


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
    """``--policies a,b``: scorer names, a file of your own made absolute."""
    return tuple(user.absolute(p.strip()) for p in text.split(","))


def cache_options(text: str | None, items: list[str] | None) -> tuple[tuple[str, Any], ...]:
    """``--params K=V,...`` and ``--param NAME=VALUE`` items: cache options of every run
    (flat name -> value), sorted."""
    given = options.typed(options.pairs(text or "", "--params"))
    fixed = sorted({"budget", "policy", "repair", "positions", "recall", "param"} & set(given))
    require(not fixed, f"--params: {', '.join(fixed)} is the benchmark's own axis"
            + (" (--param NAME=VALUE)" if "param" in fixed else ""))
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
    if typing.get_origin(f.hint) is tuple and typing.get_args(f.hint)[0] is int:
        return common.ints(text, f.name)
    if typing.get_origin(f.hint) is tuple:
        return tuple(t.strip() for t in text.split(","))
    return text  # argparse read it (``_kind``)


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
        g.add_argument(f.flag, dest=f.name, default=None, help=f.help + _defaults(f),
                       choices=f.choices, metavar=f.metavar, **_kind(f))
        if f.repeat:
            g.add_argument(f"--{f.repeat}", action="append", default=None,
                           metavar="NAME=VALUE", help=options.CHOOSERS[f.repeat].help)


def _kind(f: Flag) -> dict:
    """argparse reads a number; the rest is text until ``config`` reads it."""
    hint = f.hint
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
    """The ``positronic-brain bench`` command that reproduces a run: ``--quick``, then in
    the order of the config's fields, each flag given (``--model`` and ``--device`` unless
    at their defaults), then ``--out`` and ``--report``."""
    shared = {"model": MODEL, "device": DEVICE}
    own = {f.field: f for f in flags_of(classes)}
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
    first), ``run(cfg, command[, workers])``, ``tables``, ``plots``, ``report_md`` and, where
    its report's section is not its name, ``section(cfg)``."""
    cfg = config(bench.FLAGS[0], args)
    out = common.out_dir(args)
    workers = {"workers": common.jobs(args)} if Workers in bench.FLAGS else {}
    res = bench.run(cfg, command_line(args.kind, args, bench.FLAGS), **workers)
    section = bench.section(cfg) if hasattr(bench, "section") else args.kind
    common.emit(res, args, out, section, bench.plots, bench.report_md, bench.tables)
    return 0
