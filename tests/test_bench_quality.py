"""`bench quality`: streaming perplexity through the real loop with teacher forcing, checked
against Hugging Face's own full-context forward; the CLI's JSON, report and plots."""
import json
import math

import pytest
import torch

from positronic_brain.bench import quality
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.types import CacheParams, SamplerParams, Segment, UserError
from tests.oracle import hf_step_logits

PNG = b"\x89PNG\r\n\x1a\n"


N_TOKENS = 64  # real-model loops run on one thread: on a busy machine a second one waits


@pytest.fixture(scope="module")
def text_ids(real_policy):
    return real_policy.encode(quality.default_text())[:N_TOKENS]


@torch.no_grad()
def hf_nll(model, ids: list[int]) -> torch.Tensor:
    """(T-1,) NLL of ids[1:] from one HF forward over the whole text (the full context)."""
    logp = model.hf(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _assert_equals_hf(s, want):
    got = torch.tensor(s.nll)
    assert s.totals.culled == 0 and s.stop_reason == "max_new_tokens" and got.shape == want.shape
    diff = (got - want).abs()
    assert float(diff.max()) <= 1e-4, f"NLL max abs diff {float(diff.max()):.3g}"
    assert abs(s.ppl - math.exp(float(want.mean()))) <= 1e-4 * s.ppl


@pytest.mark.usefixtures("one_thread")
def test_streaming_nll_equals_hf_full_context(real_model, real_policy, text_ids):
    """Without a budget, and with a budget >= the text, nothing is culled: every token's NLL
    and the perplexity equal HF's forward over the whole text."""
    want = hf_nll(real_model, text_ids)
    for cache in (CacheParams(scorer="none"), CacheParams(budget=N_TOKENS + 8)):
        _assert_equals_hf(quality.streaming_nll(real_model, real_policy, text_ids, cache), want)


@pytest.mark.usefixtures("one_thread")
def test_a_budget_changes_only_what_follows_the_first_cull(real_model, real_policy, text_ids):
    cut = quality.streaming_nll(real_model, real_policy, text_ids,
                                CacheParams(budget=40, scorer="streaming", sinks=2, recent=8))
    # Step t runs ids[t-1] over t-1 cached tokens and culls (in stage 4, after its NLL) from
    # t = 41 on: the first 41 NLLs are the full context's, each later one sees a culled one.
    want, got = hf_nll(real_model, text_ids), torch.tensor(cut.nll)
    assert cut.totals.culled == N_TOKENS - 1 - 40
    assert float((got[:41] - want[:41]).abs().max()) <= 1e-4
    assert bool(((got[41:] - want[41:]).abs() > 1e-4).all())


def test_forced_tokens_become_pending_without_drawing(tiny_model, tiny_policy):
    """Teacher forcing: each step's pending token is the forced one, the generator is never
    drawn from, and the record's logprob is the model's for that token."""
    session = Session(tiny_model, tiny_policy, SamplerParams(temperature=1.0, seed=3),
                      CacheParams(budget=24, sinks=2, recent=4))
    session.prime([Segment((5, 6, 7), "user")])
    rng = session.generator.get_state()
    forced = [9, 10, 11, 12] * 8
    for tok in forced:
        want = hf_step_logits(tiny_model, session.state.view()).log_softmax(-1)[tok]
        rec = session.step(force=tok)
        assert rec.token_id == tok == session.state.pending_token
        assert abs(rec.logprob - float(want)) <= 1e-4
    assert torch.equal(session.generator.get_state(), rng)
    assert session.generated_ids == forced and session.state.arena.n == 24
    with pytest.raises(UserError, match="forced tokens"):
        next(session.stream(3, force=[1]))
    assert [r.token_id for r in session.stream(2, force=[7, 8])] == [7, 8]
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        session.step(force=tiny_model.spec.vocab)


def test_bench_quality_quick_json_report_and_plots(capsys, tmp_path, one_thread):
    """The tiny model (512 positions) makes the long run cheap: compact passes the limit,
    keep stops there."""
    out, doc = tmp_path / "q", tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\nspeed section\n")
    args = ["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "32",
            "--tokens", "64", "--long", "560", "--jobs", "1", "--json", "--out", str(out),
            "--report", str(doc)]
    code = main(args)
    stdout, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(stdout)  # exactly one JSON object on stdout
    assert res == json.loads((out / "results.json").read_text())
    assert res["model"] == "tiny-random" and res["quick"] and res["max_positions"] == 512
    assert res["text"]["slice"] == "eval" and res["text"]["offset"] == 0

    grid = [(r["budget"], r["policy"], r["repair"]) for r in res["runs"]]
    assert grid == [(32, p, r) for p in quality.SCORERS for r in quality.REPAIRS]
    for r in res["runs"]:
        assert r["scored"] == 64 and r["ppl"] > 1 and math.isfinite(r["ppl"])
        # every step past the budget removes one: a cull or a merge (a fold is a cull too)
        removed = r["culled"] + r["merged"]
        assert removed == 64 - 32
        assert (r["merged"] + r["folded"] > 0) == (r["repair"] != "none")
        assert r["repair"] != "fold" or 0 < r["folded"] <= r["culled"]
    (oracle,) = res["oracle"]  # the hindsight oracle, from the reference's attention
    assert (oracle["budget"], oracle["policy"], oracle["repair"]) == (32, "oracle", "none")
    assert oracle["scored"] == 64 and oracle["culled"] == 64 - 32
    ref = res["reference"]
    assert ref["budget"] is None and ref["culled"] == 0 and ref["scored"] == 64
    assert ref["windows"][-1]["end"] == 512  # the reference streams up to the positions

    compact, keep, base, recall = res["long"]
    assert [(r["policy"], r["positions"], r["recall"]) for r in res["long"]] == [
        ("brightness", "compact", False), ("brightness", "keep", False),
        ("streaming", "keep", False), ("brightness", "keep", True)]
    assert compact["scored"] == 560 and compact["reindexed"] >= 1
    for r in (keep, base, recall):
        assert r["scored"] == 512 and r["stop_reason"] == "max_positions"
        assert r["reindexed"] == 0 and r["budget"] == 32
    assert recall["recalled"] > 0 and keep["recalled"] == 0
    assert ref["scored_all"] == 512 and ref["ppl_all"] > 1
    # The runs are one until the re-index (in stage 4 of the step at position 511).
    assert keep["windows"] == compact["windows"][:len(keep["windows"])]
    # The control streams the last 256 tokens from token 304: the 48 past the positions
    # are its scored tokens 208-255, the compact run's 512-559.
    c = res["control"]
    assert c["start"] == 304 and c["scored"] == 256 and c["tokens"] == [513, 561]
    assert c["positions_scored"] == [208, 256] and c["reindexed"] == 0
    assert c["ppl_compact"] == pytest.approx(next(w["ppl"] for w in compact["windows"]
                                                  if w["start"] == 512))
    whats = [t["what"] for t in res["targets"]]
    assert {w.split(":")[0] for w in whats} >= {"budget 32", "compact positions",
                                                  "budget 32, the first 512 tokens"}
    gap = next(t for t in res["targets"] if "gap between the best baseline" in t["what"])
    assert gap["met"] is None if gap["value"] is None else gap["met"] == (gap["value"] >= 0.5)
    with_recall = next(t for t in res["targets"] if "with recall" in t["what"])
    assert with_recall["value"] == pytest.approx(recall["ppl"] / ref["ppl_all"])
    control = next(t for t in res["targets"] if "control run" in t["what"])
    assert control["value"] == pytest.approx(c["ppl_compact"] / c["ppl_past"])

    for name in ("ppl_vs_budget.png", "ppl_long.png"):
        assert (out / name).read_bytes().startswith(PNG)
    report = (out / "report.md").read_text()
    assert "bench quality --quick --model tiny-random" in report
    assert "![ppl_long.png](./ppl_long.png)" in report
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nspeed section\n")
    assert "<!-- bench quality: end -->" in text
    assert "![ppl_vs_budget.png](q/ppl_vs_budget.png)" in text


def test_slices_never_overlap():
    ids = list(range(1000))
    assert quality.text_slice(ids, "eval", 10) == (0, ids[:10])
    assert quality.text_slice(ids, "tune", 10) == (500, ids[500:510])
    assert quality.text_slice(ids, "tune", 10, at=0.875) == (875, ids[875:885])
    assert quality.text_slice(ids, "tune", 125, at=0.875)[1][-1] == 999
    for which, need, at in (("eval", 501, 0.5), ("tune", 126, 0.875)):
        with pytest.raises(UserError, match="slice holds"):
            quality.text_slice(ids, which, need, at)


def test_pool_workers_give_the_inline_result(tiny_model, tiny_policy):
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), tokens=40)
    ids = tiny_policy.encode(quality.default_text())[:41]
    jobs = [quality.Job("grid", p, cfg.cache(24, p), 40, 40) for p in ("tova", "h2o")]
    inline = quality.execute(cfg, jobs, ids, workers=1)
    pooled = quality.execute(cfg, jobs, ids, workers=2)
    for a, b in zip(inline, pooled):
        assert a.totals.culled == b.totals.culled and max(abs(x - y) for x, y in zip(a.nll, b.nll)) < 1e-4


def test_bad_input_is_one_line(capsys):
    for argv, msg in ((["--budgets", "1,a"], "comma-separated integers"),
                      (["--params", "gain=x"], "bad value for gain"),
                      (["--params", "budget=3"], "unknown or fixed field"),
                      (["--policies", "none"], "non-culling"),
                      (["--budgets", "8"], "smaller than sinks + recent"),
                      (["--at", "0.7"], "--at places the tune slice"),
                      (["--slice", "tune", "--at", "0.3"], "--at places the tune slice")):
        assert main(["bench", "quality", "--model", "tiny-random", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert main(["bench", "speed", "--tokens", "9"]) == 2
    assert "for bench quality only" in capsys.readouterr().err


def test_a_forced_run_replays_bit_for_bit(tiny_model, tiny_policy, tmp_path):
    """The forced token is a captured stage-1 input, so replay re-runs stage 1 with it."""
    from positronic_brain.capture import CaptureTape
    from positronic_brain.replay import replay

    cap = CaptureTape(tmp_path, {"model": tiny_model.name, "dtype": "float32",
                                   "fingerprint": tiny_model.fingerprint}, run_id="forced")
    session = Session(tiny_model, tiny_policy, SamplerParams(temperature=1.0, seed=1),
                      CacheParams(budget=24, sinks=2, recent=4, repair="merge"), tape=cap)
    session.prime([Segment((5, 6, 7), "user")])
    list(session.stream(30, force=list(range(40, 70))))
    cap.close(session.stop_reason)
    report = replay(cap.dir, model=tiny_model)
    assert report.ok and report.steps == 30, str(report)
