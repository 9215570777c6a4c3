"""Stage 3's part of merge repair (``MergeRepair``): up to its ``max_merges`` removals become
merges of a dim adjacent pair (text order, lowest summed score, pairs never overlap) into the
single token the model ranks best at the pair's first position given the text to its left:
two read-only forwards with the right-hand slots masked out, the second of which yields the
new token's K/V. Stage 4 writes it (``stages.apply.merge``)."""
from __future__ import annotations

import torch

from ...forward import forward
from ...model import Model
from ...state import View
from ...types import Merge


def pick_pairs(scores: torch.Tensor, position: torch.Tensor, keep: torch.Tensor,
               count: int) -> list[tuple[int, int, int]]:
    """Up to ``count`` non-overlapping adjacent (text order) unprotected pairs with the lowest
    summed score, each with a live token to its left: [(left, first, second)] slots."""
    order = torch.argsort(position)  # (n,)
    if count == 0 or order.numel() < 3:
        return []
    a, b = order[1:-1], order[2:]  # candidate pairs (order[i], order[i+1]) for i >= 1
    ok = (~keep[a] & ~keep[b]).nonzero()[:, 0]  # (m,) indices into the candidates
    cost = scores[a[ok]] + scores[b[ok]]
    picked, used = [], set()
    for i in ok[torch.argsort(cost, stable=True)].tolist():
        if len(picked) == count:
            break
        first, second = int(a[i]), int(b[i])
        if first in used or second in used:
            continue
        used.update((first, second))
        picked.append((int(order[i]), first, second))
    return picked


@torch.no_grad()
def merge_pair(model: Model, view: View, left: int, first: int, second: int) -> Merge:
    """The model's argmax at ``first``'s position given the text to its left, and its K/V
    (L, kv_heads, 1, head_dim): forwards over the live slots with the right-hand ones masked."""
    pos = view.position  # (n,)
    p_left, p_first = int(pos[left]), int(pos[first])
    out = forward(model, view.k, view.v, view.token_id[left:left + 1], pos[left:left + 1],
                  past_mask=(pos < p_left)[None], past_log_mass=view.log_mass)
    token = int(out.logits[0].argmax())
    out = forward(model, view.k, view.v, pos.new_tensor([token]), pos[first:first + 1],
                  past_mask=(pos < p_first)[None], past_log_mass=view.log_mass, kv_only=True)
    return Merge(slots=(first, second), uids=(int(view.uid[first]), int(view.uid[second])),
                  token_id=token, position=p_first, k=out.k, v=out.v)
