"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"; kvpress's
KeyDiffPress): keep the tokens whose keys point away from the others'. Each (layer, KV head)
takes the mean of its live keys' unit vectors (the anchor); a key's score is minus its cosine
to the anchor, so the keys most unlike the rest are kept. It reads no attention and keeps no
state: the arena's keys and their norms (``View.knorm``) are the score, this step's.

A key that stands apart is one that no other token's key stands in for: a number, a name or
a word that appears once in a long text. In RULER's haystacks that is the needle
(docs/BENCHMARKS.md, RULER: whole tokens keep most of the needle's tokens at a quarter of the
context, with no pass over the prompt besides its prefill).

Whole tokens: minus the mean over every (layer, KV head) of the cosine, so every head weighs
alike. Per head (a per-head allocation): minus each slot's cosine to the anchor of its own
head's live slots, so each head keeps its own most distinct keys, as kvpress's press does.

Prefill scores: none taken; every key is known from the moment it is written, and the first
cull after a prime scores the whole prompt as kvpress's press compresses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import View
from ..types import ScoreOut


CHUNK_BYTES = 1 << 27  # the most float32 key bytes one pass copies (128 MiB)


def cosines(view: View, live: torch.Tensor | None = None) -> torch.Tensor:
    """Each slot's key's cosine to its (layer, KV head)'s anchor, the mean unit key over
    the live slots (``live``: (L, kv_heads, n) bool, the slots each head holds; None: all),
    (L, kv_heads, n) float32. A zero key (norm 0) counts as no direction and scores 0. A
    run of layers at a time, each where its block of a split arena lives, so that the keys'
    float32 copy stays within ``CHUNK_BYTES`` (all of a small model's layers at once)."""
    blocks = (view.k,) if isinstance(view.k, torch.Tensor) else view.k
    out, first = [], 0
    for k in blocks:
        step = max(1, CHUNK_BYTES // max(4 * k[0].numel(), 1))
        for i in range(0, k.shape[0], step):
            at = slice(first + i, first + min(i + step, k.shape[0]))
            out.append(_run(k[i:i + step], view.knorm[at].to(k.device),
                            None if live is None else live[at].to(k.device)
                            ).to(view.knorm.device))
        first += k.shape[0]
    return out[0] if len(out) == 1 else torch.cat(out)


def _run(k: torch.Tensor, knorm: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``cosines`` of a run of layers' keys ``k`` (l, kv_heads, n, head_dim) on one device,
    their norms ``knorm`` (l, kv_heads, n)."""
    tiny = torch.finfo(torch.float32).tiny
    inv = 1.0 / knorm.clamp_min(tiny)  # (L, KVH, n)
    count = inv.shape[-1]
    if live is not None:  # a free slot weighs nothing
        inv, count = inv * live, live.sum(-1, keepdim=True).clamp_min(1)
    k = k.float()  # (L, KVH, n, D)
    anchor = (inv.unsqueeze(-2) @ k).squeeze(-2) / count  # (L, KVH, D): mean unit key
    dots = (k @ anchor.unsqueeze(-1)).squeeze(-1)  # (L, KVH, n)
    norm = anchor.norm(dim=-1, keepdim=True).clamp_min(tiny)
    return dots * inv / norm


@dataclass(frozen=True)
class KeyDiff:
    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        return ScoreOut(scores=-cosines(view).mean((0, 1)))

    def score_heads(self, view: View, attention: torch.Tensor) -> ScoreOut:
        """Per head: each slot's cosine to its own head's anchor, (L, KVH, n) (a free slot's
        score is never read)."""
        return ScoreOut(scores=-cosines(view, view.heads.live(view.knorm.shape[-1])))
