"""Shared types: configuration, stage inputs/outputs, errors.

Everything that crosses a stage boundary is defined here, as frozen dataclasses
holding tensors and plain Python values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Provenance of a cached token (the mirror stores the index into this tuple).
SOURCES = ("system", "user", "assistant", "tool")


class UserError(ValueError):
    """Bad input from a user: the CLI prints it on one line and exits 2."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


@dataclass(frozen=True)
class SamplerParams:
    """Sampling rule applied to one row of logits.

    Order (as in Hugging Face `generate`): repetition penalty, temperature,
    top-k, top-p, min-p. `greedy` (or temperature 0) takes the argmax.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0
    report_top: int = 5  # how many alternatives the sampler reports

    def __post_init__(self) -> None:
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be >= 0, got {self.temperature}")
        require(self.top_k >= 0, f"top-k must be >= 0, got {self.top_k}")
        require(0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p < 1, f"min-p must be in [0, 1), got {self.min_p}")
        require(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition penalty must be > 0, got {self.repetition_penalty}")
        require(self.report_top >= 1, f"report_top must be >= 1, got {self.report_top}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass(frozen=True)
class Segment:
    """A run of prompt token ids with one source (what the special-token policy emits)."""

    ids: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        require(self.source in SOURCES, f"unknown source {self.source!r}; expected one of {SOURCES}")


@dataclass(frozen=True)
class ForwardOut:
    """Output of the read-only manual forward of T new tokens over n live slots."""

    logits: torch.Tensor  # (T', V) float32; T' = T or 1 (last row only)
    k: torch.Tensor  # (L, kv_heads, T, head_dim) new keys, RoPE applied at their positions
    v: torch.Tensor  # (L, kv_heads, T, head_dim)
    attention: torch.Tensor | None  # (L, heads, n) float32: last new query's weights on live slots


@dataclass(frozen=True)
class SamplerReport:
    token_id: int
    top_ids: tuple[int, ...]  # most likely after the sampling rule's processing, best first
    top_probs: tuple[float, ...]


@dataclass(frozen=True)
class GenerateOut:
    """Stage 1 output: everything stage 4 needs to append the pending token."""

    input_token: int  # the pending token that was run
    position: int  # its position
    logits: torch.Tensor  # (V,) float32, raw model logits
    token_id: int  # the sampled next token (the new pending token)
    report: SamplerReport
    k: torch.Tensor  # (L, kv_heads, 1, head_dim)
    v: torch.Tensor  # (L, kv_heads, 1, head_dim)
    attention: torch.Tensor  # (L, heads, n) float32 over live slots (slot order)


@dataclass(frozen=True)
class Actions:
    """Stage 3 output: the patch stage 4 applies besides the append."""

    cull_slots: tuple[int, ...] = ()
    reindex: bool = False


NO_ACTIONS = Actions()


@dataclass(frozen=True)
class Patch:
    """What stage 0/4 changed in one application (the capture's event-log entry)."""

    step: int
    culled_slots: tuple[int, ...] = ()
    culled_uids: tuple[int, ...] = ()
    moves: tuple[tuple[int, int], ...] = ()  # (from_slot, to_slot) that filled cull holes
    appended_slots: tuple[int, ...] = ()
    appended_uids: tuple[int, ...] = ()
    rebuilt: bool = False  # a failure part-way rebuilt the arena from the mirror


@dataclass(frozen=True)
class PrimeOut:
    """Stage 0 output besides the new state."""

    logits: torch.Tensor  # (T', V) float32: every cached prompt token's logits, or the last row
    patch: Patch


@dataclass(frozen=True)
class StepRecord:
    """What the loop reports per generated token (plain values only)."""

    step: int
    token_id: int
    cache_len: int
    ms: float
    top_ids: tuple[int, ...] = ()
    top_probs: tuple[float, ...] = ()
    culled: tuple[int, ...] = field(default=())
