"""`bench ruler`: the three protocols compress the context to the cell's budget, the full
cache answers hand-checked RULER samples on SmolLM2, a miss's capture replays, and the
CLI's rows, data files and one-line errors."""
import json
from dataclasses import replace

import pytest
import torch

from positronic_brain.bench import ruler, ruler_tasks
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.replay import replay
from positronic_brain.types import CacheParams, SamplerParams, Segment, UserError


def _cfg(**kw) -> ruler.RulerConfig:
    base = {"tasks": ("niah_single_1",), "lengths": (1024,), "samples": 1, "new_tokens": 12,
            "policies": ("h2o",), "ratios": (0.125,), "protocols": ruler.PROTOCOLS, "chunk": 32}
    return ruler.RulerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def needle(real_policy):
    return ruler_tasks.generate(real_policy, "niah_single_1", 1024, 1, 0)[0]


@pytest.fixture(scope="module")
def short(real_policy):
    """A 512-token sample, for the tests whose cells' programs do not depend on the length."""
    return ruler_tasks.generate(real_policy, "niah_single_1", 512, 1, 0)[0]


def test_every_protocol_compresses_the_context_to_the_budget(real_model, real_policy, needle):
    """compress, online and chunked: at the question the cache holds the budget (7/8 of the
    context here), whatever the protocol; the question and the answer then go uncompressed."""
    cfg = _cfg()
    grid = ruler.cells(cfg)
    assert [c.protocol for c in grid] == list(ruler.PROTOCOLS)
    row = ruler.run_sample(real_model, real_policy, cfg, needle, grid)
    prompt = ruler.Prompt.of(real_policy, needle)
    assert row.n_context == prompt.n_context < needle.n_tokens
    assert row.budgets[0] is None and row.kept[0] is None
    for b, k in zip(row.budgets[1:], row.kept[1:]):
        assert b == round(prompt.n_context * 0.875) and k == b  # culled to it, the question next
    assert len(row.outputs) == len(row.scores) == len(row.held) == 1 + len(grid)
    # the needle's number, spelt by context tokens, is held or not at the question
    assert real_policy.decode([prompt.ids[i] for i in prompt.answer]).strip() == needle.answers[0]
    assert row.held[0] is None and all(0 <= h <= 1 for h in row.held[1:])


def test_query_aware_compresses_the_question_with_the_context(real_model, real_policy,
                                                             needle):
    """``query_aware`` (kvpress's): the question goes through the protocol with the context,
    its tokens part of what the ratio counts and the budget keeps; only the answer prefix
    follows uncompressed."""
    cfg = _cfg(query_aware=True, protocols=("compress", "online"))
    plain, aware = (ruler.Prompt.of(real_policy, needle, query_aware=q) for q in (False, True))
    assert plain.ids == aware.ids and aware.answer == plain.answer
    assert real_policy.decode(aware.ids[plain.n_context:aware.n_context]).strip() == \
        needle.question.strip()
    assert real_policy.decode(aware.ids[aware.n_context:]).strip() == needle.answer_prefix.strip()
    row = ruler.run_sample(real_model, real_policy, cfg, needle, ruler.cells(cfg))
    assert row.n_context == aware.n_context
    assert row.budgets[1:] == row.kept[1:] == [round(aware.n_context * 0.875)] * 2
    assert row.scores[0] == 1.0  # the full cache still finds the needle


def test_a_sample_s_answers_as_a_batch_s_rows_are_its_answers_one_at_a_time(
        real_model, real_policy, short):
    """``--batch``: the full cache and the cells answer 3 rows at a time (the later ones
    taking the places of those that finish), each row its own protocol's program (compress
    from the shared prime, online primed and streamed through its budget, recall and per
    head among them): the same answers, tokens kept and answer tokens held as one at a time
    (greedy; no tie that rounding tips here, as the comparison checks)."""
    cfg = _cfg(lengths=(512,), new_tokens=6, policies=("h2o", "tova@head"), ratios=(0.06,),
               recall=("all",), protocols=("compress", "online"))
    grid = ruler.cells(cfg)
    assert len(grid) == 8 and any(c.recall and "@" in c.policy for c in grid)
    alone = ruler.run_sample(real_model, real_policy, cfg, short, grid)
    rows = ruler.run_sample(real_model, real_policy, replace(cfg, batch=3), short, grid)
    assert rows.outputs == alone.outputs and rows.scores == alone.scores
    assert rows.kept == alone.kept and rows.held == alone.held
    assert rows.held_at_answer == alone.held_at_answer
    assert rows.budgets == alone.budgets and len(rows.seconds) == 9


def test_with_recall_the_question_s_steps_bring_the_needle_back(real_model, real_policy,
                                                                needle):
    """A recall cell steps the question a token a step (the others extend it at once), so
    its queries can bring back what they read: compressed to a quarter or an eighth, h2o
    has culled the whole needle (a 7-digit number, at 16% of the context) by the question
    and misses; with recall the question's steps bring every digit back before the answer
    starts, and the answer is right. At an eighth the hot cache (108 tokens) is smaller
    than the question and answer's room (164): the recent window covers only what came
    since the question began, so a swap has context tokens to send cold."""
    cfg = _cfg(policies=("h2o",), ratios=(0.75, 0.875), protocols=("compress",), recall=("all",),
               new_tokens=None)  # the task's own 128: room for 164 tokens after the context
    row = ruler.run_sample(real_model, real_policy, cfg, needle, ruler.cells(cfg))
    assert row.budgets[1:] == [215, 108] * 2
    assert row.scores == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert row.held[1:] == [0.0] * 4  # culled by the question, with recall or without
    assert row.held_at_answer[1:] == [0.0, 0.0, 1.0, 1.0]
    assert row.outputs[3] == row.outputs[4] == row.outputs[0]


@pytest.mark.parametrize("policy", ["h2o@pyramid", "h2o@head"])
def test_a_per_head_recall_cell_culls_nothing_while_the_question_steps(real_model, real_policy,
                                                                       needle, policy):
    """Every (layer, KV head) grows by the one token a step appends from the question on:
    a pyramid cell's budgets are shares above the protected tokens, so its recent window
    does not move (a moving one moved the budgets and culled the context); a head cell's
    budgets do not read it, so its window moves and swaps keep each head's count."""
    cfg = _cfg(policies=(policy,), ratios=(0.875,), protocols=("compress",), recall=("all",),
               new_tokens=None)
    cell = ruler.cells(cfg)[1]
    prompt = ruler.Prompt.of(real_policy, needle)
    program = ruler.cell_steps(real_model, real_policy, cell, cfg, prompt,
                               ruler.cell_cache(cfg, cell, prompt))
    counts, recalled, want = [], 0, next(program)
    with pytest.raises(StopIteration):
        while True:
            session, force = want
            rec = session.step(force)
            counts.append(session.state.heads.n.clone())
            recalled += len(rec.recalled) if len(counts) > 1 else 0
            want = program.send(rec)
    assert len(counts) > 40 and recalled > 0
    assert all(torch.equal(b, a + 1) for a, b in zip(counts, counts[1:]))


def test_the_answer_held_is_the_share_of_its_spelling_the_cache_holds(real_model, real_policy):
    """Hand-worked: "7 4 seven 74 and 74 too" spells 74 twice (SmolLM2's digits are a token
    each, so not "7 4"); a cache that culled one of those 4 tokens holds 3 of them."""
    ids = real_policy.encode("7 4 seven 74 and 74 too")  # the last one pending, not cached
    answer = ruler.spelling(real_policy, ids, ("74",))
    assert [real_policy.decode([ids[i]]) for i in answer] == ["7", "4"] * 2
    assert answer[0] > 3 and ruler.spelling(real_policy, ids, ("75",)) == ()
    s = Session(real_model, real_policy, SamplerParams(greedy=True), CacheParams())
    s.prime([Segment(tuple(ids), "user")])
    assert ruler.answer_held(s.state, answer) == 1.0 and ruler.answer_held(s.state, ()) is None
    m = s.state.ledger
    m.col("uid")[4:m.n] += 1  # as if a merge had taken uid 4: each later token's uid one on
    m.merged, m.next_uid = {4: (2, 3)}, m.next_uid + 1
    assert ruler.answer_held(s.state, answer) == 1.0
    m.col("uid")[answer[0]] = 10 ** 6  # as if culled (the uid no longer there)
    assert ruler.answer_held(s.state, answer) == 3 / 4


def test_per_head_cells_keep_the_budget_in_each_head(real_model, real_policy, short):
    """A per-head policy (``NAME@ALLOCATION``) compresses the context at the same K/V memory:
    at the question its (layer, KV head)s hold the budget on average (``head``: each
    exactly), with recall too (each head's own cold store)."""
    cfg = _cfg(lengths=(512,), policies=("h2o@head", "tova@adaptive"), ratios=(0.03,),
               recall=("all",), protocols=("compress", "online"))
    grid = ruler.cells(cfg)
    assert [(c.protocol, c.method) for c in grid] == [
        (p, m + r) for p in ("compress", "online") for r in ("", "+recall")
        for m in ("h2o@head", "tova@adaptive")]
    row = ruler.run_sample(real_model, real_policy, cfg, short, grid)
    prompt = ruler.Prompt.of(real_policy, short)
    budget = prompt.budget(ruler.Size(0.03), ruler.cell_cache(cfg, grid[0], prompt))
    assert row.budgets[1:] == [budget] * 8 and row.kept[1:] == [budget] * 8
    assert all(0 < h <= 1 for h in row.held[1:])  # 3% culled: most of the needle held
    assert all(0 <= s <= 1 for s in row.scores)


def test_a_miss_is_captured_and_replays(real_model, real_policy, short, tmp_path, monkeypatch):
    """Every cell scored below 1 answers again on a tape (here each, by a scorer of answers
    that finds none right): the capture replays bit for bit, budget change included."""
    monkeypatch.setattr(ruler_tasks, "score", lambda task, text, answers: 0.0)
    cfg = _cfg(lengths=(512,), protocols=("compress",), recall=("all",),
               capture_misses=str(tmp_path))
    grid = ruler.cells(cfg)
    assert [c.method for c in grid] == ["h2o", "h2o+recall"]
    ruler.run_sample(real_model, real_policy, cfg, short, grid[1:])
    captured = sorted(tmp_path.iterdir())
    assert [p.name for p in captured] == ["niah_single_1-512-0-compress-h2o+recall-0.125"]
    report = replay(captured[0], model=real_model)
    assert report.ok, report.mismatches[:3]


def test_the_full_cache_answers_hand_checked_samples(real_model, real_policy):
    """SmolLM2 with the full cache finds the needle of RULER's niah_single_1 at 1k tokens
    (noise haystack, a word key, a 7-digit number): the ceiling the cells are measured
    against."""
    cfg = ruler.RulerConfig(tasks=("niah_single_1",), lengths=(1024,), samples=3, policies=(),
                            new_tokens=12)
    for sample in ruler_tasks.generate(real_policy, "niah_single_1", 1024, 3, 0):
        row = ruler.run_sample(real_model, real_policy, cfg, sample, [])
        assert row.scores == [1.0], (sample.answers, row.outputs)
        assert sample.answers[0] in row.outputs[0]


def test_json_rows_have_the_leaderboard_columns(real_model, capsys):
    code = main(["bench", "ruler", "--tasks", "niah_single_1", "--lengths", "1024",
                 "--samples", "1", "--policies", "h2o,streaming", "--ratios", "0.5",
                 "--budgets", "200", "--new-tokens", "8", "--protocols", "compress",
                 "--jobs", "1", "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["rows"]
    assert len(rows) == 1 + 2 * 2  # the full cache + a cell per policy and size
    assert [r["size"] for r in rows] == [None] + ["ratio 0.5", "budget 200"] * 2
    n_context = res["samples"][0]["n_context"]
    for r in rows[2::2]:  # a budget in tokens: its ratio the sample's
        assert r["budget"] == 200 and r["compression_ratio"] == 1 - 200 / n_context
        assert r["kept_fraction"] == 200 / n_context
    for r in rows:
        assert {"dataset", "data_dir", "model", "method", "compression_ratio", "score",
                "protocol", "budget", "recall", "full_cache_score", "score_vs_full", "seconds",
                "samples", "answer_held", "misses", "misses_culled", "query_aware"} <= set(r)
        assert r["dataset"] == "ruler" and r["data_dir"] == "1024" and 0 <= r["score"] <= 100
    assert [r["protocol"] for r in rows] == [None] + ["compress"] * 4
    assert rows[0]["method"] == "full cache" and rows[0]["score"] == 100
    assert "bench ruler" in res["command"] and res["targets"] is not None


def test_write_data_writes_the_samples_and_measures_nothing(real_model, capsys, tmp_path):
    code = main(["bench", "ruler", "--tasks", "niah_single_1,fwe",
                 "--lengths", "1024", "--samples", "2", "--write-data", str(tmp_path / "data")])
    assert code == 0
    files = sorted((tmp_path / "data").iterdir())
    assert [f.name for f in files] == ["fwe-1024.jsonl", "niah_single_1-1024.jsonl"]
    lines = [json.loads(x) for x in files[1].read_text().splitlines()]
    assert len(lines) == 2 and {"context", "question", "answer_prefix", "answers", "task",
                                "length", "seed"} <= set(lines[0])
    assert "Samples written" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "niah_single_9"], "--tasks: unknown"),
    (["--protocols", "sometimes"], "--protocols: unknown"),
    (["--ratios", "1.5"], "--ratios takes comma-separated fractions"),
    (["--tasks", "qa_1"], "need --qa-file"),
    (["--samples", "0"], "samples must be >= 1"),
    (["--batch", "0"], "batch must be >= 1, got 0"),
    (["--policies", "bogus"], "bogus"),
    (["--trials", "3"], "unrecognized arguments: --trials"),
    (["--lengths", "1024,1024"], "--lengths repeats a value"),
    (["--params", "allocation=turns"], "NAME@ALLOCATION"),
    (["--budgets", "0"], "--budgets takes comma-separated token counts >= 1"),
    (["--policies", "h2o@turns"], "--allocation turns do not apply"),
    (["--recall", "bogus"], "bogus"),
    (["--recall", "h2o,none"], "non-culling policies ['none']"),
    (["--recall", "h2o,all"], "--recall takes comma-separated policies, or all"),
    (["--recall", "h2o,h2o"], "--recall repeats a value"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["bench", "ruler", "--model", "tiny-random", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_recall_names_the_policies_that_run_with_it(monkeypatch):
    """``--recall P,...`` adds recall cells for those policies only (one not among
    ``--policies`` runs only with recall); the flag alone, or ``all``, for every policy;
    the command written back reproduces the cells."""
    from positronic_brain.bench import flags
    seen = []

    def stop(cfg, command, **_k):
        seen.append((cfg, command))
        raise UserError("stopped")

    monkeypatch.setattr(ruler, "run", stop)
    base = ["bench", "ruler", "--model", "tiny-random", "--quick", "--policies", "h2o,tova"]
    for extra in (["--recall", "tova,brightness@head"], ["--recall"], ["--recall", "all"]):
        assert main(base + extra) == 2
    (named, command), (bare, alone), (every, _) = seen
    methods = [c.method for c in ruler.cells(named)]
    assert methods == ["h2o", "tova", "tova+recall", "brightness@head+recall"]
    assert [c.method for c in ruler.cells(bare)] == [c.method for c in ruler.cells(every)] \
        == ["h2o", "tova", "h2o+recall", "tova+recall"]
    assert command.endswith("--recall tova,brightness@head") and alone.endswith(" --recall")
    assert flags.recall_policies(True) == bare.recall == (flags.EVERY,)


def test_the_misses_table_tells_a_cull_from_a_misreading():
    """Hand-worked: of four samples a cell answered, one right (its answer wholly held),
    one wrong with half its answer's tokens culled, one wrong with all of them held, one
    wrong with half culled at the question but all back when the answer started (recall's
    doing): three misses, one a cull's; held 3 / 4 at the question and 3.5 / 4 at the
    answer on average. Rows without the measures say "–"; a row without the answer's
    reads the question's in its place."""
    cfg = _cfg(protocols=("compress",))
    res = ruler.RulerResult(benchmark="ruler", command="", model="m", quick=False,
                            machine=None, config=cfg, dtype="float32", max_positions=1,
                            base={})
    res.samples = [ruler.SampleRow("niah_single_1", 1024, i, 10, 8, [], ["1"], ["1", o],
                                   [1.0, score], [None, 4], [None, 4], [0.0, 0.0],
                                   [None, held], [None, at_answer])
                   for i, (o, score, held, at_answer) in enumerate((
                       ("1", 1.0, 1.0, 1.0), ("2", 0.0, 0.5, 0.5), ("3", 0.0, 1.0, 1.0),
                       ("4", 0.0, 0.5, 1.0)))]
    res.rows = ruler.rows(res, ruler.cells(cfg))
    cell = res.rows[1]
    assert (cell.misses, cell.misses_culled, cell.answer_held, cell.answer_held_at_answer) \
        == (3, 1, 3 / 4, 3.5 / 4)
    table = ruler.misses_table(cfg, res.rows[1:], ["h2o"])
    assert table.rows == (("compress", "h2o", "ratio 0.125", "3", "1", "0.750", "0.875"),)
    for s in res.samples:
        s.held_at_answer.clear()  # a run from before that measure: the question's
    old = ruler.rows(res, ruler.cells(cfg))[1]
    assert (old.misses_culled, old.answer_held_at_answer) == (2, 3 / 4)
    for s in res.samples:
        s.held.clear()  # a run from before either
    old = ruler.rows(res, ruler.cells(cfg))[1]
    assert (old.misses, old.misses_culled, old.answer_held) == (3, None, None)
    assert ruler.misses_table(cfg, [old], ["h2o"]).rows[0][4:] == ("–",) * 3


def test_the_targets_read_the_default_policy_and_with_recall_its_recall_cells():
    """Hand-worked: one sample the full cache answers; brightness misses where h2o answers,
    and with recall the other way round. The targets hold brightness to the full cache and
    to h2o, and brightness+recall to the full cache and to h2o+recall (like against
    like)."""
    cfg = _cfg(policies=("brightness", "h2o"), ratios=(0.75,), protocols=("compress",),
               recall=("all",))
    grid = ruler.cells(cfg)
    scores = {"brightness": 0.0, "h2o": 1.0, "brightness+recall": 1.0, "h2o+recall": 0.0}
    res = ruler.RulerResult(benchmark="ruler", command="", model="m", quick=False,
                            machine=None, config=cfg, dtype="float32", max_positions=1,
                            base={})
    res.samples = [ruler.SampleRow("niah_single_1", 1024, 0, 10, 8, [], ["1"], ["1"] * 5,
                                   [1.0, *(scores[c.method] for c in grid)], [None] + [2] * 4,
                                   [None] + [2] * 4, [0.0] * 5)]
    res.rows = ruler.rows(res, grid)
    got = [(t.what, t.value, t.met) for t in ruler.targets(res)]
    assert got == [
        ("compress, ratio 0.75: brightness / the full cache, the worst of 1 task-lengths "
         "(niah_single_1, 1024)", 0.0, False),
        ("compress, ratio 0.75: brightness's average - the best other's (h2o)", -100.0, False),
        ("compress, ratio 0.75: brightness+recall / the full cache, the worst of 1 "
         "task-lengths (niah_single_1, 1024)", 1.0, True),
        ("compress, ratio 0.75: brightness+recall's average - the best other's (h2o+recall)",
         100.0, True)]


def test_the_full_cache_alone_reports_its_ceiling_and_no_empty_table():
    """``--policies none``: the report holds the ceiling, not a target table, protocol
    tables, misses or budgets without a row."""
    cfg = _cfg(policies=(), ratios=())
    res = ruler.RulerResult(benchmark="ruler", command="", model="m", quick=False,
                            machine=None, config=cfg, dtype="float32", max_positions=1,
                            base={})
    res.samples = [ruler.SampleRow("niah_single_1", 1024, 0, 10, 8, [], ["1"], ["1"], [1.0],
                                   [None], [None], [0.0])]
    res.rows = ruler.rows(res, ruler.cells(cfg))
    res.targets = ruler.targets(res)
    (table,) = ruler.tables(res)
    assert table.title.startswith("The full cache's score") and \
        table.rows == (("niah_single_1", "100"),)


def test_cells_need_a_size():
    with pytest.raises(UserError, match="the cells need --ratios or --budgets"):
        _cfg(ratios=())
    assert [c.size.label for c in ruler.cells(_cfg(ratios=(), budgets=(64, 8)))] == \
        ["budget 64", "budget 8"] * len(ruler.PROTOCOLS)
