"""Stage 0/4: build and patch the cache — the only code that writes to an arena or a ledger.

- ``prime``: allocate the arena and ledger and prefill a prompt (stage 0).
- ``extend``: prefill new prompt segments onto an existing state (stage 0; chat turns,
  imported sessions).
- ``apply``: apply one step's actions atomically, in a fixed order: brightness/attn_sum,
  merges, folds (a culled slot's K/V into survivors), removals (each hole is filled by moving
  the last live slot into it, so live
  slots stay a dense prefix), position re-index (keys re-rotated exactly), then the append
  of the pending token's K/V (stage 4).
- ``rebuild_from_ledger``: re-prefill the arena from the ledger after a failure part-way.
"""
from __future__ import annotations

import math

import torch

from ..forward import apply_rope, forward, rerotation
from ..model import Model
from ..state import (FLAG_PROTECTED, MAX_BRIGHTNESS, Arena, Ledger, State, key_norms,
                     value_norms)
from ..types import (NO_ACTIONS, SOURCES, Actions, Fold, GenerateOut, Patch, PrimeOut, Merge,
                     Segment, require)

PREFILL_CHUNK = 256


def _write_rows(m: Ledger, slots: slice, token_ids: torch.Tensor, positions: torch.Tensor,
                sources: torch.Tensor, step: int, flags: torch.Tensor) -> list[int]:
    """Fill ledger rows ``slots`` for new tokens; returns their fresh uids."""
    count = token_ids.shape[0]
    uids = torch.arange(m.next_uid, m.next_uid + count, device=m.device)
    m.uid[slots] = uids
    m.token_id[slots] = token_ids
    m.position[slots] = positions
    m.source[slots] = sources
    m.brightness[slots] = torch.tensor(m.seeds, device=m.device)[sources.long()]
    m.attn_sum[slots] = 0.0
    m.born_step[slots] = step
    m.changed_step[slots] = step
    m.flags[slots] = flags
    m.next_uid += count
    return uids.tolist()


def _prefill(model: Model, state: State, ids: torch.Tensor, positions: torch.Tensor,
             sources: torch.Tensor, flags: torch.Tensor, chunk: int,
             all_logits: bool) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Append ``ids`` at ``positions`` in causal chunks; each chunk attends to all live slots."""
    a, m = state.arena, state.ledger
    logits, slots, uids = [], [], []
    for start in range(0, ids.shape[0], chunk):
        sl = slice(start, start + chunk)
        n = a.n
        out = forward(model, a.k[:, :, :n], a.v[:, :, :n], ids[sl], positions[sl],
                      all_logits=all_logits, past_log_mass=a.live_log_mass(n))
        t = out.k.shape[2]
        a.k[:, :, n:n + t] = out.k  # (L, KVH, t, D)
        a.v[:, :, n:n + t] = out.v
        a.log_mass[:, :, n:n + t] = 0.0
        a.renorm(n, n + t)
        uids += _write_rows(m, slice(n, n + t), ids[sl], positions[sl], sources[sl],
                            state.step, flags[sl])
        slots += range(n, n + t)
        a.n = m.n = n + t
        logits.append(out.logits)
    return logits, slots, uids


@torch.no_grad()
def prime(model: Model, segments: list[Segment], capacity: int,
          pinned: frozenset[str] = frozenset(), chunk: int = PREFILL_CHUNK,
          all_logits: bool = False,
          seeds: tuple[float, ...] | None = None) -> tuple[State, PrimeOut]:
    """Stage 0: allocate an arena of ``capacity`` slots and prefill all prompt tokens but
    the last, which becomes the pending token (stage 1 runs it and samples the first
    generated token). Tokens whose source is in ``pinned`` are protected from culls;
    ``seeds`` gives new tokens' brightness by source (SOURCES order; default: the max).

    ``capacity``: the arena's slots (``loop.arena_capacity`` chooses them for a session).
    """
    ids_list = [i for s in segments for i in s.ids]
    require(len(ids_list) > 0, "the prompt is empty")
    require(capacity >= 1, f"capacity must be >= 1, got {capacity}")
    require(len(ids_list) <= capacity,
            f"the prompt has {len(ids_list)} tokens, more than the arena's capacity of {capacity}")
    require(len(ids_list) <= model.spec.max_positions,
            f"the prompt has {len(ids_list)} tokens, more than the model's "
            f"{model.spec.max_positions} positions")
    bad = [i for i in ids_list if not 0 <= i < model.spec.vocab]
    require(not bad, f"token id {bad[:1]} outside the model's vocabulary of {model.spec.vocab}")
    require(chunk >= 1, f"prefill chunk must be >= 1, got {chunk}")

    src = [SOURCES.index(s.source) for s in segments for _ in s.ids]
    flg = [FLAG_PROTECTED if s.source in pinned else 0 for s in segments for _ in s.ids]
    state = State(Arena.allocate(model.spec, capacity, model.dtype, model.device),
                  Ledger.allocate(capacity, seeds, model.device), pinned=tuple(sorted(pinned)))
    T = len(ids_list) - 1
    dev = model.device
    logits, slots, uids = _prefill(
        model, state, torch.tensor(ids_list[:T], device=dev), torch.arange(T, device=dev),
        torch.tensor(src[:T], dtype=torch.int8, device=dev),
        torch.tensor(flg[:T], dtype=torch.int8, device=dev), chunk, all_logits)
    state.pending_token = ids_list[-1]
    state.pending_source = segments[-1].source
    state.next_position = T
    rows = torch.cat(logits) if logits else torch.empty(0, model.spec.vocab, device=dev)
    patch = Patch(step=0, appended_slots=tuple(slots), appended_uids=tuple(uids))
    return state, PrimeOut(logits=rows, patch=patch)


@torch.no_grad()
def extend(model: Model, state: State, segments: list[Segment], chunk: int = PREFILL_CHUNK,
           pending: int | None = None) -> Patch:
    """Stage 0 on a live state: prefill the pending token, then every new id but the last,
    which becomes the pending token (a chat turn, or an imported session's next prompt).

    Positions continue from ``state.next_position``; tokens whose source is pinned
    (``state.pinned``) are protected. ``pending`` first replaces the pending token, which is not cached yet
    (a chat closes a reply that ended on another stop token with its end-of-turn marker).
    Raises UserError (changing nothing) if they would not fit.
    """
    new = [i for s in segments for i in s.ids]
    require(len(new) > 0, "nothing to extend: the segments are empty")
    a, spec = state.arena, model.spec
    require(a.n + len(new) <= a.capacity, f"{len(new)} more tokens do not fit the arena "
            f"({a.n} of {a.capacity} slots live)")
    require(state.next_position + len(new) < spec.max_positions,
            f"{len(new)} more tokens would pass the model's {spec.max_positions} positions")
    first = state.pending_token if pending is None else pending
    bad = [i for i in [first] + new if not 0 <= i < spec.vocab]
    require(not bad, f"token id {bad[:1]} outside the model's vocabulary of {spec.vocab}")
    ids = [first] + new[:-1]
    src = [state.pending_source] + [s.source for s in segments for _ in s.ids][:-1]
    dev = model.device
    _, slots, uids = _prefill(
        model, state, torch.tensor(ids, device=dev),
        torch.arange(state.next_position, state.next_position + len(ids), device=dev),
        torch.tensor([SOURCES.index(x) for x in src], dtype=torch.int8, device=dev),
        torch.tensor([FLAG_PROTECTED if x in state.pinned else 0 for x in src], dtype=torch.int8,
                     device=dev), chunk, all_logits=False)
    state.pending_token = new[-1]
    state.pending_source = segments[-1].source
    state.next_position += len(ids)
    return Patch(step=state.step, appended_slots=tuple(slots), appended_uids=tuple(uids))


def _check(state: State, gen: GenerateOut, actions: Actions) -> None:
    """Refuse bad actions before anything changes (stale slots, protected slots, shapes)."""
    a, m = state.arena, state.ledger
    n = m.n
    assert gen.position == state.next_position and gen.input_token == state.pending_token, \
        "the generate output is not for this state's pending token"
    assert gen.k.shape == (a.k.shape[0], a.k.shape[1], 1, a.k.shape[3]), \
        f"new K has shape {tuple(gen.k.shape)}"
    assert gen.k.dtype == gen.v.dtype == a.v.dtype, f"new K/V are {gen.k.dtype}, not {a.v.dtype}"
    for name, top in (("brightness", MAX_BRIGHTNESS), ("attn_sum", float("inf"))):
        t = getattr(actions, name)
        assert t is None or t.shape == (n,), f"bad {name} for {n} slots"
        if t is not None and n:
            lo, hi = (float(x) for x in t.aminmax())  # a NaN fails the comparisons
            assert 0 <= lo and hi <= top and math.isfinite(hi), \
                f"{name} outside [0, {top}]: [{lo}, {hi}]"
    slots = list(actions.cull_slots) + [s for r in actions.merges for s in r.slots]
    require(len(set(slots)) == len(slots), f"a slot is culled or repaired twice: {slots}")
    require(all(0 <= s < n for s in slots), f"a cull or repair slot is outside [0, {n})")
    protected = [s for s in slots if int(m.flags[s]) & FLAG_PROTECTED]
    require(not protected, f"slots {protected} are protected and cannot be culled")
    for r in actions.merges:
        assert r.k.shape == gen.k.shape and r.v.shape == gen.v.shape, "repair K/V shape"
        assert r.k.dtype == r.v.dtype == a.v.dtype, "repair K/V dtype"
        assert (int(m.uid[r.slots[0]]), int(m.uid[r.slots[1]])) == r.uids, "stale repair"
        assert int(m.position[r.slots[0]]) == r.position, "repair position"
    culled = set(actions.cull_slots)
    changed = culled | {s for r in actions.merges for s in r.slots}
    for f in actions.folds:
        assert f.slot in culled and int(m.uid[f.slot]) == f.uid, "a fold of a slot not culled"
        assert f.into.shape == a.log_mass.shape[:2], f"fold targets have shape {tuple(f.into.shape)}"
        into = set(f.into.flatten().tolist()) - {-1}
        assert all(0 <= s < n for s in into) and not into & changed, \
            "a fold into a slot that goes or is repaired"
    removed = len(actions.cull_slots) + len(actions.merges)
    require(n - removed < a.capacity,
            f"the arena is full ({a.capacity} slots); set a budget to cull")


def _merge(state: State, r: Merge, step: int) -> int:
    """Rewrite slot ``r.slots[0]`` as the merged token (a fresh uid; source kept; brightness
    the pair's max); its partner is removed with the culls. Returns the new uid."""
    a, m = state.arena, state.ledger
    s, t = r.slots
    uid = m.next_uid
    m.next_uid += 1
    m.merged[uid] = r.uids
    m.brightness[s] = torch.maximum(m.brightness[s], m.brightness[t])
    m.uid[s], m.token_id[s], m.position[s] = uid, r.token_id, r.position
    m.born_step[s] = m.changed_step[s] = step
    m.flags[s], m.attn_sum[s] = 0, 0.0
    a.k[:, :, s:s + 1] = r.k
    a.v[:, :, s:s + 1] = r.v
    a.log_mass[:, :, s] = 0.0
    a.renorm(s, s + 1, r.k, r.v)
    return uid


def _fold(state: State, f: Fold) -> None:
    """Fold slot ``f.slot``'s K/V into ``f.into`` (one slot per layer and KV head, -1 =
    none there): there K and V become the mass-weighted mean of both, and the log-mass
    their log-sum-exp, so a query that scores both keys alike gives the pair the attention
    it gave them apart."""
    a = state.arena
    li, hi = (f.into >= 0).nonzero(as_tuple=True)  # the (layer, KV head) pairs that fold
    if len(li) == 0:
        return
    into = f.into[li, hi]
    lm_i, lm_j = a.log_mass[li, hi, into], a.log_mass[li, hi, f.slot]  # (p,)
    w = torch.sigmoid(lm_j - lm_i).unsqueeze(-1)  # m_j / (m_i + m_j), (p, 1)
    for t, norm, rows in ((a.k, a.knorm, key_norms), (a.v, a.vnorm, value_norms)):
        x = t[li, hi, into].float()  # (p, D)
        folded = (x + w * (t[li, hi, f.slot].float() - x)).to(t.dtype)
        t[li, hi, into] = folded
        norm[li, hi, into] = rows(folded)
    a.log_mass[li, hi, into] = torch.logaddexp(lm_i, lm_j)
    a.folded = True


def _remove(state: State, slots: list[int]) -> list[tuple[int, int]]:
    """Remove live slots; the survivors among the last ``len(slots)`` slots fill the holes
    below them (O(1) per token). Each move reads an original slot, never one that another
    move has just filled, so all of them can be done at once."""
    a, m = state.arena, state.ledger
    gone = set(slots)
    n = m.n - len(gone)
    fillers = [s for s in range(n, m.n) if s not in gone]
    moves = list(zip(fillers, sorted(s for s in gone if s < n)))  # (from_slot, to_slot)
    if moves:
        src = torch.tensor([f for f, _ in moves], device=m.device)
        dst = torch.tensor([t for _, t in moves], device=m.device)
        for c in Ledger.COLUMNS:  # ledger first: a later failure rebuilds from it
            col = getattr(m, c)
            col[dst] = col[src]
    m.n = n
    if moves:
        for f, t in moves:  # slot by slot: slice copies beat index copies for a few slots
            a.kt[..., t] = a.kt[..., f]
            for x in (a.v, a.log_mass, a.knorm, a.vnorm):
                x[:, :, t] = x[:, :, f]
    a.n = n
    return moves


def _reindex(model: Model, state: State) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions become 0..n-1 in text order; each moved key is re-rotated by the exact
    rotation old -> new. Returns (old, new) positions (n,) in slot order."""
    a, m = state.arena, state.ledger
    n = m.n
    old = m.live("position").clone()  # (n,)
    new = torch.empty_like(old)
    new[torch.argsort(old)] = torch.arange(n, device=old.device)
    moved = (old != new).nonzero()[:, 0]  # (t,) slots whose position changes
    m.position[:n] = new  # ledger first
    if moved.numel():
        # Rotate the whole live block in the keys' stored layout (KVH, D, n), rows of
        # contiguous slots (a gather along slots would be per element); unmoved slots keep
        # their exact bits. Same per-element arithmetic as apply_rope.
        cos, sin = rerotation(model, old[moved], new[moved])  # (t, D) float32
        d = cos.shape[1]
        c, s = cos.new_ones(n, d), sin.new_zeros(n, d)
        c[moved], s[moved] = cos, sin
        c, s = c.t().contiguous(), s.t().contiguous()  # (D, n)
        is_moved = old != new  # (n,)
        for i in range(a.kt.shape[0]):  # per layer: a float32 temporary
            x = a.kt[i, :, :, :n].float()  # (KVH, D, n)
            rot = torch.cat((-x[:, d // 2:], x[:, : d // 2]), dim=1)  # rotate_half over D
            a.kt[i, :, :, :n] = torch.where(is_moved, x * c + rot * s, x)
        a.renorm(0, n, values=False)
    return old, new


def _append(state: State, gen: GenerateOut, position: int, model: Model,
            step: int) -> tuple[int, int, torch.Tensor]:
    """Write the pending token at ``position`` (its key re-rotated if a re-index moved it)."""
    a, m = state.arena, state.ledger
    n = a.n
    k = gen.k
    def row(x: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor([x], dtype=dtype, device=m.device)

    if position != gen.position:
        cos, sin = rerotation(model, row(gen.position), row(position))
        k = apply_rope(gen.k.float(), cos, sin).to(gen.k.dtype)  # (L, KVH, 1, D)
    flag = FLAG_PROTECTED if state.pending_source in state.pinned else 0
    (uid,) = _write_rows(m, slice(n, n + 1), row(gen.input_token), row(position),
                         row(SOURCES.index(state.pending_source), torch.int8), step,
                         row(flag, torch.int8))
    m.n = n + 1
    a.k[:, :, n:n + 1] = k
    a.v[:, :, n:n + 1] = gen.v
    a.log_mass[:, :, n] = 0.0
    a.renorm(n, n + 1, k, gen.v)
    a.n = n + 1
    return n, uid, k


@torch.no_grad()
def apply(model: Model, state: State, gen: GenerateOut, actions: Actions = NO_ACTIONS) -> Patch:
    """Stage 4: in this order, write brightness/attn_sum, apply merges, fold culled slots'
    K/V into their survivors, remove culled and repair-partner slots, re-index positions, append the pending token; the sampled token
    becomes pending.

    Updates ``state`` in place (same arena tensors; O(changed tokens)). Atomic: bad actions
    raise before anything changes; a failure part-way restores the ledger and rebuilds the
    arena from it, then re-raises.
    """
    _check(state, gen, actions)
    m, step = state.ledger, state.step + 1
    n = m.n
    undo = ({c: m.live(c).clone() for c in Ledger.COLUMNS}, m.next_uid)  # (n,) each: the ledger
    culled_uids = m.uid[list(actions.cull_slots)].tolist()
    reindex_from = reindex_to = None
    try:
        if actions.brightness is not None:  # 1) the scorer's persistent columns
            m.brightness[:n] = actions.brightness
        if actions.attn_sum is not None:
            m.attn_sum[:n] = actions.attn_sum
        new_uids = [_merge(state, r, step) for r in actions.merges]  # 2) merges
        for f in actions.folds:  # 3) folds
            _fold(state, f)
        moves = _remove(state, list(actions.cull_slots)  # 4) removals
                        + [r.slots[1] for r in actions.merges])
        position = gen.position
        if actions.reindex:  # 5) positions 0..n-1; the appended token comes next
            reindex_from, reindex_to = _reindex(model, state)
            position = m.n
        slot, uid, k = _append(state, gen, position, model, step)  # 6) append
    except BaseException:
        cols, next_uid = undo
        for c, col in cols.items():
            getattr(m, c)[:n] = col
        for uid in range(next_uid, m.next_uid):
            m.merged.pop(uid, None)
        m.n, m.next_uid = n, next_uid
        rebuild_from_ledger(model, state)  # the arena may be half-patched: make it agree
        raise
    state.step = step
    state.pending_token = gen.token_id
    state.pending_source = "assistant"
    state.next_position = position + 1
    return Patch(step=step, brightness=actions.brightness, attn_sum=actions.attn_sum,
                 merges=actions.merges, merged_uids=tuple(new_uids), folds=actions.folds,
                 culled_slots=tuple(actions.cull_slots), culled_uids=tuple(culled_uids),
                 moves=tuple(moves), reindex_from=reindex_from, reindex_to=reindex_to,
                 appended_slots=(slot,), appended_uids=(uid,), appended_positions=(position,),
                 appended_k=k, appended_v=gen.v)


@torch.no_grad()
def rebuild_from_ledger(model: Model, state: State, chunk: int = PREFILL_CHUNK) -> None:
    """Re-prefill every live token (in position order, at its position) so the arena
    agrees with the ledger again. Slot order becomes position order; folds are lost (every
    slot holds its own token's K/V again)."""
    m = state.ledger
    order = torch.argsort(m.live("position"))
    cols = {c: m.live(c)[order].clone() for c in Ledger.COLUMNS}
    a = state.arena
    a.n = 0
    a.log_mass.zero_()
    a.folded = False
    n = cols["uid"].shape[0]
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        out = forward(model, a.k[:, :, :start], a.v[:, :, :start], cols["token_id"][sl],
                      cols["position"][sl], kv_only=True)
        t = out.k.shape[2]
        a.k[:, :, start:start + t] = out.k
        a.v[:, :, start:start + t] = out.v
        a.renorm(start, start + t)
        a.n = start + t
    for c, col in cols.items():
        getattr(m, c)[:n] = col
    m.n = a.n = n


@torch.no_grad()
def restore(model: Model, k: torch.Tensor, v: torch.Tensor, columns: dict[str, torch.Tensor],
            capacity: int, ledger_fields: dict, state_fields: dict,
            log_mass: torch.Tensor) -> State:
    """Stage 0 from a saved session (checked by ``session_io``): allocate ``capacity`` slots
    and write back the live prefix ``k``/``v`` (L, kv_heads, n, head_dim), the ledger
    ``columns`` (name -> (n,), every one of ``Ledger.COLUMNS``) and the slots' ``log_mass``
    (L, kv_heads, n) float32; ``ledger_fields`` (next_uid, merged, ...) and ``state_fields``
    (pending token, its source and position, step, pinned) are set as given. An
    inconsistent ledger fails ``check_valid`` (AssertionError)."""
    n = k.shape[2]
    state = State(Arena.allocate(model.spec, capacity, model.dtype, model.device),
                  Ledger.allocate(capacity, device=model.device), **state_fields)
    a, m = state.arena, state.ledger
    for c in Ledger.COLUMNS:
        getattr(m, c)[:n] = columns[c]
    for name, value in ledger_fields.items():
        setattr(m, name, value)
    a.k[:, :, :n] = k
    a.v[:, :, :n] = v
    a.renorm(0, n)
    a.log_mass[:, :, :n] = log_mass
    a.folded = bool((log_mass > 0).any())
    a.n = m.n = n
    state.check_valid()
    return state
