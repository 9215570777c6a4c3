"""Fold repair: each culled token's K/V folded into the survivor whose key is most alike
(per layer and KV head), mass-weighted, with log(tokens held) added to that slot's scores."""
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from positronic_brain import options
from positronic_brain.forward import forward
from positronic_brain.loop import Session
from positronic_brain.model import load_model, packable
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import apply
from positronic_brain.stages.decide import decide
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import score
from positronic_brain.types import CacheParams, SamplerParams
from tests.oracle import assert_close
from tests.tolerance import gamma, model_bound, products

GREEDY = SamplerParams(greedy=True)
FOLD = options.params(budget=20, sinks=2, recent=4, repair="fold", fold_min_cos=-1.0)


def cosine_bound(model) -> float:
    """How far two computations of a cosine of two keys may lie apart: a head_dim-term dot
    product and two norms, each side in its own order (|cos| <= 1: Cauchy-Schwarz)."""
    return products(torch.float32, model.spec.head_dim, 2, 1.0)


def mass_bound(tokens: int) -> float:
    """How far the masses may lie from the ``tokens`` that entered the cache: a sum of that
    many unit masses, added in the log domain (a rounding of log m moves m by |log m| u, at
    most log(tokens) u, besides its own) and then summed."""
    return gamma(torch.float32, tokens) * (math.log(tokens) + 2) * tokens


def test_a_log_mass_bias_makes_one_slot_attend_as_two(tiny_model):
    """Two slots with one key and values v1, v2 give the output of one slot holding their
    mean with log 2 added to its scores: the exact case a fold approximates."""
    s = tiny_model.spec
    g = torch.Generator().manual_seed(0)
    k = torch.randn(s.n_layers, s.n_kv_heads, 6, s.head_dim, generator=g)
    v = torch.randn(s.n_layers, s.n_kv_heads, 6, s.head_dim, generator=g)
    k[:, :, 5] = k[:, :, 2]
    k, v = k.to(tiny_model.device), v.to(tiny_model.device)
    ids, pos = torch.tensor([7], device=tiny_model.device), torch.tensor([6], device=tiny_model.device)
    both = forward(tiny_model, k, v, ids, pos, want_attention=True)
    v1 = v[:, :, :5].clone()
    v1[:, :, 2] = (v[:, :, 2] + v[:, :, 5]) / 2
    bias = torch.zeros(s.n_layers, s.n_kv_heads, 5, device=tiny_model.device)
    bias[:, :, 2] = math.log(2)
    one = forward(tiny_model, k[:, :, :5], v1, ids, pos, want_attention=True, past_log_mass=bias)
    # exact in arithmetic; the two add (and the bias rounds) in other orders
    tol = model_bound(tiny_model, float(both.logits.abs().max()), 6)
    assert_close(one.logits, both.logits, tol, "logits")
    summed = both.attention[..., :5].clone()
    summed[..., 2] += both.attention[..., 5]
    # the last layer's attention weights (at most 1): its norm, q/k/v, scores and softmax
    assert_close(one.attention, summed, model_bound(tiny_model, 1.0, 6, s.n_layers - 1, 4),
                 "attention")
    plain = forward(tiny_model, k[:, :, :5], v1, ids, pos)
    assert (plain.logits - both.logits).abs().max() > 100 * tol  # the bias is what makes it exact


def test_every_cull_folds_into_its_most_alike_survivor(tiny_model, tiny_policy):
    """Stages run one by one past the budget: every culled slot is folded; each target is
    the surviving slot of highest key cosine; the target's K/V become the mass-weighted
    mean; and the live slots' masses always add up to every token that entered the cache."""
    session = Session(tiny_model, tiny_policy, GREEDY, FOLD)
    session.prime(tiny_policy.raw_prompt("fold every culled token into its most alike survivor"))
    state, folds = session.state, 0
    for _ in range(30):
        view = state.view()
        before = {"k": view.k.clone(), "v": view.v.clone(), "uid": view.uid.clone(),
                  "mass": state.arena.log_mass[:, :, :view.n].exp()}
        gen = generate(tiny_model, view, GREEDY, session.generator)
        actions = decide(tiny_model, view, score(view, gen.attention, session.scorer), FOLD)
        assert [f.slot for f in actions.folds] == list(actions.cull_slots)
        gone = list(actions.cull_slots)
        apply(tiny_model, state, gen, actions)
        slot_of = {u: s for s, u in enumerate(state.view().uid.tolist())}
        for f in actions.folds:
            folds += 1
            L, KVH = f.into.shape
            for layer in range(L):
                for h in range(KVH):
                    keys = before["k"][layer, h]  # (n, D)
                    cos = F.cosine_similarity(keys, keys[f.slot][None], dim=-1)
                    cos[gone] = float("-inf")
                    i = int(f.into[layer, h])
                    # the stage's cosines and these, each within cosine_bound of the other
                    assert cos[i] >= cos.max() - 2 * cosine_bound(tiny_model), \
                        "not the most alike survivor"
                    if len(gone) > 1:
                        continue  # two folds into one slot compound; checked by the masses
                    m_i, m_j = before["mass"][layer, h, i], before["mass"][layer, h, f.slot]
                    after = slot_of[int(before["uid"][i])]
                    for t in ("k", "v"):
                        x, y = before[t][layer, h, i], before[t][layer, h, f.slot]
                        want = (m_i * x + m_j * y) / (m_i + m_j)
                        got = getattr(state.view(), t)[layer, h, after]
                        # a weighted mean of two rows, 3 roundings in series on each side
                        # (the weights, the products, the sum), in another order
                        size = float(torch.maximum(x.abs(), y.abs()).max())
                        assert_close(got, want, products(torch.float32, 2, 3, size),
                                     f"folded {t}")
        masses = state.arena.log_mass[:, :, :state.arena.n].exp().sum(-1)  # (L, KVH)
        assert_close(masses, torch.full_like(masses, float(state.next_position)),
                     mass_bound(state.next_position), "mass")
    assert folds >= 10 and state.view().log_mass is not None


@pytest.mark.parametrize("min_cos", [0.2, 0.5])
def test_below_the_cosine_threshold_a_culled_token_is_only_dropped(tiny_model, tiny_policy,
                                                                   min_cos):
    """With ``fold_min_cos``, a culled token folds only in the layers and KV heads where its
    most alike survivor's cosine reaches it (into that survivor), is dropped elsewhere, and
    gets no Fold if dropped everywhere; the masses count every token not dropped."""
    cache = options.cache_params({"fold_min_cos": min_cos}, FOLD)
    session = Session(tiny_model, tiny_policy, GREEDY, cache)
    session.prime(tiny_policy.raw_prompt("fold only the culled tokens that have a close match"))
    state = session.state
    dropped = state.arena.log_mass.new_zeros(state.arena.log_mass.shape[:2])  # (L, KVH)
    kinds = set()
    for _ in range(30):
        view = state.view()
        keys, mass = view.k.clone(), state.arena.log_mass[:, :, :view.n].exp()
        gen = generate(tiny_model, view, GREEDY, session.generator)
        actions = decide(tiny_model, view, score(view, gen.attention, session.scorer), cache)
        gone = list(actions.cull_slots)
        folds = {f.slot: f.into for f in actions.folds}
        for c in gone:
            cos = F.cosine_similarity(keys, keys[:, :, c:c + 1], dim=-1)  # (L, KVH, n)
            cos[..., gone] = float("-inf")
            best = cos.max(-1).values
            into = folds.get(c, torch.full(best.shape, -1, device=best.device))
            # the stage's cosines and these, each within cosine_bound of the other
            near = (best - min_cos).abs() <= cosine_bound(tiny_model)  # too close to call
            assert bool(((into < 0) == (best < min_cos))[~near].all()), "fold vs threshold"
            hit = (into >= 0).nonzero(as_tuple=True)
            worst = best[hit] - 2 * cosine_bound(tiny_model)
            assert bool((cos[hit + (into[hit],)] >= worst).all()), "not the best"
            dropped += torch.where(into < 0, mass[:, :, c], 0.0)  # every token it held
            kinds |= {"fold"} if bool((into >= 0).any()) else set()
            kinds |= {"drop"} if bool((into < 0).any()) else set()
            assert c in folds or not bool((into >= 0).any())
        apply(tiny_model, state, gen, actions)
        masses = state.arena.log_mass[:, :, :state.arena.n].exp().sum(-1)  # (L, KVH)
        assert_close(masses, state.next_position - dropped, mass_bound(state.next_position), "mass")
    assert kinds == {"fold", "drop"}
    state.check_valid()


def test_a_folded_session_saves_and_continues_exactly(tmp_path, tiny_model, tiny_policy):
    a = Session(tiny_model, tiny_policy, GREEDY, FOLD)
    a.prime(tiny_policy.raw_prompt("saved after a few folds"))
    assert sum(a.step().folded for _ in range(24)) > 0
    save_session(a, tmp_path / "s.pbs")
    b = load_session(load_model("tiny-random", device=str(tiny_model.device)), tmp_path / "s.pbs")
    n = a.state.arena.n
    assert torch.equal(b.state.arena.log_mass[:, :, :n], a.state.arena.log_mass[:, :, :n])
    assert b.state.arena.folded
    assert [b.step().token_id for _ in range(8)] == [a.step().token_id for _ in range(8)]


@pytest.mark.parametrize("policy", ["brightness", "h2o"])
def test_fold_streams_the_real_model_within_budget(real_model, real_policy, policy):
    cache = CacheParams(budget=48, scorer=policy, repair="fold")
    session = Session(real_model, real_policy, GREEDY, cache)
    session.prime(real_policy.raw_prompt("The keeper climbed the stairs of the lighthouse"))
    records = list(session.stream(60, ignore_eos=True))
    assert all(r.cache_len <= 48 for r in records)
    assert 0 < sum(r.folded for r in records) <= sum(len(r.culled) for r in records)
    session.state.check_valid()


def test_a_folding_capture_replays_bit_exactly(real_model, real_policy, tmp_path):
    from positronic_brain.capture import CaptureTape
    from positronic_brain.loop import run
    from positronic_brain.replay import replay

    capture = CaptureTape(tmp_path, {"model": real_model.name, "dtype": "float32",
                                       "fingerprint": real_model.fingerprint},
                            level="full", run_id="fold")
    result = run(real_model, real_policy, real_policy.raw_prompt("Tides follow the moon"),
                 GREEDY, max_new_tokens=12, ignore_eos=True,
                 cache_params=CacheParams(budget=8, sinks=1, recent=2, repair="fold"), tape=capture)
    assert sum(len(s["culled"]) for s in result["steps"]) >= 8
    last = torch.load(capture.dir / "state_000012.pt", weights_only=True)
    assert float(last["arena_log_mass"].max()) > 0  # the states compared hold folded slots
    report = replay(capture.dir, model=real_model)
    assert report.ok and report.steps == 12, [str(m) for m in report.mismatches[:5]]


def test_run_reports_folds_per_step(capsys):
    from positronic_brain.cli import main

    code = main(["run", "--model", "tiny-random", "--prompt", "a prompt longer than the budget",
                 "--max-new-tokens", "6", "--ignore-eos", "--json", "--budget", "12",
                 "--sinks", "1", "--recent", "2", "--repair", "fold", "--fold-min-cos", "-1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    steps = json.loads(out)["steps"]
    assert all(s["folded"] == len(s["culled"]) for s in steps)
    assert sum(s["folded"] for s in steps) > 0 and all(s["cache_len"] <= 12 for s in steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slots_key_and_value_norms_are_the_same_bits_either_way(tiny_model, dtype):
    """Stage 4 computes one new slot's key and value norms from the K/V it writes, a
    block's from the stored rows; the two ways agree bit for bit, so the columns never
    depend on the path, and the value norms are the bits the scorer computed from V."""
    from positronic_brain.state import Arena

    a = Arena.allocate(tiny_model.spec, 64, dtype)
    g = torch.Generator().manual_seed(1)
    scale = torch.rand(a.kt.shape[:3] + (1,), generator=g) * 9
    a.kt.copy_(torch.randn(a.kt.shape, generator=g) * scale)
    a.v.copy_(torch.randn(a.v.shape, generator=g) * scale.transpose(2, 3))
    a.renorm(0, 64)
    block = (a.knorm.clone(), a.vnorm.clone())
    for s in range(64):
        a.renorm(s, s + 1, a.k[:, :, s:s + 1].clone(), a.v[:, :, s:s + 1].clone())
    assert torch.equal(a.knorm, block[0]) and torch.equal(a.vnorm, block[1])
    assert torch.equal(a.vnorm, a.v.float().norm(dim=-1))


def test_chat_stats_count_the_folds(tiny_model, tiny_policy):
    from positronic_brain.chat import Chat

    cache = options.params(budget=96, sinks=2, recent=4, repair="fold", fold_min_cos=-1.0)
    chat = Chat(tiny_model, tiny_policy, system="be brief", sampler=GREEDY, cache_params=cache,
                max_new_tokens=16)
    for t in range(6):
        chat.say(f"turn {t}")
    stats = chat.stats()
    assert stats["folded"] == stats["culled"] > 0 and stats["merged"] == 0


def test_bfloat16_fold_targets_read_the_stored_keys_in_place(tiny_model, monkeypatch):
    """In bfloat16 the fold-target product runs over the arena's whole dense key block when
    the live slots fill most of it (oneDNN would otherwise copy the strided live keys
    first): its live columns are the view's keys, whatever the dead slots hold, the targets
    and the cosine threshold's drops equal those found from a plain copy of the live keys,
    and it allocates about a copy of the keys less than the strided view would (its output
    over the wider block costs a little). Sparser arenas and views that start past slot 0
    get their own columns."""
    from positronic_brain.bench.common import bytes_allocated
    from positronic_brain.stages.decide import fold_targets
    from positronic_brain.state import Arena, stored_keys

    n = 1000
    a = Arena.allocate(tiny_model.spec, 1024, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    a.kt.copy_(torch.randn(a.kt.shape, generator=g))
    a.kt[..., n:] = float("nan")  # dead slots: never read as live
    a.n = n
    a.renorm(0, n)
    view = dataclasses.replace(_view(a), k=a.k[:, :, :n])
    L, KVH, _, D = view.k.shape
    block = stored_keys(view.k)
    assert block.is_contiguous() and block.data_ptr() == a.kt.data_ptr()
    assert torch.equal(block[..., :n], view.k.transpose(2, 3).reshape(L * KVH, D, n))
    plain = dataclasses.replace(view, k=view.k.contiguous())
    assert stored_keys(plain.k).shape == (L * KVH, D, n)  # not an arena's layout: its columns
    for k in (a.k[:, :, :600], a.k[:, :, 2:n], a.k[1:, :, 3:n]):  # sparse; starting later
        live = k.transpose(2, 3).reshape(-1, D, k.shape[2])
        assert torch.equal(stored_keys(k)[..., :k.shape[2]], live)
    assert stored_keys(a.k[:, :, :600]).shape[-1] == 600  # the wider product would cost more
    culls = (3, 17, 300)
    for min_cos in (-1.0, 0.7):
        got, want = fold_targets(view, culls, min_cos), fold_targets(plain, culls, min_cos)
        assert [f.slot for f in got] == [f.slot for f in want]
        assert all(torch.equal(x.into, y.into) for x, y in zip(got, want))
    assert [f.slot for f in fold_targets(view, culls)] == list(culls)
    assert any(bool((f.into == -1).any()) for f in fold_targets(view, culls, 0.7))
    in_place = bytes_allocated(lambda: fold_targets(view, culls[:1]))
    monkeypatch.setattr("positronic_brain.stages.decide.fold.stored_keys",
                        lambda k: k.transpose(2, 3).reshape(L * KVH, D, n))  # the strided view
    saved = bytes_allocated(lambda: fold_targets(view, culls[:1])) - in_place
    if packable():  # oneDNN's bfloat16 product (avx512bw/vl/dq or avx_ne_convert) copies a
        # strided operand; elsewhere (an AVX2-only AMD EPYC) torch's reads it where it lies
        assert saved >= 0.9 * view.k.numel() * view.k.element_size()


def _view(a):
    from positronic_brain.state import Ledger, State

    m = Ledger.allocate(a.capacity)
    m.n = a.n
    m.uid[: a.n] = torch.arange(a.n)
    m.position[: a.n] = torch.arange(a.n)
    return State(a, m).view()
