"""Property tests (hypothesis) of the central rule: only stage 0/4 writes the arena or the
ledger. Random prompts, cache and sampler parameters and random sequences of stage calls
and actions on the tiny model:

- stages 1-3 (generate, score, decide with its repair forwards, merge_pair) leave every
  arena and ledger tensor as it was: same ``_version`` counter, same ``data_ptr()``, same
  content hash; and every scalar field of the state;
- stage 4 does exactly what its actions say, token by token: the cache length changes by
  +1 (append) -1 (each cull) -1 (each repair); the survivors keep their K/V (re-rotated
  exactly if re-indexed), ledger rows and text order; new uids are fresh (never reused);
  the live slots stay the dense prefix the ledger describes; ``check_valid()`` holds.

Deterministic: ``derandomize=True`` and no example database.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
from collections import Counter
from dataclasses import fields, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from positronic_brain import options
from positronic_brain import forward as forward_module
from positronic_brain.forward import apply_rope, rerotation
from positronic_brain.model import load_model
from positronic_brain.sampler import make_generator
from positronic_brain.scorers import SCORERS, columns_of, make_scorer
from positronic_brain.stages.apply import apply, prime
from positronic_brain.stages.decide import decide, fold_targets, merge_pair
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.state import FLAG_PROTECTED, Ledger
from positronic_brain.types import (AGGREGATIONS, REPAIRS, SOURCES, Actions,
                                    CacheParams, SamplerParams, Segment, UserError)
from tests.oracle import assert_close
from tests.tolerance import rotation_bound, unit

# CI runs the same examples every time; nothing is stored between runs.
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BYTES = 256  # every byte-level tokenizer's first 256 ids are the bytes

# --- strategies -------------------------------------------------------------------------

token_ids = st.integers(0, BYTES - 1)


@st.composite
def prompts(draw, max_segments: int = 4, max_len: int = 8) -> list[Segment]:
    """1-4 segments of random byte tokens: each with a random source, or (half the time)
    chat-like, alternating user and assistant turns after an optional system prompt."""
    texts = draw(st.lists(st.lists(token_ids, min_size=1, max_size=max_len), min_size=1,
                          max_size=max_segments))
    if draw(st.booleans()):
        sources = [draw(st.sampled_from(SOURCES)) for _ in texts]
    else:
        first = draw(st.sampled_from(("system", "user")))
        sources = [first] + [("user", "assistant")[i % 2] for i in range(len(texts) - 1)]
    return [Segment(tuple(ids), src) for src, ids in zip(sources, texts)]


@st.composite
def cache_params(draw) -> CacheParams:
    """Any valid CacheParams with small budgets (so culls happen within a few steps) and
    re-index thresholds close enough to be reached."""
    policy = draw(st.sampled_from(tuple(SCORERS)))
    sinks, recent = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    budget = None if policy == "none" else draw(
        st.none() | st.integers(sinks + recent + 1, sinks + recent + 12))
    top = draw(st.sampled_from((255.0, 40.0)))
    repair = draw(st.sampled_from(tuple(REPAIRS)))
    return options.cache_params(dict(  # each field where its scorer or piece takes it
        budget=budget, policy=policy, repair=repair,
        allocation=draw(st.sampled_from(("token", "turns"))) if repair == "none" else "token",
        positions=draw(st.sampled_from(("keep", "compact"))), sinks=sinks, recent=recent,
        pinned=tuple(sorted(draw(st.sets(st.sampled_from(SOURCES), max_size=2)))),
        decay=draw(st.floats(0, 20)), gain=draw(st.floats(0, 60)), max_brightness=top,
        seeds=tuple(draw(st.lists(st.floats(0, top), min_size=len(SOURCES),
                                  max_size=len(SOURCES)))),
        aggregate=draw(st.sampled_from(AGGREGATIONS)), max_merges=draw(st.integers(0, 3)),
        fold_min_cos=draw(st.sampled_from((-1.0, 0.0, 0.5, 1.0))),
        reindex_at=draw(st.none() | st.integers((budget or 1) + 1, (budget or 1) + 30)),
        random_seed=draw(st.integers(0, 3))), strict=False)


samplers = st.builds(
    SamplerParams, greedy=st.booleans(), temperature=st.sampled_from((0.0, 0.7, 1.0, 1.5)),
    top_k=st.integers(0, 50), top_p=st.sampled_from((1.0, 0.9, 0.5)),
    min_p=st.sampled_from((0.0, 0.05)), repetition_penalty=st.sampled_from((1.0, 1.3)),
    seed=st.integers(0, 9))


# --- what must not change ----------------------------------------------------------------

def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def snapshot(state) -> tuple[dict, dict]:
    """Every arena/ledger tensor (whole capacity) -> (_version, data_ptr, content hash),
    and every other field of the state, arena and ledger (whatever their dataclasses list)."""
    a, m = state.arena, state.ledger
    tensors = {"arena.kt": a.kt, "arena.v": a.v, "arena.log_mass": a.log_mass,
               "arena.knorm": a.knorm, "arena.vnorm": a.vnorm,
               **{f"ledger.{c}": m.col(c) for c in m.names}}
    scalars = {f"{prefix}{f.name}": copy.deepcopy(getattr(obj, f.name))
               for prefix, obj in (("arena.", a), ("ledger.", m), ("", state))
               for f in fields(obj)
               if f.name not in ("kt", "v", "log_mass", "knorm", "vnorm", "arena", "ledger",
                                 "columns") + Ledger.COLUMNS}
    return {name: (t._version, t.data_ptr(), _sha(t)) for name, t in tensors.items()}, scalars


def assert_unchanged(before: tuple[dict, dict], state, what: str) -> None:
    tensors, scalars = snapshot(state)
    for name, (version, ptr, sha) in before[0].items():
        assert tensors[name][0] == version, f"{what} bumped {name}._version"
        assert tensors[name][1] == ptr, f"{what} moved {name} (data_ptr)"
        assert tensors[name][2] == sha, f"{what} changed the contents of {name}"
    assert scalars == before[1], f"{what} changed a scalar field: {before[1]} -> {scalars}"


# --- what stage 4 must do ----------------------------------------------------------------

def rows(state) -> dict[int, dict]:
    """Live ledger rows by uid, each with its slot and that slot's K/V (L, kv_heads, head_dim)."""
    a, m = state.arena, state.ledger
    cols = {c: m.live(c).tolist() for c in m.names}
    return {u: {**{c: cols[c][s] for c in m.names}, "slot": s,
                "k": a.k[:, :, s].clone(), "v": a.v[:, :, s].clone(),
                "log_mass": a.log_mass[:, :, s].clone()}
            for s, u in enumerate(cols["uid"])}


def assert_apply_did_what_actions_say(model, state, before: tuple[dict, dict],
                                      old: dict[int, dict], gen, actions: Actions,
                                      patch) -> None:
    """``before``: snapshot() and ``old``: rows() before the apply (stage 4 writes in place:
    no tensor is reallocated)."""
    state.check_valid()
    a, m = state.arena, state.ledger
    n0, n1 = len(old), a.n
    assert n1 == m.n == n0 + 1 - len(actions.cull_slots) - len(actions.merges), \
        "cache length: +1 append, -1 per cull, -1 per repair"
    for name, (_, ptr, _) in snapshot(state)[0].items():
        assert ptr == before[0][name][1], f"stage 4 reallocated {name}"
    next_uid = before[1]["ledger.next_uid"]
    pending_source = SOURCES.index(before[1]["pending_source"])
    new = rows(state)
    assert len(new) == n1 and sorted(r["slot"] for r in new.values()) == list(range(n1)), \
        "live slots are not the dense prefix [0, n)"

    by_slot = {r["slot"]: u for u, r in old.items()}
    culled = {by_slot[s] for s in actions.cull_slots}
    merged = {u for r in actions.merges for u in r.uids}
    assert set(old) - set(new) == culled | merged, "removed uids differ from culls + repairs"
    fresh = set(new) - set(old)
    assert fresh == set(patch.merged_uids) | set(patch.appended_uids)
    assert min(fresh) >= next_uid and m.next_uid == next_uid + len(fresh), "a uid was reused"
    assert list(patch.merged_uids) == list(range(next_uid, next_uid + len(actions.merges)))

    # What each live uid must hold, before any re-index: (row fields, position, K, V).
    new_columns = actions.columns or {}

    def column(r: dict, name: str) -> float:  # a scorer column after stage 4's first write
        return float(new_columns[name][r["slot"]]) if name in new_columns else r[name]

    def birth(name: str, source: int) -> float:  # as the float32 column holds it
        return float(torch.tensor(m.specs[name].births[source], dtype=torch.float32))

    want = {}
    for u in set(old) & set(new):
        r = old[u]
        want[u] = ({"token_id": r["token_id"], "source": r["source"], "flags": r["flags"],
                    "born_step": r["born_step"], "changed_step": r["changed_step"],
                    **{c: column(r, c) for c in m.specs}}, r["position"], r["k"], r["v"])
    for rep, u in zip(actions.merges, patch.merged_uids):
        first, second = (old[x] for x in rep.uids)
        assert m.merged[u] == rep.uids
        want[u] = ({"token_id": rep.token_id, "source": first["source"], "flags": 0,
                    "born_step": state.step, "changed_step": state.step,
                    **{c: max(column(first, c), column(second, c)) if spec.merge == "max"
                       else birth(c, first["source"]) for c, spec in m.specs.items()}},
                   rep.position, rep.k[:, :, 0], rep.v[:, :, 0])
    # Folds, in order: per layer and KV head, the target's K/V move toward the culled slot's
    # by its share of their mass, and its log-mass becomes their log-sum-exp.
    zero = a.log_mass.new_zeros(a.log_mass.shape[:2])  # repaired and appended slots hold one token
    log_mass = {u: old[u]["log_mass"].clone() if u in old else zero.clone() for u in want}
    for f in actions.folds:
        j = old[by_slot[f.slot]]
        for layer, h in itertools.product(*map(range, f.into.shape)):
            if int(f.into[layer, h]) < 0:
                continue  # below the cosine threshold: only dropped here
            i = by_slot[int(f.into[layer, h])]
            w = torch.sigmoid(j["log_mass"][layer, h] - log_mass[i][layer, h])
            for t in (2, 3):  # K, V
                x = want[i][t][layer, h].float()
                y = j["k" if t == 2 else "v"][layer, h].float()
                want[i][t][layer, h] = (x + w * (y - x)).to(want[i][t].dtype)
            log_mass[i][layer, h] = torch.logaddexp(log_mass[i][layer, h], j["log_mass"][layer, h])
    (u_app,) = patch.appended_uids
    pinned = FLAG_PROTECTED if SOURCES[pending_source] in state.pinned else 0
    want[u_app] = ({"token_id": gen.input_token, "source": pending_source, "flags": pinned,
                    "born_step": state.step, "changed_step": state.step,
                    **{c: birth(c, pending_source) for c in m.specs}},
                   gen.position, gen.k[:, :, 0], gen.v[:, :, 0])

    # Re-index: positions become text-order ranks (the appended token last); keys re-rotate.
    order = sorted((u for u in want if u != u_app), key=lambda u: want[u][1]) + [u_app]
    if actions.reindex:
        target = {u: i for i, u in enumerate(order)}
    else:
        target = {u: want[u][1] for u in want}
        assert target[u_app] == gen.position
    assert sorted(new, key=lambda u: new[u]["position"]) == order, "text order changed"
    assert state.next_position == target[u_app] + 1 and state.pending_token == gen.token_id
    uids = sorted(want)
    k_old = torch.stack([want[u][2] for u in uids], 2)  # (L, KVH, n1, D)
    cos, sin = rerotation(model, torch.tensor([want[u][1] for u in uids], device=model.device),
                          torch.tensor([target[u] for u in uids], device=model.device))
    k_want = apply_rope(k_old.float(), cos, sin)
    for i, u in enumerate(uids):
        fields, _, _, v = want[u]
        got = new[u]
        assert {f: got[f] for f in fields} == fields, f"uid {u}: ledger row"
        assert got["position"] == target[u], f"uid {u}: position"
        assert torch.equal(got["v"], v), f"uid {u}: V moved with its token unchanged (or folded)"
        if u in log_mass:
            assert torch.equal(got["log_mass"], log_mass[u]), f"uid {u}: log-mass"
        if target[u] == want[u][1]:
            assert torch.equal(got["k"], want[u][2]), f"uid {u}: K unchanged"
        else:
            # the same 2 sums (the re-rotation's cos/sin, the rotation) over another length, so
            # both positions' cos/sin perhaps 2 ulps apart; bfloat16 (int8's) keys then round
            want_k = k_want[:, :, i]
            tol = rotation_bound(k_old[:, :, i], 2, 2)
            if got["k"].dtype != torch.float32:
                tol += unit(got["k"].dtype) * float(want_k.abs().max())
            assert_close(got["k"], want_k, tol, f"uid {u}: K re-rotated")


# --- the properties ----------------------------------------------------------------------

def _read_only_call(model, view, state, data, kind: str, seen: Counter):
    """One extra stage-1/2/3 call with freshly drawn parameters; nothing may change."""
    before = snapshot(state)
    if kind == "generate":
        params = data.draw(samplers)
        generate(model, view, params, make_generator(params.seed, model.device))
    else:
        gen = generate(model, view, SamplerParams(greedy=True), make_generator(0))
        cache = data.draw(cache_params())
        if kind == "decide" and cache.scorer.name != "none":
            # three removals due, merges on: decide runs its repair forwards when it can
            budget = max(cache.sinks + cache.recent + 1, view.n - 2)
            cache = options.cache_params(dict(
                budget=budget, policy=cache.scorer.name, repair="merge", sinks=cache.sinks,
                recent=cache.recent, max_merges=3,
                aggregate=cache.scorer.get("aggregate", "all-mean")), strict=False)
        scorer = make_scorer(cache)
        # a scorer the state was not made with reads its columns at their birth values
        view = replace(view, columns={**{c: torch.full((view.n,), spec.births[0],
                                                      device=view.uid.device)
                                         for c, spec in columns_of(scorer).items()},
                                      **view.columns})
        scores = score(view, gen.attention, scorer)
        if kind == "decide":
            try:
                seen["decide repairs"] += len(decide(model, view, scores, cache).merges)
            except UserError:
                seen["decide refused"] += 1
    assert_unchanged(before, state, kind)


def _draw_actions(model, view, data, scores) -> Actions:
    """Hand-picked valid actions: unprotected culls, disjoint adjacent merges built by
    stage 3's merge_pair, maybe a re-index; the scorer's columns."""
    n = view.n
    free = [s for s in range(n) if not int(view.flags[s]) & FLAG_PROTECTED]
    culls = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=4)) if free else []
    order = torch.argsort(view.position).tolist()  # slots in text order
    pairs, used = [], set(culls)
    if n >= 3:
        for i in data.draw(st.lists(st.integers(1, n - 2), unique=True, max_size=2)):
            first, second = order[i], order[i + 1]
            if {first, second} & used or not {first, second} <= set(free):
                continue
            used |= {first, second}
            pairs.append((order[i - 1], first, second))
    # folds (never with repairs: a fold's target must survive the step as itself)
    folded = data.draw(st.lists(st.sampled_from(culls), unique=True)) if culls and not pairs \
        else []
    return Actions(columns=scores.columns, cull_slots=tuple(culls),
                   merges=tuple(merge_pair(model, view, *p) for p in pairs),
                   folds=tuple(f for f in fold_targets(view, tuple(culls),
                                                        data.draw(st.sampled_from((-1.0, 0.3))))
                               if f.slot in folded),
                   reindex=data.draw(st.booleans()))


@pytest.mark.usefixtures("one_thread")
def test_only_stage_4_writes_and_it_does_what_its_actions_say(tiny_model):
    _walk(tiny_model)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype,compiled,widen", [
    ("int8", False, True), ("int8", False, False), ("float32", True, False),
    ("bfloat16", "native", True), ("bfloat16", "native", False)],
    ids=("int8-widen", "int8", "compiled", "native-widen", "native"))
def test_only_stage_4_writes_with_int8_weights_and_compiled(monkeypatch, dtype, compiled, widen):
    """The same walk with int8 weights, with stage 1 compiled (``--compile``) and through the
    native kernels (``--compile native``, which write through raw pointers: the content hash
    is what would see them touch the arena); in half precision with ``WIDEN`` (an Intel CPU
    without AMX: prefills attend through the fused kernel) and without (built scores)."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    torch._dynamo.reset()
    _walk(load_model("tiny-random", dtype, compile=compiled))
    torch._dynamo.reset()


def _walk(tiny_model) -> None:
    """Random prompts, parameters and stage sequences on ``tiny_model``: stages 1-3 write
    nothing, stage 4 does what its actions say, and every kind of patch occurs."""
    seen = Counter()

    @settings(max_examples=40, **SETTINGS)
    @given(data=st.data(), segments=prompts(), cache=cache_params(), sampler=samplers,
           steps=st.integers(1, 10))
    def walk(data, segments, cache, sampler, steps):
        n_prompt = sum(len(s.ids) for s in segments)
        state, _ = prime(tiny_model, segments, n_prompt + steps + 1,
                         pinned=frozenset(cache.pinned),
                         columns=columns_of(make_scorer(cache)))
        state.check_valid()
        scorer, generator = make_scorer(cache), make_generator(sampler.seed, tiny_model.device)
        for _ in range(steps):
            view = state.view()
            before = snapshot(state)
            gen = generate(tiny_model, view, sampler, generator)  # 1)
            assert_unchanged(before, state, "generate")
            for kind in data.draw(st.lists(st.sampled_from(("generate", "score", "decide")),
                                           max_size=3)):
                _read_only_call(tiny_model, view, state, data, kind, seen)
            scores = score(view, gen.attention, scorer)  # 2)
            assert_unchanged(before, state, "score")
            try:
                actions = decide(tiny_model, view, scores, cache)  # 3)
            except UserError:  # too many protected tokens for the budget: refused, unchanged
                actions = None
            if actions is None or data.draw(st.booleans()):
                actions = _draw_actions(tiny_model, view, data, scores)
            assert_unchanged(before, state, "decide / merge_pair")
            old = rows(state)
            patch = apply(tiny_model, state, gen, actions)  # 4)
            assert_apply_did_what_actions_say(tiny_model, state, before, old, gen, actions,
                                              patch)
            seen.update(cull=len(actions.cull_slots), repair=len(actions.merges),
                        fold=len(actions.folds),
                        reindex=actions.reindex, step=1)

    walk()
    print(dict(seen))
    # the walk reached every kind of patch and every read-only path
    for kind in ("cull", "repair", "fold", "reindex", "decide repairs", "decide refused"):
        assert seen[kind] > 0, f"no {kind} in {dict(seen)}"


def test_culls_whose_holes_chain_keep_the_right_tokens(tiny_model):
    """Regression (found by the walk above): culling slots 0 and 1 of 3 once filled slot 1
    from slot 2 and then slot 0 from the *old* slot 1, so culled uid 1 survived and uid 2
    was lost; arena and ledger agreed, so only uid tracking could tell."""
    state, _ = prime(tiny_model, [Segment((5, 6, 7, 8), "user")], capacity=8)
    gen = generate(tiny_model, state.view(), SamplerParams(greedy=True), make_generator(0))
    before, old = snapshot(state), rows(state)
    actions = Actions(cull_slots=(0, 1))
    patch = apply(tiny_model, state, gen, actions)
    assert state.ledger.live("uid").tolist() == [2, 3] and patch.moves == ((2, 0),)
    assert_apply_did_what_actions_say(tiny_model, state, before, old, gen, actions, patch)


def test_a_pinned_prompt_stays_pinned_when_its_last_token_enters_the_cache(tiny_model):
    """Regression (found by the state machine): the last prompt token is appended by stage 4,
    which wrote it unprotected even when its source was pinned."""
    state, _ = prime(tiny_model, [Segment((5, 6, 7), "system")], capacity=8,
                     pinned=frozenset({"system"}))
    gen = generate(tiny_model, state.view(), SamplerParams(greedy=True), make_generator(0))
    apply(tiny_model, state, gen)
    assert state.ledger.live("flags").tolist() == [FLAG_PROTECTED] * 3
    gen = generate(tiny_model, state.view(), SamplerParams(greedy=True), make_generator(0))
    apply(tiny_model, state, gen)  # a generated (assistant) token is not pinned
    assert state.ledger.live("flags").tolist() == [FLAG_PROTECTED] * 3 + [0]


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-llama3"])
def test_rerotations_compose(name):
    """Re-rotating a key p -> p' -> p'' equals p -> p'' (so repeated re-indexes never drift),
    with and without Llama-3 rope scaling (p -> p' -> p, the identity, is tested on the real
    model in test_loop_step4_apply.py)."""
    model = load_model(name)
    top = model.spec.max_positions - 1
    pos = st.lists(st.integers(0, top), min_size=1, max_size=16)

    @settings(max_examples=25, **SETTINGS)
    @given(p=pos, data=st.data())
    def prop(p, data):
        t = len(p)
        p1, p2 = (data.draw(st.lists(st.integers(0, top), min_size=t, max_size=t))
                  for _ in range(2))
        p, p1, p2 = (torch.tensor(x) for x in (p, p1, p2))
        g = torch.Generator().manual_seed(t)
        k = torch.randn(model.spec.n_kv_heads, t, model.spec.head_dim, generator=g) * 4
        twice = apply_rope(apply_rope(k, *rerotation(model, p, p1)), *rerotation(model, p1, p2))
        # 2 re-rotations' 4 sums against one's 2, and R(p')^T R(p') once more
        bound = rotation_bound(k, 4, 1)
        assert_close(twice, apply_rope(k, *rerotation(model, p, p2)), bound, "p -> p' -> p''")

    prop()
