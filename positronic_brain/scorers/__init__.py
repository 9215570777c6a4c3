"""Stage-2 scorers: one small file each, same signature, higher score = keep.

A scorer is a frozen dataclass whose fields are its hyperparameters (named as in
``CacheParams``) with one method ``score(view, attention) -> ScoreOut``. Per-token state
that persists across steps (brightness, attn_sum) lives in the mirror: a scorer returns
the new values and stage 4 writes them.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Protocol

import torch

from ..state import View
from ..types import POLICIES, CacheParams, ScoreOut


class Scorer(Protocol):
    def score(self, view: View, attention: torch.Tensor) -> ScoreOut: ...


def aggregate(attention: torch.Tensor, how: str) -> torch.Tensor:
    """Attention (L, H, n) -> (n,): ``{all|last}-{mean|max}`` = over all layers (mean) or the
    last layer only, then the head mean or max."""
    layers, heads = how.split("-")
    a = attention[-1:] if layers == "last" else attention  # (L', H, n)
    a = a.amax(1) if heads == "max" else a.mean(1)  # (L', n)
    return a.mean(0)


def value_weighted(attention: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Attention (L, H, n) times each slot's value norm (``View.vnorm``) relative to the mean
    live norm of its layer and KV head, as in value-aware token pruning (Guo et al., 2024): a
    slot whose value is small moves the attention output little, however much attention it
    gets (the attention sinks are the usual case)."""
    w = norms / norms.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    L, H, n = attention.shape
    kvh = norms.shape[1]  # the heads of one KV group share its values (GQA)
    return (attention.reshape(L, kvh, H // kvh, n) * w[:, :, None]).reshape(L, H, n)


from .brightness import Brightness  # noqa: E402
from .h2o import H2O  # noqa: E402
from .none import NoScore  # noqa: E402
from .random import RandomScore  # noqa: E402
from .streaming import Streaming  # noqa: E402
from .tova import TOVA  # noqa: E402

SCORERS = {"brightness": Brightness, "streaming": Streaming, "h2o": H2O, "tova": TOVA,
           "random": RandomScore, "none": NoScore}
assert tuple(SCORERS) == POLICIES


def make_scorer(params: CacheParams) -> Scorer:
    """The scorer ``params.policy`` with its hyperparameters taken from ``params``."""
    cls = SCORERS[params.policy]
    return cls(**{f.name: getattr(params, f.name) for f in fields(cls)})
