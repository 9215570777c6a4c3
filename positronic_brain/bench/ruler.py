"""``positronic-brain bench ruler``: RULER's tasks answered through the loop under a budget.

RULER's synthetic tasks (``ruler_tasks``: needles of several kinds, variable tracking, word
extraction; QA from a file a user gives), generated here offline and seeded, with the
model's own tokenizer, are answered greedily through the real loop (stages 1-4). Each
sample's context is compressed to the cell's budget under one of three protocols, then the
question and the answer go on uncompressed:

- ``compress``: the context is prefilled whole and compressed once, by the first step's
  culls (kvpress's protocol; with prefill scores, the scorer also sees the context's own
  attention);
- ``online``: the context streams through the budget one token a step, as a reader with a
  fixed cache reads it (decode-time eviction; with recall, culled tokens can come back);
- ``chunked``: online in chunks of ``chunk`` tokens: one stage-0 extend, then the culls.

The rest of the question and the answer prefix (with ``--query-aware``, the answer prefix
alone) go in one stage-0 extend, except in a cell with recall, where they go a token a
step (their tokens forced), so that their queries can bring back from the cold store what
they read before the answer starts, and the recent window protects only the tokens since
they began, so that what comes back takes a context token's place (with ``pyramid`` and
``duo`` allocations, whose heads' budgets are shares above the protected tokens, the
window covers the whole rest at once, as without recall, so that a moving window does not
move the budgets). A recall cell's culled
tokens keep their K/V in the cold store (up to its capacity): its budget and ratio are
those of the hot cache, the slots every step attends to, and every few steps the recall
scan reads the cold keys too; it saves no memory.

With ``--query-aware`` (kvpress's ``query_aware``) the question is part of what is
compressed: the context and the question go through the protocol together (their tokens
are the "context" of the ratio, the budget and the rows) and only the answer prefix goes on
uncompressed, so a scorer that reads the prompt's last queries (prefill scores' observation
window: SnapKV's) sees what will be asked before it chooses.

A cell's budget is a compression ratio of the context (the fraction of its tokens removed;
the budget keeps the rest, and never fewer than the protected tokens allow), or with
``--budgets`` a number of the context's tokens kept; the rows give both (a budget's ratio
the mean of its samples') and the fraction really kept (a per-head policy,
``NAME@ALLOCATION``: the mean over the (layer, KV head)s, at the same K/V memory). Every
sample is also answered with the full cache: the model's own ceiling. A sample is primed
once per protocol that can share the prime, and each cell answers from its own deep copy.
``--capture-misses DIR`` captures every wrong answer, so ``inspect --html`` shows when the
needle was culled and whether it came back.

Each answer also records the share of the answer's tokens in the context (every
occurrence that spells it) the cache still held at the question (with per-head budgets,
the mean over the heads): a miss with all of them held is the model's reading, one
without them a cull's doing; the report counts both. That count is strict: a miss is
counted culled if any head lost any of those tokens, even where a whole copy of the answer
stayed (fwe and cwe spell theirs many times). The share is taken again when the answer
starts, and a miss is counted by that one: with recall the question's steps may have
brought tokens back by then (and a cold token may still come back while the model
answers); without, nothing changed.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from .. import options
from ..capture import CaptureTape, manifest
from ..batch import Program, run_programs, watched
from ..loop import Session, check_copy, head_capacity
from ..model import DTYPES, Model
from ..scorers import (CULLING, copies, culling, make_scorer, reads_copy, reads_total,
                       takes_prefill_scores)
from ..special_tokens import TokenPolicy
from ..types import CacheParams, SamplerParams, Segment, require
from ..types import option
from . import batch_size, common, flags, grid, ruler_tasks
from .common import Table, fmt
from .grid import Pool
from .result import Machine, Result, Target, model_facts, target_table

PROTOCOLS = ("compress", "online", "chunked")
DEFAULT_POLICY = CacheParams().scorer.name
TARGETS = ((0.75, 0.90), (0.875, 0.75))  # (compression ratio, score / the full cache's)
CEILING = 0.5  # the targets hold where the full cache scores at least this


@dataclass(frozen=True)
class RulerConfig:
    """What to measure: every task at every length, ``samples`` samples each, answered with
    the full cache and in every cell (protocol x policy x size, with recall too if
    ``recall``)."""

    model: str = "smollm2"
    dtype: str = option("float32", "the model's precision", choices=tuple(DTYPES))
    device: str = "cpu"
    quick: bool = False
    tasks: tuple[str, ...] = option(
        ruler_tasks.SYNTHETIC, "comma-separated RULER tasks (qa_1 and qa_2 need --qa-file)",
        quick=("niah_single_1", "niah_multikey_1", "vt", "fwe"),
        choices=tuple(ruler_tasks.TASKS))
    lengths: tuple[int, ...] = option((1024, 2048, 4096, 8192), "comma-separated input "
                                      "lengths in the model's tokens, answer included",
                                      quick=(1024,))
    samples: int = option(10, "samples per task and length", quick=2)
    policies: tuple[str, ...] = option(("brightness", "h2o", "tova", "knorm", "keydiff", "kvzip",
                                        "streaming"),
                                       "comma-separated scorers, NAME@ALLOCATION per head "
                                       "(none: the full cache only)", read=flags.policies)
    ratios: tuple[float, ...] = option((0.5, 0.75, 0.875), "compression ratios: the "
                                       "fraction of the context's tokens removed",
                                       quick=(0.75,))
    budgets: tuple[int, ...] = option((), "budgets in tokens kept of the context: cells of "
                                      "their own beside the ratios'")
    protocols: tuple[str, ...] = option(
        ("compress", "online"), "comma-separated: compress, online, chunked",
        quick=("compress",), choices=PROTOCOLS)
    chunk: int = option(128, "chunked: the context's tokens per extend")
    new_tokens: int | None = option(None, "the most new tokens of an answer (default: the "
                                    "task's own, as RULER's)")
    recall: tuple[str, ...] = option((), "policies whose cells also run with recall (as run "
                                     "--recall): comma-separated, or the flag alone (or all) "
                                     "for every policy", read=flags.recall_policies,
                                     bare=True, metavar="LIST")
    batch: int | None = option(None, "a sample's answers (the full cache's and each cell's) "
                               "B at a time, as the rows of a batch (one stage-1 forward a "
                               "step for all; 1: one at a time; " + batch_size.HELP + ")",
                               metavar="B")
    query_aware: bool = option(False, "the question is compressed with the context (kvpress's "
                               "query_aware): only the answer prefix goes on uncompressed")
    params: tuple[tuple[str, Any], ...] = option(
        (), "cache parameters of every cell, e.g. sinks=4,recent=16", metavar="K=V,...",
        read=flags.cache_options, repeat="param")
    essay: str | None = option(None, "a UTF-8 text for the essay haystacks (default: "
                               "Python's help topics)", metavar="FILE")
    qa_file: str | None = option(None, "a SQuAD- or HotpotQA-format JSON file: qa_1/qa_2's "
                                 "questions", metavar="FILE")
    seed: int = option(0, "the samples' seed")
    write_data: str | None = option(None, "write the samples as JSONL into this folder (one "
                                    "file per task and length) and measure nothing",
                                    metavar="DIR")
    capture_misses: str | None = option(None, "capture every wrong answer into this folder "
                                        "(inspect --html shows it; each answers again alone, "
                                        "so under --batch its answer may differ by rounding)",
                                        metavar="DIR")

    def __post_init__(self) -> None:
        require(self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        require(self.chunk >= 1, f"chunk must be >= 1, got {self.chunk}")
        require(self.batch is None or self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        require(self.new_tokens is None or self.new_tokens >= 1,
                f"new tokens must be >= 1, got {self.new_tokens}")
        require(all(n >= 64 for n in self.lengths), f"lengths must be >= 64, got {self.lengths}")
        require(all(0 <= r < 1 for r in self.ratios), "--ratios takes comma-separated fractions "
                f"in [0, 1), got {','.join(map(str, self.ratios))}")
        require(all(b >= 1 for b in self.budgets), "--budgets takes comma-separated token "
                f"counts >= 1, got {','.join(map(str, self.budgets))}")
        require(self.sizes or not self.policies, "the cells need --ratios or --budgets")
        bad = [p for p in flags.scorer_names(self.policies + self.recall_policies)
               if not culling(p)]
        require(not bad, f"unknown or non-culling policies {bad}; expected some of "
                f"{', '.join(CULLING)} (or none: the full cache only)")
        require(self.qa_file or not {"qa_1", "qa_2"} & set(self.tasks),
                "qa_1 and qa_2 need --qa-file (SQuAD- or HotpotQA-format JSON)")
        options.check_shared(dict(self.params),
                             flags.scorer_names(self.policies + self.recall_policies) or CULLING)
        for name in ("tasks", "lengths", "policies", "recall", "ratios", "budgets"):
            values = getattr(self, name)
            require(len(set(values)) == len(values), f"--{name} repeats a value: {values}")
        runs = [(p, False) for p in self.policies] + [(p, True) for p in self.recall_policies]
        for p, recall in runs:  # fail early: unknown fields, options of pieces that are off
            c = self.cache(p, 1 << 30, recall)  # any budget: the cells' own come later
            require("user" not in c.pinned and c.allocation.kind != "turns", "a RULER "
                    "prompt is one user turn, its question a turn of its own: pinned user "
                    "tokens and --allocation turns do not apply")

    @classmethod
    def preset(cls, quick: bool, **kw) -> "RulerConfig":
        """The config, with each field's ``quick`` value (its metadata) for ``--quick``."""
        return flags.preset(cls, quick, **kw)

    @property
    def recall_policies(self) -> tuple[str, ...]:
        """The policies whose cells also run with recall: ``recall``'s, or every policy."""
        return self.policies if self.recall == (flags.EVERY,) else self.recall

    @property
    def sizes(self) -> tuple["Size", ...]:
        """Each cell's size: the ratios', then the budgets'."""
        return tuple(Size(ratio=r) for r in self.ratios) + tuple(Size(tokens=b)
                                                                 for b in self.budgets)

    def cache(self, policy: str, budget: int | None, recall: bool) -> CacheParams:
        given = {**dict(self.params), **flags.cell_policy(policy if budget else "none"),
                 "budget": budget}
        return options.cache_params(given | ({"recall": True} if recall and budget else {}),
                                    strict=False)


@dataclass(frozen=True)
class Size:
    """A cell's budget: a compression ``ratio`` of the context (the fraction of its tokens
    removed), or ``tokens`` of it kept."""

    ratio: float | None = None
    tokens: int | None = None

    @property
    def label(self) -> str:
        return f"ratio {self.ratio}" if self.tokens is None else f"budget {self.tokens}"

    @property
    def name(self) -> str:
        """As a file name's part: the ratio, or b and the tokens."""
        return str(self.ratio) if self.tokens is None else f"b{self.tokens}"

    def kept(self, n_context: int) -> int:
        return round(n_context * (1 - self.ratio)) if self.tokens is None else self.tokens


@dataclass(frozen=True)
class Cell:
    """One way to answer: ``policy`` at ``size`` under ``protocol`` (and ``recall``)."""

    protocol: str
    policy: str
    size: Size
    recall: bool

    @property
    def method(self) -> str:
        return self.policy + ("+recall" if self.recall else "")


def cells(cfg: RulerConfig) -> list[Cell]:
    """Every protocol x policy x size (the ratios', the budgets'), then the same with
    recall for the ``recall_policies``."""
    return [Cell(pr, p, z, rc) for pr in cfg.protocols
            for rc, ps in ((False, cfg.policies), (True, cfg.recall_policies))
            for p in ps for z in cfg.sizes]


# --- one sample ---------------------------------------------------------------------------

@dataclass
class Prompt:
    """A sample's input as ids: the ``n_context`` a protocol compresses first (the context,
    or with ``query_aware`` the context and the question), then the rest (the question and)
    the answer prefix."""

    ids: list[int]
    n_context: int
    new_tokens: int
    answer: tuple[int, ...] = ()  # the context's tokens that spell an answer (``spelling``)

    @classmethod
    def of(cls, policy: TokenPolicy, sample, new_tokens: int | None = None,
           query_aware: bool = False) -> "Prompt":
        bos = [policy.bos_id] if policy.add_bos else []  # as the family wants
        ids = bos + policy.encode(sample.input())

        def split(text: str) -> int:  # where ids stop spelling ``text``'s own ids
            ctx = bos + policy.encode(text)
            return next((i for i, (a, b) in enumerate(zip(ids, ctx)) if a != b),
                        min(len(ids), len(ctx)))
        context = split(sample.context)  # the answer is spelt in the context alone
        n = split(sample.context + sample.question) if query_aware else context
        require(1 < n < len(ids), f"sample {sample.task}/{sample.index}: no context before the "
                + ("answer prefix" if query_aware else "question"))
        return cls(ids, n, new_tokens or ruler_tasks.TASKS[sample.task].tokens_to_generate,
                   spelling(policy, ids[:context], sample.answers))

    def budget(self, size: Size, params: CacheParams) -> int:
        """A cell's budget: the context's tokens ``size`` keeps, but at least the protected
        ones and two more."""
        return max(size.kept(self.n_context), params.sinks + params.recent + 2)

    def segment(self, lo: int, hi: int) -> list[Segment]:
        return [Segment(tuple(self.ids[lo:hi]), "user")]


def spelling(policy: TokenPolicy, context: list[int], answers) -> tuple[int, ...]:
    """The indices of ``context``'s tokens that spell one of ``answers`` (every occurrence,
    as the answer's own ids, or where those occur nowhere, as its ids after a space): what a
    cache must still hold at the question for the model to read the answer there."""
    out: set[int] = set()
    for a in answers:
        for want in (policy.encode(a), policy.encode(" " + a)):
            w = len(want)
            found = {i + j for i in range(len(context) - w + 1) if w and context[i:i + w] == want
                     for j in range(w)}
            if found:
                out |= found
                break
    return tuple(sorted(out))


def answer_held(state, answer: tuple[int, ...]) -> float | None:
    """The share of ``answer`` (context indices) that ``state`` still holds as themselves
    (a token merged into another is not); with per-head budgets, the mean over the (layer,
    KV head)s. The i-th token of a sample's text has the i-th uid a merge did not take.
    None where no context token spells an answer."""
    if not answer:
        return None
    m = state.ledger
    text = [u for u in range(m.next_uid) if u not in m.merged]
    uid = m.live("uid")
    want = uid.new_tensor([text[i] for i in answer if i < len(text)])
    if state.heads is None:
        return float(torch.isin(want, uid).double().mean())
    rows = state.heads.row[:, :, :state.arena.n]
    held = torch.isin(torch.where(rows >= 0, uid[rows.clamp_min(0)], -1), want)
    return float(held.sum(-1).double().mean()) / want.numel()


@dataclass(frozen=True)
class Answer:
    """What one answer gives: its ids, the tokens kept at the question (``State.kv_memory``'s),
    the share of the answer's context tokens held then and when the answer starts (after
    the question, whose steps recall may have brought some back: ``answer_held``), and why
    it stopped."""

    ids: list[int]
    kept: float
    held: float | None
    held_at_answer: float | None
    stop: str


def answer_steps(session: Session, prompt: Prompt, protocol: str | None, chunk: int,
                 prime: int | None = None) -> Program:
    """One answer as a program of steps (``batch.run_programs``): ``prime`` (the online
    and chunked protocols': the cell's arena capacity) the context's first budget tokens
    first; the context phase (``compress`` or None, the full cache: the one step after the
    primed context, which culls to the budget; ``online``/``chunked``: the context after
    the prime through the budget, ``chunk`` tokens an extend, up to the question's first
    token, then pending); then the rest of the question and the answer prefix uncompressed
    (one stage-0 extend; with recall, a step a token: the module's docstring) and up to the
    task's new tokens, greedy: from there the budget (if any) has room for them all.
    Returns its ``Answer``."""
    if prime is not None:
        session.prime(prompt.segment(0, min(session.cache_params.budget, prompt.n_context)),
                      prime)
    p = session.cache_params  # as the prime resolved it
    i, end = session.state.next_position + 1, prompt.n_context + 1
    if protocol in (None, "compress"):
        i = end
        yield session, prompt.ids[prompt.n_context]
    while i < end:
        j = min(i + (1 if protocol == "online" else chunk), end)
        if j - i > 1:
            session.extend(prompt.segment(i, j - 1))
        yield session, prompt.ids[j - 1]
        i = j
    kept = session.state.kv_memory()["tokens"]  # per head: the mean, the same memory
    held = answer_held(session.state, prompt.answer)
    rest = len(prompt.ids) - prompt.n_context + prompt.new_tokens + 1
    if p.budget is not None:  # room for the rest, protected: the recent window
        recent = max(p.recent, rest)
        session.cache_params = replace(p, recent=recent, budget=max(
            p.budget, session.state.arena.n + rest, p.sinks + recent + 1))
    q, first = session.cache_params, session.state.step

    def protect() -> None:  # the recent window over what came since the rest began alone
        if p.recall is not None and not p.allocation.above_protected:
            session.cache_params = replace(q, recent=max(p.recent, session.state.step - first))

    if p.recall is not None:
        protect()
        for t in prompt.ids[prompt.n_context + 1:]:
            yield session, t
            protect()
    elif len(prompt.ids) > prompt.n_context + 1:
        session.extend(prompt.segment(prompt.n_context + 1, len(prompt.ids)))
    at_answer = answer_held(session.state, prompt.answer)
    ids: list[int] = []
    yield from watched(session.steps(prompt.new_tokens),
                       lambda rec: (ids.append(rec.token_id), protect()))
    session.state.check_valid()
    return Answer(ids, kept, held, at_answer, session.stop_reason)


def cell_cache(cfg: RulerConfig, cell: Cell, prompt: Prompt) -> CacheParams:
    """The cache parameters of ``cell`` for ``prompt``: its budget from its size."""
    cache = cfg.cache(cell.policy, prompt.n_context, cell.recall)
    return replace(cache, budget=prompt.budget(cell.size, cache))


def cell_steps(model: Model, policy: TokenPolicy, cell: Cell, cfg: RulerConfig,
               prompt: Prompt, cache: CacheParams, primed=None, tape=None,
               scorer=None) -> Program:
    """One cell's answer to one sample under its ``cache`` (``cell_cache``), as a program
    (``answer_steps``'s). ``primed``: (the state primed with the whole context, its prompt
    statistics), which a ``compress`` cell answers from (a deep copy, made when the program
    starts); ``scorer``: ``cache``'s scorer, built already (None: the session builds it)."""
    sampler = SamplerParams(greedy=True)
    room = len(prompt.ids) - prompt.n_context + prompt.new_tokens + 2
    kw = {"scorer": scorer, **({"tape": tape} if tape is not None else {})}
    if cell.protocol != "compress":
        session = Session(model, policy, sampler, cache, **kw)
        capacity = head_capacity(model, cache) + room + (
            cfg.chunk if cell.protocol == "chunked" else 1)
        return (yield from answer_steps(session, prompt, cell.protocol, cfg.chunk, capacity))
    if primed is not None and tape is None:
        session = Session(model, policy, sampler, cache, state=copy.deepcopy(primed[0]), **kw)
        if primed[1] is not None:
            session.seed(primed[1])  # the cell's scorer columns, as its own prime's
    else:
        session = Session(model, policy, sampler, cache, **kw)
        session.prime(prompt.segment(0, prompt.n_context), prompt.n_context + room)
    return (yield from answer_steps(session, prompt, cell.protocol, cfg.chunk))


def answer_cell(model: Model, policy: TokenPolicy, cell: Cell, cfg: RulerConfig,
                prompt: Prompt, cache: CacheParams, primed=None, tape=None,
                scorer=None) -> Answer:
    """``cell_steps`` run alone."""
    out = []
    run_programs(model, [(0, cell_steps(model, policy, cell, cfg, prompt, cache, primed, tape,
                                        scorer))], 1, lambda _, value: out.append(value))
    return out[0]


@dataclass(frozen=True)
class SampleRow:
    """One sample's row: its facts, then per answer (the full cache's first, then each
    cell's) the output, its score, the cell's budget and tokens kept at the question (None
    for the full cache) and its seconds."""

    task: str
    length: int
    index: int
    n_tokens: int
    n_context: int
    depth: list[float]
    answers: list[str]
    outputs: list[str]
    scores: list[float]
    budgets: list[int | None]
    kept: list[float | None]  # ``State.kv_memory``'s tokens: a head's, on average
    seconds: list[float]
    held: list[float | None] = field(default_factory=list)  # ``answer_held``; [] read as None
    held_at_answer: list[float | None] = field(default_factory=list)  # ``Answer``'s, alike


def run_sample(model: Model, policy: TokenPolicy, cfg: RulerConfig, sample,
               grid: list[Cell], tick=None) -> SampleRow:
    """One sample answered with the full cache and in every cell, ``cfg.batch`` answers at
    a time: its row (the sample's facts, each answer, its score, the cell's budget and kept
    tokens, seconds: each answer's from its start to its end, which with a batch overlap)."""
    prompt = Prompt.of(policy, sample, cfg.new_tokens, cfg.query_aware)
    t0 = time.perf_counter()
    full = Session(model, policy, SamplerParams(greedy=True), cfg.cache("none", None, False))
    caches = [cell_cache(cfg, c, prompt) for c in grid]
    scorers = [make_scorer(k) if c.protocol == "compress" else None for c, k in zip(grid, caches)]
    seeded = [s for s, k in zip(scorers, caches)
              if s is not None and takes_prefill_scores(s, k, prompt.n_context)]
    stats = full.prime(prompt.segment(0, prompt.n_context), len(prompt.ids) + prompt.new_tokens + 2,
                       stats=bool(seeded), total=any(reads_total(s) for s in seeded),
                       copy=any(reads_copy(s) for s in seeded))
    primed = (copy.deepcopy(full.state), stats) if any(s is not None for s in scorers) else None
    n = 1 + len(grid)
    answers, budgets = [None] * n, [None] + [c.budget for c in caches]
    kept, held, at_answer = [None] * n, [None] * n, [None] * n
    seconds = [0.0] * n

    def timed(i: int, steps: Program, start: float | None = None) -> Program:
        start = time.perf_counter() if start is None else start
        value = yield from steps
        seconds[i] = time.perf_counter() - start
        return value

    def programs() -> Iterator[tuple[int, Program]]:
        yield 0, timed(0, answer_steps(full, prompt, None, cfg.chunk), t0)
        for i, (cell, cache, scorer) in enumerate(zip(grid, caches, scorers), 1):
            yield i, timed(i, cell_steps(model, policy, cell, cfg, prompt, cache, primed,
                                         scorer=scorer))

    def done(i: int, a: Answer) -> None:
        answers[i] = a.ids
        if i:  # the full cache keeps everything
            kept[i], held[i], at_answer[i] = a.kept, a.held, a.held_at_answer
        if tick:
            tick()

    run_programs(model, programs(), cfg.batch or 1, done)
    texts = [policy.decode(a) for a in answers]
    scores = [ruler_tasks.score(sample.task, t, sample.answers) for t in texts]
    if cfg.capture_misses:
        _capture_misses(model, policy, cfg, sample, prompt, zip(grid, caches, scores[1:]))
    return SampleRow(sample.task, sample.length, sample.index, sample.n_tokens, prompt.n_context,
                     list(sample.depth), list(sample.answers), texts, scores, budgets, kept,
                     seconds, held, at_answer)


def _capture_misses(model: Model, policy: TokenPolicy, cfg: RulerConfig, sample, prompt: Prompt,
                    cells_scored) -> None:
    """Each cell (of ``cells_scored``: cell, its cache, its score) that scored below 1
    answers again on a tape: a capture that replays, in
    ``capture_misses``/TASK-LENGTH-INDEX-PROTOCOL-METHOD-RATIO."""
    for cell, cache, s in cells_scored:
        if s >= 1:
            continue
        name = (f"{sample.task}-{sample.length}-{sample.index}-{cell.protocol}-{cell.method}-"
                f"{cell.size.name}").replace("/", "_").replace(":", "_")
        tape = CaptureTape(Path(cfg.capture_misses) / name, manifest(
            model, SamplerParams(greedy=True), cache, prompt.ids, "bench ruler",
            {"sample": dataclasses.asdict(sample), "cell": dataclasses.asdict(cell)}))
        try:
            stop = answer_cell(model, policy, cell, cfg, prompt, cache, tape=tape).stop
        except BaseException as e:
            tape.close(type(e).__name__, complete=False)
            raise
        tape.close(stop)


# --- the grid -----------------------------------------------------------------------------

def _run_sample(sample) -> SampleRow:
    w = grid.WORKER
    return run_sample(w["model"], w["policy"], w["cfg"], sample, w["grid"])


def samples(cfg: RulerConfig, policy: TokenPolicy) -> list:
    return [s for task in cfg.tasks for n in cfg.lengths
            for s in ruler_tasks.generate(policy, task, n, cfg.samples, cfg.seed, cfg.essay,
                                          cfg.qa_file)]


def run_samples(cfg: RulerConfig, model: Model, policy: TokenPolicy, todo: list,
                pool: Pool = Pool()) -> list[SampleRow]:
    """Every sample's row, in ``todo``'s order, measured by ``pool`` (here, or in worker
    processes that each load the model once); a row does not depend on where it ran."""
    cs = cells(cfg)
    return pool.rows(f"ruler: {len(todo)} samples x {1 + len(cs)} cells", todo, 1 + len(cs),
                     lambda s, tick: run_sample(model, policy, cfg, s, cs, tick), _run_sample,
                     cfg, cells, lambda s: s.n_tokens)


def write_data(cfg: RulerConfig, policy: TokenPolicy, todo: list) -> list[str]:
    """The samples as JSONL, one file per task and length, in ``write_data``."""
    out = common.prepare_out_dir(cfg.write_data)
    files = []
    for task in cfg.tasks:
        for n in cfg.lengths:
            path = out / f"{task}-{n}.jsonl"
            ruler_tasks.write_jsonl([s for s in todo if s.task == task and s.length == n], path)
            files.append(str(path))
    return files


@dataclass(frozen=True)
class Row:
    """One (task, length, method, size, protocol): kvpress's leaderboard columns (dataset,
    data_dir, model, method, compression_ratio, score: 0-100) and ours; the full cache's
    has no protocol. A cell sized by a budget in tokens has the ratio its samples had
    (their mean)."""

    dataset: str
    data_dir: str  # the length
    model: str
    method: str  # the policy (+recall), or "full cache"
    compression_ratio: float
    score: float
    task: str
    protocol: str | None
    budget: float | None  # the mean over the samples
    recall: bool
    kept_fraction: float | None  # of the context, at the question (mean)
    full_cache_score: float
    score_vs_full: float | None
    seconds: float
    samples: int
    answer_held: float | None = None  # the answer's context tokens held at the question (mean)
    misses: int = 0  # samples scored below 1
    misses_culled: int | None = None  # of them, those whose answer's context tokens were
    # not all held when the answer started (None: not known, no missed sample spells its
    # answer in the context)
    size: str | None = None  # the cell's ``Size.label`` (None: the full cache)
    query_aware: bool = False  # the question compressed with the context (``query_aware``)
    answer_held_at_answer: float | None = None  # as ``answer_held``, when the answer started


@dataclass(kw_only=True)
class RulerResult(Result):
    """A run: its config, each sample's row and the leaderboard's rows; with
    ``write_data``, only the files written."""

    config: RulerConfig
    dtype: str
    max_positions: int
    base: dict[str, Any]  # every cache option's value (``options.settings``: a scorer field
    # the default scorer's, where the scorers' defaults differ)
    workers: int | None = None  # None: nothing measured (``write_data``)
    ray: str | None = None
    samples: list[SampleRow] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    data: list[str] | None = None  # write_data's files


def run(cfg: RulerConfig, command: str, pool: Pool = Pool()) -> RulerResult:
    """Every measurement, the samples answered by ``pool``."""
    t0 = time.perf_counter()
    machine = Machine.now()
    model = grid.load(cfg.model, cfg.dtype, cfg.device, note=True)
    require(max(cfg.lengths) <= model.spec.max_positions, f"lengths {cfg.lengths}: the "
            f"model has {model.spec.max_positions} positions")
    policy = TokenPolicy(model.tokenizer)
    todo = samples(cfg, policy)
    if any(c.protocol == "compress" and copies(cfg.cache(c.policy, 1 << 30, c.recall))
           for c in cells(cfg)):  # KVzip's copy of the longest context: before any work
        check_copy(model, policy, max(Prompt.of(policy, s, 1, cfg.query_aware).n_context
                                      for s in todo))
    res = RulerResult(benchmark="ruler", command=command, model=cfg.model, quick=cfg.quick,
                      machine=machine, config=cfg, dtype=cfg.dtype,
                      max_positions=model.spec.max_positions,
                      base=options.settings(dict(cfg.params)),
                      stage1=model.stage1_path)
    if cfg.write_data:
        res.data = write_data(cfg, policy, todo)
    else:
        cs, longest = cells(cfg), max(cfg.lengths)
        cfg, res.batch_choice = pool.batch(cfg, model, len(todo), [(longest, False)] + [
            (longest, c.recall) for c in cs])
        res.config, res.workers, res.ray = cfg, pool.workers(len(todo)), pool.ray
        res.samples = run_samples(cfg, model, policy, todo, pool)
        res.rows = rows(res, cs)
        res.targets = targets(res)
    res.machine = machine.ended()
    res.elapsed_s = time.perf_counter() - t0
    return res


# --- analysis -----------------------------------------------------------------------------

def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def rows(res: RulerResult, grid: list[Cell]) -> list[Row]:
    """One row per (task, length, method, size, protocol): the full cache's, then each
    cell's."""
    out = []
    for task in res.config.tasks:
        for n in res.config.lengths:
            ss = [s for s in res.samples if s.task == task and s.length == n]
            full = 100 * _mean(s.scores[0] for s in ss)
            out.append(_row(res, task, n, "full cache", None, None, ss, 0, full))
            for i, c in enumerate(grid, 1):
                out.append(_row(res, task, n, c.method, c.size, c.protocol, ss, i, full))
    return out


def _row(res: RulerResult, task: str, n: int, method: str, size: Size | None, protocol,
         ss: list[SampleRow], i: int, full: float) -> Row:
    score = 100 * _mean(s.scores[i] for s in ss)
    ratio = None if size is None else size.ratio if size.tokens is None else _mean(
        1 - min(size.tokens, s.n_context) / s.n_context for s in ss)
    held = [s.held[i] if s.held else None for s in ss]
    at_answer = [s.held_at_answer[i] if s.held_at_answer else h for s, h in zip(ss, held)]
    missed = [h for s, h in zip(ss, at_answer) if s.scores[i] < 1]
    return Row("ruler", str(n), res.model, method, ratio or 0.0, score, task, protocol,
               _mean(s.budgets[i] for s in ss), method.endswith("+recall"),
               _mean(s.kept[i] / s.n_context for s in ss if s.kept[i] is not None),
               full, score / full if full else None, sum(s.seconds[i] for s in ss), len(ss),
               _mean(held), len(missed),
               sum(h < 1 for h in missed if h is not None) if any(
                   h is not None for h in missed) else None, size and size.label,
               res.config.query_aware, _mean(at_answer))


def mean_scores(rs: list[Row], key) -> dict:
    """The mean score of each group of ``rs`` with the same ``key(row)``, in one pass."""
    groups: dict[Any, list[float]] = {}
    for r in rs:
        groups.setdefault(key(r), []).append(r.score)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def averages(res: RulerResult) -> dict[tuple, float]:
    """Each (protocol, method, size label)'s mean score over the tasks and lengths."""
    return mean_scores(res.rows, lambda r: (r.protocol, r.method, r.size))


def targets(res: RulerResult) -> list[Target]:
    """Where the full cache scores >= 50%: the default policy keeps >= 90% of its score at
    ratio 0.75 and >= 75% at 0.875, per protocol; and it is at or above every other
    built-in's average at each ratio, per protocol. With recall cells, the same again for
    the default policy with recall, against the others with recall."""
    out, cfg, avg = [], res.config, averages(res)
    for protocol in cfg.protocols:
        methods = list(dict.fromkeys(r.method for r in res.rows if r.protocol == protocol))
        for mine in (DEFAULT_POLICY, DEFAULT_POLICY + "+recall"):
            if mine in methods:
                out += _targets(res, avg, protocol, mine, [
                    m for m in methods if m.endswith("+recall") == mine.endswith("+recall")
                    and m.split("+")[0] != DEFAULT_POLICY])
    return out


def _targets(res: RulerResult, avg: dict, protocol: str, mine: str,
             others: list[str]) -> list[Target]:
    out = []
    for ratio, want in TARGETS:
        rs = [r for r in res.rows if r.protocol == protocol and r.method == mine
              and r.size == Size(ratio).label and r.full_cache_score >= 100 * CEILING]
        if rs:
            worst = min(rs, key=lambda r: r.score_vs_full)
            out.append(Target(f"{protocol}, ratio {ratio}: {mine} / the full cache, the worst "
                              f"of {len(rs)} task-lengths ({worst.task}, {worst.data_dir})",
                              worst.score_vs_full, f">= {want:.2f}", worst.score_vs_full >= want))
    for size in (z.label for z in res.config.sizes):
        score = avg.get((protocol, mine, size))
        theirs = {m: avg[k] for m in others if (k := (protocol, m, size)) in avg}
        if score is not None and theirs:
            best = max(theirs, key=lambda m: theirs[m])
            out.append(Target(f"{protocol}, {size}: {mine}'s average - the best other's "
                              f"({best})", score - theirs[best], ">= 0", score >= theirs[best]))
    return out


# --- output -------------------------------------------------------------------------------

def tables(res: RulerResult) -> list[Table]:
    cfg = res.config
    if cfg.write_data:
        return [Table("Samples written (JSONL)", ("file",), tuple((f,) for f in res.data))]
    full = [r for r in res.rows if r.protocol is None]
    ceiling = Table(
        "The full cache's score per task and length (the ceiling)",
        ("task", *map(str, cfg.lengths)),
        tuple((t, *(fmt(next(r.score for r in full if r.task == t and r.data_dir == str(n)), 0)
                    for n in cfg.lengths)) for t in cfg.tasks))
    out, avg = [target_table(res.targets, digits=3), ceiling], averages(res)
    methods = list(dict.fromkeys(r.method for r in res.rows if r.protocol))
    if not methods:  # the full cache alone (--policies none): no cell, no target to show
        return [ceiling]
    for protocol in cfg.protocols:
        out.append(Table(
            f"{protocol}: mean score over tasks and lengths by compression ratio or budget "
            f"(full cache {fmt(_mean(r.score for r in full), 1)})",
            ("method", *(z.label for z in cfg.sizes)),
            tuple((m, *(fmt(avg.get((protocol, m, z.label)), 1) for z in cfg.sizes))
                  for m in methods)))
    kept = [r for r in res.rows if r.protocol]
    out.append(misses_table(cfg, kept, methods))
    out.append(Table(
        "Budgets: tokens kept of the context (mean), by ratio or budget",
        ("size", "budget (mean)", "compression ratio (mean)",
         "fraction kept at the question (mean)"),
        tuple((z, fmt(_mean(r.budget for r in rs), 0),
               fmt(_mean(r.compression_ratio for r in rs), 3),
               fmt(_mean(r.kept_fraction for r in rs), 3))
              for z in (z.label for z in cfg.sizes)
              for rs in [[r for r in kept if r.size == z]])))
    return out


def misses_table(cfg: RulerConfig, cells_rows: list[Row], methods: list[str]) -> Table:
    """Why the cells missed, per protocol, method and size (``Row.misses_culled``)."""
    out = []
    for pr in cfg.protocols:
        for m in methods:
            for z in (z.label for z in cfg.sizes):
                rs = [r for r in cells_rows if (r.protocol, r.method, r.size) == (pr, m, z)]
                known = [r.misses_culled for r in rs if r.misses_culled is not None]
                if rs:
                    out.append((pr, m, z, str(sum(r.misses for r in rs)),
                                fmt(sum(known) if known else None, 0),
                                fmt(_mean(r.answer_held for r in rs), 3),
                                fmt(_mean(r.answer_held_at_answer for r in rs), 3)))
    return Table("Why the cells missed: answers scored below 1, and of them those whose "
                 "answer's tokens in the context the cache no longer wholly held when the "
                 "answer started (culled: not there to be read); the share of those tokens "
                 "held at the question and when the answer started (after the question, "
                 "whose steps recall can bring tokens back in), over every sample",
                 ("protocol", "method", "size", "misses", "of them culled",
                  "answer tokens held at the question", "at the answer"), tuple(out))


def plots(res: RulerResult, out: Path) -> list[str]:
    """A heatmap of task x method at each size and protocol (matplotlib)."""
    if not [r for r in res.rows if r.protocol]:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, names = res.config, []
    methods = list(dict.fromkeys(r.method for r in res.rows if r.protocol))
    by = mean_scores(res.rows, lambda r: (r.task, r.method, r.protocol, r.size))
    for protocol in cfg.protocols:
        for size in cfg.sizes:
            heat = [[by.get((t, m, protocol, size.label)) for m in methods] for t in cfg.tasks]
            fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(methods), 1 + 0.4 * len(cfg.tasks)))
            ax.imshow(heat, vmin=0, vmax=100, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
            ax.set_yticks(range(len(cfg.tasks)), cfg.tasks)
            for i, row in enumerate(heat):
                for j, v in enumerate(row):
                    ax.text(j, i, fmt(v, 0), ha="center", va="center", color="white")
            ax.set_title(f"RULER score, {protocol}, {size.label}, {res.model}")
            fig.tight_layout()
            name = f"ruler_{protocol}_{size.name}.png"
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            names.append(name)
    return names


def report_md(res: RulerResult, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report; ``level`` is the heading level of its title."""
    h, cfg = "#" * level, res.config
    lines = [f"{h} RULER benchmark", "", res.regenerate(quick_version=False), "",
             f"{model_facts(res)}; tasks "
             f"{', '.join(cfg.tasks)}; lengths {', '.join(map(str, cfg.lengths))} tokens; "
             f"{cfg.samples} samples each (seed {cfg.seed}); "
             + ("query-aware (the question compressed with the context); "
                if cfg.query_aware else "") +
             f"{res.machine.facts(res.workers == 1 and res.ray is None)}"
             + grid.where("samples", res) + ".", ""]
    for tb in tables(res):
        lines += [f"{h}# {tb.title}", "", tb.markdown(), ""]
    if images:
        lines += [f"{h}# Plots", ""] + [f"![{n}]({image_dir}/{n})" for n in images] + [""]
    lines += [f"{h}# Method", "", __doc__.split("\n\n", 1)[1]]
    return "\n".join(lines) + "\n"


# --- the command line -----------------------------------------------------------------------

FLAGS = (RulerConfig, flags.Workers)  # the dataclasses whose fields are its flags
MEASURES = 2  # a row's meaning: since 2, a recall cell steps the question (``answer_steps``)
ROW = SampleRow  # one item's (a sample's) row of the grid
