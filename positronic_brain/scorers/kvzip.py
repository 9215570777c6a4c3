"""KVzip (Kim et al., 2025): keep what the model needs to reconstruct the prompt.

Prefill scores (on by default for a prompt longer than the budget, as brightness's): stage 0
also runs the prompt's reconstruction, read-only (``stages.apply.prefill.reconstruction``:
the prompt copied after a repeat instruction, teacher-forced), and a prompt token's column
``kvzip`` starts at the most attention any copy query paid it, over layers and heads
(``aggregate``, the max of both by default, as KVzip takes the max over its queries and a
KV head's query group), then the largest of the ``pool`` tokens around it: a span the model
reads from one place (a number's digits) is kept whole. The copy tells apart what the
model can only copy by reading it (a number, a name: one query's whole attention in some
head) from text it could regenerate or that repeats (its attention shared among the
occurrences), which a window of the prompt's last queries does not: that window sees what
the end of the prompt attends to, not what a later question will.

After the prime (and for tokens born later), a token's column is the most attention any
step's query has paid it, the same measure as the copy's: ``score`` keeps the larger. A
token recall brings back takes the column's largest value (``Column`` recall ``top``): that
measure never decays, so with the value it went cold with it would be the dimmest hot token
and the next swap would send it cold again (docs/BENCHMARKS.md, RULER).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention import (aggregate, aggregation, by_head, check_aggregation, head_column,
                        max_pooled)
from ..state import View
from ..types import Column, PrefillStats, ScoreOut, option, require


@dataclass(frozen=True)
class KVzip:
    prefill_default: ClassVar[bool] = True
    prefill_total: ClassVar[bool] = False  # its prefill reads the reconstruction only
    prefill_copy: ClassVar[bool] = True
    columns: ClassVar[dict[str, Column]] = {
        "kvzip": Column(birth=0.0, merge="max", recall="top", low=0.0)}
    aggregate: str = aggregation("max-max")
    pool: int = option(31, "a prompt token's seed the largest of this many around it, as "
                       "SnapKV clusters its scores (odd; 1: its own)")

    def __post_init__(self) -> None:
        check_aggregation(self.aggregate)
        require(isinstance(self.pool, int) and self.pool >= 1 and self.pool % 2 == 1,
                f"kvzip's pool must be an odd number >= 1, got {self.pool!r}")

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        most = torch.maximum(view.columns["kvzip"], aggregate(attention, self.aggregate))
        return ScoreOut(scores=most, columns={"kvzip": most})

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head: each (layer, KV head) keeps the most its query heads (their max, or
        their mean with an ``-mean`` aggregate) have paid each of its slots."""
        paid = by_head(attention, view.heads.n.shape[1], self.aggregate)  # (L, KVH, n)
        held, put = head_column(view, "kvzip")
        most = torch.maximum(held, paid)
        return ScoreOut(scores=most, columns={"kvzip": put(most)})

    def prefill(self, view: View, stats: PrefillStats) -> ScoreOut:
        """The reconstruction's most, over layers and heads, pooled (slot i is prompt token
        i at the prime)."""
        seed = torch.maximum(view.columns["kvzip"],
                             max_pooled(aggregate(stats.copy, self.aggregate), self.pool))
        return ScoreOut(scores=seed, columns={"kvzip": seed})

    def prefill_heads(self, view: View, stats: PrefillStats) -> ScoreOut:
        """Per head: each (layer, KV head)'s own most over its query heads, pooled (every
        head holds every prompt token: slot i is row i)."""
        paid = max_pooled(by_head(stats.copy, view.heads.n.shape[1], self.aggregate), self.pool)
        seed = torch.maximum(head_column(view, "kvzip")[0], paid)  # (L, KVH, n)
        return ScoreOut(scores=seed, columns={"kvzip": seed.permute(2, 0, 1).contiguous()})
