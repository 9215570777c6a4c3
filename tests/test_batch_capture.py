"""A batch's capture (``run --prompts --capture``): one run folder a row and the batch's
schedule; replay steps its rows together again, bit for bit; inspect and fork take a row;
a session saved from a row goes on as the row's own would."""
from __future__ import annotations

import json

import pytest
import torch

from positronic_brain import batch
from positronic_brain.batch import drive_rows, run_rows
from positronic_brain import replay as replay_module
from positronic_brain.capture import BatchTape, CaptureRun, read_batch, row_name
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.model import for_rows
from positronic_brain.replay import replay
from positronic_brain.session_io import load_session, save_session
from positronic_brain.types import CacheParams, SamplerParams
from tests.test_batch import TEXTS

SAMPLED = SamplerParams(temperature=1.0, seed=5)
FOLD = CacheParams(budget=12, sinks=2, recent=2, scorer="h2o", repair="fold")
RUN = ("run", "--model", "tiny-random", "--temperature", "1.0", "--seed", "5", "--ignore-eos",
       "--max-new-tokens", "14", "--budget", "12", "--sinks", "2", "--recent", "2",
       "--policy", "h2o", "--repair", "fold", "--json", "--compile", "none")


def _manifest(model) -> dict:
    return {"model": model.name, "dtype": "float32", "fingerprint": model.fingerprint}


def _batch(model, policy, root, size=3, level="light", **kw):
    tape = BatchTape(root, _manifest(model), level, size)
    rows = run_rows(model, policy, [policy.raw_prompt(t) for t in TEXTS], SAMPLED, size,
                    max_new_tokens=14, ignore_eos=True, cache_params=FOLD, tape=tape, **kw)
    return tape.dir, rows


@pytest.mark.parametrize("size, level", [(3, "full"), (1, "light")])
def test_a_batch_capture_replays_bit_exact(tiny_model, tiny_policy, tmp_path, one_thread,
                                           size, level):
    """Four prompts of different lengths three rows at a time (the fourth takes the first
    finished place): each row's folder is its run, and the batch's replay re-runs each
    row's stage 1 in one product with the rows it stepped with."""
    folder, rows = _batch(tiny_model, tiny_policy, tmp_path, size, level)
    record = read_batch(folder)
    assert record["complete"] and record["size"] == size
    assert record["rows"] == [row_name(i) for i in range(len(TEXTS))]
    assert max(len(s) for s in record["schedule"]) == size
    assert sum(len(s) for s in record["schedule"]) == 14 * len(TEXTS)
    for i, row in enumerate(rows):
        run = CaptureRun(folder, row=i)
        assert row["capture"] == str(run.dir) and run.manifest["batch"]["row"] == i
        assert run.manifest["prompt_ids"] == row["prompt_ids"]
        assert [run.step(t).gen.token_id for t in run.steps] == row["generated_ids"]
    assert sum(r["totals"]["folded"] for r in rows) > 0
    report = replay(folder, model=tiny_model)
    assert report.ok, report.mismatches[:3]
    assert report.rows == len(TEXTS) and report.steps == 14 * len(TEXTS)
    assert report.compared["s1_generate"] == 14 * len(TEXTS) and report.tolerance is None
    one = replay(folder / row_name(2), model=tiny_model)  # a row's folder: that row's files
    assert one.ok and one.rows == 1 and one.compared["s1_generate"] == 14
    assert one.run_dir == str(folder / row_name(2))


def test_replay_steps_the_rows_that_stepped_together(tiny_model, tiny_policy, tmp_path,
                                                     one_thread, monkeypatch):
    """Replay's stage 1 is one product over the rows of each captured batch step, in the
    batch's order, over the model packed for the batch's size (as the batch ran)."""
    folder, _ = _batch(tiny_model, tiny_policy, tmp_path)
    seen = []
    generate_rows = replay_module.generate_rows

    def recording(model, views, *args):
        seen.append((model is for_rows(tiny_model, 3), [v.pending_token for v in views]))
        return generate_rows(model, views, *args)

    monkeypatch.setattr(replay_module, "generate_rows", recording)
    assert replay(folder, model=tiny_model).ok
    record = read_batch(folder)
    runs = [CaptureRun(folder, row=i) for i in range(len(TEXTS))]
    assert seen == [(True, [runs[i].step(t).view["pending_token"] for i, t in together])
                    for together in record["schedule"]]


def test_a_batch_that_fails_part_way_keeps_what_it_recorded(tiny_model, tiny_policy, tmp_path,
                                                            one_thread, monkeypatch):
    calls = []
    step_rows = batch.step_rows

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("the machine went away")
        return step_rows(*args)

    monkeypatch.setattr(batch, "step_rows", failing)
    with pytest.raises(RuntimeError):
        _batch(tiny_model, tiny_policy, tmp_path)
    folder = next(tmp_path.iterdir())
    assert not read_batch(folder)["complete"]
    for i in range(3):
        manifest = CaptureRun(folder, row=i).manifest
        assert not manifest["complete"] and manifest["stop_reason"] == "RuntimeError"
    report = replay(folder, model=tiny_model)
    assert report.ok and report.steps == 3 * 4
    assert any("did not complete (stopped: RuntimeError)" in n for n in report.notes)


def test_a_batch_that_stops_while_a_row_primes_replays_the_rest(tiny_model, tiny_policy,
                                                                tmp_path, one_thread,
                                                                monkeypatch):
    primes = []
    prime = Session.prime

    def interrupted(self, *args, **kw):
        primes.append(1)
        if len(primes) == 4:  # the fourth prompt, once a place is free
            raise KeyboardInterrupt
        return prime(self, *args, **kw)

    monkeypatch.setattr(Session, "prime", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _batch(tiny_model, tiny_policy, tmp_path)
    monkeypatch.undo()
    folder = next(tmp_path.iterdir())
    assert read_batch(folder)["rows"][-1] == row_name(3)
    report = replay(folder, model=tiny_model)
    assert report.ok and report.rows == 3 and report.steps > 0
    assert any(f"{row_name(3)}: not primed" in n for n in report.notes)


def test_a_session_saved_from_a_row_goes_on_as_the_row_would(tiny_model, tiny_policy, tmp_path,
                                                             one_thread):
    """Rows saved as they finish; each file, loaded, steps as the row's own session goes on
    (alone, from the same state and generator): the same tokens and logprobs, bit for bit."""
    saved, sessions = {}, {}

    def primed():
        for i, text in enumerate(TEXTS):
            s = Session(tiny_model, tiny_policy, SAMPLED, FOLD)
            s.prime(tiny_policy.raw_prompt(text))
            yield i, s

    def done(i, report):
        sessions[i] = report.session
        saved[i] = save_session(report.session, tmp_path / f"{i}.pbs")

    drive_rows(tiny_model, primed(), 3, 10, ignore_eos=True, on_done=done)
    assert sorted(saved) == list(range(len(TEXTS)))
    for i, path in saved.items():
        loaded = load_session(tiny_model, path)
        ours = [loaded.step() for _ in range(12)]
        theirs = [sessions[i].step() for _ in range(12)]
        assert [(r.token_id, r.logprob) for r in ours] == [(r.token_id, r.logprob) for r in theirs]
        assert loaded.state.ledger.rows() == sessions[i].state.ledger.rows()
        ours, theirs = loaded.state.view(), sessions[i].state.view()
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_cli_captures_replays_inspects_forks_and_saves_a_batch(capsys, tmp_path, one_thread,
                                                                   tiny_model):
    if tiny_model.device.type != "cpu":
        pytest.skip("the CLI runs on the CPU here")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(TEXTS[:3]) + "\n")
    cap, saved = tmp_path / "cap", tmp_path / "saved"
    rc, out, err = _cli(capsys, *RUN, "--prompts", str(prompts), "--batch", "2",
                        "--capture", str(cap), "--save", str(saved))
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    (folder,) = cap.iterdir()
    assert [r["capture"] for r in rows] == [str(folder / row_name(i)) for i in range(3)]
    assert sorted(p.name for p in saved.iterdir()) == [f"{row_name(i)}.pbs" for i in range(3)]
    rc, _, err = _cli(capsys, "replay", str(cap))
    assert rc == 0 and "42 steps" in err and "(3 rows)" in err and "all bit-exact" in err
    rc, _, err = _cli(capsys, "replay", str(folder), "--row", "1", "--stage", "s1_generate")
    assert rc == 0 and "14 steps" in err and "14 s1_generate" in err
    rc, out, _ = _cli(capsys, "inspect", str(cap), "--row", "1", "--step", "5")
    assert rc == 0 and f"row 1 of batch {folder.name}" in out
    rc, _, err = _cli(capsys, "inspect", str(folder / row_name(1)), "--html",
                      str(tmp_path / "row.html"))
    assert rc == 0 and (tmp_path / "row.html").stat().st_size > 0
    # a fork of a row goes on alone: with no option changed it follows the row (sampled
    # tokens the same here; bits within rounding), and replays within the tolerance
    rc, out, err = _cli(capsys, "fork", str(folder), "--row", "2", "--step", "6", "--json",
                        "--capture", str(tmp_path / "forks"))
    assert rc == 0, err
    fork = json.loads(out)
    assert fork["parent"] == {"run": str((folder / row_name(2)).resolve()), "step": 6}
    assert len(fork["generated_ids"]) == 14
    rc, _, err = _cli(capsys, "replay", fork["capture"])
    assert rc == 0 and "in a batch of 2 rows" in err and "within the tolerance" in err
    rc, out, err = _cli(capsys, "fork", fork["capture"], "--step", "9", "--json", "--capture",
                        str(tmp_path / "forks2"))  # a fork of the fork: its first steps batched
    assert rc == 0, err
    rc, _, err = _cli(capsys, "replay", json.loads(out)["capture"])
    assert rc == 0 and "in a batch of 2 rows" in err and "within the tolerance" in err
    # a saved row goes on with run --session
    rc, out, err = _cli(capsys, "run", "--session", str(saved / f"{row_name(0)}.pbs"),
                        "--max-new-tokens", "3", "--json", "--ignore-eos")
    assert rc == 0, err
    assert json.loads(out)["prompt_ids"] == rows[0]["prompt_ids"]


@pytest.mark.parametrize("argv, message", [
    (("inspect", "BATCH"), "is a batch capture of 4 rows: name one with --row I"),
    (("inspect", "BATCH", "--row", "7"), "--row 7: "),
    (("replay", "BATCH", "--row", "9"), "--row 9: "),
    (("fork", "BATCH", "--step", "2"), "name one with --row I"),
    (("replay", "ROW1", "--row", "0"), "is row 1"),
    (("inspect", "ROW1", "--row", "0"), "is row 1 of a batch"),
    (("replay", "BATCH", "--step", "99"), "step 99 is not in this capture's rows"),
    (("inspect", "SOLO", "--row", "0"), "is not a batch capture"),
    (("replay", "SOLO", "--row", "0"), "a run of one prompt, not a batch capture"),
])
def test_rows_are_named_or_refused_in_one_line(capsys, tmp_path, tiny_model, tiny_policy,
                                                one_thread, argv, message):
    folder, _ = _batch(tiny_model, tiny_policy, tmp_path / "b", size=2)
    assert main(["run", "--model", "tiny-random", "--prompt", "solo", "--max-new-tokens", "2",
                 "--capture", str(tmp_path / "solo"), "--json"]) == 0
    solo = json.loads(capsys.readouterr().out)["capture"]
    named = {"BATCH": str(folder), "ROW1": str(folder / row_name(1)), "SOLO": solo}
    rc, out, err = _cli(capsys, *(named.get(a, a) for a in argv))
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1, err


def test_save_with_prompts_is_a_folder(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n")
    (tmp_path / "file").write_text("x")
    rc, out, err = _cli(capsys, *RUN, "--prompts", str(prompts), "--save", str(tmp_path / "file"))
    assert rc == 2 and out == "" and "a folder (one session file a prompt)" in err
    assert (tmp_path / "file").read_text() == "x"
    rc, out, err = _cli(capsys, *RUN, "--prompts", str(prompts), "--save",
                        str(tmp_path / "no" / "sessions"))
    assert rc == 2 and out == "" and "no folder" in err and not (tmp_path / "no").exists()
