"""The loop: prime once, then step through the stages, one token per step.

    state = stage0.prime(model, segments)                       # mutation
    repeat:
        gen     = stage1.generate(model, view, sampler)             # read-only
        scores  = stage2.score(view, gen.attention, scorer)         # read-only
        actions = stage3.decide(model, view, scores, cache_params)  # read-only
        patch   = stage4.apply(model, state, gen, actions)          # the only mutation

The loop iterates, reports and captures (``capture.CaptureWriter``: each stage call's
inputs and outputs saved between the stages); stages don't know about it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import InitVar, dataclass, field

from .capture import (CaptureWriter, arena_version, generate_outputs, state_snapshot,
                      view_columns)
from .model import Model
from .sampler import make_generator
from .scorers import make_scorer
from .special_tokens import TextStream, TokenPolicy
from .stages.apply import apply, extend, prime
from .stages.decide import decide
from .stages.generate import generate
from .stages.score import score
from .state import State
from .streaming import astream
from .types import CacheParams, Patch, SamplerParams, Segment, StepRecord, require


@dataclass
class Session:
    """One generation session over one model: a state plus the sampler's generator."""

    model: Model
    policy: TokenPolicy
    sampler: SamplerParams = field(default_factory=SamplerParams)
    cache_params: CacheParams = field(default_factory=CacheParams)
    state: State | None = None
    prompt_ids: list[int] = field(default_factory=list)
    generated_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    capture: CaptureWriter | None = None
    scorer: InitVar[object] = None  # a prebuilt stage-2 scorer (bench quality's oracle)

    def __post_init__(self, scorer: object = None) -> None:
        self.generator = make_generator(self.sampler.seed)
        self.scorer = make_scorer(self.cache_params) if scorer is None else scorer
        limit = self.model.spec.max_positions
        require(self.cache_params.reindex_at is None or self.cache_params.reindex_at <= limit,
                f"reindex-at {self.cache_params.reindex_at} is past the model's {limit} positions")
        require(self.cache_params.budget is None or self.cache_params.budget < limit,
                f"budget {self.cache_params.budget} must be below the model's {limit} positions")

    def prime(self, segments: list[Segment], capacity: int | None = None) -> None:
        """Stage 0 over the prompt segments (what the special-token policy produced).

        ``capacity`` defaults to the budget (or the prompt, if longer; the first step then
        culls down to the budget) or, without a budget, to the model's positions."""
        budget = self.cache_params.budget
        if budget is not None:
            n_prompt = sum(len(s.ids) for s in segments)
            capacity = capacity or max(budget, n_prompt)
            require(capacity >= budget, f"capacity {capacity} is smaller than the budget {budget}")
        pinned = frozenset(self.cache_params.pinned)
        self.state, out = prime(self.model, segments, capacity, pinned=pinned,
                                seeds=self.cache_params.seeds)
        if self.capture:
            view = self.state.view()
            self._save(0, "s0_prime", {"segments": segments, "capacity": view.capacity,
                                       "pinned": pinned, "seeds": self.cache_params.seeds},
                       {"logits": out.logits, "patch": out.patch, "k": view.k, "v": view.v})
        self.prompt_ids = [i for s in segments for i in s.ids]
        self.generated_ids = []
        self.stop_reason = None

    def extend(self, segments: list[Segment], pending: int | None = None) -> Patch:
        """Stage 0 on the live state (a chat turn): prefill the pending token and the new
        segments but their last id, which becomes pending (``pending`` replaces the old
        pending token first). Pinned sources are protected. Captured as ``s0_extend`` at the
        current step; replay re-runs it there."""
        require(self.state is not None, "prime the session before extending it")
        pinned, n = frozenset(self.cache_params.pinned), self.state.arena.n
        patch = extend(self.model, self.state, segments, pinned=pinned, pending=pending)
        if self.capture:
            view = self.state.view()
            self._save(self.state.step, "s0_extend",
                       {"segments": segments, "pinned": pinned, "pending": pending},
                       {"patch": patch, "k": view.k[:, :, n:], "v": view.v[:, :, n:]})
        return patch

    def step(self, force: int | None = None) -> StepRecord:
        """One token through the stages: 1) generate, 2) score, 3) decide (read-only),
        4) apply (the only mutation). ``force`` (teacher forcing) is the next pending
        token instead of a sampled one; the record's ``logprob`` is the model's for it."""
        require(self.state is not None, "prime the session before stepping")
        t0 = time.perf_counter()
        view, cap, step = self.state.view(), self.capture, self.state.step + 1
        if cap:
            rng = self.generator.get_state()  # the sampler's randomness is a captured input
            if cap.level == "full":
                cap.save_state(step, state_snapshot(self.state))
        gen = generate(self.model, view, self.sampler, self.generator, force)  # 1)
        if cap:
            self._save(step, "s1_generate", {"view": view_columns(view), "sampler": self.sampler,
                                             "generator_state": rng, "force": force},
                       generate_outputs(gen))
        scores = score(view, gen.attention, self.scorer)  # 2)
        if cap:
            self._save(step, "s2_score", {"view": view_columns(view), "cache": self.cache_params,
                                          "attention": "s1_generate.outputs.attention",
                                          "value_norms": view.vnorm},
                       {"out": scores})
        actions = decide(self.model, view, scores, self.cache_params)  # 3)
        if cap:
            self._save(step, "s3_decide", {"cache": self.cache_params, "scores": "s2_score.outputs.out"},
                       {"out": actions})
        patch = apply(self.model, self.state, gen, actions)  # 4)
        if cap:
            self._save(step, "s4_apply", {"gen": "s1_generate.outputs",
                                          "actions": "s3_decide.outputs.out"}, {"out": patch})
        ms = (time.perf_counter() - t0) * 1e3
        self.generated_ids.append(gen.token_id)
        return StepRecord(step=self.state.step, token_id=gen.token_id,
                          cache_len=self.state.arena.n, ms=round(ms, 3),
                          top_ids=gen.report.top_ids, top_probs=gen.report.top_probs,
                          logprob=float(gen.logits.log_softmax(-1)[gen.token_id]),
                          culled=patch.culled_uids,
                          repaired=tuple((r.uids, r.token_id, u)
                                         for r, u in zip(patch.repairs, patch.repaired_uids)),
                          folded=len(patch.folds), reindexed=patch.reindex_to is not None)

    def _save(self, step: int, stage: str, inputs: dict, outputs: dict) -> None:
        self.capture.save(step, stage, inputs, outputs, cache_len=self.state.ledger.n,
                          arena_version=arena_version(self.state))

    def astream(self, max_new_tokens: int, ignore_eos: bool = False):
        """``stream`` as an async iterator of StreamEvents, stepping in a worker thread
        (see ``positronic_brain.streaming``)."""
        return astream(self, max_new_tokens, ignore_eos)

    def stream(self, max_new_tokens: int, ignore_eos: bool = False,
               force: Sequence[int] | None = None) -> Iterator[StepRecord]:
        """Step until ``max_new_tokens``, EOS (kept as the last generated token, as with
        Hugging Face ``generate``) or a full arena. With ``force`` (teacher forcing), step
        i's next pending token is ``force[i]`` rather than a sampled one."""
        require(self.state is not None, "prime the session before streaming")
        require(max_new_tokens >= 0, f"max-new-tokens must be >= 0, got {max_new_tokens}")
        require(force is None or len(force) >= max_new_tokens,
                f"{max_new_tokens} steps need as many forced tokens, got {len(force or ())}")
        self.stop_reason = "max_new_tokens"
        for i in range(max_new_tokens):
            if self.cache_params.budget is None and self.state.arena.n >= self.state.arena.capacity:
                self.stop_reason = "capacity"
                return
            if self.state.next_position >= self.model.spec.max_positions:
                self.stop_reason = "max_positions"
                return
            rec = self.step(None if force is None else force[i])
            yield rec
            if not ignore_eos and self.policy.is_eos(rec.token_id):
                self.stop_reason = "eos"
                return


def run(model: Model, policy: TokenPolicy, segments: list[Segment], sampler: SamplerParams,
        max_new_tokens: int = 64, ignore_eos: bool = False, capacity: int | None = None,
        on_text=None, cache_params: CacheParams | None = None,
        capture: CaptureWriter | None = None) -> dict:
    """Prime and generate; returns the run as plain JSON-ready values.

    ``capacity`` defaults to what the run needs: with a budget, the budget (or the prompt
    if longer); without, prompt + new tokens, capped by the model's positions.
    ``on_text(delta)`` receives the streamed text. With ``capture``, every stage call is
    saved to its run folder (closed when the run ends, marked incomplete if it fails).
    """
    cache = cache_params or CacheParams()
    n_prompt = sum(len(s.ids) for s in segments)
    if capacity is None and cache.budget is None:
        capacity = max(1, min(n_prompt + max_new_tokens, model.spec.max_positions))
    session = Session(model, policy, sampler, cache, capture=capture)
    text = TextStream(policy)
    steps = []
    try:
        session.prime(segments, capacity)
        _generate(session, policy, text, steps, max_new_tokens, ignore_eos, on_text)
    except BaseException as e:
        if capture:
            capture.close(f"{type(e).__name__}", complete=False)
        raise
    if capture:
        capture.close(session.stop_reason)
    session.state.check_valid()
    return {
        "model": model.name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompt_ids": session.prompt_ids,
        "generated_ids": session.generated_ids,
        "text": text.text,
        "stop_reason": session.stop_reason,
        "steps": steps,
        "ledger": session.state.ledger.rows(),
        "pending_token": session.state.pending_token,
        **({"capture": str(capture.dir)} if capture else {}),
    }


def _generate(session: Session, policy: TokenPolicy, text: TextStream, steps: list,
              max_new_tokens: int, ignore_eos: bool, on_text) -> None:
    for rec in session.stream(max_new_tokens, ignore_eos):
        steps.append({"step": rec.step, "token_id": rec.token_id, "cache_len": rec.cache_len,
                      "ms": rec.ms, "top": [[i, p] for i, p in zip(rec.top_ids, rec.top_probs)],
                      "culled": list(rec.culled),
                      "repaired": [{"uids": list(u), "token_id": t, "uid": new}
                                   for u, t, new in rec.repaired],
                      "folded": rec.folded, "reindexed": rec.reindexed})
        if not ignore_eos and policy.is_eos(rec.token_id):
            continue  # the stop token ends the text (it stays in generated_ids)
        delta = text.push(rec.token_id)
        if on_text and delta:
            on_text(delta)
