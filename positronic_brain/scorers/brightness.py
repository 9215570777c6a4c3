"""Brightness (the default): a per-token value that persists across steps in the ledger.

New tokens start at their source's seed; each step b <- clamp(b - decay + gain * share, 0, max)
where share is what the new query paid to the token relative to a uniform share of the n live
slots: n times its attention, weighted by the token's value norm (``signal`` value) or not
(``signal`` attention), aggregated over layers/heads, leaving out the first ``skip_layers``
fraction of the layers. Relative to a uniform share, one (decay, gain) pair means the same
at every budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import aggregate, value_weighted
from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class Brightness:
    decay: float
    gain: float
    max_brightness: float
    aggregate: str
    signal: str
    skip_layers: float

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        first = min(round(self.skip_layers * attention.shape[0]), attention.shape[0] - 1)
        attention = attention[first:]  # (L - first, H, n)
        if self.signal == "value":
            attention = value_weighted(attention, view.vnorm[first:])
        share = view.n * aggregate(attention, self.aggregate)  # (n,) 1 = a uniform share
        b = (view.brightness - self.decay + self.gain * share).clamp(0.0, self.max_brightness)
        return ScoreOut(scores=b, brightness=b)
