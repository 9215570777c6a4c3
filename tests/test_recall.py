"""The recall tier: culled tokens go to a cold store and come back when the query attends
to them; hot keys and recalled keys alike are what Hugging Face's forward would use."""
import dataclasses

import pytest
import torch

from positronic_brain import options
from positronic_brain.capture import CaptureTape
from positronic_brain.forward import rope_cos_sin
from positronic_brain.loop import Session, run
from positronic_brain.replay import replay
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import apply
from positronic_brain.stages.decide import decide, recalled, swaps
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import recall_query, score
from positronic_brain.types import (SOURCES, CacheParams, Column, Recall, SamplerParams, Segment,
                                    Totals, UserError)
from tests.oracle import assert_close, hf_step_logits
from tests.tolerance import ORACLE, step, sum_bound

GREEDY = SamplerParams(greedy=True)
def _spanned(span: int, margin: float = 0.0) -> CacheParams:
    return CacheParams(budget=24, recall=Recall(span=span, margin=margin))


RECALL = options.params(budget=24, sinks=2, recent=4, recall=True, recall_max=4, recall_layers=2,
                     reindex_at=70)
PROMPT = "bring back what the query attends to, " * 2


def _session(model, policy, params=RECALL, sampler=GREEDY, tape=None):
    s = Session(model, policy, sampler, params, **({"tape": tape} if tape else {}))
    s.prime(policy.raw_prompt(PROMPT))
    return s


def _hf_key(model, token_id: int, position: int) -> torch.Tensor:
    """The key (L, kv_heads, head_dim) HF's own layers give ``token_id`` at ``position``
    after a forward of nothing else before it: its first layer's only (no past needed)."""
    hf = model.hf.model
    x = hf.embed_tokens(torch.tensor([[token_id]], device=model.device))
    layer = hf.layers[0]
    h = layer.input_layernorm(x)
    k = layer.self_attn.k_proj(h).view(1, 1, -1, model.spec.head_dim).transpose(1, 2)
    cos, sin = rope_cos_sin(model, torch.tensor([position], device=model.device), torch.float32)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    _, k = apply_rotary_pos_emb(k, k, cos[None], sin[None])
    return k[0, :, 0]  # (kv_heads, head_dim)


def _relative(gen, view, layers) -> float:
    """How far exp(q.k - lse) of a live key may lie from the attention stage 1 paid it,
    relative: the score, a head_dim-term sum by another kernel; stage 1's normalising sum
    over the n live slots and the token itself, and its log-sum-exp rounded at its size;
    the subtraction, the exp and a value weight's log or product, a step each."""
    KVH, D = view.k.shape[1], view.k.shape[-1]
    G = gen.query.shape[1] // KVH
    scores = max(float((gen.query[i].view(KVH, G, D).abs() @ view.k[i].abs().transpose(1, 2))
                       .max()) for i in layers)
    return (sum_bound(torch.float32, D, scores) + sum_bound(torch.float32, view.n + 1)
            + step(torch.float32) * (float(gen.lse.abs().max()) + 3))


def test_recall_off_takes_no_query_and_no_cold_store(tiny_model, tiny_policy):
    s = _session(tiny_model, tiny_policy, dataclasses.replace(RECALL, recall=False))
    assert s.state.cold is None and s.state.view().cold is None
    gen = generate(tiny_model, s.state.view(), GREEDY, s.generator)
    assert gen.query is None and gen.lse is None


def test_cold_scores_are_the_attention_a_key_would_get(tiny_model, tiny_policy):
    """exp(q.k - lse) for a live key equals the attention stage 1 paid it."""
    s = _session(tiny_model, tiny_policy)
    view = s.state.view()
    gen = generate(tiny_model, view, GREEDY, s.generator)
    L, H, D = gen.query.shape
    KVH = view.k.shape[1]
    for i in range(L):
        sc = torch.matmul(gen.query[i].view(KVH, H // KVH, D), view.k[i].transpose(1, 2))
        p = (sc.float().reshape(H, -1) - gen.lse[i, :, None]).exp()
        bound = _relative(gen, view, (i,)) * float(gen.attention[i].max())
        assert_close(p, gen.attention[i], bound, f"layer {i}")


def test_recall_never_loses_a_uid_and_logits_match_hf(tiny_model, tiny_policy):
    """Stages one by one past the budget and two re-indexes: every step's accounts hold,
    the arena stays at the budget, swaps happen, stage 1 equals HF's forward on the live
    K/V after recalls (and after re-indexes), and a recalled key equals HF's key for its
    token at its position."""
    s = _session(tiny_model, tiny_policy)
    state, totals, reindexed, checked = s.state, Totals(), 0, 0
    for _ in range(120):
        rec = s.step()
        totals.add(rec)
        state.check_valid()
        assert state.arena.n <= RECALL.budget
        reindexed += rec.reindexed
        if rec.recalled:
            view = state.view()
            gen = generate(tiny_model, view, GREEDY, torch.Generator())
            assert_close(gen.logits, hf_step_logits(tiny_model, view), ORACLE, "logits")
            slot = int((view.uid == rec.recalled[0]).nonzero()[0, 0])
            key = _hf_key(tiny_model, int(view.token_id[slot]), int(view.position[slot]))
            assert_close(view.k[0, :, slot], key, ORACLE, "recalled key")  # against HF's
            checked += 1
    assert totals.recalled > 0 and reindexed >= 1 and checked > 0
    cold = state.cold
    m = cold.ledger
    for r in range(0, cold.n, max(1, cold.n // 5)):  # cold keys sit at their current positions
        key = _hf_key(tiny_model, int(m.token_id[r]), int(m.position[r]))
        assert_close(cold.arena.k[0, :, r], key, ORACLE, f"cold key {r}")  # against HF's


def test_the_cold_store_is_bounded_and_drops_the_oldest(tiny_model, tiny_policy):
    s = _session(tiny_model, tiny_policy, options.cache_params({"cold_capacity": 5, "reindex_at": None}, RECALL))
    first_cooled = []
    for _ in range(20):
        patch_rec = s.step()
        s.state.check_valid()
        first_cooled += [u for u in patch_rec.culled]
    cold = s.state.cold
    assert cold.n == 5 and s.state.ledger.dropped > 0
    assert first_cooled[0] not in cold.ledger.live("uid").tolist()


def test_replay_with_recall_is_bit_exact(tmp_path, tiny_model, tiny_policy):
    tape = CaptureTape(tmp_path, {"model": tiny_model.name, "dtype": "float32",
                                  "fingerprint": tiny_model.fingerprint})
    result = run(tiny_model, tiny_policy, tiny_policy.raw_prompt(PROMPT),
                 SamplerParams(seed=3), max_new_tokens=80, ignore_eos=True,
                 cache_params=RECALL, tape=tape)
    assert result["totals"]["recalled"] > 0 and result["totals"]["reindexed"] >= 1
    assert any(st["recalled"] for st in result["steps"])
    report = replay(tape.dir, model=tiny_model)
    assert report.ok, report.mismatches[:3]
    assert report.steps == 80


def test_a_saved_session_with_a_cold_store_continues_bit_exact(tmp_path, tiny_model, tiny_policy):
    sampler = SamplerParams(seed=5)
    a = _session(tiny_model, tiny_policy, sampler=sampler)
    for _ in range(40):
        a.step()
    assert a.state.cold.n > 0
    path = save_session(a, tmp_path / "s.safetensors")
    b = load_session(tiny_model, path)
    assert b.state.cold.n == a.state.cold.n and b.state.cold.next_entry == a.state.cold.next_entry
    for _ in range(40):
        ra, rb = a.step(), b.step()
        assert (ra.token_id, ra.culled, ra.recalled) == (rb.token_id, rb.culled, rb.recalled)
    assert torch.equal(a.state.cold.ledger.live("uid"), b.state.cold.ledger.live("uid"))
    assert torch.equal(a.state.view().k, b.state.view().k)


@pytest.mark.parametrize("bad", ["hot uid", "cold uid", "protected", "row", "twice"])
def test_a_bad_recall_is_refused_before_anything_changes(tiny_model, tiny_policy, bad):
    """Stage 4 checks every swap against the live ledgers first: a stale uid (hot or
    cold), a protected victim, a row past the cold store or a slot swapped twice raises,
    and the arena, the ledger and the cold store are as they were."""
    from positronic_brain.state import FLAG_PROTECTED
    from positronic_brain.types import NO_ACTIONS, Swap
    s = _session(tiny_model, tiny_policy, options.cache_params({"reindex_at": None}, RECALL))
    for _ in range(12):
        s.step()
    state = s.state
    view = state.view()
    assert view.cold.n >= 2
    slot, row = view.n // 2, 0
    swap = Swap(slot=slot, uid=int(view.uid[slot]), cold_slot=row,
                cold_uid=int(view.cold.uid[row]), columns={"brightness": 1.0})
    swaps = {"hot uid": (dataclasses.replace(swap, uid=swap.uid + 1000),),
             "cold uid": (dataclasses.replace(swap, cold_uid=swap.cold_uid + 1000),),
             "protected": (swap,), "row": (dataclasses.replace(swap, cold_slot=view.cold.n),),
             "twice": (swap, dataclasses.replace(swap, cold_slot=1,
                                                 cold_uid=int(view.cold.uid[1])))}[bad]
    if bad == "protected":
        state.ledger.flags[slot] = FLAG_PROTECTED
    before = (state.view().k.clone(), state.ledger.live("uid").clone(),
              state.cold.ledger.live("uid").clone(), state.cold.view().k.clone())
    gen = generate(tiny_model, view, GREEDY, s.generator)
    with pytest.raises(AssertionError):
        apply(tiny_model, state, gen, dataclasses.replace(NO_ACTIONS, swaps=swaps))
    after = (state.view().k, state.ledger.live("uid"), state.cold.ledger.live("uid"),
             state.cold.view().k)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_recall_every_k_steps_scores_only_then(tiny_model, tiny_policy):
    params = options.cache_params({"recall_every": 3, "reindex_at": None}, RECALL)
    s = _session(tiny_model, tiny_policy, params)
    for _ in range(30):
        view = s.state.view()
        gen = generate(tiny_model, view, GREEDY, s.generator)
        rq = recall_query(view, gen, params)
        scores = score(view, gen.attention, s.scorer, rq)
        assert (scores.cold_signal is not None) == (view.cold.n > 0 and (view.step + 1) % 3 == 0)
        assert (scores.hot_signal is not None) == (view.cold.n > 0)  # hot anchors every step
        apply(tiny_model, s.state, gen, decide(tiny_model, view, scores, params))


@pytest.mark.parametrize("kw, message", [
    ({"recall": True}, "needs a budget"),
    ({"recall": True, "budget": 24, "repair": "fold"}, "no fold"),
    ({"recall": True, "budget": 24, "allocation": "turns"}, "no --allocation turns"),
    ({"recall": True, "budget": 24, "cold_capacity": 0}, "cold capacity must be >= 1"),
    ({"recall": True, "budget": 24, "recall_every": 0}, "recall every must be >= 1"),
    ({"recall": True, "budget": 24, "recall_span": 0}, "recall span must be >= 1"),
    ({"recall": True, "budget": 24, "recall_margin": -0.5}, "recall margin must be >= 0"),
    ({"recall_span": 2}, "--recall-span is for --recall"),
])
def test_bad_recall_parameters_are_one_line_errors(kw, message):
    with pytest.raises(UserError, match=message):
        options.params(**kw)


def _cold_state(cold) -> tuple:
    """Everything of a cold store that a step may change: its live rows (ledger, K/V,
    norms, order of entry), bit for bit, and its counts."""
    n, a = cold.n, cold.arena
    return (n, a.n, cold.next_entry, cold.ledger.rows(), cold.entered[:n].tolist(),
            *(getattr(a, x)[:, :, :n].clone() for x in ("k", "v", "knorm", "vnorm")))


@pytest.mark.parametrize("fail_in", ["remove", "_append"])  # after the cold writes; all of them
def test_a_failure_part_way_puts_the_cold_store_back(tiny_model, tiny_policy, monkeypatch,
                                                      fail_in):
    """Stage 4 is all or nothing with recall too: a step that fails after its recalls, its
    culled tokens going cold, the oldest dropped past the capacity (a small one, grown from
    a smaller first allocation) and a re-index leaves the cold store bit for bit as it was,
    and the run goes on (the hot arena is rebuilt from the ledger: tests/test_loop_step4_apply)."""
    from positronic_brain.stages.apply import patch
    monkeypatch.setattr("positronic_brain.stages.apply.recall.COLD_ROWS", 4)
    params = options.cache_params({"cold_capacity": 12, "recall_every": 1, "reindex_at": 45,
                                   "recall_margin": 0.0}, RECALL)
    tried = _session(tiny_model, tiny_policy, params)
    seen = Totals()
    for _ in range(14):
        before = _cold_state(tried.state.cold)
        with monkeypatch.context() as m:
            m.setattr(patch, fail_in, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
            with pytest.raises(RuntimeError):
                tried.step()
        tried.state.check_valid()
        after = _cold_state(tried.state.cold)
        assert after[:5] == before[:5]
        for x, y in zip(after[5:], before[5:]):
            assert torch.equal(x, y)
        seen.add(tried.step())
        tried.state.check_valid()
    # the failed steps tried every cold-store write: recalls, drops, growth, a re-index
    # over a full cold store (the first step's is over an empty one: the prompt is longer)
    assert seen.recalled and seen.reindexed >= 2 and tried.state.ledger.dropped, seen
    assert tried.state.cold.arena.capacity > 4


def test_a_prompt_far_over_the_budget_fills_a_grown_cold_store(tiny_model, tiny_policy,
                                                               monkeypatch):
    """The first step culls more tokens than the cold store's first allocation holds."""
    monkeypatch.setattr("positronic_brain.stages.apply.recall.COLD_ROWS", 16)
    s = Session(tiny_model, tiny_policy, GREEDY, options.cache_params({"reindex_at": None}, RECALL))
    s.prime([Segment(tuple(range(5, 105)), "user")])
    assert s.state.cold.arena.capacity == 16
    for _ in range(3):
        s.step()
        s.state.check_valid()
    assert s.state.cold.n == 100 - RECALL.budget + 2


def test_a_recalled_token_brings_the_cold_tokens_that_follow_it():
    """Anchors best first, hot or cold; each brings the cold tokens within ``recall_span``
    positions after it, in text order, with its signal; ``room`` caps all."""
    cold_pos = torch.tensor([10, 3, 11, 12, 20, 4, 13])
    cold_sig = torch.tensor([0.5, 1.0, 0.125, 0.125, 0.25, 0.1875, 0.0])
    hot_pos, hot_sig = torch.tensor([30, 5, 19]), torch.tensor([0.0, 0.0, 0.75])
    cold = type("C", (), {"position": cold_pos, "n": 7})
    view = type("V", (), {"cold": cold, "position": hot_pos, "next_position": 31})
    scores = type("S", (), {"cold_signal": cold_sig, "hot_signal": hot_sig})
    rows = lambda span, room: recalled(view, scores, _spanned(span), room)
    assert rows(1, 3) == [(1, 1.0), (0, 0.5), (4, 0.25)]  # span 1: the best cold alone
    # span 3: 3 brings 4 (5 is hot); hot 19 brings 20; 10 brings 11 and 12; then 13 and 12's
    assert rows(3, 8) == [(1, 1.0), (5, 1.0), (4, 0.75), (0, 0.5), (2, 0.5), (3, 0.5),
                          (6, 0.125)]
    assert rows(3, 4) == [(1, 1.0), (5, 1.0), (4, 0.75), (0, 0.5)]


def test_a_cold_token_swaps_in_only_past_the_margin():
    """``recall_margin`` m: a cold token takes a hot slot only if its signal beats the hot
    one's by more than m / n (n live slots)."""
    cold = type("C", (), {"position": torch.tensor([10, 3]), "n": 2, "uid": torch.tensor([7, 8]),
                          "source": torch.tensor([0, 0]), "born_step": torch.tensor([0, 0])})
    view = type("V", (), {"cold": cold, "position": torch.tensor([30, 5, 19, 40]), "n": 4,
                          "uid": torch.tensor([1, 2, 3, 4]), "step": 5, "next_position": 41,
                          "specs": {}})
    scores = type("S", (), {"cold_signal": torch.tensor([0.5, 0.375]),
                            "hot_signal": torch.tensor([0.0, 0.125, 0.75, 0.25])})
    dim = torch.tensor([0, 1])  # the dimmest hot slots, ascending score
    got = lambda m: [(s.slot, s.cold_uid) for s in swaps(  # noqa: E731
        view, scores, _spanned(1, m), dim)]
    assert got(0.0) == [(0, 7), (1, 8)]
    assert got(1.0) == [(0, 7)]  # 0.375 does not beat 0.125 + 1 / 4
    assert not got(2.0)  # 0.5 does not beat 0.0 + 2 / 4


def test_a_recalled_token_s_columns_follow_their_recall_rule():
    """Each rule of ``Column.recall`` on a hand-worked swap: ``keep`` writes nothing (the
    value it went cold with), ``birth`` its source's birth value, ``signal`` its signal
    times the queries since it was born (step 5, born at 1: 6 of them), ``top`` the
    column's largest live value (kvzip's, whose max never decays)."""
    cold = type("C", (), {"position": torch.tensor([10]), "n": 1, "uid": torch.tensor([7]),
                          "source": torch.tensor([1]), "born_step": torch.tensor([1])})
    specs = {"k": Column(recall="keep"), "b": Column(birth=(3.0, 9.0, 4.0, 5.0, 6.0, 7.0)[
        :len(SOURCES)], recall="birth"), "s": Column(recall="signal"), "t": Column(recall="top")}
    view = type("V", (), {"cold": cold, "position": torch.tensor([30, 5]), "n": 2,
                          "uid": torch.tensor([1, 2]), "step": 5, "next_position": 41,
                          "specs": specs,
                          "columns": {name: torch.tensor([0.25, 0.75]) for name in specs}})
    scores = type("S", (), {"cold_signal": torch.tensor([0.5]),
                            "hot_signal": torch.tensor([0.0, 0.125])})
    (got,) = swaps(view, scores, _spanned(1, 0.0), torch.tensor([0]))
    assert (got.slot, got.cold_uid) == (0, 7)
    assert got.columns == {"b": 9.0, "s": 0.5 * 6, "t": 0.75}


def _recalled_by_hand(cold_pos, cold_sig, hot_pos, hot_sig, span, room):
    """``recalled`` as a loop: anchors best first (stable), each taking the cold rows within
    ``span`` positions after it in text order, a row keeping its first anchor."""
    c, signal = len(cold_pos), cold_sig + hot_sig
    pos = cold_pos + hot_pos
    by_pos = sorted(range(len(pos)), key=pos.__getitem__)
    rank = {j: r for r, j in enumerate(by_pos)}
    picked = {}
    for i in sorted(range(len(pos)), key=lambda i: -signal[i])[: room + len(hot_pos)]:
        if signal[i] == float("-inf"):
            break
        for j in by_pos[rank[i]:rank[i] + span]:
            if pos[j] - pos[i] >= span:
                break
            if j < c:
                picked.setdefault(j, signal[i])
                if len(picked) == room:
                    return list(picked.items())
    return list(picked.items())


@pytest.mark.parametrize("seed", range(20))
def test_recalled_equals_the_loop_by_hand(seed):
    g = torch.Generator().manual_seed(seed)
    n, c = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 60, (1,), generator=g))
    pos = torch.randperm(3 * (n + c), generator=g)[: n + c]
    sig = (torch.randint(0, 6, (n + c,), generator=g) / 8).tolist()  # ties on purpose
    scan = seed % 3 != 0  # else the hot anchors alone
    cold_sig = sig[:c] if scan else [float("-inf")] * c
    span, room = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
    cold = type("C", (), {"position": pos[:c], "n": c})
    view = type("V", (), {"cold": cold, "position": pos[c:], "next_position": 3 * (n + c)})
    scores = type("S", (), {"cold_signal": torch.tensor(sig[:c]) if scan else None,
                            "hot_signal": torch.tensor(sig[c:])})
    want = _recalled_by_hand(pos[:c].tolist(), cold_sig, pos[c:].tolist(), sig[c:], span, room)
    assert recalled(view, scores, _spanned(span), room) == want


@pytest.mark.parametrize("seed", range(12))
def test_the_best_anchors_are_a_stable_sort_s_first(seed):
    """``_best`` (a top-k when k is a small part) gives argsort(descending, stable)[:k]: ties
    in index order, -inf last, whichever path it takes."""
    from positronic_brain.stages.decide.recall import _best
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 4000, (1,), generator=g))
    x = (torch.randint(0, 40, (n,), generator=g) / 8) if seed % 2 else torch.randn(n, generator=g)
    x[torch.randint(0, n, (n // 4,), generator=g)] = float("-inf")
    for k in {0, 1, max(1, n // 9), max(1, n // 3), n}:
        assert torch.equal(_best(x, k), torch.argsort(x, descending=True, stable=True)[:k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_scan_s_group_max_is_the_max_of_its_logits(tiny_model, tiny_policy, dtype):
    """``cold_logits`` with ``group_max`` (a running maximum over whole rows) has the bits of
    the max over each KV head's group of its full q.k - lse, over runs and lone layers."""
    from positronic_brain.state import ColdView
    from positronic_brain.types import RecallQuery
    from positronic_brain.stages.score import cold_logits
    s = _session(tiny_model, tiny_policy)
    view = s.state.view()
    gen = generate(tiny_model, view, GREEDY, s.generator)
    k = view.k.to(dtype)  # the tiny model's keys, as a store of either dtype would hold them
    twin = ColdView(k=k, v=view.v.to(dtype), vnorm=view.vnorm, uid=view.uid,
                    position=view.position, source=view.source, born_step=view.born_step)
    for layers in ((0, 1), (1,)):
        rq = RecallQuery(query=gen.query.to(dtype), lse=gen.lse, layers=layers,
                         signal="attention", aggregate="max-max")
        full = cold_logits(twin, rq)  # (l, KVH, G, c)
        assert torch.equal(cold_logits(twin, rq, group_max=True), full.amax(2, keepdim=True))


@pytest.mark.parametrize("how, signal, layers", [  # the tiny models have 2 layers
    ("max-max", "value", (0, 1)), ("all-mean", "value", (0, 1)),
    ("max-max", "attention", (1,)), ("last-max", "attention", (0,))])
def test_a_cold_copy_of_the_live_keys_gets_their_signals(tiny_model, tiny_policy, how, signal,
                                                         layers):
    """The cold scan (one product per run of consecutive layers; for max-max, the value
    weight as a log and one exp per row) gives a cold store holding the live tokens' own K/V
    the signals those tokens got as hot ones."""
    from positronic_brain.state import ColdView
    from positronic_brain.types import RecallQuery
    from positronic_brain.stages.score import recall_signals
    s = _session(tiny_model, tiny_policy)
    view = s.state.view()
    gen = generate(tiny_model, view, GREEDY, s.generator)
    twin = ColdView(k=view.k, v=view.v, vnorm=view.vnorm, uid=view.uid, position=view.position,
                    source=view.source, born_step=view.born_step)
    rq = RecallQuery(query=gen.query, lse=gen.lse, layers=layers, signal=signal, aggregate=how)
    hot, cold = recall_signals(dataclasses.replace(view, cold=twin), gen.attention, rq)
    # each term exp(q.k - lse) (times a weight) against the attention stage 1 paid, then
    # the same aggregate of positive terms (a mean: a sum over the layers' heads)
    terms = len(layers) * gen.query.shape[1]
    bound = (_relative(gen, view, layers) + sum_bound(torch.float32, terms)) * float(hot.max())
    assert_close(cold, hot, bound, f"{how} {signal} {layers}")
    hot_only, none = recall_signals(view, gen.attention, dataclasses.replace(rq, scan=False))
    assert none is None and torch.equal(hot_only, hot)


def test_the_scan_takes_consecutive_layers_as_runs():
    from positronic_brain.stages.score.recall import _runs
    assert _runs((0, 1, 3, 5, 6, 7)) == [(0, 2), (3, 4), (5, 8)]
    assert _runs((4,)) == [(4, 5)]


def test_a_cold_store_grows_by_half_and_to_a_quarter_over_what_it_needs():
    """``cold_size`` (hand-worked): a first cull of a long prompt gets a quarter of room
    more, so the next step's one more row fits without twice the prompt; a store that grows a
    row at a time grows by half; never past the capacity unless a step needs more now."""
    from positronic_brain.stages.apply.rows import cold_size
    assert cold_size(3968, 1024, 16384) == 4960  # 3968 + 992
    assert cold_size(1025, 1024, 16384) == 1536  # 1024 + 512
    assert cold_size(16000, 12000, 16384) == 16384  # at most the capacity
    assert cold_size(20000, 16384, 16384) == 20000  # a step's culls before its trim
