"""How many rows a grid benchmark steps together when ``--batch`` is not given: chosen by
measurement on this machine, once, and kept.

A batch's step reads the weights once for all its rows (docs/DESIGN.md, the batch), so B
rows cost less than B steps; how much less depends on the CPU (or GPU), the model, its
dtype and stage 1's path, and the threads a process runs. ``chosen`` times stage 1 of B
rows, each over its own copy of a prime of ``CONTEXT`` tokens (at most half the model's
positions), for B = 1, 2, 4, ... up to
``MOST``, and chooses the fewest rows whose tokens a second come within ``GAIN`` of the
most measured: past them, more rows only lengthen a grid's tail (and the rate need not
grow with B at every step: oneDNN's products of 2 rows can be slower than of 1). The choice is kept in
``cache_dir()/batch.json`` under what decides it (``device_kind``, torch's and this
package's versions, the model, its dtype and path, the threads), so every later run on the
machine takes the same B without measuring again.

A grid's numbers do not depend on B beyond rounding: each row is the session it would be
alone, and only a batch's products may add in another order (on the native path not even
that: docs/DESIGN.md, the batch).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..model import Model, cache_dir, device_kind, for_rows
from ..sampler import make_generator
from ..stages.apply import prime
from ..stages.generate import generate, generate_rows
from ..types import SamplerParams, Segment
from ..version import __version__

MOST = 32  # the most rows ``measure`` tries
BATCHES = tuple(2 ** k for k in range(MOST.bit_length()))  # 1, 2, 4, ... MOST
GAIN = 1.10  # the fewest rows whose tokens a second are within this of the most measured
CONTEXT = 256  # live slots a row while it is timed (at most half the model's positions)
REPS = 5  # timed steps of each B (their median), after one untimed
MEMORY_SHARE = 0.5  # the rows a process holds at once fill at most this of the free memory
GREEDY = SamplerParams(greedy=True)
HELP = ("default: the fewest that run near the most tokens a second, measured once on this "
        "machine and kept")  # ``--batch``'s default, in each grid benchmark's help


@dataclass(frozen=True)
class Choice:
    """The rows a step (``batch``), each B's stage-1 tokens a second as measured, and
    whether they came from the cache (measured by an earlier run on this machine)."""

    batch: int
    tokens_s: dict[int, float]
    kept: bool = False
    context: int = CONTEXT  # the live slots a row while timed

    def describe(self) -> str:
        """One line for a report: the choice and what it rests on."""
        rates = ", ".join(f"{b}: {t:,.1f}" for b, t in sorted(self.tokens_s.items()))
        return (f"{self.batch} rows a step, chosen by measurement on this machine (stage 1's "
                f"tokens a second by rows at {self.context} live slots: {rates})")


def key(model: Model, threads: int) -> str:
    """What decides the choice: the machine, the versions, the model and how it runs."""
    return " | ".join((device_kind(model.device), f"torch {torch.__version__}",
                       f"positronic-brain {__version__}", model.name, model.precision,
                       model.stage1_path, f"{threads} threads"))


def _tokens_s(model: Model, rows: int, states: list) -> float:
    """Stage 1's tokens a second over ``rows`` copies of a prime's state."""
    rows_model = for_rows(model, rows) if rows > 1 else model
    views = [s.view() for s in states[:rows]]
    gens = [make_generator(i, model.device) for i in range(rows)]
    if rows == 1:
        step = lambda: generate(model, views[0], GREEDY, gens[0])  # noqa: E731
    else:
        step = lambda: generate_rows(rows_model, views, [GREEDY] * rows, gens,  # noqa: E731
                                     [None] * rows)
    step()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return rows / sorted(times)[REPS // 2]


def measure(model: Model, threads: int) -> Choice:
    """Time stage 1 of 1, 2, 4, ... ``MOST`` rows (``threads`` torch threads) and choose the
    fewest rows whose tokens a second come within ``GAIN`` of the most measured."""
    context = min(CONTEXT, model.spec.max_positions // 2)
    ids = [(7 + 31 * i) % model.spec.vocab for i in range(context + 1)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        first = prime(model, [Segment(tuple(ids), "user")], capacity=context + 8)[0]
        states = [first] + [copy.deepcopy(first) for _ in range(MOST - 1)]
        rates = {b: _tokens_s(model, b, states) for b in BATCHES}
    finally:
        torch.set_num_threads(before)
        model.rows.clear()  # let the packed copy go
    best = max(rates.values())
    return Choice(min(b for b, t in rates.items() if t * GAIN >= best), rates, context=context)


def _kept(entry) -> Choice | None:
    """A kept entry of ``batch.json`` as a choice, or None where it is not one (damaged)."""
    try:
        rates = {int(b): float(t) for b, t in entry["tokens_s"].items()}
        batch, context = int(entry["batch"]), int(entry.get("context", CONTEXT))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return Choice(batch, rates, True, context) if batch >= 1 and batch in rates else None


def chosen(model: Model, threads: int) -> Choice:
    """The kept choice for ``model`` at ``threads`` threads on this machine, measured (and
    kept, where the cache folder takes it) if there is none or it is damaged."""
    path, k = cache_dir() / "batch.json", key(model, threads)
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    choice = _kept(kept.get(k))
    if choice is not None:
        return choice
    choice = measure(model, threads)
    kept[k] = {"batch": choice.batch, "tokens_s": asdict(choice)["tokens_s"],
               "context": choice.context}
    tmp = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(kept, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a cache folder that takes nothing: the next run measures again
    return choice


def available_bytes() -> int | None:
    """The memory the machine has free for new work (/proc/meminfo's MemAvailable), or
    None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resolve(cfg, model: Model, threads: int, row_bytes: Sequence[int] = (),
            processes: int = 1):
    """``cfg`` (a grid benchmark's config) with its ``batch`` as given (``--batch``) or, where
    none was, ``chosen``'s for ``model`` at ``threads`` threads (the threads each of the
    run's ``processes`` steps with), at most as many rows as ``MEMORY_SHARE`` of the free
    memory holds in every process, whichever rows of the grid (``row_bytes``: each one's
    bytes at its longest) come together: the largest; and the report's line on the choice
    (empty where given). The share's other half leaves room for what a row holds for a
    moment (a cold store's old storage while it grows), for what the rows are copied from
    (a trial's prime) and for the rest of the process."""
    if cfg.batch is not None:
        return cfg, ""
    choice, free = chosen(model, threads), available_bytes()
    line, batch = choice.describe(), choice.batch
    if row_bytes and free is not None:
        held = MEMORY_SHARE * free / max(processes, 1)
        # the bytes of the largest 1, 2, ... rows together, as many as a batch steps
        together = list(itertools.accumulate(sorted(row_bytes, reverse=True)[:batch]))
        if together[-1] > held:  # else every row fits, however few the grid has
            batch = max(1, sum(b <= held for b in together))
            line += (f"; {batch} rows, as many as {MEMORY_SHARE:.0%} of the free memory "
                     f"({free / 2**30:.1f} GiB) holds in each of {processes} process(es) at "
                     f"the grid's largest rows ({max(row_bytes) / 2**20:,.0f} MiB at most)")
    return dataclasses.replace(cfg, batch=batch), line
