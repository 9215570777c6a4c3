"""Stage 4's part of recall in a per-head cache (``stages.apply.heads``): the cold store kept
per (layer, KV head) as the arena is.

A head's cull is the moment its K/V of a token would be lost, while other heads may still
hold the token, so what goes cold is a (layer, KV head)'s entry, not a whole token: it moves
to the next cold slot of the same head. The cold store's map (``Cold.heads``, a
``state.Heads``) says which row of the cold ledger each (layer, KV head, cold slot) holds;
the cold ledger holds every token some head holds cold, one row a token (a token may be hot
in some heads and cold in others, at one position). A recall swaps a head's cold slot with
one of its hot slots. Past ``capacity`` entries, a head lets go of its cold entries earliest
in the text; a token leaves the cache for good when no head holds it, hot or cold.

On a failure part-way, ``Saved`` puts the cold ledger and map back, and
``heads._put_back`` re-prefills every hot and cold slot from the ledgers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...forward import apply_rope, rerotation
from ...model import Model
from ...state import Arena, Cold, Heads, Ledger, State, key_norms
from .rows import cold_size, drop_unheld, every_head, grow_ledger

KV = ("v", "knorm", "vnorm")  # a slot's per-(layer, head) rows besides its key


def to_heads(cold: Cold) -> None:
    """Stage 0: a whole-token cold store becomes a per-head one in which every head holds
    every cold token (slot i of each head holding row i, as it did), its scorer columns one
    value a (layer, KV head) (``prefill.add_heads`` does this for the arena; so are the
    columns a per-head store gained since, ``add_columns``' one value a token)."""
    cold.heads = every_head(cold.arena, cold.ledger, cold.heads, cold.n)


def room(model: Model, cold: Cold, slots: int, rows: int) -> None:
    """Storage for ``slots`` cold slots a head and ``rows`` cold ledger rows: each grown
    as needed (``cold_size``; the ledger doubled), the live part copied."""
    ledger_rows(cold, rows)
    a, h = cold.arena, cold.heads
    if slots <= a.capacity:
        return
    size = cold_size(slots, a.capacity, cold.capacity)
    new = Arena.allocate(model.spec, size, model.dtype, a.device, key_rows=True)
    w = a.n
    new.k[:, :, :w] = a.k[:, :, :w]
    for name in KV:
        getattr(new, name)[:, :, :w] = getattr(a, name)[:, :, :w]
    new.n = w
    row = h.row.new_full(h.row.shape[:2] + (new.capacity,), -1)
    row[:, :, :w] = h.row[:, :, :w]
    cold.arena, cold.heads = new, Heads(row=row, n=h.n)


def ledger_rows(cold: Cold, rows: int) -> None:
    """Room for ``rows`` cold ledger rows and their entry order, doubled as needed."""
    m = cold.ledger
    while rows > m.uid.shape[0]:
        grow_ledger(m)
        entered = cold.entered.new_zeros(m.uid.shape[0])
        entered[:cold.entered.shape[0]] = cold.entered
        cold.entered = entered


def find_or_add(dst: Ledger, src: Ledger, rows: torch.Tensor,
                cold: Cold | None = None) -> torch.Tensor:
    """The rows of ``dst`` that hold the tokens of ``src``'s ``rows`` (k,): the row already
    there, or a copy of the ``src`` row appended (once a token; ``cold``: ``dst`` is its
    ledger, and the new rows enter it now)."""
    uids = src.uid[rows]
    live = dst.live("uid")
    order = torch.argsort(live)
    at = torch.searchsorted(live[order], uids).clamp(max=max(0, dst.n - 1))
    found = (live[order][at] == uids) if dst.n else torch.zeros_like(uids, dtype=torch.bool)
    out = torch.where(found, order[at] if dst.n else at, -1)
    new, first = unique_first(uids[~found])
    if new.numel():
        if cold is not None:
            ledger_rows(cold, dst.n + new.numel())
        while dst.n + new.numel() > dst.uid.shape[0]:
            grow_ledger(dst)
        at_new = torch.arange(dst.n, dst.n + new.numel(), device=dst.device)
        take = rows[~found][first]
        for c in dst.names:
            dst.col(c)[at_new] = src.col(c)[take]
        if cold is not None:
            cold.entered[at_new] = torch.arange(cold.next_entry, cold.next_entry + new.numel(),
                                                device=dst.device)
            cold.next_entry += new.numel()
        out[~found] = dst.n + torch.searchsorted(new, uids[~found])
        dst.n += new.numel()
    return out


def unique_first(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct values of ``x`` in ascending order and where each first occurs."""
    values, inverse = torch.unique(x, sorted=True, return_inverse=True)
    first = torch.full((values.numel(),), x.numel(), dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, inverse, torch.arange(x.numel(), device=x.device), "amin")
    return values, first


def _set_column(dst: Ledger, rows: torch.Tensor, lh: torch.Tensor, hh: torch.Tensor,
                src: Ledger, src_rows: torch.Tensor) -> None:
    """Each scorer column's value at (layer ``lh``, head ``hh``) of ``dst``'s ``rows``: the
    value ``src``'s ``src_rows`` had there (an entry moving between the hot and cold side)."""
    for name, col in dst.columns.items():
        col[rows, lh, hh] = src.columns[name][src_rows, lh, hh]


def swap_heads(state: State, swaps: torch.Tensor | None,
               values: dict[str, torch.Tensor] | None, step: int) -> tuple[int, ...]:
    """Recalls: each ``swaps`` row (layer, KV head, hot slot, cold slot) trades a head's hot
    slot with its cold slot, K/V and map entries; the recalled token gets a hot ledger row
    (if no other head holds it hot) and the scorer columns ``values`` at that head, the other
    one a cold row (likewise), its columns as they were at that head. Returns the uids
    recalled, a swap each."""
    if swaps is None or not swaps.numel():
        return ()
    a, m, h, cold = state.arena, state.ledger, state.heads, state.cold
    ca, cm, ch = cold.arena, cold.ledger, cold.heads
    lh, hh, s, c = swaps.unbind(1)
    hot_rows, cold_rows = h.row[lh, hh, s], ch.row[lh, hh, c]
    hot_kv = [a.kt[lh, hh, :, s]] + [getattr(a, x)[lh, hh, s] for x in KV]  # copies
    cold_kv = [ca.k[lh, hh, c]] + [getattr(ca, x)[lh, hh, c] for x in KV]
    into_hot = find_or_add(m, cm, cold_rows)
    into_cold = find_or_add(cm, m, hot_rows, cold)
    _set_column(m, into_hot, lh, hh, cm, cold_rows)
    _set_column(cm, into_cold, lh, hh, m, hot_rows)
    for name, x in (values or {}).items():
        m.columns[name][into_hot, lh, hh] = x
    m.changed_step[into_hot] = step
    a.kt[lh, hh, :, s] = cold_kv[0]
    ca.k[lh, hh, c] = hot_kv[0]
    for name, x, y in zip(KV, cold_kv[1:], hot_kv[1:]):
        getattr(a, name)[lh, hh, s] = x
        getattr(ca, name)[lh, hh, c] = y
    h.row[lh, hh, s] = into_hot
    ch.row[lh, hh, c] = into_cold
    return tuple(cm.uid[cold_rows].tolist())


def cool_heads(model: Model, state: State, culls: torch.Tensor) -> None:
    """Each head's culled slots (``culls`` (L, KVH, n), before they are removed) into that
    head's next cold slots, their tokens into the cold ledger."""
    cold, m, a = state.cold, state.ledger, state.arena
    lh, hh, s = culls.nonzero().unbind(1)  # in (layer, head, slot) order
    if not lh.numel():
        return
    count = culls.sum(-1)  # (L, KVH)
    ch = cold.heads
    room(model, cold, int((ch.n + count).max()), cold.n + lh.numel())
    ca, ch = cold.arena, cold.heads
    flat = count.flatten()
    first = torch.cumsum(flat, 0) - flat  # each head's first entry in the nonzero order
    group = lh * count.shape[1] + hh
    at = ch.n[lh, hh] + torch.arange(lh.numel(), device=lh.device) - first[group]
    hot_rows = state.heads.row[lh, hh, s]
    rows = find_or_add(cold.ledger, m, hot_rows, cold)
    _set_column(cold.ledger, rows, lh, hh, m, hot_rows)
    ca.k[lh, hh, at] = a.kt[lh, hh, :, s]
    for name in KV:
        getattr(ca, name)[lh, hh, at] = getattr(a, name)[lh, hh, s]
    ch.row[lh, hh, at] = rows
    ch.n += count
    ca.n = int(ch.n.max())


def _compact(a: Arena, h: Heads, gone: torch.Tensor) -> None:
    """Each head's ``gone`` slots (L, KVH, width) leave; its last survivors fill the holes
    (``heads._remove`` for the cold store's key rows)."""
    width = gone.shape[2]
    left = h.n - gone.sum(-1)
    below = torch.arange(width, device=gone.device) < left.unsqueeze(-1)
    holes = (gone & below).nonzero()
    movers = (h.live(width) & ~gone & ~below).nonzero()
    if movers.numel():
        lh, hh, src = movers.unbind(1)
        dst = holes[:, 2]
        for x in (a.k, a.v, a.knorm, a.vnorm, h.row):
            x[lh, hh, dst] = x[lh, hh, src]
    h.row[:, :, :width].masked_fill_(~below, -1)
    h.n.copy_(left)
    a.n = int(h.n.max())


def trim(cold: Cold, keep_tokens: int | None = None, hot: Ledger | None = None,
         swapped: bool = True) -> torch.Tensor:
    """Each head keeps at most the store's capacity of cold entries, letting go of those
    earliest in the text; with ``keep_tokens`` (a re-index's ``cold_keep``), only the
    ``keep_tokens`` latest of the tokens held cold alone (in no head hot: ``hot``'s) stay.
    Then the cold ledger rows no head holds leave it (only a trim, or a step that
    ``swapped``, can leave one so). Returns their uids."""
    a, h, m = cold.arena, cold.heads, cold.ledger
    width = a.n
    live = h.live(width)
    over = (h.n - cold.capacity).clamp(min=0)
    gone = torch.zeros_like(live)
    if int(over.max()) > 0:  # the capacity's: each head's earliest in the text
        pos = torch.where(live, m.position[h.row[:, :, :width].clamp(min=0)],
                          torch.iinfo(torch.int64).max)
        rank = torch.empty_like(h.row[:, :, :width])
        rank.scatter_(-1, torch.argsort(pos, dim=-1, stable=True),
                      torch.arange(width, device=m.device).expand_as(rank))
        gone = live & (rank < over.unsqueeze(-1))
    if keep_tokens is not None and m.n:
        alone = ~torch.isin(m.live("uid"), hot.live("uid"))
        order = torch.argsort(m.live("position"), descending=True)
        newest = order[alone[order]][:keep_tokens]
        stays = ~alone
        stays[newest] = True
        gone |= live & ~stays[h.row[:, :, :width].clamp(min=0)]
    trimmed = bool(gone.any())
    if trimmed:
        _compact(a, h, gone)
    if not (trimmed or swapped):
        return m.uid[:0]
    return drop_unheld(m, h.row[:, :, :a.n], (cold.entered,))


def reindex_cold(model: Model, cold: Cold, new_of: torch.Tensor) -> None:
    """A re-index of the cold store: row i's position becomes ``new_of[i]``, and each head's
    cold keys re-rotate by their token's move."""
    a, h, m = cold.arena, cold.heads, cold.ledger
    old = m.live("position").clone()
    m.position[:m.n] = new_of
    lh, hh, s = h.live(a.n).nonzero().unbind(1)
    r = h.row[lh, hh, s]
    moved = old[r] != new_of[r]
    lh, hh, s, r = lh[moved], hh[moved], s[moved], r[moved]
    if r.numel():
        cos, sin = rerotation(model, old[r], new_of[r])
        a.k[lh, hh, s] = apply_rope(a.k[lh, hh, s].float(), cos, sin).to(a.k.dtype)
        a.knorm[lh, hh, s] = key_norms(a.k[lh, hh, s])


@dataclass
class Saved:
    """A per-head cold store as a step found it, to put back on a failure part-way: its
    ledger's live columns, count and entry order, its map, and its storage (a growth
    replaces it). The K/V are re-prefilled by ``heads._put_back``."""

    cold: Cold
    arena: Arena
    columns: dict[str, torch.Tensor]
    n: int
    entered: torch.Tensor
    next_entry: int
    row: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, cold: Cold | None) -> "Saved | None":
        if cold is None:
            return None
        m = cold.ledger
        return cls(cold, cold.arena, {c: m.live(c).clone() for c in m.names}, m.n,
                   cold.entered[:m.n].clone(), cold.next_entry, cold.heads.row.clone(),
                   cold.heads.n.clone())

    def put_back(self) -> None:
        c, m = self.cold, self.cold.ledger
        m.n = self.n
        for name, x in self.columns.items():
            m.col(name)[:m.n] = x
        c.entered[:m.n] = self.entered
        c.next_entry = self.next_entry
        c.arena = self.arena
        c.heads = Heads(row=self.row, n=self.counts)
        c.arena.n = int(self.counts.max())
