"""`bench speed`'s busy part: the process it starts beside a run keeps a core busy while
the run is timed, and is gone when the timing ends or when the benchmark is killed."""
import os
import signal
import subprocess
import sys
import time

from positronic_brain.bench import busy


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
    with busy._spinner() as spinner:  # pylint: disable=protected-access
        pid = spinner.proc.pid
        before = _cpu_ticks(pid)
        time.sleep(0.5)
        used = _cpu_ticks(pid) - before
        assert used >= 0.3 * os.sysconf("SC_CLK_TCK") * 0.5  # at least 30% of a core
    assert spinner.proc.poll() is not None


def test_the_spinner_stops_when_the_benchmark_is_killed():
    code = ("import sys, time\nfrom positronic_brain.bench import busy\n"
            "s = busy._spinner().__enter__()\nprint(s.proc.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert not _gone(pid, 0.3)  # spinning while its parent lives
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(pid, 10.0)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
