"""`bench passkey`: the prompt, the seeded trials, a hand-checked answer from SmolLM2, the
copied prime, and the CLI's JSON, report and one-line errors."""
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest

from positronic_brain.bench import passkey
from positronic_brain.bench.grid import Pool
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.scorers import STREAMING
from positronic_brain.types import SamplerParams, UserError

QUESTION_LAST = "\nWhat is the pass key? The pass key is"


@pytest.mark.parametrize("depth", [0.1, 0.25, 0.5, 0.77, 0.9])
def test_the_key_sits_at_its_depth_and_the_question_comes_last(depth):
    text = passkey.prompt_text(48213, depth, 200)
    assert text.startswith(passkey.INTRO + "\n") and text.endswith(QUESTION_LAST)
    assert text.count("What is the pass key?") == 1 and text.count("48213") == 2
    key = "The pass key is 48213. Remember it. 48213 is the pass key."
    before, after = text.split(key)
    filler = re.compile("|".join(re.escape(s) for s in passkey.FILLER))
    n_before, n_after = len(filler.findall(before)), len(filler.findall(after))
    assert n_before + n_after == 200 and n_before == round(depth * 200)
    # the filler cycles in order on both sides of the key
    assert filler.findall(before + after) == [passkey.FILLER[i % 5] for i in range(200)]
    # in characters too, the key sits at its depth of the filler
    start, end = len(passkey.INTRO) + 1, len(text) - len(QUESTION_LAST)
    assert abs((text.index(key) - start) / (end - start - len(key)) - depth) < 0.01


def test_trials_are_seeded_and_the_same_for_any_count():
    lengths = (1024, 2048, 3072, 4096)
    a = passkey.trials(0, 50, lengths)
    assert a == passkey.trials(0, 50, lengths) and a[:8] == passkey.trials(0, 8, lengths)
    assert [t.key for t in a] != [t.key for t in passkey.trials(1, 50, lengths)]
    assert [t.index for t in a] == list(range(50))
    assert all(10000 <= t.key <= 99999 and 0.1 <= t.depth <= 0.9 for t in a)
    assert [t.length for t in a[:8]] == list(lengths) * 2
    assert len({t.key for t in a}) > 45 and len({round(t.depth, 1) for t in a}) >= 8


def test_the_prompt_fits_its_length_in_whole_sentences(tiny_policy):
    for framing in passkey.FRAMINGS:
        n, segs = passkey.fit(tiny_policy, 12345, 0.5, 480, framing)
        tokens = passkey.n_tokens(segs)
        more = passkey.n_tokens(passkey.segments(tiny_policy, 12345, 0.5, n + 1, framing))
        assert tokens <= 480 < more
        assert tiny_policy.decode([i for s in segs for i in s.ids]).endswith("The pass key is")
    with pytest.raises(UserError, match="cannot hold the pass-key task"):
        passkey.fit(tiny_policy, 12345, 0.5, 40, "raw")


def test_variants_are_one_more_axis():
    cfg = passkey.PasskeyConfig(budgets=(128, 256), policies=("h2o", "tova"),
                                variants=({}, {"repair": "fold"}))
    grid = passkey.cells(cfg)
    assert len(grid) == 8 and grid[4].cache.repair_name == "fold" and grid[0].cache.repair is None
    assert [passkey.variant_label(c.variant) for c in grid] == ["plain"] * 4 + ["repair=fold"] * 4
    with pytest.raises(UserError, match="unknown cache option"):
        passkey.PasskeyConfig(variants=({"no_such_field": True},))
    with pytest.raises(UserError, match="other than budget and policy"):
        passkey.PasskeyConfig(variants=({"budget": 4},))
    with pytest.raises(UserError, match="fixed by the shared prime"):
        passkey.PasskeyConfig(variants=({"prefill_scores": True, "prefill_window": 8},))


def test_the_target_waits_for_a_recall_variant():
    ref = passkey.CellRow("none", None, {}, "plain", 40, 50, 0.8)
    row = lambda p, variant, correct: passkey.CellRow(  # noqa: E731
        p, 128, variant, passkey.variant_label(variant), correct, 50, correct / 50, correct / 40)
    res = SimpleNamespace(reference=ref,
                          runs=[row("h2o", {}, 20), row("h2o", {"recall": True}, 39)])
    recall, drop = passkey.targets(res)
    assert "with recall" in recall.what and recall.met is True
    assert recall.value == pytest.approx(39 / 40)
    assert "drop only" in drop.what and drop.met is False
    res.runs = res.runs[:1]
    waiting = passkey.targets(res)[0]
    assert "not measured" in waiting.what and waiting.met is None


def test_a_copied_prime_answers_as_a_fresh_one(tiny_model, tiny_policy, one_thread):
    """Each cell starts from a deep copy of the trial's prime: the same tokens
    and the same culls as a session primed for that cell alone."""
    cfg = passkey.PasskeyConfig(model="tiny-random", lengths=(400,), budgets=(64,),
                                policies=("h2o", "random"))
    trial = passkey.trials(0, 1, cfg.lengths)[0]
    grid = passkey.cells(cfg)
    row = passkey.run_trial(tiny_model, tiny_policy, cfg, trial, grid)
    _, segs = passkey.fit(tiny_policy, trial.key, trial.depth, trial.length, cfg.framing)
    for cell, text in zip(grid, row.answers[1:]):
        fresh = Session(tiny_model, tiny_policy, SamplerParams(greedy=True), cell.cache)
        fresh.prime(segs)
        ids = [r.token_id for r in fresh.stream(cfg.max_new_tokens)]
        assert text == tiny_policy.decode(ids) and fresh.state.arena.n == 64
    # plain, recall, prefill scores flipped
    assert row.tokens <= 400 and len(row.hits) == 1 + len(grid) == 7


def test_a_trial_s_answers_as_a_batch_s_rows_are_its_answers_one_at_a_time(
        tiny_model, tiny_policy, one_thread):
    """``--batch``: the full cache and the cells answer together, 3 rows at a time (the
    later cells taking the places of those that finish): the same answers (greedy; the
    tiny model's logits hold no tie that rounding tips, checked by the first comparison)."""
    cfg = passkey.PasskeyConfig(model="tiny-random", lengths=(400,), budgets=(64,),
                                policies=("h2o", "tova"))
    trial, grid = passkey.trials(1, 1, cfg.lengths)[0], passkey.cells(cfg)
    alone = passkey.run_trial(tiny_model, tiny_policy, cfg, trial, grid)
    rows = passkey.run_trial(tiny_model, tiny_policy, dataclasses.replace(cfg, batch=3),
                             trial, grid)
    assert len(rows.answers) == 1 + len(grid) == 7
    assert rows.answers == alone.answers and rows.hits == alone.hits


@pytest.mark.parametrize("policies, total", [(("brightness",), False), (("h2o",), True)])
def test_the_trial_s_prime_gathers_the_total_only_for_a_cell_that_reads_it(
        tiny_model, tiny_policy, one_thread, monkeypatch, policies, total):
    """Brightness seeds from the window alone; H2O with prefill scores (its flipped
    variant) from the total too: the shared prime gathers what the cells' seeds read."""
    cfg = passkey.PasskeyConfig(model="tiny-random", lengths=(400,), budgets=(64,),
                                policies=policies)
    gathered, prime = [], Session.prime
    monkeypatch.setattr(Session, "prime", lambda self, *a, **kw: gathered.append(
        prime(self, *a, **kw)) or gathered[-1])
    trial, grid = passkey.trials(0, 1, cfg.lengths)[0], passkey.cells(cfg)
    row = passkey.run_trial(tiny_model, tiny_policy, cfg, trial, grid)
    (stats,) = gathered
    assert stats is not None and (stats.total is not None) == total
    _, segs = passkey.fit(tiny_policy, trial.key, trial.depth, trial.length, cfg.framing)
    for cell, text in zip(grid, row.answers[1:]):  # each cell as if primed alone
        fresh = Session(tiny_model, tiny_policy, SamplerParams(greedy=True), cell.cache)
        fresh.prime(segs)
        assert text == tiny_policy.decode([r.token_id for r in fresh.stream(cfg.max_new_tokens)])


@pytest.mark.usefixtures("one_thread")
def test_smollm2_finds_the_key_in_a_1k_prompt(real_model, real_policy):
    """Hand-checked: trial 0 (key 46398 at 49% of ~1k tokens of filler) is answered
    " 46398." with the full cache, and TOVA at budget 128 answers it too, without recall
    and with it (and with prefill scores flipped, which TOVA does not take)."""
    cfg = passkey.PasskeyConfig(lengths=(1024,), budgets=(128,), policies=("tova",))
    trial = passkey.trials(0, 1, cfg.lengths)[0]
    assert (trial.key, trial.depth) == (46398, 0.493)
    row = passkey.run_trial(real_model, real_policy, cfg, trial, passkey.cells(cfg))
    assert 1000 < row.tokens <= 1024
    assert row.answers[0].startswith(" 46398.") and row.hits == [True] * 4


def test_quick_json_report_and_section(capsys, tmp_path, one_thread):
    out, doc = tmp_path / "pk", tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    code = main(["bench", "passkey", "--quick", "--model", "tiny-random", "--json",
                 "--out", str(out), "--report", str(doc)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(stdout)
    assert res == json.loads((out / "results.json").read_text())
    assert res["benchmark"] == "passkey" and res["quick"] is True
    cfg = res["config"]
    assert cfg["trials"] == 8 and cfg["budgets"] == [128]
    assert cfg["variants"] == [{}, {"recall": True}, {"prefill_scores": "flipped"}]
    assert cfg["lengths"] == [512 - 8 - 1]  # 1024 does not fit the tiny model's positions
    cells = 1 + 3 * len(STREAMING)  # the full cache, each policy in each variant
    assert len(res["trials"]) == 8 and all(len(t["hits"]) == cells for t in res["trials"])
    ref = res["reference"]
    assert ref["budget"] is None and ref["trials"] == 8 and 0 <= ref["accuracy"] <= 1
    assert [(r["policy"], r["budget"], r["variant_label"]) for r in res["runs"]] == \
        [(p, 128, v) for v in ("plain", "recall=True", "prefill_scores=flipped")
         for p in STREAMING]
    for i, r in enumerate([ref, *res["runs"]]):
        assert r["correct"] == sum(t["hits"][i] for t in res["trials"])
        assert r["accuracy"] == r["correct"] / 8 and r["trials"] == 8
    first = res["targets"][0]
    assert "with recall, brightness (recall=True" in first["what"]
    # each policy with recall, and its two drop-only variants beside it
    assert len(res["targets"]) == 3 * len(STREAMING)
    assert res["timing"]["prime_s"] > 0 and res["elapsed_s"] > 0
    report = (out / "report.md").read_text()
    assert report.startswith("# Pass-key retrieval benchmark")
    # tiny-random: 2 layers x 2 KV heads, a pair 16 float32 keys and 16 values
    assert res["kv"] == {"heads": 4, "pair_bytes": 128}
    assert f"budget 128: 512 pairs, 0.06 MiB, {128 / cfg['lengths'][0]:.0%} of the full" in report
    assert "bench passkey --quick --model tiny-random --out" in report
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n") and "<!-- bench passkey: end -->" in text
    assert "## Pass-key retrieval benchmark" in text


def test_policies_none_measures_the_full_cache_only(capsys, one_thread):
    code = main(["bench", "passkey", "--model", "tiny-random", "--policies", "none",
                 "--trials", "3", "--lengths", "300,400", "--json"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(stdout)
    assert res["runs"] == [] and res["reference"]["trials"] == 3
    assert [t["length"] for t in res["trials"]] == [300, 400, 300]
    assert [t["what"].split(":")[0] for t in res["targets"]] == \
        ["budget 128 with recall / the full cache (0/3)"]


@pytest.mark.parametrize("argv, message", [
    (["--trials", "0"], "trials must be >= 1"),
    (["--lengths", "1,a"], "comma-separated integers"),
    (["--budgets", "8"], "smaller than sinks + recent"),
    (["--budgets", "256,128"], "increasing"),
    (["--policies", "h2o,bogus"], "non-culling"),
    (["--text", "x.txt"], "unrecognized arguments: --text x.txt"),
    (["--lengths", "40", "--trials", "1"], "cannot hold the pass-key task"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_bad_options_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["bench", "passkey", "--model", "tiny-random", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_its_options_are_its_own(capsys):
    """Each benchmark's parser takes its own flags only: argparse refuses another's."""
    for argv in (["speed", "--trials", "3"], ["speed", "--jobs", "2"],
                 ["passkey", "--windows", "2"]):
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err
        assert f"unrecognized arguments: {' '.join(argv[1:])}" in err and err.count("\n") == 1


def test_trials_in_worker_processes_answer_as_here(one_thread):
    """--jobs 2: the same trials, in order, with the same answers as in one process."""
    cfg = passkey.PasskeyConfig(model="tiny-random", trials=3, lengths=(300, 400),
                                budgets=(64,), policies=("h2o",), variants=({}, {"recall": True}))
    here, there = passkey.run(cfg, "here"), passkey.run(cfg, "there", Pool(jobs=2))
    assert there.workers == 2 and here.workers == 1
    assert [t.answers for t in there.trials] == [t.answers for t in here.trials]
    assert [t.key for t in there.trials] == [t.key for t in here.trials]
    assert "trials in 2 single-thread processes" in passkey.report_md(there, [], ".")


def test_a_resumed_run_measures_nothing_again(capsys, tmp_path, monkeypatch, one_thread):
    """--out then --resume (the same folder and flags): every trial comes from items.jsonl,
    none is measured again, and the accuracies printed are the same; --resume on a folder
    another config wrote is refused in one line."""
    argv = ["bench", "passkey", "--quick", "--model", "tiny-random", "--trials", "2",
            "--jobs", "1", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len((tmp_path / "items.jsonl").read_text().splitlines()) == 1 + 2
    monkeypatch.setattr(passkey, "run_trial", lambda *a, **kw: pytest.fail("measured again"))
    code = main([*argv, "--resume"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    again = json.loads(stdout)
    for key in ("trials", "reference", "runs", "timing", "targets"):
        assert again[key] == first[key], key
    assert len((tmp_path / "items.jsonl").read_text().splitlines()) == 1 + 2
    assert main([*argv, "--trials", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is another run's" in err and err.count("\n") == 1, err
