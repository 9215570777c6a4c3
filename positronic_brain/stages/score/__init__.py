"""Stage 2: score every live slot (read-only). Higher = keep.

The scorer (``positronic_brain.scorers``) maps the view and the attention the pending
token paid to each live slot to scores, plus the new values of its own per-token ledger
columns (``ScoreOut.columns``) for stage 4 to write. With recall, ``recall_query`` (its part
of this stage: ``recall.py``) adds the hot and cold signals stage 3 compares.
"""
from __future__ import annotations

import dataclasses

import torch

from ...scorers import Scorer
from ...state import View
from ...types import RecallQuery, ScoreOut
from .recall import (cold_logits, head_signals, read_like_scorer, recall_layers, recall_query,
                     recall_signals)

__all__ = ["cold_logits", "read_like_scorer", "recall_layers", "recall_query", "recall_signals",
           "score"]


def score(view: View, attention: torch.Tensor, scorer: Scorer,
          recall: RecallQuery | None = None) -> ScoreOut:
    """``attention`` (L, H, n) float32 from stage 1 -> ScoreOut with (n,) float32 tensors;
    with ``recall`` (``recall_query``) also the hot and cold signals. A per-head cache's
    (``view.heads``) attention is over each head's slots, and its scorer's ``score_heads``
    scores them (L, kv_heads, n); its columns stay one value a token."""
    if view.heads is not None:
        out = scorer.score_heads(view, attention)
        assert out.scores.shape == view.heads.row.shape, \
            f"per-head scores have shape {tuple(out.scores.shape)}"
        for name, t in (out.columns or {}).items():
            assert name in view.columns and t.shape == view.columns[name].shape, \
                f"{name} has shape {tuple(t.shape)}"
        if recall is not None:
            hot, cold = head_signals(view, attention, recall)
            out = dataclasses.replace(out, hot_signal=hot, cold_signal=cold)
        return out
    assert attention.shape[-1] == view.n, f"attention over {attention.shape[-1]} slots, not {view.n}"
    out = scorer.score(view, attention)
    for name, t in {"scores": out.scores, **(out.columns or {})}.items():
        assert name == "scores" or name in view.columns, f"{name} is not a column of the ledger"
        assert t.shape == (view.n,), f"{name} has shape {tuple(t.shape)}"
    if recall is not None:
        hot, cold = recall_signals(view, attention, recall)
        out = dataclasses.replace(out, hot_signal=hot, cold_signal=cold)
    return out
