"""The threads a command runs on (``threads``): the cores free when it starts, or
``--threads``; reported by ``run --json``, recorded by a capture and used again by its replay
(a float32 product of one row splits by the thread count, so its bits depend on it)."""
import json
import os
from pathlib import Path

import pytest
import torch

from positronic_brain import threads
from positronic_brain.cli import main as cli
from positronic_brain.replay import replay
from positronic_brain.types import UserError


BUSY_CORES = threads.busy_cores  # the real one (the suite's fixture has each test see none)


def test_the_free_cores_at_most_torch_s_default_and_at_least_one(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(threads, "DEFAULT", 8)
    assert threads.choose(busy=0.2) == (8, "0.2 of 8 cores busy at the start")
    assert threads.choose(busy=3.4)[0] == 5  # one busy process costs about its share
    assert threads.choose(busy=7.9)[0] == 1 and threads.choose(busy=12.0)[0] == 1
    monkeypatch.setattr(threads, "DEFAULT", 4)  # OMP_NUM_THREADS=4, say
    assert threads.choose(busy=0.0)[0] == 4
    assert threads.choose(3) == (3, "--threads")
    with pytest.raises(UserError, match="threads must be >= 1, got 0"):
        threads.choose(0)


def test_the_cores_load_is_read_from_proc_stat(monkeypatch):
    """Busy time over total time between two readings, times the cores; none readable: torch's
    default, said so."""
    monkeypatch.setattr(threads, "busy_cores", BUSY_CORES)
    readings = iter([(100, 1000), (150, 1100)])  # half of the time busy
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    assert threads.busy_cores(0.0) == pytest.approx(2.0)
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    assert threads.busy_cores(0.0) is None
    assert threads.choose()[1].startswith("torch's default (the cores' load cannot be read")
    if Path("/proc/stat").exists():  # this machine's own, as the CLI reads it
        monkeypatch.undo()
        busy = BUSY_CORES(0.05)
        # busy time over total time is at most 1 (a correctly rounded quotient), so exactly
        assert busy is not None and 0 <= busy <= (os.cpu_count() or 1)


def test_run_reports_its_threads_and_refuses_none(capsys):
    assert cli(["run", "--model", "tiny-random", "--prompt", "x", "--max-new-tokens", "2",
                "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["threads"] == {"count": 1, "why": "--threads"}
    assert cli(["run", "--model", "tiny-random", "--prompt", "x", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("threads must be >= 1, got 0")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: a thread count cannot differ")
def test_a_capture_replays_on_the_threads_it_ran_on(tmp_path, capsys):
    """A float32 run on one thread replays bit for bit in a process on two, and leaves it on
    two; a manifest whose count is not one is refused in one line."""
    assert cli(["run", "--model", "tiny-random", "--prompt", "one thread, then two",
                "--max-new-tokens", "8", "--ignore-eos", "--seed", "3", "--budget", "8",
                "--sinks", "1", "--recent", "2", "--threads", "1", "--capture", str(tmp_path),
                "--json"]) == 0
    run_dir = Path(json.loads(capsys.readouterr().out)["capture"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["threads"] == 1
    torch.set_num_threads(2)
    report = replay(run_dir)
    assert report.ok and report.tolerance is None, [str(m) for m in report.mismatches[:3]]
    assert torch.get_num_threads() == 2
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "threads": 0}))
    with pytest.raises(UserError, match="threads must be >= 1, got 0"):
        replay(run_dir)
