"""compare: where two captured runs of one prompt part, and what the worse one forgot."""
from __future__ import annotations

import json

import pytest
import torch

from positronic_brain.capture import CaptureRun
from positronic_brain.cli import main

PROMPT = "two policies read the same words and keep different ones of them in mind"


@pytest.fixture
def runs(tmp_path, capsys, one_thread):
    out = {}
    for policy in ("brightness", "h2o"):
        assert main(["run", "--model", "tiny-random", "--prompt", PROMPT, "--max-new-tokens",
                     "30", "--budget", "24", "--temperature", "1.0", "--seed", "3", "--policy",
                     policy, "--json", "--capture", str(tmp_path / policy)]) == 0
        out[policy] = json.loads(capsys.readouterr().out)
    return out


def test_the_first_divergence_and_what_was_forgotten(runs, capsys):
    a, b = runs["brightness"], runs["h2o"]
    assert main(["compare", a["capture"], b["capture"], "--jump", "0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    differ = [i + 1 for i, (x, y) in enumerate(zip(a["generated_ids"], b["generated_ids"]))
              if x != y]
    assert res["first_divergence"] == (differ[0] if differ else None)
    assert [s["tokens"] for s in res["steps"]] == \
        [list(p) for p in zip(a["generated_ids"], b["generated_ids"])]
    for s, ra, rb in zip(res["steps"], a["steps"], b["steps"]):
        # the captured logits' log-softmax, as the run's record took it: the same bits
        assert s["nll"] == [-ra["logprob"], -rb["logprob"]]
    lost = [j for j in res["jumps"] if j["forgotten"]]
    assert lost, "some step had a worse run missing a token the better one read"
    caps = [CaptureRun(a["capture"]), CaptureRun(b["capture"])]
    for j in lost:
        views = [c.stage(j["step"], "s1_generate").inputs["view"]["uid"] for c in caps]
        for f in j["forgotten"]:  # in the better run's cache at that step, not in the worse's
            assert f["uid"] in views[j["other"]].tolist()
            assert f["uid"] not in views[j["run"]].tolist()
        att = [f["attention"] for f in j["forgotten"]]
        assert att == sorted(att, reverse=True)
    assert all(j["step"] <= (res["first_divergence"] or 10**9) for j in res["jumps"])
    assert main(["compare", a["capture"], b["capture"]]) == 0  # the tables
    out = capsys.readouterr().out
    assert "part at step" in out or "never part" in out
    assert torch.isfinite(torch.tensor(res["runs"][0]["mean_nll"]))


def test_bad_compares_are_one_line_and_exit_2(runs, capsys, tmp_path):
    a = runs["brightness"]["capture"]
    assert main(["run", "--model", "tiny-random", "--prompt", "another prompt", "--max-new-tokens",
                 "3", "--capture", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    other = str(next((tmp_path / "other").iterdir()))
    for argv, message in (([a], "at least two runs"), ([a, other], "not of the same prompt"),
                          ([a, a, "--top", "0"], "--top >= 1"),
                          ([a, str(tmp_path)], "not a capture run folder")):
        assert main(["compare", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
