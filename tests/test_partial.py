"""Partial transfer: an export of some tokens and layers, imported by compose. With every
layer and row it is the full import bit for bit; the layers it lacks are rebuilt exactly as a
prefill of the same tokens in the target session writes them; the filters select what they
say; origins survive; bad input is one line and writes nothing."""
import json
import math

import pytest
import torch

from positronic_brain.cli import main
from positronic_brain.compose import Part, compose, compose_files
from positronic_brain.forward import rerotate
from positronic_brain.loop import Session
from positronic_brain.blend import nll
from positronic_brain.partial import layer_subsets, parse_layers, partial_bench, save_partial, select
from positronic_brain.session_io import load_saved, load_session, save_session
from positronic_brain.stages.apply import extend
from positronic_brain.stages.generate import generate
from positronic_brain.state import Ledger
from positronic_brain.types import SOURCES, CacheParams, SamplerParams, Segment, UserError
from tests.oracle import assert_close, hf_step_logits
from tests.tolerance import ORACLE

SAMPLED = SamplerParams(temperature=1.0, top_k=40, seed=11)
TARGET = "a target context that comes first. " * 2
DOC = "the document to transfer, long enough for two prefill chunks of tokens. " * 4


def _session(model, policy, text: str, steps: int = 3, params: CacheParams | None = None,
             capacity: int = 500) -> Session:
    s = Session(model, policy, SAMPLED, cache_params=params or CacheParams())
    s.prime(policy.raw_prompt(text), capacity)
    for _ in range(steps):
        s.step()
    return s


def _rows(session: Session, slots: slice) -> dict[str, torch.Tensor]:
    m = session.state.ledger
    return {c: m.live(c)[slots] for c in Ledger.COLUMNS}


def test_partial_with_every_layer_and_row_is_the_full_import(tiny_model, tiny_policy, tmp_path):
    # culls, folds (log-mass) and a permuted slot order: the rows travel as they are
    target = _session(tiny_model, tiny_policy, TARGET)
    doc = _session(tiny_model, tiny_policy, DOC, steps=6,
                   params=CacheParams(budget=40, repair="fold"))
    assert doc.state.arena.folded
    for name, s in (("t.pbs", target), ("doc.pbs", doc)):
        save_session(s, tmp_path / name)
    save_partial(doc, tmp_path / "p.pbs")
    full = compose_files(tiny_model, [tmp_path / "t.pbs", tmp_path / "doc.pbs"], tmp_path / "f.pbs")
    part = compose_files(tiny_model, [tmp_path / "t.pbs", tmp_path / "p.pbs"], tmp_path / "c.pbs")
    assert part["parts"][1]["layers"] == list(range(tiny_model.spec.n_layers))
    assert full["origins"] == ["t.pbs", "doc.pbs"] and part["origins"] == ["t.pbs", "p.pbs"]
    f, c = (load_session(tiny_model, tmp_path / x) for x in ("f.pbs", "c.pbs"))
    vf, vc = f.state.view(), c.state.view()
    for x in ("k", "v", "log_mass"):
        assert torch.equal(getattr(vf, x), getattr(vc, x)), x
    for col in Ledger.COLUMNS:  # the origin column too: the same index, labelled p.pbs
        assert torch.equal(f.state.ledger.live(col), c.state.ledger.live(col)), col
    assert (vf.pending_token, vf.next_position) == (vc.pending_token, vc.next_position)
    ours, theirs = ([s.step() for _ in range(6)] for s in (c, f))  # sampled: the generator too
    assert [(r.token_id, r.logprob) for r in ours] == [(r.token_id, r.logprob) for r in theirs]


@pytest.mark.parametrize("layers", [(0,), (1,), ()])
def test_rebuilt_layers_are_a_prefill_in_the_target(tiny_model, tiny_policy, tmp_path, layers):
    target, doc = _session(tiny_model, tiny_policy, TARGET), _session(tiny_model, tiny_policy, DOC)
    save_session(target, tmp_path / "t.pbs")
    save_partial(doc, tmp_path / "p.pbs", layers=layers)
    composed = compose(tiny_model, [Part.read(tiny_model, tmp_path / "t.pbs", "t.pbs"),
                                    Part.read(tiny_model, tmp_path / "p.pbs", "p.pbs")])
    composed.state.check_valid()
    # the same tokens prefilled in (a copy of) the target session: stage 0's extend
    ids = doc.state.view().token_id.tolist()
    assert len(ids) > 256  # two prefill chunks
    prefilled = load_session(tiny_model, tmp_path / "t.pbs")
    extend(tiny_model, prefilled.state, [Segment(tuple(ids[1:] + [doc.state.pending_token]),
                                                 "user")], pending=ids[0])
    at = slice(target.state.ledger.n, target.state.ledger.n + len(ids))
    vc, vp = composed.state.view(), prefilled.state.view()
    assert torch.equal(vc.position[at], vp.position[at]) and vc.next_position == vp.next_position
    moved = vc.position[at]
    exported = doc.state.view()
    for i in range(tiny_model.spec.n_layers):
        if i in layers:  # transferred: the doc's own K/V, moved to the new positions
            assert torch.equal(vc.k[i][:, at], rerotate(tiny_model, exported.k[i],
                                                       exported.position, moved))
            assert torch.equal(vc.v[i][:, at], exported.v[i])
        else:  # rebuilt: the prefill's bits
            assert torch.equal(vc.k[i][:, at], vp.k[i][:, at]), f"layer {i} keys"
            assert torch.equal(vc.v[i][:, at], vp.v[i][:, at]), f"layer {i} values"
    if layers == (1,):  # layer 1 attends to the context: a transferred one is not a prefill's
        assert not torch.equal(vc.v[1][:, at], vp.v[1][:, at])
    gen = generate(tiny_model, vc, SamplerParams(greedy=True), composed.generator)
    assert_close(gen.logits, hf_step_logits(tiny_model, vc), ORACLE, "mixed layers vs HF")


def test_filters_select_what_they_say(tiny_model, tiny_policy, tmp_path):
    s = Session(tiny_model, tiny_policy, SAMPLED, cache_params=CacheParams(budget=48))
    s.prime(tiny_policy.chat([("system", "Be brief."), ("user", "Name three colours.")]), 200)
    for _ in range(12):
        s.step()
    rows = s.state.ledger.rows()
    bright = sorted(r["brightness"] for r in rows)[len(rows) // 2]
    by_uid = {r["uid"]: r for r in rows}
    slots = s.state.ledger.live("uid").tolist()
    cases = [({"uids": (5, 20)}, lambda r: 5 <= r["uid"] <= 20),
             ({"sources": ("system", "assistant")}, lambda r: r["source"] in ("system", "assistant")),
             ({"min_brightness": bright}, lambda r: r["brightness"] >= bright),
             ({"uids": (3, 30), "sources": ("user",), "min_brightness": bright},
              lambda r: 3 <= r["uid"] <= 30 and r["source"] == "user" and r["brightness"] >= bright)]
    for filters, want in cases:
        picked = [slots[i] for i in select(s, **filters).tolist()]
        assert 0 < len(picked) < len(rows), filters
        assert sorted(picked) == sorted(u for u, r in by_uid.items() if want(r)), filters
        out = save_partial(s, tmp_path / "p.pbs", layers=(1,), **filters)
        assert (out["rows"], out["of"], out["layers"]) == (len(picked), len(rows), [1])
        _, saved = load_saved(tiny_model, tmp_path / "p.pbs")
        assert sorted(saved["columns"]["uid"].tolist()) == sorted(picked)
        assert saved["k"].shape == (1, tiny_model.spec.n_kv_heads, len(picked),
                                    tiny_model.spec.head_dim)
        assert {SOURCES[x] for x in saved["columns"]["source"].tolist()} \
            == {by_uid[u]["source"] for u in picked}


def test_gaps_and_origins_survive(tiny_model, tiny_policy, tmp_path):
    for name, text in (("a.pbs", TARGET), ("b.pbs", DOC[:80]), ("t.pbs", "a third context.")):
        save_session(_session(tiny_model, tiny_policy, text), tmp_path / name)
    compose_files(tiny_model, [tmp_path / "a.pbs", tmp_path / "b.pbs"], tmp_path / "ab.pbs")
    ab = load_session(tiny_model, tmp_path / "ab.pbs")
    rows = ab.state.ledger.rows()
    lo, hi = rows[len(rows) // 3]["uid"], rows[2 * len(rows) // 3]["uid"]  # across a and b
    picked = [r for r in rows if lo <= r["uid"] <= hi]
    save_partial(ab, tmp_path / "p.pbs", uids=(lo, hi), layers=(0,))
    out = compose_files(tiny_model, [tmp_path / "t.pbs", tmp_path / "p.pbs"], tmp_path / "x.pbs")
    assert out["origins"] == ["t.pbs", "a.pbs", "b.pbs"]  # p.pbs's rows came from a and b
    x = load_session(tiny_model, tmp_path / "x.pbs")
    x.state.check_valid()
    moved = [r for r in x.state.ledger.rows() if r["origin"] != "t.pbs"]
    assert [(r["origin"], r["origin_uid"], r["token_id"]) for r in moved] \
        == [(r["origin"], r["origin_uid"], r["token_id"]) for r in picked]
    shift = load_session(tiny_model, tmp_path / "t.pbs").state.next_position
    assert [r["position"] for r in moved] == [r["position"] + shift for r in picked]  # gaps kept
    # a partial part's uids are fresh and its accounts not carried, even when it comes first
    alone = compose_files(tiny_model, [tmp_path / "p.pbs"], tmp_path / "y.pbs")
    y = load_session(tiny_model, tmp_path / "y.pbs")
    assert alone["cached"] == len(picked) and y.state.ledger.next_uid == len(picked)
    y.state.check_valid()
    assert y.state.view().pending_token == ab.state.pending_token  # the exported session's
    x.step()
    x.state.check_valid()


def test_bad_input_is_one_line_and_writes_nothing(tiny_model, tiny_policy, tmp_path, capsys):
    save_session(_session(tiny_model, tiny_policy, TARGET), tmp_path / "a.pbs")
    a, out = str(tmp_path / "a.pbs"), str(tmp_path / "p.pbs")
    for flags, says in ((["--layers", "0-x"], "--layers"), (["--layers", "1-0"], "--layers"),
                        (["--layers", ""], "--layers"), (["--layers", "0-2"], "out of range"),
                        (["--uids", "9000-9999"], "empty"), (["--uids", "5-"], "--uids"),
                        (["--source", "robot"], "unknown source"),
                        (["--min-brightness", "1e9"], "empty"),
                        (["--out", a], "a file this command reads")):
        assert main(["export", a, "--out", out] + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and says in err, (flags, err)
    assert not (tmp_path / "p.pbs").exists()
    assert main(["export", a, "--out", out, "--layers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == [1]
    with pytest.raises(UserError, match=r"a partial session \(\d+ rows, layers 1 of 2\): import "
                       "it with compose") as e:
        load_session(tiny_model, out)
    assert "\n" not in str(e.value)
    assert main(["compose", a, out, "--out", str(tmp_path / "c.pbs")]) == 0
    assert "(layers 1)" in capsys.readouterr().out
    assert parse_layers("3,0-1,1-2") == (0, 1, 2, 3)


def test_partial_bench_rows(tiny_model, tiny_policy):
    out = partial_bench(tiny_model, tiny_policy, TARGET, DOC[:120], " and what follows it.")
    rows = {r["subset"]: r for r in out["subsets"]}
    assert list(rows) == list(layer_subsets(tiny_model.spec.n_layers))
    assert rows["all"]["vs_full"] == 0.0 and rows["all"]["rebuilt"] == 0  # the full transfer
    assert all(math.isfinite(r["nll"]) and r["seconds"] >= 0 for r in rows.values())
    # none: every layer rebuilt, i.e. the document prefilled after the target
    target = _session(tiny_model, tiny_policy, TARGET, steps=0)
    doc = tiny_policy.raw_prompt(DOC[:120])[0].ids
    extend(tiny_model, target.state, [Segment(doc[1:], "user")], pending=doc[0])
    view = target.state.view()
    cont = torch.tensor(tiny_policy.encode(" and what follows it."))
    joint = nll(tiny_model, (view.k, view.v, view.log_mass), view.pending_token,
                view.next_position, cont)
    # the rebuild is stage 0's extend over the same target (the prefill's bits, as above)
    assert rows["none"]["nll"] == joint
