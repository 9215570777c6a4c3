"""Stage 3: decide culls, repairs and re-index from the scores (read-only).

`pytest tests/test_loop_step3_decide.py -s` walks a real-model session past its budget and
prints the actions stage 3 chose.
"""
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from positronic_brain import options
from positronic_brain.loop import Session
from positronic_brain.model import hf_forward
from positronic_brain.stages.apply import prime
from positronic_brain.stages.decide import decide, pick_pairs, protected, merge_pair
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.types import CacheParams, SamplerParams, ScoreOut, UserError
from tests.oracle import assert_close
from tests.test_loop_step1_generate import _assert_unchanged, _fingerprint
from tests.tolerance import ORACLE

GREEDY = SamplerParams(greedy=True)


@pytest.fixture(scope="module")
def at_budget(real_model, real_policy):
    """A real-model session at its budget of 32, with stages 1-2 run on its next step."""
    cache = CacheParams(budget=32, sinks=2, recent=4, repair="merge")
    session = Session(real_model, real_policy, GREEDY, cache)
    session.prime(real_policy.raw_prompt("The lighthouse keeper climbed the stairs every "
                                         "evening to light the lamp before the ships"))
    while session.state.arena.n < 32:
        session.step()
    view = session.state.view()
    gen = generate(real_model, view, GREEDY, session.generator)
    return session, view, score(view, gen.attention, session.scorer)


def test_decide_at_budget_on_the_real_model(at_budget, real_model, real_policy):
    session, view, scores = at_budget
    before = _fingerprint(session.state)
    actions = decide(real_model, view, scores, session.cache_params)
    _assert_unchanged(before, _fingerprint(session.state))  # stage 3 is read-only
    text = lambda s: repr(real_policy.token_text(int(view.token_id[s])))  # noqa: E731
    for r in actions.merges:
        print(f"\nrepair: {text(r.slots[0])} {text(r.slots[1])} @{r.position} -> "
              f"{real_policy.token_text(r.token_id)!r}")
    print("culls:", [text(s) for s in actions.cull_slots], "reindex:", actions.reindex)
    # at the budget exactly one removal makes room for the append: here a repair
    assert len(actions.cull_slots) + len(actions.merges) == 1 and len(actions.merges) == 1
    assert actions.columns is scores.columns and not actions.reindex


def test_repair_kv_and_token_equal_hf(at_budget, real_model):
    """The repair's token is HF's argmax after the left context; its K/V equal an HF forward
    of the left context plus that token (per layer, to ``ORACLE``)."""
    session, view, scores = at_budget
    keep = protected(view, session.cache_params)
    (left, first, second), = pick_pairs(scores.scores, view.position, keep, 1)
    r = merge_pair(real_model, view, left, first, second)
    pos = view.position

    def hf_over(mask, ids, positions):
        cache = DynamicCache(ddp_cache_data=[(view.k[i][:, mask][None].clone(),
                                              view.v[i][:, mask][None].clone())
                                             for i in range(view.k.shape[0])])
        out = hf_forward(real_model.hf, torch.tensor([ids]), cache,
                         position_ids=torch.tensor([positions]), use_cache=True)
        return out, cache

    out, _ = hf_over(pos < pos[left], [int(view.token_id[left])], [int(pos[left])])
    assert r.token_id == int(out.logits[0, -1].argmax())
    _, cache = hf_over(pos < pos[first], [r.token_id], [r.position])
    for i in range(view.k.shape[0]):
        assert_close(r.k[i, :, 0], cache.layers[i].keys[0, :, -1], ORACLE, f"layer {i} repair K")
        assert_close(r.v[i, :, 0], cache.layers[i].values[0, :, -1], ORACLE,
                     f"layer {i} repair V")
    assert r.position == int(pos[first]) and r.uids == (int(view.uid[first]), int(view.uid[second]))


def _view(tiny_model, tiny_policy, n_prompt=21, flags=None):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("x" * n_prompt), capacity=64)
    view = state.view()
    # shuffle slot order against text order, as culls do
    perm = torch.randperm(view.n, generator=torch.Generator().manual_seed(0))
    return replace(view, position=view.position[perm],
                   flags=view.flags if flags is None else flags.to(view.flags.device))


def _scores(view, s: torch.Tensor) -> ScoreOut:
    """Scores built here, on the view's device."""
    return ScoreOut(scores=s.to(view.uid.device))


def test_budget_rules(tiny_model, tiny_policy):
    view = _view(tiny_model, tiny_policy)  # 20 live slots
    scores = _scores(view, torch.rand(20, generator=torch.Generator().manual_seed(1)))
    for budget, culls in ((40, 0), (21, 0), (20, 1), (15, 6)):
        cache = CacheParams(budget=budget, sinks=1, recent=2)
        assert len(decide(tiny_model, view, scores, cache).cull_slots) == culls, budget
    assert decide(tiny_model, view, scores, CacheParams()).cull_slots == ()


def test_culls_are_the_lowest_unprotected(tiny_model, tiny_policy):
    flags = torch.zeros(20, dtype=torch.int8)
    flags[[5, 6]] = 1  # pinned
    view = _view(tiny_model, tiny_policy, flags=flags)
    s = torch.rand(20, generator=torch.Generator().manual_seed(2))
    s[[5, 6]] = -1.0  # pinned tokens are dim but never culled
    order = torch.argsort(view.position)
    s[order[:3]] = -2.0  # the sinks are dimmest of all
    s[order[-4:]] = -3.0  # and so is the recent window
    cache = CacheParams(budget=12, sinks=3, recent=4)
    actions = decide(tiny_model, view, _scores(view, s), cache)
    culled = set(actions.cull_slots)
    assert len(culled) == 9
    keep = protected(view, cache).cpu()
    assert keep.sum() == 3 + 4 + 2 and not culled & set(keep.nonzero()[:, 0].tolist())
    free = [i for i in range(20) if not keep[i]]
    assert culled == set(sorted(free, key=lambda i: float(s[i]))[:9])


def test_ties_cull_the_earlier_position(tiny_model, tiny_policy):
    view = _view(tiny_model, tiny_policy)
    actions = decide(tiny_model, view, _scores(view, torch.zeros(20)),
                     CacheParams(budget=18, sinks=0, recent=0))
    assert sorted(view.position[list(actions.cull_slots)].tolist()) == [0, 1, 2]


def test_too_many_protected_is_a_user_error(tiny_model, tiny_policy):
    view = _view(tiny_model, tiny_policy, flags=torch.ones(20, dtype=torch.int8))
    with pytest.raises(UserError, match="protected"):
        decide(tiny_model, view, _scores(view, torch.zeros(20)),
               CacheParams(budget=10, sinks=1, recent=1))


def test_pairs_are_adjacent_disjoint_and_unprotected():
    position = torch.tensor([4, 0, 1, 2, 3, 5, 6, 7, 8, 9])  # slot -> position
    by_position = torch.tensor([9.0, 1, 1, 5, 0, 0, 5, 5, 0.5, 0.5])
    s = by_position[position]  # slot -> score
    keep = position == 8
    pairs = pick_pairs(s, position, keep, 3)
    by_pos = [tuple(int(position[x]) for x in p) for p in pairs]
    # (4,5) costs 0; then (1,2) at 2; (3,4), (5,6), (2,3) overlap; (6,7) at 10; (7,8) and
    # (8,9) hold a protected token; (0,1) has no left neighbour
    assert by_pos == [(3, 4, 5), (0, 1, 2), (5, 6, 7)]
    used = [x for p in pairs for x in p[1:]]
    assert len(used) == len(set(used)) and not keep[used].any()
    assert pick_pairs(s, position, keep, 1) == pairs[:1]


def test_reindex_flag(tiny_model, tiny_policy):
    view = replace(_view(tiny_model, tiny_policy), next_position=99)
    scores = _scores(view, torch.zeros(20))
    assert decide(tiny_model, view, scores, options.params(reindex_at=100)).reindex
    assert not decide(tiny_model, view, scores, options.params(reindex_at=101)).reindex
    assert not decide(tiny_model, view, scores, options.params(reindex_at=100, positions="keep")).reindex
    at_max = replace(view, next_position=tiny_model.spec.max_positions - 1)
    assert decide(tiny_model, at_max, scores, CacheParams()).reindex
