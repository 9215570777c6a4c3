"""Random scores: the floor any policy must beat. Seeded by (random_seed, step), so reproducible.

Prefill scores: none taken (it reads no attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import View
from ..types import ScoreOut, option


@dataclass(frozen=True)
class RandomScore:
    random_seed: int = option(0, "the random scorer's seed")

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        g = torch.Generator().manual_seed(self.random_seed * 1_000_003 + view.step)
        # drawn on the CPU: the same scores on every device
        return ScoreOut(scores=torch.rand(view.n, generator=g, device="cpu").to(view.uid.device))

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head: each (layer, KV head, slot) its own draw, (L, KVH, n)."""
        g = torch.Generator().manual_seed(self.random_seed * 1_000_003 + view.step)
        shape = tuple(view.heads.row.shape)
        return ScoreOut(scores=torch.rand(shape, generator=g, device="cpu").to(view.uid.device))
