"""Key norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV
Cache Compression"; kvpress's KnormPress): keep the tokens whose keys have the lowest L2
norm, which the paper finds go with the highest attention. It reads no attention and keeps
no state: the arena's key norms (``View.knorm``, written with each key) are the score.

Whole tokens: minus the mean over every (layer, KV head) of the token's key norm relative
to that head's mean over its live slots, so that every head weighs alike whatever the scale
of its keys. Per head (a per-head allocation): each (layer, KV head) keeps its own lowest
norms, as kvpress's press does.

Prefill scores: none taken; every key's norm is known from the moment it is written.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class KeyNorm:
    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        norms = view.knorm  # (L, KVH, n)
        mean = norms.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return ScoreOut(scores=-(norms / mean).mean((0, 1)))

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head: each (layer, KV head) ranks its own slots, (L, KVH, n)."""
        return ScoreOut(scores=-view.knorm)
