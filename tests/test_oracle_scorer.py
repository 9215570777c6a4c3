"""The hindsight oracle (bench quality only): a full-cache pass records the attention every
token receives, and the oracle culls the token the rest of the text attends to least."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from positronic_brain.bench import quality
from positronic_brain.bench.grid import Pool
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.scorers import make_scorer
from positronic_brain.scorers.attention import aggregate
from positronic_brain.scorers.oracle import ONLY_BENCH, AttentionRecorder, suffix_sums
from positronic_brain.stages.decide import protected
from positronic_brain.stages.generate import generate
from positronic_brain.types import CacheParams, SamplerParams, Segment, UserError
from tests.tolerance import nll_bound, step, sum_bound

GREEDY = SamplerParams(greedy=True)
FULL = CacheParams(scorer="none")


@pytest.fixture(scope="module")
def tiny_ids(tiny_policy):
    return tiny_policy.encode(quality.default_text())[:49]  # 48 scored tokens


@pytest.fixture(scope="module")
def tiny_reference(tiny_model, tiny_policy, tiny_ids):
    return quality.streaming_nll(tiny_model, tiny_policy, tiny_ids, FULL, record=48)


def test_suffix_sums_match_a_brute_force_sum():
    a = torch.rand(7, 7, generator=torch.Generator().manual_seed(0), device="cpu").tril(-1)
    s = suffix_sums(a)
    want = torch.tensor([[sum(float(a[t, j]) for t in range(q + 1, 7)) for j in range(7)]
                         for q in range(7)], device="cpu")
    # both sum in float64 (one by one here, by a cumulative sum less the row there), then
    # round once to float32: a float32 step apart at most, besides the float64 sums' own
    tol = step(torch.float32) * want + sum_bound(torch.float64, 7, float(a.sum(0).max()))
    assert s.dtype == torch.float32 and bool(((s - want).abs() <= tol).all())
    assert not s[-1].any()  # after the last query, nothing more is paid


@pytest.mark.usefixtures("one_thread")
def test_the_recorder_holds_each_steps_attention_by_text_index(tiny_model, tiny_policy, tiny_ids):
    """Row q is what stage 1 paid, at the step that ran the text's token q, to tokens 0..q-1."""
    rec = AttentionRecorder(20, "all-mean", tiny_ids)
    session = Session(tiny_model, tiny_policy, GREEDY, FULL, scorer=rec)
    session.prime([Segment((tiny_ids[0],), "user")], capacity=32)
    want = torch.zeros(20, 20, device="cpu")
    for q in range(24):  # past the recorded size: later rows are left out
        view = session.state.view()
        if q < 20:
            att = generate(tiny_model, view, GREEDY, session.generator, tiny_ids[q + 1]).attention
            want[q, :q] = aggregate(att, "all-mean")
        session.step(force=tiny_ids[q + 1])
    # the step's own stage 1 and aggregate over the same view: the same kernels, same order
    assert torch.equal(rec.rows, want)
    oracle = rec.oracle()
    assert torch.equal(oracle.token_ids, torch.tensor(tiny_ids[:20], device="cpu"))
    assert torch.equal(oracle.future, suffix_sums(want))


@pytest.mark.usefixtures("one_thread")
def test_the_oracle_with_room_for_everything_is_the_full_cache(tiny_model, tiny_policy, tiny_ids,
                                                              tiny_reference):
    oracle = tiny_reference.oracle
    assert oracle.future.shape == (48, 48)
    s = quality.streaming_nll(tiny_model, tiny_policy, tiny_ids,
                              CacheParams(scorer="oracle", budget=64), oracle=oracle)
    assert s.totals.culled == 0
    assert max(abs(a - b) for a, b in zip(s.nll, tiny_reference.nll)) <= nll_bound(tiny_model, 49)


@pytest.mark.usefixtures("one_thread")
def test_the_oracle_culls_the_token_the_future_needs_least(tiny_model, tiny_policy, tiny_ids,
                                                          tiny_reference):
    """Each step's cull is the unprotected live token with the least attention still to come
    in the full cache (ties: the earlier position)."""
    oracle, cache = tiny_reference.oracle, CacheParams(scorer="oracle", budget=16, sinks=2,
                                                        recent=4)
    session = Session(tiny_model, tiny_policy, GREEDY, cache, scorer=oracle)
    session.prime([Segment((tiny_ids[0],), "user")])
    culls = 0
    for q in range(48):
        view = session.state.view()
        free = ~protected(view, cache)
        expect = []
        if view.n + 1 > 16:  # uid = text index = position: the least future, then the earliest
            expect = [min(view.uid[free].tolist(), key=lambda u: (float(oracle.future[q, u]), u))]
        rec = session.step(force=tiny_ids[q + 1])
        assert list(rec.culled) == expect, f"step {q + 1}"
        culls += len(expect)
    assert culls == 48 - 16
    with pytest.raises(UserError, match="full-cache run's oracle"):
        quality.streaming_nll(tiny_model, tiny_policy, tiny_ids, cache)


def test_the_oracle_needs_the_bench_one_line(capsys):
    with pytest.raises(UserError, match=ONLY_BENCH):
        make_scorer(CacheParams(scorer="oracle", budget=32))
    assert main(["run", "--model", "tiny-random", "--prompt", "hello", "--budget", "32",
                 "--policy", "oracle"]) == 2
    err = capsys.readouterr().err
    assert ONLY_BENCH in err and err.count("\n") == 1, err
    assert main(["bench", "quality", "--model", "tiny-random", "--policies", "oracle"]) == 2
    assert "the oracle runs at every budget" in capsys.readouterr().err


def test_gap_closed():
    def run(policy, repair, ppl, budget=64):
        return quality.Run(policy, repair, budget, False, "compact", ppl, 8, "max_new_tokens",
                           0, 0, 0, 0, 0, 0.0, ())

    res = SimpleNamespace(runs=[run("brightness", "none", 11.0), run("h2o", "none", 12.0),
                                run("tova", "fold", 13.0), run("random", "none", 20.0),
                                run("h2o", "none", 9.0, 128)],
                          oracle=[run("oracle", "none", 10.0), run("oracle", "none", 9.5, 128)])
    base, oracle = quality.gap(res, 64)
    assert (base.policy, oracle.ppl) == ("h2o", 10.0)
    assert quality.gap_closed(res, res.runs[0]) == 0.5  # (12 - 11) / (12 - 10): exact
    assert quality.gap_closed(res, res.runs[3]) == -4.0
    assert quality.gap(res, 128) is None  # the oracle does not beat the best baseline there
    assert quality.gap_closed(res, res.runs[4]) is None


@pytest.mark.usefixtures("one_thread")
def test_pool_workers_run_the_oracle_after_the_reference(tiny_model, tiny_policy):
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), windows=2, tokens=16, long=0)
    ids = tiny_policy.encode(quality.default_text())[:200]
    jobs = [j for j in quality.plan(cfg, 512, range(0, 200)) if j.kind in ("reference", "oracle")
            or j.label == "h2o budget 24, none repair"]
    assert [j.kind for j in jobs] == ["reference", "grid", "oracle"] and jobs[0].record
    assert jobs[0].starts == (0, 158) and jobs[0].skip == 25
    inline = quality.execute(cfg, jobs[::-1], ids, Pool(jobs=1))  # the oracle listed first
    pooled = quality.execute(cfg, jobs[::-1], ids, Pool(jobs=2))
    tol = nll_bound(tiny_model, 200)  # in a worker and inline, one thread each
    for a, b in zip(sum(inline, []), sum(pooled, [])):
        assert a.totals.culled == b.totals.culled
        assert max(abs(x - y) for x, y in zip(a.nll, b.nll)) <= tol
    assert [s.totals.culled for s in inline[0]] == [16, 16]
    assert all(s.oracle is not None for s in inline[2])


@pytest.mark.usefixtures("one_thread")
def test_each_window_has_its_own_oracle(tiny_model, tiny_policy):
    """The full cache records one oracle per window, indexed from the window's first token;
    with room for everything the oracle run is that window's full cache, and a culled one
    runs only on its own window's oracle (the oracle checks every token against it)."""
    ids = tiny_policy.encode(quality.default_text())[:200]
    full = quality.Job("reference", "full", FULL, 40, 40, (0, 150), 8, record=True)
    ref = full.run(tiny_model, tiny_policy, ids)
    oracles = tuple(s.oracle for s in ref)
    assert [torch.equal(o.token_ids, torch.tensor(ids[a:a + 40], device="cpu")) for o, a in
            zip(oracles, (0, 150))] == [True, True]
    roomy = dataclasses.replace(full, kind="oracle", record=False,
                                cache=CacheParams(scorer="oracle", budget=64))
    for r, s in zip(ref, roomy.run(tiny_model, tiny_policy, ids, oracles=oracles)):
        assert s.totals.culled == s.warm.culled == 0 and len(s.nll) == 32
        assert max(abs(a - b) for a, b in zip(s.nll, r.nll)) <= nll_bound(tiny_model, 48)
    tight = dataclasses.replace(roomy, cache=CacheParams(scorer="oracle", budget=16, sinks=2,
                                                         recent=4))
    assert [s.totals.culled for s in tight.run(tiny_model, tiny_policy, ids,
                                               oracles=oracles)] == [40 - 16] * 2
    with pytest.raises(AssertionError, match="not the text's token"):
        tight.run(tiny_model, tiny_policy, ids, oracles=oracles[::-1])


@pytest.mark.usefixtures("one_thread")
def test_the_oracle_beats_random_on_the_real_model(real_model, real_policy):
    ids = real_policy.encode(quality.default_text())[:97]
    ref = quality.streaming_nll(real_model, real_policy, ids, FULL, record=96)
    cut = {p: quality.streaming_nll(real_model, real_policy, ids,
                                    CacheParams(scorer=p, budget=32, sinks=4, recent=8),
                                    oracle=ref.oracle if p == "oracle" else None)
           for p in ("oracle", "random")}
    oracle, rand = cut["oracle"], cut["random"]
    assert oracle.totals.culled == rand.totals.culled == 96 - 32
    # (here the oracle even edges out the full cache: 19.23 against 19.34)
    assert oracle.ppl < rand.ppl, (ref.ppl, oracle.ppl, rand.ppl)
