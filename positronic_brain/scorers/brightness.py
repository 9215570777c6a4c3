"""Brightness (the default): a per-token value that persists across steps in the ledger.

Its ledger column ``brightness`` (``columns``): new tokens start at their source's seed; each step b <- clamp(b - decay + gain * share, 0, max)
where share is what the new query paid to the token relative to a uniform share of the n live
slots: n times its attention, weighted by the token's value norm (``signal`` value) or not
(``signal`` attention), aggregated over layers/heads, leaving out the first ``skip_layers``
fraction of the layers. Relative to a uniform share, one (decay, gain) pair means the same
at every budget.

Prefill scores (``prefill``): a prompt token's brightness is what the prompt's last W
prefilled queries (stage 0's observation window) give it as W steps of the same rule with
their mean share, from 0 rather than from its seed, and at most its seed:
b = clamp(W (gain share_W - decay), 0, seed). The window has looked at every prompt token,
so none needs the benefit of the doubt a seed gives a token nobody has looked at yet. From
the seed instead (255, the clamp), every token the window or the first step's query attends
a little would stay at the clamp, and the first cull would keep the most recent of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention import aggregate, value_weighted
from ..state import View
from ..types import Column, PrefillStats, ScoreOut


@dataclass(frozen=True)
class Brightness:
    # Prefill scores unless told otherwise: without them every prompt token sits at its seed
    # (the clamp) at the first cull, which then keeps the most recent (docs/BENCHMARKS.md,
    # pass-key retrieval).
    prefill_default: ClassVar[bool] = True
    prefill_total: ClassVar[bool] = False  # its prefill reads only the window
    decay: float
    gain: float
    max_brightness: float
    aggregate: str
    signal: str
    skip_layers: float
    seeds: tuple[float, ...]

    @property
    def columns(self) -> dict[str, Column]:
        return self.declared(self.seeds, self.max_brightness)

    @staticmethod
    def declared(seeds: tuple[float, ...], top: float) -> dict[str, Column]:
        """Its one column: born at the source's seed, a merged pair's max, a recalled
        token's seed again (it re-enters as a new token would), within [0, ``top``]."""
        return {"brightness": Column(birth=tuple(seeds), merge="max", recall="birth",
                                     low=0.0, high=top)}

    def share(self, view: View, attention: torch.Tensor) -> torch.Tensor:
        """Attention (L, H, n) -> each slot's share (n,), 1 = a uniform share of the n live
        slots: the layers past ``skip_layers``, value-weighted with ``signal`` value."""
        first = min(round(self.skip_layers * attention.shape[0]), attention.shape[0] - 1)
        attention = attention[first:]  # (L - first, H, n)
        if self.signal == "value":
            attention = value_weighted(attention, view.vnorm[first:])
        return view.n * aggregate(attention, self.aggregate)

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        b = (view.columns["brightness"] - self.decay + self.gain * self.share(view, attention)).clamp(
            0.0, self.max_brightness)
        return ScoreOut(scores=b, columns={"brightness": b})

    def prefill(self, view: View, stats: PrefillStats) -> ScoreOut:
        """The window's W queries as W steps from 0, each paying the window's mean attention;
        at most the token's seed (its brightness at the prime)."""
        w = stats.window_queries
        lit = w * (self.gain * self.share(view, stats.window) - self.decay)
        b = torch.minimum(lit.clamp(min=0.0), view.columns["brightness"])
        return ScoreOut(scores=b, columns={"brightness": b})
