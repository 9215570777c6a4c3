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

import math

import torch

from ...types import require


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
