"""``bench speed``'s busy machine (``busy``): ``run``'s ms a token while one other process
keeps a core busy, against the machine idle, each repetition timing both in turn.

``run`` chooses its threads when it starts from the cores it finds free (``threads.use``:
torch's threads spin-wait for a peer, so a thread on a core another process holds makes
every product wait for it). Here each repetition chooses as ``run`` would with the machine
idle and steps the loop; then starts a process that spins on one core, chooses again and
steps the loop on that choice, and on torch's default too (every core: what the choice
avoids); then stops the spinner; every other repetition takes the busy half first. The loop
is ``run``'s with no flags: stage 1 on the path ``--compile auto`` takes, no budget, the
default sampler (temperature 1)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import common
from .. import native, threads
from ..loop import Session
from ..model import NATIVE, Model
from ..special_tokens import TokenPolicy
from ..types import SamplerParams, Segment, require
from .common import Table, fmt
from .result import Target

BUSY_TARGET = 2.0  # ms a token with one other busy process / idle, threads as run chooses
STEPS = 8  # loop steps a timing
CONTEXT = 256  # the prompt's tokens (fewer where the model's positions hold fewer)
TIMINGS = 4  # a repetition's: idle and busy, each on the chosen threads and on every core
# spins on one core until its parent (this benchmark) is gone, even if that was killed
SPIN = ("import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
        "    for _ in range(200000):\n        pass\n")
STARTED_S = 0.3  # how long the spinner runs before the threads are chosen


@dataclass(frozen=True, kw_only=True)
class BusyRow:
    """``run``'s loop in ``dtype`` on ``stage1`` (plain or native), ms a token (the median
    over the repetitions) idle and with one other busy process, on the threads ``threads``
    gives: "chosen" (``threads.choose`` when each timing starts, as ``run`` does: the
    counts it chose idle and busy, the most common over the repetitions) or "default"
    (torch's default, every core, in both)."""

    dtype: str
    stage1: str
    threads: str
    idle_ms: float
    busy_ms: float
    idle_threads: int
    busy_threads: int
    ratio: float  # busy_ms / idle_ms


def run_model(model: Model, device: str, dtype: str, have: Sequence[Model]) -> Model:
    """The model ``run`` steps with no flags: ``model`` (plain) or, where ``--compile
    auto`` takes the native kernels, the native one of ``have``."""
    if native.auto([device], dtype)[0] != NATIVE:
        return model
    return next(m for m in have if m.compiled == NATIVE)


def _steps(reps: int) -> int:
    """The loop steps of ``reps`` repetitions and the warm-up round."""
    return (reps + 1) * TIMINGS * STEPS


def context(reps: int, max_positions: int) -> int:
    """The prompt's tokens: ``CONTEXT``, or fewer so that the positions hold every step of
    ``reps`` repetitions and the warm-up."""
    steps = _steps(reps)
    n = min(CONTEXT, max_positions - steps - 1)
    require(n >= 16, f"the busy part's {reps} repetitions take {steps} steps: the model's "
            f"{max_positions} positions leave no prompt of 16 tokens")
    return n


def measure(model: Model, reps: int, task, random_prompt) -> list[BusyRow]:
    """``reps`` repetitions, each: the loop on the threads chosen idle; then, with a spinner
    started, on the threads chosen busy and on torch's default (every other repetition the
    busy half first). ``random_prompt(model, n, seed)`` gives the prompt's tokens."""
    ms = {k: [] for k in ("idle", "busy", "default idle", "default busy")}
    n = context(reps, model.spec.max_positions)
    session = Session(model, TokenPolicy(model.tokenizer), SamplerParams())
    session.prime([Segment(tuple(random_prompt(model, n, seed=4)), "user")],
                  n + 8 + _steps(reps))
    before = torch.get_num_threads()
    chosen = {"idle": [], "busy": []}
    tick = task(f"{model.precision} {model.stage1_path} busy machine", reps)

    def timed(name: str, count: int) -> None:
        torch.set_num_threads(count)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            session.step()
        ms[name].append((time.perf_counter() - t0) * 1e3 / STEPS)

    def half(busy: bool) -> None:  # the choice, then the loop on it and on every core
        kind = "busy" if busy else "idle"
        count = threads.choose()[0]
        chosen[kind].append(count)
        timed(kind, count)
        timed(f"default {kind}", threads.DEFAULT)

    try:
        for r in range(reps + 1):  # the first round warms up, untimed
            for busy in (False, True) if r % 2 else (True, False):
                if busy:
                    with _spinner():
                        half(True)
                else:
                    half(False)
            if r == 0:
                for xs in (*ms.values(), *chosen.values()):
                    xs.clear()
            else:
                tick()
    finally:
        torch.set_num_threads(before)
    dt, how = model.precision, model.stage1_path
    out = []
    for kind, idle, busy, counts in (
            ("chosen", "idle", "busy", (_mode(chosen["idle"]), _mode(chosen["busy"]))),
            ("default", "default idle", "default busy", (threads.DEFAULT,) * 2)):
        a, b = common.median(ms[idle]), common.median(ms[busy])
        out.append(BusyRow(dtype=dt, stage1=how, threads=kind, idle_ms=a, busy_ms=b,
                           idle_threads=counts[0], busy_threads=counts[1], ratio=b / a))
    return out


@contextmanager
def _spinner() -> Iterator[subprocess.Popen]:
    """One other process keeping a core busy while the block runs (and its start-up)."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN, str(os.getpid())])
    try:
        time.sleep(STARTED_S)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _mode(xs: list[int]) -> int:
    return max(set(xs), key=xs.count)


def targets(rows: list[BusyRow]) -> list[Target]:
    """With the threads ``run`` chooses: ms a token with one other busy process over idle."""
    return [Target(f"{r.stage1} run with one other busy process / idle, ms a token "
                   f"({r.busy_threads} of {r.idle_threads} threads chosen)", r.ratio,
                   f"<= {BUSY_TARGET}", r.ratio <= BUSY_TARGET, r.dtype)
            for r in rows if r.threads == "chosen"]


def table(rows: list[BusyRow]) -> Table:
    return Table(
        "A busy machine: `run`'s ms a token with one other busy process",
        ("dtype", "stage 1", "threads", "idle ms", "threads idle", "busy ms", "threads busy",
         "busy / idle"),
        tuple((r.dtype, r.stage1, r.threads, fmt(r.idle_ms, 1), str(r.idle_threads),
               fmt(r.busy_ms, 1), str(r.busy_threads), fmt(r.ratio, 2)) for r in rows),
        f"The loop of `run` with no flags (stage 1 on `--compile auto`'s path, no budget, "
        f"the default sampler) over a prompt of {CONTEXT} tokens (fewer where the "
        f"positions hold fewer), {STEPS} steps a timing; busy: a process "
        "spinning on one core started beside it (a Python loop). chosen: the threads "
        "`threads.choose` gives when the timing starts, as `run` chooses them (the cores "
        "free, at least one); default: torch's own, every core, which the choice avoids. "
        "idle: the machine as the benchmark found it. Each repetition times idle and busy in "
        "turn, every other one busy first.")
