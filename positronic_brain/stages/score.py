"""Stage 2: score every live slot (read-only). Higher = keep.

The scorer (``positronic_brain.scorers``) maps the view and the attention the pending
token paid to each live slot to scores, plus the new values of its persistent per-token
columns (brightness, attn_sum) for stage 4 to write.
"""
from __future__ import annotations

import torch

from ..scorers import Scorer
from ..state import View
from ..types import ScoreOut


def score(view: View, attention: torch.Tensor, scorer: Scorer) -> ScoreOut:
    """``attention`` (L, H, n) float32 from stage 1 -> ScoreOut with (n,) float32 tensors."""
    assert attention.shape[-1] == view.n, f"attention over {attention.shape[-1]} slots, not {view.n}"
    out = scorer.score(view, attention)
    for name in ("scores", "brightness", "attn_sum"):
        t = getattr(out, name)
        assert t is None or t.shape == (view.n,), f"{name} has shape {tuple(t.shape)}"
    return out
