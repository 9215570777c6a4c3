"""Attention row helpers shared by the scorers: (L, H, n) -> one value per live slot."""
from __future__ import annotations

import torch

from ..types import AGGREGATIONS, option, require


def aggregation(default: str = "all-mean"):
    """A scorer's ``aggregate`` field: how it reduces attention over layers and heads."""
    return option(default, "attention over layers-heads", choices=AGGREGATIONS)


def check_aggregation(how: str) -> None:
    require(how in AGGREGATIONS, f"unknown aggregation {how!r}; expected one of "
            f"{', '.join(AGGREGATIONS)}")


def aggregate(attention: torch.Tensor, how: str) -> torch.Tensor:
    """Attention (L, H, n) -> (n,): ``{all|last|max}-{mean|max}`` = over all layers (mean),
    the last layer only, or the layer that gives the most, of the head mean or max."""
    layers, heads = how.split("-")
    a = attention[-1:] if layers == "last" else attention  # (L', H, n)
    a = a.amax(1) if heads == "max" else a.mean(1)  # (L', n)
    return a.amax(0) if layers == "max" else a.mean(0)


def max_pooled(x: torch.Tensor, width: int) -> torch.Tensor:
    """(..., n) in prompt order -> each the largest of the ``width`` (odd) around it, as
    SnapKV clusters its scores: a span read from one place is kept whole."""
    if width == 1 or not x.shape[-1]:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    return torch.nn.functional.max_pool1d(flat, width, 1, width // 2).view(x.shape)


def by_head(attention: torch.Tensor, kv_heads: int, how: str) -> torch.Tensor:
    """Attention (L, H, n) -> (L, kv_heads, n) for a per-head cache: what each KV head's
    query heads paid its slots, their max where ``how`` ends in ``-max``, else their mean."""
    L, H, n = attention.shape
    grouped = attention.view(L, kv_heads, H // kv_heads, n)
    return grouped.amax(2) if how.endswith("-max") else grouped.mean(2)


def head_index(view) -> torch.Tensor:
    """Where each slot of each head sits in a per-head column (tokens, L, kv_heads) seen
    flat: (L, kv_heads, n) int64, a free slot's one past the column's end."""
    h = view.heads
    L, KVH, _ = h.row.shape
    at = h.row * (L * KVH) + torch.arange(L * KVH, device=h.row.device).view(L, KVH, 1)
    return torch.where(h.row >= 0, at, view.n * L * KVH)


def head_column(view, name: str):
    """A per-head column ``name`` (tokens, L, kv_heads) read at each slot of each head:
    (L, kv_heads, n), a free slot's some other value (its score is never read), and ``put``:
    values (L, kv_heads, n) -> a new (tokens, L, kv_heads) column with each head's live
    slots set to them, the view's left as it was (the free slots write one element past
    its end, dropped). The slots' places are found once for both."""
    col = view.columns[name]
    at = head_index(view)

    def put(values: torch.Tensor) -> torch.Tensor:
        new = col.new_empty(col.numel() + 1)
        new[:-1] = col.reshape(-1)
        new.scatter_(0, at.reshape(-1), values.reshape(-1).to(new.dtype))
        return new[:-1].view(col.shape)

    return col.reshape(-1).take(at.clamp(max=max(col.numel() - 1, 0))), put


def value_weighted(attention: torch.Tensor, norms: torch.Tensor,
                   live: torch.Tensor | None = None) -> torch.Tensor:
    """Attention (L, H, n) times each slot's value norm (``View.vnorm``) relative to the mean
    live norm of its layer and KV head, as in value-aware token pruning (Guo et al., 2024): a
    slot whose value is small moves the attention output little, however much attention it
    gets (the attention sinks are the usual case). ``live``: the live norms the mean is
    taken over, when ``norms`` are others' (cold tokens, weighed as if they were live)."""
    w = relative_norms(norms, live)
    L, H, n = attention.shape
    kvh = norms.shape[1]  # the heads of one KV group share its values (GQA)
    return (attention.reshape(L, kvh, H // kvh, n) * w[:, :, None]).reshape(L, H, n)


def relative_norms(norms: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """Norms (L, kv_heads, n) relative to the mean ``live`` norm (default: their own) of
    each layer and KV head: of values, ``value_weighted``'s factors; of keys, key norm's
    score."""
    live = norms if live is None else live
    return norms / live.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def head_relative_norms(view, norms: torch.Tensor,
                        others: torch.Tensor | None = None) -> torch.Tensor:
    """A per-head view's ``norms`` (L, kv_heads, n; ``View.vnorm``'s value weights, or
    ``View.knorm``) relative to the mean norm of each head's own live slots (a free slot's
    0); with ``others`` (L, kv_heads, c; a head's cold slots), those too, relative to the
    same mean: the pair (the mean found once)."""
    h = view.heads
    live = h.live(norms.shape[-1])
    norms = norms * live
    mean = norms.sum(-1, keepdim=True) / h.n.unsqueeze(-1).clamp(min=1)
    mean = mean.clamp_min(torch.finfo(torch.float32).tiny)
    return norms / mean if others is None else (norms / mean, others / mean)
