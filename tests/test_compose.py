"""Compose: saved sessions of one model joined into one context. One session composes to
itself bit for bit; two compose to a cache our forward reads as Hugging Face's does; moved
keys are the keys HF's rotary gives at the new positions; every row keeps its origin."""
import json

import pytest
import torch
from transformers import DynamicCache

from positronic_brain.cli import main
from positronic_brain.compose import Part, compose, compose_files
from positronic_brain.loop import Session
from positronic_brain.model import hf_forward
from positronic_brain.partial import save_partial
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.generate import generate
from positronic_brain.state import Ledger
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.oracle import assert_close, hf_step_logits, per_head_state_logits
from tests.tolerance import ORACLE

SAMPLED = SamplerParams(temperature=1.0, top_k=40, seed=11)
TEXTS = ("the first part of a longer text", "and then a second part", "a third, last one")


def _session(model, policy, text: str, steps: int = 3, params: CacheParams | None = None) -> Session:
    s = Session(model, policy, SAMPLED, cache_params=params or CacheParams())
    s.prime(policy.raw_prompt(text), 96)
    for _ in range(steps):
        s.step()
    return s


def _continue(session: Session, steps: int) -> list:
    return [session.step() for _ in range(steps)]


def test_compose_of_one_session_is_that_session_bit_for_bit(tiny_model, tiny_policy):
    a = _session(tiny_model, tiny_policy, TEXTS[0], params=CacheParams(budget=24, recall=True))
    one = compose(tiny_model, [Part.of(a, "a.pbs")])
    va, vo = a.state.view(), one.state.view()
    assert torch.equal(va.k, vo.k) and torch.equal(va.v, vo.v)
    for c in Ledger.COLUMNS:
        if c not in ("origin", "origin_uid"):
            assert torch.equal(a.state.ledger.live(c), one.state.ledger.live(c)), c
    assert vo.origins == ("a.pbs",) and bool((vo.origin == 1).all())
    assert torch.equal(vo.origin_uid, va.uid)  # each row is its own uid in a.pbs
    assert (vo.pending_token, vo.next_position) == (va.pending_token, va.next_position)
    assert one.state.cold.n == a.state.cold.n > 0
    assert torch.equal(one.state.cold.arena.k[:, :, :a.state.cold.n],
                       a.state.cold.arena.k[:, :, :a.state.cold.n])
    ours, theirs = _continue(one, 6), _continue(a, 6)  # sampled: the generator came along
    assert [r.token_id for r in ours] == [r.token_id for r in theirs]
    assert [r.logprob for r in ours] == [r.logprob for r in theirs]


def test_compose_of_two_reads_as_hf_does_and_keys_are_hf_rotary(tiny_model, tiny_policy):
    a, b = (_session(tiny_model, tiny_policy, t) for t in TEXTS[:2])
    two = compose(tiny_model, [Part.of(a, "a.pbs"), Part.of(b, "b.pbs")])
    two.state.check_valid()
    view = two.state.view()
    na, nb = a.state.ledger.n, b.state.ledger.n
    assert view.n == na + nb and view.next_position == a.state.next_position + b.state.next_position
    assert view.position.tolist() == list(range(view.n))
    gen = generate(tiny_model, view, SamplerParams(greedy=True), two.generator)
    assert_close(gen.logits, hf_step_logits(tiny_model, view), ORACLE, "composed cache vs HF")
    # b's keys moved by a's next position: HF's own prefill of b's tokens there gives them
    # (attention depends on relative positions only, so every layer's keys agree)
    ids = b.state.view().token_id
    shift = a.state.next_position
    with torch.no_grad():
        cache = DynamicCache()
        hf_forward(tiny_model.hf, ids[None], cache, use_cache=True,
                   position_ids=torch.arange(shift, shift + nb, device=ids.device)[None])
    for i in range(tiny_model.spec.n_layers):
        theirs = cache.layers[i].keys[0]  # (kv_heads, nb, head_dim)
        assert_close(view.k[i][:, na:], theirs, ORACLE, f"layer {i} keys at the new positions")
    assert torch.equal(view.k[:, :, :na], a.state.view().k)  # the first part does not move


def test_origins_nest_survive_save_and_load_and_uids_are_accounted(tiny_model, tiny_policy,
                                                                  tmp_path):
    for name, text in zip("abc", TEXTS):
        save_session(_session(tiny_model, tiny_policy, text), tmp_path / f"{name}.pbs")
    compose_files(tiny_model, [tmp_path / "b.pbs", tmp_path / "c.pbs"], tmp_path / "bc.pbs")
    out = compose_files(tiny_model, [tmp_path / "a.pbs", tmp_path / "bc.pbs"], tmp_path / "x.pbs")
    assert out["origins"] == ["a.pbs", "b.pbs", "c.pbs"]  # bc.pbs's rows came from b, c
    x = load_session(tiny_model, tmp_path / "x.pbs")
    x.state.check_valid()
    rows = x.state.ledger.rows()
    labels = [r["origin"] for r in rows]
    n = {k: load_session(tiny_model, tmp_path / f"{k}.pbs").state.ledger.n for k in "abc"}
    assert labels == ["a.pbs"] * n["a"] + ["b.pbs"] * n["b"] + ["c.pbs"] * n["c"]
    b_uids = load_session(tiny_model, tmp_path / "b.pbs").state.ledger.rows()
    assert [r["origin_uid"] for r in rows if r["origin"] == "b.pbs"] == [r["uid"] for r in b_uids]
    assert len({r["uid"] for r in rows}) == len(rows)
    x.step()  # a new row is made here: origin none
    assert x.state.ledger.rows()[-1]["origin"] is None
    x.state.check_valid()


def test_compose_refuses_what_does_not_fit(tiny_model, tiny_policy, tmp_path, capsys):
    a = _session(tiny_model, tiny_policy, TEXTS[0])
    long = [Part.of(a, f"{i}.pbs") for i in range(tiny_model.spec.max_positions
                                                  // a.state.next_position + 1)]
    with pytest.raises(UserError, match="positions"):
        compose(tiny_model, long)
    save_session(a, tmp_path / "a.pbs")
    (tmp_path / "bad.pbs").write_bytes(b"not a session")
    for argv in (["compose", str(tmp_path / "a.pbs"), str(tmp_path / "bad.pbs")],
                 ["compose", str(tmp_path / "a.pbs"), str(tmp_path / "nope.pbs")],
                 ["compose", str(tmp_path / "a.pbs"), "--model", "tiny-random-qwen2"]):
        assert main(argv + ["--out", str(tmp_path / "out.pbs")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err
    assert not (tmp_path / "out.pbs").exists()
    assert main(["compose", str(tmp_path / "a.pbs"), str(tmp_path / "a.pbs"), "--out",
                 str(tmp_path / "aa.pbs"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cached"] == 2 * a.state.ledger.n and len(out["origins"]) == 1  # one file, twice


def test_per_head_sessions_compose_and_read_as_hf_does_per_head(tiny_model, tiny_policy,
                                                                 tmp_path, capsys):
    """A per-head part keeps each head's own tokens, each slot moved by its token's move; a
    whole-token part gives every head all of its tokens. The composed cache's stage 1 is
    HF's over the union, each head masked to its own; it goes on per head (the last part's
    parameters), through files and the command line too; a whole-token last part cannot
    take it on (one line)."""
    heads = CacheParams(budget=5, sinks=1, recent=1, scorer="tova", allocation="head")
    a = _session(tiny_model, tiny_policy, TEXTS[0], steps=8, params=heads)
    b = _session(tiny_model, tiny_policy, TEXTS[1])
    c = _session(tiny_model, tiny_policy, TEXTS[2], steps=6, params=heads)
    rows = a.state.heads.row[:, :, :a.state.arena.n]
    assert not bool((rows.sort(-1).values == rows[:1, :1].sort(-1).values).all()), \
        "the heads of the first part hold the same tokens"
    three = compose(tiny_model, [Part.of(a, "a.pbs"), Part.of(b, "b.pbs"), Part.of(c, "c.pbs")])
    state = three.state
    state.check_valid()
    assert torch.equal(state.heads.n, a.state.heads.n + b.state.ledger.n + c.state.heads.n)
    assert state.ledger.n == a.state.ledger.n + b.state.ledger.n + c.state.ledger.n
    view = state.view()
    assert torch.equal(view.k[0, 0, :5], a.state.view().k[0, 0, :5])  # the first part stays
    gen = generate(tiny_model, view, SamplerParams(greedy=True), three.generator)
    assert_close(gen.logits, per_head_state_logits(tiny_model, state), ORACLE,
                 "composed per-head cache vs HF")
    for _ in range(3):  # culls each head back to its budget
        three.step()
        state.check_valid()
    assert int(state.heads.n.max()) == heads.budget
    with pytest.raises(UserError, match="the last part, .* must be per-head too"):
        compose(tiny_model, [Part.of(a, "a.pbs"), Part.of(b, "b.pbs")])
    recalling = _session(tiny_model, tiny_policy, TEXTS[1], steps=8,
                         params=CacheParams(budget=6, sinks=1, recent=1, recall=True))
    assert recalling.state.cold.n > 0
    with pytest.raises(UserError, match="the last part, .* must be per-head too"):
        compose(tiny_model, [Part.of(a, "a.pbs"), Part.of(recalling, "r.pbs")])
    cold_heads = _session(tiny_model, tiny_policy, TEXTS[1], steps=8, params=CacheParams(
        budget=6, sinks=1, recent=1, scorer="tova", allocation="head", recall=True))
    assert cold_heads.state.cold.n > 0
    for parts in ([a, cold_heads], [recalling, cold_heads], [cold_heads]):
        with pytest.raises(UserError, match="cold stores .* do not compose per head yet"):
            compose(tiny_model, [Part.of(p, "p.pbs") for p in parts])
    for name, s in zip("abc", (a, b, c)):
        save_session(s, tmp_path / f"{name}.pbs")
    save_partial(b, tmp_path / "p.pbs", layers=(0,))
    with pytest.raises(UserError, match="a partial part composes with whole-token parts only"):
        compose_files(tiny_model, [tmp_path / "p.pbs", tmp_path / "c.pbs"], tmp_path / "pc.pbs")
    assert main(["compose", *(str(tmp_path / f"{x}.pbs") for x in "abc"), "--out",
                 str(tmp_path / "abc.pbs"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["cached"] for p in out["parts"]] == [s.state.ledger.n for s in (a, b, c)]
    with pytest.raises(UserError, match="a per-head composition cannot be measured"):
        compose_files(tiny_model, [tmp_path / "a.pbs"], tmp_path / "m.pbs", continuation=[1, 2])
    again = load_session(tiny_model, tmp_path / "abc.pbs")
    assert torch.equal(again.state.heads.n, compose(tiny_model, [
        Part.of(s, f"{x}.pbs") for x, s in zip("abc", (a, b, c))]).state.heads.n)
    again.step()
    again.state.check_valid()
