"""Stage 0/4: build and patch the cache — the only code that writes to an arena or a ledger.

- ``prime``: allocate the arena and ledger and prefill a prompt (stage 0), gathering the
  prompt's attention statistics on request.
- ``seed``: write a scorer's ledger columns from those statistics (stage 0; prefill scores).
- ``extend``: prefill new prompt segments onto an existing state (stage 0; chat turns,
  imported sessions).
- ``apply``: apply one step's actions atomically, in a fixed order: brightness/attn_sum,
  merges, folds (a culled slot's K/V into survivors), removals (each hole is filled by moving
  the last live slot into it, so live
  slots stay a dense prefix), position re-index (keys re-rotated exactly), then the append
  of the pending token's K/V (stage 4).
- ``rebuild_from_ledger``: re-prefill the arena from the ledger after a failure part-way.
- ``restore``: write a saved or composed session back (stage 0); ``rewrite``: write
  recomputed K/V into live slots (stage 0; a selective recompute).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

import torch

from ..forward import apply_rope, builds_scores, forward, rerotation
from ..model import Model
from ..scorers import reads_total
from ..state import (FLAG_PROTECTED, MAX_BRIGHTNESS, Arena, Cold, Ledger, SplitArena, State,
                     key_norms, value_norms)
from ..types import (NO_ACTIONS, SOURCES, Actions, Fold, GenerateOut, Merge, Patch, PrefillStats,
                     PrimeOut, ScoreOut, Segment, Swap, require)

SLICE_MOVES = 8  # ``_remove``: up to this many moved slots one by one, more by index copies
PREFILL_CHUNK = 256  # tokens per prefill chunk on the CPU (longer ones measured slower there)
FUSED_CHUNK = 1024  # ... through torch's fused attention, without every token's logits


def gpu_chunk_bytes(device: torch.device) -> int:
    """What a GPU prefill chunk's buffers that grow with chunk x context may take: a 16th of
    the device's memory (its total, not what is free, so one kind of GPU always cuts a
    prompt the same way: a replay's bits)."""
    return torch.cuda.get_device_properties(device).total_memory // 16


def chunks(model: Model, n: int, total: int, chunk: int | None = None,
           logits: bool = False, scores: bool = False) -> Iterator[slice]:
    """The slices of ``total`` new tokens prefilled, a chunk at a time, after ``n`` live
    slots: ``chunk`` tokens each if given. Else on the CPU ``FUSED_CHUNK`` where the forward
    attends through torch's fused attention (not ``scores``) without every token's
    ``logits`` (float32, or bfloat16 where ``forward.WIDEN``: fewer, larger products, and each
    chunk copies the past
    keys once; at 4,096 tokens 256 or 512 measured slower, and so did 2,048 or one chunk,
    whose MLP activations outgrow the caches), else ``PREFILL_CHUNK``; on a GPU, where
    a chunk's kernel launches cost about what a decode step's do however many tokens it
    holds, as many as keep what grows with the chunk within ``gpu_chunk_bytes``, but at
    least ``PREFILL_CHUNK``: with ``scores`` (the forward builds them:
    ``forward.builds_scores``) one layer's float32 scores, probabilities and mask over every
    head and slot; else (``forward.fused_attention``, whose kernels never build them) the mask's row
    over every slot and the MLP's activations (gate and up, the activation, their product),
    4 bytes each at most; with ``logits`` every token's logits. (The intermediate size comes
    from the config: ``ModelSpec`` is part of the fingerprint that captures record.)"""
    if chunk is None and model.device.type == "cpu":
        chunk = PREFILL_CHUNK if scores or logits else FUSED_CHUNK
    if chunk is None:
        s = model.spec
        row = (4 * s.n_heads * (n + total) if scores
               else n + total + 4 * model.hf.config.intermediate_size)
        per_token = 4 * (row + s.vocab * logits)
        chunk = max(PREFILL_CHUNK, gpu_chunk_bytes(model.device) // max(1, per_token))
    require(chunk >= 1, f"prefill chunk must be >= 1, got {chunk}")
    for start in range(0, total, chunk):
        yield slice(start, min(total, start + chunk))


def arena(model: Model, capacity: int) -> Arena | SplitArena:
    """An empty arena of ``capacity`` slots for ``model``: one block per run of layers on
    one device when a device map splits it (``Model.blocks``)."""
    if model.split:
        return SplitArena.allocate(model.spec, capacity, model.dtype, model.blocks, model.device)
    return Arena.allocate(model.spec, capacity, model.dtype, model.device)


def _parts(a: Arena | SplitArena, *xs: torch.Tensor | None):
    """Each block of ``a`` with its layers' part of each (L, ...) tensor in ``xs`` (None
    stays None), on the block's device: on one device, the arena and ``xs`` themselves."""
    if isinstance(a, Arena):
        return ((a, xs),)
    return tuple((b, tuple(None if x is None else x[sl].to(b.device) for x in xs))
                 for b, sl in zip(a.blocks, a.layers))


def _write(a: Arena | SplitArena, lo: int, k: torch.Tensor, v: torch.Tensor,
           norms_of_kv: bool = True, copy: bool = True) -> None:
    """Write K/V ``k``/``v`` (L, kv_heads, t, head_dim) into slots [lo, lo + t) of each
    block, each slot holding one token (log-mass 0), and their norms: from ``k``/``v`` at
    once, or (not ``norms_of_kv``) from the arena one layer at a time (same bits). Not
    ``copy``: ``k``/``v`` are those slots already (``_slots``)."""
    hi = lo + k.shape[2]
    for b, (kb, vb) in _parts(a, k, v):
        if copy:
            b.k[:, :, lo:hi] = kb
            b.v[:, :, lo:hi] = vb
        b.log_mass[:, :, lo:hi] = 0.0
        if norms_of_kv:
            b.renorm(lo, hi, kb, vb)
        else:
            b.renorm(lo, hi)


def _slots(a: Arena | SplitArena, lo: int, t: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V views (L, kv_heads, t, head_dim) of slots [lo, lo + t) of a one-device arena,
    which a prefill's forward writes its new K/V into (``forward``'s ``into``; why:
    docs/DESIGN.md, stage 0). None for a split arena, whose layers' K/V cross devices."""
    return None if isinstance(a, SplitArena) else (a.k[:, :, lo:lo + t], a.v[:, :, lo:lo + t])


def _write_rows(m: Ledger, slots: slice, token_ids: torch.Tensor, positions: torch.Tensor,
                sources: torch.Tensor, step: int, flags: torch.Tensor) -> list[int]:
    """Fill ledger rows ``slots`` for new tokens; returns their fresh uids."""
    count = token_ids.shape[0]
    uids = list(range(m.next_uid, m.next_uid + count))  # known here: not read back (a sync)
    m.uid[slots] = torch.arange(m.next_uid, m.next_uid + count, device=m.device)
    m.token_id[slots] = token_ids
    m.position[slots] = positions
    m.source[slots] = sources
    m.brightness[slots] = _seed_table(m.seeds, m.device)[sources.long()]
    m.attn_sum[slots] = 0.0
    m.born_step[slots] = step
    m.changed_step[slots] = step
    m.flags[slots] = flags
    m.origin[slots], m.origin_uid[slots] = 0, -1
    m.next_uid += count
    return uids


@functools.lru_cache(maxsize=16)
def _seed_table(seeds: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The ledger's seed brightness per source as a tensor on ``device``, made once (copying
    it from host memory at every step would wait for the device)."""
    return torch.tensor(seeds, device=device)


TOTAL_UNREAD = ("this scorer's prefill reads the prompt's total attention, which the prime "
                "does not gather")


def _prefill(model: Model, state: State, ids: torch.Tensor, positions: torch.Tensor,
             sources: torch.Tensor, flags: torch.Tensor, chunk: int | None, all_logits: bool,
             received: tuple[torch.Tensor, torch.Tensor, int] | None = None,
             ) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Append ``ids`` at ``positions`` in causal chunks; each chunk attends to all live slots.
    ``received`` (total, window, first): add into ``total`` (L, H, >= n) what every new
    query paid each slot (None: not wanted) and into ``window`` what the queries from the
    ``first``-th new one on paid (``forward``'s ``received``), without a second forward."""
    a, m = state.arena, state.ledger
    logits, slots, uids = [], [], []
    built = builds_scores(model, received is not None, a.folded)
    window_only = received is not None and received[0] is None
    for sl in chunks(model, a.n, ids.shape[0], chunk, logits=all_logits, scores=built):
        start, n = sl.start, a.n
        past_k, past_v, log_mass = a.past(n)
        into = _slots(a, n, sl.stop - start)
        # the queries from which this chunk's statistics are wanted (none: a chunk before
        # the window when only the window is)
        first = None if received is None or (window_only and received[2] >= sl.stop) else (
            max(0, received[2] - start))
        out = forward(model, past_k, past_v, ids[sl], positions[sl], all_logits=all_logits,
                      past_log_mass=log_mass, received_from=first, window_only=window_only,
                      into=into)
        t = out.k.shape[2]
        if out.received is not None:
            received[0][:, :, :n + t] += out.received
        if out.received_window is not None:
            received[1][:, :, :n + t] += out.received_window
        _write(a, n, out.k, out.v, norms_of_kv=False, copy=into is None)  # (L, KVH, t, D)
        uids += _write_rows(m, slice(n, n + t), ids[sl], positions[sl], sources[sl],
                            state.step, flags[sl])
        slots += range(n, n + t)
        a.n = m.n = n + t
        logits.append(out.logits)
    return logits, slots, uids


@torch.no_grad()
def prime(model: Model, segments: list[Segment], capacity: int,
          pinned: frozenset[str] = frozenset(), chunk: int | None = None,
          all_logits: bool = False, seeds: tuple[float, ...] | None = None,
          cold_capacity: int | None = None, prefill_window: int | None = None,
          scorer=None, prefill_total: bool = True) -> tuple[State, PrimeOut]:
    """Stage 0: allocate an arena of ``capacity`` slots and prefill all prompt tokens but
    the last, which becomes the pending token (stage 1 runs it and samples the first
    generated token). Tokens whose source is in ``pinned`` are protected from culls;
    ``seeds`` gives new tokens' brightness by source (SOURCES order; default: the max).

    ``capacity``: the arena's slots (``loop.arena_capacity`` chooses them for a session).
    ``cold_capacity``: with recall, the cold store's (None: no cold store).
    ``prefill_window``: also gather the prompt's attention statistics (``PrimeOut.stats``,
    ``PrefillStats``) over its last ``prefill_window`` prefilled queries and, with
    ``prefill_total``, all of them, inside the chunked prefill; ``scorer``: then seed its
    ledger columns from them (``seed``).
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
    require(prefill_total or scorer is None or not reads_total(scorer), TOTAL_UNREAD)

    src = [SOURCES.index(s.source) for s in segments for _ in s.ids]
    flg = [FLAG_PROTECTED if s.source in pinned else 0 for s in segments for _ in s.ids]
    state = State(arena(model, capacity), Ledger.allocate(capacity, seeds, model.device),
                  pinned=tuple(sorted(pinned)),
                  cold=None if cold_capacity is None else cold_store(model, cold_capacity))
    T = len(ids_list) - 1
    dev = model.device
    received = None
    if prefill_window is not None:
        shape = (model.spec.n_layers, model.spec.n_heads, T)
        received = (torch.zeros(shape, device=dev) if prefill_total else None,
                    torch.zeros(shape, device=dev), max(0, T - prefill_window))
    logits, slots, uids = _prefill(
        model, state, torch.tensor(ids_list[:T], device=dev), torch.arange(T, device=dev),
        torch.tensor(src[:T], dtype=torch.int8, device=dev),
        torch.tensor(flg[:T], dtype=torch.int8, device=dev), chunk, all_logits, received)
    state.pending_token = ids_list[-1]
    state.pending_source = segments[-1].source
    state.next_position = T
    rows = torch.cat(logits) if logits else torch.empty(0, model.spec.vocab, device=model.device)
    patch = Patch(step=0, appended_slots=tuple(slots), appended_uids=tuple(uids))
    stats = None
    if received is not None:
        total, window, first = received
        stats = PrefillStats(uid=state.ledger.live("uid").clone(),
                             window=window / max(1, T - first), window_queries=T - first,
                             total=total, queries=torch.arange(T - 1, -1, -1, device=dev).float())
        seeded = seed(state, scorer, stats)
        if seeded is not None:
            patch = dataclasses.replace(patch, brightness=seeded.brightness,
                                        attn_sum=seeded.attn_sum)
    return state, PrimeOut(logits=rows, patch=patch, stats=stats)


@torch.no_grad()
def seed(state: State, scorer, stats: PrefillStats) -> ScoreOut | None:
    """Stage 0: write the ledger columns ``scorer`` seeds from the prompt's statistics
    ``stats`` (its ``prefill(view, stats)``, read-only; None: a scorer without one ignores
    them, and nothing changes) into the live slots they are of (a fresh prime's, or a copy
    of it: bench passkey seeds each cell's). Returns what the scorer gave."""
    view = state.view()
    take = getattr(scorer, "prefill", None)
    if take is None:
        return None
    assert torch.equal(view.uid, stats.uid), "the prompt statistics are of other slots"
    require(stats.total is not None or not reads_total(scorer), TOTAL_UNREAD)
    out = take(view, stats)
    _check_columns(out, view.n)
    m = state.ledger
    if out.brightness is not None:
        m.brightness[: view.n] = out.brightness
    if out.attn_sum is not None:
        m.attn_sum[: view.n] = out.attn_sum
    return out


@torch.no_grad()
def extend(model: Model, state: State, segments: list[Segment], chunk: int | None = None,
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
    ranges = _column_ranges(actions, n)
    slots = list(actions.cull_slots) + [s for r in actions.merges for s in r.slots]
    require(len(set(slots)) == len(slots), f"a slot is culled or repaired twice: {slots}")
    require(all(0 <= s < n for s in slots), f"a cull or repair slot is outside [0, {n})")
    at = torch.tensor(slots, dtype=torch.long).to(m.device, non_blocking=True)
    culls = len(actions.cull_slots)
    folds = [f.into.flatten().double() for f in actions.folds]  # their targets too
    read = torch.cat([r for _, _, r in ranges]  # float64 holds int8 flags and uids exactly
                     + [m.flags[at].double(), m.uid[at[:culls]].double()] + folds).tolist() \
        if ranges or slots else []
    targets = read[len(read) - sum(len(f) for f in folds):]
    read = read[:len(read) - len(targets)]
    _in_range(ranges, read)
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


COLUMN_RANGES = (("brightness", MAX_BRIGHTNESS), ("attn_sum", float("inf")))


def _column_ranges(new, n: int) -> list[tuple[str, float, torch.Tensor]]:
    """The scorer columns ``new`` writes (``brightness``, ``attn_sum``; None = unchanged),
    each checked to have one value per live slot: (name, top, its lowest and highest value
    as a float64 tensor (2,), not read yet) for each written over any slot."""
    out = []
    for name, top in COLUMN_RANGES:
        t = getattr(new, name)
        assert t is None or t.shape == (n,), f"bad {name} for {n} slots"
        if t is not None and n:
            out.append((name, top, torch.stack(t.aminmax()).double()))
    return out


def _in_range(ranges: list[tuple[str, float, torch.Tensor]], read: list[float]) -> None:
    """Each of ``_column_ranges``' columns in [0, top], from its (lowest, highest) read back
    in ``read`` (two values a column, in order; a NaN fails the comparisons)."""
    for (name, top, _), lo, hi in zip(ranges, read[::2], read[1::2]):
        assert 0 <= lo and hi <= top and math.isfinite(hi), \
            f"{name} outside [0, {top}]: [{lo}, {hi}]"


def _check_columns(new, n: int) -> None:
    """The scorer columns ``new`` writes have one value per live slot, in range."""
    ranges = _column_ranges(new, n)
    if ranges:
        _in_range(ranges, torch.cat([r for _, _, r in ranges]).tolist())


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
    assert all(0 <= s.brightness <= MAX_BRIGHTNESS and 0 <= s.attn_sum < float("inf")
               for s in actions.swaps), "a recalled token's brightness or attn_sum out of range"
    at = torch.tensor(hot, device=m.device)  # one read of each column, not one per swap
    assert m.uid[at].tolist() == [s.uid for s in actions.swaps], "stale recall (hot uid)"
    assert not bool((m.flags[at] & FLAG_PROTECTED).any()), "a recall replaces a protected slot"
    assert cold.ledger.uid[torch.tensor(rows, device=m.device)].tolist() == \
        [s.cold_uid for s in actions.swaps], "stale recall (cold uid)"


def _merge(state: State, r: Merge, step: int) -> int:
    """Rewrite slot ``r.slots[0]`` as the merged token (a fresh uid; source kept; brightness
    the pair's max); its partner is removed with the culls. Returns the new uid."""
    m = state.ledger
    s, t = r.slots
    uid = m.next_uid
    m.next_uid += 1
    m.merged[uid] = r.uids
    m.brightness[s] = torch.maximum(m.brightness[s], m.brightness[t])
    m.uid[s], m.token_id[s], m.position[s] = uid, r.token_id, r.position
    m.born_step[s] = m.changed_step[s] = step
    m.flags[s], m.attn_sum[s] = 0, 0.0
    m.origin[s], m.origin_uid[s] = 0, -1
    _write(state.arena, s, r.k, r.v)
    return uid


def _fold(state: State, f: Fold) -> None:
    """Fold slot ``f.slot``'s K/V into ``f.into`` (one slot per layer and KV head, -1 =
    none there): there K and V become the mass-weighted mean of both, and the log-mass
    their log-sum-exp, so a query that scores both keys alike gives the pair the attention
    it gave them apart."""
    for a, (into,) in _parts(state.arena, f.into):
        _fold_block(a, f.slot, into)


def _fold_block(a: Arena, slot: int, into: torch.Tensor) -> None:
    """``_fold`` in one block of layers: ``into`` (layers, kv_heads). Over the pairs that
    fold alone, selected by value (a read of the device): on the CPU, sigmoid and logaddexp
    may round an element otherwise by where it sits in the operand (vector loops, then a
    scalar tail), so computing them over every pair would change the bits a fold gave."""
    li, hi = (into >= 0).nonzero(as_tuple=True)  # the (layer, KV head) pairs that fold
    if len(li) == 0:
        return
    into = into[li, hi]
    lm_i, lm_j = a.log_mass[li, hi, into], a.log_mass[li, hi, slot]  # (p,)
    w = torch.sigmoid(lm_j - lm_i).unsqueeze(-1)  # m_j / (m_i + m_j), (p, 1)
    for t, norm, rows in ((a.k, a.knorm, key_norms), (a.v, a.vnorm, value_norms)):
        x = t[li, hi, into].float()  # (p, D)
        folded = (x + w * (t[li, hi, slot].float() - x)).to(t.dtype)
        t[li, hi, into] = folded
        norm[li, hi, into] = rows(folded)
    a.log_mass[li, hi, into] = torch.logaddexp(lm_i, lm_j)
    a.folded = True


def _remove(a: Arena | SplitArena, m: Ledger, slots: list[int],
            extra: tuple[torch.Tensor, ...] = ()) -> list[tuple[int, int]]:
    """Remove live slots of ``a``/``m`` (the arena and ledger, or the cold store's); the
    survivors among the last ``len(slots)`` slots fill the holes below them (O(1) per token),
    and so do their entries of the ``extra`` per-slot tensors. Each move reads an original
    slot, never one that another move has just filled, so all of them can be done at once."""
    gone = set(slots)
    n = m.n - len(gone)
    fillers = [s for s in range(n, m.n) if s not in gone]
    moves = list(zip(fillers, sorted(s for s in gone if s < n)))  # (from_slot, to_slot)
    if moves:
        src = torch.tensor([f for f, _ in moves], device=m.device)
        dst = torch.tensor([t for _, t in moves], device=m.device)
        for col in [getattr(m, c) for c in Ledger.COLUMNS] + list(extra):  # ledger first
            col.index_copy_(0, dst, col.index_select(0, src))
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
                x[:, :, t] = x[:, :, f]
    a.n = n
    return moves


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


def _reindex(model: Model, state: State,
             cold_keep: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                             list[int]]:
    """Positions become 0..n-1 in text order over the hot slots and the cold store's rows
    together (the oldest cold rows to enter past ``cold_keep`` dropped for good first);
    each moved key, hot or cold, is re-rotated by the exact rotation old -> new. Returns
    the hot slots' (old, new) positions (n,) in slot order, the cold rows' new positions
    and the dropped uids."""
    a, m, cold = state.arena, state.ledger, state.cold
    dropped = [] if cold is None or cold_keep is None else _drop_oldest(state, cold.n - cold_keep)
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
    cold.ledger.position[: cold.n] = new_cold
    _rotate(model, cold.arena, old_cold, new_cold)
    return old, new, new_cold, dropped


COLD_ROWS = 1024  # a cold store's first allocation; stage 4 doubles it up to its capacity


def cold_store(model: Model, capacity: int, rows: int | None = None) -> Cold:
    """An empty cold store for at most ``capacity`` tokens, with storage for ``rows``
    (default ``COLD_ROWS``)."""
    rows = min(capacity, rows or COLD_ROWS)
    dev = model.device
    return Cold(Arena.allocate(model.spec, rows, model.dtype, dev, key_rows=True),
                Ledger.allocate(rows, device=dev),
                torch.zeros(rows, dtype=torch.int64, device=dev), capacity)


def add_cold_store(model: Model, state: State, capacity: int) -> None:
    """Stage 0: an empty cold store for a live state that has none (a session restored from
    a cache without recall that now recalls, as bench passkey's cells do)."""
    require(state.cold is None, "the state has a cold store already")
    state.cold = cold_store(model, capacity)


def _grow(model: Model, cold: Cold, rows: int) -> None:
    """Room for ``rows`` live cold rows: storage twice as large (at most the capacity)
    with the live rows copied (amortised O(1) per row)."""
    if rows <= cold.arena.capacity:
        return
    size = min(cold.capacity, max(rows, 2 * cold.arena.capacity))
    new = cold_store(model, cold.capacity, size)
    a, m, n = new.arena, new.ledger, cold.n
    a.k[:, :, :n] = cold.arena.k[:, :, :n]  # a slot per row: contiguous
    for name in ("v", "knorm", "vnorm"):
        getattr(a, name)[:, :, :n] = getattr(cold.arena, name)[:, :, :n]
    for c in Ledger.COLUMNS:
        getattr(m, c)[:n] = cold.ledger.live(c)
    new.entered[:n] = cold.entered[:n]
    a.n = m.n = n
    cold.arena, cold.ledger, cold.entered = a, m, new.entered


def _drop_oldest(state: State, count: int) -> list[int]:
    """Drop the ``count`` cold rows that entered first, for good; returns their uids."""
    cold = state.cold
    if count <= 0:
        return []
    rows = torch.argsort(cold.entered[: cold.n])[:count]
    uids = cold.ledger.uid[rows].tolist()
    _remove(cold.arena, cold.ledger, rows.tolist(), extra=(cold.entered,))
    state.ledger.dropped += len(uids)
    return uids


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


def _take_rows(a: Arena | SplitArena, m: Ledger, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """Slots ``slots`` (k,): their ledger rows, K, V and norms, as copies (on the ledger's
    device)."""
    blocks = []
    for b in a.blocks:
        at = slots.to(b.device)
        blocks.append([_take_keys(b, at)] + [getattr(b, x).index_select(2, at) for x in ROWS[1:]])
    parts = blocks[0] if isinstance(a, Arena) else [
        torch.cat([t.to(m.device) for t in ts]) for ts in zip(*blocks)]
    # index_select, not ``[slots]``: one operator a column instead of advanced indexing's
    return {**{c: getattr(m, c).index_select(0, slots) for c in Ledger.COLUMNS},
            **dict(zip(ROWS, parts))}


def _put_rows(a: Arena | SplitArena, m: Ledger, slots: torch.Tensor,
              rows: dict[str, torch.Tensor]) -> None:
    """Write rows taken by ``_take_rows`` into ``slots`` (ledger first); each holds one
    token (log-mass 0)."""
    for c in Ledger.COLUMNS:
        getattr(m, c).index_copy_(0, slots, rows[c])
    _put_kv(a, slots, rows)


def _put_kv(a: Arena | SplitArena, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
    """Write the ``ROWS`` of ``rows`` (K, V and their norms) into ``slots``; each holds one
    token (log-mass 0)."""
    for b, (k, *rest) in _parts(a, *(rows[x] for x in ROWS)):
        at = slots.to(b.device)
        _put_keys(b, at, k)
        for name, x in zip(ROWS[1:], rest):
            getattr(b, name).index_copy_(2, at, x)
        if b.folded:  # else every log-mass is 0 already
            b.log_mass[:, :, at] = 0.0


def _enter_cold(cold: Cold, rows: torch.Tensor) -> None:
    """Cold rows ``rows`` (k,) entered now, in that order."""
    cold.entered[rows] = torch.arange(cold.next_entry, cold.next_entry + rows.numel(),
                                      device=rows.device)
    cold.next_entry += rows.numel()


def _leaving(state: State, swaps: tuple[Swap, ...], culls: list[int]) -> tuple[dict, dict]:
    """The rows of the hot slots that go cold this step, taken in one pass over the hot key
    rows (a slot's key is one element in each of them): the swaps' slots, then the culled
    ones (``culls``, with a cold store; none without). Each part also holds its ``slots``."""
    slots = [s.slot for s in swaps] + (culls if state.cold is not None else [])
    if not slots:
        return {}, {}
    at = torch.tensor(slots, device=state.ledger.device)
    rows = {**_take_rows(state.arena, state.ledger, at), "slots": at}
    return _some_rows(rows, slice(None, len(swaps))), _some_rows(rows, slice(len(swaps), None))


def _some_rows(rows: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    """A ``part`` of rows taken by ``_take_rows``, as views."""
    return {name: x[:, :, part] if name in ROWS else x[part] for name, x in rows.items()}


def _swap(state: State, swaps: tuple[Swap, ...], step: int, leaving: dict) -> None:
    """Recalls: each cold row ``cold_slot`` and hot slot ``slot`` trade places (``leaving``:
    those slots' rows); the recalled tokens take the swaps' brightness and attn_sum; the
    others enter the cold store now."""
    if not swaps:
        return
    cold, dev = state.cold, state.ledger.device
    rows = torch.tensor([s.cold_slot for s in swaps], device=dev)
    recalled = _take_rows(cold.arena, cold.ledger, rows)  # copies: set before they are put
    recalled["brightness"], recalled["attn_sum"] = torch.tensor(
        [[s.brightness for s in swaps], [s.attn_sum for s in swaps]], dtype=torch.float32,
        device=dev)
    recalled["changed_step"].fill_(step)
    _put_rows(state.arena, state.ledger, leaving["slots"], recalled)
    _put_rows(cold.arena, cold.ledger, rows, leaving)
    _enter_cold(cold, rows)


def _cool(model: Model, state: State, slots: list[int],
          leaving: dict) -> tuple[list[int], list[int]]:
    """Culled hot ``slots`` (``leaving``: their rows) into the cold store, the rows that
    entered first dropped for good past its capacity (and, if more go at once than it holds,
    the first of them). Returns the uids that went cold and those dropped."""
    cold = state.cold
    direct = slots[: max(0, len(slots) - cold.capacity)]
    slots = slots[len(direct):]
    dropped = state.ledger.uid[direct].tolist() if direct else []
    state.ledger.dropped += len(dropped)
    dropped += _drop_oldest(state, cold.n + len(slots) - cold.capacity)
    _grow(model, cold, cold.n + len(slots))
    n, k = cold.n, len(slots)
    leaving = _some_rows(leaving, slice(len(direct), None))
    if k:
        rows = torch.arange(n, n + k, device=state.ledger.device)
        _put_rows(cold.arena, cold.ledger, rows, leaving)
        _enter_cold(cold, rows)
    cold.arena.n = cold.ledger.n = n + k
    return leaving["uid"].tolist() if k else [], dropped


def _append(state: State, gen: GenerateOut, position: int, model: Model,
            step: int) -> tuple[int, int, torch.Tensor]:
    """Write the pending token at ``position`` (its key re-rotated if a re-index moved it)."""
    a, m = state.arena, state.ledger
    n = a.n
    k = gen.k
    def row(x: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:  # filled there: no copy
        return torch.full((1,), x, dtype=dtype, device=m.device)

    if position != gen.position:
        cos, sin = rerotation(model, row(gen.position), row(position))
        k = apply_rope(gen.k.float(), cos, sin).to(gen.k.dtype)  # (L, KVH, 1, D)
    flag = FLAG_PROTECTED if state.pending_source in state.pinned else 0
    (uid,) = _write_rows(m, slice(n, n + 1), row(gen.input_token), row(position),
                         row(SOURCES.index(state.pending_source), torch.int8), step,
                         row(flag, torch.int8))
    m.n = n + 1
    _write(a, n, k, gen.v)
    a.n = n + 1
    return n, uid, k


@torch.no_grad()
def apply(model: Model, state: State, gen: GenerateOut, actions: Actions = NO_ACTIONS) -> Patch:
    """Stage 4: in this order, write brightness/attn_sum, apply merges, fold culled slots'
    K/V into their survivors, swap recalled cold tokens in (their hot slots' tokens go cold),
    move culled tokens into the cold store (with recall), remove culled and repair-partner
    slots, re-index positions (the cold store's too), append the pending token; the sampled
    token becomes pending.

    Updates ``state`` in place (same arena tensors; O(changed tokens)). Atomic for the arena
    and the ledger: bad actions raise before anything changes; a failure part-way restores
    the ledger and rebuilds the arena from it, then re-raises (a cold store is not rolled
    back: a failure after it changed leaves the state invalid, which ``check_valid`` says).
    """
    culled_uids = _check(model, state, gen, actions)
    m, step = state.ledger, state.step + 1
    n = m.n
    undo = ({c: m.live(c).clone() for c in Ledger.COLUMNS}, m.next_uid, m.dropped)
    culls = list(actions.cull_slots)
    reindex_from = reindex_to = cold_to = None
    cooled, dropped = [], []
    try:
        if actions.brightness is not None:  # 1) the scorer's persistent columns
            m.brightness[:n] = actions.brightness
        if actions.attn_sum is not None:
            m.attn_sum[:n] = actions.attn_sum
        new_uids = [_merge(state, r, step) for r in actions.merges]  # 2) merges
        for f in actions.folds:  # 3) folds
            _fold(state, f)
        swapped, culled = _leaving(state, actions.swaps, culls)
        _swap(state, actions.swaps, step, swapped)  # 4) recalls
        if state.cold is not None:  # 5) culled tokens go cold, or away for good
            cooled, dropped = _cool(model, state, culls, culled)
        else:
            m.dropped += len(culls)
        moves = _remove(state.arena, m, culls + [r.slots[1] for r in actions.merges])  # 6)
        position = gen.position
        if actions.reindex:  # 7) positions 0..n-1; the appended token comes next
            reindex_from, reindex_to, cold_to, gone = _reindex(model, state, actions.cold_keep)
            dropped += gone
            position = m.n + (state.cold.n if state.cold is not None else 0)
        slot, uid, k = _append(state, gen, position, model, step)  # 8) append
    except BaseException:
        cols, next_uid, m.dropped = undo
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
                 moves=tuple(moves), swaps=actions.swaps, cooled_uids=tuple(cooled),
                 dropped_uids=tuple(dropped), cold_reindex_to=cold_to,
                 reindex_from=reindex_from, reindex_to=reindex_to,
                 appended_slots=(slot,), appended_uids=(uid,), appended_positions=(position,),
                 appended_k=k, appended_v=gen.v)


@torch.no_grad()
def rewrite(model: Model, state: State, slots: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> None:
    """Stage 0: write K/V ``k``/``v`` (L, kv_heads, s, head_dim) into the live ``slots`` (s,)
    of ``state`` (``blend``'s selective recompute); each then holds one token (log-mass 0),
    its norms recomputed. The ledger is unchanged."""
    n, spec = state.arena.n, model.spec
    require(slots.ndim == 1 and torch.unique(slots).numel() == slots.numel(),
            "rewrite: the slots are not distinct")
    require(slots.numel() == 0 or 0 <= int(slots.min()) <= int(slots.max()) < n,
            f"rewrite: a slot outside the live [0, {n})")
    shape = (spec.n_layers, spec.n_kv_heads, slots.numel(), spec.head_dim)
    assert k.shape == v.shape == shape and k.dtype == v.dtype == model.dtype, \
        f"rewrite: K/V {tuple(k.shape)} {k.dtype}, not {shape} {model.dtype}"
    _put_kv(state.arena, slots.to(state.ledger.device),
            {"k": k, "v": v, "knorm": key_norms(k), "vnorm": value_norms(v)})


@torch.no_grad()
def rebuild_from_ledger(model: Model, state: State, chunk: int | None = None) -> None:
    """Re-prefill every live token (in position order, at its position) so the arena
    agrees with the ledger again. Slot order becomes position order; folds are lost (every
    slot holds its own token's K/V again)."""
    m = state.ledger
    parts = list(chunks(model, 0, m.n, chunk))  # a bad chunk refused before anything changes
    order = torch.argsort(m.live("position"))
    cols = {c: m.live(c)[order].clone() for c in Ledger.COLUMNS}
    a = state.arena
    a.n = 0
    for b in a.blocks:
        b.log_mass.zero_()
    a.folded = False
    n = cols["uid"].shape[0]
    for sl in parts:
        start = sl.start
        past_k, past_v, _ = a.past(start)
        out = forward(model, past_k, past_v, cols["token_id"][sl], cols["position"][sl],
                      kv_only=True)
        _write(a, start, out.k, out.v, norms_of_kv=False)
        a.n = start + out.k.shape[2]
    for c, col in cols.items():
        getattr(m, c)[:n] = col
    m.n = a.n = n


@torch.no_grad()
def restore(model: Model, k: torch.Tensor, v: torch.Tensor, columns: dict[str, torch.Tensor],
            capacity: int, ledger_fields: dict, state_fields: dict,
            log_mass: torch.Tensor, cold: dict | None = None) -> State:
    """Stage 0 from a saved session (checked by ``session_io``): allocate ``capacity`` slots
    and write back the live prefix ``k``/``v`` (L, kv_heads, n, head_dim), the ledger
    ``columns`` (name -> (n,), every one of ``Ledger.COLUMNS``) and the slots' ``log_mass``
    (L, kv_heads, n) float32; ``ledger_fields`` (next_uid, merged, ...) and ``state_fields``
    (pending token, its source and position, step, pinned) are set as given; ``cold`` (the
    cold store's ``k``, ``v``, ``columns``, ``entered``, ``capacity``, ``next_entry``) is
    written back likewise. An inconsistent ledger fails ``check_valid`` (AssertionError)."""
    n = k.shape[2]
    state = State(arena(model, capacity), Ledger.allocate(capacity, device=model.device),
                  **state_fields)
    a, m = state.arena, state.ledger
    for c in Ledger.COLUMNS:
        getattr(m, c)[:n] = columns[c]
    for name, value in ledger_fields.items():
        setattr(m, name, value)
    _write(a, 0, k, v, norms_of_kv=False)
    for b, (lm,) in _parts(a, log_mass):
        b.log_mass[:, :, :n] = lm
    a.folded = bool((log_mass > 0).any())
    a.n = m.n = n
    if cold is not None:
        state.cold = _restore_cold(model, cold)
    state.check_valid()
    return state


def _restore_cold(model: Model, saved: dict) -> Cold:
    """A cold store holding the saved rows."""
    cold = cold_store(model, saved["capacity"])
    n = saved["k"].shape[2]
    _grow(model, cold, n)
    a, m = cold.arena, cold.ledger
    a.k[:, :, :n] = saved["k"]
    a.v[:, :, :n] = saved["v"]
    a.renorm(0, n)
    for c in Ledger.COLUMNS:
        getattr(m, c)[:n] = saved["columns"][c]
    cold.entered[:n] = saved["entered"]
    cold.next_entry = saved["next_entry"]
    a.n = m.n = n
    return cold
