"""`bench speed`'s busy part: the process it starts beside a run keeps a core busy while
the run is timed, and is gone when the timing ends or when the benchmark is killed."""
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from positronic_brain.bench import busy, speed
from positronic_brain.types import UserError


def _cpu_ticks(pid: int) -> int:
    """The user and system CPU time process ``pid`` has used, in clock ticks."""
    fields = open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` has exited (or is a zombie) within ``within_s`` seconds."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_spinner_keeps_a_core_busy_and_stops_with_the_block():
    with busy._spinner() as proc:  # pylint: disable=protected-access
        before, end = _cpu_ticks(proc.pid), time.monotonic() + 30
        while _cpu_ticks(proc.pid) - before < 5 and time.monotonic() < end:
            time.sleep(0.05)  # it spins (5 ticks of CPU time), however loaded the machine
        assert _cpu_ticks(proc.pid) - before >= 5
    assert proc.poll() is not None


def test_the_spinner_stops_when_its_start_is_interrupted(monkeypatch):
    started = []

    def interrupted(_):
        started.append(True)
        raise KeyboardInterrupt

    monkeypatch.setattr(busy, "time", SimpleNamespace(sleep=interrupted))  # busy's alone
    with pytest.raises(KeyboardInterrupt), busy._spinner():  # pylint: disable=protected-access
        pass
    assert started
    # the process it started was killed and waited for: no child of this test is left
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    assert not [c for c in children if _is_spinner(int(c))]


def _is_spinner(pid: int) -> bool:
    try:
        return "getppid" in Path(f"/proc/{pid}/cmdline").read_text()
    except FileNotFoundError:
        return False


def test_the_busy_part_fits_the_model_positions():
    assert busy.context(5, 8192) == busy.CONTEXT
    assert busy.context(2, 128) == 128 - 3 * busy.TIMINGS * busy.STEPS - 1
    with pytest.raises(UserError, match="leave no prompt of 16 tokens"):
        busy.context(5, 128)


def test_the_spinner_stops_when_the_benchmark_is_killed():
    code = ("import sys, time\nfrom positronic_brain.bench import busy\n"
            "spinning = busy._spinner()\nprint(spinning.__enter__().pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([parent.stdout], [], [], 300)[0], "the spinner did not start"
        pid = int(parent.stdout.readline())
        assert not _gone(pid, 0.3)  # spinning while its parent lives
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(pid, 10.0)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_a_gpu_run_takes_no_busy_part():
    """The busy part times the CPU's threads: a GPU run leaves it out, and asked for it,
    refuses in one line."""
    assert "busy" not in speed.SpeedConfig.preset(False, device="cuda").parts
    assert "busy" in speed.SpeedConfig.preset(False).parts
    with pytest.raises(UserError, match="--parts busy measures the CPU only, not cuda"):
        speed.SpeedConfig.preset(False, device="cuda", parts=("stage", "busy"))
