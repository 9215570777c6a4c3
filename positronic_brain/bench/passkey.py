"""``positronic-brain bench passkey``: can a culled cache still give back one fact?

Pass-key retrieval (Mohtashami & Jaggi's classic prompt). A random 5-digit key sentence
("The pass key is 48213. Remember it. 48213 is the pass key.") sits at a depth of 10-90%
in 1k-4k tokens of filler ("The grass is green. The sky is blue. ..." repeated); the
prompt ends with the question ("What is the pass key? The pass key is"). The model answers
greedily through the real loop (stages 1-4, the budget enforced at every step) with up to
``max_new_tokens`` new tokens; a trial is correct if the key's five digits appear in the
answer. Measured:

1. the full cache (no budget): the ceiling of the model itself;
2. every culling scorer at every budget, under each ``variant`` (a dict of CacheParams
   overrides: one more axis of the grid, labelled in every row): by default each scorer's
   own defaults ("plain"), with recall, and with prefill scores the other way from the
   scorer's default (``prefill_scores=flipped``: the first cull seeing the prompt's own
   attention, or only its last query's).

Trial i (its key, depth and length) depends only on the seed and i, so every cell answers
the same prompts and a quick run's trials are the first of a full run's. The prime does
not depend on the policy: each trial is primed once and each cell answers from its own deep
copy of the primed state (much cheaper than a prefill of thousands of tokens).
The prime gathers the prompt's attention statistics when a cell takes prefill scores, and
each such cell seeds its scorer's columns from them (``Session.seed``), as a prime with the
cell's parameters would. With a budget below the prompt, the arena holds the whole prompt
and the first step culls down to the budget on that one step's scores (and, with prefill
scores, the prompt's); the first answer token is still computed over the whole prompt.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import options
from ..batch import drive_rows
from ..loop import Session, arena_capacity, check_copy
from ..model import DTYPES, Model
from ..scorers import (CULLING, STREAMING, copies, culling, make_scorer, reads_copy,
                       reads_total, takes_prefill_scores)
from ..special_tokens import TokenPolicy
from ..types import CacheParams, SamplerParams, Segment, UserError, option, require
from . import batch_size, common, flags, grid
from .common import Table, fmt
from .grid import Pool
from .result import KVCost, Machine, Result, Target, model_facts, target_table

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
KEY = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER = "The pass key is"  # the prompt's last words: the model continues with the key
FRAMINGS = ("raw", "chat")
DEPTHS = (0.1, 0.9)  # the key's depth in the filler: uniform in this range
DEPTH_BINS = ((0.1, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9))
# The target from the project's issue: reported, never asserted.
FLIPPED = "flipped"  # a variant's prefill_scores: the other way from each scorer's default
TARGET_BUDGET = 128
TARGET_RATIO = 0.95  # pass-key accuracy with recall at TARGET_BUDGET / the full cache


# --- the prompt ---------------------------------------------------------------------------

def prompt_text(key: int, depth: float, sentences: int) -> str:
    """The raw prompt: the task, ``sentences`` filler sentences with the key sentence after
    ``round(depth * sentences)`` of them, then the question and the answer's start (last).
    Pure: no tokenizer."""
    return f"{haystack(key, depth, sentences)}\n{QUESTION} {ANSWER}"


def haystack(key: int, depth: float, sentences: int) -> str:
    """The task and the filler with the key sentence at ``depth`` of the filler (the
    question not included)."""
    require(10000 <= key <= 99999, f"the key must have 5 digits, got {key}")
    require(0 <= depth <= 1 and sentences >= 0, f"bad depth {depth} or sentences {sentences}")
    filler = [FILLER[i % len(FILLER)] for i in range(sentences)]
    at = round(depth * sentences)
    return "\n".join((INTRO, " ".join(filler[:at]), KEY.format(key=key), " ".join(filler[at:])))


def segments(policy: TokenPolicy, key: int, depth: float, sentences: int,
             framing: str) -> list[Segment]:
    """The prompt as primed: ``raw`` text (BOS if the model family wants it), or ``chat``:
    a user turn (the task, the filler, the question) and an assistant turn opened with the
    answer's start, so both framings end with the same words."""
    if framing == "raw":
        return policy.raw_prompt(prompt_text(key, depth, sentences))
    require(framing == "chat", f"framing must be one of {', '.join(FRAMINGS)}, got {framing!r}")
    user = f"{haystack(key, depth, sentences)}\n{QUESTION}"
    return policy.chat([("user", user)]) + [Segment(tuple(policy.encode(ANSWER)), "assistant")]


def n_tokens(segs: list[Segment]) -> int:
    return sum(len(s.ids) for s in segs)


def fit(policy: TokenPolicy, key: int, depth: float, length: int,
        framing: str) -> tuple[int, list[Segment]]:
    """The most filler sentences whose prompt holds at most ``length`` tokens, and the
    prompt's segments."""
    fixed = n_tokens(segments(policy, key, depth, 0, framing))
    require(fixed < length, f"a {length}-token prompt cannot hold the pass-key task "
            f"({fixed} tokens without filler)")
    cycle = n_tokens(segments(policy, key, depth, len(FILLER), framing)) - fixed
    n = max(0, int((length - fixed) * len(FILLER) / max(1, cycle)))
    segs = segments(policy, key, depth, n, framing)
    while n_tokens(segs) < length:  # the estimate is close: walk to the exact count
        more = segments(policy, key, depth, n + 1, framing)
        if n_tokens(more) > length:
            break
        n, segs = n + 1, more
    while n > 0 and n_tokens(segs) > length:
        n -= 1
        segs = segments(policy, key, depth, n, framing)
    return n, segs


def correct(key: int, answer: str) -> bool:
    """The key's five digits appear, in order and together, in the answer."""
    return str(key) in answer


# --- trials -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trial:
    """One prompt: the key, its depth in the filler, the prompt's length in tokens (at
    most; the prompt ends at a whole sentence)."""

    index: int
    key: int
    depth: float
    length: int


def trials(seed: int, n: int, lengths: tuple[int, ...]) -> list[Trial]:
    """Trial i depends only on ``seed`` and i (a quick run's trials are the first of a full
    run's): a random key and depth; the lengths in turn, so each gets its share."""
    out = []
    for i in range(n):
        rng = random.Random(f"passkey:{seed}:{i}")
        out.append(Trial(i, rng.randrange(10000, 100000), round(rng.uniform(*DEPTHS), 3),
                         lengths[i % len(lengths)]))
    return out


# --- configuration ------------------------------------------------------------------------

@dataclass(frozen=True)
class PasskeyConfig:
    """What to measure. ``policies`` empty: the full cache only. ``variants``: cache
    options (``options``, by their flat names) set in turn, each one more run of the whole policy x budget grid (``{}``: the plain cache;
    default: plain, with recall, and with prefill scores flipped from each scorer's default:
    ``{"prefill_scores": FLIPPED}``)."""

    model: str = "smollm2"
    dtype: str = option("float32", "the model's precision", choices=tuple(DTYPES))
    device: str = "cpu"
    quick: bool = False
    budgets: tuple[int, ...] = option((128, 256, 512), "live cache slots, comma-separated",
                                      quick=(128,))
    policies: tuple[str, ...] = option(STREAMING, "comma-separated scorers (none: the full "
                                       "cache only)", read=flags.policies)
    trials: int = option(50, "prompts per cell", quick=8)
    lengths: tuple[int, ...] = option((1024, 2048, 3072, 4096), "comma-separated prompt "
                                      "lengths in tokens, taken in turn", quick=(1024,))
    # each scorer's defaults (prefill scores or not: its own), with recall, and prefill
    # scores the other way round from its default
    variants: tuple[dict, ...] = ({}, {"recall": True}, {"prefill_scores": FLIPPED})
    framing: str = "raw"  # SmolLM2's full-cache accuracy: raw 50/50, chat 30/50 (METHOD)
    max_new_tokens: int = 8
    seed: int = 0
    batch: int | None = option(None, "a trial's answers (the full cache's and each cell's) "
                               "B at a time, as the rows of a batch (one stage-1 forward a "
                               "step for all; 1: one after another; " + batch_size.HELP + ")",
                               metavar="B")
    # cache options of every cell (flat name -> value): sinks, recent, scorer fields (each
    # cell's scorer takes those it has)
    params: tuple[tuple[str, Any], ...] = option(
        (), "cache parameters of every cell, e.g. sinks=4,pool=1", metavar="K=V,...",
        read=flags.cache_options, repeat="param")

    def __post_init__(self) -> None:
        require(self.trials >= 1, f"trials must be >= 1, got {self.trials}")
        require(len(self.lengths) > 0 and all(n >= 1 for n in self.lengths),
                f"lengths must be >= 1, got {self.lengths}")
        require(len(self.budgets) > 0 and all(b >= 1 for b in self.budgets),
                f"budgets must be >= 1, got {self.budgets}")
        require(tuple(sorted(set(self.budgets))) == self.budgets,
                f"budgets must be increasing, got {self.budgets}")
        bad = [p for p in flags.scorer_names(self.policies) if not culling(p)]
        require(not bad, f"unknown or non-culling policies {bad}; expected some of "
                f"{', '.join(CULLING)} (or none: the full cache only)")
        require(self.framing in FRAMINGS,
                f"framing must be one of {', '.join(FRAMINGS)}, got {self.framing!r}")
        require(self.max_new_tokens >= 5, "the answer needs at least 5 new tokens")
        require(self.batch is None or self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        require(len(self.variants) > 0, "variants must hold at least one entry ({} = plain)")
        options.check_shared(dict(self.params), flags.scorer_names(self.policies) or STREAMING)
        for v in self.variants:
            require(isinstance(v, dict) and not {"budget", "policy"} & set(v),
                    f"a variant sets cache options other than budget and policy, got {v!r}")
            require(not {"pinned", "seeds", "prefill_window"} & set(v),
                    f"variant {v!r}: pinned, seeds and prefill window are fixed by the "
                    "shared prime")
            for b in self.budgets:  # fail early: unknown fields, too small for the protections
                for p in (self.policies or STREAMING)[:1]:
                    self.cache(b, p, v)

    @classmethod
    def preset(cls, quick: bool, **kw) -> "PasskeyConfig":
        """The config, with each field's ``quick`` value (its metadata) for ``--quick``."""
        return flags.preset(cls, quick, **kw)

    def fitted(self, max_positions: int) -> "PasskeyConfig":
        """Prompts and answers within the model's positions; budgets below them."""
        room = max_positions - self.max_new_tokens - 1
        budgets = tuple(b for b in self.budgets if b < max_positions)
        require(budgets, f"the model's {max_positions} positions fit none of the budgets "
                f"{self.budgets}")
        lengths = tuple(dict.fromkeys(min(n, room) for n in self.lengths))
        return dataclasses.replace(self, budgets=budgets, lengths=lengths)

    def cache(self, budget: int | None, policy: str, variant: dict | None = None) -> CacheParams:
        shared = {**dict(self.params), "budget": budget,
                  **flags.cell_policy("none" if budget is None else policy)}
        own = options.cache_params(shared, strict=False)
        if budget is None:
            return own
        variant = dict(variant or {})
        if variant.get("prefill_scores") == FLIPPED:  # the other way from the scorer's own
            variant["prefill_scores"] = not takes_prefill_scores(make_scorer(own), own)
        try:
            return options.cache_params(variant, own, strict=False)
        except UserError as e:
            raise UserError(f"variant {variant!r}: {e}") from None


def variant_label(v: dict) -> str:
    return ", ".join(f"{k}={val}" for k, val in sorted(v.items())) or "plain"


# --- measurement --------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One column of the grid: ``budget`` None is the full cache."""

    policy: str
    budget: int | None
    variant: dict
    cache: CacheParams


def cells(cfg: PasskeyConfig) -> list[Cell]:
    """Every variant x budget x policy."""
    return [Cell(p, b, v, cfg.cache(b, p, v))
            for v in cfg.variants for b in cfg.budgets for p in cfg.policies]


@dataclass(frozen=True)
class TrialRow:
    """One trial's row: its prompt (the trial's fields, its tokens and filler sentences),
    the answers of the full cache then of each cell (``cells``' order), whether each holds
    the key, and the seconds spent priming, copying and answering."""

    index: int
    key: int
    depth: float
    length: int
    tokens: int
    sentences: int
    answers: list[str]
    hits: list[bool]
    prime_s: float
    copy_s: float
    answer_s: float


ROW = TrialRow  # one item of the grid, as ``--out``'s items.jsonl keeps it


def run_trial(model: Model, policy: TokenPolicy, cfg: PasskeyConfig, trial: Trial,
              grid: list[Cell], tick=None) -> TrialRow:
    """One prompt, primed once, answered with the full cache and in every cell (each from
    a copy of the primed session)."""
    sentences, segs = fit(policy, trial.key, trial.depth, trial.length, cfg.framing)
    n = n_tokens(segs)
    sampler = SamplerParams(greedy=True)
    t0 = time.perf_counter()
    ref = Session(model, policy, sampler, cfg.cache(None, "none"))
    scorers = [make_scorer(c.cache) for c in grid]
    seeded = [s for s, c in zip(scorers, grid) if takes_prefill_scores(s, c.cache, n)]
    stats = ref.prime(segs, arena_capacity(model, ref.cache_params, n, cfg.max_new_tokens),
                      stats=bool(seeded), total=any(reads_total(s) for s in seeded),
                      copy=any(reads_copy(s) for s in seeded))
    t1 = time.perf_counter()
    primed = copy.deepcopy(ref.state) if grid else None
    copy_s = [time.perf_counter() - t1]

    def sessions():  # the full cache, then each cell from a copy, made as a place frees
        yield 0, ref
        for i, cell in enumerate(grid, 1):
            t = time.perf_counter()
            state = copy.deepcopy(primed)
            copy_s[0] += time.perf_counter() - t
            session = Session(model, policy, sampler, cell.cache, state=state)
            if stats is not None:
                session.seed(stats)  # stage 0: the cell's scorer columns, as its own prime's
            yield i, session

    answers: list = [None] * (1 + len(grid))

    def done(i: int, report) -> None:
        report.session.state.check_valid()
        answers[i] = report.session.generated_ids
        if tick:
            tick()

    drive_rows(model, sessions(), cfg.batch or 1, cfg.max_new_tokens, on_done=done)
    texts = [policy.decode(a) for a in answers]
    return TrialRow(**dataclasses.asdict(trial), tokens=n, sentences=sentences, answers=texts,
                    hits=[correct(trial.key, t) for t in texts], prime_s=t1 - t0,
                    copy_s=copy_s[0], answer_s=time.perf_counter() - t1 - copy_s[0])


def _run_trial(trial: Trial) -> TrialRow:
    w = grid.WORKER
    return run_trial(w["model"], w["policy"], w["cfg"], trial, w["grid"])


def run_trials(cfg: PasskeyConfig, model: Model, policy: TokenPolicy, todo: list[Trial],
               pool: Pool = Pool()) -> list[TrialRow]:
    """Every trial's row, in ``todo``'s order, measured by ``pool`` (here, or in worker
    processes that each load the model once); a trial's row does not depend on where it
    ran."""
    cs = cells(cfg)
    return pool.rows(f"pass key: {len(todo)} trials x {1 + len(cs)} cells", todo, 1 + len(cs),
                     lambda t, tick: run_trial(model, policy, cfg, t, cs, tick), _run_trial,
                     cfg, cells, lambda t: t.length)


@dataclass(frozen=True)
class CellRow:
    """A cell's accuracy over the trials (the reference: the full cache, ``budget`` None);
    ``ratio``: its accuracy / the full cache's (None for the reference itself, or where
    the full cache found no key)."""

    policy: str
    budget: int | None
    variant: dict
    variant_label: str
    correct: int
    trials: int
    accuracy: float
    ratio: float | None = None


@dataclass(frozen=True)
class Timing:
    """Seconds summed over the trials."""

    prime_s: float
    copy_s: float
    answer_s: float


@dataclass(kw_only=True)
class PasskeyResult(Result):
    """A run: its config (fitted to the model's positions), the cache options every cell
    starts from (``base``), each trial's row, the full cache's accuracy, each cell's, and
    the time spent."""

    config: PasskeyConfig
    base: dict
    dtype: str
    max_positions: int
    workers: int
    kv: KVCost
    ray: str | None = None
    trials: list[TrialRow]
    reference: CellRow
    runs: list[CellRow]
    timing: Timing


def run(cfg: PasskeyConfig, command: str, pool: Pool = Pool()) -> PasskeyResult:
    """Every measurement, the trials measured by ``pool``."""
    t0 = time.perf_counter()
    machine = Machine.now()
    model = grid.load(cfg.model, cfg.dtype, cfg.device, note=True)
    cfg = cfg.fitted(model.spec.max_positions)
    policy = TokenPolicy(model.tokenizer)
    for n in cfg.lengths:  # fail before the progress bar: each length holds the task
        fit(policy, 10000, 0.5, n, cfg.framing)
    if any(copies(c.cache) for c in cells(cfg)):  # KVzip's copy, likewise
        check_copy(model, policy, max(cfg.lengths))
    todo = trials(cfg.seed, cfg.trials, cfg.lengths)
    longest = max(cfg.lengths) + cfg.max_new_tokens  # a trial's rows: the full cache, the cells
    cfg, choice = pool.batch(cfg, model, len(todo), [(longest, False)] + [
        (longest, c.cache.recall is not None) for c in cells(cfg)])
    workers = pool.workers(len(todo))
    rows = run_trials(cfg, model, policy, todo, pool)
    ref = _cell_row(rows, 0, "none", None, {})
    res = PasskeyResult(
        benchmark="passkey", command=command, model=cfg.model, quick=cfg.quick,
        machine=machine, config=cfg, base=options.settings(dict(cfg.params)), dtype=cfg.dtype,
        max_positions=model.spec.max_positions, workers=workers, kv=KVCost.of(model),
        ray=pool.ray, batch_choice=choice, stage1=model.stage1_path,
        trials=rows, reference=ref,
        runs=[_cell_row(rows, i, c.policy, c.budget, c.variant, ref)
              for i, c in enumerate(cells(cfg), 1)],
        timing=Timing(*(sum(getattr(r, k) for r in rows)
                        for k in ("prime_s", "copy_s", "answer_s"))))
    res.targets = targets(res)
    res.machine = machine.ended()
    res.elapsed_s = time.perf_counter() - t0
    return res


def _cell_row(rows: list[TrialRow], i: int, policy: str, budget: int | None, variant: dict,
              ref: CellRow | None = None) -> CellRow:
    """Cell ``i``'s accuracy (0: the full cache); with ``ref``, its ratio to that."""
    hits = [r.hits[i] for r in rows]
    row = CellRow(policy, budget, variant, variant_label(variant), sum(hits), len(hits),
                  sum(hits) / len(hits))
    if ref is None:
        return row
    return dataclasses.replace(row, ratio=row.accuracy / ref.accuracy if ref.accuracy else None)


# --- analysis -----------------------------------------------------------------------------

def targets(res: PasskeyResult) -> list[Target]:
    """Pass-key accuracy with recall at budget 128 / the full cache >= 0.95, for every cell
    whose variant turns recall on; the drop-only cells are shown beside it."""
    ref, goal = res.reference, f">= {TARGET_RATIO:.2f}"
    at = [r for r in res.runs if r.budget == TARGET_BUDGET]
    recall = [r for r in at if r.variant.get("recall")]
    base = f"the full cache ({ref.correct}/{ref.trials})"

    def target(what: str, r: CellRow) -> Target:
        return Target(f"{what}{r.policy} ({r.variant_label}, {r.correct}/{r.trials}) / {base}",
                      r.ratio, goal, None if r.ratio is None else r.ratio >= TARGET_RATIO)

    out = [target(f"budget {TARGET_BUDGET} with recall, ", r) for r in recall]
    if not recall:
        out.append(Target(f"budget {TARGET_BUDGET} with recall / {base}: not measured "
                          "(no cell recalls culled tokens)", None, goal, None))
    return out + [target(f"budget {TARGET_BUDGET}, drop only (for reference): ", r)
                  for r in at if not r.variant.get("recall")]


def _pct(correct: int, n: int) -> str:
    return f"{100 * correct / n:.0f}% ({correct}/{n})" if n else "–"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _split(res: PasskeyResult, i: int, key) -> dict:
    """Correct and total trials of cell ``i`` (0: the full cache) per ``key(trial)``."""
    out: dict = {}
    for t in res.trials:
        k = key(t)
        c, n = out.get(k, (0, 0))
        out[k] = (c + t.hits[i], n + 1)
    return out


def _depth_bin(t: TrialRow) -> str:
    lo, hi = next((b for b in DEPTH_BINS if t.depth < b[1]), DEPTH_BINS[-1])
    return f"{lo:.0%}-{hi:.0%}"


# --- output -------------------------------------------------------------------------------

def tables(res: PasskeyResult) -> list[Table]:
    cfg, ref = res.config, res.reference
    budgets = cfg.budgets
    cells_by = {(r.policy, r.variant_label, r.budget): r for r in res.runs}
    rows = []
    for v in cfg.variants:
        for p in cfg.policies:
            rs = [cells_by.get((p, variant_label(v), b)) for b in budgets]
            rows.append((p, variant_label(v), *(
                f"{_pct(r.correct, r.trials)}, {_ratio(r.ratio)}" if r else "–" for r in rs)))
    grid = Table(
        f"Pass-key accuracy by budget ({ref.trials} trials per cell; x = / the full cache)",
        ("policy", "variant", *(f"budget {b}" for b in budgets)), tuple(rows),
        f"Full cache (no budget): {_pct(ref.correct, ref.trials)}. Higher is better.")
    named = [("full cache", "–", 0)] + [
        (r.policy, f"{r.variant_label}, budget {r.budget}", i) for i, r in enumerate(res.runs, 1)]
    lengths = sorted({t.length for t in res.trials})
    by_length = Table(
        "Accuracy by prompt length (tokens, at most)", ("cell", "setting", *map(str, lengths)),
        tuple((a, b, *(_pct(*_split(res, i, lambda t: t.length).get(n, (0, 0)))
                       for n in lengths)) for a, b, i in named))
    bins = [f"{lo:.0%}-{hi:.0%}" for lo, hi in DEPTH_BINS]
    by_depth = Table(
        "Accuracy by the key's depth in the filler", ("cell", "setting", *bins),
        tuple((a, b, *(_pct(*_split(res, i, _depth_bin).get(d, (0, 0))) for d in bins))
              for a, b, i in named))
    tm = res.timing
    cost = Table(
        "Time (seconds, summed over the trials; elapsed: the whole run)", ("prime (once per trial)", "copy (deep copies)",
                                      "answers", "mean prompt tokens", "elapsed"),
        ((fmt(tm.prime_s, 1), fmt(tm.copy_s, 1), fmt(tm.answer_s, 1),
          fmt(sum(t.tokens for t in res.trials) / len(res.trials), 0), fmt(res.elapsed_s, 1)),))
    return [target_table(res.targets, digits=3), *([grid] if res.runs else []), by_length,
            by_depth, cost]


def plots(res: PasskeyResult, out: Path) -> list[str]:
    """Accuracy vs budget, one line per policy (and variant), the full cache dotted."""
    cfg = res.config
    if not res.runs:
        return []
    series = {}
    for i, p in enumerate(cfg.policies):
        for j, v in enumerate(cfg.variants):
            label = variant_label(v)
            rs = [r for r in res.runs if r.policy == p and r.variant_label == label]
            if not rs:
                continue
            series[p if len(cfg.variants) == 1 else f"{p}, {label}"] = (
                [r.budget for r in rs], [100 * r.accuracy for r in rs],
                {"color": f"C{i}", "linestyle": ("-", "--", "-.", ":")[j % 4]})
    series["full cache"] = (cfg.budgets, [100 * res.reference.accuracy] * len(cfg.budgets),
                            {"linestyle": ":", "color": "gray"})
    common.line_plot(out / "passkey_vs_budget.png",
                     f"Pass-key accuracy vs budget, {res.model} {res.dtype}",
                     "budget (live cache slots)", "accuracy (%)", series)
    return ["passkey_vs_budget.png"]


def report_md(res: PasskeyResult, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report; ``level`` is the heading level of its title."""
    h = "#" * level
    cfg, sp, ref = res.config, res.base, res.reference
    only = "" if res.runs else " Only the full cache was measured (`--policies none`)."
    lines = [
        f"{h} Pass-key retrieval benchmark",
        "",
        res.regenerate(quick_version=False) + only,
        "",
        f"{model_facts(res)}; "
        f"{len(res.trials)} trials (seed {cfg.seed}), "
        f"prompt lengths {', '.join(map(str, cfg.lengths))} tokens, `{cfg.framing}` "
        f"framing, up to {cfg.max_new_tokens} greedy new tokens; "
        f"{res.machine.facts(threads=res.workers == 1 and res.ray is None)}"
        + grid.where("trials", res)
        + ". Full-cache accuracy: "
        f"**{_pct(ref.correct, ref.trials)}**. Protected from culls: {sp['sinks']} "
        f"sinks, {sp['recent']} recent tokens. "
        + res.kv.sentence(cfg.budgets, max(cfg.lengths), "the longest prompt"),
        "",
    ]
    for tb in tables(res):
        lines += [f"{h}# {tb.title}", "", tb.markdown(), ""]
    if images:
        lines += [f"{h}# Plots", ""] + [f"![{n}]({image_dir}/{n})" for n in images] + [""]
    lines += [f"{h}# Method", "", METHOD]
    return "\n".join(lines) + "\n"


METHOD = """\
- **Prompt** (the classic pass-key prompt): the task ("There is an important info hidden
  inside a lot of irrelevant text. ..."), then filler sentences ("The grass is green. The
  sky is blue. The sun is yellow. Here we go. There and back again." repeated) with the key
  sentence ("The pass key is 48213. Remember it. 48213 is the pass key.") after a fraction
  `depth` of them, then "What is the pass key? The pass key is". As many whole sentences as
  fit the trial's length in tokens. `raw` framing primes this text as it is; `chat` puts all
  but the last four words in a user turn and opens the assistant's turn with them. `raw`
  is the default because SmolLM2-135M-Instruct answers it best with the full cache: 50 of
  the 50 trials of seed 0 (1k-4k tokens) raw, 30 of 50 as a chat turn (12/13, 8/13, 5/12
  and 5/12 at 1k, 2k, 3k and 4k tokens; the misses describe "a magical item that ...").
- **Trials**: trial i's key (5 digits) and depth (uniform in 10-90%) come from the seed and
  i only; lengths are taken in turn. Every cell answers the same trials.
- **Answer**: up to `max_new_tokens` greedy tokens through the real loop (stages 1-4), the
  budget enforced at every step; correct if the key's five digits appear in the answer.
- **Cells**: each trial is primed once without a budget; each cell answers in a fresh
  session over its own deep copy of the primed state, with the cell's cache parameters.
  With a budget below the prompt, the arena holds the whole prompt and
  the first step culls down to the budget: on that step's attention alone, or with prefill
  scores also on the prompt's own (the prime gathers its statistics once; each such cell
  seeds its scorer's columns from them, as its own prime would). The first answer token (a
  space before the digits, for SmolLM2) is computed over the whole prompt, and the digits
  over what that step kept.
- **Variants**: each is a set of cache-parameter overrides and one more run of the whole
  policy x budget grid; `plain` is the cache as configured (each scorer's own prefill
  default), `prefill_scores=flipped` the same with prefill scores the other way round."""


# --- the command line -----------------------------------------------------------------------

FLAGS = (PasskeyConfig, flags.Workers)  # the dataclasses whose fields are its flags
