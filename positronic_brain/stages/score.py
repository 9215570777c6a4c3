"""Stage 2: score every live slot (read-only). Higher = keep.

The scorer (``positronic_brain.scorers``) maps the view and the attention the pending
token paid to each live slot to scores, plus the new values of its persistent per-token
columns (brightness, attn_sum) for stage 4 to write.

With recall, on every ``recall_every``-th step, the same query also scores the cold
store's keys, exactly as the attention they would have received next to the hot ones,
exp(q.k - lse) with stage 1's log-sum-exp, over ``recall_layers`` layers; hot and cold
tokens get one signal each, aggregated alike, for stage 3 to compare.
"""
from __future__ import annotations

import dataclasses

import torch

from ..scorers import Scorer
from ..scorers.attention import aggregate, value_weighted
from ..state import View
from ..types import CacheParams, GenerateOut, RecallQuery, ScoreOut


def recall_layers(params: CacheParams, n_layers: int) -> tuple[int, ...]:
    """``recall_layers`` layers spread evenly over those brightness reads (all but the first
    ``skip_layers`` fraction), or all of them (None)."""
    first = min(round(params.skip_layers * n_layers), n_layers - 1)
    count = min(params.recall_layers or n_layers, n_layers - first)
    spread = torch.linspace(first, n_layers - 1, count, device="cpu")
    return tuple(sorted({round(x) for x in spread.tolist()}))


def recall_query(view: View, gen: GenerateOut, params: CacheParams) -> RecallQuery | None:
    """Stage 2's recall input for this step, or None (no recall, an empty cold store, or not
    a ``recall_every``-th step)."""
    if (not params.recall or view.cold is None or view.cold.n == 0 or gen.query is None
            or (view.step + 1) % params.recall_every):
        return None
    return RecallQuery(query=gen.query, lse=gen.lse,
                       layers=recall_layers(params, gen.query.shape[0]),
                       signal=params.signal, aggregate=params.recall_aggregate)


def recall_signals(view: View, attention: torch.Tensor,
                   recall: RecallQuery) -> tuple[torch.Tensor, torch.Tensor]:
    """The signal (n,) each hot slot got and (c,) each cold row would have got from this
    query over the recall layers: attention, value-weighted if ``signal`` is value (a cold
    value's norm relative to the live ones'), then ``aggregate``d."""
    cold, layers = view.cold, list(recall.layers)
    KVH, c = cold.k.shape[1], cold.n
    H, D = recall.query.shape[1:]
    p = torch.empty(len(layers), H, c, device=recall.query.device)
    for j, i in enumerate(layers):  # one layer at a time: no copy of the strided cold keys
        s = torch.matmul(recall.query[i].view(KVH, H // KVH, D), cold.k[i].transpose(1, 2))
        p[j] = (s.float().view(H, c) - recall.lse[i].unsqueeze(-1)).exp()
    hot = attention[layers]  # (l, H, n)
    if recall.signal == "value":
        live = view.vnorm[layers]
        hot, p = value_weighted(hot, live), value_weighted(p, cold.vnorm[layers], live)
    return aggregate(hot, recall.aggregate), aggregate(p, recall.aggregate)


def score(view: View, attention: torch.Tensor, scorer: Scorer,
          recall: RecallQuery | None = None) -> ScoreOut:
    """``attention`` (L, H, n) float32 from stage 1 -> ScoreOut with (n,) float32 tensors;
    with ``recall`` (``recall_query``) also the hot and cold signals."""
    assert attention.shape[-1] == view.n, f"attention over {attention.shape[-1]} slots, not {view.n}"
    out = scorer.score(view, attention)
    for name in ("scores", "brightness", "attn_sum"):
        t = getattr(out, name)
        assert t is None or t.shape == (view.n,), f"{name} has shape {tuple(t.shape)}"
    if recall is not None:
        hot, cold = recall_signals(view, attention, recall)
        out = dataclasses.replace(out, hot_signal=hot, cold_signal=cold)
    return out
