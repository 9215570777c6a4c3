"""Key norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV
Cache Compression"; kvpress's KnormPress): keep the tokens whose keys have the lowest L2
norm, which the paper finds go with the highest attention. It reads no attention and keeps
no state: the arena's key norms (``View.knorm``, written with each key) are the score.

Whole tokens: minus the mean over every (layer, KV head) of the token's key norm relative
to that head's mean over its live slots, so that every head weighs alike whatever the scale
of its keys. Per head (a per-head allocation): minus each slot's norm relative to its own
head's mean, so each head keeps its own lowest norms, as kvpress's press does, and an
allocation that shares a layer's places among its heads by score (adaptive) does not give
them to the head whose keys are the shortest on the whole.

Prefill scores: none taken; every key's norm is known from the moment it is written.

With recall it keeps little of what it brings back: a token culled for its long key comes
back with it, is ranked low again, and the next step's cull or swap tends to send it cold.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import head_relative_norms, relative_norms
from ..state import View
from ..types import ScoreOut


@dataclass(frozen=True)
class KeyNorm:
    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        return ScoreOut(scores=-relative_norms(view.knorm).mean((0, 1)))

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head: each slot's norm relative to its head's live slots' mean, (L, KVH, n)
        (a free slot's score is never read)."""
        return ScoreOut(scores=-head_relative_norms(view, view.knorm))
