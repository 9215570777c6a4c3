"""``bench speed``'s throughput of a batch (``batch``; ``run --prompts --batch B``): tokens
a second for B rows a step, stage 1 alone at the decode contexts and the whole loop at the
budget, against one row at a time (B = 1: ``Session.step``, the solo path)."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from . import common, flags
from .. import options
from ..batch import step_rows
from ..loop import Session
from ..model import Model, for_rows
from ..sampler import make_generator
from ..special_tokens import TokenPolicy
from ..stages.apply import prime
from ..stages.generate import generate, generate_rows
from ..types import SamplerParams, Segment
from .common import Table, fmt
from .result import Target

GREEDY = SamplerParams(greedy=True)
SAMPLED = SamplerParams()  # the default rule: a draw a row every step
SPEEDUP_BATCH, SPEEDUP_TARGET = 8, 4.0  # B = 8: at least 4x the tokens/s of B = 1 ...
OVERHEAD_TARGET = 1.15  # ... and its loop step at most 1.15x its stage 1
# the loop's settings: (repair, recall, sampler)
LOOPS = (("none", False, GREEDY), ("fold", False, GREEDY), ("none", True, GREEDY),
         ("none", False, SAMPLED))
RECALL_COLD = 1024  # the loop with recall: cold tokens a row (its prime culls them), at most


@dataclass(frozen=True, kw_only=True)
class BatchRow:
    """B rows stepped together: ``what`` is "stage 1" (at ``context`` live slots a row) or
    "loop REPAIR" (the whole loop at the budget, brightness, greedy; "none + recall" with a
    cold store; "none, sampled" a draw by the default rule). ``ms``: one step of all B rows;
    ``tokens_s``: B tokens over it; ``speedup``: over one row's tokens/s, that row (the same
    what and context) stepped alone in turn with the B rows in every repetition
    (``paired``), so that a change of the machine's pace between two cells does not show as
    a speedup; ``ceiling``: the most it could be where a step reads the weights once and
    each row's live K/V once (``ceiling``); a loop row's ``stage1_ms`` is stage 1 of its
    rows, ``overhead`` its step over that, ``row_ms`` stages 2-4 a row."""

    dtype: str
    what: str
    context: int
    batch: int
    stage1: str = "plain"  # how stage 1 runs: plain, or the model's ``compiled`` mode
    ms: float
    tokens_s: float
    speedup: float | None = None
    ceiling: float | None = None
    stage1_ms: float | None = None
    overhead: float | None = None
    row_ms: float | None = None


def _stage1(model: Model, rows_model: Model, views: list, gens: list,
            sampler: SamplerParams = GREEDY):
    """Stage 1 of ``views`` under ``sampler``: alone (B = 1, the solo ``generate``), or all
    at once."""
    if len(views) == 1:
        return lambda: generate(model, views[0], sampler, gens[0])
    return lambda: generate_rows(rows_model, views, [sampler] * len(views), gens,
                                 [None] * len(views))


def ceiling(batch: int, context: int, weight_bytes: int, kv_bytes_per_token: int) -> float:
    """The speedup of ``batch`` rows over one at ``context`` live slots a row where the bytes
    read bound a step: one row reads the weights and its K/V a token, B rows the weights
    once and B rows' K/V for B tokens."""
    one = weight_bytes + context * kv_bytes_per_token
    return batch * one / (weight_bytes + batch * context * kv_bytes_per_token)


def paired(b: int, ms: float, one_ms: float | None) -> float:
    """B rows' tokens/s over one row's, from the medians of a step of the B rows (``ms``)
    and of one row's step (``one_ms``) timed in turn with it (None: B is 1)."""
    return 1.0 if one_ms is None else b * one_ms / ms


def measure(model: Model, cfg, task, random_prompt, weight_bytes: int,
            kv_bytes_per_token: int) -> list[BatchRow]:
    """For each B of ``cfg.batches`` (the model packed for B rows, one copy at a time):
    stage 1 of B rows at each of ``cfg.batch_contexts`` live slots, each row a copy of one
    prime's state (so each reads K/V of its own), then the whole loop at ``cfg.budget`` for
    each of ``LOOPS``, each row a copy of one primed session at its budget; beside each,
    in every repetition, one row alone (``BatchRow.speedup``).
    ``random_prompt(model, n, seed)`` gives the primes' tokens; ``weight_bytes`` and
    ``kv_bytes_per_token`` (what a token reads) each row's ``ceiling``."""
    dt, out, most, how = model.precision, [], max(cfg.batches), model.stage1_path
    primed = {}  # context -> the prime's state, copied for every row
    for c in cfg.batch_contexts:  # a prime of c cached tokens and the pending one
        ids = random_prompt(model, c + 1, seed=3)
        first = prime(model, [Segment(tuple(ids), "user")], capacity=c + 8)[0]
        primed[c] = [first] + [copy.deepcopy(first) for _ in range(most - 1)]
    sessions = {}  # the loop's setting -> its primed session, copied for every row
    for repair, recall, sampler in LOOPS:
        params = options.cache_params({**flags.cell_policy("brightness"),
                                       "budget": cfg.budget, "repair": repair,
                                       "recall": recall})
        first = Session(model, TokenPolicy(model.tokenizer), sampler, params)
        cold = min(RECALL_COLD, cfg.recall_cold) if recall else 0  # what the positions hold
        first.prime([Segment(tuple(random_prompt(model, cfg.budget + 1 + cold, seed=2)),
                             "user")])
        sessions[f"loop {repair}" + (" + recall" if recall else "")
                 + ("" if sampler.is_greedy else ", sampled")] = first
    for b in cfg.batches:
        rows_model = for_rows(model, b) if b > 1 else model
        for c, states in primed.items():
            views = [s.view() for s in states[:b]]
            gens = [make_generator(i, model.device) for i in range(b)]
            tick = task(f"{dt} stage 1, {b} rows at {c}", cfg.batch_reps)
            timed = {"rows": _stage1(model, rows_model, views, gens)}
            if b > 1:  # the first row alone, in turn with them
                timed["one"] = _stage1(model, model, views[:1], gens[:1])
            t = common.interleaved_ms(timed, cfg.batch_reps, warmup=1, tick=tick)
            ms, one = common.median(t["rows"]), common.median(t["one"]) if b > 1 else None
            out.append(BatchRow(dtype=dt, what="stage 1", context=c, batch=b, ms=ms,
                                tokens_s=b / ms * 1e3, stage1=how, speedup=paired(b, ms, one)))
        for what, first in sessions.items():
            out.append(_loop_row(model, rows_model, first, b, what, cfg, task))
    return [dataclasses.replace(r, ceiling=ceiling(r.batch, r.context, weight_bytes,
                                                   kv_bytes_per_token))
            for r in out]


def _loop_row(model: Model, rows_model: Model, first: Session, b: int, what: str, cfg,
              task) -> BatchRow:
    """The whole loop of ``b`` copies of the primed session ``first``: a step of every row
    (the mean over a round of recall's scans) against stage 1 of the same rows, and (``b``
    above 1) against one more copy stepped alone."""
    rows = [Session(model, first.policy, first.sampler, first.cache_params,
                    state=copy.deepcopy(first.state)) for _ in range(b + (b > 1))]
    alone, rows = rows[b:], rows[:b]
    every = first.cache_params.recall.every if first.cache_params.recall else 1

    def steps():
        for _ in range(every):
            if b == 1:
                rows[0].step()
            else:
                step_rows(rows_model, rows)

    def one():
        for _ in range(every):
            alone[0].step()

    def stage1():  # as the loop's, without recall's query (that counts as recall's cost)
        views = [dataclasses.replace(s.state.view(), cold=None) for s in rows]
        _stage1(model, rows_model, views, [s.generator for s in rows], first.sampler)()

    tick = task(f"{model.precision} {what}, {b} rows", cfg.loop_reps)
    timed = {"stage 1": stage1, "step": steps} | ({"one": one} if alone else {})
    t = common.interleaved_ms(timed, cfg.loop_reps, warmup=1, tick=tick)
    step, s1 = common.median(t["step"]) / every, common.median(t["stage 1"])
    return BatchRow(dtype=model.precision, what=what, context=first.cache_params.budget,
                    batch=b, ms=step, tokens_s=b / step * 1e3, stage1_ms=s1,
                    overhead=step / s1, row_ms=(step - s1) / b, stage1=model.stage1_path,
                    speedup=paired(b, step, common.median(t["one"]) / every if alone else None))


def targets(rows: list[BatchRow]) -> list[Target]:
    """B = 8's tokens/s over B = 1's (stage 1 at each context, each greedy loop), and its
    loop step over its stage 1 (the sampled loop is shown, not held to them)."""
    out = []
    for r in rows:
        if r.batch != SPEEDUP_BATCH or r.what.endswith(", sampled"):
            continue
        if r.speedup is not None:
            out.append(Target(f"{r.stage1} {r.what} tokens/s, {r.batch} rows / 1 at {r.context} "
                              f"(the bytes read allow {r.ceiling:.2f})",
                              r.speedup, f">= {SPEEDUP_TARGET}", r.speedup >= SPEEDUP_TARGET,
                              r.dtype, context=r.context))
        if r.overhead is not None:
            out.append(Target(f"{r.stage1} {r.what} step / stage 1, {r.batch} rows at budget "
                              f"{r.context}",
                              r.overhead, f"<= {OVERHEAD_TARGET}",
                              r.overhead <= OVERHEAD_TARGET, r.dtype))
    return out


def table(rows: list[BatchRow]) -> Table:
    return Table(
        "Throughput of a batch: B rows a step (`run --prompts --batch B`)",
        ("dtype", "stage 1", "what", "context", "rows", "ms a step", "tokens/s", "x B = 1",
         "ceiling x", "stage 1 ms", "step / stage 1", "stages 2-4 ms a row"),
        tuple((r.dtype, r.stage1, r.what, str(r.context), str(r.batch), fmt(r.ms, 1),
               fmt(r.tokens_s, 1), fmt(r.speedup, 2), fmt(r.ceiling, 2), fmt(r.stage1_ms, 1),
               fmt(r.overhead, 2), fmt(r.row_ms, 2)) for r in rows),
        "Stage 1: one forward of every row's pending token, each row over its own copy of a "
        "prime's K/V at the context (B = 1: the solo `generate`); native: the native "
        "kernels' (`--compile native`; B rows: `native.decode_rows`, each weight read once "
        "for all of them). Loop: the whole step of "
        "every row (`batch.step_rows`; B = 1: `Session.step`) at the budget, the brightness "
        "scorer, greedy (sampled: a draw a row a step by the default rule, its stage 1 too; "
        "not held to the targets), "
        "each row a copy of one primed session; with recall, over "
        f"{RECALL_COLD} cold tokens a row (fewer where the positions hold fewer), the mean step of a round of its scans; its stage 1 "
        "timed on the same rows without recall's query. x B = 1: tokens/s over one row's, "
        "that row (a copy of the first) stepped alone in turn with the B rows in every "
        "repetition, so the two see the same machine; "
        "ceiling: the most it could be where the bytes read bound a step (B rows read the "
        "weights once and each row's K/V: B (W + c kv) / (W + B c kv), W the weights' bytes, "
        "kv a token's K/V bytes, c the context).")
