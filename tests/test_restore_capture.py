"""A capture that starts from a restored session (``s0_restore``): ``run --session`` on a
composed file replays bit for bit with its origins in every file, inspect shows it, it goes on
exactly as the saved session would, and a chat's ``/load`` keeps capturing."""
import json

import pytest
import torch

from positronic_brain import page
from positronic_brain.capture import RESTORE, CaptureRun, CaptureTape, file_name, sha256
from positronic_brain.cli import main
from positronic_brain.compose import compose_files
from positronic_brain.loop import Session
from positronic_brain.replay import replay
from positronic_brain.session_io import load_session, save_session
from positronic_brain.state import Ledger
from positronic_brain.types import CacheParams, SamplerParams

SAMPLED = SamplerParams(temperature=1.0, top_k=40, seed=11)
STEPS = 12


def _saved(model, policy, path, text: str, steps: int = 3, budget: int = 24) -> Session:
    s = Session(model, policy, SAMPLED, CacheParams(budget=budget, recall=True))
    s.prime(policy.raw_prompt(text), 96)
    for _ in range(steps):
        s.step()
    save_session(s, path)
    return s


def _composed(model, policy, folder, budget: int = 24):
    """ab.pbs: a.pbs then b.pbs, each a session that culled into its cold store."""
    _saved(model, policy, folder / "a.pbs", "the first part of a longer text", budget=budget)
    _saved(model, policy, folder / "b.pbs", "and then a second part", budget=budget)
    compose_files(model, [folder / "a.pbs", folder / "b.pbs"], folder / "ab.pbs")
    return folder / "ab.pbs"


@pytest.fixture
def composed(tiny_model, tiny_policy, tmp_path, one_thread):
    return _composed(tiny_model, tiny_policy, tmp_path)


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["run", "--compile", "none", *argv])  # the plain path, as the sessions here
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def captured(composed, tiny_model, capsys, tmp_path):
    code, out, err = _run(capsys, "--session", str(composed), "--max-new-tokens", str(STEPS),
                          "--ignore-eos", "--capture", str(tmp_path / "caps"),
                          "--capture-level", "full", "--device", str(tiny_model.device), "--json")
    assert code == 0, err
    res = json.loads(out)
    return res, CaptureRun(res["capture"])


def test_a_composed_session_run_replays_bit_for_bit_with_its_origins(captured, composed,
                                                                     tiny_model, capsys):
    res, run = captured
    saved = load_session(tiny_model, composed)
    assert run.steps == list(range(1, STEPS + 1))  # the tape's steps, not the session's
    assert [p for p in map(run.has, (file_name(0, "s0_prime"), file_name(0, RESTORE)))] == \
        [False, True]
    restored = run.at(0, RESTORE)
    assert restored.inputs["source"] == str(composed)
    out = restored.outputs
    assert out["ledger_fields"]["origins"] == ("a.pbs", "b.pbs")
    for c in Ledger.COLUMNS:  # every column as the file has it, the origin ones included
        assert torch.equal(out["columns"][c], saved.state.ledger.live(c).cpu()), c
    assert out["cold"]["k"].shape[2] == saved.state.cold.n > 0
    assert out["state_fields"]["step"] == saved.state.step
    first = run.step(1).view  # the first step read the restored ledger, origins and all
    assert first["origins"] == ["a.pbs", "b.pbs"] and first["step"] == saved.state.step
    assert torch.equal(first["origin"], out["columns"]["origin"])
    assert torch.equal(first["origin_uid"], out["columns"]["origin_uid"])
    assert set(first["origin"].tolist()) == {1, 2}
    last = run.step(STEPS).view  # rows made here since have no origin
    assert set(last["origin"].tolist()) == {0, 1, 2}
    report = replay(run.dir, model=tiny_model)
    assert report.ok, [str(m) for m in report.mismatches[:5]]
    assert report.compared == {RESTORE: 1, "s1_generate": STEPS, "s2_score": STEPS,
                               "s3_decide": STEPS, "s4_apply": STEPS}
    assert main(["replay", str(run.dir), "--stage", RESTORE]) == 0
    assert "compared 1 s0_restore; all bit-exact" in capsys.readouterr().err.replace("\n", " ")
    assert res["generated_ids"][-STEPS:] == [s["token_id"] for s in res["steps"]]


def test_replay_writes_the_captured_state_and_goes_on_from_it(captured, tiny_model):
    """A restore file changed (and re-signed) is what the replay then steps from: stage 1
    no longer gives the captured logits."""
    _, run = captured
    name = file_name(0, RESTORE)
    data = torch.load(run.dir / name, weights_only=True)
    data["outputs"]["v"] += 0.5
    torch.save(data, run.dir / name)
    manifest = json.loads((run.dir / "manifest.json").read_text())
    manifest["files"][name] = sha256((run.dir / name).read_bytes())
    (run.dir / "manifest.json").write_text(json.dumps(manifest))
    report = replay(run.dir, model=tiny_model)
    assert report.compared[RESTORE] == 1
    assert ("000001_s1_generate.pt", "logits") in {(m.file, m.key) for m in report.mismatches}


def test_inspect_shows_the_restored_run_and_its_origins(captured, composed, capsys, tmp_path,
                                                        monkeypatch):
    _, run = captured
    monkeypatch.setenv("COLUMNS", "400")  # the file's path on one line
    assert main(["inspect", str(run.dir), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert f"after step 0: {composed}" in out and "rows from a.pbs, b.pbs" in out
    assert "context at step 1" in out and "a.pbs (" in out and "b.pbs (" in out
    assert main(["inspect", str(run.dir / file_name(0, RESTORE))]) == 0
    assert "ledger_fields" in capsys.readouterr().out
    assert main(["inspect", str(run.dir), "--html", str(tmp_path / "run.html")]) == 0
    data = page.run_data(run, str)
    first, restored = data["steps"][0], run.at(0, RESTORE).outputs["columns"]
    order = torch.argsort(restored["position"])
    assert first["origin"] == [("a.pbs", "b.pbs")[o - 1] for o in restored["origin"][order]]
    assert first["changed"] == restored["changed_step"][order].tolist()  # the file's, not born


def test_a_restored_run_forks_like_any_other(captured, capsys, tmp_path):
    res, run = captured
    assert main(["fork", str(run.dir), "--step", "5", "--json", "--capture",
                 str(tmp_path / "forks")]) == 0
    fk = json.loads(capsys.readouterr().out)
    assert [s["token_id"] for s in fk["steps"]] == [s["token_id"] for s in res["steps"][4:]]
    assert main(["replay", fk["capture"]]) == 0


def test_run_session_goes_on_exactly_as_the_saved_session(tiny_model, tiny_policy, tmp_path,
                                                         capsys, one_thread):
    a = _saved(tiny_model, tiny_policy, tmp_path / "a.pbs", "a session saved, then run", 5)
    code, out, err = _run(capsys, "--session", str(tmp_path / "a.pbs"), "--max-new-tokens",
                          "10", "--ignore-eos", "--device", str(tiny_model.device), "--json")
    assert code == 0, err
    steps = json.loads(out)["steps"]
    ours = [a.step() for _ in range(10)]
    assert [(s["step"], s["token_id"], s["logprob"]) for s in steps] == \
        [(r.step, r.token_id, r.logprob) for r in ours]


def test_bad_session_runs_are_one_line_and_exit_2(tiny_model, tiny_policy, tmp_path, capsys):
    s = Session(tiny_model, tiny_policy, SAMPLED)
    s.prime(tiny_policy.raw_prompt("refuse me"), 32)
    save_session(s, tmp_path / "a.pbs")
    caps = ["--capture", str(tmp_path / "caps")]
    for argv, message in (
            (["--session", str(tmp_path / "nope.pbs")], "no session file at"),
            (["--session", str(tmp_path / "a.pbs"), "--prompt", "x"], "not allowed with"),
            (["--session", str(tmp_path / "a.pbs"), "--model", "tiny-random-qwen2"],
             "cannot load into 'tiny-random-qwen2'"),
            (["--session", str(tmp_path / "a.pbs"), "--budget", "8", "--seed", "2"],
             "--seed, --budget: not with --session")):
        code, _, err = _run(capsys, *argv, *caps)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "caps").exists()  # nothing captured, nothing lost


def test_a_chat_keeps_capturing_across_load(tiny_model, tiny_policy, capsys, tmp_path,
                                            one_thread):
    composed = _composed(tiny_model, tiny_policy, tmp_path, budget=64)  # room for a turn
    script = tmp_path / "turns.txt"
    script.write_text(f"hello there\n/load {composed}\nand then?\n")
    assert main(["chat", "--model", "tiny-random", "--device", str(tiny_model.device),
                 "--script", str(script), "--max-new-tokens", "4", "--greedy", "--json",
                 "--capture", str(tmp_path / "caps")]) == 0
    turns = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [t.get("tokens") for t in turns] == [4, None, 4]
    run = CaptureRun(tmp_path / "caps")
    assert run.steps == list(range(1, 9))
    for t, stage in ((0, "s0_prime"), (4, RESTORE), (4, "s0_extend")):
        assert run.has(file_name(t, stage)), (t, stage)
    assert not run.has(file_name(0, "s0_extend"))  # the first turn was the prime
    assert run.step(5).view["origins"] == ["a.pbs", "b.pbs"]
    assert main(["replay", str(run.dir)]) == 0
    assert "8 steps" in capsys.readouterr().err


def test_a_restore_supersedes_a_turn_recorded_at_its_step(tiny_model, tiny_policy, tmp_path,
                                                          composed, one_thread):
    tape = CaptureTape(tmp_path / "caps", {"model": tiny_model.name, "dtype": "float32",
                                           "device": str(tiny_model.device),
                                           "fingerprint": tiny_model.fingerprint}, run_id="r")
    s = Session(tiny_model, tiny_policy, SAMPLED, tape=tape)
    s.prime(tiny_policy.raw_prompt("primed"), 64)
    s.extend(tiny_policy.raw_prompt(" then a turn that no step followed"))
    assert tape.manifest["files"].keys() == {file_name(0, "s0_prime"), file_name(0, "s0_extend")}
    loaded = load_session(tiny_model, composed)
    loaded.record(tape, str(composed))
    assert set(tape.manifest["files"]) == {file_name(0, "s0_prime"), file_name(0, RESTORE)}
    assert not (tape.dir / file_name(0, "s0_extend")).exists()
    tokens = [loaded.step().token_id for _ in range(3)]
    tape.close("done")
    report = replay(tape.dir, model=tiny_model)
    assert report.ok and report.steps == 3, [str(m) for m in report.mismatches[:5]]
    assert [CaptureRun(tape.dir).step(t).gen.token_id for t in (1, 2, 3)] == tokens
