"""``calibrate``: DuoAttention's retrieval heads chosen by the attention each (layer, KV
head) pays a pass-key's tokens while the model answers it; the file it writes is the one
``--allocation duo`` reads."""
import json

import pytest
import torch

from positronic_brain import calibrate
from positronic_brain.bench.passkey import trials
from positronic_brain.cli import main
from positronic_brain.stages.decide.allocation import retrieval_heads


def test_key_slots_finds_every_occurrence():
    assert calibrate.key_slots([5, 1, 2, 9, 1, 2, 1], [1, 2]) == [1, 2, 4, 5]
    assert calibrate.key_slots([5, 1, 3], [1, 2]) == []


def test_a_kv_heads_score_is_its_query_heads_mean_share():
    """Two steps, one layer, four query heads over two KV heads (grouped: 0-1 and 2-3)."""
    shares = torch.tensor([[[0.1, 0.3, 0.5, 0.9]],
                           [[0.3, 0.5, 0.1, 0.1]]])
    got = calibrate.head_scores(shares, kv_heads=2)
    assert torch.allclose(got, torch.tensor([[0.3, 0.4]]))


def test_choose_takes_the_highest_share_ties_to_the_lower_head():
    scores = torch.tensor([[0.2, 0.5, 0.5], [0.1, 0.9, 0.0]])
    assert calibrate.choose(scores, 0.5).tolist() == [[False, True, True], [False, True, False]]
    assert calibrate.choose(scores, 1 / 6).tolist() == [[False, False, False],
                                                        [False, True, False]]
    assert int(calibrate.choose(scores, 0.01).sum()) == 1  # at least one
    assert int(calibrate.choose(scores, 1.0).sum()) == 6


def test_scores_are_the_attention_the_answer_pays_the_key(tiny_model, tiny_policy, one_thread):
    """Each score is a mean of attention shares (within [0, 1]); the heads chosen are the
    fraction asked; the same seed gives the same heads."""
    found = calibrate.calibrate(tiny_model, tiny_policy, 2, (300, 400), 0.5, seed=1)
    spec = tiny_model.spec
    assert found.scores.shape == (spec.n_layers, spec.n_kv_heads)
    assert bool(((found.scores > 0) & (found.scores <= 1)).all())
    assert int(found.heads.sum()) == 2 and found.trials == 2
    assert found.steps == sum(len(tiny_policy.encode(f" {t.key}"))
                              for t in trials(1, 2, (300, 400)))
    again = calibrate.calibrate(tiny_model, tiny_policy, 2, (300, 400), 0.5, seed=1)
    assert torch.equal(again.scores, found.scores)


def test_the_cli_writes_the_heads_file_duo_reads(capsys, tmp_path, one_thread, tiny_model):
    out = tmp_path / "heads.json"
    assert main(["calibrate", "--model", "tiny-random", "--lengths", "256", "--trials", "2",
                 "--fraction", "0.5", "--out", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    spec = tiny_model.spec
    grid = retrieval_heads(str(out), spec.n_layers, spec.n_kv_heads)
    assert grid.tolist() == json.loads(out.read_text()) and int(grid.sum()) == 2
    assert sorted(res["heads"]) == sorted(grid.nonzero().tolist()) and res["steps"] > 0
    assert main(["run", "--model", "tiny-random", "--prompt", "the heads as chosen",
                 "--max-new-tokens", "4", "--budget", "16", "--sinks", "1", "--recent", "2",
                 "--policy", "tova", "--allocation", "duo", "--allocation-heads", str(out),
                 "--json"]) == 0


def test_the_random_baseline_chooses_as_many(capsys, tmp_path, tiny_model):
    out = tmp_path / "random.json"
    assert main(["calibrate", "--model", "tiny-random", "--random", "--fraction", "0.5",
                 "--seed", "3", "--out", str(out)]) == 0
    spec = tiny_model.spec
    grid = retrieval_heads(str(out), spec.n_layers, spec.n_kv_heads)
    assert int(grid.sum()) == 2
    assert torch.equal(grid, calibrate.at_random(tiny_model, 0.5, 3).heads)
    assert "heads drawn at random" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--fraction", "0"], "--fraction must be in (0, 1], got 0.0"),
    (["--fraction", "1.5"], "--fraction must be in (0, 1]"),
    (["--trials", "0"], "--trials must be >= 1, got 0"),
    (["--lengths", "256,x"], "--lengths '256,x'"),
    (["--lengths", "4096"], "--lengths 4096: each in 1..496"),
    (["--lengths", "256,20"], "a 20-token prompt cannot hold the pass-key task"),
    (["--trials", "1", "--lengths", "256,20"], "a 20-token prompt cannot hold the pass-key task"),
    (["--random", "--seed", "99999999999999999999999"], "the seed must fit in 64 bits"),
    (["--out", "NO/heads.json"], "no folder"),
])
def test_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, argv, message):
    argv = [str(tmp_path / a) if a.startswith("NO/") else a for a in argv]
    out = ["--out", str(tmp_path / "heads.json")] if "--out" not in argv else []
    assert main(["calibrate", "--model", "tiny-random", "--lengths", "256", *out, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "heads.json").exists()
