"""How far a composed cache is from a joint prefill of its text, and what CacheBlend's
selective recompute gets back (``compose --measure``, ``bench transfer``). Read-only: it
reads a live state and writes nothing; ``stages.apply.rewrite`` (stage 0) writes what
``measure`` recomputed.

- The joint prefill: the cache's token ids in text order at their positions, through the
  read-only forward over an empty past in chunks (as stage 0's prefill: each chunk over the
  chunks before it).
- Deviation: per layer, ||K_c - K_j|| / ||K_j|| over every row, head and dimension (and V
  alike); per token, the same over every layer, head and dimension.
- NLL: the continuation teacher-forced over a cache, the pending token and the
  continuation but its last id at the positions from the pending one's, in one forward;
  the mean of each next id's negative log-likelihood.
- Recompute R%: the ceiling of R% of the rows, those whose values deviate most at layer
  ``layer`` (CacheBlend selects by the value deviation of its first layers, which it
  computes at run time; the default here is layer 1, the first whose K/V depend on other
  tokens: layer 0's are each token's own, equal in both caches), run again in text order
  at their positions through one masked forward over the composed cache: a selected token
  sees the unselected rows before it and the selected tokens before it (the forward's new
  tokens, causal), so each layer's new K/V are CacheBlend's recompute of that layer. The
  selected rows' K/V are replaced by the forward's; R = 100 is the joint prefill.
- Gap closed at R: (NLL composed - NLL at R) / (NLL composed - NLL joint); None where the
  two are equal.

The live cache only: a cold store is not measured. One device only (not a split model).
"""
from __future__ import annotations

import math

import torch

from .forward import builds_scores, forward
from .model import Model
from .stages.apply import chunks
from .state import State
from .types import require

SELECT_LAYER = 1  # the default layer whose value deviation selects the rows to recompute

Cache = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # K, V (L, kv_heads, n, D), log-mass


def _buffer(model: Model, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty K/V of ``rows`` rows, the keys stored transposed as an arena's are, so a chunk
    reads them as stage 0's prefill reads the arena."""
    L, KVH, _, D = like.shape
    kt = torch.empty(L, KVH, D, rows, dtype=model.dtype, device=model.device)
    return kt.transpose(2, 3), torch.empty(L, KVH, rows, D, dtype=model.dtype, device=model.device)


@torch.no_grad()
def chunked(model: Model, past: Cache, ids: torch.Tensor, positions: torch.Tensor,
        past_mask: torch.Tensor | None = None, logits: bool = False,
        chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``ids`` (T,) at ``positions`` over the rows ``past`` (copied once into a buffer, which
    the new rows follow), in chunks (``stages.apply.chunks``), each over the past and the chunks
    before it; query t sees past row j where ``past_mask`` (T, n) is True (None: every row).
    Returns the new K/V (L, kv_heads, T, head_dim) and, with ``logits``, every new token's
    logits (T, V) float32."""
    k0, v0, lm0 = past
    n, T = k0.shape[2], ids.shape[0]
    k, v = _buffer(model, n + T, k0)
    k[:, :, :n], v[:, :, :n] = k0, v0
    lm = None
    if lm0 is not None:
        lm = torch.zeros(k.shape[:3], device=model.device)
        lm[:, :, :n] = lm0
    rows = []
    for sl in chunks(model, n, T, chunk, logits=logits,
                     scores=builds_scores(model, False, lm is not None, past_mask is not None)):
        start = sl.start
        m = n + start
        mask = None
        if past_mask is not None:
            mask = past_mask[sl]
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], start)), dim=1)
        out = forward(model, k[:, :, :m], v[:, :, :m], ids[sl], positions[sl], past_mask=mask,
                      past_log_mass=None if lm is None else lm[:, :, :m], all_logits=logits,
                      kv_only=not logits)
        t = out.k.shape[2]
        k[:, :, m:m + t], v[:, :, m:m + t] = out.k, out.v
        rows.append(out.logits)
    return k[:, :, n:], v[:, :, n:], torch.cat(rows) if logits else None


def nll(model: Model, cache: Cache, pending: int, next_position: int,
        continuation: torch.Tensor) -> float:
    """The mean NLL of ``continuation`` (C,) teacher-forced over ``cache``: the ``pending``
    token and the continuation but its last id at the positions from ``next_position``, in
    one forward (on the model's device, wherever ``continuation`` is)."""
    continuation = continuation.to(model.device)
    ids = torch.cat((continuation.new_tensor([pending]), continuation[:-1]))
    positions = torch.arange(next_position, next_position + ids.shape[0], device=ids.device)
    _, _, logits = chunked(model, cache, ids, positions, logits=True, chunk=ids.shape[0])
    return float(-logits.log_softmax(-1).gather(1, continuation[:, None]).mean())


def relative(x: torch.Tensor, ref: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """||x - ref|| / ||ref|| over ``dims``, in float32."""
    x, ref = x.float(), ref.float()
    return (x - ref).square().sum(dims).sqrt() / ref.square().sum(dims).sqrt()


def check_percents(percents: tuple[float, ...]) -> None:
    """Recompute percentages are in (0, 100]."""
    bad = [r for r in percents if not 0 < r <= 100]
    require(not bad, f"a recompute percentage must be in (0, 100], got {bad[0]:g}" if bad else "")


def percent_rows(n: int, percent: float) -> int:
    """How many of ``n`` rows R% recomputes: the ceiling of R% of them."""
    return math.ceil(n * percent / 100 - 1e-9)


class Blend:
    """A live state's cache in text order (copies) beside the joint prefill of its text."""

    @torch.no_grad()
    def __init__(self, model: Model, state: State, chunk: int | None = None):
        require(not model.split, "blend measures a model on one device (no device map)")
        a, m, n = state.arena, state.ledger, state.ledger.n
        require(n > 0, "the cache is empty: nothing to measure")
        self.model, self.chunk = model, chunk
        self.order = torch.argsort(m.live("position"))  # text index -> slot
        self.ids, self.positions = m.live("token_id")[self.order], m.live("position")[self.order]
        k, v, log_mass = a.past(n)
        self.cache: Cache = (k.index_select(2, self.order), v.index_select(2, self.order),
                             None if log_mass is None else log_mass.index_select(2, self.order))
        empty = (k[:, :, :0], v[:, :, :0], None)
        jk, jv, _ = chunked(model, empty, self.ids, self.positions, chunk=chunk)
        self.joint: Cache = (jk, jv, None)
        self.pending, self.next_position = state.pending_token, state.next_position

    @property
    def n(self) -> int:
        return self.ids.shape[0]

    def deviation(self, cache: Cache | None = None) -> dict[str, torch.Tensor]:
        """``cache``'s (default: the composed one's) relative deviation from the joint
        prefill: ``k``/``v`` over everything (scalars), ``layer_k``/``layer_v`` per layer
        (L,), ``token_k``/``token_v`` per token in text order (n,)."""
        k, v, _ = cache or self.cache
        jk, jv, _ = self.joint
        return {"k": relative(k, jk, (0, 1, 2, 3)), "v": relative(v, jv, (0, 1, 2, 3)),
                "layer_k": relative(k, jk, (1, 2, 3)), "layer_v": relative(v, jv, (1, 2, 3)),
                "token_k": relative(k, jk, (0, 1, 3)), "token_v": relative(v, jv, (0, 1, 3))}

    def selected(self, percent: float, layer: int = SELECT_LAYER) -> torch.Tensor:
        """The text indices (sorted) of the R% rows whose values deviate most from the joint
        prefill's at ``layer`` (||V_c - V_j|| over heads and dimensions; ties: the earlier
        row)."""
        dv = (self.cache[1][layer].float() - self.joint[1][layer].float()).square().sum((0, 2))
        top = torch.argsort(dv, descending=True, stable=True)[:percent_rows(self.n, percent)]
        return top.sort().values

    def recompute(self, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V (L, kv_heads, s, head_dim) of the rows ``selected`` (sorted text indices)
        run again through one masked forward over the composed cache: each sees the
        unselected rows before it and, causally, the selected ones."""
        text = torch.arange(self.n, device=selected.device)
        unselected = torch.ones(self.n, dtype=torch.bool, device=selected.device)
        unselected[selected] = False
        mask = (text[None, :] < selected[:, None]) & unselected[None, :]
        k, v, _ = chunked(self.model, self.cache, self.ids[selected], self.positions[selected],
                      past_mask=mask, chunk=self.chunk)
        return k, v

    def replaced(self, selected: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Cache:
        """The composed cache with the rows ``selected`` holding ``k``/``v`` (one token
        each: log-mass 0)."""
        ck, cv, lm = (None if t is None else t.clone() for t in self.cache)
        ck[:, :, selected], cv[:, :, selected] = k, v
        if lm is not None:
            lm[:, :, selected] = 0.0
        return ck, cv, lm

    def nll(self, cache: Cache, continuation: torch.Tensor) -> float:
        """The mean NLL of ``continuation`` (C,) teacher-forced over ``cache``."""
        return nll(self.model, cache, self.pending, self.next_position, continuation)

    def slots(self, selected: torch.Tensor) -> torch.Tensor:
        """The arena slots of the text indices ``selected``."""
        return self.order[selected]


def _plain(d: dict[str, torch.Tensor]) -> dict:
    """Deviations as JSON: floats, and lists of floats (8 decimals)."""
    return {name: float(t) if t.ndim == 0 else [round(x, 8) for x in t.tolist()]
            for name, t in d.items()}


def gap_closed(composed: float, joint: float, nll: float) -> float | None:
    """(composed - nll) / (composed - joint); None where composed equals joint."""
    return None if composed == joint else (composed - nll) / (composed - joint)


@torch.no_grad()
def measure(model: Model, state: State, continuation: list[int], percents: tuple[float, ...] = (),
            layer: int = SELECT_LAYER, chunk: int | None = None
            ) -> tuple[dict, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Measure ``state``'s cache against the joint prefill of its text (the module's
    docstring) with ``continuation`` (ids) as the text that follows, recomputing each of
    ``percents`` (R in (0, 100]) in turn from the composed cache. Returns the report
    (JSON-ready) and the last R's recomputed rows: the arena slots, K and V (None without
    ``percents``)."""
    require(len(continuation) >= 1, "the continuation to measure is empty")
    require(state.next_position + len(continuation) <= model.spec.max_positions,
            f"the cache and a continuation of {len(continuation)} tokens need "
            f"{state.next_position + len(continuation)} positions; the model has "
            f"{model.spec.max_positions}")
    bad = [i for i in continuation if not 0 <= i < model.spec.vocab]
    require(not bad, f"token id {bad[:1]} outside the model's vocabulary of {model.spec.vocab}")
    check_percents(percents)
    L = model.spec.n_layers
    require(0 <= layer < L, f"the selection layer must be in [0, {L}), got {layer}")
    b = Blend(model, state, chunk)
    cont = torch.tensor(continuation, device=model.device)
    dev = b.deviation()
    composed, joint = b.nll(b.cache, cont), b.nll(b.joint, cont)
    report = {"tokens": b.n, "continuation": len(continuation), "select_layer": layer,
              "deviation": _plain(dev),
              "positions": b.positions.tolist(),
              "nll": {"composed": composed, "joint": joint}, "recompute": []}
    rows = None
    for r in percents:
        sel = b.selected(r, layer)
        k, v = b.recompute(sel)
        cache = b.replaced(sel, k, v)
        nll, d = b.nll(cache, cont), b.deviation(cache)
        report["recompute"].append({"percent": r, "rows": sel.numel(), "nll": nll,
                                    "gap_closed": gap_closed(composed, joint, nll),
                                    "deviation": {"k": float(d["k"]), "v": float(d["v"])}})
        rows = (b.slots(sel), k, v)
    return report, rows
