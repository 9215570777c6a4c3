"""How many threads torch runs a step on, chosen from what the machine has free when a
command starts (``use``).

torch's threads wait for each other by spinning: where another busy process holds a core,
a step's threads keep waiting for a peer the kernel has descheduled, and on two cores one
busy process beside a run made it five times as slow, where one thread fewer costs about
its share. So the CLI samples how busy the cores are (``/proc/stat``, over a tenth of a
second) and runs on the cores left free, at least one, at most torch's own default
(which ``OMP_NUM_THREADS`` sets); ``--threads N`` says how many instead. A float32 product
of one row splits by the thread count (``forward.linear``), so a capture records it and
replay runs on the same number.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .types import require

DEFAULT = torch.get_num_threads()  # torch's own choice at import (OMP_NUM_THREADS's if set)
SAMPLE_S = 0.1  # how long the cores' load is sampled
CHOSEN: dict = {"count": DEFAULT, "why": "torch's default"}  # what ``use`` chose last


def _cpu_times() -> tuple[int, int] | None:
    """The machine's (busy, total) CPU time so far in clock ticks, from /proc/stat's first
    line (idle and iowait are not busy); None where there is no such file."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def busy_cores(sample_s: float = SAMPLE_S) -> float | None:
    """How many of the machine's cores other work kept busy over ``sample_s`` seconds
    (this process sleeps meanwhile), or None where it cannot be read."""
    a = _cpu_times()
    time.sleep(sample_s)
    b = _cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def choose(requested: int | None = None, busy: float | None = None) -> tuple[int, str]:
    """The threads a run takes and why: ``requested`` (``--threads``), else the cores
    ``busy`` (default: sampled now) leaves free of torch's default, at least one."""
    if requested is not None:
        require(requested >= 1, f"threads must be >= 1, got {requested}")
        return requested, "--threads"
    busy = busy_cores() if busy is None else busy
    if busy is None:
        return DEFAULT, "torch's default (the cores' load cannot be read here)"
    cores = os.cpu_count() or DEFAULT
    free = max(1, min(DEFAULT, round(cores - busy)))
    return free, f"{busy:.1f} of {cores} cores busy at the start"


def use(requested: int | None = None) -> dict:
    """Set torch's threads by ``choose``; returns (and keeps in ``CHOSEN``) the count and
    why, as ``run --json`` reports them."""
    count, why = choose(requested)
    torch.set_num_threads(count)
    CHOSEN.update(count=count, why=why)
    return dict(CHOSEN)


def current() -> dict:
    """The threads torch runs on now, and why (``use``'s reason if it set them)."""
    count = torch.get_num_threads()
    why = CHOSEN["why"] if CHOSEN["count"] == count else "set outside positronic-brain"
    return {"count": count, "why": why}


@contextmanager
def running(count: int | None):
    """Run the block on ``count`` threads (None: as now), then go back: replay runs a capture
    on the threads it ran on, whose float32 products split by them."""
    before = torch.get_num_threads()
    if count is not None:
        require(type(count) is int and count >= 1, f"threads must be >= 1, got {count!r}")
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
