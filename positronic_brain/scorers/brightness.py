"""Brightness (the default): a per-token value that persists across steps in the mirror.

New tokens start at their source's seed; each step b <- clamp(b - decay + gain * a, 0, max)
where a is the attention the new query paid to the token (aggregated over layers/heads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import aggregate
from ..state import View
from ..types import CacheParams, ScoreOut


@dataclass(frozen=True)
class Brightness:
    decay: float = CacheParams.decay
    gain: float = CacheParams.gain
    max_brightness: float = CacheParams.max_brightness
    aggregate: str = CacheParams.aggregate

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        b = view.brightness - self.decay + self.gain * aggregate(attention, self.aggregate)
        b = b.clamp(0.0, self.max_brightness)  # (n,)
        return ScoreOut(scores=b, brightness=b)
