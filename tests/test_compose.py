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
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.generate import generate
from positronic_brain.state import Ledger
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.oracle import assert_close, hf_step_logits
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
