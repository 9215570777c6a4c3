"""Stage-2 scorers: one small file each, same signature, higher score = keep.

A scorer is a frozen dataclass whose fields are its hyperparameters, each with its one
default and help (``types.option``: the CLI's flags are made from them, ``options``), with
one method ``score(view, attention) -> ScoreOut``. ``CacheParams.scorer`` (a ``ScorerSpec``)
names it and gives the fields that differ from their defaults; a field named as one of
``CacheParams``' own (``sinks``, ...) takes that value instead. Per-token state that persists across steps lives in
the ledger, in the scorer's own columns: it declares them (``columns``: name -> ``Column`` or
its value at birth; ``columns_of``), reads them as ``view.columns[name]`` and returns their
new values in ``ScoreOut.columns``, which stage 4 writes. A scorer that takes stage 0's statistics of the prompt's own attention
(``CacheParams.prefill``) also has ``prefill(view, stats) -> ScoreOut``: the columns
the prime seeds (its file says how), and says by ``prefill_total`` whether it reads the
statistics' ``total`` (gathering it costs the prime another product over every prompt
query and key; without the attribute, it does), and by ``prefill_copy`` whether it reads
their ``copy`` (KVzip's reconstruction: a second pass over the prompt; without the
attribute, it does not); the others ignore them. ``SCORERS`` is the one
registry: the CLI's choices, the benchmarks and the tests are derived from it; a user's
own scorer is named by its file or module (``scorers.user``) wherever a name goes. The hindsight
oracle (``scorers.oracle``, bench quality only) is not in it: it needs a full-cache pass over
the same text, which no parameters give.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from ..state import Ledger, View
from ..types import CacheParams, Column, ScoreOut, UserError, require
from .brightness import Brightness
from .h2o import H2O
from .keydiff import KeyDiff
from .knorm import KeyNorm
from .kvzip import KVzip
from .none import NoScore
from .oracle import NAME as ORACLE, ONLY_BENCH
from .random import RandomScore
from .streaming import Streaming
from .tova import TOVA
from . import user


class Scorer(Protocol):
    def score(self, view: View, attention: torch.Tensor) -> ScoreOut: ...


SCORERS: dict[str, type] = {"brightness": Brightness, "streaming": Streaming, "h2o": H2O,
                            "tova": TOVA, "knorm": KeyNorm, "keydiff": KeyDiff, "kvzip": KVzip,
                            "random": RandomScore, "none": NoScore}
CULLING = tuple(name for name in SCORERS if name != "none")  # the scorers that take a budget
BASELINES = tuple(name for name in CULLING if name != CacheParams().scorer.name)
SHARED = tuple(f.name for f in dataclasses.fields(CacheParams)
               if f.metadata)  # what a scorer's field of that name takes from CacheParams


def takes_prefill_scores(scorer: object, params: CacheParams,
                         n_prompt: int | None = None) -> bool:
    """Whether the prime of ``n_prompt`` tokens (None: any longer than the budget) seeds
    ``scorer``'s columns from the prompt's attention: it takes them (a ``prefill`` method)
    and ``prefill.scores`` is on; or it is None (unset), the scorer's ``prefill_default`` is
    true and the prompt is longer than the budget, so the first cull compresses it."""
    on = params.prefill.scores
    if on is None:
        on = (bool(getattr(scorer, "prefill_default", False)) and params.budget is not None
              and (n_prompt is None or n_prompt > params.budget))
    return on and hasattr(scorer, "prefill")


def reads_total(scorer: object) -> bool:
    """Whether ``scorer``'s ``prefill`` reads the statistics' ``total`` (its
    ``prefill_total``; a scorer that does not say is taken to; one without a ``prefill``
    reads nothing)."""
    return hasattr(scorer, "prefill") and bool(getattr(scorer, "prefill_total", True))


def reads_copy(scorer: object) -> bool:
    """Whether ``scorer``'s ``prefill`` reads the statistics' ``copy`` (its ``prefill_copy``,
    false unless it says so: the reconstruction costs the prime a second pass over the
    prompt; ``stages.apply.prefill.reconstruction``)."""
    return hasattr(scorer, "prefill") and bool(getattr(scorer, "prefill_copy", False))


# what the streaming benchmarks' grids (quality, pass-key) run unless told: all but a scorer
# that copies the prompt at the prime (kvzip). Its copy is a second pass over the prompt
# that needs positions after it, and what it brings is a compressed prompt: ``bench ruler``'s
# compress. A quality cell's prime is one token (nothing to copy), a pass-key trial's prompt
# the longest lengths' (few positions left)
STREAMING = tuple(name for name in CULLING if not reads_copy(SCORERS[name]))


def copies(params: CacheParams) -> bool:
    """Whether a prime under ``params`` of a prompt longer than its budget runs KVzip's
    reconstruction: its scorer takes prefill scores there and reads ``copy``."""
    scorer = make_scorer(params)
    return takes_prefill_scores(scorer, params) and reads_copy(scorer)


def prefill_scorer(scorer: object, params: CacheParams) -> object | None:
    """``scorer`` if the prime should seed its columns (``takes_prefill_scores``), else None."""
    return scorer if takes_prefill_scores(scorer, params) else None


def columns_of(scorer: object) -> dict[str, Column]:
    """The ledger columns ``scorer`` declares (its ``columns``: name -> ``Column``, or a
    number, its value at birth), checked: none (an empty dict) for a scorer without."""
    declared = getattr(scorer, "columns", None) or {}
    who = f"scorer {getattr(scorer, 'name', type(scorer).__name__)}"
    require(isinstance(declared, dict), f"{who}: its columns must be a dict of name -> "
            f"Column or a number, not {type(declared).__name__}")
    out = {}
    for name, spec in declared.items():
        require(isinstance(name, str) and name.isidentifier() and name not in Ledger.COLUMNS
                and name not in ("scores", "columns"), f"{who}: column name {name!r} is not an "
                f"identifier or is the ledger's own ({', '.join(Ledger.COLUMNS)})")
        try:
            out[name] = spec if isinstance(spec, Column) else Column(birth=spec)
        except UserError as e:
            raise UserError(f"{who}: column {name}: {e}") from None
    return out


def culling(name: str) -> bool:
    """Whether ``name`` is a scorer that takes a budget: a built-in but none, or a user's."""
    return name in CULLING or user.is_user(name)


def scorer_class(name: str) -> type:
    """The class of the scorer ``name``: a built-in's, or a user's (loaded: ``scorers.user``)."""
    require(name != ORACLE, ONLY_BENCH)
    if name in SCORERS:
        return SCORERS[name]
    require(user.is_user(name), f"unknown policy {name!r}; expected one of "
            f"{', '.join(SCORERS)} or a scorer of your own (path/to/file.py:ClassName)")
    return user.load(name)


def field_names(cls: type) -> tuple[str, ...]:
    """The fields of the scorer class ``cls``, in order: what ``--param`` may set."""
    return tuple(f.name for f in dataclasses.fields(cls))


def make_scorer(params: CacheParams) -> Scorer:
    """The scorer ``params.scorer`` names, its fields from ``params.scorer.params`` (the
    rest: their defaults, or ``CacheParams``' value of that name), checked: a field it
    lacks, one it needs and was not given, or a value its own checks refuse is one line
    naming it. A user's scorer is guarded (``scorers.user.Guarded``)."""
    name = params.scorer.name
    cls = scorer_class(name)
    own = {f.name: f for f in dataclasses.fields(cls)}  # with their defaults
    given = dict(params.scorer.params)
    unknown = sorted(set(given) - set(own))
    require(not unknown, f"scorer {name} has no field {', '.join(map(repr, unknown))} "
            f"(its fields: {', '.join(n for n in own if n not in SHARED) or 'none'})")
    kw = {n: getattr(params, n) for n in own if n in SHARED and n not in given}
    missing = [n for n, f in own.items() if n not in given and n not in kw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for n in missing[:1]:
        raise UserError(f"scorer {name}: its field {n!r} needs --param {n}=VALUE")
    try:
        scorer = cls(**given, **kw)
    except UserError as e:
        raise UserError(f"scorer {name}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- a user's class: any error is one line
        raise UserError(f"scorer {name}: {type(e).__name__}: {e}") from None
    return scorer if name in SCORERS else user.Guarded(name, scorer)
