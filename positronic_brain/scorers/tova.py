"""TOVA (Oren et al., 2024): keep the tokens the current query attends to most.

Prefill scores: none taken. TOVA keeps no per-token state, and its first step's query is
already the prompt's last token (the pending one), which sees the whole prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import aggregate, aggregation, by_head, check_aggregation
from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class TOVA:
    aggregate: str = aggregation()

    def __post_init__(self) -> None:
        check_aggregation(self.aggregate)

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        return ScoreOut(scores=aggregate(attention, self.aggregate))

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head (a per-head allocation): each (layer, KV head) scores its own slots by
        what its query heads paid them this step, their mean or (``aggregate`` ending in
        ``-max``) their max; (L, H, n) -> (L, KVH, n)."""
        return ScoreOut(scores=by_head(attention, view.heads.n.shape[1], self.aggregate))
