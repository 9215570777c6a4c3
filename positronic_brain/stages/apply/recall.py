"""Stage 4's part of recall: the cold store, allocating and growing it, culled tokens going
in, recalled ones coming back in place of a hot slot's, the oldest dropped past its capacity;
and its undo, so stage 4 stays all or nothing with recall too (``Undo``)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ...model import Model
from ...state import Arena, Cold, Ledger, State
from ...types import Column, Swap, require
from .cold_heads import to_heads
from .rows import ROWS, cold_size, put_rows, remove, take_rows


COLD_ROWS = 1024  # a cold store's first allocation; stage 4 grows it up to its capacity


def cold_most(rows: int) -> int:
    """The most storage a cold store grows to while it holds up to ``rows`` live rows: a
    growth passes neither 1.5 x its storage (below ``rows``, since it grows) nor 1.25 x
    what it needs (``cold_size``), and it starts at ``COLD_ROWS``."""
    return max(COLD_ROWS, cold_size(rows, rows - 1, sys.maxsize))


def cold_store(model: Model, capacity: int, rows: int | None = None,
               columns: dict[str, Column] | None = None) -> Cold:
    """An empty cold store for at most ``capacity`` tokens whose ledger has the scorer
    ``columns`` the hot one has, with storage for ``rows`` (default ``COLD_ROWS``)."""
    rows = min(capacity, rows or COLD_ROWS)
    dev = model.device
    return Cold(Arena.allocate(model.spec, rows, model.dtype, dev, key_rows=True),
                Ledger.allocate(rows, columns, device=dev),
                torch.zeros(rows, dtype=torch.int64, device=dev), capacity)


@dataclass
class Undo:
    """What one step changes of a cold store, kept as it goes, to put back on a failure
    part-way (``put_back``): its counts and storage (``grow`` replaces the storage and
    leaves the old as it was), and a copy of every live row before it is overwritten in
    place (``save``; a re-index saves the keys and positions it rewrites). Copies only
    rows the step changes: a recall's, a drop's holes and the rows moved into them."""

    cold: Cold
    arena: Arena
    ledger: Ledger
    entered: torch.Tensor
    n: int
    next_entry: int
    saved: list[tuple] = field(default_factory=list)  # (arena, ledger, entered, rows, copies)

    @classmethod
    def of(cls, cold: Cold | None) -> "Undo | None":
        return None if cold is None else cls(cold, cold.arena, cold.ledger, cold.entered, cold.n,
                                             cold.next_entry)

    def save(self, rows: torch.Tensor) -> None:
        """Copy the cold rows ``rows`` (k,) of the current storage before they change."""
        c = self.cold
        self.saved.append((c.arena, c.ledger, c.entered, rows,
                           {**take_rows(c.arena, c.ledger, rows), "entered": c.entered[rows]}))

    def save_positions(self) -> None:
        """Copy every live row's key, key norm and position (a re-index rewrites them)."""
        c, n = self.cold, self.cold.n
        self.saved.append((c.arena, c.ledger, None, None, (
            c.arena.k[:, :, :n].clone(), c.arena.knorm[:, :, :n].clone(),
            c.ledger.position[:n].clone())))

    def put_back(self) -> None:
        """The cold store as it was before the step, bit for bit."""
        for arena, ledger, entered, rows, copies in reversed(self.saved):
            if rows is None:
                k, knorm, position = copies
                n = position.shape[0]
                arena.k[:, :, :n], arena.knorm[:, :, :n] = k, knorm
                ledger.position[:n] = position
                continue
            put_rows(arena, ledger, rows, copies)
            entered[rows] = copies["entered"]
        c = self.cold
        c.arena, c.ledger, c.entered, c.next_entry = self.arena, self.ledger, self.entered, self.next_entry
        c.arena.n = c.ledger.n = self.n


def add_cold_store(model: Model, state: State, capacity: int) -> None:
    """Stage 0: an empty cold store for a live state that has none (a session restored from
    a cache without recall that now recalls, as bench passkey's cells do)."""
    require(state.cold is None, "the state has a cold store already")
    state.cold = cold_store(model, capacity, columns=state.ledger.specs)
    if state.heads is not None:
        to_heads(state.cold)


def grow(model: Model, cold: Cold, rows: int) -> None:
    """Room for ``rows`` live cold rows (``cold_size``), the live rows copied."""
    if rows <= cold.arena.capacity:
        return
    size = cold_size(rows, cold.arena.capacity, cold.capacity)
    new = cold_store(model, cold.capacity, size, cold.ledger.specs)
    a, m, n = new.arena, new.ledger, cold.n
    a.k[:, :, :n] = cold.arena.k[:, :, :n]  # a slot per row: contiguous
    for name in ("v", "knorm", "vnorm"):
        getattr(a, name)[:, :, :n] = getattr(cold.arena, name)[:, :, :n]
    for c in m.names:
        m.col(c)[:n] = cold.ledger.live(c)
    new.entered[:n] = cold.entered[:n]
    a.n = m.n = n
    cold.arena, cold.ledger, cold.entered = a, m, new.entered


def drop_oldest(state: State, count: int, undo: Undo) -> list[int]:
    """Drop the ``count`` cold rows that entered first, for good; returns their uids."""
    cold = state.cold
    if count <= 0:
        return []
    rows = torch.argsort(cold.entered[: cold.n])[:count]
    # the holes the last rows fill, and those last rows, which later writes may reuse
    undo.save(torch.cat((rows, torch.arange(cold.n - count, cold.n, device=rows.device))))
    uids = cold.ledger.uid[rows].tolist()
    remove(cold.arena, cold.ledger, rows.tolist(), extra=(cold.entered,))
    state.ledger.dropped += len(uids)
    return uids


def _enter_cold(cold: Cold, rows: torch.Tensor) -> None:
    """Cold rows ``rows`` (k,) entered now, in that order."""
    cold.entered[rows] = torch.arange(cold.next_entry, cold.next_entry + rows.numel(),
                                      device=rows.device)
    cold.next_entry += rows.numel()


def leaving_rows(state: State, swaps: tuple[Swap, ...], culls: list[int]) -> tuple[dict, dict]:
    """The rows of the hot slots that go cold this step, taken in one pass over the hot key
    rows (a slot's key is one element in each of them): the swaps' slots, then the culled
    ones (``culls``, with a cold store; none without). Each part also holds its ``slots``."""
    slots = [s.slot for s in swaps] + (culls if state.cold is not None else [])
    if not slots:
        return {}, {}
    at = torch.tensor(slots, device=state.ledger.device)
    rows = {**take_rows(state.arena, state.ledger, at), "slots": at}
    return _some_rows(rows, slice(None, len(swaps))), _some_rows(rows, slice(len(swaps), None))


def _some_rows(rows: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    """A ``part`` of rows taken by ``take_rows``, as views."""
    return {name: x[:, :, part] if name in ROWS else x[part] for name, x in rows.items()}


def swap(state: State, swaps: tuple[Swap, ...], step: int, leaving: dict, undo: Undo) -> None:
    """Recalls: each cold row ``cold_slot`` and hot slot ``slot`` trade places (``leaving``:
    those slots' rows); the recalled tokens' scorer columns take the swaps' values (those
    they name); the others enter the cold store now."""
    if not swaps:
        return
    cold, dev = state.cold, state.ledger.device
    rows = torch.tensor([s.cold_slot for s in swaps], device=dev)
    undo.save(rows)
    recalled = take_rows(cold.arena, cold.ledger, rows)  # copies: set before they are put
    names = list(swaps[0].columns)  # every swap names the same columns
    if names:
        values = torch.tensor([[s.columns[c] for s in swaps] for c in names],
                              dtype=torch.float32, device=dev)
        recalled |= dict(zip(names, values))
    recalled["changed_step"].fill_(step)
    put_rows(state.arena, state.ledger, leaving["slots"], recalled)
    put_rows(cold.arena, cold.ledger, rows, leaving)
    _enter_cold(cold, rows)


def cool(model: Model, state: State, slots: list[int],
         leaving: dict, undo: Undo) -> tuple[list[int], list[int]]:
    """Culled hot ``slots`` (``leaving``: their rows) into the cold store, the rows that
    entered first dropped for good past its capacity (and, if more go at once than it holds,
    the first of them). Returns the uids that went cold and those dropped."""
    cold = state.cold
    direct = slots[: max(0, len(slots) - cold.capacity)]
    slots = slots[len(direct):]
    dropped = state.ledger.uid[direct].tolist() if direct else []
    state.ledger.dropped += len(dropped)
    dropped += drop_oldest(state, cold.n + len(slots) - cold.capacity, undo)
    grow(model, cold, cold.n + len(slots))
    n, k = cold.n, len(slots)
    leaving = _some_rows(leaving, slice(len(direct), None))
    if k:
        rows = torch.arange(n, n + k, device=state.ledger.device)
        put_rows(cold.arena, cold.ledger, rows, leaving)
        _enter_cold(cold, rows)
    cold.arena.n = cold.ledger.n = n + k
    return leaving["uid"].tolist() if k else [], dropped
