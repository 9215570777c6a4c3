"""``positronic-brain bench quality``: how much each KV-cache policy forgets.

Streaming perplexity. A long text goes through the real loop one token per step (stages
1-4, the budget enforced at every step); the pending token is always the text's next
token (teacher forcing: ``Session.stream(force=...)``, so stage 4 stays the only
mutation), and each step records the negative log-likelihood stage 1's logits give that
token. Perplexity = exp(mean NLL) over the scored tokens. Measured:

1. the grid: ``--windows`` windows spread evenly over the slice, each streamed from an
   empty cache: the largest budget + 1 unscored tokens first (so at every budget the
   cache is full and has culled before the first scored token), then ``--tokens`` scored
   ones; a cell's perplexity is over every window's scored tokens. Its cells: the full
   cache (no budget, nothing culled); every scorer (brightness, streaming, h2o, tova,
   knorm, keydiff, random) at every budget, with each repair (none, merge, fold); the
   default policy (or the ``--recall`` policies) with recall (the cold store) at every
   budget; and the hindsight oracle (``scorers.oracle``) at every budget, which culls the
   token the full-cache run's later queries attend to least (its runs wait for the full
   cache, which records that attention in each window);
2. a long run past the model's positions at one budget with ``--positions compact``
   (re-index before the limit) and ``keep`` (which has to stop at the limit), as
   perplexity over windows of tokens; ``keep`` runs of the long baselines and of the long
   policy with recall over the same tokens, and the full cache up to the positions; and a
   control run that scores the tokens past the positions starting later in the text, so
   that its positions stay below half the limit (the same tokens, the same budget: what
   crossing the limit costs, apart from the text).

Texts (``--text``): the named ones in ``TEXTS``, each shipped by an offline package
(``topics``, the default, and ``jargon``), or any UTF-8 file. ``--slice eval`` (the
default) places the windows and the long run in the text's first half; ``--slice tune`` in
its second half (from ``--at``), a disjoint part on which scorer parameters are chosen.
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import options
from ..batch import drive_rows
from ..loop import Session, arena_capacity
from ..model import DTYPES, Model
from ..special_tokens import TokenPolicy
from ..stages.score import read_like_scorer
from ..scorers import BASELINES, CULLING, STREAMING, culling
from ..scorers.oracle import NAME as ORACLE, AttentionRecorder, Oracle
from ..types import (PER_HEAD, CacheParams, SamplerParams, ScorerSpec, Segment, Totals, UserError,
                     option, require)
from . import batch_size, common, flags, grid
from .common import Table, fmt
from .grid import Pool
from .result import KVCost, Machine, Result, Target, model_facts, target_table

SCORERS = STREAMING  # the default scorer first, then the baselines
REPAIRS = ("none", "merge", "fold")
SLICES = ("eval", "tune")
DEFAULT = CacheParams()  # the default policy: its scorer and repair, with recall in the grid
# Targets from the project's issues: reported, never asserted.
FULL_TARGET = 1.05  # brightness at FULL_TARGET_BUDGET / the full cache
FULL_TARGET_BUDGET = 512
FLAT_TARGET = 1.10  # long run: perplexity past the positions / at half the positions
GAP_TARGET = 0.5  # the default policy with recall closes this much of the baseline -> oracle gap
RECALL_TARGET = 1.05  # the long run with recall over the first positions / the full cache
GRID_RECALL_TARGET = 0.97  # the default policy with recall / the best drop-only baseline
GRID_RECALL_BUDGETS = (128, 256)  # ... at these budgets
HEADS_TARGET = 1.0  # the best per-head cell / the best whole-token cell, at equal K/V memory
HEADS_TARGET_BUDGETS = (128, 256)  # ... at these budgets
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
TEXTS = {"topics": "Python's English help topics, `pydoc_data.topics` in sorted-key order",
         "jargon": f"the Jargon File 4.4.7 as Debian's `jargon-text` ships it, `{JARGON}`"}
DEFAULT_TEXT = "topics"


@dataclass(frozen=True)
class QualityConfig:
    """What to measure. ``windows``: grid windows over the slice, each of ``tokens`` scored
    tokens after ``warmup`` unscored ones; ``long``: scored tokens of the long run (0 =
    none), at ``long_budget`` with ``long_policy`` (and, up to the positions, with each of
    ``long_baselines``, and with ``long_recall`` with the long policy and recall on);
    ``long_window``: tokens per perplexity window of the long run."""

    model: str = "smollm2"
    dtype: str = option("float32", "the model's precision", choices=tuple(DTYPES))
    device: str = "cpu"
    quick: bool = False
    text: str = option(DEFAULT_TEXT, "topics (Python's help topics), jargon (the Jargon File, "
                       "Debian package jargon-text) or a UTF-8 file")
    slice: str = option("eval", "eval: the text's first half; tune: its second",
                        choices=SLICES)
    at: float = option(0.5, "the tune slice starts F of the way into the text (0.5 <= F < 1)",
                       metavar="F")
    budgets: tuple[int, ...] = option((128, 256, 512), "live cache slots, comma-separated",
                                      quick=(64,))
    policies: tuple[str, ...] = option(SCORERS, "comma-separated scorers", read=flags.scorers)
    repairs: tuple[str, ...] = option(REPAIRS, "comma-separated")
    # cache options of every run (flat name -> value): sinks, recent, scorer fields (each
    # run's scorer takes those it has), recall's (in the runs with recall)
    params: tuple[tuple[str, Any], ...] = option(
        (), "cache parameters of every run, e.g. decay=1,gain=200,sinks=4", metavar="K=V,...",
        read=flags.cache_options, repeat="param")
    recall: tuple[str, ...] = option((), "policies that also run with recall: comma-separated, "
                                     "or the flag alone (or all) for every policy (not given: "
                                     "those of the default scorer among the policies)",
                                     read=flags.recall_policies, bare=True, metavar="LIST")
    windows: int = option(4, "grid windows spread over the slice", quick=2)
    batch: int | None = option(None, "windows stepped B at a time as the rows of a batch, "
                               "a cell's and other cells' together (one stage-1 forward a step "
                               "for all; 1: one after another; " + batch_size.HELP + ")",
                               metavar="B")
    tokens: int = option(512, "scored tokens per grid window", quick=64)
    long: int = option(10240, "scored tokens of the run past the model's positions (0 = none)",
                       quick=0)
    long_budget: int = 512
    long_policy: str = "brightness"
    long_baselines: tuple[str, ...] = field(default=("streaming", "h2o"),
                                            metadata={"quick": ("streaming",)})
    long_repair: str = "none"
    long_recall: bool = True  # the long policy with recall too (positions keep)
    long_window: int = field(default=512, metadata={"quick": 128})

    def __post_init__(self) -> None:
        require(self.slice in SLICES,
                f"slice must be one of {', '.join(SLICES)}, got {self.slice!r}")
        require(0.5 <= self.at < 1 and (self.slice == "tune" or self.at == 0.5),
                f"--at places the tune slice in the text's second half (0.5 <= at < 1), "
                f"got {self.at} with slice {self.slice}")
        require(len(self.budgets) > 0 and all(b >= 1 for b in self.budgets),
                f"budgets must be >= 1, got {self.budgets}")
        require(tuple(sorted(set(self.budgets))) == self.budgets,
                f"budgets must be increasing, got {self.budgets}")
        bad = [p for p in flags.scorer_names(self.policies + self.recall_policies + (
                   self.long_policy, *self.long_baselines))
               if not culling(p)]
        require(not bad and len(self.policies) > 0, f"unknown or non-culling policies {bad}; "
                f"expected some of {', '.join(CULLING)} (the oracle runs at every budget)")
        require(all(r in REPAIRS for r in self.repairs + (self.long_repair,)),
                f"repairs must be among {REPAIRS}")
        require(self.windows >= 1, f"windows must be >= 1, got {self.windows}")
        require(self.batch is None or self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        require(self.tokens >= 2, f"tokens must be >= 2, got {self.tokens}")
        require(self.long >= 0 and self.long_window >= 1,
                "long must be >= 0 and long_window >= 1")
        options.check_shared(dict(self.params), flags.scorer_names(self.policies))
        for b in self.budgets:  # fail early: too small for the protections
            self.cache(b, self.policies[0])
        for p in self.policies[1:]:  # and each scorer built (your own: its file and fields)
            self.cache(self.budgets[0], p)
        for r in self.repairs:  # each piece with the options given for it
            self.cache(self.budgets[-1], self.policies[0], r)
        for p in self.recall_policies:
            self.cache(self.budgets[-1], p, DEFAULT.repair_name, recall=True)

    @classmethod
    def preset(cls, quick: bool, **kw) -> "QualityConfig":
        """The config, with each field's ``quick`` value (its metadata) for ``--quick``."""
        return flags.preset(cls, quick, **kw)

    @property
    def warmup(self) -> int:
        """Unscored steps that open each grid window: the largest budget + 1, so that at
        every budget the first scored token's step runs over a cache that has culled."""
        return self.budgets[-1] + 1

    @property
    def recall_policies(self) -> tuple[str, ...]:
        """The grid's policies that run with recall too: ``recall``'s, every policy (``all``),
        or where none are given those of the default scorer, whole tokens or per head
        (``brightness``, ``brightness@head``)."""
        if self.recall == (flags.EVERY,):
            return self.policies
        return self.recall or tuple(p for p in self.policies
                                    if flags.cell_policy(p)["policy"] == DEFAULT.scorer.name)

    def fitted(self, max_positions: int) -> "QualityConfig":
        """What the model's positions allow: budgets below half of them, grid windows (and
        their full cache) within them, perplexity windows that split the long run's halves."""
        budgets = tuple(b for b in self.budgets if b <= max_positions // 2)
        require(budgets, f"the model's {max_positions} positions fit none of the budgets "
                f"{self.budgets} (each must be <= half of them)")
        fit = dataclasses.replace(self, budgets=budgets,
                                  long_budget=min(self.long_budget, budgets[-1]),
                                  long_window=min(self.long_window, max_positions // 4))
        return dataclasses.replace(fit, tokens=min(self.tokens, max_positions - fit.warmup))

    def cache(self, budget: int | None, policy: str, repair: str = "none",
              positions: str = "compact", recall: bool = False) -> CacheParams:
        if budget is None:
            return CacheParams(scorer="none")
        if policy == ORACLE:  # built by the benchmark, not from options
            return dataclasses.replace(self.cache(budget, DEFAULT.scorer.name, repair,
                                                  positions, recall), scorer=ScorerSpec(ORACLE))
        return options.cache_params({**dict(self.params), "budget": budget,
                                     **flags.cell_policy(policy), "repair": repair,
                                     "positions": positions, "recall": recall}, strict=False)


# --- the text -------------------------------------------------------------------------------

def default_text() -> str:
    """Python's English help topics, concatenated in sorted-key order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def jargon_text() -> str:
    """The Jargon File as Debian's ``jargon-text`` ships it: plain UTF-8 text, gzipped."""
    try:
        return gzip.decompress(JARGON.read_bytes()).decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"--text jargon needs the Debian package jargon-text (apt-get install "
                        f"jargon-text): no {JARGON}") from None


def read_text(source: str) -> str:
    """A named text (``TEXTS``) or a UTF-8 file."""
    if source in TEXTS:
        return default_text() if source == "topics" else jargon_text()
    try:
        return Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--text {source!r}: no such file (or a name: "
                        f"{', '.join(TEXTS)})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text {source!r}: cannot read it as UTF-8 ({e})") from None


def section(cfg: QualityConfig) -> str:
    """The report's section in the shared document: ``quality``, ``quality-tune``,
    ``quality-jargon``, ``quality-jargon-tune``, ...: one text or slice never replaces
    another."""
    text = "" if cfg.text == DEFAULT_TEXT else "-" + re.sub(
        r"[^A-Za-z0-9_.]+", "_", cfg.text if cfg.text in TEXTS else Path(cfg.text).stem)
    return f"quality{text}" + ("-tune" if cfg.slice == "tune" else "")


def slice_range(n_tokens: int, which: str, at: float = 0.5) -> range:
    """The token indices of the ``eval`` slice (the text's first half) or the ``tune`` one
    (from ``at`` of the way to the end): the two never overlap."""
    return range(0, n_tokens // 2) if which == "eval" else range(int(n_tokens * at), n_tokens)


def window_starts(room: range, span: int, count: int) -> tuple[int, ...]:
    """The first token of ``count`` windows of ``span`` tokens spread evenly over ``room``:
    the first at its start, the last ending at its end, none overlapping another."""
    require(count * span <= len(room), f"the slice holds {len(room)} tokens, {count} "
            f"window(s) of {span} need {count * span} (use a longer --text, fewer --windows "
            "or fewer --tokens)")
    return tuple(room.start + k * (len(room) - span) // max(count - 1, 1) for k in range(count))


# --- measurement ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Streamed:
    """One streaming run: the NLL of every scored token, in text order; ``totals`` over the
    scored steps, ``warm`` over the unscored ones before them."""

    nll: tuple[float, ...]
    stop_reason: str
    totals: Totals
    warm: Totals = field(default_factory=Totals)
    oracle: Oracle | None = field(default=None, compare=False, repr=False)  # ``record``'s

    @property
    def ppl(self) -> float:
        return perplexity(self.nll)


@dataclass(frozen=True)
class Measured:
    """One job's measurement (an item of its ``--resume`` journal), one entry per start:
    the scored tokens' NLLs, why the run stopped, its tallies over the scored steps (the
    fields of ``Totals``) and what its warm-up removed (culls and merges)."""

    nll: list[list[float]]
    stop_reason: list[str]
    steps: list[int]
    ms: list[float]
    culled: list[int]
    merged: list[int]
    folded: list[int]
    reindexed: list[int]
    recalled: list[int]
    warm_removed: list[int]

    @classmethod
    def of(cls, runs: list[Streamed]) -> "Measured":
        return cls([list(s.nll) for s in runs], [s.stop_reason for s in runs],
                   **{f.name: [getattr(s.totals, f.name) for s in runs]
                      for f in dataclasses.fields(Totals)},
                   warm_removed=[s.warm.culled + s.warm.merged for s in runs])

    @property
    def totals(self) -> Totals:
        """The tallies over every start's scored steps."""
        return Totals(**{f.name: sum(getattr(self, f.name)) for f in dataclasses.fields(Totals)})


ROW = Measured  # a job's row in the journal


def perplexity(nll) -> float:
    return math.exp(sum(nll) / len(nll))


@dataclass(frozen=True)
class Span:
    """Perplexity over scored tokens ``start`` to ``end`` (exclusive) of a long run."""

    start: int
    end: int
    ppl: float


def windows(nll, size: int) -> list[Span]:
    """Perplexity over consecutive windows of ``size`` scored tokens."""
    return [Span(i, min(i + size, len(nll)), perplexity(nll[i:i + size]))
            for i in range(0, len(nll), size)]


def streaming_nll(model: Model, policy: TokenPolicy, ids: list[int], cache: CacheParams,
                  tick=None, record: int = 0, oracle: Oracle | None = None,
                  skip: int = 0) -> Streamed:
    """Prime ``ids[0]``, then one step per following token through ``Session.step``, each
    forced to the text's next token; the NLL of ``ids[t]`` comes from the step that ran
    ``ids[t-1]``. The first ``skip`` steps are a warm-up, not scored. Without a budget the
    arena holds the whole text (within the positions); with ``positions=keep`` the run
    stops at the model's positions. ``record`` (full cache only): the first ``record``
    queries' attention becomes ``Streamed.oracle``; ``oracle``: the scorer of a run with
    scorer ``oracle``, from such a run over the same ``ids``."""
    return streaming_rows(model, policy, [Stream(ids, cache, oracle, record, tick)], skip)[0]


@dataclass(frozen=True)
class Stream:
    """One row of ``streaming_rows``: its text, cache, oracle and recording
    (``streaming_nll``'s), and ``tick``, told of each of its steps."""

    ids: list[int]
    cache: CacheParams
    oracle: Oracle | None = None
    record: int = 0
    tick: Any = None


def streaming_rows(model: Model, policy: TokenPolicy, streams: list[Stream], skip: int = 0,
                   batch: int = 1) -> list[Streamed]:
    """``streaming_nll`` of each of ``streams`` (texts as long as each other, each with a
    cache of its own), ``batch`` at a time as the rows of a batch (``batch.drive_rows``;
    one stream steps alone)."""
    require(all(len(r.ids) == len(streams[0].ids) for r in streams),
            "the rows of a batch stream texts of one length")
    require(len(streams[0].ids) >= skip + 2,
            "streaming perplexity needs at least 2 tokens past the warm-up")
    for r in streams:
        require(not r.record or r.cache.budget is None, "only a full-cache run records the "
                "oracle")
        require((r.oracle is not None) == (r.cache.scorer.name == ORACLE),
                "an oracle run needs the full-cache run's oracle, and only it takes one")
    recorders = [AttentionRecorder(r.record, read_like_scorer(r.cache, "aggregate"), r.ids)
                 if r.record else None for r in streams]
    nll, totals, warm = ([[] for _ in streams], [Totals() for _ in streams],
                         [Totals() for _ in streams])
    sessions: list[Session | None] = [None] * len(streams)

    def primed():  # each text's session, made as its place frees
        for b, (r, recorder) in enumerate(zip(streams, recorders)):
            sessions[b] = Session(model, policy, SamplerParams(greedy=True), r.cache,
                                  scorer=recorder or r.oracle)
            sessions[b].prime([Segment((r.ids[0],), "user")],
                              arena_capacity(model, r.cache, 1, len(r.ids) - 1))
            yield b, sessions[b]

    def stepped(b: int, rec) -> None:
        if warm[b].steps < skip:
            warm[b].add(rec)
        else:
            nll[b].append(-rec.logprob)
            totals[b].add(rec)
        if streams[b].tick:
            streams[b].tick()

    drive_rows(model, primed(), batch if len(streams) > 1 else 1, len(streams[0].ids) - 1,
               ignore_eos=True, force=lambda b, k: streams[b].ids[k + 1], on_step=stepped)
    out = []
    for b, (s, recorder) in enumerate(zip(sessions, recorders)):
        s.state.check_valid()
        require(not recorder or warm[b].steps + len(nll[b]) >= streams[b].record,
                f"the full cache ran {warm[b].steps + len(nll[b])} steps, the oracle needs "
                f"{streams[b].record}")
        out.append(Streamed(tuple(nll[b]), s.stop_reason, totals[b], warm[b],
                            recorder.oracle() if recorder else None))
    return out


@dataclass(frozen=True)
class Job:
    """One cell: ``cache`` streamed from each of ``starts`` (text indices), ``skip`` unscored
    steps then ``tokens - skip`` scored ones; ``steps``: how many it can run per start
    (``keep`` stops at the model's positions); ``record``: the full cache that records each
    window's attention for the oracle runs."""

    kind: str  # reference | grid | oracle | long-reference | long | control
    label: str
    cache: CacheParams
    tokens: int
    steps: int
    starts: tuple[int, ...] = (0,)
    skip: int = 0
    record: bool = False

    def streams(self, ids: list[int], tick=None,
                oracles: tuple[Oracle, ...] | None = None) -> list[Stream]:
        """One row a start; ``oracles``: the recording job's, one a start."""
        oracles = oracles or (None,) * len(self.starts)
        return [Stream(ids[s:s + self.tokens + 1], self.cache, o,
                       self.tokens if self.record else 0, tick)
                for s, o in zip(self.starts, oracles)]

    def run(self, model: Model, policy: TokenPolicy, ids: list[int], tick=None,
            oracles: tuple[Oracle, ...] | None = None, batch: int = 1) -> list[Streamed]:
        """One ``Streamed`` per start; ``oracles``: the recording job's, one per start;
        ``batch``: the starts run that many at a time as a batch's rows."""
        return run_jobs(model, policy, ids, [self], [tick], oracles, batch)[0]


def run_jobs(model: Model, policy: TokenPolicy, ids: list[int], jobs: list[Job], ticks: list,
             oracles: tuple[Oracle, ...] | None = None, batch: int = 1) -> list[list[Streamed]]:
    """Every start of each of ``jobs`` (one ``pack``: the same length and warm-up) as the
    rows of one batch, ``batch`` at a time; ``ticks``: one a job; ``oracles`` for the
    oracle jobs among them. Each job's ``Streamed``s, one a start."""
    streams = [r for j, t in zip(jobs, ticks)
               for r in j.streams(ids, t, oracles if j.kind == "oracle" else None)]
    runs = iter(streaming_rows(model, policy, streams, jobs[0].skip, batch))
    return [[next(runs) for _ in j.starts] for j in jobs]


def packs(jobs: list[Job], batch: int, workers: int = 1) -> list[list[int]]:
    """``jobs`` (their indices, in order) in groups each run as one batch (``run_jobs``):
    jobs of one length and warm-up, their starts together at most ``batch`` rows, and at
    most as many as keep ``workers`` processes busy (the rows of that length over the
    workers, rounded up); a job with more starts is a group of its own and runs that many
    of them at a time."""
    key = lambda j: (j.tokens, j.skip)  # noqa: E731
    rows: dict[tuple[int, int], int] = {}
    for j in jobs:
        rows[key(j)] = rows.get(key(j), 0) + len(j.starts)
    most = {k: max(1, min(batch, -(-n // workers))) for k, n in rows.items()}
    out: list[list[int]] = []
    filling: dict[tuple[int, int], list[int]] = {}
    size: dict[tuple[int, int], int] = {}  # the filling group's starts
    for i, j in enumerate(jobs):
        k = key(j)
        if k not in filling or size[k] + len(j.starts) > most[k]:
            filling[k], size[k] = [], 0
            out.append(filling[k])
        filling[k].append(i)
        size[k] += len(j.starts)
    return out


def plan(cfg: QualityConfig, limit: int, room: range) -> list[Job]:
    """The grid over the windows (the full cache, which records each window's attention for
    the oracle runs, every scorer x budget x repair, the default policy with recall, the
    oracle), then the long runs from the slice's start: the full cache up to the positions,
    the long policy and baselines, and the control, which scores the last ``limit / 2``
    tokens of the long run from ``long - limit / 2``. The long run has no oracle (no full
    cache goes past the positions)."""
    span, w = cfg.warmup + cfg.tokens, cfg.warmup
    starts = window_starts(room, span + 1, cfg.windows)
    grid = lambda kind, label, cache, record=False: Job(  # noqa: E731
        kind, label, cache, span, span, starts, w, record)
    jobs = [grid("reference", "full cache", cfg.cache(None, "none"), record=True)]
    jobs += [grid("grid", f"{p} budget {b}, {r} repair", cfg.cache(b, p, r))
             for b in cfg.budgets for p in cfg.policies for r in cfg.repairs]
    repair = DEFAULT.repair_name  # recall keeps culled tokens whole: no fold, no merge
    jobs += [grid("grid", f"{p} with recall budget {b}, {repair} repair",
                  cfg.cache(b, p, repair, recall=True))
             for p in cfg.recall_policies for b in cfg.budgets]
    jobs += [grid("oracle", f"oracle budget {b}", cfg.cache(b, ORACLE)) for b in cfg.budgets]
    return jobs + long_plan(cfg, limit, room)


def long_plan(cfg: QualityConfig, limit: int, room: range) -> list[Job]:
    """The long run's jobs (none without ``long``), from the slice's start."""
    if not cfg.long:
        return []
    require(cfg.long + 1 <= len(room), f"the slice holds {len(room)} tokens, the long run "
            f"needs {cfg.long + 1} (use a longer --text or a smaller --long)")
    long = lambda p, positions, recall=False: cfg.cache(  # noqa: E731
        cfg.long_budget, p, cfg.long_repair, positions, recall)
    at, ref = (room.start,), min(cfg.long, limit)
    jobs = [Job("long-reference", "long run, full cache", cfg.cache(None, "none"), ref, ref, at),
            Job("long", f"long run, {cfg.long_policy}, positions compact",
                long(cfg.long_policy, "compact"), cfg.long, cfg.long, at)]
    jobs += [Job("long", f"long run, {p}, positions keep", long(p, "keep"), cfg.long, ref, at)
             for p in (cfg.long_policy, *cfg.long_baselines)]
    if cfg.long_recall:
        jobs.append(Job("long", f"long run, {cfg.long_policy} with recall, positions keep",
                        long(cfg.long_policy, "keep", True), cfg.long, ref, at))
    if cfg.long > limit:
        n = limit // 2
        jobs.append(Job("control", f"control, from token {cfg.long - n}",
                        long(cfg.long_policy, "compact"), n, n, (room.start + cfg.long - n,)))
    return jobs


_WORKER: dict = {}  # a pool worker's model, policy, ids and tick queue


def _init_worker(model: str, dtype: str, device: str, ids: list[int], queue,
                 batch: int = 1) -> None:
    import torch

    grid.end_with_parent()
    torch.set_num_threads(1)  # one thread per worker: parallel runs, not parallel matmuls
    m = grid.load(model, dtype, device)
    _WORKER.update(model=m, policy=TokenPolicy(m.tokenizer), ids=ids, queue=queue,
                   batch=batch)


def _run_pack(pack: list[int], jobs: list[Job],
              oracles: tuple[Oracle, ...] | None = None) -> list[list[Streamed]]:
    w = _WORKER

    def ticker(i: int):
        count = [0]

        def tick() -> None:  # every 16 tokens: the queue is shared by every worker
            count[0] += 1
            if count[0] % 16 == 0:
                w["queue"].put((i, 16))
        return tick

    return run_jobs(w["model"], w["policy"], w["ids"], jobs, [ticker(i) for i in pack],
                    oracles, w["batch"])


def _oracles(runs: list[Streamed]) -> tuple[Oracle, ...]:
    """The oracles the recording job recorded, one per window."""
    return tuple(s.oracle for s in runs)


def _given_ids(ids: list[int], _cfg: QualityConfig) -> list[int]:
    """A Ray worker's copy of the text's tokens (``grid.WORKER["grid"]``): the driver's,
    whatever folder and files the worker's node has."""
    return ids


def _ray_pack(item: tuple[list[Job], tuple[Oracle, ...] | None]) -> list[list[Streamed]]:
    w = grid.WORKER
    return run_jobs(w["model"], w["policy"], w["grid"], item[0], [None] * len(item[0]),
                    item[1], w["cfg"].batch or 1)


def _phases(cfg: QualityConfig, jobs: list[Job],
            pool: Pool = Pool()) -> tuple[list[list[int]], list[list[int]]]:
    """``jobs``' packs (``packs``, each a list of job indices, spread over ``pool``'s
    processes): those that run first, then the oracle jobs', which wait for the full cache
    that records their oracles."""
    spread = (pool.jobs or 1) if pool.ray is not None or pool.jobs != 1 else 1
    first = [i for i, j in enumerate(jobs) if j.kind != "oracle"]
    later = [i for i, j in enumerate(jobs) if j.kind == "oracle"]
    group = lambda idx: [[idx[k] for k in p] for p in packs(  # noqa: E731
        [jobs[i] for i in idx], cfg.batch or 1, spread)]
    return group(first), group(later)


def _on_ray(cfg: QualityConfig, jobs: list[Job], ids: list[int], pool: Pool, phases: tuple,
            ticks: list, finished) -> list[list[Streamed]]:
    """``execute`` on the Ray cluster of ``pool``: the ``phases``' first packs, then the
    oracle jobs' packs."""
    results: list = [None] * len(jobs)
    first, later = phases

    def done(pack: list[int], runs: list[list[Streamed]]) -> None:
        for i, r in zip(pack, runs):
            results[i] = r
            finished(i, r)
            for _ in range(jobs[i].steps * len(jobs[i].starts)):
                ticks[i]()

    given = functools.partial(_given_ids, ids)

    def phase(groups: list[list[int]], oracles) -> None:
        grid.on_ray(pool.ray, pool.jobs, [(k, ([jobs[i] for i in p], oracles))
                                          for k, p in enumerate(groups)],
                    _ray_pack, cfg, given, lambda k, runs: done(groups[k], runs))

    phase(first, None)
    if later:
        phase(later, _oracles(next(results[i] for p in first for i in p if jobs[i].record)))
    return results


def execute(cfg: QualityConfig, jobs: list[Job], ids: list[int], pool: Pool,
            finished=None) -> list[list[Streamed]]:
    """Run ``jobs`` (over the text ``ids``) with a progress bar each, ``cfg.batch`` rows (a
    job's starts, and the jobs of one ``pack`` together; None, as ``run`` has not chosen
    one: 1) a step: here (``pool.jobs`` = 1),
    in that many single-thread processes (each loads the model once) or on the Ray cluster
    of ``pool``. Oracle jobs start once the full cache that records their oracles is done.
    ``finished(i, runs)``: job ``i``'s runs, as it finishes."""
    first, later = _phases(cfg, jobs, pool)
    rec = next((i for p in first for i in p if jobs[i].record), None) if later else None
    require(not later or rec is not None, "the oracle runs need the full cache's recording")
    results: list = [None] * len(jobs)
    finished = finished or (lambda i, runs: None)
    workers = dataclasses.replace(pool, journal=None).workers(len(first) + len(later))
    with common.progress() as task:
        ticks = [task(j.label, j.steps * len(j.starts)) for j in jobs]
        if pool.ray is not None:
            return _on_ray(cfg, jobs, ids, pool, (first, later), ticks, finished)

        def done(pack: list[int], runs: list[list[Streamed]]) -> None:
            for i, r in zip(pack, runs):
                results[i] = r
                finished(i, r)

        if workers == 1:
            model = grid.load(cfg.model, cfg.dtype, cfg.device)
            policy = TokenPolicy(model.tokenizer)
            for k, p in enumerate(first + later):
                done(p, run_jobs(model, policy, ids, [jobs[i] for i in p],
                                 [ticks[i] for i in p],
                                 _oracles(results[rec]) if k >= len(first) else None,
                                 cfg.batch or 1))
            return results
        return _on_processes(cfg, jobs, ids, workers, (first, later, rec), ticks, done)


def _on_processes(cfg: QualityConfig, jobs: list[Job], ids: list[int], workers: int,
                  phases: tuple, ticks: list, done) -> list[list[Streamed]]:
    """``execute`` in ``workers`` local processes: the first packs, then (once the
    recording job ``rec`` is done) the oracle jobs' packs."""
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import ProcessPoolExecutor

    first, later, rec = phases
    results: list = [None] * len(jobs)

    def landed(p: list[int], runs: list[list[Streamed]]) -> None:
        for i, r in zip(p, runs):
            results[i] = r
        done(p, runs)

    ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
    q = ctx.Queue()
    with ProcessPoolExecutor(workers, ctx, _init_worker,
                             (cfg.model, cfg.dtype, cfg.device, ids, q, cfg.batch or 1)) as pool:
        futures = {k: pool.submit(_run_pack, p, [jobs[i] for i in p])
                   for k, p in enumerate(first)}
        groups, got = first + later, set()
        while len(got) < len(groups):
            for k, f in list(futures.items()):
                if k not in got and f.done():
                    got.add(k)
                    landed(groups[k], f.result())  # a worker's error now, not at the end
            if len(futures) < len(groups) and rec is not None and results[rec] is not None:
                oracles = _oracles(results[rec])
                futures.update({len(first) + k: pool.submit(_run_pack, p,
                                                            [jobs[i] for i in p], oracles)
                                for k, p in enumerate(later)})
            try:
                i, n = q.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            for _ in range(n):
                ticks[i]()
    return results


def measure(cfg: QualityConfig, jobs: list[Job], ids: list[int],
            pool: Pool = Pool()) -> list[Measured]:
    """Each job's measurement: the ``journal``'s where it holds it, else measured (longest
    first: they pack best into the workers) and added to it as it finishes. While an
    oracle job is left, the full cache that records the oracles is measured again (the
    journal does not keep its recordings)."""
    journal = pool.journal
    done = dict(journal.done) if journal is not None else {}
    if any(j.kind == "oracle" and i not in done for i, j in enumerate(jobs)):
        done = {i: m for i, m in done.items() if not jobs[i].record}
    cost = [j.steps * len(j.starts) * (2 if j.cache.repair_name == "merge" else 1) for j in jobs]
    order = sorted((i for i in range(len(jobs)) if i not in done), key=lambda i: -cost[i])

    def finished(k: int, runs: list[Streamed]) -> None:
        done[order[k]] = Measured.of(runs)
        if journal is not None:
            journal.add(order[k], done[order[k]])

    if order:
        execute(cfg, [jobs[i] for i in order], ids, pool, finished)
    return [done[i] for i in range(len(jobs))]


@dataclass(frozen=True)
class Tally:
    """A run's perplexity over its scored tokens and its counts over the scored steps."""

    policy: str
    repair: str
    budget: int | None
    recall: bool
    positions: str
    ppl: float
    scored: int
    stop_reason: str
    culled: int
    merged: int
    folded: int
    reindexed: int
    recalled: int
    ms_per_token: float


@dataclass(frozen=True)
class Window:
    """One grid window of a run: its first streamed and first scored token, its perplexity
    and what its warm-up removed."""

    start: int
    first_scored: int
    scored: int
    ppl: float
    warm_removed: int


@dataclass(frozen=True)
class Run(Tally):
    """A grid cell (the full cache, a policy x budget x repair, recall, the oracle): its
    perplexity over every window's scored tokens, and each window's own."""

    by_window: tuple[Window, ...]


@dataclass(frozen=True)
class LongRun(Tally):
    """A run of the long part, with its perplexity per ``long_window`` scored tokens."""

    windows: tuple[Span, ...]


@dataclass(frozen=True)
class Control(Run):
    """The control run against the compact long run over the same tokens past the
    positions: it starts at the slice's token ``start``; ``tokens``: the tokens past the
    positions (from the slice's start, end exclusive), ``positions_scored``: its scored
    tokens that they are; their perplexity in the control (``ppl_past``) and in the
    compact long run (``ppl_compact``)."""

    start: int
    tokens: tuple[int, int]
    positions_scored: tuple[int, int]
    ppl_past: float
    ppl_compact: float


@dataclass(frozen=True)
class Text:
    """The text measured: its source, size and hash, the slice and the grid windows' starts."""

    source: str
    about: str
    chars: int
    tokens: int
    sha256: str
    slice: str
    offset: int
    end: int
    windows: tuple[int, ...]


@dataclass(kw_only=True)
class QualityResult(Result):
    """A run: its config (fitted to the model's positions), the cache options every run
    starts from (``base``), the unscored steps that open each grid window (``warmup``),
    the text, the grid's runs (the full cache, the policies, the oracle) and the long
    part's (none without ``long``)."""

    config: QualityConfig
    base: dict
    warmup: int
    dtype: str
    max_positions: int
    workers: int
    kv: KVCost
    ray: str | None = None
    text: Text
    reference: Run
    runs: list[Run]
    oracle: list[Run]
    long_reference: LongRun | None = None
    long: list[LongRun] = field(default_factory=list)
    control: Control | None = None


def _tally(job: Job, m: Measured) -> dict:
    """A job's perplexity over every start's scored tokens, and its counts over the scored
    steps."""
    nll, t, c = [x for n in m.nll for x in n], m.totals, job.cache
    return {"policy": flags.policy_label(c), "repair": c.repair_name, "budget": c.budget,
            "recall": c.recall is not None, "positions": c.positions.mode,
            "ppl": perplexity(nll), "scored": len(nll),
            "stop_reason": ", ".join(sorted(set(m.stop_reason))), "culled": t.culled,
            "merged": t.merged, "folded": t.folded, "reindexed": t.reindexed,
            "recalled": t.recalled, "ms_per_token": t.ms_per_token}


def _run(job: Job, m: Measured, cls=Run, **more) -> Run:
    """A grid cell's row (``cls``, with ``more`` of its fields)."""
    return cls(**_tally(job, m), **more, by_window=tuple(
        Window(a, a + job.skip + 1, len(n), perplexity(n), w)
        for a, n, w in zip(job.starts, m.nll, m.warm_removed)))


def _long_row(cfg: QualityConfig, job: Job, m: Measured) -> LongRun:
    """A long run's row (one stream)."""
    return LongRun(**_tally(job, m), windows=tuple(windows(m.nll[0], cfg.long_window)))


def _control(done: list[tuple[Job, Measured]], limit: int, offset: int) -> Control | None:
    """The control run against the compact long run over the same tokens past the positions
    (token numbers from the slice's start)."""
    j, m = next(((j, m) for j, m in done if j.kind == "control"), (None, None))
    if j is None:
        return None
    start, nll = j.starts[0] - offset, m.nll[0]
    compact = next(c.nll[0] for k, c in done
                   if k.kind == "long" and k.cache.positions.mode == "compact")
    # scored token i of a run from ``start`` is the slice's token start + 1 + i
    lo, hi = limit - start, len(nll)
    return _run(j, m, Control, start=start, tokens=(limit + 1, start + hi + 1),
                positions_scored=(lo, hi), ppl_past=perplexity(nll[lo:hi]),
                ppl_compact=perplexity(compact[limit:start + hi]))


def run(cfg: QualityConfig, command: str, pool: Pool = Pool()) -> QualityResult:
    """Every measurement, the runs measured by ``pool`` (the jobs its journal holds kept,
    not measured again)."""
    t0 = time.perf_counter()
    text = read_text(cfg.text)
    machine = Machine.now()
    model = grid.load(cfg.model, cfg.dtype, cfg.device, note=True)
    limit = model.spec.max_positions
    cfg = cfg.fitted(limit)
    all_ids = TokenPolicy(model.tokenizer).encode(text)
    kv, stage1 = KVCost.of(model), model.stage1_path
    room = slice_range(len(all_ids), cfg.slice, cfg.at)
    jobs = plan(cfg, limit, room)
    cfg, choice = pool.batch(cfg, model, len(jobs), [(j.tokens + 1, j.cache.recall is not None)
                                                     for j in jobs for _ in j.starts])
    del model
    workers = pool.workers(len(jobs))  # at most one a pack of jobs here
    workers = workers if pool.ray is not None else min(workers,
                                                        sum(map(len, _phases(cfg, jobs, pool))))
    done = list(zip(jobs, measure(cfg, jobs, all_ids, pool)))
    rows = {kind: [_run(j, m) for j, m in done if j.kind == kind]
            for kind in ("reference", "grid", "oracle")}
    res = QualityResult(
        benchmark="quality", command=command, model=cfg.model, quick=cfg.quick,
        machine=machine, config=cfg, base=options.settings(dict(cfg.params)),
        warmup=cfg.warmup, dtype=cfg.dtype, max_positions=limit,
        workers=workers, kv=kv, ray=pool.ray, batch_choice=choice, stage1=stage1,
        text=Text(cfg.text, TEXTS.get(cfg.text, "a file"), len(text), len(all_ids),
                  hashlib.sha256(text.encode()).hexdigest()[:16], cfg.slice, room.start,
                  room.stop, jobs[0].starts),
        reference=rows["reference"][0], runs=rows["grid"], oracle=rows["oracle"],
        long_reference=next((_long_row(cfg, j, m) for j, m in done
                             if j.kind == "long-reference"), None),
        long=[_long_row(cfg, j, m) for j, m in done if j.kind == "long"],
        control=_control(done, limit, room.start))
    res.targets = targets(res)
    res.machine = machine.ended()
    res.elapsed_s = time.perf_counter() - t0
    return res


# --- analysis -------------------------------------------------------------------------------

def best(runs: list[Run], budget: int, policies) -> Run | None:
    """The lowest-perplexity drop-only run (no recall) at ``budget`` among ``policies`` (any
    repair setting)."""
    rows = [r for r in runs if r.budget == budget and r.policy in policies and not r.recall]
    return min(rows, key=lambda r: r.ppl) if rows else None


def with_recall(res: QualityResult, budget: int) -> Run | None:
    """The grid's run of the default policy (whole tokens) with recall at ``budget``, if any."""
    return next((r for r in res.runs if r.recall and r.budget == budget
                 and r.policy == DEFAULT.scorer.name), None)


def _label(r: Tally) -> str:
    return f"{r.policy}{' with recall' if r.recall else ''} ({r.repair} repair)"


def gap(res: QualityResult, budget: int) -> tuple[Run, Run] | None:
    """(the best baseline run, the oracle run) at ``budget``, if the oracle beats it."""
    base = best(res.runs, budget, BASELINES)
    oracle = next((r for r in res.oracle if r.budget == budget), None)
    return (base, oracle) if base and oracle and oracle.ppl < base.ppl else None


def gap_closed(res: QualityResult, run: Run) -> float | None:
    """The fraction of the gap between the best baseline and the oracle at the run's budget
    that the run closes: (ppl(best baseline) - ppl(run)) / (ppl(best baseline) - ppl(oracle));
    0 = no better than the best baseline, 1 = as good as the oracle. None without a gap."""
    g = gap(res, run.budget)
    return None if g is None else (g[0].ppl - run.ppl) / (g[0].ppl - g[1].ppl)


def long_flatness(res: QualityResult) -> dict | None:
    """Compact long run: perplexity of the window ending at half the positions vs the worst
    window wholly past the positions (different text: the control run compares the same)."""
    compact = next((r for r in res.long if r.positions == "compact"), None)
    if compact is None:
        return None
    half, limit = res.max_positions // 2, res.max_positions
    # Window i scores the tokens at steps start+1..end, which run at positions start..end-1.
    at_half = next((w for w in compact.windows if w.start < half <= w.end), None)
    past = [w for w in compact.windows if w.start >= limit]
    if at_half is None or not past:
        return None
    worst = max(past, key=lambda w: w.ppl)
    return {"half": half, "limit": limit, "ppl_half": at_half.ppl, "window_half": at_half,
            "ppl_past": worst.ppl, "window_past": worst, "ratio": worst.ppl / at_half.ppl}


def _target(what: str, value: float | None, target: float | None,
            at_most: bool = True) -> Target:
    """A target row; ``met`` is None without a value or a target."""
    met = None if value is None or target is None else (
        value <= target if at_most else value >= target)
    return Target(what, value, "–" if target is None
                  else f"{'<=' if at_most else '>='} {target:.2f}", met)


def _grid_targets(res: QualityResult) -> list[Target]:
    """Per budget: brightness (drop-only, its best repair) / the best baseline; the default
    policy with recall / the best baseline; the share of the baseline -> oracle gap the
    default policy with recall closes; the oracle / the best baseline."""
    out = []
    for b in res.config.budgets:
        base, rec = best(res.runs, b, BASELINES), with_recall(res, b)
        ours = best(res.runs, b, ("brightness",))
        if not base:
            continue
        vs = f"the best baseline, {_label(base)[:-1]}, {base.ppl:.3f})"
        if ours:
            out.append(_target(f"budget {b}: brightness ({ours.repair} repair, "
                               f"{ours.ppl:.3f}) / {vs}", ours.ppl / base.ppl, 1.0))
        if rec:
            out.append(_target(f"budget {b}: {_label(rec)[:-1]}, {rec.ppl:.3f}) / {vs}",
                               rec.ppl / base.ppl,
                               GRID_RECALL_TARGET if b in GRID_RECALL_BUDGETS else None))
            out.append(_gap_target(res, rec))
        oracle = next((r for r in res.oracle if r.budget == b), None)
        if oracle:  # the yardstick of the rows above (no strict bound), with no target
            out.append(_target(f"budget {b}: the hindsight oracle ({oracle.ppl:.3f}) / {vs}",
                               oracle.ppl / base.ppl, None))
    return out


def _gap_target(res: QualityResult, run: Run) -> Target:
    b, g = run.budget, gap(res, run.budget)
    what = f"budget {b}: {_label(run)[:-1]}, {run.ppl:.3f}) closes this fraction of the gap "
    if g is None:
        return _target(what + "between the best baseline and the oracle: the oracle does not "
                       "beat the best baseline, no gap", None, GAP_TARGET, at_most=False)
    return _target(what + f"between the best baseline, {_label(g[0])[:-1]}, {g[0].ppl:.3f}) "
                   f"and the oracle ({g[1].ppl:.3f})", gap_closed(res, run), GAP_TARGET,
                   at_most=False)


def per_head(policy: str) -> bool:
    """Whether a grid's policy (``NAME@ALLOCATION``) keeps tokens per (layer, KV head)."""
    return flags.cell_policy(policy).get("allocation", "token") in PER_HEAD


def _head_targets(res: QualityResult) -> list[Target]:
    """Per budget where the grid has both kinds: the best per-head cell / the best
    whole-token cell (any repair, with recall or not; equal K/V memory at one budget), and
    in how many of the windows the per-head cell is the lower."""
    out = []
    for b in res.config.budgets:
        cells = [r for r in res.runs if r.budget == b]
        heads = [r for r in cells if per_head(r.policy)]
        tokens = [r for r in cells if not per_head(r.policy)]
        if not heads or not tokens:
            continue
        h, t = (min(rs, key=lambda r: r.ppl) for rs in (heads, tokens))
        assert [w.start for w in h.by_window] == [w.start for w in t.by_window], \
            "a grid's cells share their windows"
        lower = sum(a.ppl < c.ppl for a, c in zip(h.by_window, t.by_window))
        out.append(_target(f"budget {b}: the best per-head cell, {_label(h)[:-1]}, "
                           f"{h.ppl:.3f}) / the best whole-token cell, {_label(t)[:-1]}, "
                           f"{t.ppl:.3f}); lower in {lower} of {len(h.by_window)} windows",
                           h.ppl / t.ppl,
                           HEADS_TARGET if b in HEADS_TARGET_BUDGETS else None))
    return out


def _full_target(res: QualityResult) -> list[Target]:
    ours, ref = best(res.runs, FULL_TARGET_BUDGET, ("brightness",)), res.reference
    if not ours:
        return []
    return [_target(f"budget {FULL_TARGET_BUDGET}: brightness ({ours.repair} repair, "
                    f"{ours.ppl:.3f}) / the full cache ({ref.ppl:.3f}), {ours.scored} "
                    f"tokens in {len(ours.by_window)} window(s), each after "
                    f"{res.warmup} unscored", ours.ppl / ref.ppl, FULL_TARGET)]


def _long_targets(res: QualityResult) -> list[Target]:
    """The long run over the positions (``keep``): brightness / the best long baseline and /
    the full cache; with recall / the full cache."""
    out, ref = [], res.long_reference
    if not ref:
        return out
    keep = {r.policy: r for r in res.long
            if r.positions == "keep" and not r.recall and r.scored == ref.scored}
    lead, rest = keep.get("brightness"), [r for p, r in keep.items() if p != "brightness"]
    first = f"budget {res.config.long_budget}, the first {ref.scored} tokens: "
    if lead and rest:
        base = min(rest, key=lambda r: r.ppl)
        out.append(_target(first + f"brightness ({lead.ppl:.3f}) / the best long baseline, "
                           f"{base.policy} ({base.ppl:.3f})", lead.ppl / base.ppl, 1.0))
    if lead and lead.budget == FULL_TARGET_BUDGET:
        out.append(_target(first + f"brightness ({lead.ppl:.3f}) / the full cache "
                           f"({ref.ppl:.3f})", lead.ppl / ref.ppl, FULL_TARGET))
    for r in res.long:
        if r.recall and r.scored == ref.scored:
            out.append(_target(first + f"{r.policy} with recall ({r.ppl:.3f}, "
                               f"{r.recalled} recalled) / the full cache ({ref.ppl:.3f})",
                               r.ppl / ref.ppl, RECALL_TARGET))
    return out


def _position_targets(res: QualityResult) -> list[Target]:
    """Compact positions: past the limit vs half of it, and vs the control run."""
    out, flat, c = [], long_flatness(res), res.control
    if flat:
        out.append(_target(f"compact positions: the worst window past {flat['limit']} "
                           f"({flat['ppl_past']:.3f}) / the window at {flat['half']} "
                           f"({flat['ppl_half']:.3f}), different text", flat["ratio"],
                           FLAT_TARGET))
    if c:
        a, z = c.tokens
        out.append(_target(f"compact positions: tokens {a}-{z - 1}, past the positions "
                           f"({c.ppl_compact:.3f}) / the same tokens at positions "
                           f"{c.positions_scored[0]}-{c.positions_scored[1] - 1} "
                           f"(control run from token {c.start}, {c.ppl_past:.3f})",
                           c.ppl_compact / c.ppl_past, FLAT_TARGET))
    return out


def targets(res: QualityResult) -> list[Target]:
    """Every target (``met`` None: no value or no target)."""
    return (_grid_targets(res) + _head_targets(res) + _full_target(res) + _long_targets(res)
            + _position_targets(res))


# --- output ---------------------------------------------------------------------------------

def _name(r: Tally) -> str:
    """``brightness``, ``brightness with recall``: a run's policy as the tables name it."""
    return r.policy + (" with recall" if r.recall else "")


def grid_lines(res: QualityResult) -> list[tuple[str, str, list[Run | None]]]:
    """The grid's lines: (policy, repair, its run at each budget or None), every scorer x
    repair, then the default policy with recall."""
    cells = {(_name(r), r.repair, r.budget): r for r in res.runs}
    keys = [(p, rep) for p in res.config.policies for rep in res.config.repairs]
    keys += sorted({(_name(r), r.repair) for r in res.runs if r.recall})
    return [(p, rep, [cells.get((p, rep, b)) for b in res.config.budgets]) for p, rep in keys]


def _grid_facts(res: QualityResult) -> str:
    return (f"{len(res.text.windows)} window(s) x {res.config.tokens} scored tokens, each "
            f"after {res.warmup} unscored")


def _ppl_table(res: QualityResult) -> Table:
    ref = res.reference.ppl
    cell = lambda r: f"{r.ppl:.3f} ({r.ppl / ref:.3f}x)" if r else "–"  # noqa: E731
    oracle = {r.budget: r for r in res.oracle}
    rows = [(p, rep, *map(cell, rs)) for p, rep, rs in grid_lines(res)]
    rows.append(("oracle (hindsight)", "none", *(cell(oracle.get(b))
                                                 for b in res.config.budgets)))
    return Table(
        f"Streaming perplexity by budget ({_grid_facts(res)}; x = / full cache)",
        ("policy", "repair", *(f"budget {b}" for b in res.config.budgets)), tuple(rows),
        f"Full cache (no budget): {ref:.3f}. Lower is better. The oracle culls the token the "
        "full-cache run's later queries attend to least (it knows the future: a reference "
        "point, not a policy, and no strict bound: a culled cache is attended differently).")


def _gap_table(res: QualityResult) -> Table:
    budgets = res.config.budgets
    bases = [best(res.runs, b, BASELINES) for b in budgets]
    oracle = {r.budget: r.ppl for r in res.oracle}
    ran = ", ".join(p for p in res.config.policies if p in BASELINES) or "none run"
    return Table(
        "Gap closed: (best baseline - policy) / (best baseline - oracle), by budget",
        ("policy", "repair", *(f"budget {b}" for b in budgets)),
        (("best baseline", "", *(f"{_label(r)} {r.ppl:.3f}" if r else "–" for r in bases)),
         ("oracle (hindsight)", "none", *(fmt(oracle.get(b), 3) for b in budgets)),
         *((p, rep, *(fmt(None if r is None else gap_closed(res, r), 2) for r in rs))
           for p, rep, rs in grid_lines(res))),
        f"1 = as good as the oracle, 0 = as the best baseline (the best of {ran}, any "
        "repair, no recall), below 0 = worse. – : no run, or the oracle does not beat the "
        "best baseline there.")


def _cost_table(res: QualityResult) -> Table:
    return Table(
        "Per run: ms per token (whole loop step"
        + (f"; with up to {res.config.batch} rows a step, the batch's stage 1 and the "
           "row's stages 2-4" if (res.config.batch or 1) > 1 else "")
        + "), culls (and how many folded), merges, recalls, over the scored steps",
        ("policy", "repair", "budget", "ms/token", "culled", "folded", "merged", "recalled",
         "stop"),
        tuple((_name(r), r.repair, str(r.budget), fmt(r.ms_per_token, 1), str(r.culled),
               str(r.folded), str(r.merged), str(r.recalled), r.stop_reason)
              for r in [res.reference, *res.runs, *res.oracle]))


def _long_table(res: QualityResult) -> Table:
    ref = res.long_reference
    ws = {_long_label(r): {w.end: w.ppl for w in r.windows} for r in res.long}
    ws["full cache"] = {w.end: w.ppl for w in ref.windows}
    ends = sorted(set().union(*ws.values()))
    first = res.long[0]
    return Table(
        f"Long run: perplexity per window of {res.config.long_window} tokens "
        f"(budget {first.budget}, {first.repair} repair)",
        ("tokens up to", *ws), tuple((str(e), *(fmt(ws[p].get(e), 3) for p in ws))
                                     for e in ends)
        + (("all", *(fmt(r.ppl, 3) for r in [*res.long, ref])),),
        " ".join(f"{_long_label(r)}: {r.scored} tokens scored, stopped by "
                 f"{r.stop_reason}, {r.reindexed} re-index(es)"
                 + (f", {r.recalled} recalled" if r.recall else "") + "."
                 for r in res.long)
        + f" The model has {res.max_positions} positions: `keep` and the full cache "
          "stop there. No oracle here: it needs a full-cache pass, which cannot go past "
          "the positions.")


def tables(res: QualityResult) -> list[Table]:
    out = [target_table(res.targets, 4), _ppl_table(res)]
    out += [_gap_table(res)] if res.oracle else []
    out += [_long_table(res)] if res.long else []
    return out + [_cost_table(res)]


def plots(res: QualityResult, out: Path) -> list[str]:
    """PNG plots into ``out``; returns their file names."""
    series = {}
    budgets = res.config.budgets
    colour = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(res.config.policies
                                                             + res.config.recall_policies))}
    for p, rep, rs in grid_lines(res):  # colour: policy; line: repair (dotted: recall)
        rs = [r for r in rs if r]
        if rs:
            series[f"{p}{'' if rep == 'none' else ' + ' + rep}"] = (
                [r.budget for r in rs], [r.ppl for r in rs],
                {"color": colour[rs[0].policy], "linestyle": (0, (1, 1)) if rs[0].recall
                 else {"none": "-", "merge": "--"}.get(rep, "-.")})
    if res.oracle:
        series["oracle (hindsight)"] = ([r.budget for r in res.oracle],
                                        [r.ppl for r in res.oracle],
                                        {"linestyle": "-", "color": "black"})
    series["full cache"] = (budgets, [res.reference.ppl] * len(budgets),
                            {"linestyle": ":", "color": "gray"})
    common.line_plot(out / "ppl_vs_budget.png",
                     f"Streaming perplexity vs budget, {res.model} {res.dtype}, "
                     f"text {res.text.source}", "budget (live cache slots)", "perplexity",
                     series)
    images = ["ppl_vs_budget.png"]
    if res.long:
        _long_plot(res, out / "ppl_long.png")
        images.append("ppl_long.png")
    return images


def _long_plot(res: QualityResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5.2), dpi=110)
    for r in res.long:
        ax.step([w.end for w in r.windows], [w.ppl for w in r.windows], where="pre",
                label=f"{r.policy} budget {r.budget}, positions {r.positions}"
                + (", recall" if r.recall else ""),
                linestyle="-" if r.positions == "compact" else "--")
    ref = res.long_reference
    ax.step([w.end for w in ref.windows], [w.ppl for w in ref.windows], where="pre",
            label="full cache", linestyle=":", color="gray")
    ax.axvline(res.max_positions, color="red", alpha=0.5, label="the model's positions")
    ax.set_title(f"Perplexity per {res.config.long_window}-token window, {res.model}")
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("perplexity")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def missed_notes(res: QualityResult) -> list[str]:
    return [f"- **Missed: {t.what}**: {t.value:.4f}, target {t.target}."
            for t in res.targets if t.met is False]


def _long_label(r: LongRun) -> str:
    """``brightness keep``, ``brightness keep recall``: a long run's column."""
    return f"{r.policy} {r.positions}" + (" recall" if r.recall else "")


def report_md(res: QualityResult, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report; ``level`` is the heading level of its title."""
    h, t, sp, c = "#" * level, res.text, res.base, res.config
    what = [f"text `{t.source}`"] * (t.source != DEFAULT_TEXT) + ["tune slice"] * (
        t.slice == "tune")
    lines = [
        f"{h} Quality benchmark: streaming perplexity" + (f" ({', '.join(what)})" if what else ""),
        "",
        res.regenerate(),
        "",
        f"{model_facts(res)}; text "
        f"`{t.source}`: {t.about} ({t.tokens:,} tokens, sha256 {t.sha256}…), slice "
        f"`{t.slice}`: tokens {t.offset:,}-{t.end - 1:,}; grid windows from tokens "
        f"{', '.join(f'{a:,}' for a in t.windows)}, each {res.warmup} unscored tokens then "
        f"{c.tokens} scored; {res.machine.facts()}{grid.where('runs', res)}. "
        f"Protected from culls: {sp['sinks']} sinks, "
        f"{sp['recent']} recent tokens. Brightness: decay {sp['decay']}, gain {sp['gain']}, "
        f"signal {sp['signal']}, aggregation {sp['aggregate']}, "
        f"skip layers {sp.get('skip_layers', 0.0)}, max {sp['max_brightness']}"
        + (f"; per head, pool {sp['pool']}, shrink {sp['shrink']}" if "shrink" in sp else "")
        + ". Recall: the "
        f"cold store scanned every {sp['recall_every']} step(s) over "
        f"{sp['recall_layers'] or 'all the brightness'} layers, at most {sp['recall_max']} "
        f"swaps a step, span {sp['recall_span']}, margin {sp.get('recall_margin', 0.0)}. "
        + res.kv.sentence(c.budgets, res.warmup + c.tokens, "a window's end"),
        "",
    ]
    for tb in tables(res):
        lines += [f"{h}# {tb.title}", "", tb.markdown(), ""]
        if tb.title.startswith("Targets"):
            lines += missed_notes(res) + [""] if missed_notes(res) else []
    lines += [f"{h}# Plots", ""]
    lines += [f"![{name}]({image_dir}/{name})" for name in images]
    lines += ["", f"{h}# Method", "", METHOD + f"  This report is `{t.slice}`.\n"]
    return "\n".join(lines) + "\n"


METHOD = """\
- **Streaming perplexity**: a run primes its first token; every step runs the pending
  token through stages 1-4 (`Session.stream(force=...)`): stage 1's logits give the NLL of
  the text's next token, which becomes the pending token (teacher forcing; nothing is
  sampled), stage 2 scores, stage 3 culls to the budget (and merges a dim pair with merge
  repair, or folds each culled token's K/V into its most alike survivor with fold repair),
  stage 4 applies. Perplexity = exp(mean NLL) over the scored tokens.
- **Grid windows**: every grid run (the full cache, each policy x budget x repair, the
  default policy with recall, the oracle) streams the same windows, spread evenly over the
  slice (the first at its start, the last ending at its end, none overlapping), each from
  an empty cache: first the largest budget + 1 tokens, unscored, so that at every budget
  the cache is full and has culled before the first scored token, then the scored ones.
  A cell's perplexity is over every window's scored tokens; `results.json` also holds
  each window's (`by_window`).
- **Recall**: the default policy (brightness, no repair) with `recall`: a culled token
  goes to a cold store and comes back when the query attends to it more than to one of
  the dimmest hot tokens (docs/DESIGN.md, Recall tier); the cache holds the budget at
  every step, as without it. The baselines and the oracle it is compared with drop.
- **Full cache**: the same loop without a budget; it checks against Hugging Face's own
  forward over the whole text in `tests/test_bench_quality.py` (NLL equal to 1e-4).
- **Oracle** (hindsight, a reference point, not a policy): in each window the full-cache
  run records each step's attention row by token (aggregated as the scorers do, `all-mean`
  by default); the oracle runs at each budget (no repair, the same sinks and recent tokens
  protected) score a live token by the attention that window's later queries paid it in
  the full cache, so the token the future needs least goes first (Belady-style). *Gap
  closed* = (best baseline - policy) / (best baseline - oracle) in perplexity, the best
  baseline being the lowest of the non-default scorers (any repair, no recall) at that
  budget. The oracle is no strict bound (the queries of a culled cache attend differently
  from the full cache's); where it does not beat the best baseline there is no gap, and
  the fractions read `–`. The long run has no oracle.
- **Long run**: one configuration streamed from the slice's start past the model's
  positions. `compact` re-indexes the live cache to positions 0..n-1 (keys re-rotated
  exactly) when the next position would leave the trained range; `keep` never does, so it
  stops at the limit. The long baselines and the long policy with recall run `keep` over
  the same tokens, so each meets the full cache over the whole trained range. The control
  run streams the tokens past the limit again from later in the text, so they are scored
  at positions below half the limit with the same budget: the text is the same, only the
  positions differ.
- **Slices**: `eval` is the text's first half, `tune` its second (from `--at`, default
  halfway); the windows and the long run lie inside the slice, so the two share no token.
  Scorer defaults are chosen on `tune` only (`--slice tune`), never on `eval`."""


FLAGS = (QualityConfig, flags.Workers)  # the dataclasses whose fields are its flags
