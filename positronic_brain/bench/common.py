"""What the benchmarks share: timing, allocation counting, machine facts, and the report
(a rich table on stdout, one JSON object, report.md with PNG plots).

Timing rules: warm up first, take the median of several repetitions, and alternate
between the contenders inside one repetition so every contender sees the same load.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from ..plain import make_folder, output_file
from ..types import UserError, require


# --- timing -------------------------------------------------------------------------------

def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of per-round ratios: pairs taken in the same round share the machine's load,
    so this is steadier than a ratio of medians when the load drifts."""
    return median([a / b for a, b in zip(num, den, strict=True)])


def interleaved_ms(contenders: dict[str, Callable[[], object]], reps: int, warmup: int = 1,
                   after: dict[str, Callable[[], object]] | None = None,
                   tick: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Wall time in ms of each contender in each of ``reps`` rounds (after ``warmup``
    untimed rounds). One round runs every contender once, in turn, so machine load hits
    them alike; ``after[name]`` runs untimed after each call (e.g. crop a cache back)."""
    require(reps >= 1, f"repetitions must be >= 1, got {reps}")
    after = after or {}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    # the young generations only: a full collection walks every object the process holds
    # (hundreds of thousands with torch and a model loaded) and finds nothing a measurement
    # left (its tensors go by reference counts); each dtype's measurements start with a full
    # one (``speed.measure_dtype``)
    gc.collect(1)
    for r in range(warmup + reps):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            if name in after:
                after[name]()
            if r >= warmup:
                samples[name].append(dt)
        if tick is not None and r >= warmup:
            tick()
    return samples


def sync() -> None:
    """Wait for queued GPU work (a CUDA call returns before its kernels finish); nothing on
    a CPU-only run."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


# --- allocations ----------------------------------------------------------------------------

def bytes_allocated(fn: Callable[[], object]) -> int:
    """Bytes the CPU allocator hands out during one call of ``fn``, from the profiler's
    memory events: every allocation, also those an operator's kernel makes for itself
    (oneDNN's bfloat16 product copies a strided operand first, which a count of the
    tensors that operators return would miss); views and in-place writes cost nothing.
    Each operator's allocations net of what it frees itself, summed over the operators
    that allocate."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()
               if e.self_cpu_memory_usage > 0)


def operators(fn: Callable[[], object], most: int = 8) -> tuple[int, list[tuple[str, int]]]:
    """The operators one call of ``fn`` launches from Python (the profiler's top-level CPU
    events: each goes through torch's dispatcher, a fixed cost however small its work) and
    the ``most`` frequent names with their counts."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    top = [e.name for e in prof.events() if e.cpu_parent is None]
    return len(top), collections.Counter(top).most_common(most)


# operators whose result a host must wait for: a value read back, or an output whose size
# depends on the values (a boolean mask's selection counts its True entries first)
_READS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero",
          "unique_consecutive", "_unique2"}


class _HostReads(TorchDispatchMode):
    """Counts each operator that reads a tensor's values back to the host, by where it was
    called from (``host_reads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        masked = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
        sized = (name == "repeat_interleave" and "Tensor" in func._overloadname
                 and kwargs.get("output_size") is None)  # repeats given as a tensor
        if name in _READS or masked or sized:
            self.sites[_caller()] += 1
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame of this package that is not this module, as ``file:line``."""
    for frame in reversed(traceback.extract_stack()):
        if "positronic_brain" in frame.filename and not frame.filename.endswith("common.py"):
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


def host_reads(fn: Callable[[], object]) -> collections.Counter:
    """Where one call of ``fn`` waits for the device to read values back (on a GPU each
    drains the queue of launched work; on the CPU the same calls are counted, though
    nothing waits): ``file:line`` -> count. Counted: the operators that read values
    (``item``, ``int()``, ``bool()``, comparisons' truth, ``torch.equal``), that size their
    output by them (``nonzero``, a boolean mask's indexing), and ``tolist``, which reads a
    CPU tensor's memory with no operator. A tensor made from host values on a GPU (a copy
    from host memory) is not seen on the CPU; CUDA's sync debug mode sees it there."""
    mode = _HostReads()
    real = torch.Tensor.tolist

    def tolist(t: torch.Tensor):
        mode.sites[_caller()] += 1
        return real(t)

    torch.Tensor.tolist = tolist
    try:
        with mode:
            fn()
    finally:
        torch.Tensor.tolist = real
    return mode.sites


def cuda_syncs(fn: Callable[[], object]) -> int | None:
    """How many times one call of ``fn`` made the host wait for a CUDA device, by CUDA's
    own count (torch's sync debug mode warns at each: reads back and copies from host memory
    alike, which ``host_reads`` cannot see); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


# --- the machine ------------------------------------------------------------------------------

def copy_bandwidth_gbs(mbytes: int = 256, reps: int = 9, device: str = "cpu") -> float:
    """Memory bandwidth in GB/s of ``device`` from a large tensor copy (bytes read + bytes
    written, as STREAM counts a copy), median of ``reps``; ``mbytes`` must dwarf the caches."""
    src = torch.ones(mbytes * 2 ** 20 // 4, device=device)  # float32
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    ms = median(interleaved_ms({"copy": lambda: dst.copy_(src)}, reps)["copy"])
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (MiB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb / 1024


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- progress and tables ----------------------------------------------------------------------

@contextmanager
def progress() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """A rich progress bar on stderr. Yields ``task(description, total) -> tick``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        def task(description: str, total: int) -> Callable[[], None]:
            tid = bar.add_task(description, total=total)
            return lambda: bar.advance(tid)

        yield task


@dataclass(frozen=True)
class Table:
    """One result table: printed with rich on stdout and written as markdown."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""

    def __post_init__(self) -> None:
        assert all(len(r) == len(self.headers) for r in self.rows), f"ragged table {self.title!r}"

    def markdown(self) -> str:
        lines = [f"| {' | '.join(self.headers)} |", "|" + " --- |" * len(self.headers)]
        lines += [f"| {' | '.join(r)} |" for r in self.rows]
        return "\n".join(lines) + (f"\n\n{self.note}" if self.note else "")


def print_tables(tables: Sequence[Table]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table as RichTable

    console = Console()
    for t in tables:
        rt = RichTable(title=t.title, title_justify="left", caption=escape(t.note) if t.note else None,
                       caption_justify="left")
        for i, h in enumerate(t.headers):
            rt.add_column(h, justify="left" if i == 0 else "right")
        for r in t.rows:
            rt.add_row(*r)
        console.print(rt)


# --- files -----------------------------------------------------------------------------------

def line_plot(path: Path, title: str, xlabel: str, ylabel: str,
              series: dict[str, tuple[Sequence[float], Sequence[float], str | dict]],
              logy: bool = False) -> None:
    """One PNG with a line per series ``label -> (xs, ys, linestyle or plot keywords)`` (x on
    a log-2 axis)."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib: pip install 'positronic-brain[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys, style) in series.items():
        kw = style if isinstance(style, dict) else {"linestyle": style}
        ax.plot(xs, ys, marker="o" if kw.get("linestyle") != ":" else None, label=label, **kw)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for xs, _, _ in series.values() for x in xs})
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", ncol=2 if len(series) > 8 else 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def prepare_out_dir(out: str) -> Path:
    path = Path(out)
    if str(out) == "":
        raise UserError("--out '' is not a folder name")
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {out!r} exists and is not a folder")
    try:
        return make_folder(path)  # taken back if empty when the command is refused
    except OSError as e:
        raise UserError(f"--out {out!r}: cannot make the folder: {e.strerror}") from None


def write_text(path: Path, text: str) -> None:
    """Write atomically: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=1) + "\n")


def out_dir(args) -> Path | None:
    """The ``--out`` folder, created; checked with ``--report`` (a file that can be written)
    before any measuring."""
    if args.report and args.out is None:
        raise UserError("--report needs --out (the plots and results.json go there)")
    out = None if args.out is None else prepare_out_dir(args.out)
    if args.report:  # after the folder, which may hold it
        output_file(args.report)
    return out


def emit(res, args, out: Path | None, name: str, plots: Callable[..., list[str]],
         report_md: Callable[..., str], tables: Callable[..., list[Table]]) -> None:
    """A benchmark's outputs (``res``: its ``result.Result``): into ``out``, results.json, the PNG ``plots`` and report.md;
    with ``--report``, the report also as section ``name`` of that shared document (unless
    it names ``out``'s own report.md, which holds the report already); on
    stdout, one JSON object (``--json``) or the tables.

    ``report_md(res, images, image_dir, level)`` -> markdown whose title has that level."""
    if out is not None:
        images = plots(res, out)
        write_json(out / "results.json", res.to_json())
        write_text(out / "report.md", report_md(res, images, ".", 1))
        if args.report and Path(args.report).resolve() != (out / "report.md").resolve():
            doc = Path(args.report)
            write_section(doc, name, report_md(res, images, os.path.relpath(out, doc.parent), 2))
    if args.json:
        json.dump(res.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print_tables(tables(res))


def write_section(path: Path, name: str, section: str) -> None:
    """Put ``section`` between the markers ``<!-- bench NAME: begin/end -->`` of ``path``,
    keeping the rest of the file, so several benchmarks share one document (markers are
    appended if missing; the file is created if needed)."""
    begin, end = f"<!-- bench {name}: begin -->", f"<!-- bench {name}: end -->"
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block
    write_text(path, new)


def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def jobs(args) -> int:
    """``--jobs``: processes that measure in parallel (default: the CPU's cores)."""
    n = args.jobs if args.jobs is not None else os.cpu_count() or 1
    require(n >= 1, f"--jobs must be >= 1, got {n}")
    return n


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def command_line(bench: str, args, flags: tuple[tuple[str, object], ...]) -> str:
    """The ``positronic-brain bench`` command that reproduces a run: ``--quick`` and every
    ``(name, default)`` (a flag's parsed name) given a value other than its default, a
    switch given as its flag alone."""
    parts = [f"positronic-brain bench {bench}"] + (["--quick"] if args.quick else [])
    for name, default in flags:
        value, flag = getattr(args, name, None), "--" + name.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:  # a repeatable flag: each
            if v is True:  # a switch
                parts.append(flag)
            elif v is not None and v != default:
                parts += [flag, str(v)]
    return " ".join(parts)
