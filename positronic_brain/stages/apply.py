"""Stage 0/4: build and patch the cache — the only code that writes to an arena or a mirror.

- ``prime``: allocate the arena and mirror and prefill a prompt (stage 0).
- ``apply``: apply one step's patch atomically, in a fixed order: culls (each hole is
  filled by moving the last live slot into it, so live slots stay a dense prefix),
  then the append of the pending token's K/V (stage 4).
- ``rebuild_from_mirror``: re-prefill the arena from the ledger after a failure part-way.
"""
from __future__ import annotations

import torch

from ..forward import forward
from ..model import Model
from ..state import FLAG_PROTECTED, MAX_BRIGHTNESS, Arena, KVMirror, State
from ..types import (NO_ACTIONS, SOURCES, Actions, GenerateOut, Patch, PrimeOut, Segment,
                     require)

PREFILL_CHUNK = 256


def _write_rows(m: KVMirror, slots: slice, token_ids: torch.Tensor, positions: torch.Tensor,
                sources: torch.Tensor, step: int, flags: torch.Tensor) -> list[int]:
    """Fill mirror rows ``slots`` for new tokens; returns their fresh uids."""
    count = token_ids.shape[0]
    uids = torch.arange(m.next_uid, m.next_uid + count)
    m.uid[slots] = uids
    m.token_id[slots] = token_ids
    m.position[slots] = positions
    m.source[slots] = sources
    m.brightness[slots] = MAX_BRIGHTNESS
    m.born_step[slots] = step
    m.changed_step[slots] = step
    m.flags[slots] = flags
    m.next_uid += count
    return uids.tolist()


def _prefill(model: Model, state: State, ids: torch.Tensor, positions: torch.Tensor,
             sources: torch.Tensor, flags: torch.Tensor, chunk: int,
             all_logits: bool) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Append ``ids`` at ``positions`` in causal chunks; each chunk attends to all live slots."""
    a, m = state.arena, state.mirror
    logits, slots, uids = [], [], []
    for start in range(0, ids.shape[0], chunk):
        sl = slice(start, start + chunk)
        n = a.n
        out = forward(model, a.k[:, :, :n], a.v[:, :, :n], ids[sl], positions[sl],
                      all_logits=all_logits)
        t = out.k.shape[2]
        a.k[:, :, n:n + t] = out.k  # (L, KVH, t, D)
        a.v[:, :, n:n + t] = out.v
        uids += _write_rows(m, slice(n, n + t), ids[sl], positions[sl], sources[sl],
                            state.step, flags[sl])
        slots += range(n, n + t)
        a.n = m.n = n + t
        logits.append(out.logits)
    return logits, slots, uids


@torch.no_grad()
def prime(model: Model, segments: list[Segment], capacity: int | None = None,
          pinned: frozenset[str] = frozenset(), chunk: int = PREFILL_CHUNK,
          all_logits: bool = False) -> tuple[State, PrimeOut]:
    """Stage 0: allocate an arena of ``capacity`` slots and prefill all prompt tokens but
    the last, which becomes the pending token (stage 1 runs it and samples the first
    generated token). Tokens whose source is in ``pinned`` are protected from culls.

    ``capacity`` defaults to the model's maximum positions.
    """
    ids_list = [i for s in segments for i in s.ids]
    require(len(ids_list) > 0, "the prompt is empty")
    capacity = capacity or model.spec.max_positions
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
    state = State(Arena.allocate(model.spec, capacity, model.dtype), KVMirror.allocate(capacity))
    T = len(ids_list) - 1
    logits, slots, uids = _prefill(
        model, state, torch.tensor(ids_list[:T], dtype=torch.int64), torch.arange(T),
        torch.tensor(src[:T], dtype=torch.int8), torch.tensor(flg[:T], dtype=torch.int8),
        chunk, all_logits)
    state.pending_token = ids_list[-1]
    state.pending_source = segments[-1].source
    state.next_position = T
    rows = torch.cat(logits) if logits else torch.empty(0, model.spec.vocab)
    patch = Patch(step=0, appended_slots=tuple(slots), appended_uids=tuple(uids))
    return state, PrimeOut(logits=rows, patch=patch)


def _cull(state: State, slots: tuple[int, ...]) -> tuple[list[int], list[tuple[int, int]]]:
    """Remove live slots; each hole takes the current last live slot (O(1) per token)."""
    a, m = state.arena, state.mirror
    require(len(set(slots)) == len(slots), f"duplicate cull slots {slots}")
    require(all(0 <= s < m.n for s in slots), f"cull slot outside the live range [0, {m.n})")
    protected = [s for s in slots if int(m.flags[s]) & FLAG_PROTECTED]
    require(not protected, f"slots {protected} are protected and cannot be culled")
    uids = [int(m.uid[s]) for s in slots]
    n, moves = m.n, []
    for s in sorted(slots, reverse=True):  # every culled slot above s is gone already
        last = n - 1
        if s != last:
            moves.append((last, s))
        n -= 1
    if moves:
        src = torch.tensor([f for f, _ in moves])
        dst = torch.tensor([t for _, t in moves])
        for c in KVMirror.COLUMNS:  # ledger first: a later failure rebuilds from it
            col = getattr(m, c)
            col[dst] = col[src]
    m.n = n
    if moves:
        a.k[:, :, dst] = a.k[:, :, src]
        a.v[:, :, dst] = a.v[:, :, src]
    a.n = n
    return uids, moves


def _append(state: State, gen: GenerateOut) -> tuple[int, int]:
    a, m = state.arena, state.mirror
    n = a.n
    require(n < a.capacity, f"the arena is full ({a.capacity} slots); set a budget to cull")
    assert gen.k.shape == (a.k.shape[0], a.k.shape[1], 1, a.k.shape[3]), \
        f"new K has shape {tuple(gen.k.shape)}"
    assert gen.position == state.next_position and gen.input_token == state.pending_token, \
        "the generate output is not for this state's pending token"
    (uid,) = _write_rows(m, slice(n, n + 1), torch.tensor([gen.input_token]),
                         torch.tensor([gen.position]),
                         torch.tensor([SOURCES.index(state.pending_source)], dtype=torch.int8),
                         state.step + 1, torch.zeros(1, dtype=torch.int8))
    m.n = n + 1
    a.k[:, :, n:n + 1] = gen.k
    a.v[:, :, n:n + 1] = gen.v
    a.n = n + 1
    return n, uid


@torch.no_grad()
def apply(model: Model, state: State, gen: GenerateOut, actions: Actions = NO_ACTIONS) -> Patch:
    """Stage 4: culls, then append the pending token; the sampled token becomes pending.

    Updates ``state`` in place (same arena tensors; O(changed tokens)). Bad actions
    raise before anything changes; a failure part-way rebuilds the arena from the mirror.
    """
    require(state.arena.n - len(actions.cull_slots) < state.arena.capacity,
            f"the arena is full ({state.arena.capacity} slots); set a budget to cull")
    culled_uids, moves, rebuilt = [], [], False
    try:
        if actions.cull_slots:
            culled_uids, moves = _cull(state, actions.cull_slots)
        slot, uid = _append(state, gen)
    except Exception:
        if state.arena.n != state.mirror.n:  # arena half-written: make it agree with the ledger
            rebuild_from_mirror(model, state)
        raise
    state.step += 1
    state.pending_token = gen.token_id
    state.pending_source = "assistant"
    state.next_position = gen.position + 1
    return Patch(step=state.step, culled_slots=tuple(actions.cull_slots),
                 culled_uids=tuple(culled_uids), moves=tuple(moves),
                 appended_slots=(slot,), appended_uids=(uid,), rebuilt=rebuilt)


@torch.no_grad()
def rebuild_from_mirror(model: Model, state: State, chunk: int = PREFILL_CHUNK) -> None:
    """Re-prefill every live token (in position order, at its position) so the arena
    agrees with the mirror again. Slot order becomes position order."""
    m = state.mirror
    order = torch.argsort(m.live("position"))
    cols = {c: m.live(c)[order].clone() for c in KVMirror.COLUMNS}
    a = state.arena
    a.n = 0
    n = cols["uid"].shape[0]
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        out = forward(model, a.k[:, :, :start], a.v[:, :, :start], cols["token_id"][sl],
                      cols["position"][sl])
        t = out.k.shape[2]
        a.k[:, :, start:start + t] = out.k
        a.v[:, :, start:start + t] = out.v
        a.n = start + t
    for c, col in cols.items():
        getattr(m, c)[:n] = col
    m.n = a.n = n
