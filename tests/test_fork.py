"""fork: a captured run continued from step T with other options (those not given stay)."""
from __future__ import annotations

import json

import pytest

from positronic_brain.capture import CaptureRun, file_name, parse_name
from positronic_brain.cli import main
from positronic_brain.replay import diff, replay

RUN = ["run", "--model", "tiny-random", "--prompt", "what if another policy had been in charge",
       "--max-new-tokens", "30", "--budget", "24", "--temperature", "1.0", "--top-k", "40",
       "--seed", "3", "--json", "--compile", "none"]


@pytest.fixture
def parent(tmp_path, capsys, one_thread):
    assert main([*RUN, "--capture", str(tmp_path / "parent")]) == 0
    res = json.loads(capsys.readouterr().out)
    return res, CaptureRun(res["capture"])


def _fork(capsys, tmp_path, run, *argv):
    rc = main(["fork", str(run.dir), "--json", "--capture", str(tmp_path / "forks"), *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    return res, CaptureRun(res["capture"])


def test_with_no_option_changed_a_fork_is_its_parent(parent, capsys, tmp_path):
    res, run = parent
    fk, frun = _fork(capsys, tmp_path, run, "--step", "10")
    assert fk["generated_ids"] == res["generated_ids"] and fk["ledger"] == res["ledger"]
    assert len(fk["steps"]) == 21 and fk["parent"] == {"run": str(run.dir.resolve()), "step": 10}
    assert frun.manifest["parent"]["step"] == 10 and frun.steps == run.steps
    # the steps before T: the parent's files byte for byte; from T on, the same outputs
    for name, sha in run.manifest["files"].items():
        parsed = parse_name(name)
        if parsed is None or parsed[0] < 10:
            assert frun.manifest["files"][name] == sha, name
        else:
            theirs, ours = run.stage(*parsed).outputs, frun.stage(*parsed).outputs
            assert diff(ours, theirs) == [], name
    assert main(["replay", str(frun.dir)]) == 0
    assert "all bit-exact" in capsys.readouterr().err


def test_a_fork_of_a_run_from_another_cpu_replays_within_tolerance(parent, capsys, tmp_path):
    """The steps before the fork are the parent's files: captured on another kind of device
    (here a manifest saying so), the fork's manifest names both kinds, and its replay
    compares within the dtype's tolerance with a note, as the parent's own would."""
    _, run = parent
    path = run.dir / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "device_kind": "cpu: another CPU, flags 00000000"}))
    _, frun = _fork(capsys, tmp_path, run, "--step", "10")
    assert frun.manifest["device_kind"] == (
        f"cpu: another CPU, flags 00000000 (the parent's steps), {data['device_kind']}")
    report = replay(frun.dir)
    assert report.ok and report.tolerance is not None and "captured on cpu" in report.notes[0]
    path.write_text(json.dumps(data))  # the parent's own kind: the fork records only it
    _, frun = _fork(capsys, tmp_path / "again", run, "--step", "10")
    assert frun.manifest["device_kind"] == data["device_kind"]
    assert frun.manifest["kernels"] is None  # not native


def test_a_fork_with_another_policy_parts_at_its_step(parent, capsys, tmp_path):
    res, run = parent
    fk, frun = _fork(capsys, tmp_path, run, "--step", "10", "--policy", "h2o",
                     "--max-new-tokens", "12")
    assert fk["generated_ids"][:9] == res["generated_ids"][:9] and len(fk["steps"]) == 12
    assert fk["ledger"] != res["ledger"]
    for t in range(1, 10):  # the steps before T: the parent's files
        for st in ("s1_generate", "s2_score", "s3_decide", "s4_apply"):
            name = file_name(t, st)
            assert frun.manifest["files"][name] == run.manifest["files"][name]
    assert frun.stage(9, "s2_score").args["cache_params"].scorer.name == "brightness"
    assert frun.stage(10, "s2_score").args["cache_params"].scorer.name == "h2o"
    assert frun.steps == list(range(1, 22))
    assert main(["replay", str(frun.dir)]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--step", "99"], "step 99 is not in this capture (steps 1..30)"),
    (["--step", "5", "--recall"], "a fork cannot switch recall on"),
    (["--step", "5", "--budget", "1000"], "more than the parent's arena"),
    (["--step", "5", "--policy", "bogus"], "unknown policy 'bogus'"),
    (["--step", "5", "--max-new-tokens", "-1"], "max-new-tokens must be >= 0"),
])
def test_bad_forks_are_one_line_and_exit_2(parent, capsys, argv, message):
    _, run = parent
    assert main(["fork", str(run.dir), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
