"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention.

The sum of the attention each token received since it was born (a ledger column), divided
by the number of queries that could attend to it, so old tokens are not favoured for age.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import aggregate
from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class H2O:
    aggregate: str

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        total = view.attn_sum + aggregate(attention, self.aggregate)  # (n,)
        queries = (view.step - view.born_step + 1).clamp(min=1).float()  # (n,) incl. this one
        return ScoreOut(scores=total / queries, attn_sum=total)
