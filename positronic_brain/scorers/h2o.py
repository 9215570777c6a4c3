"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention.

The sum of the attention each token received since it was born (its ledger column
``attn_sum``: 0 at birth and for a merged pair's new token; a recalled token's is the
attention it beat a hot token with times the queries since it was born), divided
by the number of queries that could attend to it, so old tokens are not favoured for age.

Prefill scores (``prefill``): a prompt token's ``attn_sum`` starts at the mean attention the
prefilled queries after it paid it (stage 0's ``total`` over ``queries``: H2O's score had it
run through the prompt), so the prompt's queries count as one: the first step weighs their
view and its own query alike, and a token born later is not outweighed by the prompt's
many queries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention import aggregate, aggregation, by_head, check_aggregation, head_column
from ..state import View
from ..types import Column, PrefillStats, ScoreOut


@dataclass(frozen=True)
class H2O:
    # No prefill scores unless told: the prompt's accumulated attention favours what the
    # filler attends to, while the first step's query (the question) finds what matters
    # (docs/BENCHMARKS.md, pass-key retrieval).
    prefill_default: ClassVar[bool] = False
    prefill_total: ClassVar[bool] = True  # its prefill reads ``total``
    columns: ClassVar[dict[str, Column]] = {
        "attn_sum": Column(birth=0.0, merge="birth", recall="signal", low=0.0)}
    aggregate: str = aggregation()

    def __post_init__(self) -> None:
        check_aggregation(self.aggregate)

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        total = view.columns["attn_sum"] + aggregate(attention, self.aggregate)  # (n,)
        queries = (view.step - view.born_step + 1).clamp(min=1).float()  # (n,) incl. this one
        return ScoreOut(scores=total / queries, columns={"attn_sum": total})

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head (a per-head allocation): each (layer, KV head) sums the attention its
        query heads paid each of its slots (their mean, or max with a ``-max`` aggregate)
        into its own ``attn_sum`` of the slot's token, the column then one value a
        (layer, KV head): (L, H, n) -> scores (L, KVH, n), ``attn_sum`` (tokens, L, KVH)."""
        paid = by_head(attention, view.heads.n.shape[1], self.aggregate)  # (L, KVH, n)
        summed, put = head_column(view, "attn_sum")
        total = summed + paid
        born = view.born_step[view.heads.row.clamp(min=0)]
        queries = (view.step - born + 1).clamp(min=1).float()
        return ScoreOut(scores=total / queries,
                        columns={"attn_sum": put(total)})

    def prefill(self, view: View, stats: PrefillStats) -> ScoreOut:
        """The prompt's mean attention per later query, as one query's worth."""
        mean = aggregate(stats.total, self.aggregate) / stats.queries.clamp(min=1)
        return ScoreOut(scores=mean, columns={"attn_sum": view.columns["attn_sum"] + mean})

    def prefill_heads(self, view: View, stats: PrefillStats) -> ScoreOut:
        """Per head: what each (layer, KV head)'s query heads paid each prompt token, per
        later query (every head holds every prompt token: slot i is row i)."""
        paid = by_head(stats.total, view.heads.n.shape[1], self.aggregate)  # (L, KVH, n)
        mean = (paid / stats.queries.clamp(min=1)).permute(2, 0, 1)  # (n, L, KVH)
        return ScoreOut(scores=paid, columns={"attn_sum": view.columns["attn_sum"] + mean})
