"""Blend: a composed cache measured against a joint prefill of its text, and CacheBlend's
selective recompute. Recomputing every row is the joint prefill; the recomputed rows are
what Hugging Face's forward gives with the same rows visible; a composition of one primed
session does not deviate at all; ``rewrite`` writes only the slots it is given; the CLI's
``compose --measure/--recompute`` and ``bench transfer``."""
import json

import pytest
import torch
from transformers import DynamicCache

from positronic_brain.blend import Blend, measure
from positronic_brain.capture import arena_version
from positronic_brain.cli import main
from positronic_brain.compose import Part, compose, compose_files
from positronic_brain.loop import Session
from positronic_brain.model import hf_forward, load_model
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import rewrite
from positronic_brain.state import Ledger
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.oracle import assert_close
from tests.tolerance import ORACLE, model_bound, nll_bound, sum_bound

TEXTS = ("the first part of a longer text", "and then a second part", "a third, last one")
MORE = " which goes on for a while after"
PNG = b"\x89PNG\r\n\x1a\n"


def _session(model, policy, text: str, steps: int) -> Session:
    s = Session(model, policy, SamplerParams(greedy=True), cache_params=CacheParams())
    s.prime(policy.raw_prompt(text), 96)
    for _ in range(steps):
        s.step()
    return s


def _composed(model, policy, steps: int = 3) -> Session:
    return compose(model, [Part.of(_session(model, policy, t, steps), f"{i}.pbs")
                           for i, t in enumerate(TEXTS)])


def _first_part(model, policy) -> int:
    """How many rows the first part of ``_composed`` holds."""
    return _session(model, policy, TEXTS[0], 3).state.ledger.n


@pytest.mark.parametrize("chunk", [256, 16])
def test_recomputing_every_row_is_the_joint_prefill(tiny_model, tiny_policy, chunk):
    """R = 100 selects every row; with nothing left to see of the composed cache, the
    masked forward is the joint prefill (to float rounding), and so is the NLL. Chunk 16
    runs the prefill and the recompute in several chunks each."""
    state = _composed(tiny_model, tiny_policy).state
    b = Blend(tiny_model, state, chunk)
    sel = b.selected(100)
    assert sel.tolist() == list(range(b.n)) and b.n == state.ledger.n
    k, v = b.recompute(sel)
    last = tiny_model.spec.n_layers - 1  # the deepest K/V: every layer's sums before them
    for got, want, what in ((k, b.joint[0], "K"), (v, b.joint[1], "V")):
        tol = model_bound(tiny_model, float(want.abs().max()), b.n, last)  # other chunks and masks
        assert_close(got, want, tol, f"recomputed {what} vs the joint prefill")
    cont = torch.tensor(tiny_policy.encode(MORE), device=tiny_model.device)
    tol = nll_bound(tiny_model, b.n + cont.numel())  # the same forward over those K/V
    assert abs(b.nll(b.replaced(sel, k, v), cont) - b.nll(b.joint, cont)) <= tol
    dev = b.deviation()
    # relative deviations, in units of the rows' size: layer 0's are each token's own norm
    # and projection, the later parts' keys rotated again to their new positions (compose)
    tol = model_bound(tiny_model, 1.0, b.n, 0, 3)
    assert float(dev["layer_k"][0]) <= tol and float(dev["layer_v"][0]) <= tol  # per token
    n0 = _first_part(tiny_model, tiny_policy)  # the first part saw no other: a prefix
    tol = model_bound(tiny_model, 1.0, b.n, last)  # its session's prefill and decode steps
    assert float(dev["token_k"][:n0].max()) <= tol
    assert float(dev["token_k"][n0:].min()) > 100 * tol  # never saw the first: far past rounding


def test_recomputed_rows_are_hf_forward_with_the_same_rows_visible(tiny_model, tiny_policy):
    """HF's own forward of the selected tokens over the composed cache, with an attention
    mask letting each see the unselected rows before it and the selected ones causally,
    gives the recomputed K/V at every layer."""
    b = Blend(tiny_model, _composed(tiny_model, tiny_policy).state)
    sel = b.selected(30)
    assert 0 < sel.numel() < b.n
    k, v = b.recompute(sel)
    ck, cv, _ = b.cache
    n, t = b.n, sel.numel()
    unselected = torch.ones(n, dtype=torch.bool, device=sel.device)
    unselected[sel] = False
    sees = torch.cat(((torch.arange(n, device=sel.device)[None] < sel[:, None]) & unselected,
                      torch.ones(t, t, dtype=torch.bool, device=sel.device).tril()), dim=1)
    mask = torch.zeros(1, 1, t, n + t, device=sel.device).masked_fill(~sees, float("-inf"))
    cache = DynamicCache(ddp_cache_data=[(ck[i][None].clone(), cv[i][None].clone())
                                         for i in range(ck.shape[0])])
    with torch.no_grad():
        hf_forward(tiny_model.hf, b.ids[sel][None], cache, position_ids=b.positions[sel][None],
                   attention_mask=mask, use_cache=True)
    for i in range(ck.shape[0]):
        layer = cache.layers[i]
        assert_close(k[i], layer.keys[0][:, n:], ORACLE, f"layer {i} recomputed keys vs HF")
        assert_close(v[i], layer.values[0][:, n:], ORACLE, f"layer {i} recomputed values vs HF")
    # the selection: the rows whose layer-1 values deviate most
    dv = (cv[1] - b.joint[1][1]).square().sum((0, 2))
    assert float(dv[sel].min()) >= float(dv[~torch.isin(torch.arange(n, device=sel.device), sel)].max())


def test_a_composition_of_one_session_deviates_only_by_rounding(tiny_model, tiny_policy):
    """A primed session's K/V come from one prefill, as the joint prefill's: no deviation at
    all. Tokens generated step by step round differently (decode steps add in other orders
    than a prefill). Either way the NLL is the session's own, teacher-forced step by step."""
    cont = tiny_policy.encode(MORE)
    for steps in (0, 4):
        s = _session(tiny_model, tiny_policy, TEXTS[0], steps)
        n = s.state.ledger.n
        report, rows = measure(tiny_model, compose(tiny_model, [Part.of(s, "a.pbs")]).state,
                               cont, (100,))
        d = report["deviation"]
        context = n + len(cont)
        # relative deviations, in units of the rows' size; none without steps (equal bits)
        tol = model_bound(tiny_model, 1.0, n, tiny_model.spec.n_layers - 1) if steps else 0.0
        assert d["k"] <= tol and d["v"] <= tol and max(d["layer_k"] + d["layer_v"]) <= tol
        nll = report["nll"]
        assert abs(nll["composed"] - nll["joint"]) <= (nll_bound(tiny_model, context)
                                                       if steps else 0.0)
        own = -sum(s.step(force=t).logprob for t in cont) / len(cont)
        # one forward against decode steps, and the mean of the NLLs in another order
        tol = nll_bound(tiny_model, context) + sum_bound(torch.float32, len(cont), own)
        assert abs(nll["composed"] - own) <= tol
        assert rows[0].tolist() == list(range(n))
        if steps == 0:
            assert report["recompute"][0]["gap_closed"] is None  # no gap to close


def test_rewrite_writes_only_the_given_slots(tiny_model, tiny_policy):
    """``measure`` leaves the state as it was; ``rewrite`` (stage 0) then changes the given
    slots' K/V, norms and log-mass and nothing else, and the state stays valid."""
    session = _composed(tiny_model, tiny_policy)
    state = session.state
    cont = tiny_policy.encode(MORE)
    version = arena_version(state)
    report, (slots, k, v) = measure(tiny_model, state, cont, (50,))
    assert arena_version(state) == version  # measuring reads the state, never writes it
    a, m, n = state.arena, state.ledger, state.ledger.n
    before = {x: getattr(a, x)[:, :, :n].clone() for x in ("k", "v", "knorm", "vnorm", "log_mass")}
    ledger = {c: m.live(c).clone() for c in Ledger.COLUMNS}
    rewrite(tiny_model, state, slots, k, v)
    state.check_valid()
    others = torch.ones(n, dtype=torch.bool)
    others[slots] = False
    for x, old in before.items():
        assert torch.equal(getattr(a, x)[:, :, :n][:, :, others], old[:, :, others]), x
    assert torch.equal(a.k[:, :, slots], k) and torch.equal(a.v[:, :, slots], v)
    assert not bool(a.log_mass[:, :, slots].any())
    assert all(torch.equal(m.live(c), col) for c, col in ledger.items())
    # the state now holds the recomputed cache: measured again, its NLL is the report's (the
    # same forward over the same K/V bits)
    again, _ = measure(tiny_model, state, cont)
    assert again["nll"]["composed"] == report["recompute"][0]["nll"]
    for bad, what in ((torch.tensor([0, 0]), "distinct"), (torch.tensor([n]), "outside")):
        with pytest.raises(UserError, match=what):
            rewrite(tiny_model, state, bad, k[:, :, :bad.numel()], v[:, :, :bad.numel()])


def _saved(model, policy, tmp_path) -> list[str]:
    paths = [str(tmp_path / f"{i}.pbs") for i in range(len(TEXTS))]
    for p, t in zip(paths, TEXTS):
        save_session(_session(model, policy, t, 3), p)
    return paths


def test_compose_files_saves_the_recomputed_cache(tiny_model, tiny_policy, tmp_path):
    paths = _saved(tiny_model, tiny_policy, tmp_path)
    cont = tiny_policy.encode(MORE)
    out = compose_files(tiny_model, paths, tmp_path / "c.pbs", cont, (10, 100))
    curve = out["measure"]["recompute"]
    # all rows recomputed close the whole gap, to rounding: the rebuild attends through a
    # mask over its past, the joint prefill to past and new apart on the CPU
    assert [r["percent"] for r in curve] == [10, 100]
    # 1 - (NLL at R - joint) / (composed - joint): the two NLLs in other orders
    m = out["measure"]
    nll, context = m["nll"], m["tokens"] + len(cont)
    gap = nll_bound(tiny_model, context) / abs(nll["composed"] - nll["joint"])
    assert abs(curve[1]["gap_closed"] - 1) <= gap
    tol = model_bound(tiny_model, 1.0, m["tokens"], tiny_model.spec.n_layers - 1)  # relative
    assert curve[1]["deviation"]["k"] <= tol and curve[1]["deviation"]["v"] <= tol
    loaded = load_session(tiny_model, tmp_path / "c.pbs")
    loaded.state.check_valid()
    again, _ = measure(tiny_model, loaded.state, cont)
    assert again["deviation"]["k"] <= tol and again["deviation"]["v"] <= tol  # R = 100
    with pytest.raises(UserError, match="continuation"):
        compose_files(tiny_model, paths, tmp_path / "d.pbs", None, (10,))
    assert not (tmp_path / "d.pbs").exists()


def test_compose_measure_cli(tiny_model, tiny_policy, tmp_path, capsys):
    paths = _saved(tiny_model, tiny_policy, tmp_path)
    out = str(tmp_path / "out.pbs")
    for argv in (["--recompute", "10"], ["--measure", MORE, "--recompute", "0"],
                 ["--measure", MORE, "--recompute", "150"], ["--measure", MORE, "--recompute", "x"],
                 ["--measure", ""], ["--measure", MORE, "--select-layer", "2"]):
        assert main(["compose", *paths, "--out", out, "--model", "tiny-random", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err, (argv, err)
    assert not (tmp_path / "out.pbs").exists()
    assert main(["compose", *paths, "--out", out, "--model", "tiny-random", "--measure", MORE,
                 "--recompute", "20,50", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    m = res["measure"]
    assert m["tokens"] == res["cached"] and m["continuation"] == len(tiny_policy.encode(MORE))
    assert len(m["deviation"]["layer_k"]) == tiny_model.spec.n_layers
    assert len(m["deviation"]["token_v"]) == len(m["positions"]) == res["cached"]
    assert [r["rows"] for r in m["recompute"]] == [-(-res["cached"] * p // 100) for p in (20, 50)]
    assert main(["compose", *paths, "--out", out, "--model", "tiny-random", "--measure",
                 MORE]) == 0
    text = capsys.readouterr().out
    assert "Deviation" in text and "NLL" in text and "composed" in text


def test_bench_transfer_quick(capsys, tmp_path, one_thread):
    out, doc = tmp_path / "t", tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\nspeed section\n")
    code = main(["bench", "transfer", "--quick", "--model", "tiny-random", "--json", "--out",
                 str(out), "--report", str(doc)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(stdout)
    assert res == json.loads((out / "results.json").read_text())
    c, cfg = res["sections"]["compose"], res["config"]
    assert len(c["runs"]) == cfg["texts"] == 2 and cfg["parts"] * cfg["part_tokens"] + 1 \
        + cfg["continuation"] <= res["max_positions"]
    model = load_model("tiny-random")
    context = cfg["parts"] * cfg["part_tokens"] + 1 + cfg["continuation"]
    layer0 = model_bound(model, 1.0, context, 0, 3)  # and the later parts' keys rotated again
    deepest = model_bound(model, 1.0, context, model.spec.n_layers - 1)
    for r in c["runs"]:
        d = r["deviation"]  # relative, in units of the rows' size
        # the first part is a prefix (rounding only); the others never saw it
        assert d["part_k"][0] <= deepest and min(d["part_k"][1:]) > 100 * deepest
        assert d["layer_k"][0] <= layer0 and d["layer_v"][0] <= layer0  # layer 0: per token
        assert [x["percent"] for x in r["recompute"]] == list(cfg["percents"])
        assert abs(r["recompute"][-1]["nll"] - r["nll"]["joint"]) <= nll_bound(model, context)
    assert [x["percent"] for x in c["summary"]["curve"]] == list(cfg["percents"])
    p = res["sections"]["partial"]
    assert len(p["runs"]) == 2 and p["subsets"][0]["subset"] == "all"
    assert p["subsets"][0]["vs_full"] == 0.0  # every layer carried: the full transfer's bits
    j = res["sections"]["projector"]
    assert j["kl_after"] < j["kl_before"] and j["steps"] == cfg["projector_steps"]
    assert j["kl_fit"] < j["kl_before"]
    assert (out / "compose_gap_closed.png").read_bytes().startswith(PNG)
    report = (out / "report.md").read_text()
    assert "bench transfer --quick --model tiny-random" in report
    assert "![compose_gap_closed.png](./compose_gap_closed.png)" in report
    assert "Partial transfer" in report and "held-out KL" in report
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nspeed section\n") and "<!-- bench transfer: end -->" in text
    for argv in (["--jobs", "2"], ["--budgets", "64"], ["--trials", "3"]):
        assert main(["bench", "transfer", "--model", "tiny-random", *argv]) == 2
        assert capsys.readouterr().err.count("\n") == 1
