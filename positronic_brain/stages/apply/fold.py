"""Stage 4's part of fold repair: a culled slot's K/V folded into its survivors, as stage 3
chose them (``stages.decide.fold``)."""
from __future__ import annotations

import torch

from ...state import Arena, State, key_norms, value_norms
from ...types import Fold
from .rows import per_block


def fold(state: State, f: Fold) -> None:
    """Fold slot ``f.slot``'s K/V into ``f.into`` (one slot per layer and KV head, -1 =
    none there): there K and V become the mass-weighted mean of both, and the log-mass
    their log-sum-exp, so a query that scores both keys alike gives the pair the attention
    it gave them apart."""
    for a, (into,) in per_block(state.arena, f.into):
        _fold_block(a, f.slot, into)


def _fold_block(a: Arena, slot: int, into: torch.Tensor) -> None:
    """``fold`` in one block of layers: ``into`` (layers, kv_heads). Over the pairs that
    fold alone, selected by value (a read of the device): on the CPU, sigmoid and logaddexp
    may round an element otherwise by where it sits in the operand (vector loops, then a
    scalar tail), so computing them over every pair would change the bits a fold gave."""
    li, hi = (into >= 0).nonzero(as_tuple=True)  # the (layer, KV head) pairs that fold
    if len(li) == 0:
        return
    fold_pairs(a, li, hi, slot, into[li, hi])


def fold_pairs(a: Arena, li: torch.Tensor, hi: torch.Tensor, slot, into: torch.Tensor) -> None:
    """Fold the K/V of ``slot`` (a slot, or one per pair) into ``into`` (one per pair) in
    the (layer, KV head) pairs ``li``, ``hi`` (p,), each pair's own: a mass-weighted mean,
    the log-masses' log-sum-exp."""
    lm_i, lm_j = a.log_mass[li, hi, into], a.log_mass[li, hi, slot]  # (p,)
    w = torch.sigmoid(lm_j - lm_i).unsqueeze(-1)  # m_j / (m_i + m_j), (p, 1)
    for t, norm, rows in ((a.k, a.knorm, key_norms), (a.v, a.vnorm, value_norms)):
        x = t[li, hi, into].float()  # (p, D)
        folded = (x + w * (t[li, hi, slot].float() - x)).to(t.dtype)
        t[li, hi, into] = folded
        norm[li, hi, into] = rows(folded)
    a.log_mass[li, hi, into] = torch.logaddexp(lm_i, lm_j)
    a.folded = True


def fold_heads(state: State, folds: torch.Tensor) -> None:
    """A per-head cache's folds (``Actions.head_folds`` (L, KVH, n): each culled slot's
    target in its head, -1 none), in slot order within each head: a round folds each
    head's next one, so two folds into one slot compound as in ``fold``."""
    li, hi, src = (folds >= 0).nonzero(as_tuple=True)  # (layer, head, slot) order
    if len(li) == 0:
        return
    dst = folds[li, hi, src]
    head = li * folds.shape[1] + hi
    first = torch.searchsorted(head, head)  # each head's first fold's index
    rank = torch.arange(len(li), device=li.device) - first
    for r in range(int(rank.max()) + 1):
        at = rank == r
        fold_pairs(state.arena, li[at], hi[at], src[at], dst[at])
