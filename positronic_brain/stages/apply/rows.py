"""Stage 0/4's row writers: the arena and ledger rows every writer below shares (a slot's
K/V and norms, a new token's ledger row, moving and removing slots)."""
from __future__ import annotations

import functools
import math

import torch

from ...model import Model
from ...state import Arena, Heads, Ledger, SplitArena, State, key_norms, value_norms
from ...types import Column


SLICE_MOVES = 8  # ``remove``: up to this many moved slots one by one, more by index copies


def arena(model: Model, capacity: int) -> Arena | SplitArena:
    """An empty arena of ``capacity`` slots for ``model``: one block per run of layers on
    one device when a device map splits it (``Model.blocks``)."""
    if model.split:
        return SplitArena.allocate(model.spec, capacity, model.dtype, model.blocks, model.device)
    return Arena.allocate(model.spec, capacity, model.dtype, model.device)


def per_block(a: Arena | SplitArena, *xs: torch.Tensor | None):
    """Each block of ``a`` with its layers' part of each (L, ...) tensor in ``xs`` (None
    stays None), on the block's device: on one device, the arena and ``xs`` themselves."""
    if isinstance(a, Arena):
        return ((a, xs),)
    return tuple((b, tuple(None if x is None else x[sl].to(b.device) for x in xs))
                 for b, sl in zip(a.blocks, a.layers))


def write(a: Arena | SplitArena, lo: int, k: torch.Tensor, v: torch.Tensor,
           norms_of_kv: bool = True, copy: bool = True) -> None:
    """Write K/V ``k``/``v`` (L, kv_heads, t, head_dim) into slots [lo, lo + t) of each
    block, each slot holding one token (log-mass 0), and their norms: from ``k``/``v`` at
    once, or (not ``norms_of_kv``) from the arena one layer at a time (same bits). Not
    ``copy``: ``k``/``v`` are those slots already (``slots_of``)."""
    hi = lo + k.shape[2]
    for b, (kb, vb) in per_block(a, k, v):
        if copy:
            b.k[:, :, lo:hi] = kb
            b.v[:, :, lo:hi] = vb
        if b.folded:  # else every log-mass is 0 already
            b.log_mass[:, :, lo:hi] = 0.0
        if norms_of_kv:
            b.renorm(lo, hi, kb, vb)
        else:
            b.renorm(lo, hi)


def slots_of(a: Arena | SplitArena, lo: int, t: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V views (L, kv_heads, t, head_dim) of slots [lo, lo + t) of a one-device arena,
    into which a prefill's forward hands its new K/V layer by layer (``store_layer``; why:
    docs/DESIGN.md, stage 0). None for a split arena, whose layers' K/V cross devices."""
    return None if isinstance(a, SplitArena) else (a.k[:, :, lo:lo + t], a.v[:, :, lo:lo + t])


def store_layer(into: tuple[torch.Tensor, torch.Tensor], i: int, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Layer ``i``'s new K/V (kv_heads, t, head_dim) into the slots ``into`` (``slots_of``):
    ``forward``'s ``store`` in a prefill, so the write is stage 0's."""
    into[0][i], into[1][i] = k, v


def write_rows(m: Ledger, slots: slice, token_ids: torch.Tensor | int,
                positions: torch.Tensor | int, sources: torch.Tensor | int, step: int,
                flags: torch.Tensor | int) -> list[int]:
    """Fill ledger rows ``slots`` for new tokens (each value a tensor with one a row, or an
    int for every row: a fill, no tensor made for it); returns their fresh uids."""
    count = slots.stop - slots.start
    uids = list(range(m.next_uid, m.next_uid + count))  # known here: not read back (a sync)

    def put(col: torch.Tensor, x: torch.Tensor | int | float) -> None:
        if isinstance(x, (int, float)):
            col[slots].fill_(x)  # ``col[slots] = x`` would make a tensor of x first
        else:
            col[slots] = x

    uid = (torch.arange(m.next_uid, m.next_uid + count, device=m.device) if count > 1
           else m.next_uid)
    for col, x in ((m.uid, uid), (m.token_id, token_ids), (m.position, positions),
                   (m.source, sources), (m.born_step, step), (m.changed_step, step),
                   (m.flags, flags), (m.origin, 0), (m.origin_uid, -1)):
        put(col, x)
    for name, spec in m.specs.items():  # the scorer's columns at their birth values
        if isinstance(sources, int):  # per head too: every head's the one value
            put(m.columns[name], spec.births[sources])
            continue
        col, born = m.columns[name], birth_values(spec.births, m.device)[sources.long()]
        put(col, born.view(-1, *(1,) * (col.dim() - 1)))  # per head: each
    m.next_uid += count
    return uids


def append_heads(state: State, k: torch.Tensor, v: torch.Tensor, token_ids: torch.Tensor,
                 positions: torch.Tensor, sources: torch.Tensor, flags: torch.Tensor,
                 step: int) -> list[int]:
    """Append t tokens to a per-head cache (``state.heads``): new ledger rows (the ledger
    grown as needed) and every head's next t slots, their K/V ``k``, ``v`` (L, kv_heads, t,
    head_dim, rotated at ``positions``); returns their uids."""
    a, m, h = state.arena, state.ledger, state.heads
    t = k.shape[2]
    while m.n + t > m.uid.shape[0]:
        grow_ledger(m)
    uids = write_rows(m, slice(m.n, m.n + t), token_ids, positions, sources, step, flags)
    L, KVH = h.n.shape
    s = h.n.unsqueeze(-1) + torch.arange(t, device=m.device)  # (L, KVH, t): each head's next
    lh = torch.arange(L, device=m.device).view(L, 1, 1).expand_as(s)
    hh = torch.arange(KVH, device=m.device).view(1, KVH, 1).expand_as(s)
    a.kt[lh, hh, :, s] = k
    a.v[lh, hh, s] = v
    a.knorm[lh, hh, s] = key_norms(k)
    a.vnorm[lh, hh, s] = value_norms(v)
    a.log_mass[lh, hh, s] = 0.0
    h.row[lh, hh, s] = m.n + torch.arange(t, device=m.device)
    m.n += t
    h.n += t
    a.n = int(h.n.max())
    return uids


def every_head(a: Arena, m: Ledger, heads: Heads | None, n: int) -> Heads:
    """Stage 0: ``heads``, or (None) a map over ``a`` in which every (layer, KV head) holds
    ledger rows 0..n-1 in its slots 0..n-1; and ``m``'s scorer columns one value a (layer,
    KV head) of each token (a column of one value a token widened, every head's that
    value)."""
    L, KVH, cap = a.vnorm.shape
    if heads is None:
        row = torch.full((L, KVH, cap), -1, dtype=torch.long, device=m.device)
        row[:, :, :n] = torch.arange(n, device=m.device)
        heads = Heads(row=row, n=torch.full((L, KVH), n, dtype=torch.long, device=m.device))
    for name, col in m.columns.items():
        if col.dim() == 1:
            m.columns[name] = col.view(-1, 1, 1).expand(-1, L, KVH).clone()
    return heads


def drop_unheld(m: Ledger, rows: torch.Tensor, extra: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """A per-head cache's ledger rows that no slot of the map ``rows`` (L, kv_heads, width;
    -1 where free) holds leave ``m``: the last rows fill the holes (and their entries of the
    ``extra`` per-row tensors), and the map follows them. Returns the uids that left."""
    held = torch.bincount(rows.flatten() + 1, minlength=m.n + 1)[1:m.n + 1]  # -1: left out
    gone = (held == 0).nonzero()[:, 0]
    if not gone.numel():
        return gone
    uids = m.uid[gone].clone()
    n = m.n - gone.numel()
    keep = torch.ones(m.n, dtype=torch.bool, device=m.device)
    keep[gone] = False
    src = (keep & (torch.arange(m.n, device=m.device) >= n)).nonzero()[:, 0]
    dst = gone[gone < n]
    for col in [m.col(c) for c in m.names] + list(extra):
        col.index_copy_(0, dst, col.index_select(0, src))
    remap = torch.arange(m.n, device=m.device)
    remap[src] = dst
    rows.copy_(torch.where(rows >= 0, remap[rows.clamp(min=0)], rows))
    m.n = n
    return uids


def cold_size(needed: int, current: int, capacity: int) -> int:
    """The storage a cold store grows to from ``current`` rows (or slots a head) when it
    needs ``needed``: half as large again at least (amortised O(1) a row) and a quarter more
    than needed, at most ``capacity`` unless more is needed now (a step's culls before its
    trim). Not twice what is needed: a first cull that sends a long prompt cold would then
    hold twice the prompt after the next step's one more."""
    return max(needed, min(capacity, max(needed + needed // 4, current + current // 2)))


def grow_ledger(m: Ledger) -> None:
    """Double the ledger's rows (a per-head cache's union of tokens can pass the arena's
    slots a head)."""
    rows = 2 * m.uid.shape[0]
    for c in m.COLUMNS:
        old = getattr(m, c)
        new = old.new_full((rows,), -1 if c == "origin_uid" else 0)
        new[:old.shape[0]] = old
        setattr(m, c, new)
    for c, old in m.columns.items():
        new = old.new_zeros((rows,) + old.shape[1:])
        new[:old.shape[0]] = old
        m.columns[c] = new
    m.pack()


@functools.lru_cache(maxsize=16)
def birth_values(births: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A column's birth value per source as a float32 tensor on ``device``, made once
    (copying it from host memory at every step would wait for the device)."""
    return torch.tensor(births, dtype=torch.float32, device=device)


def remove(a: Arena | SplitArena, m: Ledger, slots: list[int],
            extra: tuple[torch.Tensor, ...] = (),
            room: bool = False) -> tuple[list[tuple[int, int]], int]:
    """Remove live slots of ``a``/``m`` (the arena and ledger, or the cold store's); the
    survivors among the last slots fill the holes below them (O(1) per token), and so do
    their entries of the ``extra`` per-slot tensors. Each move reads an original
    slot, never one that another move has just filled, so all of them can be done at once.
    Returns the moves (from_slot, to_slot) and the slot a token appended next takes: the
    new count, or with ``room`` (and a slot removed) the highest hole below the count with
    that token, which no survivor fills: the append writes there, and the step that culls
    one token and appends one moves none (the caller's next write must be that append)."""
    gone = set(slots)
    n = m.n - len(gone)
    top = n + 1 if room and gone else n  # the dense prefix the moves fill
    holes = sorted(s for s in gone if s < top)
    free = holes.pop() if top > n else n
    moves = list(zip([s for s in range(top, m.n) if s not in gone], holes))
    tables = m.tables() + [(x, 0) for x in extra] if moves else []  # ledger first
    if len(moves) == 1:  # a row copy a table: no index tensors to make
        (f, t), = moves
        for x, dim in tables:
            x.select(dim, t).copy_(x.select(dim, f))
    elif moves:
        src = torch.tensor([f for f, _ in moves], device=m.device)
        dst = torch.tensor([t for _, t in moves], device=m.device)
        for x, dim in tables:
            x.index_copy_(dim, dst, x.index_select(dim, src))
    m.n = n
    for b in a.blocks if moves else ():
        per_slot = (b.k, b.v, b.knorm, b.vnorm) + ((b.log_mass,) if b.folded else ())
        if len(moves) > SLICE_MOVES:  # many (a re-index's drop of cold rows): index copies
            src_b, dst_b = src.to(b.v.device), dst.to(b.v.device)
            for x in per_slot:  # (L, kv_heads, capacity[, head_dim])
                x.index_copy_(2, dst_b, x.index_select(2, src_b))
            continue
        for f, t in moves:  # slot by slot: slice copies beat index copies for a few slots
            for x in per_slot:
                x.select(2, t).copy_(x.select(2, f))
    a.n = n
    return moves, free


def _take_keys(a: Arena, slots: torch.Tensor) -> torch.Tensor:
    """The keys of ``slots`` (k,) as (L, kv_heads, k, head_dim), a copy. Keys stored
    transposed come by ``gather`` over the rows of one key dimension each (faster than
    ``index_select`` along the strided slot dimension, cached or not; same bits)."""
    if a.key_rows:  # the cold store
        return a.k.index_select(2, slots)
    rows = a.kt.flatten(0, 2)  # (L * kv_heads * head_dim, capacity), a view
    out = torch.gather(rows, 1, slots.expand(rows.shape[0], slots.numel()))
    return out.view(*a.kt.shape[:3], slots.numel()).transpose(2, 3)


def _put_keys(a: Arena, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Write keys ``k`` (L, kv_heads, k, head_dim) into ``slots`` (k,); transposed keys by
    indexed assignment, about half the time of ``index_copy_`` along the strided slot
    dimension (``scatter_`` would be no faster on uncached rows, and in bfloat16 it copies
    the whole block twice)."""
    if a.key_rows:
        a.k.index_copy_(2, slots, k)
    else:
        a.kt[..., slots] = k.transpose(2, 3)


ROWS = ("k", "v", "knorm", "vnorm")  # what a slot's row holds besides its ledger row


def take_rows(a: Arena | SplitArena, m: Ledger, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """Slots ``slots`` (k,): their ledger rows, K, V and norms, as copies (on the ledger's
    device)."""
    blocks = []
    for b in a.blocks:
        at = slots.to(b.device)
        blocks.append([_take_keys(b, at)] + [getattr(b, x).index_select(2, at) for x in ROWS[1:]])
    parts = blocks[0] if isinstance(a, Arena) else [
        torch.cat([t.to(m.device) for t in ts]) for ts in zip(*blocks)]
    # index_select, not ``[slots]``: one operator a column instead of advanced indexing's
    return {**{c: m.col(c).index_select(0, slots) for c in m.names},
            **dict(zip(ROWS, parts))}


def put_rows(a: Arena | SplitArena, m: Ledger, slots: torch.Tensor,
              rows: dict[str, torch.Tensor]) -> None:
    """Write rows taken by ``take_rows`` into ``slots`` (ledger first); each holds one
    token (log-mass 0)."""
    for c in m.names:
        m.col(c).index_copy_(0, slots, rows[c])
    put_kv(a, slots, rows)


def put_kv(a: Arena | SplitArena, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
    """Write the ``ROWS`` of ``rows`` (K, V and their norms) into ``slots``; each holds one
    token (log-mass 0)."""
    for b, (k, *rest) in per_block(a, *(rows[x] for x in ROWS)):
        at = slots.to(b.device)
        _put_keys(b, at, k)
        for name, x in zip(ROWS[1:], rest):
            getattr(b, name).index_copy_(2, at, x)
        if b.folded:  # else every log-mass is 0 already
            b.log_mass[:, :, at] = 0.0


def column_ranges(m: Ledger, new: dict[str, torch.Tensor] | None,
                   n: int) -> list[tuple[str, Column, torch.Tensor]]:
    """The scorer columns ``new`` writes (name -> values; None: none), each checked to be a
    column of ``m`` with one float32 value per live slot: (name, its ``Column``, its lowest
    and highest value as a float64 tensor (2,), not read yet) for each written over any slot."""
    out = []
    for name, t in (new or {}).items():
        assert name in m.specs, f"{name} is not a column of the ledger"
        assert t.shape == (n,) + m.columns[name].shape[1:] and t.dtype == torch.float32, \
            f"bad {name} for {n} slots"
        if n:
            out.append((name, m.specs[name], torch.stack(t.aminmax()).double()))
    return out


def in_range(ranges: list[tuple[str, Column, torch.Tensor]], read: list[float]) -> None:
    """Each of ``column_ranges``' columns finite and within its column's bounds, from its
    (lowest, highest) read back in ``read`` (two values a column, in order; a NaN fails)."""
    for (name, spec, _), lo, hi in zip(ranges, read[::2], read[1::2]):
        assert math.isfinite(lo) and math.isfinite(hi) and spec.holds(lo) and spec.holds(hi), \
            f"{name} outside [{spec.low}, {spec.high}] or not finite: [{lo}, {hi}]"


def check_columns(m: Ledger, new: dict[str, torch.Tensor] | None, n: int) -> None:
    """The scorer columns ``new`` writes are the ledger's, one value per live slot, in range."""
    ranges = column_ranges(m, new, n)
    if ranges:
        in_range(ranges, torch.cat([r for _, _, r in ranges]).tolist())
