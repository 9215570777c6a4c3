"""Budget allocations across layers and KV heads, the rules of the methods that keep
different tokens per head: PyramidKV's per-layer schedule (``pyramid``), DuoAttention's
retrieval and streaming heads (``duo``) and AdaKV's share of a layer's budget among its
heads by score (``adaptive``).

Every rule spends the same memory as a whole-token budget of ``budget``: ``budget`` K/V
pairs per (layer, KV head) on average, ``budget x layers x KV heads`` in all, so that
allocations compare at equal memory. ``protected`` is what each head keeps whatever the
scores (sinks and the recent window): the rules share out the rest. These are the rules
alone, over plain numbers and score tensors; the stage that culls per head applies them.
"""
from __future__ import annotations

import functools
import json
import math
import pathlib

import torch

from ...state import View
from ...types import Allocation, CacheParams, UserError, require


def shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` into whole numbers that add up to it
    (largest remainder: each gets the floor of its share, the units left go to the largest
    fractional parts, the first of equal ones first)."""
    require(total >= 0 and weights and all(w >= 0 for w in weights) and sum(weights) > 0,
            f"cannot share {total} by {weights}")
    exact = [total * w / sum(weights) for w in weights]
    out = [math.floor(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))
    for i in order[:total - sum(out)]:
        out[i] += 1
    return out


def pyramid(budget: int, layers: int, protected: int, beta: float = 20) -> list[int]:
    """PyramidKV's per-layer budgets (every head of a layer keeps its layer's): the scored
    part of the budget (``budget - protected``) falls linearly from the first layer to the
    last, from ``2 x scored - scored / beta`` to ``scored / beta``, each layer also keeping
    ``protected``; the layers' sum is ``budget x layers`` (rounded by ``shares``). With one
    layer, or nothing to share, every layer keeps ``budget``."""
    require(beta >= 1, f"pyramid beta must be >= 1, got {beta}")
    scored = budget - protected
    if layers == 1 or scored <= 0:
        return [budget] * layers
    low = scored / beta
    high = 2 * scored - low
    step = (high - low) / (layers - 1)
    return [protected + s for s in shares(scored * layers, [high - i * step for i in range(layers)])]


def duo(retrieval: torch.Tensor, budget: int, protected: int) -> torch.Tensor:
    """DuoAttention's budgets (L, KVH): a streaming head (``retrieval`` False) keeps the
    sinks and the recent window alone (``protected``); the retrieval heads share the rest
    of ``budget x L x KVH`` equally (``shares``, in layer-then-head order)."""
    require(retrieval.dtype == torch.bool and retrieval.dim() == 2,
            "duo: the retrieval heads are a (layers, KV heads) boolean map")
    n = int(retrieval.sum())
    require(n > 0, "duo: no retrieval head")
    total = budget * retrieval.numel() - protected * (retrieval.numel() - n)
    require(total >= protected * n, f"duo: a budget of {budget} cannot hold {protected} "
            "protected tokens in every head")
    out = torch.full(retrieval.shape, protected, dtype=torch.long)
    out[retrieval] = torch.tensor(shares(total, [1.0] * n))
    return out


def adaptive(scores: torch.Tensor, budget: int, floor: float = 0.2) -> torch.Tensor:
    """AdaKV's choice in one layer: which tokens each KV head keeps (KVH, n) from its
    ``scores`` (KVH, n, higher kept first). Each head first keeps its ``int(budget x
    floor)`` best tokens (the safeguard); then the layer's ``budget x KVH`` places go to
    the best scores of the layer, whichever head they are in (equal scores: the lower head,
    then the earlier token)."""
    require(0 <= floor <= 1, f"adaptive floor must be in [0, 1], got {floor}")
    heads, n = scores.shape
    keep = min(budget * heads, heads * n)
    ranked = scores.float().clone()
    safe = int(budget * floor)
    if safe:
        best = torch.argsort(-scores.float(), dim=1, stable=True)[:, :safe]
        ranked.scatter_(1, best, math.inf)
    order = torch.argsort(-ranked.flatten(), stable=True)[:keep]
    kept = torch.zeros(heads * n, dtype=torch.bool)
    kept[order] = True
    return kept.view(heads, n)


# --- stage 3 of a per-head cache: each head's culls -------------------------------------------

def budgets(params: CacheParams, layers: int, kv_heads: int) -> torch.Tensor | None:
    """Each (layer, KV head)'s budget (L, KVH) under ``params.allocation`` (``head``,
    ``pyramid``, ``duo``): at most this many live slots after a step's append. None for
    ``adaptive``, which shares a layer's budget by this step's scores (``head_culls``).
    Protected (what a head keeps whatever the scores): the sinks, the recent window and
    the token appended."""
    return _budgets(params.allocation, params.budget, params.sinks + params.recent + 1,
                    layers, kv_heads)


@functools.lru_cache(maxsize=16)
def _budgets(alloc: Allocation, budget: int, protected: int, layers: int,
             kv_heads: int) -> torch.Tensor | None:
    if alloc.kind == "head":
        return torch.full((layers, kv_heads), budget, dtype=torch.long)
    if alloc.kind == "pyramid":
        if alloc.layers:
            require(len(alloc.layers) == layers, f"--allocation-layers gives {len(alloc.layers)} "
                    f"layers' weights; the model has {layers} layers")
            per = [protected + s for s in shares((budget - protected) * layers, list(alloc.layers))]
        else:
            per = pyramid(budget, layers, protected, alloc.beta)
        return torch.tensor(per, dtype=torch.long).view(layers, 1).expand(layers, kv_heads)
    if alloc.kind == "duo":
        return duo(retrieval_heads(alloc.heads, layers, kv_heads), budget, protected)
    return None


def retrieval_heads(path: str | None, layers: int, kv_heads: int) -> torch.Tensor:
    """DuoAttention's retrieval heads from a JSON file: a list of [layer, KV head] pairs,
    or a (layers x KV heads) grid of 0/1 (its ``full_attention_heads``' form); a one-line
    error for anything else."""
    require(path is not None, "--allocation duo needs --allocation-heads FILE (the retrieval "
            "heads: [[layer, kv_head], ...] or a layers x KV heads grid of 0/1)")
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--allocation-heads {path}: {e}") from None
    out = torch.zeros(layers, kv_heads, dtype=torch.bool)
    grid = (isinstance(data, list) and len(data) == layers
            and all(isinstance(r, list) and len(r) == kv_heads and all(x in (0, 1) for x in r)
                    for r in data))
    if grid:
        return torch.tensor(data, dtype=torch.bool)
    ok = isinstance(data, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
        and 0 <= p[0] < layers and 0 <= p[1] < kv_heads for p in data)
    require(ok and data, f"--allocation-heads {path}: expected [[layer, kv_head], ...] within "
            f"{layers} layers and {kv_heads} KV heads, or a {layers} x {kv_heads} grid of 0/1")
    for layer, head in data:
        out[layer, head] = True
    return out


def head_culls(view: View, scores: torch.Tensor, params: CacheParams,
               budget: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor:
    """(L, KVH, n) bool: the slots each head culls this step, from ``scores`` (L, KVH, n)
    over each head's slots (higher kept; ties: the earlier position culled first). With
    ``budget`` (L, KVH), each head culls its lowest unprotected slots until, after the
    append, it holds its budget; without (``adaptive``: ``_adaptive_culls``), each layer
    keeps ``budget - 1`` slots a head on average. Protected tokens (``keep`` (n,) over the
    ledger's rows: ``decide.protected``'s sinks, recent and pinned) are held by every head,
    never culled."""
    rows, held = view.heads.row, view.heads.n  # (L, KVH, n), (L, KVH)
    live = view.heads.live(rows.shape[2])
    at = rows.clamp(min=0)
    guard = keep[at] & live
    free = live & ~guard
    if budget is None:
        return _adaptive_culls(scores, params, free, guard, _by_position(view, live, at))
    need = (held + 1 - budget.to(held.device)).clamp(min=0)
    short = need > free.sum(-1)
    most, any_short = torch.stack((need.amax(), short.any())).tolist()
    if any_short:
        layer, head = short.nonzero()[0].tolist()
        raise UserError(f"budget {int(budget[layer, head])} of layer {layer}, KV head {head} "
                        f"is too small: it holds {int(held[layer, head])} tokens, "
                        f"{int(guard[layer, head].sum())} of them protected")
    if most == 0:
        return torch.zeros_like(free)
    if most == 1:  # a step at the budget: each head culls one slot at most, found without a sort
        return _lowest(view, scores.float(), free, at, need)
    return _sorted(view, scores.float(), free, live, at, need)


def _sorted(view: View, scores: torch.Tensor, free: torch.Tensor, live: torch.Tensor,
            at: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Each head's ``need`` (L, KVH) free slots first in ascending score, of equal ones the
    earliest position (a stable sort: NaN above every number)."""
    by_pos = _by_position(view, live, at)
    # ascending score, then the slots that may not go last (a stable sort by that flag
    # keeps the score order within each part, whatever the scores: inf and NaN too)
    order = by_pos.gather(-1, torch.argsort(scores.gather(-1, by_pos), dim=-1,
                                            stable=True))
    order = order.gather(-1, torch.argsort((~free).gather(-1, order).to(torch.uint8), dim=-1,
                                           stable=True))
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return free & (rank < need.unsqueeze(-1))


def _by_position(view: View, live: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Each head's slots in text order, the free ones last (L, KVH, n): for the ties."""
    return torch.argsort(torch.where(live, view.position[at], view.next_position), dim=-1,
                         stable=True)


def _lowest(view: View, scores: torch.Tensor, free: torch.Tensor, at: torch.Tensor,
            need: torch.Tensor) -> torch.Tensor:
    """``_sorted``'s culls where each head culls at most one slot (``need`` (L, KVH) 0 or
    1), without its sorts: the free slot of the lowest score (NaN above every number), of
    equal ones the earliest position."""
    nan = scores.isnan()
    key = torch.where(free & ~nan, scores, math.inf)
    first = free & ~nan & (key == key.amin(-1, keepdim=True))
    first |= free & nan & ~first.any(-1, keepdim=True)  # all its free slots NaN
    pick = torch.where(first, view.position[at], view.next_position).argmin(-1, keepdim=True)
    return torch.zeros_like(free).scatter_(-1, pick, need.unsqueeze(-1) > 0)


def _adaptive_culls(scores: torch.Tensor, params: CacheParams, free: torch.Tensor,
                    guard: torch.Tensor, by_pos: torch.Tensor) -> torch.Tensor:
    """AdaKV's culls: each layer keeps its protected tokens (every head holds them) and,
    of the scored part of ``budget - 1`` slots a head (the append comes next), each head
    first its best ``floor`` share, then the layer's best whichever head they are in
    (``adaptive``; equal scores: the lower head's, then the later position kept)."""
    heads = scores.shape[1]
    protected = guard.sum(-1).amax(-1)  # (L,) every head of a layer holds the same ones
    scored = params.budget - 1 - protected
    if bool((scored < 0).any()):
        layer = int((scored < 0).nonzero()[0])
        raise UserError(f"budget {params.budget} is too small: {int(protected[layer])} tokens "
                        f"of layer {layer} are protected in each of its {heads} KV heads")
    latest = by_pos.flip(-1)  # the later position first: the one ``adaptive`` keeps on ties
    ranked = torch.where(free, scores.float(), -math.inf).gather(-1, latest).cpu()
    kept = torch.stack([adaptive(r, int(b), params.allocation.floor)
                        for r, b in zip(ranked, scored.tolist())]).to(free.device)
    return free & ~torch.zeros_like(free).scatter(-1, latest, kept)
