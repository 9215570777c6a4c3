"""Stage 0: the prime (a prompt prefilled into a fresh arena, with the prompt's attention
statistics on request), the seed of a scorer's columns from them, and the extend of a live
state by new segments (chat turns, imported sessions)."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch

from ...forward import builds_scores, forward
from ...model import Model
from ...scorers import reads_copy, reads_total
from ...state import FLAG_PROTECTED, Arena, Ledger, State
from ...types import SOURCES, Column, Patch, PrefillStats, PrimeOut, ScoreOut, Segment, require
from .cold_heads import to_heads
from .recall import cold_store
from .rows import (append_heads, arena, check_columns, every_head, slots_of, store_layer, write,
                   write_rows)


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


COPY_CHUNK = 2048  # prompt tokens a reconstruction forward copies (``reconstruction``)
COPY_MIN = 64  # ... at least (or the whole prompt): fewer, and it takes a forward over the
# whole cache for every few tokens


TOTAL_UNREAD = ("this scorer's prefill reads the prompt's total attention, which the prime "
                "does not gather")
COPY_UNREAD = ("this scorer's prefill reads KVzip's reconstruction of the prompt, which the "
               "prime does not run")


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
        into = slots_of(a, n, sl.stop - start)
        # the queries from which this chunk's statistics are wanted (none: a chunk before
        # the window when only the window is)
        first = None if received is None or (window_only and received[2] >= sl.stop) else (
            max(0, received[2] - start))
        out = forward(model, past_k, past_v, ids[sl], positions[sl], all_logits=all_logits,
                      past_log_mass=log_mass, received_from=first, window_only=window_only,
                      store=None if into is None else functools.partial(store_layer, into))
        k, v = into if into is not None else (out.k, out.v)
        t = k.shape[2]
        if out.received is not None:
            received[0][:, :, :n + t] += out.received
        if out.received_window is not None:
            received[1][:, :, :n + t] += out.received_window
        write(a, n, k, v, norms_of_kv=False, copy=into is None)  # (L, KVH, t, D)
        uids += write_rows(m, slice(n, n + t), ids[sl], positions[sl], sources[sl],
                            state.step, flags[sl])
        slots += range(n, n + t)
        a.n = m.n = n + t
        logits.append(out.logits)
    return logits, slots, uids


def copy_room(model: Model, n: int, instruction) -> int:
    """How many prompt tokens a ``reconstruction`` forward copies after a prime of ``n``
    cached tokens (the pending one at position n): ``COPY_CHUNK``, or as many as the model's
    positions leave after the pending token and the ``instruction``, and off the CPU as many
    as a prefill chunk's memory allows there (``chunks``: a forward that builds its scores);
    refused in one line where that is fewer than ``COPY_MIN`` and than the prompt."""
    lead = 1 + len(instruction)
    room = min(COPY_CHUNK, model.spec.max_positions - n - lead)
    if model.device.type != "cpu":
        room = min(room, len(next(chunks(model, n, COPY_CHUNK + lead, scores=True))) - lead)
    require(room >= min(COPY_MIN, n), f"the prompt's {n + 1} tokens leave {max(0, room)} of "
            f"the model's {model.spec.max_positions} positions for KVzip's reconstruction "
            f"after them, fewer than {COPY_MIN}: a shorter prompt, or prefill scores off")
    return room


@torch.no_grad()
def reconstruction(model: Model, state: State, ids: list[int], pending: int,
                   instruction: list[int]) -> torch.Tensor:
    """KVzip's context reconstruction (Kim et al., 2025), read-only: after the n prompt
    tokens ``ids`` that ``state`` holds (slot i: ``ids[i]``, a fresh prime's), the pending
    token, the repeat ``instruction`` and then the prompt again, teacher-forced,
    ``COPY_CHUNK`` tokens of it a forward, each chunk after the instruction at the positions
    right after the prompt; nothing is written. Returns (L, heads, n) float32: the most
    attention any copy query paid each prompt token (the queries of the pending token and
    the instruction left out, as are the weights on a forward's own tokens). A token the
    model can only copy by reading it (a number, a name) gets one query's whole attention
    in some head; a phrase the text repeats shares it among its occurrences."""
    n = state.arena.n
    assert n == len(ids) and state.heads is None, "a reconstruction of a fresh prime"
    start, lead = state.next_position, 1 + len(instruction)
    room = copy_room(model, n, instruction)
    past_k, past_v, log_mass = state.arena.past(n)
    out = torch.zeros(model.spec.n_layers, model.spec.n_heads, n, device=model.device)
    for lo in range(0, n, max(1, room)):
        new = [pending, *instruction, *ids[lo:lo + room]]
        got = forward(model, past_k, past_v, torch.tensor(new, device=model.device),
                      torch.arange(start, start + len(new), device=model.device),
                      past_log_mass=log_mass, received_from=lead, window_only=True,
                      window_peak=True).received_window
        torch.maximum(out, got[:, :, :n], out=out)
    return out


def _prefill_heads(model: Model, state: State, ids: torch.Tensor, positions: torch.Tensor,
                   sources: torch.Tensor, flags: torch.Tensor, chunk: int | None) -> list[int]:
    """``_prefill`` of a per-head cache: each causal chunk attends to what each head holds
    (the view's mask: -inf where a head holds no token, a folded slot's log-mass), then
    joins the ledger and every head's next slots (``append_heads``). Returns the uids."""
    uids = []
    for sl in chunks(model, state.arena.n, ids.shape[0], chunk, logits=False, scores=True):
        view = state.view()
        out = forward(model, view.k, view.v, ids[sl], positions[sl], past_log_mass=view.log_mass)
        uids += append_heads(state, out.k, out.v, ids[sl], positions[sl], sources[sl],
                             flags[sl], state.step)
    return uids


@torch.no_grad()
def prime(model: Model, segments: list[Segment], capacity: int,
          pinned: frozenset[str] = frozenset(), chunk: int | None = None,
          all_logits: bool = False, columns: dict[str, Column] | None = None,
          cold_capacity: int | None = None, prefill_window: int | None = None,
          scorer=None, prefill_total: bool = True, per_head: bool = False,
          prefill_copy: tuple[int, ...] | None = None) -> tuple[State, PrimeOut]:
    """Stage 0: allocate an arena of ``capacity`` slots and prefill all prompt tokens but
    the last, which becomes the pending token (stage 1 runs it and samples the first
    generated token). Tokens whose source is in ``pinned`` are protected from culls;
    ``columns``: the scorer's ledger columns (``scorers.columns_of``; default none).

    ``capacity``: the arena's slots (``loop.arena_capacity`` chooses them for a session).
    ``cold_capacity``: with recall, the cold store's (None: no cold store).
    ``prefill_window``: also gather the prompt's attention statistics (``PrimeOut.stats``,
    ``PrefillStats``) over its last ``prefill_window`` prefilled queries and, with
    ``prefill_total``, all of them, inside the chunked prefill; ``scorer``: then seed its
    ledger columns from them (``seed``). ``per_head``: the state becomes a per-head cache
    (``add_heads``) before the seed, which is then per head (``prefill_heads``).
    ``prefill_copy``: with the statistics, also KVzip's (``PrefillStats.copy``) from a
    ``reconstruction`` after these ids of its repeat instruction.
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
    require(prefill_copy is not None or scorer is None or not reads_copy(scorer), COPY_UNREAD)
    if prefill_window is not None and prefill_copy is not None:  # before any work
        copy_room(model, len(ids_list) - 1, prefill_copy)

    src = [SOURCES.index(s.source) for s in segments for _ in s.ids]
    flg = [FLAG_PROTECTED if s.source in pinned else 0 for s in segments for _ in s.ids]
    state = State(arena(model, capacity), Ledger.allocate(capacity, columns, model.device),
                  pinned=tuple(sorted(pinned)), cold=None if cold_capacity is None else
                  cold_store(model, cold_capacity, columns=columns))
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
    copied = None if received is None or prefill_copy is None else reconstruction(
        model, state, ids_list[:T], ids_list[-1], list(prefill_copy))
    if per_head:
        add_heads(state)
    if received is not None:
        total, window, first = received
        stats = PrefillStats(uid=state.ledger.live("uid").clone(),
                             window=window / max(1, T - first), window_queries=T - first,
                             total=total, queries=torch.arange(T - 1, -1, -1, device=dev).float(),
                             copy=copied)
        seeded = seed(state, scorer, stats)
        if seeded is not None:
            patch = dataclasses.replace(patch, columns=seeded.columns)
    return state, PrimeOut(logits=rows, patch=patch, stats=stats)


@torch.no_grad()
def add_heads(state: State) -> None:
    """Stage 0: make ``state`` a per-head cache in which every head holds every live token
    (slot i of each head holds ledger row i, as the arena did). Each scorer column then
    holds a value per (layer, KV head) of each token (tokens, L, KVH), every head's the
    token's value so far; so does a column given to a per-head state later (a fork to a
    scorer with columns of its own: ``add_columns`` makes them one value a token)."""
    a, m = state.arena, state.ledger
    require(isinstance(a, Arena), "per-head allocations run on one device (no device map)")
    if state.cold is not None:  # every head holds every cold token too
        to_heads(state.cold)
    state.heads = every_head(a, m, state.heads, a.n)


@torch.no_grad()
def seed(state: State, scorer, stats: PrefillStats) -> ScoreOut | None:
    """Stage 0: write the ledger columns ``scorer`` seeds from the prompt's statistics
    ``stats`` (its ``prefill(view, stats)``, read-only; None: a scorer without one ignores
    them, and nothing changes) into the live slots they are of (a fresh prime's, or a copy
    of it: bench passkey seeds each cell's); a per-head cache's from its ``prefill_heads``,
    one value a (layer, KV head). Returns what the scorer gave."""
    view = state.view()
    take = getattr(scorer, "prefill" if state.heads is None else "prefill_heads", None)
    if take is None:
        return None
    assert torch.equal(view.uid, stats.uid), "the prompt statistics are of other slots"
    require(stats.total is not None or not reads_total(scorer), TOTAL_UNREAD)
    require(stats.copy is not None or not reads_copy(scorer), COPY_UNREAD)
    out = take(view, stats)
    m = state.ledger
    check_columns(m, out.columns, view.n)
    for name, t in (out.columns or {}).items():
        m.columns[name][: view.n] = t
    return out


@torch.no_grad()
def extend(model: Model, state: State, segments: list[Segment], chunk: int | None = None,
           pending: int | None = None) -> Patch:
    """Stage 0 on a live state: prefill the pending token, then every new id but the last,
    which becomes the pending token (a chat turn, or an imported session's next prompt).

    Positions continue from ``state.next_position``; tokens whose source is pinned
    (``state.pinned``) are protected. ``pending`` first replaces the pending token, which is
    not cached yet (a chat closes a reply that ended on another stop token with its end-of-turn marker).
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
    args = (model, state, torch.tensor(ids, device=dev),
            torch.arange(state.next_position, state.next_position + len(ids), device=dev),
            torch.tensor([SOURCES.index(x) for x in src], dtype=torch.int8, device=dev),
            torch.tensor([FLAG_PROTECTED if x in state.pinned else 0 for x in src],
                         dtype=torch.int8, device=dev), chunk)
    if state.heads is None:
        _, slots, uids = _prefill(*args, all_logits=False)
    else:
        slots, uids = [], _prefill_heads(*args)
    state.pending_token = new[-1]
    state.pending_source = segments[-1].source
    state.next_position += len(ids)
    return Patch(step=state.step, appended_slots=tuple(slots), appended_uids=tuple(uids))
