"""`bench quality`: streaming perplexity through the real loop with teacher forcing, checked
against Hugging Face's own full-context forward; the CLI's JSON, report and plots."""
import dataclasses
import gzip
import json
import math
from types import SimpleNamespace

import pytest
import torch

from positronic_brain import native, options
from positronic_brain.bench import grid, quality
from positronic_brain.bench.grid import Pool
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.model import hf_forward
from positronic_brain.types import CacheParams, SamplerParams, Segment, UserError
from tests.oracle import hf_step_logits
from tests.tolerance import ORACLE, nll_bound, sum_bound

PNG = b"\x89PNG\r\n\x1a\n"


N_TOKENS = 64  # real-model loops run on one thread: on a busy machine a second one waits


@pytest.fixture(scope="module")
def text_ids(real_policy):
    return real_policy.encode(quality.default_text())[:N_TOKENS]


@torch.no_grad()
def hf_nll(model, ids: list[int]) -> torch.Tensor:
    """(T-1,) NLL of ids[1:] from one HF forward over the whole text (the full context)."""
    logp = hf_forward(model.hf, torch.tensor([ids], device=model.device)).logits[0]
    logp = logp.float().log_softmax(-1).cpu()
    return -logp[:-1].gather(1, torch.tensor(ids[1:], device="cpu")[:, None])[:, 0]


def _assert_equals_hf(s, want, tol):
    got = torch.tensor(s.nll, device="cpu")
    assert s.totals.culled == 0 and s.stop_reason == "max_new_tokens" and got.shape == want.shape
    diff = (got - want).abs()
    assert float(diff.max()) <= tol, f"NLL max abs diff {float(diff.max()):.3g}"
    # the mean NLL: each within tol, and summed in another order (float32 here)
    mean = tol + sum_bound(torch.float32, len(s.nll), float(want.mean()))
    assert abs(s.ppl - math.exp(float(want.mean()))) <= math.expm1(mean) * s.ppl


@pytest.mark.usefixtures("one_thread")
def test_streaming_nll_equals_hf_full_context(real_model, real_policy, text_ids):
    """Without a budget, and with a budget >= the text, nothing is culled: every token's NLL
    and the perplexity equal HF's forward over the whole text."""
    want = hf_nll(real_model, text_ids)
    for cache in (CacheParams(scorer="none"), CacheParams(budget=N_TOKENS + 8)):
        _assert_equals_hf(quality.streaming_nll(real_model, real_policy, text_ids, cache), want,
                          nll_bound(real_model, 0, ORACLE))


@pytest.mark.usefixtures("one_thread")
def test_a_budget_changes_only_what_follows_the_first_cull(real_model, real_policy, text_ids):
    cut = quality.streaming_nll(real_model, real_policy, text_ids,
                                CacheParams(budget=40, scorer="streaming", sinks=2, recent=8))
    # Step t runs ids[t-1] over t-1 cached tokens and culls (in stage 4, after its NLL) from
    # t = 41 on: the first 41 NLLs are the full context's, each later one sees a culled one.
    want, got = hf_nll(real_model, text_ids), torch.tensor(cut.nll, device="cpu")
    assert cut.totals.culled == N_TOKENS - 1 - 40
    tol = nll_bound(real_model, 0, ORACLE)
    assert float((got[:41] - want[:41]).abs().max()) <= tol
    assert bool(((got[41:] - want[41:]).abs() > tol).all())  # past what rounding explains


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
        assert abs(rec.logprob - float(want)) <= nll_bound(tiny_model, 0, ORACLE)
    assert torch.equal(session.generator.get_state(), rng)
    assert session.generated_ids == forced and session.state.arena.n == 24
    with pytest.raises(UserError, match="forced tokens"):
        next(session.stream(3, force=[1]))
    assert [r.token_id for r in session.stream(2, force=[7, 8])] == [7, 8]
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        session.step(force=tiny_model.spec.vocab)


def _kept(monkeypatch) -> list:
    """The typed results ``bench quality`` returns to the CLI, as they come."""
    kept, real = [], quality.run
    monkeypatch.setattr(quality, "run", lambda *a, **k: kept.append(real(*a, **k)) or kept[-1])
    return kept


def test_bench_quality_quick_json_report_and_plots(capsys, tmp_path, one_thread, monkeypatch):
    """The tiny model (512 positions) makes the long run cheap: compact passes the limit,
    keep stops there."""
    out, doc = tmp_path / "q", tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\nspeed section\n")
    args = ["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "32",
            "--tokens", "64", "--long", "560", "--jobs", "1", "--json", "--out", str(out),
            "--report", str(doc)]
    kept = _kept(monkeypatch)
    code = main(args)
    stdout, err = capsys.readouterr()
    assert code == 0, err
    (res,) = kept
    # exactly one JSON object on stdout
    assert json.loads(stdout) == json.loads((out / "results.json").read_text()) == res.to_json()
    assert res.model == "tiny-random" and res.quick and res.max_positions == 512
    _check_windows(res)
    _check_grid(res)
    _check_long(res)
    _check_targets(res)

    for name in ("ppl_vs_budget.png", "ppl_long.png"):
        assert (out / name).read_bytes().startswith(PNG)
    report = (out / "report.md").read_text()
    assert "bench quality --quick --model tiny-random" in report
    assert "![ppl_long.png](./ppl_long.png)" in report
    assert "| brightness with recall | none |" in report
    assert "skip layers 0.2, max 255.0; per head, pool 7, shrink 0.0. Recall:" in report
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nspeed section\n")
    assert "<!-- bench quality: end -->" in text
    assert "![ppl_vs_budget.png](q/ppl_vs_budget.png)" in text


def _check_windows(res):
    """Two windows (--quick), spread over the eval slice (the text's first half: the tune
    slice never shares a token), each opening with the largest budget + 1 unscored steps."""
    t, warmup = res.text, res.warmup
    assert t.slice == "eval" and t.offset == 0 and t.end == t.tokens // 2
    assert warmup == 33 and res.config.tokens == 64
    (a, b), span = t.windows, warmup + 64 + 1
    assert a == 0 and b + span == t.end and a + span <= b
    assert b + span <= quality.slice_range(t.tokens, "tune").start


def _check_grid(res):
    grid = [(r.budget, r.policy, r.repair, r.recall) for r in res.runs]
    assert grid == [(32, p, r, False) for p in quality.SCORERS for r in quality.REPAIRS] + [
        (32, "brightness", "none", True)]  # the default policy with recall
    (oracle,) = res.oracle  # the hindsight oracle, from the reference's attention
    assert (oracle.budget, oracle.policy, oracle.repair) == (32, "oracle", "none")
    for r in res.runs + [oracle]:
        assert r.scored == 2 * 64 and r.ppl > 1 and math.isfinite(r.ppl)
        # every scored step removes one: a cull or a merge (a fold is a cull too)
        assert r.culled + r.merged == 2 * 64
        assert (r.merged + r.folded > 0) == (r.repair != "none")
        assert r.repair != "fold" or 0 < r.folded <= r.culled
        assert (r.recalled > 0) == r.recall
        # every window's cache was full and culling before its first scored token
        assert [(w.start, w.first_scored, w.scored, w.warm_removed)
                for w in r.by_window] == [(a, a + 34, 64, 1) for a in res.text.windows]
        # the windows' float64 NLL sums against the run's (another grouping), and the
        # exp/log roundings between
        tol = sum_bound(torch.float64, 2 * 64, math.log(r.ppl) + 1)
        assert r.ppl == pytest.approx(math.exp(sum(
            math.log(w.ppl) for w in r.by_window) / 2), rel=tol)
    ref = res.reference
    assert ref.budget is None and ref.culled == 0 and ref.scored == 2 * 64
    assert [w.warm_removed for w in ref.by_window] == [0, 0]


def _check_long(res):
    ref = res.long_reference  # the full cache streams the long run up to the positions
    assert ref.budget is None and ref.culled == 0 and ref.scored == 512
    assert ref.windows[-1].end == 512 and ref.ppl > 1
    compact, keep, base, recall = res.long
    assert [(r.policy, r.positions, r.recall) for r in res.long] == [
        ("brightness", "compact", False), ("brightness", "keep", False),
        ("streaming", "keep", False), ("brightness", "keep", True)]
    assert compact.scored == 560 and compact.reindexed >= 1
    for r in (keep, base, recall):
        assert r.scored == 512 and r.stop_reason == "max_positions"
        assert r.reindexed == 0 and r.budget == 32
    assert recall.recalled > 0 and keep.recalled == 0
    # The runs are one until the re-index (in stage 4 of the step at position 511).
    assert keep.windows == compact.windows[:len(keep.windows)]
    # The control streams the last 256 tokens from token 304: the 48 past the positions
    # are its scored tokens 208-255, the compact run's 512-559.
    c = res.control
    assert c.start == 304 and c.scored == 256 and c.tokens == (513, 561)
    assert c.positions_scored == (208, 256) and c.reindexed == 0
    # the same perplexity of the same NLLs
    assert c.ppl_compact == next(w.ppl for w in compact.windows if w.start == 512)


def _target(res, *words):
    (t,) = [t for t in res.targets if all(w in t.what for w in words)]
    return t


def _check_targets(res):
    whats = [t.what for t in res.targets]
    assert {w.split(":")[0] for w in whats} >= {"budget 32", "compact positions",
                                                  "budget 32, the first 512 tokens"}
    rec = quality.with_recall(res, 32)
    base = quality.best(res.runs, 32, quality.BASELINES)
    assert rec.recall and not base.recall and base.policy in quality.BASELINES
    vs = _target(res, "budget 32: brightness with recall", "/ the best baseline")
    assert vs.value == rec.ppl / base.ppl  # the same division (so below too)
    assert vs.target == "–" and vs.met is None  # the 0.97 target is at 128 and 256
    gap = _target(res, "budget 32: brightness with recall", "gap between the best baseline")
    assert gap.value == quality.gap_closed(res, rec)
    assert gap.met is None if gap.value is None else gap.met == (gap.value >= 0.5)
    with_recall = _target(res, "the first 512 tokens: brightness with recall")
    assert with_recall.value == res.long[3].ppl / res.long_reference.ppl
    c = res.control
    assert _target(res, "control run").value == c.ppl_compact / c.ppl_past


def test_resume_measures_nothing_again(capsys, tmp_path, one_thread, monkeypatch):
    """``--resume`` with the same ``--out`` and flags keeps every job its journal holds:
    nothing is measured again and the runs are the same; a journal without an oracle job
    measures it again, and the full cache that records its oracle."""
    out = tmp_path / "q"
    args = ["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "24",
            "--policies", "brightness,h2o", "--repairs", "none", "--windows", "1",
            "--tokens", "16", "--jobs", "1", "--batch", "1", "--json", "--out", str(out)]
    # --batch 1: a re-measured job's bits do not depend on which jobs share its batch
    measured, real = [], quality.run_jobs

    def spy(model, policy, ids, jobs, *a, **k):
        measured.extend(j.kind for j in jobs)
        return real(model, policy, ids, jobs, *a, **k)

    def results() -> dict:
        assert capsys.readouterr().out  # the --json object
        res = json.loads((out / "results.json").read_text())
        return {k: v for k, v in res.items() if k not in ("machine", "elapsed_s", "earlier_s")}

    def times() -> tuple[float, float]:
        res = json.loads((out / "results.json").read_text())
        return res["elapsed_s"], res["earlier_s"]

    monkeypatch.setattr(quality, "run_jobs", spy)
    assert main(args) == 0
    first = results()
    assert measured == ["reference", "grid", "grid", "grid", "oracle"] and times()[1] == 0.0

    def refuse(model, policy, ids, jobs, *a, **k):
        raise AssertionError(f"{[j.label for j in jobs]} measured again")

    monkeypatch.setattr(quality, "run_jobs", refuse)
    assert main([*args, "--resume"]) == 0
    assert results() == first
    elapsed, earlier = times()  # the first part's time (its last item's), counted in
    assert elapsed > earlier > 0

    lines = (out / "items.jsonl").read_text().splitlines()
    (out / "items.jsonl").write_text("".join(f"{x}\n" for x in lines[:-1]))  # the oracle's
    measured.clear()
    monkeypatch.setattr(quality, "run_jobs", spy)
    assert main([*args, "--resume"]) == 0
    again = results()
    assert measured == ["reference", "oracle"]
    assert again["runs"] == first["runs"]
    assert [r["ppl"] for r in (again["reference"], *again["oracle"])] == [
        r["ppl"] for r in (first["reference"], *first["oracle"])]


def test_the_recall_targets_read_the_recall_rows():
    """The default policy with recall against the best drop-only baseline (<= 0.97 at
    budgets 128 and 256) and against the oracle (>= half the gap, at every budget)."""
    def run(policy, ppl, budget, recall=False):
        return quality.Run(policy, "none", budget, recall, "compact", ppl, 8, "max_new_tokens",
                           0, 0, 0, 0, 0, 0.0, (quality.Window(0, 1, 8, ppl, 0),))

    res = SimpleNamespace(
        config=quality.QualityConfig(budgets=(128, 256, 512)), warmup=513,
        reference=run("none", 9.0, None), long=[], long_reference=None, control=None,
        oracle=[run("oracle", 9.0, 128), run("oracle", 9.9, 256)],
        runs=[run(p, ppl, b, rec) for b in (128, 256, 512) for p, ppl, rec in (
            ("h2o", 10.0, False), ("brightness", 10.5, False), ("brightness", 9.6, True))])
    rows = quality.targets(res)
    vs = [t for t in rows if "with recall" in t.what and "/ the best baseline" in t.what]
    # the values are the same float divisions as the targets' (so equal bits)
    assert [(t.value, t.target, t.met) for t in vs] == [
        (9.6 / 10.0, "<= 0.97", True), (9.6 / 10.0, "<= 0.97", True), (9.6 / 10.0, "–", None)]
    gaps = [t for t in rows if "with recall" in t.what and "gap" in t.what]
    # past the oracle (9.9) at 256; no oracle at 512
    assert [(t.value, t.met) for t in gaps] == [
        ((10.0 - 9.6) / (10.0 - 9.0), False), ((10.0 - 9.6) / (10.0 - 9.9), True), (None, None)]
    drop = [t for t in rows if t.what.startswith("budget 128: brightness (")]
    assert [t.value for t in drop] == [10.5 / 10.0]  # recall is not drop-only
    bound = [t for t in rows if "the hindsight oracle" in t.what]  # no oracle at 512
    assert [(t.value, t.target, t.met) for t in bound] == [
        (9.0 / 10.0, "–", None), (9.9 / 10.0, "–", None)]


def test_the_per_head_target_takes_the_best_cell_of_each_kind():
    """Per budget with both kinds: the best per-head cell (any allocation, repair, recall)
    over the best whole-token one (<= 1 at budgets 128 and 256), and the windows in which
    it is the lower; a budget with one kind only has no row, one past 256 no target."""
    def run(policy, budget, windows, repair="none", recall=False):
        ppl = sum(windows) / len(windows)  # stands for the windows' perplexity
        return quality.Run(policy, repair, budget, recall, "compact", ppl, 8, "max_new_tokens",
                           0, 0, 0, 0, 0, 0.0,
                           tuple(quality.Window(i, i + 1, 8, w, 0) for i, w in enumerate(windows)))

    res = SimpleNamespace(
        config=quality.QualityConfig(budgets=(128, 256, 512)), warmup=513,
        reference=run("none", None, (9.0, 9.0)), long=[], long_reference=None, control=None,
        oracle=[], runs=[
            run("brightness", 128, (10.0, 12.0)), run("brightness", 128, (9.0, 11.0), recall=True),
            run("h2o@head", 128, (9.5, 10.0), repair="fold"), run("tova@adaptive", 128, (9.0, 13.0)),
            run("brightness", 256, (8.0, 8.0), recall=True), run("brightness@head", 256, (7.0, 9.5)),
            run("brightness", 512, (7.0, 7.0)), run("h2o@pyramid", 512, (7.0, 7.0))])
    rows = [t for t in quality.targets(res) if "per-head" in t.what]
    assert [(t.what, t.value, t.target, t.met) for t in rows] == [
        ("budget 128: the best per-head cell, h2o@head (fold repair, 9.750) / the best "
         "whole-token cell, brightness with recall (none repair, 10.000); lower in 1 of 2 "
         "windows", 9.75 / 10.0, "<= 1.00", True),
        ("budget 256: the best per-head cell, brightness@head (none repair, 8.250) / the best "
         "whole-token cell, brightness with recall (none repair, 8.000); lower in 1 of 2 "
         "windows", 8.25 / 8.0, "<= 1.00", False),
        ("budget 512: the best per-head cell, h2o@pyramid (none repair, 7.000) / the best "
         "whole-token cell, brightness (none repair, 7.000); lower in 0 of 2 windows", 1.0, "–",
         None)]  # no target past 256
    assert quality.per_head("tova@adaptive") and not quality.per_head("h2o")


def test_windows_never_overlap_the_tune_slice():
    assert quality.slice_range(1000, "eval") == range(0, 500)
    assert quality.slice_range(1000, "tune") == range(500, 1000)
    assert quality.slice_range(1000, "tune", at=0.875) == range(875, 1000)
    assert quality.window_starts(range(0, 500), 100, 4) == (0, 133, 266, 400)
    assert quality.window_starts(range(875, 1000), 25, 5) == (875, 900, 925, 950, 975)
    assert quality.window_starts(range(0, 500), 100, 1) == (0,)
    for room, span, count in ((range(0, 500), 7, 9), (range(0, 500), 100, 5),
                              (range(875, 1000), 31, 4), (range(501, 1000), 3, 166)):
        starts = quality.window_starts(room, span, count)
        ends = [a + span for a in starts]
        assert starts[0] == room.start and ends[-1] == room.stop  # spread over the whole slice
        assert all(e <= a for e, a in zip(ends, starts[1:]))  # none overlapping
    with pytest.raises(UserError, match="window"):
        quality.window_starts(range(0, 500), 101, 5)


def test_every_grid_run_culls_before_it_scores():
    """The grid's runs share windows that open with more unscored steps than any budget."""
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24, 40), windows=3, tokens=20,
                                long=0)
    jobs = quality.plan(cfg, 512, range(100, 600))
    assert cfg.warmup == 41 and {j.kind for j in jobs} == {"reference", "grid", "oracle"}
    assert {(j.starts, j.skip, j.tokens) for j in jobs} == {((100, 319, 538), 41, 61)}
    assert [j.record for j in jobs].count(True) == 1 and jobs[0].kind == "reference"
    assert [j.cache.budget for j in jobs if j.cache.recall] == [24, 40]
    chosen = dataclasses.replace(cfg, policies=("h2o", "brightness"),
                                 recall=("h2o@head", "tova"))
    assert [(j.cache.scorer.name, j.cache.allocation.kind, j.cache.budget)
            for j in quality.plan(chosen, 512, range(100, 600)) if j.cache.recall] == [
        ("h2o", "head", 24), ("h2o", "head", 40), ("tova", "token", 24), ("tova", "token", 40)]
    assert quality.QualityConfig(budgets=(128,), tokens=600).fitted(512).tokens == 512 - 129


@pytest.mark.usefixtures("one_thread")
def test_recall_runs_a_policy_of_its_own_into_the_tables_and_plots(tmp_path, capsys):
    """``--recall`` may name a policy the grid does not run without recall: its row is in
    the report's tables, and its line in the plots."""
    out = tmp_path / "q"
    assert main(["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "24",
                 "--policies", "h2o", "--repairs", "none", "--recall", "tova@head",
                 "--windows", "1", "--tokens", "16", "--jobs", "1", "--batch", "2",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    report = (out / "report.md").read_text()
    assert "| tova@head with recall |" in report and "| h2o |" in report
    assert "| brightness with recall |" not in report  # the default's only where none given
    assert (out / "ppl_vs_budget.png").exists()


def test_recall_alone_or_all_runs_every_policy_with_recall(monkeypatch, capsys):
    """As in bench ruler: ``--recall`` alone, or ``all``, is every policy of the grid;
    ``none`` among the named policies is refused in one line, exit 2."""
    seen = []

    def stop(cfg, command, **_k):
        seen.append((cfg, command))
        raise UserError("stopped")

    monkeypatch.setattr(quality, "run", stop)
    base = ["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "24",
            "--policies", "h2o,tova@head"]
    for extra in (["--recall"], ["--recall", "all"], []):
        assert main(base + extra) == 2
    (alone, command), (every, _), (default, _) = seen
    assert alone.recall_policies == every.recall_policies == ("h2o", "tova@head")
    assert default.recall_policies == () and command.endswith(" --recall")
    capsys.readouterr()
    assert main(base + ["--recall", "h2o,none"]) == 2
    err = capsys.readouterr().err.strip()
    assert "non-culling policies ['none']" in err and "\n" not in err, err


@pytest.mark.usefixtures("one_thread")
def test_a_warm_up_is_streamed_but_not_scored(tiny_model, tiny_policy):
    ids = tiny_policy.encode(quality.default_text())[:60]
    cache = CacheParams(budget=24, scorer="h2o", sinks=2, recent=4)
    whole = quality.streaming_nll(tiny_model, tiny_policy, ids, cache)
    warm = quality.streaming_nll(tiny_model, tiny_policy, ids, cache, skip=30)
    assert warm.nll == whole.nll[30:] and warm.warm.steps == 30 and warm.totals.steps == 29
    assert warm.warm.culled == 30 - 24 and warm.totals.culled == 29
    assert warm.warm.culled + warm.totals.culled == whole.totals.culled


def test_named_texts(tmp_path, monkeypatch, capsys):
    """``--text jargon`` reads Debian's jargon-text file (here a stand-in); without the
    package, one line that names it."""
    fake = tmp_path / "jargon.txt.gz"
    fake.write_bytes(gzip.compress("The Jargon File\n\u2550\u2550 hack\n".encode()))
    monkeypatch.setattr(quality, "JARGON", fake)
    assert quality.read_text("jargon") == "The Jargon File\n\u2550\u2550 hack\n"
    assert quality.read_text("topics") == quality.default_text()
    monkeypatch.setattr(quality, "JARGON", tmp_path / "missing.txt.gz")
    assert main(["bench", "quality", "--model", "tiny-random", "--text", "jargon"]) == 2
    err = capsys.readouterr().err
    assert "apt-get install jargon-text" in err and err.count("\n") == 1, err
    names = {(t, s): quality.section(quality.QualityConfig(text=t, slice=s))
             for t in ("topics", "jargon", "/x/my text.txt") for s in ("eval", "tune")}
    assert names == {("topics", "eval"): "quality", ("topics", "tune"): "quality-tune",
                     ("jargon", "eval"): "quality-jargon",
                     ("jargon", "tune"): "quality-jargon-tune",
                     ("/x/my text.txt", "eval"): "quality-my_text",
                     ("/x/my text.txt", "tune"): "quality-my_text-tune"}


def test_pool_workers_give_the_inline_result(tiny_model, tiny_policy):
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), tokens=40)
    ids = tiny_policy.encode(quality.default_text())[:41]
    jobs = [quality.Job("grid", p, cfg.cache(24, p), 40, 40) for p in ("tova", "h2o")]
    inline = [s for (s,) in quality.execute(cfg, jobs, ids, Pool(jobs=1))]
    finished = {}  # each job's runs as it finishes (the journal's items)
    pooled = [s for (s,) in quality.execute(cfg, jobs, ids, Pool(jobs=2),
                                            finished=lambda i, runs: finished.update({i: runs}))]
    assert sorted(finished) == [0, 1] and all(finished[i] == [s] for i, s in enumerate(pooled))
    tol = nll_bound(tiny_model, 40)  # the session's threads inline, one in a worker
    for a, b in zip(inline, pooled):
        assert a.totals.culled == b.totals.culled
        assert max(abs(x - y) for x, y in zip(a.nll, b.nll)) <= tol


def test_batched_windows_give_what_one_at_a_time_gives(tiny_model, tiny_policy):
    """A cell's windows as a batch's rows (``--batch``): each window's NLLs as when it runs
    alone, to float rounding (a product of several rows adds in another order), with the
    same culls; the oracle cells too, each row with its window's oracle."""
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), tokens=40, batch=3)
    ids = tiny_policy.encode(quality.default_text())[:200]
    starts = (0, 50, 100)
    full = quality.Job("reference", "full", cfg.cache(None, "none"), 40, 40, starts, 5, True)
    jobs = [quality.Job("grid", p, cfg.cache(24, p, r), 40, 40, starts, 5)
            for p, r in (("h2o", "none"), ("tova", "merge"), ("brightness", "fold"))]
    jobs.append(quality.Job("oracle", "oracle", cfg.cache(24, quality.ORACLE), 40, 40, starts,
                            5))
    oracles = tuple(s.oracle for s in full.run(tiny_model, tiny_policy, ids))
    tol = nll_bound(tiny_model, 45)
    for job in [full] + jobs:
        o = oracles if job.kind == "oracle" else None
        alone = job.run(tiny_model, tiny_policy, ids, oracles=o)
        batched = job.run(tiny_model, tiny_policy, ids, oracles=o, batch=cfg.batch)
        _as_alone(alone, batched, len(starts), tol)
    assert sum(s.totals.culled for s in alone) > 0


def _as_alone(alone, batched, windows: int, tol: float) -> None:
    """Each window's batched run has its solo run's culls, merges, folds and stop, and its
    35 scored NLLs within ``tol``."""
    assert len(alone) == len(batched) == windows
    for a, b in zip(alone, batched):
        assert (a.totals.culled, a.totals.merged, a.totals.folded, a.stop_reason) == \
            (b.totals.culled, b.totals.merged, b.totals.folded, b.stop_reason)
        assert len(a.nll) == len(b.nll) == 35
        assert max(abs(x - y) for x, y in zip(a.nll, b.nll)) <= tol


def test_cells_step_together_as_one_batch_s_rows(tiny_model, tiny_policy):
    """Jobs of one length and warm-up run as one batch (``packs``: their windows together at
    most ``--batch`` rows, each row with its own cache): each window's NLLs as when its job
    runs alone, to float rounding, with the same culls; the oracle jobs wait for the full
    cache's recording and run as a pack of their own."""
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), tokens=40, batch=7)
    ids = tiny_policy.encode(quality.default_text())[:200]
    starts = (0, 50, 100)
    job = lambda kind, cache, record=False: quality.Job(  # noqa: E731
        kind, kind, cache, 40, 40, starts, 5, record)
    jobs = [job("reference", cfg.cache(None, "none"), record=True),
            job("grid", cfg.cache(24, "h2o")), job("grid", cfg.cache(24, "tova", "merge")),
            job("grid", cfg.cache(24, "brightness", "fold")),
            job("oracle", cfg.cache(24, quality.ORACLE)),
            job("oracle", cfg.cache(24, quality.ORACLE, "fold"))]
    odd = quality.Job("grid", "h2o, longer", cfg.cache(24, "h2o"), 44, 44, (0,), 5)
    assert quality.packs(jobs[:4] + [odd], 7) == [[0, 1], [2, 3], [4]]
    assert quality.packs(jobs[:4], 2) == [[0], [1], [2], [3]]  # 3 starts: a job alone
    assert quality._phases(cfg, jobs) == ([[0, 1], [2, 3]], [[4, 5]])
    # spread over 2 processes: at most half of a length's rows a pack, so both are busy
    assert quality.packs(jobs[:4], 32, workers=2) == [[0, 1], [2, 3]]
    assert quality.packs(jobs[:4], 32, workers=1) == [[0, 1, 2, 3]]
    long = [dataclasses.replace(odd, starts=(k,)) for k in range(5)]
    assert quality.packs(long, 32, workers=2) == [[0, 1, 2], [3, 4]]
    assert quality._phases(cfg, jobs, Pool(jobs=2)) == ([[0, 1], [2, 3]], [[4], [5]])
    together = quality.execute(cfg, jobs, ids, Pool(jobs=1))
    oracles = tuple(s.oracle for s in together[0])
    tol = nll_bound(tiny_model, 45)
    for j, batched in zip(jobs, together):
        alone = j.run(tiny_model, tiny_policy, ids,
                      oracles=oracles if j.kind == "oracle" else None)
        _as_alone(alone, batched, len(starts), tol)
    assert all(sum(s.totals.culled + s.totals.merged for s in runs) > 0 for runs in together[1:])
    assert sum(s.totals.merged for s in together[2]) > 0


def test_on_the_native_path_no_number_depends_on_the_batch(tiny_policy, one_thread):
    """Where the grid's stage 1 is native (``grid.load``), a window's NLLs and counts are
    the same bits whether it steps alone or with other cells' windows."""
    if native.slower([torch.device("cpu")], "float32") or native.unavailable():
        pytest.skip("the grid's stage 1 is plain here: "
                    f"{native.slower([torch.device('cpu')], 'float32') or native.unavailable()}")
    assert grid.load("tiny-random", "float32", "cpu").compiled == "native"
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), tokens=40)
    ids = tiny_policy.encode(quality.default_text())[:200]
    jobs = [quality.Job("grid", p, cfg.cache(24, p, r), 40, 40, (0, 50, 100), 5)
            for p, r in (("h2o", "none"), ("tova", "merge"), ("brightness", "fold"))]
    alone = quality.execute(dataclasses.replace(cfg, batch=1), jobs, ids, Pool(jobs=1))
    together = quality.execute(dataclasses.replace(cfg, batch=9), jobs, ids, Pool(jobs=1))
    facts = lambda runs: [[(s.nll, s.stop_reason, s.totals.culled, s.totals.merged,  # noqa: E731
                            s.totals.folded) for s in r] for r in runs]
    assert facts(alone) == facts(together)
    assert sum(s.totals.folded for s in alone[2]) > 0


def test_params_take_true_and_false_for_yes_no_fields():
    read = lambda text: options.cache_params(options.pairs(text, "--params"), text=True)  # noqa: E731
    assert read("prefill_scores=false").prefill.scores is False
    assert read("prefill_scores=On,decay=1").prefill.scores is True
    assert read("prefill-window=3,seeds=1:2:3:4").scorer.get("seeds") == (1.0, 2.0, 3.0, 4.0)
    with pytest.raises(UserError, match=r"prefill_scores: 'maybe' is not true or false"):
        read("prefill_scores=maybe")
    with pytest.raises(UserError, match=r"--params: unknown option 'bogus'"):
        read("bogus=1")


def test_bad_input_is_one_line(capsys):
    for argv, msg in ((["--budgets", "1,a"], "comma-separated integers"),
                      (["--params", "gain=x"], "gain: 'x' is not a finite number"),
                      (["--params", "budget=3"], "budget is the benchmark's own axis"),
                      (["--params", "recall_every=0"], "recall every must be >= 1"),
                      (["--policies", "none"], "non-culling"),
                      (["--budgets", "8"], "smaller than sinks + recent"),
                      (["--at", "0.7"], "--at places the tune slice"),
                      (["--windows", "0"], "windows must be >= 1"),
                      (["--slice", "tune", "--at", "0.3"], "--at places the tune slice")):
        assert main(["bench", "quality", "--model", "tiny-random", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert main(["bench", "speed", "--tokens", "9"]) == 2  # another benchmark's flag
    assert "unrecognized arguments: --tokens 9" in capsys.readouterr().err


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
