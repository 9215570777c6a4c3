"""Stage 2's part of recall (``Recall``): the hot tokens get one signal each from this step's
attention over recall's ``layers`` layers, and on every ``every``-th step the same query also
scores the cold store's keys, exactly as the attention they would have received next to the
hot ones, exp(q.k - lse) with stage 1's log-sum-exp, aggregated alike, for stage 3 to
compare (``stages.decide.recall``)."""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ... import native
from ...scorers.brightness import Brightness
from ...scorers.attention import (aggregate, by_head, head_relative_norms, relative_norms,
                                  value_weighted)
from ...state import ColdView, View
from ...types import CacheParams, GenerateOut, RecallQuery


DEFAULTS = {f.name: f.default for f in dataclasses.fields(Brightness)}


def read_like_scorer(params: CacheParams, name: str):
    """The scorer's field ``name`` that recall reads as it does (``skip_layers``, ``signal``):
    its own value, or brightness's default where it has none."""
    return params.scorer.get(name, DEFAULTS[name])


def recall_layers(params: CacheParams, n_layers: int) -> tuple[int, ...]:
    """Recall's ``layers`` layers spread evenly over those the scorer reads (all but the first
    ``skip_layers`` fraction), or all of them (None). In a per-head cache every layer's
    heads recall their own (as every layer scores its own heads): spread over all layers."""
    skip = 0.0 if params.allocation.per_head else read_like_scorer(params, "skip_layers")
    return _spread(skip, params.recall.layers, n_layers)


@functools.lru_cache(maxsize=64)  # asked on every recall step: computed once per setting
def _spread(skip_layers: float, wanted: int | None, n_layers: int) -> tuple[int, ...]:
    first = min(round(skip_layers * n_layers), n_layers - 1)
    count = min(wanted or n_layers, n_layers - first)
    spread = torch.linspace(first, n_layers - 1, count, device="cpu")
    return tuple(sorted({round(x) for x in spread.tolist()}))


def recall_query(view: View, gen: GenerateOut, params: CacheParams,
                 compiled: str = "") -> RecallQuery | None:
    """Stage 2's recall input for this step, or None (no recall or an empty cold store); it
    scans the cold keys on every ``every``-th step, with the native kernel where the
    model's stage 1 is native (its ``Model.compiled``) and the aggregate is max-max."""
    recall = params.recall
    if not recall or view.cold is None or view.cold.n == 0 or gen.query is None:
        return None
    return RecallQuery(query=gen.query, lse=gen.lse,
                       layers=recall_layers(params, gen.query.shape[0]),
                       signal=read_like_scorer(params, "signal"), aggregate=recall.aggregate,
                       scan=(view.step + 1) % recall.every == 0,
                       native=native.chosen(compiled) and recall.aggregate == "max-max"
                       and view.heads is None)


def recall_signals(view: View, attention: torch.Tensor,
                   recall: RecallQuery) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The signal (n,) each hot slot got and (c,) each cold row would have got from this
    query over the recall layers (None unless the step scans the cold store): attention,
    value-weighted if ``signal`` is value (a cold value's norm relative to the live ones'),
    then ``aggregate``d."""
    layers = _index(recall.layers)
    hot = attention[layers]  # (l, H, n)
    live = view.vnorm[layers] if recall.signal == "value" else None
    if live is not None:
        hot = value_weighted(hot, live)
    if not recall.scan:
        return aggregate(hot, recall.aggregate), None
    most = recall.aggregate == "max-max"
    log_w = None if live is None else relative_norms(view.cold.vnorm[layers], live).log()
    if recall.native:  # max-max in one pass over the cold keys: the same maximum of sums
        return aggregate(hot, recall.aggregate), native.cold_max(view.cold, recall, log_w).exp()
    logits = cold_logits(view.cold, recall, most)  # (l, KVH, G or 1, c) float32: q.k - lse
    if log_w is not None:  # (l, KVH, c)
        logits += log_w[:, :, None]
    if most:  # exp(max) = max(exp): one exp per cold row
        return aggregate(hot, recall.aggregate), logits.amax((0, 1, 2)).exp()
    p = logits.exp().flatten(1, 2)  # (l, H, c)
    return aggregate(hot, recall.aggregate), aggregate(p, recall.aggregate)


def head_signals(view: View, attention: torch.Tensor,
                 recall: RecallQuery) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A per-head cache's signals over the recall layers: what each (layer, KV head)'s query
    heads paid each of its hot slots (l, kv_heads, n) and would have paid each of its cold
    slots (l, kv_heads, c; None unless the step scans), their max or mean as ``aggregate``
    ends, value-weighted by the head's own live values with the ``value`` signal; -inf at
    the slots a head does not hold."""
    layers = _index(recall.layers)
    h, KVH = view.heads, view.heads.n.shape[1]
    hot = by_head(attention[layers], KVH, recall.aggregate)
    cold, cold_weights = view.cold, None
    if recall.signal == "value":  # a scan's cold values too, by the same head means
        if recall.scan:
            weights, cold_weights = head_relative_norms(view, view.vnorm, cold.vnorm)
        else:
            weights = head_relative_norms(view, view.vnorm)
        hot = hot * weights[layers]
    hot = hot.masked_fill(~h.live(hot.shape[-1])[layers], -math.inf)
    if not recall.scan:
        return hot, None
    most = recall.aggregate.endswith("-max")
    logits = cold_logits(cold, recall, most)  # (l, KVH, G or 1, c)
    p = logits[:, :, 0].exp() if most else logits.exp().mean(2)
    if cold_weights is not None:
        p = p * cold_weights[layers]
    return hot, p.masked_fill(~cold.heads.live(p.shape[-1])[layers], -math.inf)


def cold_logits(cold: ColdView, recall: RecallQuery, group_max: bool = False) -> torch.Tensor:
    """q.k - lse (l, kv_heads, group, c) float32 of every cold key for the recall layers'
    query heads, or with ``group_max`` its max over each KV head's group (l, kv_heads, 1,
    c; the same bits as the max taken later, since rounding is monotonic). The products K
    q^T, one batched product per run of consecutive layers over the cold keys as they are
    stored (a slot per row, without a copy: the scan's bytes are the cost), go into one
    buffer; the rest runs once over all of it. K q^T, not q K^T: the faster in both
    dtypes, by far in bfloat16 (one layer at a time there: oneDNN's batched bfloat16
    product is slower over more than one layer's rows)."""
    layers, (KVH, c), (H, D) = recall.layers, cold.k.shape[1:3], recall.query.shape[1:]
    G, l = H // KVH, len(layers)
    products = torch.empty(l * KVH, c, G, dtype=cold.k.dtype, device=cold.k.device)
    one_by_one, at = cold.k.device.type == "cpu" and cold.k.dtype != torch.float32, 0
    for first, last in [(i, i + 1) for i in layers] if one_by_one else _runs(layers):
        n = (last - first) * KVH
        q = recall.query[first:last].reshape(n, G, D)
        k = cold.k[first:last].reshape(n, c, D)  # a view: no copy
        torch.bmm(k, q.transpose(1, 2), out=products[at:at + n])
        at += n
    s = products.view(l, KVH, c, G).float()
    lse = recall.lse[_index(layers)].view(l, KVH, 1, G)
    return _group_max(s, lse)[:, :, None] if group_max else (s - lse).transpose(2, 3)


def _group_max(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """max over the last dimension (a KV head's group, a few wide) of ``s`` - ``lse``: one
    subtraction and maximum per member over whole rows, where a reduction over a dimension
    of 3 contiguous values and the broadcast subtraction before it took twice as long
    (same bits: a maximum is exact)."""
    out = s[..., 0] - lse[..., 0]
    for j in range(1, s.shape[-1]):
        out = torch.maximum(out, s[..., j] - lse[..., j])
    return out


def _index(layers: tuple[int, ...]) -> slice | list[int]:
    """What selects increasing ``layers`` along a tensor's first dimension: a slice (a view)
    when they are one run of consecutive layers, else the list."""
    runs = _runs(layers)
    return slice(*runs[0]) if len(runs) == 1 else list(layers)


def _runs(layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """Increasing ``layers`` as runs of consecutive ones, [first, last + 1) each."""
    runs = []
    for i in layers:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
