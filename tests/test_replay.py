"""Replay: every captured stage re-runs from its captured inputs to bit-identical outputs;
a tampered value is reported by file, key and max difference; bad files exit 2."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from positronic_brain.capture import STAGES, CaptureRun, load_file, read_manifest, sha256
from positronic_brain.cli import main as cli
from positronic_brain.model import device_kind
from positronic_brain.replay import replay
from positronic_brain.types import UserError


def test_the_capture_has_every_stage_and_every_kind_of_patch(captured_run):
    run_dir, result, _ = captured_run
    m = read_manifest(run_dir)
    assert m["complete"] and m["stop_reason"] == "max_new_tokens"
    steps = len(result["steps"])
    assert set(m["files"]) == {"000000_s0_prime.pt"} | {
        f"{t:06d}_{s}.pt" for t in range(1, steps + 1) for s in STAGES[1:]} | {
        f"state_{t:06d}.pt" for t in range(1, steps + 1)}
    assert any(s["culled"] for s in result["steps"]), "no cull happened"
    assert any(s["merged"] for s in result["steps"]), "no repair happened"
    assert any(s["reindexed"] for s in result["steps"]), "no re-index happened"


def test_replay_is_bit_exact(captured_run, real_model):
    run_dir, result, _ = captured_run
    report = replay(run_dir, model=real_model)
    assert report.ok, [str(m) for m in report.mismatches[:5]]
    n = len(result["steps"])
    assert report.steps == n and report.compared == {"s0_prime": 1, "s1_generate": n,
                                                      "s2_score": n, "s3_decide": n, "s4_apply": n}


def test_replay_one_stage_at_one_step(captured_run, real_model):
    report = replay(captured_run[0], stage="s3_decide", step=5, model=real_model)
    assert report.ok and report.compared == {"s3_decide": 1}


def _tamper(run_dir, name, edit):
    """Change a captured value and re-sign the file, so only replay can notice."""
    path = run_dir / name
    data = torch.load(path, weights_only=True)
    edit(data)
    torch.save(data, path)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["files"][name] = sha256(path.read_bytes())
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def run_copy(captured_run, tmp_path):
    return shutil.copytree(captured_run[0], tmp_path / "run")


def test_a_changed_logit_is_reported_with_file_key_and_difference(run_copy, real_model):
    def edit(d):
        d["outputs"]["logits"][123] += 0.5
    _tamper(run_copy, "000007_s1_generate.pt", edit)
    report = replay(run_copy, model=real_model)
    assert [(m.file, m.key) for m in report.mismatches] == [("000007_s1_generate.pt", "logits")]
    assert "max abs diff 0.5" in report.mismatches[0].detail


def test_replay_cli_exit_codes(run_copy, capsys):
    assert cli(["replay", str(run_copy), "--stage", "s2_score", "--step", "3"]) == 0
    assert "replay OK" in capsys.readouterr().err

    def edit(d):
        b = d["outputs"]["out"]["columns"]["brightness"]  # a value stage 4 would still accept
        b[3] += -1.0 if b[3] >= 1 else 1.0
    _tamper(run_copy, "000012_s3_decide.pt", edit)
    assert cli(["replay", str(run_copy), "--stage", "s3_decide", "--step", "12"]) == 1
    err = capsys.readouterr().err
    assert "000012_s3_decide.pt: out.columns.brightness: max abs diff 1" in err

    (run_copy / "000003_s2_score.pt").write_bytes(b"garbage")
    assert cli(["replay", str(run_copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sha256" in err and "Traceback" not in err


def test_files_are_plain_data_and_stage_outputs_have_the_promised_keys(captured_run):
    run_dir, result, _ = captured_run
    m = read_manifest(run_dir)
    s1 = load_file(run_dir / "000001_s1_generate.pt", m["files"]["000001_s1_generate.pt"])
    out = s1["outputs"]
    assert out["logits"].dtype == torch.float32 and out["logits"].shape == (49152,)
    assert out["token_id"] == result["generated_ids"][0]
    assert len(out["report"]["top_ids"]) == len(out["report"]["top_probs"]) >= 1
    assert out["attention"].shape == (30, 9, s1["cache_len"])
    s4 = load_file(run_dir / "000001_s4_apply.pt", m["files"]["000001_s4_apply.pt"])
    assert set(s4["outputs"]["out"]) >= {"culled_uids", "moves", "merges", "reindex_to",
                                         "appended_k"}


def test_inspect_renders_a_run_and_a_file(captured_run, real_policy, capsys):
    run_dir = captured_run[0]
    assert cli(["inspect", str(run_dir), "--step", "20"]) == 0
    out = capsys.readouterr().out
    assert "context at step 20" in out and "steps (24 in all)" in out
    live = CaptureRun(run_dir).step(20).view["token_id"].tolist()  # the cache step 20 read
    words = [w for w in (real_policy.decode([t]).strip() for t in live) if w.isalpha()]
    assert words and all(w in out for w in words), words
    assert cli(["inspect", str(run_dir / "000020_s4_apply.pt")]) == 0
    assert "culled_uids" in capsys.readouterr().out
    assert cli(["inspect", str(run_dir), "--step", "99"]) == 2


def test_another_model_is_refused(captured_run, tiny_model):
    with pytest.raises(UserError, match="does not match"):
        replay(captured_run[0], model=tiny_model)


def test_the_fingerprint_keeps_its_fields(tiny_model):
    """Replay refuses a capture whose recorded fingerprint differs from the loaded model's in
    anything, so a field added to it (``ModelSpec``'s among them) would refuse every capture
    made before: what a new computation needs that the fingerprint lacks is read elsewhere
    (the config, as ``stages.apply.chunks`` reads the intermediate size)."""
    fp = tiny_model.fingerprint
    assert sorted(fp) == ["dtype", "model_type", "name", "rope", "spec", "weights"]
    assert sorted(fp["spec"]) == ["head_dim", "hidden", "max_positions", "model_type",
                                  "n_heads", "n_kv_heads", "n_layers", "rms_eps", "vocab"]


def test_run_capture_then_replay_from_the_command_line(tmp_path, capsys):
    args = ["run", "--model", "tiny-random", "--prompt", "capture me", "--max-new-tokens", "12",
            "--ignore-eos", "--seed", "5", "--budget", "10", "--sinks", "1", "--recent", "3",
            "--repair", "merge", "--capture", str(tmp_path), "--capture-level", "full", "--json"]
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    m = read_manifest(out["capture"])
    assert m["params"]["cache_params"]["budget"] == 10 and m["seed"] == 5 and m["complete"]
    assert m["prompt_ids"] == out["prompt_ids"]
    assert cli(["replay", str(tmp_path)]) == 0  # a root holding one run
    assert "12 steps" in capsys.readouterr().err
    assert cli(args) == 0 and cli(["replay", str(tmp_path)]) == 2  # now two runs: name one
    assert "holds 2 capture runs" in capsys.readouterr().err


def test_a_capture_from_another_kind_of_gpu_is_compared_within_tolerance(tmp_path, capsys):
    """The manifest names the kind of device (on a GPU its name and memory, which sets the
    prefill's chunks); replayed on another kind, floats are compared within the dtype's
    tolerance, with a note, as on another device."""
    assert cli(["run", "--model", "tiny-random", "--prompt", "which card", "--max-new-tokens",
                "4", "--ignore-eos", "--capture", str(tmp_path), "--json"]) == 0
    run_dir = json.loads(capsys.readouterr().out)["capture"]
    manifest = read_manifest(run_dir)
    here = device_kind(torch.device("cpu"))  # the CPU's model and a digest of its flags
    assert manifest["device"] == "cpu" and manifest["device_kind"] == here
    assert here.startswith("cpu: ") and ", flags " in here
    report = replay(run_dir)
    assert report.tolerance is None and not report.notes and not report.mismatches
    path = Path(run_dir) / "manifest.json"
    data = json.loads(path.read_text())
    data["device_kind"] = "NVIDIA H100 80GB HBM3, 81559 MiB"
    path.write_text(json.dumps(data))
    report = replay(run_dir)
    assert report.tolerance is not None and not report.mismatches
    assert report.notes == [f"captured on cpu (NVIDIA H100 80GB HBM3, 81559 MiB), replayed on "
                            f"cpu ({here}): floating-point outputs compared within "
                            f"{report.tolerance:g} (relative), sampled tokens taken from the "
                            "capture"]
