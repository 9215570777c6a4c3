"""Options made from the config dataclasses: every cache option is stated once, as a field.

``CacheParams``' own fields, its pieces' (``Positions``, ``Prefill``, ``Allocation``,
``MergeRepair``, ``FoldRepair``, ``Recall``) and the built-in scorers' are options where they carry a help string
(``types.option``). Each has one flat name: its ``flag``, or the field's name after its
class's ``PREFIX`` (``Recall.every`` is ``recall_every``, ``--recall-every`` on the
command line). Four more choose the pieces: ``policy`` (the scorer's name), ``param``
(NAME=VALUE for any field of the scorer, a user's own or a built-in's), ``repair`` and
``recall``. ``add_cache_args`` makes the CLI's flags from them, ``cache_params`` turns the
ones given (by flag, by ``bench --params`` or by a benchmark's variant) into a
``CacheParams`` over a base (a forked capture's, say), and ``reference`` writes the flag
reference (docs/OPTIONS.md). A piece's option given while the piece is off is refused, as
is a scorer field the chosen scorer does not have.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass
from types import UnionType
from typing import Any

from .scorers import SCORERS, field_names, make_scorer, scorer_class
from .scorers import user
from .types import (REPAIRS, Allocation, CacheParams, FoldRepair, MergeRepair, Positions, Prefill,
                    Recall, ScorerSpec, UserError, repair_class, require)

# where a cache option lives
PIECES = (CacheParams, Positions, Prefill, Allocation, MergeRepair, FoldRepair, Recall)

@dataclass(frozen=True)
class Option:
    """One cache option: its flat ``name``, the config class and field it sets, its type
    (``hint``), default and help."""

    name: str
    owner: type
    field: str
    hint: Any
    default: Any
    help: str
    choices: tuple | None = None
    metavar: str | None = None
    of: str | None = None  # the one allocation kind it is for (``Allocation``'s fields)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def options_of(cls: type, kind: type = Option) -> list:
    """The fields of ``cls`` that carry a help string, as ``kind`` (an ``Option``, or a
    subclass whose added fields come from the field's metadata of the same names)."""
    hints = typing.get_type_hints(cls)
    prefix = getattr(cls, "PREFIX", "")
    extra = [f.name for f in dataclasses.fields(kind)][len(dataclasses.fields(Option)):]
    return [kind(f.metadata.get("flag") or (f"{prefix}_" if prefix else "") + f.name, cls,
                 f.name, hints[f.name], f.default,
                 (f"{f.metadata['of']}: " if f.metadata.get("of") else "") + f.metadata["help"],
                 f.metadata.get("choices"), f.metadata.get("metavar"), f.metadata.get("of"),
                 **{k: f.metadata[k] for k in extra if k in f.metadata})
            for f in dataclasses.fields(cls) if "help" in f.metadata]


def _scorer_defaults() -> dict[str, dict[str, Any]]:
    """Each built-in scorer field's default by the scorers that have it."""
    out: dict[str, dict[str, Any]] = {}
    for name, cls in SCORERS.items():
        for o in options_of(cls):
            out.setdefault(o.name, {})[name] = o.default
    return out


SCORER_DEFAULTS = _scorer_defaults()
PER_SCORER = frozenset(n for n, each in SCORER_DEFAULTS.items()
                       if len(set(map(repr, each.values()))) > 1)  # defaults that differ


def _scorer_options() -> dict[str, Option]:
    """The built-in scorers' fields, one option a name (``aggregate`` serves four) with the
    first one's help, naming the scorers that have it; where their defaults differ
    (``PER_SCORER``), each scorer's, and none of its own."""
    out: dict[str, Option] = {}
    for cls in SCORERS.values():
        for o in options_of(cls):
            out.setdefault(o.name, o)

    def owners(n: str) -> str:
        each = SCORER_DEFAULTS[n]
        return ", ".join(f"{s}: {d}" if n in PER_SCORER else s for s, d in each.items())
    return {n: dataclasses.replace(o, owner=ScorerSpec, help=f"{o.help} ({owners(n)})",
                                   default=None if n in PER_SCORER else o.default)
            for n, o in out.items()}


CHOOSERS = {o.name: o for o in (  # the options that choose pieces rather than set a field
    Option("policy", ScorerSpec, "name", str, ScorerSpec().name, "the stage-2 scorer: "
           + "|".join(SCORERS) + ", or your own: path/to/file.py:ClassName, module:ClassName "
           "or an installed entry point (README: bring your own scorer)"),
    Option("param", ScorerSpec, "params", tuple[str, ...], (), "a field of the scorer, "
           "NAME=VALUE (repeatable; its default otherwise)", metavar="NAME=VALUE"),
    Option("repair", CacheParams, "repair", str, CacheParams().repair_name,
           "merge dim adjacent pairs, or fold culled K/V into the most alike survivor",
           choices=tuple(REPAIRS)),
    Option("recall", CacheParams, "recall", bool, False, "culled tokens go to a cold store "
           "and come back when the query attends to them more than to the dimmest hot ones"))}
FIELDS = {o.name: o for cls in PIECES for o in options_of(cls)}
SCORER_FIELDS = _scorer_options()
assert not set(FIELDS) & set(SCORER_FIELDS) and not set(FIELDS) & set(CHOOSERS)
OPTIONS = {**CHOOSERS, **FIELDS, **SCORER_FIELDS}  # every cache option by its flat name
NAMES = tuple(OPTIONS)


# --- values ---------------------------------------------------------------------------------

BOOLS = {"true": True, "on": True, "yes": True, "1": True,
         "false": False, "off": False, "no": False, "0": False}


KINDS = {bool: "true or false", int: "an integer", float: "a finite number"}


def parse(text: str, hint, what: str = ""):
    """``text`` as a value of the annotated type ``hint`` (bool, int, float, str, a tuple of
    one of them ``:``- or ``,``-separated, or any of these or None: ``none``); a one-line
    error (naming ``what``, if given) otherwise."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, UnionType):
        if text.strip().lower() == "none" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else str
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:  # an item's error names the item
        items = [t.strip() for t in text.replace(":", ",").split(",") if t.strip()]
        try:
            return tuple(parse(t, args[0]) for t in items)
        except UserError as e:
            raise UserError(f"{what}: " * bool(what) + f"{text!r}: {e}") from None
    try:
        if hint is bool:
            return BOOLS[text.strip().lower()]
        if hint in (int, float):
            value = hint(text)
            require(math.isfinite(value), "")
            return value
    except (KeyError, ValueError, UserError):
        kind = KINDS.get(hint, f"a {getattr(hint, '__name__', hint)}")
        raise UserError(f"{what}: " * bool(what) + f"{text!r} is not {kind}") from None
    return text


def _scorer_hint(cls: type, name: str):
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 -- a user's class whose annotations do not resolve
        hints = {}
    if name in hints:
        return hints[name]
    field = cls.__dataclass_fields__.get(name)
    return type(field.default) if field is not None and field.default is not None else str


def param_pairs(items, policy: str) -> dict[str, Any]:
    """``--param NAME=VALUE`` items as the scorer ``policy``'s field values (by their types)."""
    out = {}
    cls = scorer_class(policy) if items else None
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        require(eq and name.isidentifier(), f"--param takes NAME=VALUE, got {item!r}")
        own = field_names(cls)
        require(name in own, f"scorer {policy} has no field {name!r} (its fields: "
                f"{', '.join(own) or 'none'})")
        out[name] = parse(text, _scorer_hint(cls, name), f"--param {name}")
    return out


# --- given options -> CacheParams -------------------------------------------------------------

def cache_params(given: dict[str, Any], base: CacheParams | None = None,
                 text: bool = False, strict: bool = True) -> CacheParams:
    """``base`` (default: ``CacheParams()``) with the options ``given`` (flat name -> value,
    or its text with ``text``) set, checked, the scorer built once to check its fields.
    Not ``strict`` (a benchmark's options shared by cells of several scorers and pieces):
    a scorer field the scorer lacks, or a field of a piece that is off, is left out."""
    base = base or CacheParams()
    given = dict(given)
    unknown = sorted(set(given) - set(NAMES))
    require(not unknown, f"unknown cache option {unknown[:1]}")
    if text:
        given = typed(given)
    policy = given.pop("policy", None)
    spec = base.scorer if policy in (None, base.scorer.name) else ScorerSpec(policy)
    fields = dict(spec.params)
    fields |= {k: given.pop(k) for k in list(given) if k in SCORER_FIELDS}
    items = given.pop("param", None) or ()
    if not strict:
        own = field_names(scorer_class(spec.name))
        fields = {k: v for k, v in fields.items() if k in own}
        items = [i for i in items if i.partition("=")[0].strip() in own]
    fields |= param_pairs(items, spec.name)
    repair, recall = base.repair, base.recall
    if given.get("repair") is not None:
        kind = repair_class(given["repair"])
        repair = kind and (base.repair if isinstance(base.repair, kind) else kind())
    if given.get("recall") is not None:
        recall = (base.recall or Recall()) if given["recall"] else None
    given = {k: v for k, v in given.items() if k in FIELDS}
    pieces = {Positions: base.positions, Prefill: base.prefill, Allocation: base.allocation,
              MergeRepair: repair, FoldRepair: repair, Recall: recall}
    for cls, piece in pieces.items():
        names = [k for k in given if FIELDS[k].owner is cls]
        if not names or not (strict or isinstance(piece, cls)):
            continue
        if not isinstance(piece, cls):
            raise UserError(f"{FIELDS[names[0]].flag} is for {_switch(cls)}")
        pieces[cls] = dataclasses.replace(piece, **{FIELDS[k].field: given[k] for k in names})
    kind = pieces[Allocation].kind
    other = [FIELDS[k] for k in given if strict and FIELDS[k].of not in (None, kind)]
    if other:
        raise UserError(f"{other[0].flag} is for --allocation {other[0].of}, not {kind}")
    top = {FIELDS[k].field: v for k, v in given.items() if FIELDS[k].owner is CacheParams}
    params = dataclasses.replace(
        base, **top, scorer=ScorerSpec(spec.name, fields), positions=pieces[Positions],
        prefill=pieces[Prefill], allocation=pieces[Allocation], repair=pieces[MergeRepair] if isinstance(repair, MergeRepair)
        else pieces[FoldRepair] if isinstance(repair, FoldRepair) else None, recall=pieces[Recall])
    make_scorer(params)
    return params


def params(**flat) -> CacheParams:
    """``CacheParams`` from options by their flat names: ``params(budget=64, recall=True,
    recall_every=2, decay=0.3)``."""
    return cache_params(flat)


def _switch(cls: type) -> str:
    return {MergeRepair: "--repair merge", FoldRepair: "--repair fold", Recall: "--recall"}[cls]


def typed(given: dict[str, Any]) -> dict[str, Any]:
    """Options given as text (``pairs``) as values of their fields' types."""
    return {k: _parse_given(k, v) for k, v in given.items()}


def check_shared(given: dict[str, Any], policies) -> None:
    """A benchmark's shared options: each scorer field among ``given`` (by flag or
    ``param``) is a field of at least one of ``policies``' scorers."""
    classes = [scorer_class(p) for p in policies]
    names = [k for k in given if k in SCORER_FIELDS]
    names += [i.partition("=")[0].strip() for i in given.get("param") or ()]
    for name in names:
        require(any(name in field_names(c) for c in classes),
                f"{name}: a field of none of the policies {', '.join(policies)}")


def _parse_given(name: str, value):
    if not isinstance(value, str):
        return value
    return [value] if name == "param" else parse(value, OPTIONS[name].hint, name)


def pairs(text: str, what: str) -> dict[str, str]:
    """``"name=value,name=value"`` (``bench --params``) as {flat name: value text}, each a
    cache option's name (dashes or underscores)."""
    out = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, eq, value = item.partition("=")
        name = name.strip().replace("-", "_")
        require(eq and name in NAMES, f"{what}: unknown option {name!r} (expected NAME=VALUE "
                f"with a cache option's name: docs/OPTIONS.md)")
        out[name] = value.strip()
    return out


# --- the CLI --------------------------------------------------------------------------------

def add_cache_args(p: argparse.ArgumentParser) -> None:
    """The cache flags, each from its option. A flag not given is absent from the parsed
    args (``given``)."""
    g = p.add_argument_group("cache (see docs/CACHE.md: budgets, policies, repair, recall, "
                             "positions; docs/OPTIONS.md)")
    none = argparse.SUPPRESS
    for o in OPTIONS.values():
        kw = {"default": none, "help": o.help + _default_text(o), "dest": o.name}
        if o.hint in (bool, bool | None):
            g.add_argument(o.flag, action=argparse.BooleanOptionalAction, **kw)
        elif o.name == "param":  # repeatable: each item NAME=VALUE
            g.add_argument(o.flag, action="append", metavar=o.metavar, **kw)
        else:
            g.add_argument(o.flag, type=_reader(o), choices=o.choices,
                           metavar=o.metavar or (None if o.choices else o.field.upper()), **kw)


def _reader(o: Option):
    """``o``'s argparse type: its error is argparse's one line, naming the flag."""
    def read(text: str):
        try:
            return parse(text, o.hint)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return read


def _default_text(o: Option) -> str:
    if o.default in (None, ()) or o.default is dataclasses.MISSING:
        return ""
    value = ":".join(map(str, o.default)) if isinstance(o.default, tuple) else o.default
    return f" (default: {value})"


def given(args) -> dict[str, Any]:
    """The cache options given on the command line (flat name -> value)."""
    return {k: v for k, v in vars(args).items() if k in NAMES}


def from_args(args, base: CacheParams | None = None) -> CacheParams:
    """``run``/``chat``/``fork``'s cache parameters: ``base`` with the flags given, checked
    (the scorer too) before any model loads; a scorer file's path made absolute."""
    options = given(args)
    if "policy" in options:
        options["policy"] = user.absolute(options["policy"])
    return cache_params(options, base)


# --- the reference --------------------------------------------------------------------------

def reference() -> str:
    """docs/OPTIONS.md: every cache option, its flag, type, default and help, by piece."""
    lines = ["# Cache options", "",
             "Every cache option, made from the config dataclasses' fields by "
             "`python -m positronic_brain.options > docs/OPTIONS.md` (a test holds this page "
             "to it). Each is a flag of `run`, `chat` and `fork`, and "
             "a name for `bench quality --params NAME=VALUE,...` and `bench passkey`'s "
             "variants. A piece's option given while the piece is off (an allocation's under "
             "another allocation), or a scorer field the chosen scorer lacks, is refused in "
             "one line.", ""]
    groups = [("Choosers (which scorer, repair and recall)",
               [_row(o) for o in CHOOSERS.values()])]
    for cls in PIECES:
        groups.append((f"{cls.__name__} (`types.{cls.__name__}`)",
                       [_row(o) for o in FIELDS.values() if o.owner is cls]))
    groups.append(("Scorer fields (the built-ins'; `--param NAME=VALUE` sets any scorer's)",
                   [_row(o) for o in SCORER_FIELDS.values()]))
    for title, rows in groups:
        lines += [f"## {title}", "", "| flag | type | default | what |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(f"`{c}`" if k == 0 else str(c).replace("|", "\\|")
                                    for k, c in enumerate(row)) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def _row(o: Option) -> tuple[str, str, str, str]:
    default = _default_text(o)[len(" (default: "):-1] if _default_text(o) else ""
    kind = str(o.hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    choices = f" ({', '.join(o.choices)})" if o.choices else ""
    return (o.flag, kind, default or ("per scorer" if o.name in PER_SCORER else "unset"),
            o.help + choices)


def settings(given: dict[str, Any]) -> dict[str, Any]:
    """Every option's default (the built-in scorers' fields too, the default scorer's where
    theirs differ), with ``given`` set: what a benchmark's report says its cells ran with."""
    own = {o.name: o.default for o in options_of(scorer_class(CacheParams().scorer.name))}
    return {o.name: o.default for o in (*FIELDS.values(), *SCORER_FIELDS.values())} | own | given


def flat(params: CacheParams) -> dict[str, Any]:
    """``params`` as its options (flat name -> value; the inverse of ``cache_params``): the
    pieces chosen, every field of those that are on, the scorer's fields given."""
    out = {"policy": params.scorer.name, "repair": params.repair_name,
           "recall": params.recall is not None}
    pieces = {CacheParams: params, Positions: params.positions, Prefill: params.prefill,
              Allocation: params.allocation, MergeRepair: params.repair, FoldRepair: params.repair, Recall: params.recall}
    out |= {o.name: getattr(pieces[o.owner], o.field) for o in FIELDS.values()
            if isinstance(pieces[o.owner], o.owner)}
    return out | dict(params.scorer.params)


if __name__ == "__main__":  # python -m positronic_brain.options > docs/OPTIONS.md
    print(reference(), end="")
