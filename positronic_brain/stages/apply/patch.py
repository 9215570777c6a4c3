"""Stage 4: one step's actions applied atomically in a fixed order (``apply``), after
checks that refuse bad actions before anything changes."""
from __future__ import annotations

import math

import torch

from ...forward import apply_rope, rerotation
from ...model import Model
from ...state import FLAG_PROTECTED, Arena, Ledger, SplitArena, State
from ...types import NO_ACTIONS, SOURCES, Actions, GenerateOut, Patch, require
from .fold import fold
from .heads import apply_heads
from .merge import merge
from .recall import Undo, cool, drop_oldest, leaving_rows, swap
from .restore import rebuild_from_ledger
from .rows import column_ranges, in_range, remove, write, write_rows


def _check(model: Model, state: State, gen: GenerateOut, actions: Actions) -> list[int]:
    """Refuse bad actions before anything changes (stale slots, protected slots, shapes);
    returns the culled slots' uids. What it reads of the device (the columns' ranges, the
    slots' flags, the uids) it reads back at once: each read waits for the device."""
    a, m, spec, dtype = state.arena, state.ledger, model.spec, model.dtype
    n = m.n
    assert gen.position == state.next_position and gen.input_token == state.pending_token, \
        "the generate output is not for this state's pending token"
    assert gen.k.shape == (spec.n_layers, spec.n_kv_heads, 1, spec.head_dim), \
        f"new K has shape {tuple(gen.k.shape)}"
    assert gen.k.dtype == gen.v.dtype == dtype, f"new K/V are {gen.k.dtype}, not {dtype}"
    ranges = column_ranges(m, actions.columns, n)
    slots = list(actions.cull_slots) + [s for r in actions.merges for s in r.slots]
    require(len(set(slots)) == len(slots), f"a slot is culled or repaired twice: {slots}")
    require(all(0 <= s < n for s in slots), f"a cull or repair slot is outside [0, {n})")
    at = torch.tensor(slots, dtype=torch.long).to(m.device, non_blocking=True)
    culls = len(actions.cull_slots)
    folds = [f.into.flatten().double() for f in actions.folds]  # their targets too
    read = torch.cat([r for _, _, r in ranges]  # float64 holds int8 flags and uids exactly
                     + [m.flags.index_select(0, at).double(),
                        m.uid.index_select(0, at[:culls]).double()] + folds).tolist() \
        if ranges or slots else []
    targets = read[len(read) - sum(len(f) for f in folds):]
    read = read[:len(read) - len(targets)]
    in_range(ranges, read)
    flags = read[2 * len(ranges):2 * len(ranges) + len(slots)]
    protected = [s for s, f in zip(slots, flags) if int(f) & FLAG_PROTECTED]
    require(not protected, f"slots {protected} are protected and cannot be culled")
    for r in actions.merges:
        assert r.k.shape == gen.k.shape and r.v.shape == gen.v.shape, "repair K/V shape"
        assert r.k.dtype == r.v.dtype == dtype, "repair K/V dtype"
        assert (int(m.uid[r.slots[0]]), int(m.uid[r.slots[1]])) == r.uids, "stale repair"
        assert int(m.position[r.slots[0]]) == r.position, "repair position"
    culled = set(actions.cull_slots)
    changed = culled | {s for r in actions.merges for s in r.slots}
    uids = dict(zip(actions.cull_slots, (int(u) for u in read[len(read) - culls:])))
    width = spec.n_layers * spec.n_kv_heads
    for i, f in enumerate(actions.folds):
        assert f.slot in culled and uids[f.slot] == f.uid, "a fold of a slot not culled"
        assert f.into.shape == (spec.n_layers, spec.n_kv_heads), \
            f"fold targets have shape {tuple(f.into.shape)}"
        into = {int(s) for s in targets[i * width:(i + 1) * width]} - {-1}
        assert all(0 <= s < n for s in into) and not into & changed, \
            "a fold into a slot that goes or is repaired"
    _check_swaps(state, actions, changed)
    removed = len(actions.cull_slots) + len(actions.merges)
    require(n - removed < a.capacity,
            f"the arena is full ({a.capacity} slots); set a budget to cull")
    return [uids[s] for s in actions.cull_slots]


def _check_swaps(state: State, actions: Actions, changed: set[int]) -> None:
    """Recalls name live, unprotected hot slots that nothing else changes, and live cold
    rows, each once, with their uids; a recalled token's columns are in range."""
    if not actions.swaps:
        return
    m, cold = state.ledger, state.cold
    assert cold is not None, "a recall without a cold store"
    hot = [s.slot for s in actions.swaps]
    rows = [s.cold_slot for s in actions.swaps]
    assert len(set(hot)) == len(hot) and len(set(rows)) == len(rows), "a slot swapped twice"
    assert all(0 <= s < m.n and s not in changed for s in hot), "a recall into a slot that changes"
    assert all(0 <= r < cold.n for r in rows), "a recall of a row that is not live"
    assert all(name in m.specs and math.isfinite(x) and m.specs[name].holds(x)
               for s in actions.swaps for name, x in s.columns.items()), \
        "a recalled token's column is not the ledger's, or out of its range"
    at = torch.tensor(hot, device=m.device)  # one read of each column, not one per swap
    assert m.uid[at].tolist() == [s.uid for s in actions.swaps], "stale recall (hot uid)"
    assert not bool((m.flags[at] & FLAG_PROTECTED).any()), "a recall replaces a protected slot"
    assert cold.ledger.uid[torch.tensor(rows, device=m.device)].tolist() == \
        [s.cold_uid for s in actions.swaps], "stale recall (cold uid)"


def _rotate(model: Model, a: Arena | SplitArena, old: torch.Tensor, new: torch.Tensor) -> None:
    """Re-rotate the keys of live slots [0, n) from positions ``old`` (n,) to ``new`` (n,)
    by the exact rotation old -> new; unmoved slots keep their exact bits."""
    n = old.shape[0]
    moved = (old != new).nonzero()[:, 0]  # (t,) slots whose position changes
    if not moved.numel():
        return
    # Rotate the whole live block in the keys' stored layout (KVH, D, n), rows of
    # contiguous slots (a gather along slots would be per element). Same per-element
    # arithmetic as apply_rope.
    cos, sin = rerotation(model, old[moved], new[moved])  # (t, D) float32
    d = cos.shape[1]
    c, s = cos.new_ones(n, d), sin.new_zeros(n, d)
    c[moved], s[moved] = cos, sin
    c, s = c.t().contiguous(), s.t().contiguous()  # (D, n)
    is_moved = old != new  # (n,)
    for b in a.blocks:
        if b.device != c.device:
            c, s, is_moved = c.to(b.device), s.to(b.device), is_moved.to(b.device)
        for i in range(b.kt.shape[0]):  # per layer: a float32 temporary
            x = b.kt[i, :, :, :n].float()  # (KVH, D, n)
            rot = torch.cat((-x[:, d // 2:], x[:, : d // 2]), dim=1)  # rotate_half over D
            b.kt[i, :, :, :n] = torch.where(is_moved, x * c + rot * s, x)
        b.renorm(0, n, values=False)


def _reindex(model: Model, state: State, cold_keep: int | None,
             undo: Undo | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                             list[int]]:
    """Positions become 0..n-1 in text order over the hot slots and the cold store's rows
    together (the oldest cold rows to enter past ``cold_keep`` dropped for good first);
    each moved key, hot or cold, is re-rotated by the exact rotation old -> new. Returns
    the hot slots' (old, new) positions (n,) in slot order, the cold rows' new positions
    and the dropped uids."""
    a, m, cold = state.arena, state.ledger, state.cold
    dropped = [] if cold is None or cold_keep is None else drop_oldest(state, cold.n - cold_keep,
                                                                       undo)
    old = m.live("position").clone()  # (n,)
    old_cold = cold.ledger.live("position").clone() if cold is not None else old[:0]
    both = torch.cat((old, old_cold))
    ranks = torch.empty_like(both)
    ranks[torch.argsort(both)] = torch.arange(both.numel(), device=both.device)
    new, new_cold = ranks[: m.n], ranks[m.n:]
    m.position[: m.n] = new  # ledger first
    _rotate(model, a, old, new)
    if cold is None:
        return old, new, None, dropped
    undo.save_positions()
    cold.ledger.position[: cold.n] = new_cold
    _rotate(model, cold.arena, old_cold, new_cold)
    return old, new, new_cold, dropped


def _append(state: State, gen: GenerateOut, position: int, model: Model, step: int,
            slot: int) -> tuple[int, int, torch.Tensor]:
    """Write the pending token at ``position`` into ``slot`` (the live count's, or the hole
    a removal left for it: ``rows.remove``), its key re-rotated if a re-index moved it."""
    a, m = state.arena, state.ledger
    n = a.n
    k = gen.k
    if position != gen.position:  # filled there: no copy from host memory
        cos, sin = rerotation(model, *(torch.full((1,), x, device=m.device)
                                       for x in (gen.position, position)))
        k = apply_rope(gen.k.float(), cos, sin).to(gen.k.dtype)  # (L, KVH, 1, D)
    flag = FLAG_PROTECTED if state.pending_source in state.pinned else 0
    (uid,) = write_rows(m, slice(slot, slot + 1), gen.input_token, position,
                         SOURCES.index(state.pending_source), step, flag)
    m.n = n + 1
    write(a, slot, k, gen.v)
    a.n = n + 1
    return slot, uid, k


def _undo(m: Ledger, actions: Actions) -> tuple:
    """What ``apply`` will change of the ledger ``m``, copied, and only that: the rows of
    the slots it rewrites (a merge's, a recall's, each hole a removal fills or leaves for
    the append, the append's when it lands below the live count), the scorer columns it
    writes whole, the positions a re-index writes, the counts. (slots, their rows by
    ``Ledger.tables`` table (the table, its row dimension, the copy), whole columns, next
    uid, dropped)."""
    n = m.n
    gone = list(actions.cull_slots) + [r.slots[1] for r in actions.merges]
    kept = n - len(gone)
    slots = ({r.slots[0] for r in actions.merges} | {s.slot for s in actions.swaps}
             | {s for s in gone if s < kept} | ({kept} if kept < n else set()))
    whole = set(actions.columns or ()) | ({"position"} if actions.reindex else set())
    at = torch.tensor(sorted(slots), dtype=torch.long).to(m.device, non_blocking=True)
    # the tables as they are now: a whole-token ``apply`` replaces no column's tensor
    saved_whole = {id(m.col(c)) for c in whole}  # a packed table's rows are copied anyway
    return (at, [(x, dim, x.index_select(dim, at)) for x, dim in m.tables()
                 if id(x) not in saved_whole],
            {c: m.live(c).clone() for c in whole}, m.next_uid, m.dropped)


@torch.no_grad()
def apply(model: Model, state: State, gen: GenerateOut, actions: Actions = NO_ACTIONS) -> Patch:
    """Stage 4: in this order, write the scorer's columns, apply merges, fold culled slots'
    K/V into their survivors, swap recalled cold tokens in (their hot slots' tokens go cold),
    move culled tokens into the cold store (with recall), remove culled and repair-partner
    slots, re-index positions (the cold store's too), append the pending token; the sampled
    token becomes pending.

    Updates ``state`` in place (same arena tensors; O(changed tokens)). Atomic for the arena
    and the ledger, and for the cold store: bad actions raise before anything changes; a
    failure part-way restores the ledger and rebuilds the arena from it, puts the cold store
    back as it was (``recall.Undo``), then re-raises.
    """
    if state.heads is not None:
        return apply_heads(model, state, gen, actions, actions.reindex)
    culled_uids = _check(model, state, gen, actions)
    m, step = state.ledger, state.step + 1
    n = m.n
    undo, cold_undo = _undo(m, actions), Undo.of(state.cold)
    culls = list(actions.cull_slots)
    reindex_from = reindex_to = cold_to = None
    cooled, dropped = [], []
    try:
        for name, t in (actions.columns or {}).items():  # 1) the scorer's columns
            m.columns[name][:n] = t
        new_uids = [merge(state, r, step) for r in actions.merges]  # 2) merges
        for f in actions.folds:  # 3) folds
            fold(state, f)
        swapped, culled = leaving_rows(state, actions.swaps, culls)
        swap(state, actions.swaps, step, swapped, cold_undo)  # 4) recalls
        if state.cold is not None:  # 5) culled tokens go cold, or away for good
            cooled, dropped = cool(model, state, culls, culled, cold_undo)
        else:
            m.dropped += len(culls)
        moves, free = remove(state.arena, m, culls + [r.slots[1] for r in actions.merges],
                             room=not actions.reindex)  # 6) a hole left for the append
        position = gen.position
        if actions.reindex:  # 7) positions 0..n-1; the appended token comes next
            reindex_from, reindex_to, cold_to, gone = _reindex(model, state, actions.cold_keep,
                                                               cold_undo)
            dropped += gone
            position = m.n + (state.cold.n if state.cold is not None else 0)
        slot, uid, k = _append(state, gen, position, model, step, free)  # 8) append
    except BaseException:
        at, rows, whole, next_uid, m.dropped = undo
        for x, dim, saved in rows:  # the rows first: a whole column's copy goes over them
            x.index_copy_(dim, at, saved)
        for c, x in whole.items():
            m.col(c)[:n] = x
        for uid in range(next_uid, m.next_uid):
            m.merged.pop(uid, None)
        m.n, m.next_uid = n, next_uid
        if cold_undo is not None:
            cold_undo.put_back()
        rebuild_from_ledger(model, state)  # the arena may be half-patched: make it agree
        raise
    state.step = step
    state.pending_token = gen.token_id
    state.pending_source = "assistant"
    state.next_position = position + 1
    return Patch(step=step, columns=actions.columns,
                 merges=actions.merges, merged_uids=tuple(new_uids), folds=actions.folds,
                 culled_slots=tuple(actions.cull_slots), culled_uids=tuple(culled_uids),
                 moves=tuple(moves), swaps=actions.swaps, cooled_uids=tuple(cooled),
                 dropped_uids=tuple(dropped), cold_reindex_to=cold_to,
                 reindex_from=reindex_from, reindex_to=reindex_to,
                 appended_slots=(slot,), appended_uids=(uid,), appended_positions=(position,),
                 appended_k=k, appended_v=gen.v)
