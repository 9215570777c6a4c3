"""Retrieval heads for ``--allocation duo`` (``positronic-brain calibrate``), from what each
(layer, KV head) reads while the model answers a pass-key.

DuoAttention keeps the whole context only in its retrieval heads and sinks plus a recent
window in the others. Which heads retrieve is measured here as the "retrieval head" work
does (Wu et al., 2024: a retrieval head is one whose attention lands on the needle the
model is copying out): the model answers pass-key prompts (``bench.passkey``'s, at the
lengths given) with the whole cache, each answer token given (teacher forcing), and a
head's score is the share of its attention that the answer's queries pay the key's tokens
in the prompt, averaged over the KV head's query heads, the answer's tokens and the
trials. The ``fraction`` of heads with the highest scores are the retrieval heads; the file
written is the (layers x KV heads) grid of 0/1 that ``--allocation-heads`` reads (as
DuoAttention's ``full_attention_heads``). ``at_random`` chooses as many at random: the
baseline a choice is measured against.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .bench.passkey import FRAMINGS, fit, trials
from .capture import Tape
from .loop import Session, arena_capacity
from .model import Model
from .plain import atomic_write
from .special_tokens import TokenPolicy
from .types import CacheParams, SamplerParams, require, require_seed


SEED = 1  # the trials' seed: other prompts than bench passkey's (seed 0) evaluates on
ROOM = 16  # positions a prompt leaves for its answer (a key's tokens)


@dataclass(frozen=True)
class Calibration:
    """Each (layer, KV head)'s retrieval score (the mean share of its attention on the
    key's tokens) and the heads chosen (the ``fraction`` with the highest)."""

    scores: torch.Tensor  # (L, KVH) float
    heads: torch.Tensor  # (L, KVH) bool
    trials: int
    steps: int  # answer tokens read in all

    def grid(self) -> list[list[int]]:
        """The chosen heads as ``--allocation-heads`` reads them: a layers x KV heads 0/1 grid."""
        return self.heads.int().tolist()


class _Reads(Tape):
    """A tape that keeps, of each step, the share of each (layer, query head)'s attention
    on ``slots``."""

    def __init__(self, slots: list[int]):
        self.slots, self.shares = slots, []

    def generated(self, view, sampler, force, gen) -> None:
        self.shares.append(gen.attention[:, :, self.slots].float().sum(-1))


def key_slots(ids: list[int], key: list[int]) -> list[int]:
    """The positions in ``ids`` of every occurrence of the ``key`` tokens (in order)."""
    n = len(key)
    return [i + j for i in range(len(ids) - n + 1) if ids[i:i + n] == key for j in range(n)]


def head_scores(shares: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(steps, L, H) attention shares -> (L, KVH): the mean over the steps and over each KV
    head's query heads (a group of H / KVH consecutive heads, as grouped-query attention
    shares a KV head)."""
    steps, layers, heads = shares.shape
    return shares.view(steps, layers, kv_heads, heads // kv_heads).mean(dim=(0, 3))


def choose(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """(L, KVH) bool: the ``ceil(fraction x L x KVH)`` heads with the highest ``scores`` (at
    least one; ties to the lower layer, then the lower head)."""
    require(0 < fraction <= 1, f"--fraction must be in (0, 1], got {fraction}")
    flat = scores.flatten().double()
    k = max(1, math.ceil(fraction * flat.numel()))
    order = sorted(range(flat.numel()), key=lambda i: (-float(flat[i]), i))
    out = torch.zeros(flat.numel(), dtype=torch.bool)
    out[order[:k]] = True
    return out.view(scores.shape)


def calibrate(model: Model, policy: TokenPolicy, n_trials: int = 8,
              lengths: tuple[int, ...] = (1024,), fraction: float = 0.25, seed: int = SEED,
              framing: str = "raw") -> Calibration:
    """Score every (layer, KV head) on ``n_trials`` pass-key prompts (``bench.passkey``'s
    trials of ``seed``, at ``lengths`` tokens) and choose the ``fraction`` that read the
    key the most (``choose``)."""
    require(n_trials >= 1, f"--trials must be >= 1, got {n_trials}")
    most = model.spec.max_positions - ROOM
    require(lengths and all(1 <= n <= most for n in lengths),
            f"--lengths {','.join(map(str, lengths))}: each in 1..{most} (the model's "
            f"positions less {ROOM} for the answer)")
    require_seed(seed)
    require(framing in FRAMINGS, f"--framing must be one of {', '.join(FRAMINGS)}")
    choose(torch.zeros(1), fraction)  # a bad fraction refused before the work
    for n in dict.fromkeys(lengths):  # every length given, a trial's or not, holds the task
        fit(policy, 10000, 0.5, n, framing)
    prompts = []  # every trial's prompt made before the work
    for trial in trials(seed, n_trials, tuple(lengths)):
        segs = fit(policy, trial.key, trial.depth, trial.length, framing)[1]
        ids = [i for s in segs for i in s.ids]
        answer = policy.encode(f" {trial.key}")
        slots = key_slots(ids[:-1], answer)  # the prompt's cached tokens (the last pends)
        require(slots, f"the key {trial.key}'s tokens {answer} are not in the prompt as the "
                "answer spells them (this tokenizer splits them otherwise)")
        prompts.append((segs, ids, answer, slots))
    shares = []
    for segs, ids, answer, slots in prompts:
        tape = _Reads(slots)
        session = Session(model, policy, SamplerParams(greedy=True), CacheParams(), tape=tape)
        session.prime(segs, arena_capacity(model, CacheParams(), len(ids), len(answer)))
        for token in answer:
            session.step(force=token)
        shares += tape.shares
    scores = head_scores(torch.stack(shares).cpu(), model.spec.n_kv_heads)
    return Calibration(scores, choose(scores, fraction), n_trials, len(shares))


def at_random(model: Model, fraction: float = 0.25, seed: int = SEED) -> Calibration:
    """The baseline: the ``fraction`` of heads chosen at random (``seed``), each head's
    "score" its draw."""
    spec = model.spec
    choose(torch.zeros(1), fraction)
    require_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    scores = torch.rand(spec.n_layers, spec.n_kv_heads, generator=rng)
    return Calibration(scores, choose(scores, fraction), 0, 0)


def write(calibration: Calibration, out: str | Path) -> Path:
    """The chosen heads' grid to ``out`` (JSON, atomically)."""
    return atomic_write(Path(out), json.dumps(calibration.grid()).encode())


__all__ = ["Calibration", "at_random", "calibrate", "choose", "head_scores", "key_slots",
           "write"]
