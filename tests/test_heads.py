"""Per-head caches (``Allocation.per_head``; ``stages.apply.heads``): each (layer, KV head)
keeps tokens of its own. Stage 1 equals Hugging Face's forward with each head masked to the
tokens it holds (``oracle.hf_step_logits_per_head``) after per-head culls and re-indexes;
every head holds its budget at every step; every (layer, head, slot) is accounted for; the
rules pick the slots worked out by hand; a failure part-way changes nothing; bad input is
one line and exit 2."""
import copy
import gc
import json
import math
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from positronic_brain.bench.common import host_reads
from positronic_brain.capture import CaptureRun, CaptureTape
from positronic_brain.chat import Chat
from positronic_brain.cli import main
from positronic_brain.loop import Session, head_capacity
from positronic_brain.options import params
from positronic_brain.replay import replay
from positronic_brain.scorers.brightness import Brightness
from positronic_brain.sampler import make_generator
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import apply, heads as apply_heads
from positronic_brain.stages.decide import allocation, decide
from positronic_brain.stages.decide.allocation import budgets, head_culls, retrieval_heads
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.state import Heads
from positronic_brain.types import (Actions, Allocation, CacheParams, FoldRepair, Positions,
                                    Prefill, SamplerParams, Segment, UserError)
from tests.oracle import assert_close, per_head_state_logits
from tests.test_fold import cosine_bound, mass_bound
from tests.test_page import page_data
from tests.tolerance import ORACLE, apart, step, sum_bound

TEXT = "the quick brown fox jumps over the lazy dog and runs far away " * 4


def _session(model, policy, n_prompt=40, **cache) -> Session:
    cache = {"budget": 24, "sinks": 2, "recent": 4, "scorer": "tova"} | cache
    s = Session(model, policy, SamplerParams(greedy=True), CacheParams(**cache))
    s.prime([Segment(tuple(policy.encode(TEXT))[:n_prompt], "user")])
    return s


def _duo_file(tmp_path, model) -> str:
    path = tmp_path / "heads.json"
    path.write_text(json.dumps([[0, 1], [model.spec.n_layers - 1, 0]]))
    return str(path)


@pytest.mark.parametrize("kind,repair", [("head", "none"), ("pyramid", "none"),
                                         ("adaptive", "none"), ("duo", "none"),
                                         ("head", "fold"), ("adaptive", "fold")])
def test_stage1_equals_the_per_head_oracle_after_culls_and_reindexes(tiny_model, tiny_policy,
                                                                    one_thread, tmp_path, kind,
                                                                    repair):
    """... and folds (each head's own, into its own slots: its log-mass in the oracle)."""
    extra = {"allocation_heads": _duo_file(tmp_path, tiny_model)} if kind == "duo" else {}
    cache = params(budget=24, sinks=2, recent=4, policy="tova", allocation=kind,
                   reindex_at=60, repair=repair,
                   **({"fold_min_cos": 0.2} if repair == "fold" else {}), **extra)
    s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True), cache)
    s.prime([Segment(tuple(tiny_policy.encode(TEXT))[:40], "user")])
    reindexed = differ = folded = 0
    for _ in range(36):
        gen = generate(tiny_model, s.state.view(), s.sampler, make_generator(0, "cpu"))
        assert_close(gen.logits, per_head_state_logits(tiny_model, s.state), ORACLE, f"{kind} step {s.state.step}")
        rec = s.step()
        s.state.check_valid()
        reindexed += rec.reindexed
        h = s.state.heads
        rows = [set(h.row[0, i, :int(h.n[0, i])].tolist()) for i in range(h.n.shape[1])]
        differ += rows[0] != rows[1]
        folded += rec.folded
    assert folded or repair == "none", "no fold happened"
    assert reindexed >= 1, "no re-index happened"
    assert differ, "the heads never kept different tokens"


def test_every_head_holds_its_budget_at_every_step(tiny_model, tiny_policy, one_thread, tmp_path):
    for kind in ("head", "pyramid", "duo"):
        cache = CacheParams(budget=24, sinks=2, recent=4, scorer="random", allocation=kind)
        if kind == "duo":
            cache = params(budget=24, sinks=2, recent=4, policy="random", allocation="duo",
                           allocation_heads=_duo_file(tmp_path, tiny_model))
        s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True), cache)
        s.prime([Segment(tuple(tiny_policy.encode(TEXT))[:40], "user")])
        want = budgets(cache, tiny_model.spec.n_layers, tiny_model.spec.n_kv_heads)
        assert int(want.sum()) == 24 * want.numel(), "not the memory of a budget of 24"
        for step in range(1, 13):  # the prompt's 39 cached tokens, then one more a step
            s.step()
            assert torch.equal(s.state.heads.n, want.clamp(max=39 + step)), (kind, step)
    s = _session(tiny_model, tiny_policy, scorer="random", allocation="adaptive")
    for _ in range(12):
        s.step()
        n = s.state.heads.n
        assert (n.sum(1) == 24 * n.shape[1]).all() and int(n.min()) >= 1 + int(23 * 0.2)
        assert int(n.max()) <= head_capacity(tiny_model, s.cache_params)


def test_whole_tokens_stay_todays_loop(tiny_model, tiny_policy, one_thread):
    s = _session(tiny_model, tiny_policy)
    assert s.cache_params.allocation.kind == "token" and s.state.heads is None
    s.step()
    assert s.state.arena.n == s.state.ledger.n == 24


def _hand_view(n_heads=2):
    """A view of 2 layers x ``n_heads`` KV heads over 6 ledger rows at positions 0..5, every
    head holding rows 0..5 in slots 0..5, protecting nothing."""
    L, n = 2, 6
    row = torch.arange(n).expand(L, n_heads, n).clone()
    return SimpleNamespace(heads=Heads(row=row, n=torch.full((L, n_heads), n)),
                           k=torch.zeros(L, n_heads, n, 1), position=torch.arange(n),
                           next_position=n)


def test_the_rules_drop_the_slots_worked_out_by_hand():
    view = _hand_view()
    keep = torch.zeros(6, dtype=torch.bool)
    scores = torch.tensor([[[5., 1, 4, 3, 2, 6], [1, 2, 3, 4, 5, 6]],
                           [[6., 5, 4, 3, 2, 1], [2, 2, 9, 9, 9, 9]]])
    # head: every head keeps 5 after the append, so each drops its lowest slot (ties: earlier)
    p = CacheParams(budget=6, sinks=0, recent=0, scorer="tova", allocation="head")
    got = head_culls(view, scores, p, torch.full((2, 2), 6), keep)
    assert [r.nonzero()[:, 0].tolist() for r in got.flatten(0, 1)] == [[1], [0], [5], [0]]
    # pyramid over 2 layers, budget 6, 1 protected (the append), beta 2: the 5 scored a
    # layer fall from 7.5 to 2.5, [8, 2] by largest remainder, +1 each: [9, 3]; layer 0's
    # heads keep the 6 they hold, layer 1's keep 2 + the append: their 4 lowest go
    p = CacheParams(budget=6, sinks=0, recent=0, scorer="tova",
                    allocation=Allocation("pyramid", beta=2))
    assert budgets(p, 2, 2).tolist() == [[9, 9], [3, 3]]
    got = head_culls(view, scores, p, budgets(p, 2, 2), keep)
    assert [r.nonzero()[:, 0].tolist() for r in got.flatten(0, 1)] == [
        [], [], [2, 3, 4, 5], [0, 1, 2, 3]]
    # adaptive, budget 4, floor 0.5: a layer keeps 3 x 2 = 6 slots before the append; each
    # head first its best int(3 x 0.5) = 1 (layer 1, head 1: the first of its 9s), then the
    # layer's best, equal scores the lower head's first: layer 0 keeps h0's 6, h1's 6, then
    # h0's 5 and h1's 5, h0's 4 and h1's 4; layer 1 h0's 6, h1's four 9s, h0's 5
    p = CacheParams(budget=4, sinks=0, recent=0, scorer="tova",
                    allocation=Allocation("adaptive", floor=0.5))
    got = head_culls(view, scores, p, None, keep)
    kept = [(~r).nonzero()[:, 0].tolist() for r in got.flatten(0, 1)]
    assert kept == [[0, 2, 5], [3, 4, 5], [0, 1], [2, 3, 4, 5]]
    # a protected row is never culled, in any head
    keep[1] = True
    p = CacheParams(budget=6, sinks=0, recent=0, scorer="tova", allocation="head")
    got = head_culls(view, scores, p, torch.full((2, 2), 6), keep)
    assert not got[:, :, 1].any() and got.sum() == 4


def test_duo_reads_its_heads_file(tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text("[[0, 1], [1, 0], [0, 0]]")
    assert retrieval_heads(str(grid), 3, 2).tolist() == [[False, True], [True, False],
                                                          [False, False]]
    pairs = tmp_path / "pairs.json"
    pairs.write_text("[[2, 1]]")
    assert retrieval_heads(str(pairs), 3, 2).nonzero().tolist() == [[2, 1]]
    for text in ("[[3, 0]]", "{}", "[]", "not json"):
        pairs.write_text(text)
        with pytest.raises(UserError, match="allocation-heads"):
            retrieval_heads(str(pairs), 3, 2)


def fail_at_append(monkeypatch, s: Session) -> None:
    """A step of ``s`` that fails at its last write (the append), after everything else."""
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(apply_heads, "_append", boom)
    with pytest.raises(RuntimeError, match="boom"):
        s.step()
    monkeypatch.undo()


def test_a_failure_part_way_changes_nothing(tiny_model, tiny_policy, one_thread, monkeypatch):
    s = _session(tiny_model, tiny_policy, allocation="head")
    for _ in range(3):
        s.step()
    state = s.state
    before = ({c: state.ledger.live(c).clone() for c in state.ledger.names},
              state.heads.row.clone(), state.heads.n.clone(), state.step)
    fail_at_append(monkeypatch, s)
    cols, row, n, step = before
    assert all(torch.equal(state.ledger.live(c), x) for c, x in cols.items())
    assert torch.equal(state.heads.row, row) and torch.equal(state.heads.n, n)
    assert state.step == step
    state.check_valid()
    s.step()  # and it goes on
    state.check_valid()


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["head", "pyramid", "adaptive"]), budget=st.integers(8, 20),
       prompt=st.integers(4, 30), steps=st.integers(1, 25), reindex=st.booleans())
def test_per_head_culls_never_lose_a_token_a_head_holds(tiny_model, tiny_policy, kind, budget,
                                                       prompt, steps, reindex):
    """``check_valid`` after every step: every (layer, head, slot) holds a live ledger row
    or none, each ledger row is held by some head, and every uid issued is held or dropped
    exactly once; the uids a head held and did not cull are still in the ledger."""
    torch.set_num_threads(1)
    s = _session(tiny_model, tiny_policy, n_prompt=prompt, budget=budget, sinks=1, recent=2,
                 scorer="random", allocation=kind,
                 positions=Positions(reindex_at=max(prompt, budget) + 10) if reindex
                 else Positions())
    for _ in range(steps):
        m, h = s.state.ledger, s.state.heads
        width = s.state.arena.n
        held = {(i, j, int(m.uid[r])) for i, j, slot in h.live(width).nonzero().tolist()
                for r in [int(h.row[i, j, slot])]}
        gen_step = s.step()
        s.state.check_valid()
        culled = set(gen_step.culled)
        uids = set(s.state.ledger.live("uid").tolist())
        assert {u for _, _, u in held} - culled <= uids


@pytest.mark.parametrize("argv,message", [
    (["--allocation", "head", "--policy", "tests/scorers/ema.py:Ema"], "scores whole tokens"),
    (["--allocation", "duo", "--policy", "tova"], "allocation-heads"),
    (["--allocation", "head", "--policy", "tova", "--repair", "merge"], "takes no merge repair"),
    (["--allocation", "sideways"], "--allocation"),
    (["--allocation", "pyramid", "--allocation-beta", "0.5", "--policy", "tova"], "beta"),
])
def test_bad_allocations_are_one_line_and_exit_2(capsys, argv, message):
    try:
        code = main(["run", "--model", "tiny-random", "--prompt", "hi", "--budget", "24", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_h2o_sums_each_heads_own_attention(tiny_model, tiny_policy, one_thread):
    """Per head, H2O's ``attn_sum`` of a token is what that (layer, KV head)'s query heads
    paid it, step by step (their mean), from the prompt's own (``prefill_heads``) on."""
    s = _session(tiny_model, tiny_policy, budget=64, scorer="h2o", allocation="head",
                 prefill=Prefill(scores=True))
    state = s.state
    L, KVH = state.heads.n.shape
    want = state.ledger.live("attn_sum").clone()  # (n, L, KVH): the prompt's, per head
    assert want.shape[1:] == (L, KVH) and bool((want > 0).any())
    assert not torch.equal(want[:, 0, 0], want[:, -1, -1]), "every head seeded alike"
    for _ in range(4):
        view = state.view()
        gen = generate(tiny_model, view, s.sampler, make_generator(0, "cpu"))
        paid = gen.attention.view(L, KVH, -1, view.k.shape[2]).mean(2)  # (L, KVH, slots)
        rows = view.heads.row
        for layer in range(L):
            for head in range(KVH):
                want[rows[layer, head], layer, head] += paid[layer, head]
        s.step(force=gen.token_id)
        want = torch.cat((want, torch.zeros(1, L, KVH)))  # the appended token's, from 0
        assert torch.equal(state.ledger.live("attn_sum"), want)  # the same sums, in order


def test_a_grid_names_a_per_head_allocation_with_its_policy():
    from positronic_brain.bench import flags
    from positronic_brain.bench.quality import QualityConfig
    assert flags.cell_policy("tova@adaptive") == {"policy": "tova", "allocation": "adaptive"}
    assert flags.cell_policy("h2o") == {"policy": "h2o"}
    cfg = QualityConfig(policies=("h2o", "tova@head"), budgets=(64,), repairs=("none",))
    cache = cfg.cache(64, "tova@head")
    assert cache.allocation.kind == "head" and flags.policy_label(cache) == "tova@head"
    assert flags.policy_label(cfg.cache(64, "h2o")) == "h2o"
    with pytest.raises(UserError, match="allocation must be one of"):
        QualityConfig(policies=("tova@sideways",), budgets=(64,), repairs=("none",))
    with pytest.raises(UserError, match="NAME@ALLOCATION"):
        flags.cache_options("allocation=head", None)


def test_unorderable_scores_still_cull_what_the_budget_needs():
    """A free slot scored inf or NaN still goes before a protected one would (none does):
    each head culls exactly what its budget needs."""
    view = _hand_view()
    keep = torch.zeros(6, dtype=torch.bool)
    keep[0] = True
    scores = torch.full((2, 2, 6), math.inf)
    scores[0, 0, 3] = math.nan
    p = CacheParams(budget=5, sinks=0, recent=0, scorer="tova", allocation="head")
    got = head_culls(view, scores, p, torch.full((2, 2), 5), keep)
    assert got.sum(-1).tolist() == [[2, 2], [2, 2]] and not got[:, :, 0].any()


def test_adaptive_shares_what_protection_leaves():
    """AdaKV's floor is a share of the scored part of the budget (what the protected tokens,
    held by every head, leave): a head whose scores all lose still keeps its share."""
    view = _hand_view()
    keep = torch.tensor([True, True, False, False, False, False])
    scores = torch.tensor([[[0., 0, 9, 8, 7, 6], [0, 0, 1, 1, 1, 1]]] * 2)
    p = CacheParams(budget=5, sinks=0, recent=0, scorer="tova",
                    allocation=Allocation("adaptive", floor=0.5))
    got = head_culls(view, scores, p, None, keep)
    # 5 - 1 - 2 protected = 2 scored a head, 4 a layer; each head first its best 1 (head 1:
    # its latest of equal scores, position 5), then the layer's best: 9, 8, 7 of head 0
    kept = [(~r).nonzero()[:, 0].tolist() for r in got.flatten(0, 1)]
    assert kept == [[0, 1, 2, 3, 4], [0, 1, 5]] * 2
    with pytest.raises(UserError, match="too small"):
        head_culls(view, scores, CacheParams(budget=2, sinks=0, recent=0, scorer="tova",
                                             allocation="adaptive"), None,
                   torch.ones(6, dtype=torch.bool))


def test_a_re_index_waits_until_what_the_heads_hold_fits(tiny_model, tiny_policy, one_thread):
    """The heads together hold more tokens than one head's budget: a re-index is made only
    where it brings the next position back below the re-index point."""
    s = _session(tiny_model, tiny_policy, n_prompt=20, budget=8, sinks=1, recent=2,
                 scorer="random", allocation="head", positions=Positions(reindex_at=40))
    reindexed = 0
    for _ in range(60):
        rec = s.step()
        s.state.check_valid()
        if rec.reindexed:
            reindexed += 1
            assert s.state.next_position < 40
    assert reindexed >= 1


def test_a_per_head_cache_takes_no_cuda_graph(tiny_model, tiny_policy, monkeypatch):
    monkeypatch.setattr(tiny_model, "compiled", "graph")
    with pytest.raises(UserError, match="compile graph"):
        Session(tiny_model, tiny_policy, SamplerParams(greedy=True),
                CacheParams(budget=24, scorer="tova", allocation="head"))


def _head_brightness(b, attention, vnorm, held, gain, decay, top=255.0):
    """Brightness's rule per (layer, KV head), by hand in float64: each head's share of a
    slot is its query heads' mean attention x the slot's value norm over the head's mean
    live norm, x the head's live count."""
    L, KVH, n = b.shape
    group = attention.shape[1] // KVH
    out = torch.empty(L, KVH, n, dtype=torch.float64)
    for layer in range(L):
        for head in range(KVH):
            k = int(held[layer, head])
            norms = vnorm[layer, head, :k].double()
            paid = attention[layer, head * group:(head + 1) * group, :k].double().mean(0)
            share = k * paid * norms / norms.mean()
            out[layer, head, :k] = (b[layer, head, :k].double() - decay + gain * share).clamp(0, top)
    return out


def test_brightness_lights_each_head_by_its_own_window_and_queries(tiny_model, tiny_policy,
                                                                  one_thread):
    """Per head, a prompt token's brightness is the window's rule for that (layer, KV head)
    alone, its share the largest of the ``pool`` slots around it; each step then adds what
    that head's own query heads paid each of its slots."""
    cache = params(budget=24, sinks=2, recent=4, policy="brightness", allocation="head", pool=3)
    s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True), cache)
    stats = s.prime([Segment(tuple(tiny_policy.encode(TEXT))[:40], "user")])
    sc, state = s.scorer, s.state
    L, KVH, n = state.heads.row[:, :, :state.arena.n].shape
    w = stats.window_queries
    share = _head_brightness(torch.zeros(L, KVH, n), stats.window, state.arena.vnorm,
                             state.heads.n, 1.0, 0.0, math.inf)  # the bare shares
    pooled = torch.stack([share[:, :, max(0, j - 1):j + 2].amax(-1) for j in range(n)], -1)
    want = (w * (sc.gain * pooled - sc.decay)).clamp(0, 255)
    got = state.ledger.live("brightness").permute(1, 2, 0)
    bound = sum_bound(torch.float32, n, 255.0)  # the same sums, ours added in any order
    assert (got.double() - want).abs().max() <= bound and bool((got > 0).any())
    assert not torch.equal(got[0, 0], got[-1, -1]), "every head lit alike"
    for _ in range(6):
        view = state.view()
        gen = generate(tiny_model, view, s.sampler, make_generator(0, "cpu"))
        b = view.columns["brightness"][view.heads.row.clamp(min=0), torch.arange(L)[:, None, None],
                                       torch.arange(KVH)[None, :, None]]
        want = _head_brightness(b, gen.attention, view.vnorm, view.heads.n, sc.gain, sc.decay)
        out = s.scorer.score_heads(view, gen.attention)
        live = view.heads.live(view.k.shape[2])
        assert (out.scores.double() - want)[live].abs().max() <= bound
        s.step(force=gen.token_id)
        s.state.check_valid()


def test_brightness_shrinks_each_heads_share_toward_its_tokens_mean():
    """``shrink``: each slot's share moves that fraction of the way to the mean share its
    token gets over the heads that hold it; a free slot's is left as it was (hand-worked)."""
    row = torch.tensor([[[0, 1, 2], [2, 0, -1], [1, -1, -1]]])  # (1 layer, 3 KV heads, 3 slots)
    view = SimpleNamespace(heads=Heads(row=row, n=torch.tensor([[3, 2, 1]])), n=3)
    share = torch.tensor([[[1.0, 2.0, 3.0], [5.0, 7.0, 9.0], [8.0, 6.0, 4.0]]])
    # the tokens' means: row 0 (1 + 7) / 2 = 4, row 1 (2 + 8) / 2 = 5, row 2 (3 + 5) / 2 = 4
    half = Brightness(shrink=0.5)._shrunk(view, share)
    assert torch.equal(half, torch.tensor([[[2.5, 3.5, 3.5], [4.5, 5.5, 9.0], [6.5, 6.0, 4.0]]]))
    assert torch.equal(Brightness(shrink=1.0)._shrunk(view, share),
                       torch.tensor([[[4.0, 5.0, 4.0], [4.0, 4.0, 9.0], [5.0, 6.0, 4.0]]]))
    with pytest.raises(UserError, match=r"shrink must be in \[0, 1\], got 1.5"):
        Brightness(shrink=1.5)


def test_brightness_shrink_sums_in_a_fixed_order_and_reads_nothing_back():
    """The heads' mean share of a token is a sum in one order on every device: no operator
    that adds into an index (a GPU runs those as atomics, in any order), no host read; and
    it is the mean (a float64 reference, a random per-head map with free slots)."""
    g = torch.Generator().manual_seed(3)
    L, KVH, width, n = 4, 3, 40, 90
    row = torch.stack([torch.randperm(n, generator=g)[:width] for _ in range(L * KVH)])
    row[torch.rand(L * KVH, width, generator=g) < 0.2] = -1
    row = row.view(L, KVH, width)
    view = SimpleNamespace(heads=Heads(row=row, n=(row >= 0).sum(-1)), n=n)
    share = torch.rand(L, KVH, width, generator=g) * 4
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            adds = name in ("index_put", "index_put_") and (
                args[3] if len(args) > 3 else kwargs.get("accumulate", False))
            seen.append(name + (" accumulate" if adds else ""))
            return func(*args, **kwargs)

    with Ops():
        out = Brightness(shrink=0.25)._shrunk(view, share)
    adding = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
              "scatter_reduce_", "bincount", "put_", "index_put accumulate",
              "index_put_ accumulate"}
    assert not set(seen) & adding, seen
    assert not host_reads(lambda: Brightness(shrink=0.25)._shrunk(view, share))
    held = row >= 0
    total = torch.zeros(n, dtype=torch.float64).index_add(0, row[held], share[held].double())
    count = torch.bincount(row[held], minlength=n).clamp(min=1)
    mean = (total / count)[row.clamp(min=0)]
    want = torch.where(held, share + 0.25 * (mean - share), share.double())
    # the sum of at most L x KVH shares of at most 4, then a division's and a lerp's
    # roundings (a step each, of values up to 4)
    bound = sum_bound(torch.float32, L * KVH, 4 * L * KVH) + 3 * 4 * step(torch.float32)
    assert (out.double() - want).abs().max() <= bound


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_a_step_at_the_budget_culls_what_the_sort_would(data):
    """Where each head culls one slot at most (a step at the budget), the culls found
    without a sort are the sort's, whatever the scores (ties, inf, NaN) and the protection."""
    L, KVH, n = 2, 3, data.draw(st.integers(1, 9))
    values = st.sampled_from([0.0, 1.0, 2.0, math.inf, -math.inf, math.nan])
    scores = torch.tensor(data.draw(st.lists(values, min_size=L * KVH * n,
                                             max_size=L * KVH * n))).view(L, KVH, n)
    held = torch.tensor(data.draw(st.lists(st.integers(0, n), min_size=L * KVH,
                                           max_size=L * KVH))).view(L, KVH)
    order = data.draw(st.permutations(range(n)))
    row = torch.tensor(order).expand(L, KVH, n).clone()
    live = torch.arange(n) < held.unsqueeze(-1)
    row[~live] = -1
    view = SimpleNamespace(heads=Heads(row=row, n=held), position=torch.arange(n) * 3,
                           next_position=3 * n)
    protect = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    at = row.clamp(min=0)
    free = live & ~protect[at]
    need = torch.tensor(data.draw(st.lists(st.integers(0, 1), min_size=L * KVH,
                                           max_size=L * KVH))).view(L, KVH)
    need = torch.minimum(need, free.sum(-1))
    args = (view, scores, free)
    fast = allocation._lowest(*args, at, need)
    assert torch.equal(fast, allocation._sorted(*args, live, at, need))
    assert torch.equal(fast.sum(-1), need)


def test_a_per_head_run_captures_replays_forks_and_draws(tmp_path, capsys, one_thread):
    """A per-head run (culls, a re-index) captured at level full replays bit for bit (its
    head map among each view's inputs and each state file's); a fork of it goes on per head
    and replays too; inspect and the page say how many heads hold each token."""
    run = ["run", "--model", "tiny-random", "--prompt", TEXT, "--max-new-tokens", "30",
           "--ignore-eos", "--budget", "16", "--sinks", "1", "--recent", "2",
           "--allocation", "head", "--reindex-at", "60", "--repair", "fold", "--json",
           "--compile", "none"]
    assert main([*run, "--capture", str(tmp_path / "c"), "--capture-level", "full"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert any(s["reindexed"] for s in res["steps"]) and sum(len(s["culled"]) for s in res["steps"])
    assert sum(s["folded"] for s in res["steps"])
    heads = 2 * 2  # tiny-random's layers x KV heads
    tokens = len(res["prompt_ids"]) + len(res["generated_ids"]) - 1
    assert res["kv"] == {"pairs": 16 * heads, "bytes": 16 * heads * 2 * 16 * 4, "tokens": 16,
                         "full_pairs": tokens * heads, "fraction": 16 / tokens}
    files = CaptureRun(res["capture"]).step(5)
    assert files.view["heads"]["row"].shape[:2] == files.view["heads"]["n"].shape
    assert main(["replay", res["capture"]]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    assert main(["fork", res["capture"], "--step", "12", "--policy", "h2o", "--json",
                 "--capture", str(tmp_path / "f")]) == 0
    fk = json.loads(capsys.readouterr().out)
    assert main(["replay", fk["capture"]]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    assert main(["fork", res["capture"], "--step", "12", "--allocation", "token"]) == 2
    assert "per-head" in capsys.readouterr().err
    assert main(["compare", res["capture"], fk["capture"], "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 2
    assert main(["inspect", res["capture"]]) == 0
    assert f"of {heads} (layer, KV head)s" in capsys.readouterr().out
    page = tmp_path / "p.html"
    assert main(["inspect", res["capture"], "--html", str(page)]) == 0
    data = page_data(page)
    step = data["runs"][0]["steps"][-1]
    assert data["runs"][0]["heads"] == heads and len(step["held"]) == len(step["uid"])
    assert 1 <= min(step["held"]) and max(step["held"]) == heads  # the sinks: every head's


def test_a_fork_of_a_duo_run_takes_another_per_head_allocation(tmp_path, capsys, one_thread,
                                                               tiny_model):
    """A fork given ``--allocation head`` of a duo parent (whose retrieval-heads file it
    inherits, unused) goes on with every head keeping up to the budget, and replays."""
    run = ["run", "--model", "tiny-random", "--prompt", TEXT, "--max-new-tokens", "16",
           "--ignore-eos", "--budget", "16", "--sinks", "1", "--recent", "2", "--allocation",
           "duo", "--allocation-heads", _duo_file(tmp_path, tiny_model), "--json",
           "--compile", "none", "--capture", str(tmp_path / "c")]
    assert main(run) == 0
    res = json.loads(capsys.readouterr().out)
    assert main(["fork", res["capture"], "--step", "8", "--allocation", "head", "--json",
                 "--capture", str(tmp_path / "f")]) == 0
    fk = CaptureRun(json.loads(capsys.readouterr().out)["capture"])
    before, after = (fk.stage(t, "s2_score").args["cache_params"].allocation for t in (7, 8))
    assert (before.kind, after.kind, after.heads) == ("duo", "head", before.heads)
    # each step's view (before its cull): under duo (64 pairs in all) the streaming heads
    # keep the sink, the recent window and the pending token, the retrieval heads ((0, 1)
    # and (1, 0), the file's) the rest; from the fork on every head keeps up to 16, and
    # the streaming heads, which cannot get back what they let go, fill a slot a step
    n = [fk.step(t).view["heads"]["n"].tolist() for t in fk.steps[1:]]
    assert n[:7] == [[[4, 28], [28, 4]]] * 7
    assert n[7:] == [[[k, 16], [16, k]] for k in range(5, 5 + len(n) - 7)]
    assert main(["replay", str(fk.dir)]) == 0
    assert "all bit-exact" in capsys.readouterr().err


def test_a_per_head_cache_starts_from_a_one_token_prompt(tiny_model, tiny_policy, one_thread):
    """The first step reads no slot (a one-token prompt is all pending): nothing to cull,
    as bench quality's streams start."""
    s = _session(tiny_model, tiny_policy, n_prompt=1, budget=8, sinks=1, recent=2,
                 scorer="brightness", allocation="head")
    for _ in range(12):
        s.step()
        s.state.check_valid()
    assert s.state.heads.n.eq(8).all()


def test_each_head_folds_what_it_culls_into_its_most_alike_survivor(tiny_model, tiny_policy,
                                                                    one_thread):
    """Fold per head: each slot a head culls folds into the slot of that head whose key is
    most alike, so each head's masses add up to every token that entered the cache."""
    s = _session(tiny_model, tiny_policy, budget=16, sinks=1, recent=2, scorer="tova",
                 allocation="head", repair=FoldRepair(min_cos=-1.0))
    state, folds = s.state, 0
    for _ in range(16):
        view = state.view()
        gen = generate(tiny_model, view, s.sampler, s.generator)
        actions = decide(tiny_model, view, score(view, gen.attention, s.scorer), s.cache_params)
        culls, into = actions.head_culls, actions.head_folds
        assert torch.equal(into >= 0, culls)  # min cos -1: every cull folds
        for layer, head, slot in culls.nonzero().tolist():
            keys = view.k[layer, head, :int(view.heads.n[layer, head])]
            cos = F.cosine_similarity(keys, keys[slot][None], dim=-1)
            cos[culls[layer, head, :len(cos)]] = -math.inf
            assert cos[int(into[layer, head, slot])] >= cos.max() - 2 * cosine_bound(tiny_model)
            folds += 1
        apply(tiny_model, state, gen, actions)
        state.check_valid()
        masses = state.arena.log_mass[:, :, :state.arena.n].exp()
        masses = (masses * state.heads.live(state.arena.n)).sum(-1)  # (L, KVH)
        assert_close(masses, torch.full_like(masses, float(state.next_position)),
                     mass_bound(state.next_position), "each head's mass")
    assert folds >= 16


def test_a_per_head_session_saves_loads_and_goes_on(tiny_model, tiny_policy, one_thread,
                                                    tmp_path):
    """A per-head session (culls, folds and a re-index behind it, h2o's column a value a
    head) saved and loaded goes on as it would have: the same tokens and logprobs, ledger,
    head map and live K/V, bit for bit."""
    s = Session(tiny_model, tiny_policy, SamplerParams(temperature=1.0, seed=4), CacheParams(
        budget=16, sinks=1, recent=2, scorer="h2o", allocation=Allocation(kind="head"),
        repair=FoldRepair(), positions=Positions(reindex_at=50)))
    s.prime([Segment(tuple(tiny_policy.encode(TEXT))[:40], "user")])
    fresh = load_session(tiny_model, save_session(s, tmp_path / "fresh.pbs"))  # every head
    assert torch.equal(fresh.state.heads.n, s.state.heads.n)  # holds every token yet
    records = [s.step() for _ in range(20)]
    assert any(r.culled for r in records) and any(r.reindexed for r in records)
    assert s.state.ledger.n > s.state.arena.n  # the heads' union passes one head's slots
    loaded = load_session(tiny_model, save_session(s, tmp_path / "h.pbs"))
    assert loaded.state.heads is not None and loaded.cache_params == s.cache_params
    ours = [loaded.step() for _ in range(10)]
    theirs = [s.step() for _ in range(10)]
    assert [(r.token_id, r.logprob) for r in ours] == [(r.token_id, r.logprob) for r in theirs]
    a, b = loaded.state, s.state
    assert a.ledger.rows() == b.ledger.rows()
    assert torch.equal(a.heads.n, b.heads.n)
    assert torch.equal(a.heads.row[:, :, :a.arena.n], b.heads.row[:, :, :b.arena.n])
    va, vb = a.view(), b.view()
    assert torch.equal(va.k, vb.k) and torch.equal(va.v, vb.v)
    assert torch.equal(va.columns["attn_sum"], vb.columns["attn_sum"])
    state = weakref.ref(s.state)  # nothing keeps a finished session's state alive
    del s, a, b, va, vb
    gc.collect()
    assert state() is None


def test_a_per_head_session_goes_on_from_the_cli_captured(tmp_path, capsys, one_thread):
    """``run --save`` of a per-head run, ``run --session`` of it captured: the capture's
    restore holds the head map and replays bit for bit. Exporting part of it is refused in
    one line."""
    saved = tmp_path / "h.pbs"
    assert main(["run", "--model", "tiny-random", "--prompt", TEXT, "--max-new-tokens", "12",
                 "--ignore-eos", "--budget", "16", "--sinks", "1", "--recent", "2",
                 "--allocation", "head", "--policy", "tova", "--json", "--save",
                 str(saved)]) == 0
    capsys.readouterr()
    assert main(["run", "--session", str(saved), "--max-new-tokens", "8", "--ignore-eos",
                 "--json", "--capture", str(tmp_path / "c")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["steps"]) == 8 and res["kv"]["pairs"] == 16 * 4
    assert main(["replay", res["capture"]]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    assert main(["export", str(saved), "--out", str(tmp_path / "y.pbs"), "--layers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be exported in part" in err[0], err


@pytest.mark.parametrize("scorer", ["tova", "h2o", "knorm"])  # h2o: a column a head
def test_a_turn_per_head_is_its_tokens_stepped_one_at_a_time(tiny_model, tiny_policy,
                                                             one_thread, scorer):
    """Stage 0's extend of a per-head cache whose heads hold different tokens caches each new
    token in every head's next slot, with the K/V that stepping the tokens one at a time
    gives (stage 1 over each head's own tokens, stage 4 appending without a cull), to float
    rounding; stage 1 then equals the per-head oracle, before and after the culls back to
    the budget."""
    s = _session(tiny_model, tiny_policy, budget=16, sinks=1, recent=2, scorer=scorer,
                 allocation=Allocation(kind="head"))
    for _ in range(12):
        s.step()
    h = s.state.heads
    assert not all(torch.equal(h.row[0, 0], h.row[i, j]) for i in range(h.row.shape[0])
                   for j in range(h.row.shape[1]))  # the heads hold different tokens
    ref = copy.deepcopy(s.state)
    turn = tuple(tiny_policy.encode(" the cat sat"))
    s.extend([Segment(turn, "user")])
    s.state.check_valid()
    for token in turn:
        gen = generate(tiny_model, ref.view(), SamplerParams(greedy=True), make_generator(0),
                       force=token)
        apply(tiny_model, ref, gen, Actions())
    a, b = s.state, ref
    assert torch.equal(a.heads.n, b.heads.n) and int(a.heads.n.min()) == 16 + len(turn)
    assert torch.equal(a.heads.row, b.heads.row)
    keep = ("uid", "token_id", "position")  # (stepped, a token is the model's own)
    assert [{k: r[k] for k in keep} for r in a.ledger.rows()] == \
        [{k: r[k] for k in keep} for r in b.ledger.rows()]
    assert (a.pending_token, a.next_position) == (b.pending_token, b.next_position)
    va, vb = a.view(), b.view()
    for x, y in ((va.k, vb.k), (va.v, vb.v)):
        tol = apart(tiny_model, float(y.abs().max()), a.arena.n, tiny_model.spec.n_layers - 1)
        assert (x - y).abs().max() <= tol
    for _ in range(3):
        gen = generate(tiny_model, s.state.view(), SamplerParams(greedy=True), make_generator(0))
        assert_close(gen.logits, per_head_state_logits(tiny_model, s.state), ORACLE, "after the turn")
        s.step()
    assert torch.equal(s.state.heads.n, torch.full_like(s.state.heads.n, 16))


def test_a_per_head_chat_holds_each_heads_budget_and_replays(tiny_model, tiny_policy, tmp_path,
                                                             one_thread):
    """Turns of a chat under a per-head allocation: after each reply every head holds at most
    its budget (then all of it), the system prompt in every head; the capture (its turns
    with their head maps) replays bit for bit."""
    capture = CaptureTape(tmp_path, {"model": tiny_model.name, "dtype": "float32",
                                     "fingerprint": tiny_model.fingerprint}, run_id="chat")
    chat = Chat(tiny_model, tiny_policy, system="Be brief.", max_new_tokens=6, tape=capture,
                sampler=SamplerParams(temperature=1.0, seed=5),
                cache_params=CacheParams(budget=64, sinks=2, recent=4, scorer="tova",
                                         allocation=Allocation(kind="head")))
    for q in ("one", "two", "three", "four", "five"):
        chat.say(q)
        state = chat.session.state
        state.check_valid()  # pinned: every head holds the system prompt
        assert int(state.heads.n.max()) <= 64
    assert torch.equal(state.heads.n, torch.full_like(state.heads.n, 64))
    assert chat.stats()["culled"] > 0 and state.ledger.n > 64  # the heads kept other tokens
    capture.close(chat.session.stop_reason)
    report = replay(capture.dir, model=tiny_model)
    assert report.ok, report.mismatches[:3]
    assert report.compared["s0_extend"] == 5
