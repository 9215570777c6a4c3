"""Async streaming: ``async for event in astream(session, max_new_tokens): ...``

Each step (all stages of one token) runs in a worker thread, so the event loop stays
free while the model computes. The stop rules are ``Session.stream``'s own: this module
only drives that generator one step at a time from the worker.

Cancellation: a step in flight cannot be interrupted half-way, so a cancelled consumer
waits for it to finish before the cancellation propagates: when ``astream`` is gone, no
thread is touching the state and ``state.check_valid()`` holds. ``stop_reason`` becomes
``"cancelled"``.

Concurrency: sessions sharing one loaded model may stream at the same time. The forward
only reads the weights and the rotary embedding's fixed frequencies (rope types whose
frequencies change at run time are refused at load), everything it writes is per-session,
and torch releases the GIL inside its kernels, so no lock is needed. On a machine with
fewer cores than ``sessions x torch.get_num_threads()`` the steps compete for cores;
results are unchanged (tested: tokens equal solo runs).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from .loop import Session
from .special_tokens import TextStream
from .types import StepRecord, require


@dataclass(frozen=True)
class StreamEvent:
    """One generated token: its printable text delta and the loop's record of the step
    (``record.token_id``, ``.step``, ``.cache_len``, ``.ms``, ``.top_ids``/``.top_probs``,
    ``.culled`` uids, ``.merged``, ``.folded``, ``.reindexed``)."""

    text: str  # "" for a stop token or while a multi-byte character is incomplete
    record: StepRecord


async def _next_in_worker(steps: Iterator[StepRecord]) -> StepRecord | None:
    """Run one step in a worker thread; if cancelled, let that step finish first."""
    fut = asyncio.get_running_loop().run_in_executor(None, next, steps, None)
    try:
        return await asyncio.shield(fut)  # a cancel reaches us, not the step
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                pass  # cancelled again: still wait, then propagate once
        raise


async def astream(session: Session, max_new_tokens: int,
                  ignore_eos: bool = False) -> AsyncIterator[StreamEvent]:
    """Async version of ``session.stream``: the same tokens, as ``StreamEvent``s."""
    require(session.state is not None, "prime the session before streaming")
    text = TextStream(session.policy)
    steps = session.stream(max_new_tokens, ignore_eos)
    try:
        while (rec := await _next_in_worker(steps)) is not None:
            stop = not ignore_eos and session.policy.is_eos(rec.token_id)
            yield StreamEvent("" if stop else text.push(rec.token_id), rec)
    except asyncio.CancelledError:
        session.stop_reason = "cancelled"
        raise
    finally:
        steps.close()
