"""The `run` command: JSON output, streaming, and one-line errors with exit code 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from positronic_brain.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_has_the_promised_keys(capsys):
    code, out, err = _run(capsys, "run", "--model", "tiny-random", "--prompt", "hello",
                          "--max-new-tokens", "5", "--ignore-eos", "--json", "--seed", "3")
    assert code == 0, err
    d = json.loads(out)
    for key in ("model", "dtype", "prompt_ids", "generated_ids", "text", "steps", "ledger"):
        assert key in d
    assert d["model"] == "tiny-random" and d["dtype"] == "float32"
    assert len(d["prompt_ids"]) == 5  # one byte token per character, nothing added
    assert len(d["generated_ids"]) == len(d["steps"]) == 5
    assert [s["step"] for s in d["steps"]] == [1, 2, 3, 4, 5]
    # the cache holds the prompt minus the pending token, plus one token per step
    assert [s["cache_len"] for s in d["steps"]] == [4 + i for i in range(1, 6)]
    assert all(s["ms"] > 0 for s in d["steps"])
    ledger = d["ledger"]
    assert [r["position"] for r in ledger] == list(range(9))
    assert [r["token_id"] for r in ledger] == (d["prompt_ids"] + d["generated_ids"])[:9]
    assert {r["source"] for r in ledger} == {"user", "assistant"}


def test_run_is_reproducible_with_a_seed(capsys):
    argv = ["run", "--model", "tiny-random", "--prompt", "abc", "--max-new-tokens", "8",
            "--ignore-eos", "--json", "--temperature", "0.9", "--top-k", "50", "--top-p", "0.9",
            "--min-p", "0.01", "--repetition-penalty", "1.2"]
    a = json.loads(_run(capsys, *argv, "--seed", "1")[1])["generated_ids"]
    b = json.loads(_run(capsys, *argv, "--seed", "1")[1])["generated_ids"]
    assert a == b


def test_run_streams_text(capsys):
    code, out, _ = _run(capsys, "run", "--model", "tiny-random", "--prompt", "hi",
                        "--max-new-tokens", "6", "--ignore-eos", "--greedy")
    assert code == 0 and len(out.strip("\n")) > 0


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--top-p", "0"], "top-p"),
    (["--prompt", "x", "--top-p", "1.5"], "top-p"),
    (["--prompt", "x", "--top-k", "-1"], "top-k"),
    (["--prompt", "x", "--model", "/no/such/model"], "model not found"),
    (["--prompt", "a long prompt", "--capacity", "3"], "capacity"),
    (["--prompt", "x", "--dtype", "int4"], "dtype"),
    (["--prompt", "x", "--device", "tpu"], "unknown device 'tpu'"),
    (["--prompt", "x", "--device", "cpu:3"], "unknown device 'cpu:3'"),
    (["--prompt", "x", "--device", "cuda:99"], "cuda:99"),
    (["--prompt", "x", "--max-new-tokens", "-2"], "max-new-tokens"),
    (["--prompt", "x", "--repetition-penalty", "0"], "repetition penalty"),
    (["--prompt", "x", "--seed", str(2 ** 70)], "64 bits"),
    (["--prompt", "hi \udcff there"], "not valid UTF-8"),  # a byte 0xff in argv
    (["--prompt", "x", "--system", "\udcfe"], "not valid UTF-8"),
    (["--prompt", "x", "--capacity", "999999999999"], "positions"),
    ([], "--prompt"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    if "--model" not in argv:
        argv = argv + ["--model", "tiny-random"]
    code, out, err = _run(capsys, "run", *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("positronic-brain: error: "), err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", [["run", "--prompt", "x"], ["chat", "--script", "SCRIPT"],
                                     ["bench", "passkey", "--quick"]])
def test_cuda_without_cuda_is_one_line_and_exit_2(capsys, tmp_path, command):
    (tmp_path / "turns.txt").write_text("hello\n")
    command = [str(tmp_path / "turns.txt") if c == "SCRIPT" else c for c in command]
    code, _, err = _run(capsys, *command, "--model", "tiny-random", "--device", "cuda")
    assert code == 2 and err.count("\n") == 1 and "no CUDA device" in err, err


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = _run(capsys, "run", "--prompt", "x", "--model", str(tmp_path))
    assert code == 2 and "unsupported model architecture 'gpt2'" in err


def test_folder_without_config(capsys, tmp_path):
    code, _, err = _run(capsys, "run", "--prompt", "x", "--model", str(tmp_path))
    assert code == 2 and "no config.json" in err


def test_console_script_exit_code():
    """The installed entry point (a separate process) turns a bad input into exit 2."""
    proc = subprocess.run([sys.executable, "-m", "positronic_brain", "run", "--prompt", "x",
                           "--top-p", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "positronic-brain: error: top-p must be in (0, 1], got 2.0"


def test_model_help_names_every_tiny_model():
    from positronic_brain.cli.args import MODEL_HELP
    from positronic_brain.model import TINY_CONFIGS

    assert all(name in MODEL_HELP for name in TINY_CONFIGS)


def _one_line_exit_2(capsys, *argv) -> str:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_outputs_are_checked_before_the_work_and_never_replace_an_input(capsys, tmp_path):
    """--out: a file name in a folder that exists, not a folder, not a file the command
    reads (compose, export, transfer apply); a failed write is one line; an input is left
    as it was."""
    one, two = tmp_path / "a.pbs", tmp_path / "b.pbs"
    for path, prompt in ((one, "first part"), (two, "second part")):
        script = tmp_path / "script.txt"
        script.write_text(f"{prompt}\n/save {path}\n")
        code, _, err = _run(capsys, "chat", "--model", "tiny-random", "--script", str(script),
                            "--max-new-tokens", "2")
        assert code == 0 and path.exists(), err
    before = one.read_bytes()
    inside_a_file = str(one / "c.pbs")
    for argv, message in (
            (["compose", str(one), str(two), "--out", str(one)], "a file this command reads"),
            (["compose", str(one), str(two), "--out", ""], "not a file name"),
            (["compose", str(one), str(two), "--out", inside_a_file], "no folder"),
            (["compose", str(one), str(two), "--out", str(tmp_path)], "is a folder"),
            (["export", str(one), "--out", str(tmp_path / "." / "a.pbs")], "reads"),
            (["export", str(one), "--out", ""], "not a file name"),
            (["export", str(one), "--out", inside_a_file], "no folder"),
            (["export", str(one), "--out", str(tmp_path / "p.pbs"), "--uids", f"0-{2 ** 70}"],
             "--uids"),
            (["transfer", "apply", str(one), "--projector", str(two), "--source", "tiny-random",
              "--target", "tiny-random", "--out", str(one)], "reads"),
            (["bench", "quality", "--model", "tiny-random", "--quick", "--out", inside_a_file],
             "cannot make the folder")):
        assert message in _one_line_exit_2(capsys, *argv), argv
    assert one.read_bytes() == before


@pytest.mark.parametrize("command", [["inspect"], ["compare", "RUN"]])
@pytest.mark.parametrize("last", ["0", "-3"])
def test_last_below_one_is_refused_in_every_mode(capsys, tmp_path, command, last):
    run = tmp_path / "cap"
    code, _, err = _run(capsys, "run", "--model", "tiny-random", "--prompt", "hello",
                        "--max-new-tokens", "2", "--capture", str(run))
    assert code == 0, err
    (runs,) = list(run.iterdir())
    argv = [a.replace("RUN", str(runs)) for a in command] + [str(runs), "--last", last]
    assert "--last must be >= 1" in _one_line_exit_2(capsys, *argv)


def test_a_script_that_is_not_text_is_one_line(capsys, tmp_path):
    script = tmp_path / "s.bin"
    script.write_bytes(b"\xa8\xff\x00binary")
    err = _one_line_exit_2(capsys, "chat", "--model", "tiny-random", "--script", str(script))
    assert "not UTF-8" in err


@pytest.mark.parametrize("argv, message", [
    (["--param", "x=1"], "x: a field of none of the policies"),
    (["--policies", "NOFILE:X"], "no such file"),
])
def test_bench_quality_checks_its_scorers_before_measuring(capsys, tmp_path, argv, message):
    argv = [a.replace("NOFILE", str(tmp_path / "nofile.py")) for a in argv]
    err = _one_line_exit_2(capsys, "bench", "quality", "--model", "tiny-random", "--quick", *argv)
    assert message in err


def test_a_folder_without_a_tokenizer_is_one_line(capsys, tmp_path):
    from transformers import LlamaConfig  # pylint: disable=import-outside-toplevel
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300).save_pretrained(tmp_path)
    err = _one_line_exit_2(capsys, "run", "--model", str(tmp_path), "--prompt", "hi")
    assert "cannot read a tokenizer" in err


def test_a_refused_command_leaves_no_folder_or_capture_it_made(capsys, tmp_path):
    """A command refused after it made its capture, --save or --out folders, but before any
    of its work reached them, takes them back: nothing is left but the inputs; a refusal
    keeps a folder that was there before it (empty or not)."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("hello\nworld\n")
    (tmp_path / "there").mkdir()
    tiny, long = ["--model", "tiny-random"], "word " * 600
    for argv, message in (
            (["run", *tiny, "--prompt", long, "--capture", str(tmp_path / "a" / "caps")],
             "capacity"),
            (["run", *tiny, "--prompt", "hi", "--budget", "600", "--capture",
              str(tmp_path / "there")], "positions"),
            (["run", *tiny, "--prompts", str(prompts), "--batch", "2", "--budget", "600",
              "--capture", str(tmp_path / "b"), "--save", str(tmp_path / "c")], "positions"),
            (["chat", *tiny, "--script", str(prompts), "--max-new-tokens", "0", "--capture",
              str(tmp_path / "d")], "max-new-tokens"),
            (["bench", "ruler", "--jobs", "0", "--out", str(tmp_path / "e" / "f")], "--jobs"),
            (["bench", "quality", *tiny, "--quick", "--text", str(tmp_path / "nosuch.txt"),
              "--out", str(tmp_path / "g")], "nosuch.txt"),
            (["bench", "passkey", *tiny, "--quick", "--out", str(tmp_path / "h"), "--report",
              str(tmp_path)], "is a folder")):
        assert message in _one_line_exit_2(capsys, *argv), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there", "two.txt"]
    assert not list((tmp_path / "there").iterdir())


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here (a folder that "
                    "takes no new file)")
def test_an_output_that_cannot_be_written_is_refused_before_the_work(capsys, monkeypatch,
                                                                      tmp_path):
    """/proc takes no new file: --save (a file, or with --prompts a folder) and calibrate's
    --out are refused in one line before the model generates (run streams its text to
    stdout) or calibrates anything."""
    from positronic_brain import calibrate  # pylint: disable=import-outside-toplevel

    def never(*_args, **_kw):
        raise AssertionError("the work ran before the output was checked")

    monkeypatch.setattr(calibrate, "calibrate", never)
    prompts = tmp_path / "two.txt"
    prompts.write_text("hello\nworld\n")
    tiny = ["--model", "tiny-random", "--compile", "none"]
    for argv, message in (
            (["run", *tiny, "--prompt", "hi", "--save", "/proc/x.pbs"], "cannot write"),
            (["run", *tiny, "--prompts", str(prompts), "--save", "/proc/xdir"],
             "cannot make the folder"),
            (["calibrate", *tiny, "--trials", "1", "--lengths", "300", "--out",
              "/proc/h.json"], "cannot write")):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, argv


def test_a_refusal_after_the_work_landed_takes_nothing_back(capsys, monkeypatch, tmp_path):
    """A command refused once its work has reached its outputs (here a capture's stages,
    then a failure to report) keeps all of them, folders included."""
    from positronic_brain.cli import commands  # pylint: disable=import-outside-toplevel

    def refuse(*_args, **_kw):
        raise commands.UserError("refused after the work")

    monkeypatch.setattr(commands, "_report", refuse)
    err = _one_line_exit_2(capsys, "run", "--model", "tiny-random", "--prompt", "hello",
                           "--max-new-tokens", "2", "--capture", str(tmp_path / "a" / "caps"))
    assert "refused after the work" in err
    (runs,) = list((tmp_path / "a" / "caps").iterdir())
    assert (runs / "manifest.json").is_file() and list(runs.glob("*_s4_apply.pt"))


def test_inspect_prints_nothing_when_it_refuses(capsys, tmp_path):
    """inspect refuses a step the capture lacks, or a modified file, before it prints any of
    its summary; bench --resume refuses an --out folder that is not there."""
    run = tmp_path / "cap"
    code, _, err = _run(capsys, "run", "--model", "tiny-random", "--prompt", "hello",
                        "--max-new-tokens", "2", "--capture", str(run))
    assert code == 0, err
    (runs,) = list(run.iterdir())
    code, out, err = _run(capsys, "inspect", str(runs), "--step", "99")
    assert code == 2 and out == "" and "step 99 is not in this capture" in err
    (score,) = runs.glob("000001_s2_score.pt")
    score.write_bytes(score.read_bytes()[:-7])
    code, out, err = _run(capsys, "inspect", str(runs))
    assert code == 2 and out == "" and "sha256 differs" in err
    err = _one_line_exit_2(capsys, "bench", "passkey", "--quick", "--resume", "--out",
                           str(tmp_path / "none"))
    assert "--resume: no folder" in err and not (tmp_path / "none").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here (a folder that "
                    "takes no new file)")
def test_a_page_that_cannot_be_written_is_refused_before_it_is_drawn(capsys, monkeypatch,
                                                                      tmp_path):
    """inspect --html and compare --html check the page's file before reading the runs."""
    from positronic_brain import page  # pylint: disable=import-outside-toplevel
    run = tmp_path / "cap"
    for _ in range(2):
        code, _, err = _run(capsys, "run", "--model", "tiny-random", "--prompt", "hello",
                            "--max-new-tokens", "2", "--capture", str(run))
        assert code == 0, err
    runs = sorted(str(r) for r in run.iterdir())

    def never(*_args, **_kw):
        raise AssertionError("the page was drawn before its file was checked")

    monkeypatch.setattr(page, "run_data", never)
    for argv in (["inspect", runs[0]], ["compare", *runs]):
        assert "cannot write" in _one_line_exit_2(capsys, *argv, "--html", "/proc/p.html")
