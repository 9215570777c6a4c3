"""Stage 2: scorers map (view, attention) to a score per live slot, higher = keep.

`pytest tests/test_loop_step2_score.py -s` walks a real-model session to stage 2 and
prints the brightest and dimmest tokens.
"""
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from positronic_brain import options
from positronic_brain.loop import Session
from positronic_brain.scorers import SCORERS, columns_of, make_scorer
from positronic_brain.scorers import keydiff as keydiff_module
from positronic_brain.stages.apply import prime
from positronic_brain.state import Heads
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.types import AGGREGATIONS, SOURCES, CacheParams, SamplerParams
from tests.test_loop_step1_generate import _assert_unchanged, _fingerprint
from tests.tolerance import products, step, sum_bound

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
    b = out.columns["brightness"]
    assert out.scores is b and b.shape == (view.n,) and b.dtype == torch.float32
    assert float(b.min()) >= 0 and float(b.max()) <= session.scorer.max_brightness
    order = torch.argsort(b, descending=True).tolist()
    show = lambda i: f"{real_policy.token_text(int(view.token_id[i]))!r}@{int(view.position[i])}"  # noqa: E731
    print(f"\nstep {view.step}: {view.n} live slots, next position {view.next_position}")
    print("brightest:", ", ".join(f"{show(i)}={float(b[i]):.1f}" for i in order[:8]))
    print("dimmest:  ", ", ".join(f"{show(i)}={float(b[i]):.1f}" for i in order[-8:]))
    # the update rule, from the stored values, the attention row, the live values and the
    # session's parameters: n x the value-weighted attention, averaged over layers and heads
    c = session.scorer  # brightness, its fields at their defaults
    first = round(c.skip_layers * 30)  # the layers brightness leaves out (6 of 30)
    norm = view.v[first:].float().norm(dim=-1)  # (L - first, kv_heads, n)
    norm = (norm / norm.mean(-1, keepdim=True)).repeat_interleave(3, dim=1)  # 9 heads, 3 KV
    share = view.n * (gen.attention[first:] * norm).mean((0, 1))
    expected = (view.columns["brightness"] - c.decay + c.gain * share).clamp(0, 255)
    # the value norms (head_dim terms), their mean over the slots and the share's over layers
    # and heads, in other orders; then brightness - decay + gain x share, 3 terms
    terms = max(view.v.shape[-1], view.n, norm.shape[0] * norm.shape[1])
    top = float((view.columns["brightness"].abs() + c.decay + c.gain * share).max())
    bound = products(torch.float32, terms, 3, float(c.gain * share.max())) + sum_bound(
        torch.float32, 3, top)
    assert torch.allclose(b, expected, rtol=0, atol=bound)


def _value_weights(v, layer, head, heads):
    """Slot weights of one (layer, head), by hand: each value's norm over the mean norm of its
    layer and KV head."""
    kv = head // (heads // v.shape[1])
    norms = [sum(x * x for x in v[layer, kv, i].tolist()) ** 0.5 for i in range(v.shape[2])]
    mean = sum(norms) / len(norms)
    return [x / mean for x in norms]


@pytest.mark.parametrize("signal", ["value", "attention"])
def test_brightness_update_rule_by_hand(tiny_model, tiny_policy, signal):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("abcdefgh"), capacity=16)
    view = replace(state.view(), columns={"brightness": torch.tensor(
        [0.5, 3.0, 100.0, 254.0, 255.0, 1.0, 2.0], device=tiny_model.device)})
    L, H, n = tiny_model.spec.n_layers, tiny_model.spec.n_heads, view.n
    attention = torch.rand(L, H, n, generator=torch.Generator().manual_seed(0)).to(tiny_model.device)
    weight = [[_value_weights(view.v, li, h, H) if signal == "value" else [1.0] * n
               for h in range(H)] for li in range(L)]
    for how, skip in [(how, 0.0) for how in AGGREGATIONS] + [("all-mean", 0.5), ("all-max", 0.6)]:
        scorer = make_scorer(options.params(decay=1.5, gain=0.5, max_brightness=200.0,
                                         aggregate=how, signal=signal, skip_layers=skip))
        got = scorer.score(view, attention).columns["brightness"]
        first = round(skip * L)
        if signal == "value":
            weight = [[_value_weights(view.v[first:], li - first, h, H) if li >= first else None
                       for h in range(H)] for li in range(L)]
        for i in range(n):
            layers = [L - 1] if how.startswith("last") else range(first, L)
            heads = [[float(attention[li, h, i]) * weight[li][h][i] for h in range(H)]
                     for li in layers]
            per_layer = [max(x) if how.endswith("max") else sum(x) / H for x in heads]
            share = n * (max(per_layer) if how.startswith("max") else sum(per_layer) / len(per_layer))
            want = min(200.0, max(0.0, float(view.columns["brightness"][i]) - 1.5 + 0.5 * share))
            # float32 against float64 by hand: the value norms (head_dim terms), their mean
            # over the slots, the share's over heads and layers; then b - decay + gain x share
            terms = max(view.v.shape[-1], n, H * L)
            bound = products(torch.float32, terms, 3, 0.5 * share) + sum_bound(
                torch.float32, 3, abs(float(view.columns["brightness"][i])) + 1.5 + 0.5 * share)
            assert abs(float(got[i]) - want) <= bound, (how, i)


def test_value_weights_favour_large_values(tiny_model, tiny_policy):
    """Equal attention, one value scaled up: that slot gains more brightness, the others
    less (the weights keep their mean at 1)."""
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("abcdef"), capacity=16)
    view = replace(state.view(), columns={"brightness": torch.zeros(state.arena.n,
                                                                    device=tiny_model.device)})
    view = replace(view, vnorm=torch.ones_like(view.vnorm))  # equal value norms
    norms = view.vnorm.clone()
    norms[:, :, 2] *= 5
    attention = torch.full((tiny_model.spec.n_layers, tiny_model.spec.n_heads, view.n), 1 / view.n,
                           device=tiny_model.device)
    scorer = make_scorer(options.params(decay=0.0, gain=1.0))
    plain = scorer.score(view, attention).columns["brightness"]
    # n x 1/n, the same for every slot: 1/n rounded, L x H of them averaged, times n, plus 0
    L, H = attention.shape[:2]
    bound = sum_bound(torch.float32, L * H) + sum_bound(torch.float32, 3) + step(torch.float32)
    assert torch.allclose(plain, torch.ones_like(plain), rtol=0, atol=bound)
    b = scorer.score(replace(view, vnorm=norms), attention).columns["brightness"]
    assert float(b[2]) > 1 and bool((b[torch.arange(view.n, device=b.device) != 2] < 1).all())
    # the norms' mean, each weight's over layers and heads, 0 - decay + gain x share and b's
    # mean over the slots: 1 in exact arithmetic
    bound = products(torch.float32, max(view.n, L * H), 4, float(b.max()))
    assert abs(float(b.mean()) - 1) <= bound


def test_new_tokens_are_seeded_by_source(tiny_model, tiny_policy):
    seeds = (200.0, 100.0, 50.0, 25.0)
    segs = tiny_policy.chat([("system", "S"), ("user", "U")])  # ends with the assistant opener
    scorer = make_scorer(options.params(seeds=seeds))
    state, _ = prime(tiny_model, segs, capacity=64, columns=columns_of(scorer))
    m = state.ledger
    want = torch.tensor(seeds)[m.live("source").long().cpu()]
    assert torch.equal(m.live("brightness").cpu(), want)
    assert set(m.live("source").tolist()) == {SOURCES.index(r) for r in ("system", "user", "assistant")}


def _synthetic_view(tiny_model, tiny_policy, step=10):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("abcdefghij"), capacity=16)
    n = state.arena.n
    dev = tiny_model.device
    return replace(state.view(), step=step,
                   position=torch.tensor([0, 1, 2, 3, 5, 7, 8, 9, 4], device=dev),
                   born_step=torch.tensor([0, 0, 0, 2, 4, 6, 8, 9, 10], device=dev),
                   columns={"attn_sum": torch.arange(n, dtype=torch.float32, device=dev)}), n


def test_baselines(tiny_model, tiny_policy):
    view, n = _synthetic_view(tiny_model, tiny_policy)
    s = tiny_model.spec
    attention = torch.rand(s.n_layers, s.n_heads, n, generator=torch.Generator().manual_seed(1))
    attention = attention.to(tiny_model.device)
    agg = attention.mean((0, 1))

    h2o = make_scorer(CacheParams(scorer="h2o")).score(view, attention)
    total = view.columns["attn_sum"] + agg
    # the mean over layers and heads in another order, then added to attn_sum (and divided)
    bound = sum_bound(torch.float32, s.n_layers * s.n_heads, float(agg.max()))
    bound += sum_bound(torch.float32, 2, float(total.max()))
    assert torch.allclose(h2o.columns["attn_sum"], total, rtol=0, atol=bound)
    queries = torch.tensor([11, 11, 11, 9, 7, 5, 3, 2, 1], dtype=torch.float32, device=view.uid.device)
    scores = total / queries
    assert torch.allclose(h2o.scores, scores, rtol=0,
                          atol=bound + step(torch.float32) * float(scores.max()))
    assert list(h2o.columns) == ["attn_sum"]

    # a max is one of its terms, whatever the order: the same bits
    tova = make_scorer(options.params(policy="tova", aggregate="last-max")).score(view, attention)
    assert torch.equal(tova.scores, attention[-1].amax(0)) and tova.columns is None

    st = make_scorer(CacheParams(scorer="streaming", sinks=2)).score(view, attention).scores
    assert torch.isinf(st[:2]).all() and torch.equal(st[2:], view.position[2:].float())

    r = make_scorer(options.params(policy="random", random_seed=3))
    a, b = r.score(view, attention).scores, r.score(view, attention).scores
    assert torch.equal(a, b) and not torch.equal(a, r.score(replace(view, step=11), attention).scores)

    assert not make_scorer(CacheParams(scorer="none")).score(view, attention).scores.any()


def test_key_norm_keeps_the_lowest_keys_relative_to_their_head():
    """Hand-worked: two layers of one KV head over three slots, their key norms on scales
    32 times apart. Relative to each head's mean they are [0.5, 1.5, 1] and [1, 0.5, 1.5]:
    slot 0 scores highest (kept first), where the raw norms' mean (32.5, 17.5, 49) would keep
    slot 1. Per head, each norm relative to its own head's mean over the slots it holds:
    one layer's two heads, the second holding two slots (its third free) on a scale 32
    times the first's, score alike ([0.5, 1.5] of their means), so an allocation that
    shares a layer's places among its heads by score shares them by the relative norms."""
    view = SimpleNamespace(knorm=torch.tensor([[[1.0, 3.0, 2.0]], [[64.0, 32.0, 96.0]]]))
    knorm = make_scorer(CacheParams(scorer="knorm"))
    assert torch.equal(knorm.score(view, None).scores, torch.tensor([-0.75, -1.0, -1.25]))
    heads = Heads(row=torch.tensor([[[0, 1, 2], [0, 1, -1]]]), n=torch.tensor([[3, 2]]))
    view = SimpleNamespace(knorm=torch.tensor([[[1.0, 3.0, 2.0], [32.0, 96.0, 7.0]]]),
                           heads=heads)
    scores = knorm.score_heads(view, None).scores
    assert torch.equal(scores[0, 0], torch.tensor([-0.5, -1.5, -1.0]))
    assert torch.equal(scores[0, 1, :2], torch.tensor([-0.5, -1.5]))


def test_key_diff_keeps_the_keys_least_like_their_head_s_anchor(monkeypatch):
    """Hand-worked: one KV head's keys (1, 0), (0, 2) and (3, 3): unit keys (1, 0), (0, 1)
    and (1, 1)/sqrt 2, whose mean points along (1, 1), so their cosines to it are 1/sqrt 2,
    1/sqrt 2 and 1: the third key, the one most like the others, scores lowest (culled
    first) and the two that point apart tie. Whole tokens average the cosines of two such
    heads. Per head, a head's free slot is left out of its anchor: the second head holds
    (1, 0) and (0, 1) (its third slot, free, holds (5, 0), which would tip the anchor)."""
    k = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]]]])  # (L, KVH, n, D)
    c = 1 / math.sqrt(2)  # the cosine of 45 degrees
    # float32, against the exact values: a norm, the anchor's mean, its norm, a dot product
    # and the heads' mean in series, each of at most three terms of magnitude about 1
    tol = products(torch.float32, 3, 5)

    def close(got: torch.Tensor, want: list[float]) -> bool:
        return torch.allclose(got, torch.tensor(want), rtol=0, atol=tol)

    view = SimpleNamespace(k=k, knorm=k.norm(dim=-1))
    keydiff = make_scorer(CacheParams(scorer="keydiff"))
    assert close(keydiff.score(view, None).scores, [-c, -c, -1.0])
    two = torch.cat((k, -k), dim=1)  # a second head of the opposite keys: the same cosines
    view = SimpleNamespace(k=two, knorm=two.norm(dim=-1))
    assert close(keydiff.score(view, None).scores, [-c, -c, -1.0])
    layers = torch.cat((k, -k))  # two layers; a split arena's blocks give the same bits
    whole = keydiff.score(SimpleNamespace(k=layers, knorm=layers.norm(dim=-1)), None).scores
    split = SimpleNamespace(k=(layers[:1], layers[1:]), knorm=layers.norm(dim=-1))
    assert torch.equal(keydiff.score(split, None).scores, whole)
    # a run of layers at a time (a large model's keys) gives the whole pass's cosines
    with monkeypatch.context() as m:
        m.setattr(keydiff_module, "CHUNK_BYTES", 4 * k[0].numel())
        got = keydiff.score(SimpleNamespace(k=layers, knorm=layers.norm(dim=-1)), None).scores
    assert torch.equal(got, whole)
    zero = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]]])  # a key of norm 0: no
    view = SimpleNamespace(k=zero, knorm=zero.norm(dim=-1))  # direction, a cosine of 0
    assert close(keydiff.score(view, None).scores, [-c, -c, 0.0])
    free = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]], [[1.0, 0.0], [0.0, 1.0],
                                                                  [5.0, 0.0]]]])
    heads = Heads(row=torch.tensor([[[0, 1, 2], [0, 1, -1]]]), n=torch.tensor([[3, 2]]))
    view = SimpleNamespace(k=free, knorm=free.norm(dim=-1), heads=heads)
    scores = keydiff.score_heads(view, None).scores
    assert close(scores[0, 0], [-c, -c, -1.0])
    assert close(scores[0, 1, :2], [-c, -c])


@pytest.mark.parametrize("policy", SCORERS)
def test_scoring_is_read_only(tiny_model, tiny_policy, policy):
    session = Session(tiny_model, tiny_policy, GREEDY, CacheParams(scorer=policy, sinks=1, recent=1))
    session.prime(tiny_policy.raw_prompt("read only please"))
    session.step()
    view = session.state.view()
    gen = generate(tiny_model, view, GREEDY, session.generator)
    before = _fingerprint(session.state)
    out = score(view, gen.attention, session.scorer)
    _assert_unchanged(before, _fingerprint(session.state))
    assert out.scores.shape == (view.n,)
    assert type(session.scorer) is SCORERS[policy]
