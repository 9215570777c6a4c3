"""What every benchmark's result holds and how it is shown: ``Result`` (the run's command,
model, machine, targets and time; each benchmark's result is a dataclass that adds its
config and its rows), ``Target`` and its table, ``Machine``, and ``Journal``, the file
that lets an interrupted grid resume where it stopped.

A result becomes JSON in one way (``Result.to_json``: its fields, nested dataclasses
included), written as results.json and printed by ``--json``; tables, plots and the
report read its attributes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..plain import landed
from ..stages.apply import arena
from ..types import UserError
from .common import Table, cpu_name, duration, fmt, write_text


@dataclass(frozen=True)
class Machine:
    """The machine a run measured on, and its load at the start and at the end."""

    cpu: str
    cores: int | None
    torch_threads: int
    torch: str
    transformers: str
    python: str
    loadavg_start: tuple[float, ...]
    loadavg_end: tuple[float, ...] = ()
    gpu: str | None = None

    @classmethod
    def now(cls) -> "Machine":
        import transformers

        return cls(cpu_name(), os.cpu_count(), torch.get_num_threads(), torch.__version__,
                   transformers.__version__, platform.python_version(), _load(),
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_initialized() else None)

    def ended(self) -> "Machine":
        """The same machine with its load average now, at the end of the run."""
        return dataclasses.replace(self, loadavg_end=_load())

    def facts(self, threads: bool = False) -> str:
        """The machine as a report names it: GPU, CPU, cores, (torch threads,) load."""
        end = self.loadavg_end[0] if self.loadavg_end else "–"
        return ((f"{self.gpu} (GPU), " if self.gpu else "") + f"{self.cpu}, {self.cores} cores, "
                + (f"{self.torch_threads} torch thread(s), " if threads else "")
                + f"load average {self.loadavg_start[0]} at the start, {end} at the end")


def _load() -> tuple[float, ...]:
    return tuple(round(x, 2) for x in os.getloadavg())


@dataclass(frozen=True)
class Target:
    """A goal from the project's issues, reported and never asserted: ``met`` is None
    where nothing was measured to hold against it."""

    what: str
    value: float | None
    target: str  # e.g. ">= 0.95"
    met: bool | None
    dtype: str | None = None  # the precision it was measured in, where a run has several
    unit: str | None = None  # "B": ``value`` is a count of bytes
    context: int | None = None  # the context (tokens) it was measured at, where one


def target_table(targets: list[Target], digits: int = 3, note: str = "") -> Table:
    """The targets as a table (a dtype column where any target names one)."""
    dtypes = any(t.dtype for t in targets)

    def value(t: Target) -> str:
        return f"{t.value:,.0f} B" if t.unit == "B" and t.value is not None else fmt(t.value, digits)

    return Table(
        "Targets (reported, not asserted)",
        ("what", *(("dtype",) if dtypes else ()), "value", "target", "met"),
        tuple((t.what, *((t.dtype or "–",) if dtypes else ()), value(t), t.target,
               "–" if t.met is None else "yes" if t.met else "NO") for t in targets),
        note if targets else "None: no target of this benchmark reads the cells this run holds.")


@dataclass(kw_only=True)
class Result:
    """What every benchmark's result holds; each benchmark's result adds its ``config``
    and its rows."""

    benchmark: str
    command: str  # the command that reproduces the run
    model: str
    quick: bool
    machine: Machine
    targets: list[Target] = field(default_factory=list)
    elapsed_s: float = 0.0  # the whole run's, a resumed run's earlier parts included
    earlier_s: float | None = 0.0  # of it, before a --resume (None: not recorded)
    batch_choice: str = ""  # a grid's rows a step, where chosen by measurement (batch_size)
    stage1: str = ""  # a grid's stage-1 path (``grid.load``): native or plain

    def to_json(self) -> dict:
        """The result as JSON: every field, nested dataclasses as objects."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def regenerate(self, quick_version: bool = True) -> str:
        """A report's first sentence: the command that made it (with the rows a step a grid
        chose by measurement, so that a rerun steps the same), how long it took, and that
        every number in it comes from that run."""
        quick = "; `make bench` runs the quick version" if quick_version else ""
        command, config = self.command, getattr(self, "config", None)
        if self.batch_choice and getattr(config, "batch", None):  # the rows chosen, pinned
            command += f" --batch {config.batch}"
        if self.earlier_s is None:
            took = (f"its last part took {duration(self.elapsed_s)}, resumed with --resume "
                    "from a journal that does not record the parts before")
        else:
            took = f"this run took {duration(self.elapsed_s)}" + (
                f", {duration(self.earlier_s)} of it before it was resumed with --resume"
                if self.earlier_s else "")
        return (f"Regenerate with `{command}` ({took}{quick}). Every number below comes "
                "from that one run.")


@dataclass(frozen=True)
class KVCost:
    """What a budget costs in a model's K/V cache: its (layer, KV head)s and the bytes of one
    K/V pair (a key and a value of one head, in the arena's dtypes)."""

    heads: int
    pair_bytes: int

    @classmethod
    def of(cls, model) -> "KVCost":
        a = arena(model, 1)  # the arena's own dtypes
        return cls(a.kt.shape[0] * a.kt.shape[1],
                   a.kt.shape[2] * (a.kt.element_size() + a.v.element_size()))

    def sentence(self, budgets, full_tokens: int, full_what: str) -> str:
        """A report's sentence: the K/V pairs, bytes and fraction of the full cache of
        ``full_tokens`` tokens each budget keeps at most, whatever its allocation."""
        each = "; ".join(f"budget {b}: {b * self.heads:,} pairs, "
                         f"{b * self.heads * self.pair_bytes / 2 ** 20:.2f} MiB, "
                         f"{b / full_tokens:.0%} of the full cache" for b in budgets)
        return (f"K/V memory a cell keeps at most, whatever its allocation (budget x "
                f"{self.heads} (layer, KV head)s, {self.pair_bytes} bytes a pair; the full "
                f"cache: {full_what}, {full_tokens:,} tokens): {each}.")


def model_facts(res) -> str:
    """``Model `smollm2` (float32, stage 1 native, quick), 8192 positions``: a report's
    first facts, from a result with a ``dtype`` and ``max_positions`` beside ``Result``'s
    fields."""
    path = f", stage 1 {res.stage1}" if res.stage1 else ""
    return (f"Model `{res.model}` ({res.dtype}{path}{', quick' if res.quick else ''}), "
            f"{res.max_positions} positions")


# --- resuming ---------------------------------------------------------------------------------

class Journal:
    """``items.jsonl`` in a run's ``--out`` folder: a first line naming the benchmark and
    its config, then one line per finished item of its grid (the item's index in the
    grid's list, its row, and the seconds the run had taken when it finished, its earlier
    parts included), written as each finishes. A run with ``--resume`` keeps the rows of a
    journal whose first line is its own and measures only the rest; any other journal
    there is refused (without ``--resume`` a run starts a new one, from the first item it
    finishes). ``earlier``: the seconds of the parts before this one (the last kept item's;
    None where a kept line does not say, a journal from before they did)."""

    def __init__(self, path: Path, head: dict, resume: bool, row: type) -> None:
        self.path, self.done, self.seconds = path, {}, {}
        self.first, self.started = json.dumps(head, sort_keys=True), False
        self.start, self.earlier = time.perf_counter(), 0.0
        if resume and path.exists():
            lines = path.read_text().splitlines()
            if lines and lines[0] != self.first:
                raise UserError(f"--resume: {path} is another run's (its benchmark or config "
                                "differs); give another --out or leave out --resume")
            for line in lines[1:]:
                try:
                    item = json.loads(line)
                    self.done[item["index"]] = row(**item["row"])
                except (ValueError, KeyError, TypeError):
                    break  # a line cut short when the run stopped: measured again
                self.seconds[item["index"]] = item.get("seconds")
            taken = list(self.seconds.values())
            self.earlier = None if None in taken else max(taken, default=0.0)

    def _line(self, index: int, row: Any) -> str:
        return json.dumps({"index": index, "row": dataclasses.asdict(row),
                           "seconds": self.seconds[index]}) + "\n"

    def add(self, index: int, row: Any) -> None:
        """Item ``index`` is finished: its row goes on the file at once. The first one
        writes the file anew (atomically: its first line and the rows kept), so a run that
        stops before measuring anything leaves the journal it found as it was."""
        self.done[index] = row
        self.seconds[index] = round((self.earlier or 0.0) + time.perf_counter() - self.start, 3)
        if not self.started:
            write_text(self.path, self.first + "\n" + "".join(
                self._line(i, r) for i, r in self.done.items()))
            self.started = True
            landed()  # the --out folder holds the work: kept whatever follows
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(self._line(index, row))
