"""Partial transfer (``positronic-brain export``): some of a session's cached tokens (by uid
range, source, brightness) with the K/V of some of its layers, written as a partial session
file (``session_io.save_session``'s ``rows`` and ``layers``). ``compose`` imports it after a
target session, rebuilding the layers it lacks as a prefill of its tokens in the target
session computes them. ``partial_bench`` measures what transferring each subset of layers
(and rebuilding the rest) does to the NLL of a continuation.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

import torch

from .blend import nll
from .compose import Part, compose
from .loop import Session
from .model import Model
from .plain import output_file
from .session_io import load_session, save_session, spans
from .special_tokens import TokenPolicy
from .types import SOURCES, SamplerParams, require


def parse_span(text: str, what: str) -> tuple[int, int]:
    """``N`` or ``LO-HI`` (inclusive, LO <= HI, not negative) as (LO, HI)."""
    lo, dash, hi = text.strip().partition("-")
    hi = hi if dash else lo
    require(lo.isdigit() and hi.isdigit() and int(lo) <= int(hi) < 2 ** 63,
            f"{what} {text!r}: expected N or LO-HI with LO <= HI < 2**63, e.g. 0-11")
    return int(lo), int(hi)


def parse_layers(spec: str) -> tuple[int, ...]:
    """A layer list such as ``0-11,20-29`` (comma-separated N or LO-HI), ascending."""
    layers: set[int] = set()
    for item in spec.split(","):
        lo, hi = parse_span(item, "--layers")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def select(session: Session, uids: tuple[int, int] | None = None,
           sources: tuple[str, ...] | None = None,
           min_brightness: float | None = None) -> torch.Tensor:
    """The live slots (ascending) whose ledger row passes every filter given: uid in
    [LO, HI] (``uids``), source among ``sources``, brightness at least ``min_brightness``."""
    require(session.state is not None, "prime the session before exporting from it")
    m = session.state.ledger
    keep = torch.ones(m.n, dtype=torch.bool, device=m.device)
    if uids is not None:
        uid = m.live("uid")
        keep &= (uid >= uids[0]) & (uid <= uids[1])
    if sources is not None:
        unknown = [s for s in sources if s not in SOURCES]
        require(not unknown, f"unknown source {unknown[:1]}: one of {', '.join(SOURCES)}")
        keep &= torch.isin(m.live("source"), torch.tensor([SOURCES.index(s) for s in sources],
                                                          dtype=torch.int8, device=m.device))
    if min_brightness is not None:
        require(math.isfinite(min_brightness), f"--min-brightness must be a finite number, got "
                f"{min_brightness}")
        require("brightness" in m.columns, "--min-brightness: this session's ledger has no "
                "brightness column (its scorer keeps none)")
        keep &= m.live("brightness") >= min_brightness
    return keep.nonzero().flatten()


def save_partial(session: Session, path: str | os.PathLike, uids: tuple[int, int] | None = None,
                 sources: tuple[str, ...] | None = None, min_brightness: float | None = None,
                 layers: tuple[int, ...] | None = None) -> dict:
    """Write the cached tokens ``select`` picks with the K/V of ``layers`` (None: every
    layer) to the partial session file ``path``; returns what was written. An empty
    selection or a layer the model lacks raises UserError and writes nothing."""
    rows = select(session, uids, sources, min_brightness)
    n_layers = session.model.spec.n_layers
    held = tuple(range(n_layers)) if layers is None else tuple(sorted(set(layers)))
    bad = [i for i in held if not 0 <= i < n_layers]
    require(not bad, f"layers {spans(tuple(bad))} out of range: the model has {n_layers} "
            f"layers (0-{n_layers - 1})")
    require(rows.numel() > 0, "the selection is empty: no cached token passes the filters")
    out = save_session(session, path, rows=rows, layers=held)
    return {"out": str(out), "rows": rows.numel(), "of": session.state.ledger.n,
            "layers": list(held), "n_layers": n_layers}


def export_file(model: Model, path: str | os.PathLike, out: str | os.PathLike,
                **filters) -> dict:
    """``save_partial`` of the session file ``path`` (loaded into ``model``) to ``out``,
    which must be another file (a partial export would replace the session)."""
    output_file(out, path)
    return save_partial(load_session(model, path), out, **filters)


# --- measurement -------------------------------------------------------------------------

def layer_subsets(n_layers: int) -> dict[str, tuple[int, ...]]:
    """The layer subsets ``partial_bench`` transfers by default."""
    half, four = n_layers // 2, min(4, n_layers)
    return {"all": tuple(range(n_layers)), "none": (), "first half": tuple(range(half)),
            "second half": tuple(range(half, n_layers)),
            "every other": tuple(range(0, n_layers, 2)), "first 4": tuple(range(four)),
            "last 4": tuple(range(n_layers - four, n_layers))}


def _primed(model: Model, policy: TokenPolicy, text: str) -> Session:
    session = Session(model, policy, SamplerParams(greedy=True))
    segments = policy.raw_prompt(text)
    session.prime(segments, capacity=sum(len(s.ids) for s in segments))
    return session


def partial_bench(model: Model, policy: TokenPolicy, target_text: str, doc_text: str,
                  continuation_text: str,
                  subsets: dict[str, tuple[int, ...]] | None = None) -> dict:
    """Transfer a document into a target session with each subset of layers (default
    ``layer_subsets``) and the rest rebuilt, and score a continuation.

    The target and the document are primed alone (raw text); the document is exported with
    every cached token and the subset's layers (``save_partial``) and composed after the
    target (``compose``: the target's pending token is not composed, the document's is the
    pending one). Each subset's row has the continuation's mean NLL (nats per token), its
    difference from the full transfer (the whole document session composed, no layer
    rebuilt; ``blend.nll``) and the seconds compose took (the rebuild); ``target_cached`` and
    ``doc_cached`` count the tokens each part brings. Subset ``none`` rebuilds every
    layer: a prefill of the document after the target, the joint-context reference."""
    n_layers = model.spec.n_layers
    subsets = layer_subsets(n_layers) if subsets is None else subsets
    target, doc = _primed(model, policy, target_text), _primed(model, policy, doc_text)
    cont = torch.tensor(policy.encode(continuation_text), device=model.device)
    require(cont.numel() > 0, "the continuation is empty")

    def scored(part: Part) -> tuple[float, float]:
        start = time.perf_counter()
        view = compose(model, [Part.of(target, "target"), part]).state.view()
        seconds = time.perf_counter() - start
        return nll(model, (view.k, view.v, view.log_mass), view.pending_token,
                   view.next_position, cont), seconds

    full, full_seconds = scored(Part.of(doc, "doc"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, layers in subsets.items():
            path = Path(tmp) / "doc.pbs"
            save_partial(doc, path, layers=layers)
            mean, seconds = scored(Part.read(model, path, "doc.pbs"))
            rows.append({"subset": name, "layers": spans(tuple(sorted(set(layers)))),
                         "transferred": len(set(layers)), "rebuilt": n_layers - len(set(layers)),
                         "nll": mean, "vs_full": mean - full, "seconds": seconds})
    return {"model": model.name, "dtype": model.precision,
            "n_layers": n_layers, "target_cached": target.state.ledger.n,
            "doc_cached": doc.state.ledger.n, "continuation_tokens": cont.numel(),
            "full": {"nll": full, "seconds": full_seconds}, "subsets": rows}
