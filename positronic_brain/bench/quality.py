"""``positronic-brain bench quality``: how much each KV-cache policy forgets.

Streaming perplexity. A long text goes through the real loop one token per step (stages
1-4, the budget enforced at every step); the pending token is always the text's next
token (teacher forcing: ``Session.stream(force=...)``, so stage 4 stays the only
mutation), and each step records the negative log-likelihood stage 1's logits give that
token. Perplexity = exp(mean NLL) over the scored tokens. Measured:

1. the full-cache reference (no budget, nothing culled);
2. every scorer (brightness, streaming, h2o, tova, random) at every budget, with each
   repair (none, merge, fold); and the hindsight oracle (``scorers.oracle``) at every
   budget, which culls the token the full-cache run's later queries attend to least (its
   runs wait for the reference, which records that attention);
3. a long run past the model's positions at one budget with ``--positions compact``
   (re-index before the limit) and ``keep`` (which has to stop at the limit), as
   perplexity over windows of tokens; ``keep`` runs of the long baselines over the same
   tokens (each policy against the full cache over the whole trained range, not only the
   grid's first tokens); and a control run that scores the tokens past the positions
   starting later in the text, so that its positions stay below half the limit (the same
   tokens, the same budget: what crossing the limit costs, apart from the text).

Default text: Python's own English help topics (``pydoc_data.topics``, sorted by key), so
the benchmark runs offline. ``--slice eval`` (the default) scores from the text's start;
``--slice tune`` from its middle, a disjoint part on which scorer parameters are chosen.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..loop import Session, arena_capacity
from ..model import Model, load_model, resolve_device
from ..special_tokens import TokenPolicy
from ..scorers import BASELINES, CULLING
from ..scorers.oracle import NAME as ORACLE, AttentionRecorder, Oracle
from ..types import CacheParams, SamplerParams, Segment, Totals, UserError, require
from . import common
from .common import Table, fmt

SCORERS = CULLING  # the default scorer first, then the baselines
REPAIRS = ("none", "merge", "fold")
SLICES = ("eval", "tune")
# Targets from the project's issues: reported, never asserted.
FULL_TARGET = 1.05  # brightness at FULL_TARGET_BUDGET / the full cache
FULL_TARGET_BUDGET = 512
FLAT_TARGET = 1.10  # long run: perplexity past the positions / at half the positions
GAP_TARGET = 0.5  # the default policy closes this much of the best baseline -> oracle gap
RECALL_TARGET = 1.05  # the long run with recall over the first positions / the full cache
DEFAULT_TEXT = "pydoc_data.topics"


@dataclass(frozen=True)
class QualityConfig:
    """What to measure. ``tokens``: scored tokens per configuration; ``long``: scored
    tokens of the long run (0 = none), at ``long_budget`` with ``long_policy`` (and, up to
    the positions, with each of ``long_baselines``, and with ``long_recall`` with the long
    policy and recall on); ``window``: tokens per perplexity window of the long run."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    quick: bool = False
    text: str = DEFAULT_TEXT
    slice: str = "eval"
    at: float = 0.5  # where the tune slice starts, as a fraction of the text's tokens
    budgets: tuple[int, ...] = (128, 256, 512)
    policies: tuple[str, ...] = SCORERS
    repairs: tuple[str, ...] = REPAIRS
    tokens: int = 1536
    long: int = 10240
    long_budget: int = 512
    long_policy: str = "brightness"
    long_baselines: tuple[str, ...] = ("streaming", "h2o")
    long_repair: str = "none"
    long_recall: bool = True  # the long policy with recall too (positions keep)
    window: int = 512
    base: CacheParams = CacheParams()  # sinks, recent, scorer parameters of every run

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
        bad = [p for p in self.policies + (self.long_policy, *self.long_baselines)
               if p not in CULLING]
        require(not bad and len(self.policies) > 0, f"unknown or non-culling policies {bad}; "
                f"expected some of {', '.join(SCORERS)} (the oracle runs at every budget)")
        require(all(r in REPAIRS for r in self.repairs + (self.long_repair,)),
                f"repairs must be among {REPAIRS}")
        require(self.tokens >= 2, f"tokens must be >= 2, got {self.tokens}")
        require(self.long >= 0 and self.window >= 1, "long must be >= 0 and window >= 1")
        for b in self.budgets:  # fail early: too small for the protections
            self.cache(b, self.policies[0])

    @classmethod
    def preset(cls, quick: bool, **kw) -> "QualityConfig":
        if not quick:
            return cls(**kw)
        return cls(quick=True, **{"budgets": (64,), "tokens": 256, "long": 0, "window": 128,
                                  "long_baselines": ("streaming",), **kw})

    def fitted(self, max_positions: int) -> "QualityConfig":
        """What the model's positions allow: budgets below half of them, a full-cache
        reference (and arena) within them, windows that split the long run's halves."""
        budgets = tuple(b for b in self.budgets if b <= max_positions // 2)
        require(budgets, f"the model's {max_positions} positions fit none of the budgets "
                f"{self.budgets} (each must be <= half of them)")
        return dataclasses.replace(
            self, budgets=budgets, tokens=min(self.tokens, max_positions),
            long_budget=min(self.long_budget, budgets[-1]),
            window=min(self.window, max_positions // 4))

    def cache(self, budget: int | None, policy: str, repair: str = "none",
              positions: str = "compact") -> CacheParams:
        if budget is None:
            return CacheParams(scorer="none")
        return dataclasses.replace(self.base, budget=budget, scorer=policy, repair=repair,
                                   positions=positions)


# --- the text -------------------------------------------------------------------------------

def default_text() -> str:
    """Python's English help topics, concatenated in sorted-key order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def read_text(source: str) -> str:
    if source == DEFAULT_TEXT:
        return default_text()
    try:
        return Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--text {source!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text {source!r}: cannot read it as UTF-8 ({e})") from None


def text_slice(ids: list[int], which: str, need: int, at: float = 0.5) -> tuple[int, list[int]]:
    """``need`` token ids from the ``eval`` slice (the text's first half, from its start) or
    the ``tune`` one (the second half, from ``at`` of the way): the two never overlap.
    Returns (offset, ids)."""
    offset = 0 if which == "eval" else int(len(ids) * at)
    room = len(ids) // 2 if which == "eval" else len(ids) - offset
    require(need <= room, f"the text has {len(ids)} tokens; the {which} slice holds {room}, "
            f"{need} are needed (use a longer --text or fewer --tokens)")
    return offset, ids[offset:offset + need]


# --- measurement ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Streamed:
    """One streaming run: the NLL of every scored token, in text order."""

    nll: tuple[float, ...]
    stop_reason: str
    totals: Totals
    oracle: Oracle | None = field(default=None, compare=False, repr=False)  # ``record``'s

    @property
    def ppl(self) -> float:
        return perplexity(self.nll)


def perplexity(nll) -> float:
    return math.exp(sum(nll) / len(nll))


def windows(nll, size: int) -> list[dict]:
    """Perplexity over consecutive windows of ``size`` scored tokens: [{start, end, ppl}]."""
    return [{"start": i, "end": min(i + size, len(nll)), "ppl": perplexity(nll[i:i + size])}
            for i in range(0, len(nll), size)]


def streaming_nll(model: Model, policy: TokenPolicy, ids: list[int], cache: CacheParams,
                  tick=None, record: int = 0, oracle: Oracle | None = None) -> Streamed:
    """Prime ``ids[0]``, then one step per following token through ``Session.step``, each
    forced to the text's next token; the NLL of ``ids[t]`` comes from the step that ran
    ``ids[t-1]``. Without a budget the arena holds the whole text (within the positions);
    with ``positions=keep`` the run stops at the model's positions. ``record`` (full cache
    only): the first ``record`` queries' attention becomes ``Streamed.oracle``; ``oracle``:
    the scorer of a run with scorer ``oracle``, from such a run over the same text."""
    require(len(ids) >= 2, "streaming perplexity needs at least 2 tokens")
    require(not record or cache.budget is None, "only a full-cache run records the oracle")
    require((oracle is not None) == (cache.scorer == ORACLE),
            "an oracle run needs the full-cache run's oracle, and only it takes one")
    recorder = AttentionRecorder(record, cache.aggregate, ids) if record else None
    session = Session(model, policy, SamplerParams(greedy=True), cache,
                      scorer=recorder or oracle)
    session.prime([Segment((ids[0],), "user")], arena_capacity(model, cache, 1, len(ids) - 1))
    nll, totals = [], Totals()
    for rec in session.stream(len(ids) - 1, ignore_eos=True, force=ids[1:]):
        nll.append(-rec.logprob)
        totals.add(rec)
        if tick:
            tick()
    session.state.check_valid()
    require(not recorder or len(nll) >= record, f"the full cache scored {len(nll)} tokens, "
            f"the oracle needs {record}")
    return Streamed(tuple(nll), session.stop_reason, totals,
                    recorder.oracle() if recorder else None)


def _row(s: Streamed, **what) -> dict:
    return {**what, "ppl": s.ppl, "scored": len(s.nll), "stop_reason": s.stop_reason,
            "culled": s.totals.culled, "merged": s.totals.merged, "folded": s.totals.folded,
            "reindexed": s.totals.reindexed, "recalled": s.totals.recalled,
            "ms_per_token": s.totals.ms_per_token}


@dataclass(frozen=True)
class Job:
    """One streaming run: ``cache`` over the slice's ``tokens`` + 1 ids from ``start``;
    ``steps`` is how many it can score (``keep`` stops at the model's positions);
    ``record``: the oracle's queries the run records (the reference)."""

    kind: str  # reference | grid | oracle | long | control
    label: str
    cache: CacheParams
    tokens: int
    steps: int
    start: int = 0
    record: int = 0

    def ids(self, ids: list[int]) -> list[int]:
        return ids[self.start:self.start + self.tokens + 1]


def plan(cfg: QualityConfig, limit: int) -> list[Job]:
    """The reference, the grid, the oracle, the long runs and the control. The reference
    streams the long run's tokens too, up to the positions: a causal model's NLL of the
    first tokens does not depend on what follows, so its prefix is the grid's; it records
    the grid's attention for the oracle runs. The long run has no oracle (no full cache
    goes past the positions). The control scores the last ``limit / 2`` tokens of the
    long run, from ``long - limit / 2``."""
    ref = min(max(cfg.tokens, cfg.long), limit)
    jobs = [Job("reference", "full cache", cfg.cache(None, "none"), ref, ref, record=cfg.tokens)]
    if cfg.long:
        long = lambda p, positions: cfg.cache(cfg.long_budget, p, cfg.long_repair, positions)  # noqa: E731
        jobs.append(Job("long", f"long run, {cfg.long_policy}, positions compact",
                        long(cfg.long_policy, "compact"), cfg.long, cfg.long))
        for p in (cfg.long_policy, *cfg.long_baselines):
            jobs.append(Job("long", f"long run, {p}, positions keep", long(p, "keep"),
                            cfg.long, min(cfg.long, limit)))
        if cfg.long_recall:
            jobs.append(Job("long", f"long run, {cfg.long_policy} with recall, positions keep",
                            dataclasses.replace(long(cfg.long_policy, "keep"), recall=True),
                            cfg.long, min(cfg.long, limit)))
        if cfg.long > limit:
            n = limit // 2
            jobs.append(Job("control", f"control, from token {cfg.long - n}",
                            long(cfg.long_policy, "compact"), n, n, cfg.long - n))
    jobs += [Job("grid", f"{p} budget {b}, {r} repair", cfg.cache(b, p, r), cfg.tokens,
                 cfg.tokens) for b in cfg.budgets for p in cfg.policies for r in cfg.repairs]
    jobs += [Job("oracle", f"oracle budget {b}", cfg.cache(b, ORACLE), cfg.tokens, cfg.tokens)
             for b in cfg.budgets]
    return jobs


_WORKER: dict = {}  # a pool worker's model, policy, ids and tick queue


def _init_worker(model: str, dtype: str, device: str, ids: list[int], queue) -> None:
    import torch

    torch.set_num_threads(1)  # one thread per worker: parallel runs, not parallel matmuls
    m = load_model(model, dtype, device)
    _WORKER.update(model=m, policy=TokenPolicy(m.tokenizer), ids=ids, queue=queue)


def _run_job(i: int, job: Job, oracle: Oracle | None = None) -> Streamed:
    w, count = _WORKER, [0]

    def tick() -> None:  # every 16 tokens: the queue is shared by every worker
        count[0] += 1
        if count[0] % 16 == 0:
            w["queue"].put((i, 16))

    return streaming_nll(w["model"], w["policy"], job.ids(w["ids"]), job.cache, tick,
                         job.record, oracle)


def _recorded(jobs: list[Job], results: list) -> Oracle:
    """The oracle recorded by the one job that records it (run before any oracle job)."""
    (i,) = [i for i, j in enumerate(jobs) if j.record]
    return results[i].oracle


def execute(cfg: QualityConfig, jobs: list[Job], ids: list[int], workers: int) -> list[Streamed]:
    """Run ``jobs`` with a progress bar each: here (``workers`` = 1) or in that many
    single-thread processes (each loads the model once). Oracle jobs start once the
    reference (the job that records their oracle) is done."""
    first = [i for i, j in enumerate(jobs) if j.kind != "oracle"]
    later = [i for i, j in enumerate(jobs) if j.kind == "oracle"]
    results: list = [None] * len(jobs)
    with common.progress() as task:
        ticks = [task(j.label, j.steps) for j in jobs]
        if workers == 1:
            model = load_model(cfg.model, cfg.dtype, cfg.device)
            policy = TokenPolicy(model.tokenizer)
            for i in first + later:
                j = jobs[i]
                results[i] = streaming_nll(model, policy, j.ids(ids), j.cache, ticks[i], j.record,
                                           _recorded(jobs, results) if i in later else None)
            return results
        import multiprocessing as mp
        import queue as queue_mod
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
        q = ctx.Queue()
        with ProcessPoolExecutor(workers, ctx, _init_worker,
                                 (cfg.model, cfg.dtype, cfg.device, ids, q)) as pool:
            futures = {i: pool.submit(_run_job, i, jobs[i]) for i in first}
            (rec,) = [i for i in first if jobs[i].record] if later else [None]
            while len(futures) < len(jobs) or not all(f.done() for f in futures.values()):
                if len(futures) < len(jobs) and futures[rec].done():
                    oracle = futures[rec].result().oracle
                    futures.update({i: pool.submit(_run_job, i, jobs[i], oracle) for i in later})
                try:
                    i, n = q.get(timeout=0.2)
                except queue_mod.Empty:
                    continue
                for _ in range(n):
                    ticks[i]()
            return [futures[i].result() for i in range(len(jobs))]


def run(cfg: QualityConfig, command: str, workers: int = 1) -> dict:
    """Every measurement, as one JSON-ready dict."""
    t0 = time.perf_counter()
    info = common.machine()
    model = load_model(cfg.model, cfg.dtype, cfg.device)
    limit = model.spec.max_positions
    cfg = cfg.fitted(limit)
    text = read_text(cfg.text)
    all_ids = TokenPolicy(model.tokenizer).encode(text)
    del model
    offset, ids = text_slice(all_ids, cfg.slice, max(cfg.tokens, cfg.long) + 1, cfg.at)
    res = {"benchmark": "quality", "command": command, "model": cfg.model, "dtype": cfg.dtype,
           "quick": cfg.quick, "machine": info, "max_positions": limit, "workers": workers,
           "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"},
           "text": {"source": cfg.text, "chars": len(text), "tokens": len(all_ids),
                    "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
                    "slice": cfg.slice, "offset": offset}}
    jobs = plan(cfg, limit)
    # Longest first: they pack best into the workers.
    cost = [j.steps * (2 if j.cache.repair == "merge" else 1) for j in jobs]
    order = sorted(range(len(jobs)), key=lambda i: -cost[i])
    out = execute(cfg, [jobs[i] for i in order], ids, min(workers, len(jobs)))
    done = [(jobs[i], s) for i, s in sorted(zip(order, out))]
    ref = next(s for j, s in done if j.kind == "reference")
    res["reference"] = {**_row(dataclasses.replace(ref, nll=ref.nll[:cfg.tokens]),
                               policy="none", repair="none", budget=None),
                        "ppl_all": ref.ppl, "scored_all": len(ref.nll),
                        "windows": windows(ref.nll, cfg.window)}
    res["runs"] = [_row(s, policy=j.cache.scorer, repair=j.cache.repair, budget=j.cache.budget)
                   for j, s in done if j.kind == "grid"]
    res["oracle"] = [_row(s, policy=j.cache.scorer, repair=j.cache.repair, budget=j.cache.budget)
                     for j, s in done if j.kind == "oracle"]
    res["long"] = [{**_row(s, policy=j.cache.scorer, repair=j.cache.repair, budget=j.cache.budget,
                           positions=j.cache.positions, recall=j.cache.recall),
                    "windows": windows(s.nll, cfg.window)}
                   for j, s in done if j.kind == "long"]
    res["control"] = None
    for j, s in done:
        if j.kind == "control":
            compact = next(c for k, c in done if k.kind == "long" and k.cache.positions == "compact")
            # scored token i of a run from ``start`` is the text's token start + 1 + i
            lo, hi = limit - j.start, len(s.nll)
            res["control"] = {**_row(s, policy=j.cache.scorer, repair=j.cache.repair,
                                     budget=j.cache.budget, positions=j.cache.positions),
                              "start": j.start, "tokens": [limit + 1, j.start + hi + 1],
                              "positions_scored": [lo, hi],
                              "ppl_past": perplexity(s.nll[lo:hi]),
                              "ppl_compact": perplexity(compact.nll[limit:j.start + hi])}
    res["targets"] = targets(res)
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["elapsed_s"] = time.perf_counter() - t0
    return res


# --- analysis -------------------------------------------------------------------------------

def best(runs: list[dict], budget: int, policies) -> dict | None:
    """The lowest-perplexity run at ``budget`` among ``policies`` (any repair setting)."""
    rows = [r for r in runs if r["budget"] == budget and r["policy"] in policies]
    return min(rows, key=lambda r: r["ppl"]) if rows else None


def _label(r: dict) -> str:
    return f"{r['policy']} ({r['repair']} repair)"


def gap(res: dict, budget: int) -> tuple[dict, dict] | None:
    """(the best baseline run, the oracle run) at ``budget``, if the oracle beats it."""
    base = best(res["runs"], budget, BASELINES)
    oracle = next((r for r in res.get("oracle", ()) if r["budget"] == budget), None)
    return (base, oracle) if base and oracle and oracle["ppl"] < base["ppl"] else None


def gap_closed(res: dict, run: dict) -> float | None:
    """The fraction of the gap between the best baseline and the oracle at the run's budget
    that the run closes: (ppl(best baseline) - ppl(run)) / (ppl(best baseline) - ppl(oracle));
    0 = no better than the best baseline, 1 = as good as the oracle. None without a gap."""
    g = gap(res, run["budget"])
    return None if g is None else (g[0]["ppl"] - run["ppl"]) / (g[0]["ppl"] - g[1]["ppl"])


def long_flatness(res: dict) -> dict | None:
    """Compact long run: perplexity of the window ending at half the positions vs the worst
    window wholly past the positions (different text: the control run compares the same)."""
    compact = next((r for r in res["long"] if r["positions"] == "compact"), None)
    if compact is None:
        return None
    half, limit = res["max_positions"] // 2, res["max_positions"]
    # Window i scores the tokens at steps start+1..end, which run at positions start..end-1.
    at_half = next((w for w in compact["windows"] if w["start"] < half <= w["end"]), None)
    past = [w for w in compact["windows"] if w["start"] >= limit]
    if at_half is None or not past:
        return None
    worst = max(past, key=lambda w: w["ppl"])
    return {"half": half, "limit": limit, "ppl_half": at_half["ppl"], "window_half": at_half,
            "ppl_past": worst["ppl"], "window_past": worst,
            "ratio": worst["ppl"] / at_half["ppl"]}


def targets(res: dict) -> list[dict]:
    out = []
    runs = res["runs"]
    for b in res["config"]["budgets"]:
        ours, base = best(runs, b, ("brightness",)), best(runs, b, BASELINES)
        if ours and base:
            out.append({"what": f"budget {b}: brightness ({ours['repair']} repair, "
                                f"{ours['ppl']:.3f}) / the best baseline, {_label(base)[:-1]}, "
                                f"{base['ppl']:.3f})",
                        "value": ours["ppl"] / base["ppl"], "target": "<= 1.00",
                        "met": ours["ppl"] <= base["ppl"]})
    default = CacheParams()
    for b in res["config"]["budgets"]:  # no recall exists yet: the default policy without it
        ours = next((r for r in runs if (r["budget"], r["policy"], r["repair"])
                     == (b, default.scorer, default.repair)), None)
        base = best(runs, b, BASELINES)
        oracle = next((r for r in res.get("oracle", ()) if r["budget"] == b), None)
        if not (ours and base and oracle):
            continue
        what = (f"budget {b}: {default.scorer} ({default.repair} repair, no recall yet, "
                f"{ours['ppl']:.3f}) closes this fraction of the gap between the best baseline, "
                f"{_label(base)[:-1]}, {base['ppl']:.3f}) and the oracle ({oracle['ppl']:.3f})")
        value = gap_closed(res, ours)  # None (met: None) where the oracle is no better
        out.append({"what": what + ("" if value is not None else ": the oracle does not beat "
                                    "the best baseline, no gap"),
                    "value": value, "target": f">= {GAP_TARGET:.2f}",
                    "met": None if value is None else value >= GAP_TARGET})
    ours = best(runs, FULL_TARGET_BUDGET, ("brightness",))
    ref = res["reference"]
    if ours:
        ratio = ours["ppl"] / ref["ppl"]
        out.append({"what": f"budget {FULL_TARGET_BUDGET}: brightness ({ours['repair']} repair, "
                            f"{ours['ppl']:.3f}) / the full cache ({ref['ppl']:.3f}), the first "
                            f"{ours['scored']} tokens ({FULL_TARGET_BUDGET} before any cull)",
                    "value": ratio,
                    "target": f"<= {FULL_TARGET:.2f}", "met": ratio <= FULL_TARGET})
    keep = {r["policy"]: r for r in res["long"]
            if r["positions"] == "keep" and not r.get("recall")}
    first = next(iter(keep.values()), None)
    if first and first["scored"] == ref.get("scored_all"):
        lead, rest = keep.get("brightness"), [r for p, r in keep.items() if p != "brightness"]
        n, b = first["scored"], first["budget"]
        if lead and rest:
            base = min(rest, key=lambda r: r["ppl"])
            out.append({"what": f"budget {b}, the first {n} tokens: brightness "
                                f"({lead['ppl']:.3f}) / the best long baseline, "
                                f"{base['policy']} ({base['ppl']:.3f})",
                        "value": lead["ppl"] / base["ppl"], "target": "<= 1.00",
                        "met": lead["ppl"] <= base["ppl"]})
        if lead and b == FULL_TARGET_BUDGET:
            ratio = lead["ppl"] / ref["ppl_all"]
            out.append({"what": f"budget {b}, the first {n} tokens: brightness "
                                f"({lead['ppl']:.3f}) / the full cache ({ref['ppl_all']:.3f})",
                        "value": ratio, "target": f"<= {FULL_TARGET:.2f}",
                        "met": ratio <= FULL_TARGET})
    for r in res["long"]:
        if r.get("recall") and r["scored"] == ref.get("scored_all"):
            ratio = r["ppl"] / ref["ppl_all"]
            out.append({"what": f"budget {r['budget']}, the first {r['scored']} tokens: "
                                f"{r['policy']} with recall ({r['ppl']:.3f}, {r['recalled']} "
                                f"recalled) / the full cache ({ref['ppl_all']:.3f})",
                        "value": ratio, "target": f"<= {RECALL_TARGET:.2f}",
                        "met": ratio <= RECALL_TARGET})
    flat = long_flatness(res)
    if flat:
        out.append({"what": f"compact positions: the worst window past {flat['limit']} "
                            f"({flat['ppl_past']:.3f}) / the window at {flat['half']} "
                            f"({flat['ppl_half']:.3f}), different text", "value": flat["ratio"],
                    "target": f"<= {FLAT_TARGET:.2f}", "met": flat["ratio"] <= FLAT_TARGET})
    c = res.get("control")
    if c:
        ratio = c["ppl_compact"] / c["ppl_past"]
        a, z = c["tokens"]
        out.append({"what": f"compact positions: tokens {a}-{z - 1}, past the positions "
                            f"({c['ppl_compact']:.3f}) / the same tokens at positions "
                            f"{c['positions_scored'][0]}-{c['positions_scored'][1] - 1} "
                            f"(control run from token {c['start']}, {c['ppl_past']:.3f})",
                    "value": ratio, "target": f"<= {FLAT_TARGET:.2f}",
                    "met": ratio <= FLAT_TARGET})
    return out


# --- output ---------------------------------------------------------------------------------

def tables(res: dict) -> list[Table]:
    ref = res["reference"]["ppl"]
    budgets = res["config"]["budgets"]
    cells = {(r["policy"], r["repair"], r["budget"]): r for r in res["runs"]}
    rows = []
    for p in res["config"]["policies"]:
        for rep in res["config"]["repairs"]:
            rs = [cells.get((p, rep, b)) for b in budgets]
            rows.append((p, rep, *(f"{r['ppl']:.3f} ({r['ppl'] / ref:.3f}x)" if r else "–"
                                   for r in rs)))
    oracle = {r["budget"]: r for r in res.get("oracle", ())}
    if oracle:
        rows.append(("oracle (hindsight)", "none",
                     *(f"{oracle[b]['ppl']:.3f} ({oracle[b]['ppl'] / ref:.3f}x)" if b in oracle
                       else "–" for b in budgets)))
    ppl = Table(
        f"Streaming perplexity by budget ({res['config']['tokens']} scored tokens; "
        "x = / full cache)",
        ("policy", "repair", *(f"budget {b}" for b in budgets)), tuple(rows),
        f"Full cache (no budget): {ref:.3f}. Lower is better. The oracle culls the token the "
        "full-cache run's later queries attend to least (it knows the future: a reference "
        "point, not a policy, and no strict bound: a culled cache is attended differently).")
    bases = [best(res["runs"], b, BASELINES) for b in budgets]
    closed = Table(
        "Gap closed: (best baseline - policy) / (best baseline - oracle), by budget",
        ("policy", "repair", *(f"budget {b}" for b in budgets)),
        (("best baseline", "", *(f"{_label(r)} {r['ppl']:.3f}" if r else "–" for r in bases)),
         ("oracle (hindsight)", "none", *(fmt(oracle[b]["ppl"] if b in oracle else None, 3)
                                          for b in budgets)),
         *((p, rep, *(fmt(None if r is None else gap_closed(res, r), 2)
                      for r in (cells.get((p, rep, b)) for b in budgets)))
           for p in res["config"]["policies"] for rep in res["config"]["repairs"])),
        "1 = as good as the oracle, 0 = as the best baseline (the best of "
        f"{', '.join(BASELINES)}, any repair), below 0 = worse. – : no run, or the oracle "
        "does not beat the best baseline there.")
    target = Table(
        "Targets (reported, not asserted)", ("what", "value", "target", "met"),
        tuple((t["what"], fmt(t["value"], 4), t["target"],
               "–" if t["met"] is None else "yes" if t["met"] else "NO")
              for t in res["targets"]))
    cost = Table(
        "Per run: ms per token (whole loop step), culls (and how many folded), merges",
        ("policy", "repair", "budget", "ms/token", "culled", "folded", "merged", "stop"),
        tuple((r["policy"], r["repair"], str(r["budget"]), fmt(r["ms_per_token"], 1),
               str(r["culled"]), str(r["folded"]), str(r["merged"]), r["stop_reason"])
              for r in [res["reference"], *res["runs"], *res.get("oracle", ())]))
    out = [target, ppl, closed] if oracle else [target, ppl]
    if res["long"]:
        ws = {_long_label(r): {w["end"]: w["ppl"] for w in r["windows"]} for r in res["long"]}
        ws["full cache"] = {w["end"]: w["ppl"] for w in res["reference"]["windows"]}
        ends = sorted(set().union(*ws.values()))
        first = res["long"][0]
        out.append(Table(
            f"Long run: perplexity per window of {res['config']['window']} tokens "
            f"(budget {first['budget']}, {first['repair']} repair)",
            ("tokens up to", *ws), tuple((str(e), *(fmt(ws[p].get(e), 3) for p in ws))
                                         for e in ends)
            + (("all", *(fmt(r["ppl"], 3) for r in res["long"]),
                fmt(res["reference"]["ppl_all"], 3)),),
            " ".join(f"{_long_label(r)}: {r['scored']} tokens scored, stopped by "
                     f"{r['stop_reason']}, {r['reindexed']} re-index(es)"
                     + (f", {r['recalled']} recalled" if r.get("recall") else "") + "."
                     for r in res["long"])
            + f" The model has {res['max_positions']} positions: `keep` and the full cache "
              "stop there. No oracle here: it needs a full-cache pass, which cannot go past "
              "the positions."))
    out.append(cost)
    return out


def plots(res: dict, out: Path) -> list[str]:
    """PNG plots into ``out``; returns their file names."""
    series = {}
    budgets = res["config"]["budgets"]
    for i, p in enumerate(res["config"]["policies"]):  # colour: policy; line: repair
        for rep in res["config"]["repairs"]:
            rs = [r for r in res["runs"] if r["policy"] == p and r["repair"] == rep]
            series[f"{p}{'' if rep == 'none' else ' + ' + rep}"] = (
                [r["budget"] for r in rs], [r["ppl"] for r in rs],
                {"color": f"C{i}", "linestyle": {"none": "-", "merge": "--"}.get(rep, "-.")})
    ref = res["reference"]["ppl"]
    oracle = res.get("oracle", ())
    if oracle:
        series["oracle (hindsight)"] = ([r["budget"] for r in oracle], [r["ppl"] for r in oracle],
                                        {"linestyle": "-", "color": "black"})
    series["full cache"] = (budgets, [ref] * len(budgets), {"linestyle": ":", "color": "gray"})
    common.line_plot(out / "ppl_vs_budget.png",
                     f"Streaming perplexity vs budget, {res['model']} {res['dtype']}",
                     "budget (live cache slots)", "perplexity", series)
    images = ["ppl_vs_budget.png"]
    if res["long"]:
        _long_plot(res, out / "ppl_long.png")
        images.append("ppl_long.png")
    return images


def _long_plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5.2), dpi=110)
    for r in res["long"]:
        ax.step([w["end"] for w in r["windows"]], [w["ppl"] for w in r["windows"]], where="pre",
                label=f"{r['policy']} budget {r['budget']}, positions {r['positions']}"
                + (", recall" if r.get("recall") else ""),
                linestyle="-" if r["positions"] == "compact" else "--")
    ref = res["reference"]
    ax.step([w["end"] for w in ref["windows"]], [w["ppl"] for w in ref["windows"]], where="pre",
            label="full cache", linestyle=":", color="gray")
    ax.axvline(res["max_positions"], color="red", alpha=0.5, label="the model's positions")
    ax.set_title(f"Perplexity per {res['config']['window']}-token window, {res['model']}")
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("perplexity")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def missed_notes(res: dict) -> list[str]:
    return [f"- **Missed: {t['what']}**: {t['value']:.4f}, target {t['target']}."
            for t in res["targets"] if t["met"] is False]


def _long_label(r: dict) -> str:
    """``brightness keep``, ``brightness keep recall``: a long run's column."""
    return f"{r['policy']} {r['positions']}" + (" recall" if r.get("recall") else "")


def report_md(res: dict, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report; ``level`` is the heading level of its title."""
    h = "#" * level
    m, t = res["machine"], res["text"]
    sp = res["config"]["base"]
    lines = [
        f"{h} Quality benchmark: streaming perplexity"
        + (" (tune slice)" if t["slice"] == "tune" else ""),
        "",
        common.regenerate(res),
        "",
        f"{common.model_facts(res)}; text `{t['source']}` ({t['tokens']:,} tokens, sha256 "
        f"{t['sha256']}…), slice `{t['slice']}` from token {t['offset']:,}; "
        f"{common.machine_facts(m)}. Protected from culls: {sp['sinks']} sinks, "
        f"{sp['recent']} recent tokens. Brightness: decay {sp['decay']}, gain {sp['gain']}, "
        f"signal {sp['signal']}, aggregation {sp['aggregate']}, "
        f"skip layers {sp.get('skip_layers', 0.0)}, max {sp['max_brightness']}.",
        "",
    ]
    for tb in tables(res):
        lines += [f"{h}# {tb.title}", "", tb.markdown(), ""]
        if tb.title.startswith("Targets"):
            lines += missed_notes(res) + [""] if missed_notes(res) else []
    lines += [f"{h}# Plots", ""]
    lines += [f"![{name}]({image_dir}/{name})" for name in images]
    lines += ["", f"{h}# Method", "", METHOD + f"  This report is `{t['slice']}`.\n"]
    return "\n".join(lines) + "\n"


METHOD = """\
- **Streaming perplexity**: the slice's first token is primed; every step runs the pending
  token through stages 1-4 (`Session.stream(force=...)`): stage 1's logits give the NLL of
  the text's next token, which becomes the pending token (teacher forcing; nothing is
  sampled), stage 2 scores, stage 3 culls to the budget (and merges a dim pair with merge
  repair, or folds each culled token's K/V into its most alike survivor with fold repair),
  stage 4 applies. Perplexity = exp(mean NLL) over every scored token, so the first
  `budget` tokens (before any cull) are the same for every policy.
- **Full cache**: the same loop without a budget; it checks against Hugging Face's own
  forward over the whole text in `tests/test_bench_quality.py` (NLL equal to 1e-4).
- **Oracle** (hindsight, a reference point, not a policy): the full-cache run records each
  step's attention row by token (aggregated as the scorers do, `all-mean` by default); the
  oracle runs at each budget (no repair, the same sinks and recent tokens protected) score
  a live token by the attention the text's later queries paid it in the full cache, so the
  token the future needs least goes first (Belady-style). *Gap closed* = (best baseline -
  policy) / (best baseline - oracle) in perplexity, the best baseline being the lowest of
  the non-default scorers (any repair) at that budget. The oracle is no strict bound (the
  queries of a culled cache attend differently from the full cache's); where it does not
  beat the best baseline there is no gap, and the fractions read `–`. The long run has no
  oracle.
- **Long run**: one configuration streamed past the model's positions. `compact` re-indexes
  the live cache to positions 0..n-1 (keys re-rotated exactly) when the next position
  would leave the trained range; `keep` never does, so it stops at the limit. The long
  baselines run `keep` over the same tokens, so every long policy meets the full cache
  over the whole trained range, not only over the grid's first tokens (where the first
  `budget` tokens are shared by all). The control run streams the tokens past the limit
  again from later in the text, so they are scored at positions below half the limit with
  the same budget: the text is the same, only the positions differ.
- **Slices**: `eval` scores from the text's start, `tune` from its middle; scorer defaults
  are chosen on `tune` only (`--slice tune`), never on `eval`."""


def command_line(args) -> str:
    return common.command_line("quality", args, (
        ("model", "smollm2"), ("dtype", None), ("device", "cpu"), ("text", None), ("slice", None), ("at", None),
        ("budgets", None), ("policies", None), ("repairs", None), ("params", None),
        ("tokens", None), ("long", None), ("out", None), ("report", None)))


def config_from_args(args) -> QualityConfig:
    kw = {"model": args.model, "dtype": args.dtype or "float32",
          "device": str(resolve_device(args.device))}
    if args.text is not None:
        kw["text"] = args.text
    if args.slice is not None:
        kw["slice"] = args.slice
    if args.at is not None:
        kw["at"] = args.at
    if args.budgets is not None:
        kw["budgets"] = common.ints(args.budgets, "budgets")
    if args.policies is not None:
        kw["policies"] = tuple(p.strip() for p in args.policies.split(","))
    if args.tokens is not None:
        kw["tokens"] = args.tokens
    if args.long is not None:
        kw["long"] = args.long
    if args.repairs is not None:
        kw["repairs"] = tuple(r.strip() for r in args.repairs.split(","))
    if args.params is not None:
        kw["base"] = base_params(args.params)
    return QualityConfig.preset(args.quick, **kw)


def base_params(text: str) -> CacheParams:
    """``--params decay=1,gain=200,seeds=128:128:128:128`` -> CacheParams with those fields
    (tuples take ``:``-separated values); budget, policy, repair and positions are the
    benchmark's own axes."""
    fields = {f.name: f for f in dataclasses.fields(CacheParams)}
    kw = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip().replace("-", "_")
        require(name in fields and name not in ("budget", "scorer", "repair", "positions"),
                f"--params: unknown or fixed field {name!r}")
        default = getattr(CacheParams(), name)
        try:
            if isinstance(default, tuple):
                kind = float if name == "seeds" else str
                kw[name] = tuple(kind(v) for v in value.split(":")) if value else ()
            elif isinstance(default, str):
                kw[name] = value
            else:
                kw[name] = type(default)(value) if default is not None else int(value)
        except ValueError:
            raise UserError(f"--params: bad value for {name}: {value!r}") from None
    return CacheParams(**kw)


def main(args) -> int:
    """The CLI entry: measure, then print tables (or one JSON object) and write files."""
    cfg = config_from_args(args)  # validate before the slow part
    out = common.out_dir(args)
    jobs = args.jobs if args.jobs is not None else os.cpu_count() or 1
    require(jobs >= 1, f"--jobs must be >= 1, got {jobs}")
    res = run(cfg, command_line(args), jobs)
    # the tune slice's report is a section of its own: it never replaces the eval one
    common.emit(res, args, out, "quality" if cfg.slice == "eval" else "quality-tune", plots,
                report_md, tables)
    return 0
