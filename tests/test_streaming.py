"""Async streaming: the same tokens as the sync loop, computed off the event loop; a
cancel stops between steps with a valid state; sessions sharing one model stream at once."""
import asyncio
import threading
import time

import pytest

from positronic_brain.loop import Session
from positronic_brain.streaming import astream
from positronic_brain.types import CacheParams, SamplerParams, UserError

# every test here is a coroutine, which pytest runs only through this plugin (the dev extra)
pytest.importorskip("pytest_asyncio", reason="the async tests need pytest-asyncio "
                    "(pip install -e .[dev])")

GREEDY = SamplerParams(greedy=True)


def _session(model, policy, prompt, sampler=GREEDY, cache=None, capacity=256):
    s = Session(model, policy, sampler, cache or CacheParams())
    s.prime(policy.chat([("user", prompt)]), capacity)
    return s


async def test_astream_equals_stream_and_leaves_the_loop_free(real_model, real_policy):
    prompt = "Name three colours of the rainbow."
    sync = _session(real_model, real_policy, prompt)
    expected = [r.token_id for r in sync.stream(24)]
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    tick = asyncio.create_task(ticker())
    session = _session(real_model, real_policy, prompt)
    events = [e async for e in astream(session, 24)]
    tick.cancel()
    assert [e.record.token_id for e in events] == expected == session.generated_ids
    assert session.stop_reason == sync.stop_reason
    # the text deltas add up to the decoded answer (the stop token prints nothing)
    answer = expected[:-1] if sync.stop_reason == "eos" else expected
    assert "".join(e.text for e in events) == real_policy.decode(answer)
    assert [e.record.step for e in events] == list(range(1, len(events) + 1))
    assert ticks >= len(events)  # the event loop kept running while the model computed


async def test_astream_reports_culls_with_a_budget(tiny_model, tiny_policy):
    cache = CacheParams(budget=24, sinks=2, recent=4)
    sampler = SamplerParams(temperature=1.0, seed=4)
    sync = _session(tiny_model, tiny_policy, "culls arrive in the events too", sampler, cache)
    expected = [(r.token_id, r.culled) for r in sync.stream(30, ignore_eos=True)]
    session = _session(tiny_model, tiny_policy, "culls arrive in the events too", sampler, cache)
    got = [(e.record.token_id, e.record.culled)
           async for e in astream(session, 30, ignore_eos=True)]
    assert got == expected and any(c for _, c in got)
    assert session.state.arena.n <= 24


async def test_cancel_mid_step_finishes_that_step_and_leaves_a_valid_state(tiny_model, tiny_policy):
    session = _session(tiny_model, tiny_policy, "cancel me half-way")
    reference = _session(tiny_model, tiny_policy, "cancel me half-way")
    expected = [r.token_id for r in reference.stream(20, ignore_eos=True)]
    in_step, real_step = threading.Event(), session.step

    def slow_step(*args, **kwargs):  # the 4th step is in the worker when the cancel arrives
        if session.state.step == 3:
            in_step.set()
            time.sleep(0.2)
        return real_step(*args, **kwargs)

    session.step = slow_step
    seen = []

    async def consume():
        async for e in astream(session, 20, ignore_eos=True):
            seen.append(e.record.token_id)

    task = asyncio.create_task(consume())
    assert await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 60), \
        "the 4th step never started"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the step in flight completed (its token is in the session, not delivered) and nothing
    # runs behind our back afterwards
    assert seen == expected[:3] and session.generated_ids == expected[:4]
    assert session.state.step == 4 and session.stop_reason == "cancelled"
    before = (session.state.step, session.state.arena.n)
    await asyncio.sleep(0.3)
    assert (session.state.step, session.state.arena.n) == before
    session.state.check_valid()
    # ... and the session carries on exactly where the uninterrupted run would be
    session.step = real_step
    assert [r.token_id for r in session.stream(16, ignore_eos=True)] == expected[4:]


async def test_two_sessions_share_one_model_concurrently(real_model, real_policy):
    prompts = ["Why is the sea salty?", "Write a haiku about autumn."]
    alone = []
    for p in prompts:
        alone.append([r.token_id for r in _session(real_model, real_policy, p).stream(16)])

    async def run(p):
        return [e.record.token_id async for e in astream(_session(real_model, real_policy, p), 16)]

    together = await asyncio.gather(*(run(p) for p in prompts))
    assert list(together) == alone


async def test_astream_needs_a_primed_session(tiny_model, tiny_policy):
    with pytest.raises(UserError, match="prime"):
        async for _ in astream(Session(tiny_model, tiny_policy), 3):
            pass
