"""StreamingLLM (Xiao et al., 2023): keep the first ``sinks`` tokens and the most recent.

Prefill scores: none taken; it keeps by position, whatever the attention.

With recall it keeps nothing it brings back: a swap replaces the hot slot ranked lowest, and a
recalled token, which keeps its position, is older than every hot token but the sinks, so
the next step's cull or swap sends it cold again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class Streaming:
    sinks: int  # CacheParams.sinks

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        s = view.position.float()  # (n,) later = higher
        first = torch.argsort(view.position)[: self.sinks]
        return ScoreOut(scores=s.index_fill(0, first, float("inf")))

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head: each slot scored as its token, (L, KVH, n) (every head keeps the same
        sinks and recent tokens)."""
        return ScoreOut(scores=self.score(view, attention).scores[view.heads.row.clamp(min=0)])
