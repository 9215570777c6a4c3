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

The composed cache is not what a joint prefill of the text would give: each part never saw
the parts before it. ``blend.measure`` says how far it is, and what re-running the tokens
that deviate most (CacheBlend's selective recompute) recovers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .forward import rerotate
from .loop import Session
from .model import Model
from .session_io import load_session, save_session
from .special_tokens import TokenPolicy
from .stages.apply import restore
from .state import Ledger, gathered
from .types import UserError, require


@dataclass
class Part:
    """One session to compose, as read from it: its live rows (K/V rotated at ``position``),
    cold rows, accounts and the session it belongs to."""

    label: str  # the origin label its rows get (the file's name)
    session: Session
    k: torch.Tensor  # (L, kv_heads, n, head_dim)
    v: torch.Tensor
    log_mass: torch.Tensor  # (L, kv_heads, n)
    columns: dict[str, torch.Tensor]  # every Ledger.COLUMNS, (n,)
    cold: dict | None  # k, v, columns, entered of the cold rows (None: no cold store)

    @classmethod
    def of(cls, session: Session, label: str) -> "Part":
        state = session.state
        require(state is not None, f"{label}: the session is not primed")
        a, m, n = state.arena, state.ledger, state.ledger.n
        cold = None
        if state.cold is not None:
            c = state.cold
            cold = {"k": c.arena.k[:, :, :c.n], "v": c.arena.v[:, :, :c.n],
                    "columns": {col: c.ledger.live(col) for col in Ledger.COLUMNS},
                    "entered": c.entered[:c.n], "capacity": c.capacity}
        return cls(label, session, gathered(a, "k", n), gathered(a, "v", n),
                   gathered(a, "log_mass", n), {c: m.live(c) for c in Ledger.COLUMNS}, cold)

    @property
    def ledger(self) -> Ledger:
        return self.session.state.ledger


def compose_files(model: Model, paths: list[str | Path], out: str | Path) -> dict:
    """Compose the session files ``paths`` (each loaded by ``session_io.load_session``, so
    each must come from ``model``) into the file ``out``; returns what was composed. A
    part's origin label is its file name, or its path where two parts share a name."""
    names = [Path(p).name for p in paths]
    parts = [Part.of(load_session(model, p), name if names.count(name) == 1 else str(p))
             for p, name in zip(paths, names)]
    session = compose(model, parts)
    save_session(session, out)
    state = session.state
    return {"out": str(out), "parts": [{"file": str(p), "label": part.label,
                                        "cached": part.k.shape[2],
                                        "cold": 0 if part.cold is None else part.cold["k"].shape[2]}
                                       for p, part in zip(paths, parts)],
            "cached": state.ledger.n, "cold": 0 if state.cold is None else state.cold.n,
            "next_position": state.next_position, "origins": list(state.ledger.origins)}


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
        labels = (part.label,) + part.ledger.origins
        table = torch.zeros(len(labels), dtype=torch.int32, device=cols["origin"].device)
        for o in sorted(set(cols["origin"].tolist())):  # only the labels rows use
            table[o] = self.index(labels[o])
        here = cols["origin"] == 0
        return table[cols["origin"].long()], torch.where(here, cols["uid"], cols["origin_uid"])


def compose(model: Model, parts: list[Part]) -> Session:
    """One session holding ``parts``' caches in order (see the module's docstring)."""
    require(len(parts) >= 1, "nothing to compose")
    s = model.spec
    last = parts[-1].session
    recall = last.cache_params.recall
    origins = _Origins()
    hot, cold = [], []
    offset, next_uid, dropped, merged = 0, 0, 0, {}
    for i, part in enumerate(parts):
        state = part.session.state
        keep_uids = i == 0
        if keep_uids:
            next_uid, merged = state.ledger.next_uid, dict(state.ledger.merged)
            dropped = state.ledger.dropped
        rows = [(hot, part.k, part.v, part.log_mass, part.columns)]
        if part.cold is not None:
            if recall:
                c = part.cold
                rows.append((cold, c["k"], c["v"], None, c["columns"]))
            elif keep_uids:
                dropped += part.cold["k"].shape[2]
        for out, k, v, log_mass, cols in rows:
            n = k.shape[2]
            cols = dict(cols)
            cols["origin"], cols["origin_uid"] = origins.columns(part, cols)
            if not keep_uids:
                cols["uid"] = torch.arange(next_uid, next_uid + n, device=cols["uid"].device)
                next_uid += n
            old = cols["position"]
            cols["position"] = old + offset
            out.append((rerotate(model, k, old, cols["position"]), v, log_mass, cols))
        offset += state.next_position
    next_position = offset  # the last part's pending position, moved
    require(next_position < s.max_positions,
            f"the composed context needs {next_position + 1} positions; the model has "
            f"{s.max_positions}")
    k, v, log_mass = (torch.cat([h[j] for h in hot], dim=2) for j in range(3))
    columns = {c: torch.cat([h[3][c] for h in hot]) for c in Ledger.COLUMNS}
    n = k.shape[2]
    capacity = min(s.max_positions, max(max(p.session.state.arena.capacity for p in parts), n + 1))
    ledger_fields = {"next_uid": next_uid, "merged": merged, "dropped": dropped,
                     "seeds": last.state.ledger.seeds, "origins": tuple(origins.labels)}
    state_fields = {"pending_token": last.state.pending_token,
                    "pending_source": last.state.pending_source,
                    "next_position": next_position,
                    "step": max(p.session.state.step for p in parts),
                    "pinned": tuple(sorted({x for p in parts for x in p.session.state.pinned}))}
    saved_cold = _cold(parts, cold) if cold else None
    try:
        state = restore(model, k, v, columns, capacity, ledger_fields, state_fields, log_mass,
                        saved_cold)
    except AssertionError as e:
        raise UserError(f"the composed sessions are inconsistent: {e}") from None
    session = Session(model, TokenPolicy(model.tokenizer, bos="yes" if last.policy.add_bos else "no"),
                      sampler=last.sampler, cache_params=last.cache_params, state=state,
                      prompt_ids=[t for p in parts[:-1] for t in p.session.prompt_ids
                                  + p.session.generated_ids] + list(last.prompt_ids),
                      generated_ids=list(last.generated_ids))
    session.generator.set_state(last.generator.get_state())
    return session


def _cold(parts: list[Part], rows: list[tuple]) -> dict:
    """The composed cold store (``restore``'s form): the parts' cold rows in part order,
    each part's entry order kept within it."""
    entered, base = [], 0
    for p in parts:
        if p.cold is not None:
            e = p.cold["entered"]
            entered.append(e - (e.min() if e.numel() else 0) + base)
            base += int(e.numel() and (e.max() - e.min() + 1))
    k, v = (torch.cat([r[j] for r in rows], dim=2) for j in range(2))
    return {"k": k, "v": v, "columns": {c: torch.cat([r[3][c] for r in rows])
                                        for c in Ledger.COLUMNS},
            "entered": torch.cat(entered), "next_entry": base,
            "capacity": max(max(p.cold["capacity"] for p in parts if p.cold is not None),
                            k.shape[2])}
