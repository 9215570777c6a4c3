"""Where a grid benchmark's items are measured: here, in local worker processes, or on a
Ray cluster (``Pool``), with a journal that lets an interrupted run resume.

A grid benchmark (quality's runs, passkey's trials, ruler's samples) measures a list of
items, each in every cell of its grid. An item's row does not depend on where it was
measured: here (one process), in ``jobs`` single-thread local processes, or in ``jobs``
single-thread Ray actors (``--ray``), each of which loads the model once. Rows come back
in the items' order whatever order they finish in; with a journal (``result.Journal``)
each goes on it as it finishes, and the items it already holds are not measured again.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from .. import native
from ..model import Model, load_model, resolve_device
from ..special_tokens import TokenPolicy
from ..stages.apply.recall import cold_most
from ..types import UserError, require
from . import batch_size, common
from .result import Journal, KVCost

WORKER: dict = {}  # a worker's model, policy, config and grid (``Pool.rows``)


def load(model: str, dtype: str, device: str, note: bool = False) -> Model:
    """A grid benchmark's model, its stage 1 on the path ``run``'s ``--compile auto`` takes
    (``native.auto``: the native kernels where they pay and build, whose rows of a batch get
    the bits of their solo steps, so that no number depends on ``--batch`` there);
    ``note``: say on stderr where they would pay but cannot run."""
    compiled, why = native.auto([resolve_device(device)], dtype)
    if note and why:
        print(f"positronic-brain: {why}", file=sys.stderr)
    return load_model(model, dtype, device, compile=compiled)


def end_with_parent(poll: float = 1.0) -> None:
    """A local worker process ends itself once the process that started it is gone, instead
    of measuring on for no one: a parent killed by a signal it cannot clean up after
    (SIGTERM, SIGKILL) leaves its pool's workers behind. A daemon thread looks every
    ``poll`` seconds whether the worker has been handed to another parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def _init_worker(cfg, cells: Callable) -> None:
    """A worker's ``WORKER``: ``cfg``'s model and its token policy, ``cfg``, then
    ``cells(cfg)`` (which may read the model and policy there); it ends with its parent."""
    end_with_parent()
    torch.set_num_threads(1)  # one thread per worker: parallel items, not parallel matmuls
    m = load(cfg.model, cfg.dtype, cfg.device)
    WORKER.update(model=m, policy=TokenPolicy(m.tokenizer), cfg=cfg)
    WORKER["grid"] = cells(cfg)


@dataclass(frozen=True)
class Pool:
    """How a grid's items are measured: ``jobs`` processes (1: here; None: one per CPU
    of the Ray cluster), on the Ray cluster at ``ray`` (``auto``: the one this machine
    has joined, ``local``: one started for this run, or an address), with a ``journal``."""

    jobs: int | None = 1
    journal: Journal | None = None
    ray: str | None = None

    def workers(self, items: int) -> int:
        """The processes (Ray: actors) that measure a grid of ``items`` items, those the
        journal holds aside (1: here; 0: one per CPU of the Ray cluster). Ask before the
        run: the journal then holds what the run measures too."""
        left = items - (len(self.journal.done) if self.journal is not None else 0)
        if self.ray is None and (self.jobs == 1 or left <= 1):
            return 1
        return min(self.jobs or 0, left)

    def threads(self, items: int) -> int:
        """The torch threads each process that measures a grid of ``items`` items steps
        with: one in a worker (or an actor), this process's own where it measures them."""
        return 1 if self.ray is not None or self.workers(items) > 1 else torch.get_num_threads()

    def batch(self, cfg, model: Model, items: int, rows: Iterable[tuple[int, bool]]):
        """``batch_size.resolve`` for a grid of ``items`` items measured by this pool,
        whose ``rows`` (each row a batch may step: its tokens at most, and whether it
        recalls) hold their tokens' K/V each, and a row with recall its cold store too, at
        the most it grows to (``cold_most``)."""
        kv = KVCost.of(model)
        return batch_size.resolve(
            cfg, model, self.threads(items),
            [kv.heads * kv.pair_bytes * (t + (cold_most(t) if cold else 0)) for t, cold in rows],
            max(self.workers(items), 1))

    def rows(self, label: str, todo: list, cells_each: int, here: Callable,
             there: Callable, cfg, cells: Callable,
             size: Callable[[Any], float] | None = None) -> list:
        """Each of ``todo`` measured in every cell of a grid, with a progress bar of
        ``label``: ``here(item, tick)`` in this process, or ``there(item)`` in a worker
        whose ``WORKER`` holds ``cfg``'s model, ``cfg`` and ``cells(cfg)``;
        ``cells_each`` ticks an item. Workers take the items largest first by ``size``
        (an item's work, roughly), so that no long one starts last and holds up the end.
        The rows in ``todo``'s order."""
        done = dict(self.journal.done) if self.journal is not None else {}
        rows = dict(done)
        with common.progress() as task:
            tick = task(label, len(todo) * cells_each)
            for _ in range(len(done) * cells_each):
                tick()

            def finished(i: int, row, ticks: int = cells_each) -> None:
                rows[i] = row
                if self.journal is not None:
                    self.journal.add(i, row)
                for _ in range(ticks):
                    tick()

            left = [i for i in range(len(todo)) if i not in done]
            away = left if size is None else sorted(left, key=lambda i: -size(todo[i]))
            if self.ray is not None and left:
                on_ray(self.ray, self.jobs, [(i, todo[i]) for i in away], there, cfg,
                        cells, finished)
            elif self.jobs == 1 or len(left) <= 1:
                for i in left:
                    finished(i, here(todo[i], tick), 0)
            elif left:
                _on_processes(min(self.jobs or 1, len(left)), [(i, todo[i]) for i in away],
                              there, cfg, cells, finished)
        return [rows[i] for i in range(len(todo))]


def where(what: str, res) -> str:
    """Where a result's items were measured, as its report says it (``what``: the items,
    e.g. ``trials``; ``res``: a result with ``workers`` and ``ray``): `` on the Ray cluster
    at ...``, `` in 2 single-thread processes``, or nothing (here); then the rows a step,
    where they were chosen by measurement (``batch_choice``)."""
    workers = res.workers or 0
    rows = f"; {res.batch_choice}" if res.batch_choice else ""
    if res.ray is not None:
        return f"; {what} on the Ray cluster at {res.ray}" + (
            f" ({workers} single-CPU actors)" if workers else "") + rows
    return (f"; {what} in {workers} single-thread processes" if workers > 1 else "") + rows


def _on_processes(jobs: int, items: list[tuple[int, Any]], there: Callable, cfg,
                  cells: Callable, finished: Callable) -> None:
    """``there(item)`` for each (index, item) in ``jobs`` local single-thread processes."""
    ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
    with ProcessPoolExecutor(jobs, ctx, _init_worker, (cfg, cells)) as pool:
        futures = {pool.submit(there, item): i for i, item in items}
        try:
            for f in as_completed(futures):
                finished(futures[f], f.result())  # a worker's error now, not at the end
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


class _Actor:
    """A Ray worker: the model loaded once, then items measured one at a time."""

    def __init__(self, cfg, cells: Callable) -> None:
        _init_worker(cfg, cells)

    def measure(self, there: Callable, i: int, item) -> tuple[int, Any]:
        return i, there(item)


def on_ray(address: str, jobs: int | None, items: list[tuple[int, Any]], there: Callable,
            cfg, cells: Callable, finished: Callable) -> None:
    """``there(item)`` for each (index, item) in single-CPU actors on the Ray cluster at
    ``address``: ``jobs`` of them (None: one per CPU of the cluster), at most as many as
    it has CPUs free (an actor waiting for one would hold its items for ever)."""
    try:
        import ray  # pylint: disable=import-outside-toplevel  # an optional extra
        from ray.util import ActorPool  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'positronic-brain[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"--ray {address}: {why}") from None
    try:
        free = max(1, int(ray.available_resources().get("CPU", 1)))  # an actor a CPU
        actor = ray.remote(num_cpus=1)(_Actor)
        pool = ActorPool([actor.remote(cfg, cells) for _ in range(min(jobs or free, free,
                                                                      len(items)))])
        for i, row in pool.map_unordered(lambda a, x: a.measure.remote(there, *x), items):
            finished(i, row)
    except ray.exceptions.RayTaskError as e:  # a user's error, as it would be here
        raise (e.cause if isinstance(e.cause, UserError) else e) from None
    finally:
        if started:
            ray.shutdown()


def check_address(address: str) -> None:
    """``--ray``'s address (``HOST:PORT``) must answer, checked before a run starts: Ray
    itself waits minutes for one that does not."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    require(host and port.isdigit(), f"--ray takes auto, local or HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise UserError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e})") \
            from None
