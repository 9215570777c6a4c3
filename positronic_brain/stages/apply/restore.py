"""Stage 0 on whole states: a saved or composed session written back (``restore``),
recomputed K/V written into live slots (``rewrite``), the arena re-prefilled from the ledger
after a failure (``rebuild_from_ledger``), and a scorer's columns added to a state made
without them (``add_columns``)."""
from __future__ import annotations

import torch

from ...forward import forward
from ...model import Model
from ...state import Cold, Heads, Ledger, State, key_norms, value_norms
from ...types import Column, require
from .cold_heads import room as cold_room, to_heads
from .recall import cold_store, grow
from .prefill import add_heads, chunks
from .rows import arena, birth_values, per_block, put_kv, write


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
    put_kv(state.arena, slots.to(state.ledger.device),
            {"k": k, "v": v, "knorm": key_norms(k), "vnorm": value_norms(v)})


@torch.no_grad()
def rebuild_from_ledger(model: Model, state: State, chunk: int | None = None) -> None:
    """Re-prefill every live token (in position order, at its position) so the arena
    agrees with the ledger again. Slot order becomes position order; folds are lost (every
    slot holds its own token's K/V again)."""
    m = state.ledger
    parts = list(chunks(model, 0, m.n, chunk))  # a bad chunk refused before anything changes
    order = torch.argsort(m.live("position"))
    cols = {c: m.live(c)[order].clone() for c in m.names}
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
        write(a, start, out.k, out.v, norms_of_kv=False)
        a.n = start + out.k.shape[2]
    for c, col in cols.items():
        m.col(c)[:n] = col
    m.n = a.n = n


@torch.no_grad()
def restore(model: Model, k: torch.Tensor, v: torch.Tensor, columns: dict[str, torch.Tensor],
            capacity: int, ledger_fields: dict, state_fields: dict,
            log_mass: torch.Tensor, cold: dict | None = None, heads: dict | None = None) -> State:
    """Stage 0 from a saved session (checked by ``session_io``): allocate ``capacity`` slots
    and write back the live prefix ``k``/``v`` (L, kv_heads, n, head_dim), the ledger
    ``columns`` (name -> (rows,): ``Ledger.COLUMNS`` and the scorer columns that
    ``ledger_fields``' ``specs`` declare) and the slots' ``log_mass``
    (L, kv_heads, n) float32; ``ledger_fields`` (next_uid, merged, ...) and ``state_fields``
    (pending token, its source and position, step, pinned) are set as given; ``cold`` (the
    cold store's ``k``, ``v``, ``columns``, ``entered``, ``capacity``, ``next_entry``) is
    written back likewise, and a per-head cache's map ``heads`` (``row`` (L, kv_heads, n),
    ``n`` (L, kv_heads); its scorer columns (rows, L, kv_heads)). An inconsistent ledger
    fails ``check_valid`` (AssertionError)."""
    n, rows = k.shape[2], columns["uid"].shape[0]  # whole tokens: a row a slot
    state = State(arena(model, capacity), Ledger.allocate(
        max(capacity, rows), ledger_fields["specs"], model.device), **state_fields)
    a, m = state.arena, state.ledger
    for name, value in ledger_fields.items():
        setattr(m, name, value)
    if heads is not None:
        row = torch.full(log_mass.shape[:2] + (capacity,), -1, dtype=torch.long,
                         device=m.device)
        row[:, :, :n] = heads["row"]
        state.heads = Heads(row=row, n=heads["n"].to(m.device, copy=True))
        add_heads(state)  # the scorer columns one value a head
    for c in m.names:
        m.col(c)[:rows] = columns[c]
    write(a, 0, k, v, norms_of_kv=False)
    for b, (lm,) in per_block(a, log_mass):
        b.log_mass[:, :, :n] = lm
    a.folded = bool((log_mass > 0).any())
    a.n, m.n = n, rows
    if cold is not None:
        state.cold = _restore_cold(model, cold, m.specs)
    state.check_valid()
    return state


def _restore_cold(model: Model, saved: dict, columns: dict[str, Column]) -> Cold:
    """A cold store holding the saved rows (with the scorer ``columns``); a per-head one's
    map (``heads``) over its slots."""
    cold = cold_store(model, saved["capacity"], columns=columns)
    if saved.get("heads") is not None:
        return _restore_cold_heads(model, cold, saved)
    n = saved["k"].shape[2]
    grow(model, cold, n)
    a, m = cold.arena, cold.ledger
    a.k[:, :, :n] = saved["k"]
    a.v[:, :, :n] = saved["v"]
    a.renorm(0, n)
    for c in m.names:
        m.col(c)[:n] = saved["columns"][c]
    cold.entered[:n] = saved["entered"]
    cold.next_entry = saved["next_entry"]
    a.n = m.n = n
    return cold


def _restore_cold_heads(model: Model, cold: Cold, saved: dict) -> Cold:
    """``_restore_cold`` of a per-head cold store: its slots, map and ledger rows."""
    to_heads(cold)
    width, rows = saved["k"].shape[2], saved["entered"].shape[0]
    cold_room(model, cold, width, rows)
    a, m, h = cold.arena, cold.ledger, cold.heads
    a.k[:, :, :width] = saved["k"]
    a.v[:, :, :width] = saved["v"]
    a.renorm(0, width)
    for c in m.names:
        m.col(c)[:rows] = saved["columns"][c]
    h.row[:, :, :width] = saved["heads"]["row"]
    h.n.copy_(saved["heads"]["n"])
    cold.entered[:rows] = saved["entered"]
    cold.next_entry = saved["next_entry"]
    m.n, a.n = rows, int(h.n.max()) if h.n.numel() else 0
    return cold


@torch.no_grad()
def add_columns(state: State, columns: dict[str, Column]) -> tuple[str, ...]:
    """Stage 0: give ``state``'s ledgers (hot and cold) the scorer ``columns`` they lack,
    each row at its birth value (a session made with another scorer, continued with this
    one); the columns they have keep their values and specs. Returns the names added."""
    added = tuple(c for c in columns if c not in state.ledger.columns)
    for m in (state.ledger,) + (() if state.cold is None else (state.cold.ledger,)):
        for name in added:
            spec = columns[name]
            m.columns[name] = birth_values(spec.births, m.device)[m.source.long()].clone()
            m.specs[name] = spec
    return added
