"""Compose saved sessions of one model into one context (``positronic-brain compose``).

Each session's cached tokens keep their order and their gaps; the i-th session's positions
move past everything before it (by the sum of the earlier sessions' next positions: a
session's first token takes the position of the previous one's pending token, which was
never cached and is not composed), and its keys are re-rotated exactly to the new positions
(``forward.rerotate``, stage 4's re-index arithmetic). The
first session keeps its uids and uid accounts (merge history, tokens dropped); the others'
rows get fresh uids. Every row records where it came from (``Ledger.origin``: the file's
label, and its uid there; a row that already came from elsewhere keeps that origin). The
last session gives the pending token, the sampler and its generator state, and the cache
parameters; cold stores (recall) are composed alike when those parameters recall, and
count as dropped otherwise. Stage 0 (``stages.apply.restore``) writes the result.

Per-head parts (``Allocation.per_head``) compose head by head: each head's live slots in
part order (a whole-token part: every head holds every row), each slot's key moved by its
token's move; the composed cache is per head, so the last part's parameters must be.

A partial session file (``partial``) is a part too: its rows get fresh uids even when it
comes first (its accounts are not carried: the composed session accounts only for the rows
it holds), and the layers it lacks are rebuilt as a prefill of its tokens (text order, at
their composed positions) over the cache composed before it computes them
(``blend.chunked``, read-only, reading that cache as stage 0's prefill reads the arena; on
one device: no device map); the layers it holds are kept as exported. Last, it gives what a
whole session gives (its session's pending token and position, sampler, generator state and
cache parameters).

The composed cache is not what a joint prefill of the text would give: each part never saw
the parts before it. ``blend.measure`` says how far it is, and what re-running the tokens
that deviate most (CacheBlend's selective recompute) recovers; ``compose_files`` can save
the cache so recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .blend import SELECT_LAYER, check_percents, chunked, measure
from .forward import rerotate
from .loop import Session
from .model import Model
from .plain import output_file
from .session_io import load_saved, save_session
from .special_tokens import TokenPolicy
from .stages.apply import restore, rewrite
from .stages.apply.rows import birth_values
from .state import Ledger, restore_args
from .types import UserError, require


@dataclass
class Part:
    """One session to compose, as read from it: its live rows (K/V rotated at ``position``),
    cold rows, the rest of its state as ``restore`` takes it, and the session it belongs to
    (sampler, generator, cache parameters, text record). A partial part (``layers`` given)
    holds some of its session's rows, the K/V and log-mass of ``layers`` only, no cold rows,
    and its session has no state."""

    label: str  # the origin label its rows get (the file's name)
    session: Session
    k: torch.Tensor  # (L, kv_heads, n, head_dim); L: len(layers) for a partial part
    v: torch.Tensor
    log_mass: torch.Tensor  # (L, kv_heads, n)
    columns: dict[str, torch.Tensor]  # Ledger.COLUMNS and its scorer columns, (n,)
    cold: dict | None  # the cold rows as ``restore`` takes them (None: no cold store)
    capacity: int  # its arena's slots
    state_fields: dict  # pending token, its source and position, step, pinned
    ledger_fields: dict  # next uid, merge history, dropped, scorer column specs, origins
    layers: tuple[int, ...] | None = None  # the layers a partial part holds (None: whole)
    heads: dict | None = None  # a per-head cache's map over its slots (``restore_args``)

    @classmethod
    def of(cls, session: Session, label: str) -> "Part":
        require(session.state is not None, f"{label}: the session is not primed")
        return cls(label, session, **restore_args(session.state))

    @property
    def rows(self) -> int:
        """The ledger rows it holds (a per-head part's slots are not its rows)."""
        return self.columns["uid"].shape[0]

    def head_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its map over its slots (``row`` (L, kv_heads, w), ``n`` (L, kv_heads)): a
        whole-token part's every head holds every row, slot i row i."""
        if self.heads is not None:
            return self.heads["row"], self.heads["n"]
        L, KVH, w = self.log_mass.shape
        row = torch.arange(w, device=self.log_mass.device).expand(L, KVH, w)
        return row, torch.full((L, KVH), w, dtype=torch.long, device=row.device)

    @classmethod
    def read(cls, model: Model, path: str | Path, label: str) -> "Part":
        """The session file ``path``, whole or partial (``session_io.load_saved``)."""
        session, partial = load_saved(model, path)
        return cls.of(session, label) if partial is None else cls(label, session, cold=None,
                                                                  **partial)


def compose_files(model: Model, paths: list[str | Path], out: str | Path,
                  continuation: list[int] | None = None, percents: tuple[float, ...] = (),
                  layer: int = SELECT_LAYER) -> dict:
    """Compose the session files ``paths``, whole or partial (each read by
    ``session_io.load_saved``, so each must come from ``model``), into the file ``out``;
    returns what was composed. A part's origin label is its file name, or its path where two
    parts share a name.

    With ``continuation`` (ids), the composition is measured against a joint prefill of its
    text (``blend.measure``, recomputing each of ``percents``; under ``"measure"``) and the
    file holds the cache recomputed at the last of ``percents`` (``stages.apply.rewrite``)."""
    require(continuation is not None or not percents,
            "a recompute needs a continuation to measure")
    check_percents(percents)
    output_file(out, *paths)
    names = [Path(p).name for p in paths]
    parts = [Part.read(model, p, name if names.count(name) == 1 else str(p))
             for p, name in zip(paths, names)]
    session = compose(model, parts)
    state = session.state
    measured = None
    if continuation is not None:
        require(state.heads is None, "--measure compares whole tokens with a joint prefill: "
                "a per-head composition cannot be measured yet")
        measured, rows = measure(model, state, continuation, percents, layer)
        if rows is not None:
            rewrite(model, state, *rows)
    save_session(session, out)
    return {"out": str(out), "parts": [{"file": str(p), "label": part.label,
                                        "cached": part.rows,
                                        "layers": None if part.layers is None else list(part.layers),
                                        "cold": 0 if part.cold is None else part.cold["k"].shape[2]}
                                       for p, part in zip(paths, parts)],
            "cached": state.ledger.n, "cold": 0 if state.cold is None else state.cold.n,
            "next_position": state.next_position, "origins": list(state.ledger.origins),
            **({} if measured is None else {"measure": measured})}


class _Origins:
    """The composed origins table, built part by part."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def index(self, label: str) -> int:
        if label not in self.labels:
            self.labels.append(label)
        return self.labels.index(label) + 1

    def columns(self, part: Part, cols: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``cols``' origin and origin uid in the composed table: a row made in ``part``'s
        session comes from ``part``'s file, as its uid there; others keep theirs."""
        labels = (part.label,) + tuple(part.ledger_fields["origins"])
        table = torch.zeros(len(labels), dtype=torch.int32, device=cols["origin"].device)
        for o in sorted(set(cols["origin"].tolist())):  # only the labels rows use
            table[o] = self.index(labels[o])
        here = cols["origin"] == 0
        return table[cols["origin"].long()], torch.where(here, cols["uid"], cols["origin_uid"])


def compose(model: Model, parts: list[Part]) -> Session:
    """One session holding ``parts``' caches in order (see the module's docstring)."""
    require(len(parts) >= 1, "nothing to compose")
    s = model.spec
    last = parts[-1]
    recall = last.session.cache_params.recall
    origins = _Origins()
    hot, cold = [], []
    offset, next_uid, dropped, merged = 0, 0, 0, {}
    specs = {}  # every part's scorer columns (a later part's declaration of a name wins)
    for part in parts:
        specs |= part.ledger_fields["specs"]
    per_head = _per_head(parts)
    maps = [p.head_map() for p in parts] if per_head else []
    for i, part in enumerate(parts):
        keep_uids = i == 0 and part.layers is None
        if keep_uids:
            accounts = part.ledger_fields
            next_uid, merged = accounts["next_uid"], dict(accounts["merged"])
            dropped = accounts["dropped"]
        rows = [(hot, part.k, part.v, part.log_mass, part.columns)]
        if part.cold is not None:
            if recall:
                c = part.cold
                rows.append((cold, c["k"], c["v"], None, c["columns"]))
            elif keep_uids:
                dropped += part.cold["k"].shape[2]
        for out, k, v, log_mass, cols in rows:
            n = cols["uid"].shape[0]
            cols = _every_column(cols, specs, (s.n_layers, s.n_kv_heads)
                                 if per_head and out is hot else ())
            cols["origin"], cols["origin_uid"] = origins.columns(part, cols)
            if not keep_uids:
                cols["uid"] = torch.arange(next_uid, next_uid + n, device=cols["uid"].device)
                next_uid += n
            old = cols["position"]
            cols["position"] = old + offset
            if per_head and out is hot:  # each slot by its row's move
                k = _rerotated_slots(model, k, maps[i][0], old, cols["position"])
            else:
                k = rerotate(model, k, old, cols["position"])
            if part.layers is not None and len(part.layers) < s.n_layers:  # layers missing
                k, v, log_mass = _rebuilt(model, hot, part.layers, k, v, log_mass, cols)
            out.append((k, v, log_mass, cols))
        offset += part.state_fields["next_position"]
    next_position = offset  # the last part's pending position, moved
    require(next_position < s.max_positions,
            f"the composed context needs {next_position + 1} positions; the model has "
            f"{s.max_positions}")
    heads = None
    if per_head:
        k, v, log_mass, heads = _joined_heads(model, hot, maps)
    else:
        k, v, log_mass = _joined(model, hot)
    names = Ledger.COLUMNS + tuple(specs)
    columns = {c: torch.cat([h[3][c] for h in hot]) for c in names}
    n = k.shape[2]
    capacity = min(s.max_positions, max(max(p.capacity for p in parts), n + 1))
    ledger_fields = {"next_uid": next_uid, "merged": merged, "dropped": dropped,
                     "specs": specs, "origins": tuple(origins.labels)}
    state_fields = {"pending_token": last.state_fields["pending_token"],
                    "pending_source": last.state_fields["pending_source"],
                    "next_position": next_position,
                    "step": max(p.state_fields["step"] for p in parts),
                    "pinned": tuple(sorted({x for p in parts for x in p.state_fields["pinned"]}))}
    saved_cold = _cold(parts, cold, names) if cold else None
    try:
        state = restore(model, k, v, columns, capacity, ledger_fields, state_fields, log_mass,
                        saved_cold, heads)
    except AssertionError as e:
        raise UserError(f"the composed sessions are inconsistent: {e}") from None
    source = last.session
    session = Session(model, TokenPolicy(model.tokenizer, bos="yes" if source.policy.add_bos else "no"),
                      sampler=source.sampler, cache_params=source.cache_params, state=state,
                      prompt_ids=[t for p in parts[:-1] for t in p.session.prompt_ids
                                  + p.session.generated_ids] + list(source.prompt_ids),
                      generated_ids=list(source.generated_ids))
    session.generator.set_state(source.generator.get_state())
    return session


def _per_head(parts: list[Part]) -> bool:
    """Whether the composition is a per-head cache: a part is one (then every part is made
    one, and the last part's parameters, which it goes on with, must be per-head too; no
    cold store goes into one)."""
    per_head = any(p.heads is not None for p in parts)
    require(not per_head or parts[-1].session.cache_params.allocation.per_head, "a part is "
            "a per-head cache, so the composition is one: the last part, whose parameters it "
            "goes on with, must be per-head too")
    require(not per_head or all(p.layers is None for p in parts), "a partial part composes "
            "with whole-token parts only (a per-head part's heads hold other tokens)")
    recall = parts[-1].session.cache_params.recall
    require(not any(p.cold is not None and ((per_head and recall) or p.cold.get("heads")
                                            is not None) for p in parts),
            "cold stores (recall) do not compose per head yet")
    return per_head


def _every_column(cols: dict[str, torch.Tensor], specs: dict, heads: tuple[int, ...]) -> dict:
    """``cols`` with every scorer column ``specs`` declares (a part made without one: its
    rows' birth values), one value a head (``heads``: (L, kv_heads)) in a per-head
    composition, as ``add_heads`` makes them."""
    born = cols["source"].long()
    cols = {**{c: birth_values(spec.births, born.device)[born] for c, spec in specs.items()},
            **cols}
    return cols | {c: cols[c].view(-1, 1, 1).expand(-1, *heads) for c in specs
                   if heads and cols[c].dim() == 1}


def _joined(model: Model, rows: list[tuple]) -> tuple[torch.Tensor, ...]:
    """Composed rows (k, v, log_mass, columns) joined in order: K, V (L, kv_heads, n,
    head_dim) and log-mass (L, kv_heads, n); n is 0 for none."""
    s = model.spec
    kv = torch.zeros(s.n_layers, s.n_kv_heads, 0, s.head_dim, dtype=model.dtype,
                     device=model.device)
    mass = torch.zeros(s.n_layers, s.n_kv_heads, 0, device=model.device)
    return tuple(torch.cat([t] + [r[j] for r in rows], dim=2)
                 for j, t in enumerate((kv, kv, mass)))


def _rerotated_slots(model: Model, k: torch.Tensor, row: torch.Tensor, old: torch.Tensor,
                     new: torch.Tensor) -> torch.Tensor:
    """Keys ``k`` (L, kv_heads, w, head_dim) of a per-head map's slots (``row`` (L,
    kv_heads, w), -1 where free) rotated from their rows' ``old`` positions to ``new``, as
    ``rerotate`` moves rows (a free slot stays as it is)."""
    r = row.clamp_min(0)
    was = old[r]
    to = torch.where(row >= 0, new[r], was)
    D = k.shape[-1]
    return rerotate(model, k.reshape(-1, D), was.flatten(), to.flatten()).view(k.shape)


def _joined_heads(model: Model, rows: list[tuple], maps: list[tuple]) -> tuple:
    """``_joined`` per head: composed rows (k, v, log_mass, columns) over slots of their
    head maps ``maps`` (row, n), each head's live slots joined in order; returns K, V,
    log-mass (L, kv_heads, w) and the composed map (``restore``'s ``heads``), w the most one
    head holds."""
    count = sum(n for _, n in maps)
    s = model.spec
    shape = (s.n_layers, s.n_kv_heads, int(count.max()) if maps else 0)
    k = torch.zeros(shape + (s.head_dim,), dtype=model.dtype, device=model.device)
    v, mass = torch.zeros_like(k), torch.zeros(shape, device=model.device)
    row = torch.full(shape, -1, dtype=torch.long, device=count.device)
    start, base = torch.zeros_like(count), 0
    for (kp, vp, mp, cols), (rp, n) in zip(rows, maps):
        li, hi, j = torch.nonzero(torch.arange(rp.shape[2], device=n.device) < n[..., None],
                                  as_tuple=True)
        to = start[li, hi] + j
        k[li, hi, to], v[li, hi, to], mass[li, hi, to] = kp[li, hi, j], vp[li, hi, j], mp[li, hi, j]
        row[li, hi, to] = rp[li, hi, j] + base
        start, base = start + n, base + cols["uid"].shape[0]
    return k, v, mass, {"row": row, "n": start}


def _rebuilt(model: Model, before: list[tuple], layers: tuple[int, ...], k: torch.Tensor,
             v: torch.Tensor, log_mass: torch.Tensor,
             cols: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Every layer's K/V and log-mass of a partial part's rows, which hold ``layers`` only:
    those as they are, the others as a prefill of the rows' tokens in text order at their
    composed positions after the rows composed ``before`` them writes them (log-mass 0)."""
    require(not model.split, "a partial part's missing layers are rebuilt on one device (no "
            "device map)")
    order = torch.argsort(cols["position"])
    k0, v0, mass = _joined(model, before)
    new_k, new_v, _ = chunked(model, (k0, v0, mass if bool((mass > 0).any()) else None),
                              cols["token_id"][order], cols["position"][order])
    back = torch.argsort(order)  # text order -> the part's row order
    out = [new_k[:, :, back], new_v[:, :, back],
           torch.zeros(new_v.shape[:3], dtype=torch.float32, device=new_v.device)]
    held = list(layers)
    for full, part in zip(out, (k, v, log_mass)):
        full[held] = part
    return tuple(out)


def _cold(parts: list[Part], rows: list[tuple], names: tuple[str, ...]) -> dict:
    """The composed cold store (``restore``'s form): the parts' cold rows in part order,
    each part's entry order kept within it."""
    entered, base = [], 0
    for p in parts:
        if p.cold is not None:
            e = p.cold["entered"]
            entered.append(e - (e.min() if e.numel() else 0) + base)
            base += int(e.numel() and (e.max() - e.min() + 1))
    k, v = (torch.cat([r[j] for r in rows], dim=2) for j in range(2))
    return {"k": k, "v": v, "columns": {c: torch.cat([r[3][c] for r in rows]) for c in names},
            "entered": torch.cat(entered), "next_entry": base,
            "capacity": max(max(p.cold["capacity"] for p in parts if p.cold is not None),
                            k.shape[2])}
