"""No scoring: every token scores 0 (used without a budget, when nothing is culled).

Prefill scores: none taken.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class NoScore:
    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        return ScoreOut(scores=torch.zeros(view.n, device=view.uid.device))
