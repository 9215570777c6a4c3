"""Stage 2: scorers map (view, attention) to a score per live slot, higher = keep.

`pytest tests/test_loop_step2_score.py -s` walks a real-model session to stage 2 and
prints the brightest and dimmest tokens.
"""
from dataclasses import replace

import pytest
import torch

from positronic_brain.loop import Session
from positronic_brain.scorers import SCORERS, aggregate, make_scorer
from positronic_brain.stages.apply import prime
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.types import AGGREGATIONS, POLICIES, SOURCES, CacheParams, SamplerParams
from tests.test_loop_step1_generate import _assert_unchanged, _fingerprint

GREEDY = SamplerParams(greedy=True)


@pytest.fixture(scope="module")
def walked(real_model, real_policy):
    """A real-model session after 24 greedy steps at budget 48, and stage 1's output."""
    session = Session(real_model, real_policy, GREEDY, CacheParams(budget=48))
    session.prime(real_policy.chat([("system", "You answer in one paragraph."),
                                    ("user", "Why do cats purr?")]))
    for _ in range(24):
        session.step()
    view = session.state.view()
    gen = generate(real_model, view, GREEDY, session.generator)
    return session, view, gen


def test_brightness_on_the_real_model(walked, real_policy):
    session, view, gen = walked
    out = score(view, gen.attention, session.scorer)
    b = out.brightness
    assert out.scores is b and b.shape == (view.n,) and b.dtype == torch.float32
    assert float(b.min()) >= 0 and float(b.max()) <= session.cache.max_brightness
    order = torch.argsort(b, descending=True).tolist()
    show = lambda i: f"{real_policy.token_text(int(view.token_id[i]))!r}@{int(view.position[i])}"  # noqa: E731
    print(f"\nstep {view.step}: {view.n} live slots, next position {view.next_position}")
    print("brightest:", ", ".join(f"{show(i)}={float(b[i]):.1f}" for i in order[:8]))
    print("dimmest:  ", ", ".join(f"{show(i)}={float(b[i]):.1f}" for i in order[-8:]))
    # the update rule, from the stored values, the attention row and the session's parameters
    c = session.cache
    expected = (view.brightness - c.decay + c.gain * gen.attention.mean((0, 1))).clamp(0, 255)
    assert torch.allclose(b, expected, atol=1e-4)


def test_brightness_update_rule_by_hand(tiny_model, tiny_policy):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("abcdefgh"), capacity=16)
    view = replace(state.view(), brightness=torch.tensor([0.5, 3.0, 100.0, 254.0, 255.0, 1.0, 2.0]))
    attention = torch.rand(tiny_model.spec.n_layers, tiny_model.spec.n_heads, view.n,
                           generator=torch.Generator().manual_seed(0))
    for how in AGGREGATIONS:
        scorer = make_scorer(CacheParams(decay=1.5, gain=30.0, max_brightness=200.0,
                                         aggregate=how))
        got = scorer.score(view, attention).brightness
        for i in range(view.n):
            layers = [attention.shape[0] - 1] if how.startswith("last") else range(attention.shape[0])
            per_layer = [max(attention[li, :, i].tolist()) if how.endswith("max")
                         else sum(attention[li, :, i].tolist()) / attention.shape[1]
                         for li in layers]
            a = sum(per_layer) / len(per_layer)
            want = min(200.0, max(0.0, float(view.brightness[i]) - 1.5 + 30.0 * a))
            assert abs(float(got[i]) - want) < 1e-4, (how, i)


def test_aggregate_shapes():
    attention = torch.rand(3, 4, 5)
    assert torch.allclose(aggregate(attention, "all-mean"), attention.mean((0, 1)))
    assert torch.allclose(aggregate(attention, "last-max"), attention[-1].amax(0))


def test_new_tokens_are_seeded_by_source(tiny_model, tiny_policy):
    seeds = (200.0, 100.0, 50.0, 25.0)
    segs = tiny_policy.chat([("system", "S"), ("user", "U")])  # ends with the assistant opener
    state, _ = prime(tiny_model, segs, capacity=64, seeds=seeds)
    m = state.mirror
    want = torch.tensor(seeds)[m.live("source").long()]
    assert torch.equal(m.live("brightness"), want)
    assert set(m.live("source").tolist()) == {SOURCES.index(r) for r in ("system", "user", "assistant")}


def _synthetic_view(tiny_model, tiny_policy, step=10):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("abcdefghij"), capacity=16)
    n = state.arena.n
    return replace(state.view(), step=step, position=torch.tensor([0, 1, 2, 3, 5, 7, 8, 9, 4]),
                   born_step=torch.tensor([0, 0, 0, 2, 4, 6, 8, 9, 10]),
                   attn_sum=torch.arange(n, dtype=torch.float32)), n


def test_baselines(tiny_model, tiny_policy):
    view, n = _synthetic_view(tiny_model, tiny_policy)
    s = tiny_model.spec
    attention = torch.rand(s.n_layers, s.n_heads, n, generator=torch.Generator().manual_seed(1))
    agg = attention.mean((0, 1))

    h2o = make_scorer(CacheParams(policy="h2o")).score(view, attention)
    assert torch.allclose(h2o.attn_sum, view.attn_sum + agg)
    queries = torch.tensor([11, 11, 11, 9, 7, 5, 3, 2, 1], dtype=torch.float32)
    assert torch.allclose(h2o.scores, (view.attn_sum + agg) / queries)
    assert h2o.brightness is None

    tova = make_scorer(CacheParams(policy="tova", aggregate="last-max")).score(view, attention)
    assert torch.allclose(tova.scores, attention[-1].amax(0)) and tova.attn_sum is None

    st = make_scorer(CacheParams(policy="streaming", sinks=2)).score(view, attention).scores
    assert torch.isinf(st[:2]).all() and torch.equal(st[2:], view.position[2:].float())

    r = make_scorer(CacheParams(policy="random", seed=3))
    a, b = r.score(view, attention).scores, r.score(view, attention).scores
    assert torch.equal(a, b) and not torch.equal(a, r.score(replace(view, step=11), attention).scores)

    assert not make_scorer(CacheParams(policy="none")).score(view, attention).scores.any()


@pytest.mark.parametrize("policy", POLICIES)
def test_scoring_is_read_only(tiny_model, tiny_policy, policy):
    session = Session(tiny_model, tiny_policy, GREEDY, CacheParams(policy=policy, sinks=1, recent=1))
    session.prime(tiny_policy.raw_prompt("read only please"))
    session.step()
    view = session.state.view()
    gen = generate(tiny_model, view, GREEDY, session.generator)
    before = _fingerprint(session.state)
    out = score(view, gen.attention, session.scorer)
    _assert_unchanged(before, _fingerprint(session.state))
    assert out.scores.shape == (view.n,)
    assert type(session.scorer) is SCORERS[policy]
