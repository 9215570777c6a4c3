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

Per head (a per-head allocation: ``score_heads``, ``prefill_heads``): the same rule with a
brightness per (layer, KV head) of each token, its share what that head's query heads paid
the slot relative to a uniform share of the head's own live slots, value-weighted by the
head's own mean; every layer scores its own heads (``skip_layers`` is for whole tokens,
which every layer keeps alike). Seeded per head from the window, with each slot's share
the largest of its ``pool`` neighbours', this is SnapKV's choice (its observation window
and its clustering pool): each head keeps what its own view of the prompt's last queries
attended, and the span around it: without the pool, a head that attended to two digits of a
five-digit pass key let the other three go (docs/BENCHMARKS.md, per-head allocations).
With ``shrink`` s, a slot's share is first moved s of the way to its token's mean share over
the heads that hold it: between each head alone (0) and the heads agreeing (1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .attention import (aggregate, aggregation, by_head, check_aggregation, head_column,
                        head_index, head_relative_norms, max_pooled, value_weighted)
from ..state import View
from ..types import SIGNALS, SOURCES, Column, PrefillStats, ScoreOut, option, require


@dataclass(frozen=True)
class Brightness:
    # Prefill scores unless told otherwise: without them every prompt token sits at its seed
    # (the clamp) at the first cull, which then keeps the most recent (docs/BENCHMARKS.md,
    # pass-key retrieval).
    prefill_default: ClassVar[bool] = True
    prefill_total: ClassVar[bool] = False  # its prefill reads only the window
    decay: float = option(0.5, "brightness lost per step")
    gain: float = option(2.34, "brightness per uniform share of attention (n x attention)")
    max_brightness: float = option(255.0, "the brightness a token can reach, in (0, 255]")
    aggregate: str = aggregation()
    signal: str = option("value", "what brightness gains from (value: attention x value norm "
                         "/ mean value norm)", choices=SIGNALS)
    skip_layers: float = option(0.2, "the fraction of the first layers brightness leaves out")
    pool: int = option(7, "a prompt token's seed the largest of this many around it, as "
                       "SnapKV clusters its scores (odd; 1: its own; brightness: per head only)")
    shrink: float = option(0.0, "per head: each slot's share moved this fraction of the way "
                           "to its token's mean share over the heads that hold it (0: none)")
    seeds: tuple[float, ...] | None = option(
        None, f"a new token's brightness by its source ({':'.join(SOURCES)}; default: the max)")

    def __post_init__(self) -> None:
        for name in ("decay", "gain"):
            v = getattr(self, name)
            require(math.isfinite(v) and v >= 0, f"{name} must be >= 0, got {v}")
        require(math.isfinite(self.max_brightness) and 0 < self.max_brightness <= 255,
                f"max brightness must be in (0, 255], got {self.max_brightness}")
        require(self.signal in SIGNALS, f"signal must be one of {', '.join(SIGNALS)}, "
                f"got {self.signal!r}")
        check_aggregation(self.aggregate)
        require(0 <= self.skip_layers < 1,
                f"skip layers must be a fraction in [0, 1), got {self.skip_layers}")
        require(math.isfinite(self.shrink) and 0 <= self.shrink <= 1,
                f"shrink must be in [0, 1], got {self.shrink}")
        require(self.pool >= 1 and self.pool % 2 == 1,
                f"pool must be an odd number of slots >= 1, got {self.pool}")
        if self.seeds is None:
            object.__setattr__(self, "seeds", (float(self.max_brightness),) * len(SOURCES))
        require(len(self.seeds) == len(SOURCES)
                and all(0 <= s <= self.max_brightness for s in self.seeds),
                f"seeds must be {len(SOURCES)} values in [0, max brightness]")

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

    def head_share(self, view: View, attention: torch.Tensor) -> torch.Tensor:
        """Attention (L, H, n) over a per-head view's slots -> each slot's share of its head
        (L, KVH, n), 1 = a uniform share of the head's live slots, value-weighted with
        ``signal`` value."""
        h = view.heads
        L, H, n = attention.shape
        kvh = h.n.shape[1]
        if self.signal == "value":
            w = head_relative_norms(view, view.vnorm)
            attention = (attention.view(L, kvh, H // kvh, n) * w[:, :, None]).view(L, H, n)
        share = h.n.unsqueeze(-1) * by_head(attention, kvh, self.aggregate)
        return share if not self.shrink else self._shrunk(view, share)

    def _shrunk(self, view: View, share: torch.Tensor) -> torch.Tensor:
        """``share`` (L, KVH, width) moved ``shrink`` of the way to each token's mean share
        over the (layer, KV head)s that hold it: one head's view of a token is noisy, and
        the heads together see it as whole-token eviction does."""
        L, KVH, width = share.shape
        rows = view.heads.row[:, :, :width]
        held = rows >= 0
        at = head_index(view)[:, :, :width].reshape(-1)  # in a (tokens, L, KVH) table

        def over_heads(x: torch.Tensor) -> torch.Tensor:  # (L, KVH, width) -> (tokens,)
            # a head holds a token at most once, so the scatter adds nothing (a free slot's
            # goes one past the end, dropped), and the sum runs in a fixed order on each
            # device, where an index_add's on a GPU is its atomics'
            table = x.new_zeros(view.n * L * KVH + 1).scatter(0, at, x.reshape(-1))
            return table[:-1].view(view.n, L * KVH).sum(1)

        mean = over_heads(share) / over_heads(held.to(share.dtype)).clamp(min=1)
        return torch.where(held, torch.lerp(share, mean[rows.clamp(min=0)], self.shrink), share)

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """The rule per (layer, KV head): (L, H, n) -> scores (L, KVH, n), the column
        (tokens, L, KVH)."""
        held, put = head_column(view, "brightness")
        b = (held - self.decay
             + self.gain * self.head_share(view, attention)).clamp(0.0, self.max_brightness)
        return ScoreOut(scores=b, columns={"brightness": put(b)})

    def prefill_heads(self, view: View, stats: PrefillStats) -> ScoreOut:
        """The window per (layer, KV head), as ``prefill`` (every head holds every prompt
        token: slot i is row i), each slot's share the largest of the ``pool`` around it:
        a head that attends to part of a span (a number's digits) keeps all of it."""
        w = stats.window_queries
        share = self.head_share(view, stats.window)  # (L, KVH, n)
        share = max_pooled(share, self.pool)  # a slot lit as its brightest neighbour
        lit = w * (self.gain * share - self.decay)
        b = torch.minimum(lit.clamp(min=0.0), head_column(view, "brightness")[0])
        return ScoreOut(scores=b, columns={"brightness": b.permute(2, 0, 1).contiguous()})

    def prefill(self, view: View, stats: PrefillStats) -> ScoreOut:
        """The window's W queries as W steps from 0, each paying the window's mean attention;
        at most the token's seed (its brightness at the prime)."""
        w = stats.window_queries
        lit = w * (self.gain * self.share(view, stats.window) - self.decay)
        b = torch.minimum(lit.clamp(min=0.0), view.columns["brightness"])
        return ScoreOut(scores=b, columns={"brightness": b})
