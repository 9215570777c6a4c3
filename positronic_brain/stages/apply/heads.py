"""Stage 4 for per-head caches (an ``Allocation`` whose heads keep tokens of their own;
stage 0 makes one: ``prefill.add_heads``): each (layer, KV head) holds its own tokens in its
own slots of the arena.

``state.heads`` (``state.Heads``) says which ledger row each (layer, KV head, slot) holds;
a head's live slots are its dense prefix ``[0, n)``, as the whole arena's are with
whole-token eviction. The ledger holds every token that some head still holds (its rows
in no particular slot), and the arena's ``n`` is the largest head's count, the slots
stage 1 reads (a head with fewer masks the rest). A step culls per head (the hole filled
by the head's last slot, O(1) a token), drops the ledger rows no head holds any more,
re-indexes per slot, and appends the pending token to every head.
"""
from __future__ import annotations

import torch

from ...forward import apply_rope, rerotation
from ...model import Model
from ...state import FLAG_PROTECTED, Ledger, State, key_norms
from ...types import SOURCES, Actions, GenerateOut, Patch, require
from . import cold_heads
from .fold import fold_heads
from .restore import rebuild_from_ledger
from .rows import append_heads, arena, column_ranges, drop_unheld, in_range


def _check(model: Model, state: State, gen: GenerateOut, actions: Actions) -> torch.Tensor:
    """Refuse bad per-head actions before anything changes: the culls are a (L, KVH, n)
    mask over live slots, none of a protected token, and the append fits every head."""
    a, m, h, spec = state.arena, state.ledger, state.heads, model.spec
    assert gen.position == state.next_position and gen.input_token == state.pending_token, \
        "the generate output is not for this state's pending token"
    assert gen.k.shape == (spec.n_layers, spec.n_kv_heads, 1, spec.head_dim), \
        f"new K has shape {tuple(gen.k.shape)}"
    assert not (actions.cull_slots or actions.merges or actions.folds or actions.swaps), \
        "a per-head cache takes per-head culls, folds and swaps only"
    assert actions.head_swaps is None or state.cold is not None, "per-head swaps without recall"
    culls = actions.head_culls
    if culls is None:
        culls = torch.zeros(h.row.shape[:2] + (a.n,), dtype=torch.bool, device=m.device)
    assert culls.shape == h.row.shape[:2] + (a.n,) and culls.dtype == torch.bool, \
        f"per-head culls have shape {tuple(culls.shape)}"
    rows = h.row[:, :, :a.n]
    ranges = column_ranges(m, actions.columns, m.n)
    read = torch.cat([r for _, _, r in ranges] + [
        _bad_folds(actions.head_folds, culls, h.live(a.n)).view(1).double(),
        (culls & (rows < 0)).any().view(1).double(),
        (culls & (m.flags[rows.clamp(min=0)] & FLAG_PROTECTED != 0)).any().view(1).double(),
        (h.n - culls.sum(-1)).max().view(1).double()]).tolist()
    in_range(ranges, read[:-4])
    _check_swaps(state, actions, culls)
    assert not read[-4], "a per-head fold of a slot not culled, or into one that goes or is free"
    assert not read[-3], "a per-head cull of a slot its head does not hold"
    require(not read[-2], "a per-head cull of a protected token")
    require(read[-1] < a.capacity, f"the arena is full ({a.capacity} slots); set a budget to cull")
    return culls


def _check_swaps(state: State, actions: Actions, culls: torch.Tensor) -> None:
    """Per-head swaps pair a hot slot its head holds and keeps with a cold slot it holds,
    each at most once."""
    swaps = actions.head_swaps
    if swaps is None or not swaps.numel():
        return
    h, ch = state.heads, state.cold.heads
    assert swaps.dim() == 2 and swaps.shape[1] == 4, f"per-head swaps {tuple(swaps.shape)}"
    lh, hh, s, c = swaps.unbind(1)
    L, KVH = h.n.shape
    ok = ((lh >= 0) & (lh < L) & (hh >= 0) & (hh < KVH)).all()
    assert bool(ok), "a per-head swap outside the heads"
    ok = ((s >= 0) & (s < h.n[lh, hh]) & (c >= 0) & (c < ch.n[lh, hh])).all()
    assert bool(ok) and not bool(culls[lh, hh, s].any()), \
        "a per-head swap of a slot its head does not hold or culls"
    key = (lh * KVH + hh) * (h.row.shape[2] + ch.row.shape[2])
    assert torch.unique(key + s).numel() == torch.unique(key + h.row.shape[2] + c).numel() \
        == s.numel(), "a per-head slot swapped twice"
    for name, x in (actions.head_recalled or {}).items():
        assert name in state.ledger.columns and x.shape == s.shape, f"recalled {name}"


def _bad_folds(folds: torch.Tensor | None, culls: torch.Tensor,
               live: torch.Tensor) -> torch.Tensor:
    """Whether any fold is of a slot its head does not cull, or into one it culls or does
    not hold (a 0-d bool; False without folds)."""
    if folds is None:
        return torch.zeros((), dtype=torch.bool, device=culls.device)
    assert folds.shape == culls.shape, f"per-head folds have shape {tuple(folds.shape)}"
    into = folds.clamp(0, culls.shape[-1] - 1)
    return ((folds >= 0) & (~culls | culls.gather(-1, into) | ~live.gather(-1, into)
                            | (folds >= culls.shape[-1]))).any()


def _saved(state: State) -> tuple:
    """What a per-head step changes of the ledger, the head map and the cold store, copied
    (the arena and the cold K/V are rebuilt from them on a failure)."""
    m, h = state.ledger, state.heads
    return ({c: m.live(c).clone() for c in m.names}, m.n, m.next_uid, m.dropped,
            h.row.clone(), h.n.clone(), cold_heads.Saved.of(state.cold))


def _put_back(model: Model, state: State, saved: tuple) -> None:
    """Undo a per-head step that failed part-way: the ledger and head map as saved, each
    head's slots re-prefilled from the ledger (folds and the decode's own K/V are lost,
    as ``rebuild_from_ledger`` loses them)."""
    m, h = state.ledger, state.heads
    cols, m.n, m.next_uid, m.dropped, row, n, cold = saved
    for c, x in cols.items():
        m.col(c)[:m.n] = x
    h.row.copy_(row)
    h.n.copy_(n)
    state.arena.n = int(n.max())
    if cold is not None:
        cold.put_back()
    _rebuild(model, state)


def _rebuild(model: Model, state: State) -> None:
    """Each head's slots, hot and cold, from a fresh prefill of every token some head holds
    (in a scratch arena)."""
    m, a, h, cold = state.ledger, state.arena, state.heads, state.cold
    sides = [(a, h, m)] + ([] if cold is None else [(cold.arena, cold.heads, cold.ledger)])
    uid = torch.cat([x.live("uid") for _, _, x in sides])
    position = torch.cat([x.live("position") for _, _, x in sides])
    uids, first = cold_heads.unique_first(uid)
    t = uids.numel()
    scratch = State(arena(model, max(1, t)), Ledger.allocate(max(1, t), m.specs, m.device))
    for c in ("uid", "token_id", "position", "source", "flags", "born_step"):
        scratch.ledger.col(c)[:t] = torch.cat([x.live(c) for _, _, x in sides])[first]
    scratch.ledger.n = scratch.arena.n = t
    rebuild_from_ledger(model, scratch)  # its slot j: the j-th token in text order
    order = torch.unique(position, sorted=True, return_inverse=True)[1]  # a token's text rank
    done = 0
    for arena_, heads_, ledger in sides:
        at = order[done:done + ledger.n]
        done += ledger.n
        lh, hh, s = heads_.live(arena_.n).nonzero().unbind(1)
        src = at[heads_.row[lh, hh, s]]
        b = scratch.arena
        arena_.k[lh, hh, s] = b.k[lh, hh, src]
        for name in ("v", "knorm", "vnorm"):
            getattr(arena_, name)[lh, hh, s] = getattr(b, name)[lh, hh, src]
    a.log_mass.zero_()


def _remove(state: State, culls: torch.Tensor) -> int:
    """Each head's culled slots go; its last survivors fill the holes below its new count
    (per head as ``rows.remove`` does for the whole arena). Returns the slots moved."""
    a, h = state.arena, state.heads
    width = culls.shape[2]
    left = h.n - culls.sum(-1)  # (L, KVH)
    at = torch.arange(width, device=culls.device)
    below = at < left.unsqueeze(-1)
    holes = (culls & below).nonzero()  # (t, 3), in (layer, head, slot) order
    movers = (h.live(width) & ~culls & ~below).nonzero()  # as many per head as holes
    if movers.numel():
        lh, hh, src = movers.unbind(1)
        dst = holes[:, 2]
        a.kt[lh, hh, :, dst] = a.kt[lh, hh, :, src]
        for x in (a.v, a.knorm, a.vnorm, a.log_mass, h.row):
            x[lh, hh, dst] = x[lh, hh, src]
    h.row[:, :, :width].masked_fill_(~below, -1)
    h.n.copy_(left)
    return movers.shape[0]


def _drop_rows(state: State) -> list[int]:
    """Ledger rows that no head holds any more leave it. Returns their uids."""
    return drop_unheld(state.ledger, state.heads.row[:, :, :state.arena.n]).tolist()


def _reindex(model: Model, state: State) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Positions become 0..n-1 in text order, n the tokens held hot or cold; each head's
    slots re-rotate their keys by their token's move, as the whole-token re-index does
    (``patch._rotate``). Returns the hot rows' old and new positions, and n."""
    a, m, h, cold = state.arena, state.ledger, state.heads, state.cold
    old = m.live("position").clone()
    if cold is None:
        new, held = torch.empty_like(old), m.n
        new[torch.argsort(old)] = torch.arange(m.n, device=m.device)
    else:  # hot and cold ranked together: a token both hot and cold has one position
        ranks, both = torch.unique(torch.cat((old, cold.ledger.live("position"))),
                                   sorted=True, return_inverse=True)
        new, held = both[:m.n], ranks.numel()
        cold_heads.reindex_cold(model, cold, both[m.n:])
    m.position[:m.n] = new
    live = h.live(a.n)
    lh, hh, s = live.nonzero().unbind(1)
    r = h.row[lh, hh, s]
    moved = old[r] != new[r]
    lh, hh, s, r = lh[moved], hh[moved], s[moved], r[moved]
    if r.numel():
        cos, sin = rerotation(model, old[r], new[r])  # (t, D)
        x = a.kt[lh, hh, :, s].float()
        a.kt[lh, hh, :, s] = apply_rope(x, cos, sin).to(a.kt.dtype)
        a.knorm[lh, hh, s] = key_norms(a.kt[lh, hh, :, s])
    return old, new, held


def _append(state: State, gen: GenerateOut, position: int, model: Model, step: int) -> int:
    """The pending token becomes a ledger row and every head's next slot."""
    m = state.ledger
    k = gen.k
    if position != gen.position:
        cos, sin = rerotation(model, m.uid.new_tensor([gen.position]), m.uid.new_tensor([position]))
        k = apply_rope(gen.k.float(), cos, sin).to(gen.k.dtype)

    def one(x: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.full((1,), x, dtype=dtype, device=m.device)

    flag = FLAG_PROTECTED if state.pending_source in state.pinned else 0
    (uid,) = append_heads(state, k, gen.v, one(gen.input_token), one(position),
                          one(SOURCES.index(state.pending_source), torch.int8),
                          one(flag, torch.int8), step)
    return uid


@torch.no_grad()
def apply_heads(model: Model, state: State, gen: GenerateOut, actions: Actions,
                reindex: bool) -> Patch:
    """Stage 4 of a per-head cache, all or nothing: the scorer's columns, each head's
    culls, the ledger rows no head holds dropped, the re-index, the append."""
    culls = _check(model, state, gen, actions)
    m, step, cold = state.ledger, state.step + 1, state.cold
    saved, hot_before = _saved(state), m.n
    reindex_from = reindex_to = None
    recalled = ()
    try:
        for name, t in (actions.columns or {}).items():
            m.columns[name][:m.n] = t
        if actions.head_folds is not None:
            fold_heads(state, actions.head_folds)
        if cold is not None:
            recalled = cold_heads.swap_heads(state, actions.head_swaps, actions.head_recalled,
                                             step)
            cold_heads.cool_heads(model, state, culls)
        _remove(state, culls)
        culled = _drop_rows(state)
        keep = actions.cold_keep if reindex and actions.cold_keep is not None else None
        if keep is not None:  # less what this step's recalls added to the hot tokens
            keep = max(0, keep - max(0, m.n - hot_before))
        gone = _gone(state, culled, keep, bool(recalled))
        position = gen.position
        if reindex:
            reindex_from, reindex_to, position = _reindex(model, state)
        uid = _append(state, gen, position, model, step)
    except BaseException:
        _put_back(model, state, saved)
        raise
    state.step = step
    state.pending_token = gen.token_id
    state.pending_source = "assistant"
    state.next_position = position + 1
    return Patch(step=step, columns=actions.columns, culled_uids=tuple(culled),
                 cooled_uids=tuple(sorted(set(culled) - set(gone))) if cold else (),
                 dropped_uids=tuple(gone), head_culls=culls,
                 head_folds=actions.head_folds, head_swaps=actions.head_swaps,
                 head_recalled_uids=recalled,
                 reindex_from=reindex_from, reindex_to=reindex_to, appended_uids=(uid,),
                 appended_positions=(position,), appended_k=gen.k, appended_v=gen.v)


def _gone(state: State, culled: list[int], cold_keep: int | None, swapped: bool) -> list[int]:
    """The uids that leave the cache for good this step: those no head holds hot any more
    (``culled``) that no head holds cold either, and, with recall, the cold ones no head
    holds after the heads' cold capacity (and a re-index's ``cold_keep``) let them go or
    a swap (``swapped``) took their last cold entry back, unless hot. They are counted as
    dropped."""
    m, cold = state.ledger, state.cold
    if cold is None:
        gone = culled
    else:
        left = cold_heads.trim(cold, cold_keep, m, swapped)
        held = torch.cat((m.live("uid"), cold.ledger.live("uid")))
        out = torch.tensor(culled, dtype=torch.long, device=m.device)
        gone = sorted(set(out[~torch.isin(out, held)].tolist())
                      | set(left[~torch.isin(left, m.live("uid"))].tolist()))
    m.dropped += len(gone)
    return gone
