"""Property tests (hypothesis) over stages 2-4 on the tiny model: random budgets, policies,
sinks, windows, repairs and lengths (the whole-loop state machine is tests/test_state_machine.py)."""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from positronic_brain import options
from positronic_brain.forward import apply_rope, rerotation, rope_cos_sin
from positronic_brain.loop import Session
from positronic_brain.stages.apply import apply
from positronic_brain.stages.decide import decide, protected
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.scorers import CULLING
from positronic_brain.types import CacheParams, SamplerParams
from tests.test_loop_step1_generate import _assert_unchanged, _fingerprint
from tests.tolerance import rotation_bound

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@st.composite
def cache_params(draw):
    sinks = draw(st.integers(0, 4))
    recent = draw(st.integers(0, 6))
    budget = draw(st.integers(sinks + recent + 1, 40))
    return options.cache_params(dict(  # each field where its scorer or piece takes it
        budget=budget, policy=draw(st.sampled_from(CULLING)),
        repair=draw(st.sampled_from(["none", "merge"])), max_merges=draw(st.integers(0, 2)),
        sinks=sinks, recent=recent, decay=draw(st.floats(0, 20)),
        gain=draw(st.floats(0, 500)), aggregate=draw(st.sampled_from(["all-mean", "last-max"])),
        reindex_at=draw(st.sampled_from([None, budget + 1, budget + 9])),
        random_seed=draw(st.integers(0, 9))), strict=False)


@SETTINGS
@given(cache=cache_params(), prompt=st.integers(2, 60), steps=st.integers(1, 30),
       pin=st.booleans())
def test_culls_keep_the_best_and_protect(tiny_model, tiny_policy, cache, prompt, steps, pin):
    session = Session(tiny_model, tiny_policy, SamplerParams(temperature=1.0, seed=prompt), cache)
    segs = tiny_policy.chat([("system", "ab"), ("user", "c" * prompt)]) if pin \
        else tiny_policy.raw_prompt("c" * prompt)
    n_pinned = len(segs[0].ids) if pin else 0
    assume(n_pinned + cache.sinks + cache.recent < cache.budget)
    session.prime(segs)
    state, seen_uids = session.state, set(session.state.view().uid.tolist())
    for _ in range(steps):
        view = state.view()
        before = _fingerprint(state)
        gen = generate(tiny_model, view, session.sampler, session.generator)
        scores = score(view, gen.attention, session.scorer)
        actions = decide(tiny_model, view, scores, cache)
        _assert_unchanged(before, _fingerprint(state))  # stages 1-3 are read-only
        keep = protected(view, cache)
        touched = list(actions.cull_slots) + [s for r in actions.merges for s in r.slots]
        assert not keep[touched].any(), "a protected slot was culled or repaired"
        assert len(touched) == len(set(touched))
        removed = len(actions.cull_slots) + len(actions.merges)
        assert removed == max(0, view.n + 1 - cache.budget)
        if not actions.merges:  # culled = exactly the lowest-scored unprotected slots
            free = [i for i in range(view.n) if not keep[i]]
            free.sort(key=lambda i: (float(scores.scores[i]), int(view.position[i])))
            assert sorted(actions.cull_slots) == sorted(free[:removed])
        old_max = max(seen_uids)
        patch = apply(tiny_model, state, gen, actions)
        state.check_valid()
        assert state.arena.n <= cache.budget
        assert state.next_position < tiny_model.spec.max_positions
        new = set(patch.merged_uids) | set(patch.appended_uids)
        assert min(new) > old_max and not new & seen_uids, "a uid was reused"
        seen_uids |= new
        assert set(state.view().uid.tolist()) <= seen_uids


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=st.lists(st.integers(0, 511), min_size=1, max_size=16), data=st.data())
def test_rerotation_round_trip(tiny_model, p, data):
    """p -> p' -> p is the identity, and p -> p' equals RoPE at p' (fp32, to rounding)."""
    p2 = data.draw(st.lists(st.integers(0, 511), min_size=len(p), max_size=len(p)))
    p, p2 = torch.tensor(p), torch.tensor(p2)
    raw = torch.randn(2, len(p), tiny_model.spec.head_dim, generator=torch.Generator().manual_seed(0))
    at = lambda pos: apply_rope(raw, *rope_cos_sin(tiny_model, pos, torch.float32))  # noqa: E731
    moved = apply_rope(at(p), *rerotation(tiny_model, p, p2))
    # RoPE at p, the re-rotation's cos/sin and the rotation: 3 sums, p's cos/sin once more
    assert (moved - at(p2)).abs().max() <= rotation_bound(raw, 3, 1)
    # and back: 2 more sums, and the cos/sin at p' once more
    back = apply_rope(moved, *rerotation(tiny_model, p2, p))
    assert (back - at(p)).abs().max() <= rotation_bound(raw, 5, 2)
