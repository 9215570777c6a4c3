"""Stage 4: apply culls, repairs and re-index (the only mutation), checked against HF.

`pytest tests/test_loop_step4_apply.py -s` walks real-model sessions through budgeted steps
and prints each patch as it is applied.
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from positronic_brain import options
from positronic_brain.stages.apply import patch as stage4, recall as stage4_cold, rows as stage4_rows
from positronic_brain.forward import apply_rope, rerotation
from positronic_brain.loop import Session, run
from positronic_brain.model import hf_forward
from positronic_brain.sampler import make_generator
from positronic_brain.stages.apply import apply, extend, prime
from positronic_brain.stages.decide import decide
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.types import Actions, CacheParams, SamplerParams, Segment, UserError
from tests.oracle import assert_close, hf_step_logits
from tests.test_loop_step1_generate import _assert_unchanged, _fingerprint
from tests.tolerance import ORACLE, forward_bound, rotation_bound

GREEDY = SamplerParams(greedy=True)
PROMPT = ("In the harbour town the fishermen mended their nets while the gulls circled "
          "over the boats, and the old keeper watched the tide come in")


def fresh_layer0_keys(model, token_id, position):
    """Layer-0 keys (KVH, T, D) of tokens at positions, computed by HF's own modules: layer 0
    sees no context, so a cached key must equal this whatever happened since."""
    hf = model.hf.model
    layer = hf.layers[0]
    h = layer.input_layernorm(hf.embed_tokens(token_id[None]))  # (1, T, hidden)
    k = layer.self_attn.k_proj(h).view(1, -1, model.spec.n_kv_heads, model.spec.head_dim)
    k = k.transpose(1, 2)  # (1, KVH, T, D)
    cos, sin = hf.rotary_emb(h, position[None])
    return apply_rotary_pos_emb(k, k, cos, sin)[1][0]


@pytest.mark.parametrize("repair", ["none", "merge"])
def test_oracle_after_culls_repairs_and_reindexes(real_model, real_policy, repair):
    """After every patch, stage-1 logits equal HF model() on a DynamicCache of the live K/V
    (slot order as it is) with the pending token's position (fp32, to ``ORACLE``); after each
    re-index, layer-0 keys equal a fresh computation at the new positions."""
    cache = options.params(budget=24, sinks=2, recent=4, repair=repair, reindex_at=40)
    session = Session(real_model, real_policy, GREEDY, cache)
    session.prime(real_policy.raw_prompt(PROMPT))  # longer than the budget
    seen = set()
    for _ in range(20):  # the prompt has 29 tokens: a re-index at step 12
        rec = session.step()
        state = session.state
        state.check_valid()
        assert state.arena.n <= 24 and state.next_position < 40
        kinds = {k for k, on in (("cull", rec.culled), ("repair", rec.merged),
                                 ("reindex", rec.reindexed)) if on}
        seen |= kinds
        view = state.view()
        if kinds:
            print(f"\nstep {rec.step}: culled {list(rec.culled)}, repaired "
                  f"{[(u, real_policy.token_text(t)) for u, t, _ in rec.merged]}, "
                  f"reindexed {rec.reindexed}; next position {view.next_position}")
            gen = generate(real_model, view, GREEDY, session.generator)
            assert_close(gen.logits, hf_step_logits(real_model, view), ORACLE,
                         f"step {rec.step} ({', '.join(sorted(kinds))}) logits")
        if rec.reindexed:
            assert sorted(view.position.tolist()) == list(range(view.n))
            # our keys, re-rotated, against HF's at the new positions: the contract
            assert_close(view.k[0], fresh_layer0_keys(real_model, view.token_id, view.position),
                         ORACLE, f"step {rec.step} layer-0 keys after re-index")
    want = {"cull", "reindex"} | ({"repair"} if repair == "merge" else set())
    assert seen == want


def test_rerotation_equals_hf_rope_at_the_new_position(real_model):
    """k rotated p -> p' equals HF's apply_rotary_pos_emb of the unrotated key at p'; and
    p -> p' -> p is the identity (fp32, to rounding), across the model's whole position range."""
    g = torch.Generator().manual_seed(0)
    T, D = 64, real_model.spec.head_dim
    top = real_model.spec.max_positions
    p = torch.randint(0, top, (T,), generator=g)
    p2 = torch.randint(0, top, (T,), generator=g)
    p[:2], p2[:2] = torch.tensor([top - 1, 0]), torch.tensor([0, top - 1])
    raw = torch.randn(1, 3, T, D, generator=g) * 4  # (1, KVH, T, D) keys before RoPE

    def hf_rope(x, pos):
        cos, sin = real_model.hf.model.rotary_emb(x, pos[None])
        return apply_rotary_pos_emb(x, x, cos, sin)[1]

    at_p = hf_rope(raw, p)
    cos, sin = rerotation(real_model, p, p2)
    moved = apply_rope(at_p, cos, sin)
    # RoPE at p, the re-rotation's cos/sin and the rotation: 3 sums, and p's cos/sin once more
    assert_close(moved, hf_rope(raw, p2), rotation_bound(raw, 3, 1), "p -> p' vs HF RoPE at p'")
    cos, sin = rerotation(real_model, p2, p)
    # and back: 2 more sums, and the cos/sin at p' once more
    assert_close(apply_rope(moved, cos, sin), at_p, rotation_bound(raw, 5, 2), "p -> p' -> p")


def test_big_enough_budget_reproduces_the_no_cull_run(real_model, real_policy):
    segs = real_policy.chat([("user", "List three uses of copper.")])
    n = sum(len(s.ids) for s in segs)
    plain = run(real_model, real_policy, segs, GREEDY, max_new_tokens=40, ignore_eos=True)
    cache = CacheParams(budget=n + 40, scorer="h2o", repair="merge")
    budgeted = run(real_model, real_policy, segs, GREEDY, max_new_tokens=40, ignore_eos=True,
                   cache_params=cache)
    assert budgeted["generated_ids"] == plain["generated_ids"]
    assert not any(s["culled"] or s["merged"] or s["reindexed"] for s in budgeted["steps"])


def _at_budget(tiny_model, tiny_policy, **kw):
    cache = options.params(budget=16, sinks=2, recent=3, **kw)
    session = Session(tiny_model, tiny_policy, SamplerParams(temperature=1.0, seed=2), cache)
    session.prime(tiny_policy.raw_prompt("a byte-level prompt longer than the budget"))
    for _ in range(5):
        session.step()
    return session


def hf_cache_of_ledger(model, state):
    """HF's K/V (L, KVH, n, D) of the live tokens in text order at their positions."""
    view = state.view()
    order = torch.argsort(view.position)
    cache = DynamicCache()
    hf_forward(model.hf, view.token_id[order][None], cache,
               position_ids=view.position[order][None], use_cache=True)
    k = torch.stack([cache.layers[i].keys[0] for i in range(view.k.shape[0])])
    v = torch.stack([cache.layers[i].values[0] for i in range(view.k.shape[0])])
    return order, k, v


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fail_in, reindex", [("remove", True), ("_reindex", True),
                                               ("_append", True), ("write", False)])
def test_a_failure_part_way_rebuilds_from_the_mirror(tiny_model, tiny_policy, monkeypatch,
                                                       fail_in, reindex):
    """``write``: without a re-index the removal leaves a hole for the append, whose ledger
    row is written (``write_rows``) before its K/V write fails."""
    session = _at_budget(tiny_model, tiny_policy, repair="merge",
                         **({"reindex_at": session_next_reindex()} if reindex else {}))
    state = session.state
    assert state.arena.n + 1 > session.cache_params.budget  # the failing step culls
    step, pending = state.step, state.pending_token
    ledger, merged = state.ledger.rows(), dict(state.ledger.merged)

    def boom(*args, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(stage4, fail_in, boom)
    with pytest.raises(RuntimeError, match="injected"):
        session.step()
    monkeypatch.undo()
    state.check_valid()
    # atomic: the ledger is as before the step (whose repair and removals had been applied)
    assert state.step == step and state.pending_token == pending
    assert state.ledger.rows() == ledger and state.ledger.merged == merged
    order, k, v = hf_cache_of_ledger(tiny_model, state)
    view = state.view()
    assert_close(view.k[:, :, order], k, ORACLE, "rebuilt K")
    assert_close(view.v[:, :, order], v, ORACLE, "rebuilt V")
    session.step()  # and the loop goes on
    state.check_valid()


def session_next_reindex():
    """A re-index threshold the sixth step of ``_at_budget`` reaches (prompt 42 + 5 steps)."""
    return 47


@pytest.mark.usefixtures("one_thread")
def test_the_append_takes_a_hole_the_culls_leave(tiny_model, tiny_policy):
    """At the budget the new token goes into a culled slot: one cull a step moves no slot
    (the culled slot's K/V are overwritten by the appended token's), k culls move at most
    k - 1 survivors; the state stays valid and stage 1 equals Hugging Face over it."""
    session = _at_budget(tiny_model, tiny_policy, repair="none")
    for culls in (1, 1, 3):
        state = session.state
        view = state.view()
        n = view.n
        gen = generate(tiny_model, view, GREEDY, session.generator)
        actions = decide(tiny_model, view, score(view, gen.attention, session.scorer),
                         dataclasses.replace(session.cache_params, budget=n + 1 - culls))
        assert len(actions.cull_slots) == culls
        before = set(view.uid.tolist())  # the view's columns are the ledger's: read them now
        gone = {int(u) for u in view.uid[list(actions.cull_slots)]}
        patch = apply(tiny_model, state, gen, actions)
        state.check_valid()
        (slot,) = patch.appended_slots
        assert slot in actions.cull_slots and len(patch.moves) <= culls - 1
        assert set(state.ledger.live("uid").tolist()) == before - gone | set(patch.appended_uids)
        assert state.arena.n == n + 1 - culls
        assert int(state.ledger.uid[slot]) == patch.appended_uids[0]
        assert all(to in actions.cull_slots and fro >= state.arena.n
                   for fro, to in patch.moves)
        if culls == 1:
            assert patch.moves == () and slot == actions.cull_slots[0]
        gen = generate(tiny_model, state.view(), GREEDY, session.generator)
        assert_close(gen.logits, hf_step_logits(tiny_model, state.view()), ORACLE,
                     f"after {culls} culls")


@pytest.mark.usefixtures("one_thread")
def test_bad_actions_change_nothing(tiny_model, tiny_policy):
    segs = tiny_policy.chat([("system", "Pinned."), ("user", "Hello")])
    state, _ = prime(tiny_model, segs, capacity=64, pinned=frozenset({"system"}))
    view = state.view()
    gen = generate(tiny_model, view, GREEDY, torch.Generator())
    before = _fingerprint(state)
    for actions, message in ((Actions(cull_slots=(0,)), "protected"),
                             (Actions(cull_slots=(30, 30)), "twice"),
                             (Actions(cull_slots=(view.n,)), "outside")):
        with pytest.raises(UserError, match=message):
            apply(tiny_model, state, gen, actions)
        _assert_unchanged(before, _fingerprint(state))


@pytest.mark.usefixtures("one_thread")
def test_apply_order_and_patch(tiny_model, tiny_policy):
    """One step with a repair, culls and a re-index: the patch names what changed."""
    session = _at_budget(tiny_model, tiny_policy, repair="merge", max_merges=1)
    state = session.state
    view = state.view()
    gen = generate(tiny_model, view, session.sampler, session.generator)
    scores = score(view, gen.attention, session.scorer)
    actions = decide(tiny_model, view, scores, options.params(budget=10, sinks=2, recent=3,
                                                           repair="merge", reindex_at=100))
    actions = Actions(**{**actions.__dict__, "reindex": True})
    old = {int(u): int(p) for u, p in zip(view.uid, view.position)}
    patch = apply(tiny_model, state, gen, actions)
    state.check_valid()
    live = set(state.view().uid.tolist())
    assert len(patch.merges) == 1 and len(patch.culled_uids) == 6 and state.arena.n == 10
    assert not live & (set(patch.culled_uids) | set(patch.merges[0].uids))
    assert patch.merged_uids[0] in live and patch.appended_uids[0] in live
    assert state.ledger.merged[patch.merged_uids[0]] == patch.merges[0].uids
    assert sorted(patch.reindex_to.tolist()) == list(range(9))
    assert patch.appended_positions == (9,) and state.next_position == 10
    # re-index keeps text order
    kept = [u for u in sorted(old, key=old.get) if u in live]
    by_pos = state.view().uid[torch.argsort(state.view().position)].tolist()
    assert [u for u in by_pos if u in kept] == kept
    gen = generate(tiny_model, state.view(), session.sampler, session.generator)
    assert_close(gen.logits, hf_step_logits(tiny_model, state.view()), ORACLE, "after the patch")


@pytest.mark.usefixtures("one_thread")
def test_extend_equals_priming_everything(tiny_model, tiny_policy):
    first = tiny_policy.chat([("system", "Be kind."), ("user", "Hi")])
    session = Session(tiny_model, tiny_policy, GREEDY)
    session.prime(first, capacity=200)
    for _ in range(4):
        session.step()
    turn = tiny_policy.chat([("user", "And again?")])
    patch = extend(tiny_model, session.state, turn)  # pinned: the session's (system)
    ids = session.prompt_ids + session.generated_ids + [i for s in turn for i in s.ids]
    whole, _ = prime(tiny_model, [type(first[0])(tuple(ids), "user")], capacity=200)
    a, b = session.state.view(), whole.view()
    assert a.n == b.n and session.state.pending_token == whole.pending_token == ids[-1]
    assert session.state.next_position == whole.next_position == len(ids) - 1
    assert torch.equal(a.token_id, b.token_id) and torch.equal(a.position, b.position)
    # the turn's prefill over the session's cache (its steps' K/V one token at a time), or
    # every token in one prefill: the same sums in other orders
    assert_close(a.k, b.k, forward_bound(tiny_model, a.n, float(b.k.abs().max())), "extended K")
    assert_close(a.v, b.v, forward_bound(tiny_model, a.n, float(b.v.abs().max())), "extended V")
    assert patch.appended_uids == tuple(range(a.n - len(patch.appended_uids), a.n))
    session.state.check_valid()
    with pytest.raises(UserError, match="do not fit"):
        extend(tiny_model, session.state, [type(first[0])(tuple(range(200)), "user")])


@pytest.mark.parametrize("folded", (False, True))
def test_many_removed_slots_move_as_a_few_do(tiny_model, folded):
    """Past ``SLICE_MOVES`` moved slots, stage 4 moves them by index copies (a re-index's
    drop of thousands of cold rows), slot by slot below: the same arena and ledger either
    way, whatever the layout (the hot arena's transposed keys, the cold store's rows)."""
    import copy
    ids = torch.arange(3, 3 + 60).tolist()
    state, _ = prime(tiny_model, [Segment(tuple(ids), "user")], capacity=64)
    if folded:  # a slot holds a folded log-mass: that column moves too
        state.arena.log_mass[..., 5] = 0.25
        state.arena.folded = True
    cold = stage4_cold.cold_store(tiny_model, 64, 64)
    for arena, ledger in ((state.arena, state.ledger), (cold.arena, cold.ledger)):
        if arena is cold.arena:  # the cold store's rows: the hot arena's, copied in
            n = state.arena.n
            rows = torch.arange(n, device=ledger.device)
            stage4_rows.put_rows(arena, ledger, rows,
                             stage4_rows.take_rows(state.arena, state.ledger, rows))
            arena.n = ledger.n = n
        slots = list(range(1, 40, 2))  # 20 holes, each filled from the end
        results = []
        for limit in (len(slots) + 1, 0):  # slot by slot, then by index copies
            a, m = copy.deepcopy(arena), copy.deepcopy(ledger)
            stage4_rows.SLICE_MOVES, was = limit, stage4_rows.SLICE_MOVES
            try:
                moves, free = stage4_rows.remove(a, m, slots)
                assert free == m.n  # no room asked for: the next append goes after them
            finally:
                stage4_rows.SLICE_MOVES = was
            results.append((moves, a, m))
        (moves1, a1, m1), (moves2, a2, m2) = results
        assert moves1 == moves2 and len(moves1) > 8
        for b1, b2 in zip(a1.blocks, a2.blocks):
            for name in ("kt", "v", "knorm", "vnorm", "log_mass"):
                assert torch.equal(getattr(b1, name), getattr(b2, name)), name
        for col in m1.COLUMNS:
            assert torch.equal(getattr(m1, col), getattr(m2, col)), col


def test_the_ledger_s_tables_hold_every_column_once(tiny_model, tiny_policy):
    """The ledger's own columns of one dtype are the rows of one table (``Ledger.tables``,
    which row moves and undo copies go through), the scorer's columns themselves; a column
    replaced by another tensor leaves its table's packing, and its table is then listed
    column by column (a move still moves it); ``pack`` packs again, every value kept."""
    state = _at_budget(tiny_model, tiny_policy).state
    m = state.ledger

    def packing() -> list[int]:  # each table's row dimension, every column held once
        tables = m.tables()
        for c in m.names:
            assert sum(x is m.col(c) if dim == 0 else
                       any(r.data_ptr() == m.col(c).data_ptr() for r in x)
                       for x, dim in tables) == 1, c
        return [dim for _, dim in tables]

    assert packing() == [1, 1, 1, 0]  # int64, int8, int32; the scorer's brightness
    before = {c: m.live(c).clone() for c in m.names}
    m.uid = m.uid.clone()  # out of its table: the table's columns listed one by one
    assert packing() == [1, 1] + [0] * 7
    stage4_rows.remove(state.arena, m, [0])  # the last row fills slot 0, in every column
    for c in m.names:
        assert torch.equal(m.live(c), torch.cat((before[c][-1:], before[c][1:-1]))), c
    moved = {c: m.live(c).clone() for c in m.names}
    m.pack()
    assert packing() == [1, 1, 1, 0]
    assert all(torch.equal(m.live(c), moved[c]) for c in m.names)


def test_the_undo_copies_only_what_stage_4_changes(tiny_model, tiny_policy):
    """A cull and a merge at the budget: the undo holds the rows of the merged slot, the
    holes the removals leave below the new count and the append's slot, the scorer's
    column whole (stage 4 writes all of it), the positions whole only with a re-index."""
    session = _at_budget(tiny_model, tiny_policy, repair="merge", max_merges=1)
    state, view = session.state, session.state.view()
    n = view.n
    gen = generate(tiny_model, view, SamplerParams(greedy=True), make_generator(0))
    scores = score(view, gen.attention, session.scorer)
    actions = decide(tiny_model, view, scores, dataclasses.replace(session.cache_params,
                                                                   budget=n - 2))
    assert len(actions.cull_slots) + len(actions.merges) == 3 and actions.merges
    at, rows, whole, _, _ = stage4._undo(state.ledger, actions)
    gone = list(actions.cull_slots) + [r.slots[1] for r in actions.merges]
    kept = n - len(gone)
    want = {r.slots[0] for r in actions.merges} | {s for s in gone if s < kept} | {kept}
    assert at.tolist() == sorted(want) and len(want) <= 2 * len(gone) + 1
    m = state.ledger  # the rows of every table but the scorer's column, saved whole
    assert set(whole) == {"brightness"}
    assert [x for x, _, _ in rows] == [x for x, _ in m.tables() if x is not m.col("brightness")]
    assert all(torch.equal(saved, x.index_select(dim, at)) for x, dim, saved in rows)
    reindexed = stage4._undo(state.ledger, dataclasses.replace(actions, reindex=True))
    assert set(reindexed[2]) == {"brightness", "position"}
