"""Stage 3: decide culls, merges, folds, recalls and the re-index (read-only).

Budget rule: below the budget nothing is culled; at or above it, enough slots are removed
that the live count after the append equals the budget. Removed are the lowest-scored
unprotected slots (ties: the earlier position first); protected are the first ``sinks``
live tokens, the last ``recent`` ones, and pinned tokens (FLAG_PROTECTED). Each piece has
its part of this stage in a module of its own, called from ``decide`` where it plugs in:

- ``merge`` (``MergeRepair``): before the culls, some removals become merges of a dim pair;
- ``fold`` (``FoldRepair``): after them, each culled token's K/V fold into its survivors;
- ``recall`` (``Recall``): after them, cold tokens swap in for the dimmest hot ones left;
- ``turns`` (``--allocation turns``): the oldest whole chat turns go instead of single tokens;
- ``allocation`` (a per-head ``Allocation``): each (layer, KV head) culls its own slots.
"""
from __future__ import annotations

import torch

from ...model import Model
from ...state import FLAG_PROTECTED, View
from ...types import Actions, CacheParams, FoldRepair, MergeRepair, ScoreOut, require
from . import allocation, fold, merge, recall, turns
from .fold import fold_targets
from .merge import merge_pair, pick_pairs
from .recall import cold_kept, recalled, swaps
from .turns import oldest_turns, turn_room

__all__ = ["cold_kept", "decide", "fold_targets", "merge_pair", "oldest_turns", "pick_pairs",
           "protected", "ranked", "recalled", "removals_needed", "swaps", "turn_room"]


def protected(view: View, params: CacheParams, order: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) bool: slots that may be neither culled nor repaired (``order``: the slots in
    text order, if already known)."""
    order = torch.argsort(view.position) if order is None else order
    keep = (view.flags & FLAG_PROTECTED) != 0
    # index_fill_ takes the value as an argument; ``keep[i] = True`` copies it from host memory
    keep.index_fill_(0, order[: params.sinks], True)
    keep.index_fill_(0, order[max(0, view.n - params.recent):], True)
    return keep


def removals_needed(n: int, budget: int | None) -> int:
    """How many of ``n`` live slots must go so that ``n + 1`` (after the append) fits."""
    return 0 if budget is None else max(0, n + 1 - budget)


def ranked(scores: torch.Tensor, by_pos: torch.Tensor) -> torch.Tensor:
    """Slots by ascending score, ties by ascending position (``by_pos``: the slots in text
    order): (n,) int64."""
    # index_select, not ``[...]``: the same values, about half advanced indexing's cost
    return by_pos.index_select(0, torch.argsort(scores.index_select(0, by_pos), stable=True))


def decide(model: Model, view: View, scores: ScoreOut, params: CacheParams) -> Actions:
    """Scores (n,) -> the actions stage 4 applies (culls, merges, folds, recalls, re-index,
    new columns)."""
    n = view.n
    need = removals_needed(n, params.budget)
    limit = params.positions.reindex_position(model.spec.max_positions)
    reindex = params.positions.mode == "compact" and view.next_position + 1 >= limit
    if params.allocation.kind == "turns":
        return Actions(columns=scores.columns, cull_slots=turns.oldest_turns(view, need),
                       reindex=reindex)
    if view.heads is not None:  # re-indexed only where every token the heads hold fits
        reindex = reindex and view.n + 1 < limit
        L, KVH = view.heads.n.shape
        keep = protected(view, params)
        culls = allocation.head_culls(view, scores.scores, params,
                                      allocation.budgets(params, L, KVH), keep)
        folds = (fold.head_fold_targets(view, culls, params.repair.min_cos)
                 if isinstance(params.repair, FoldRepair) else None)
        swapped, recalled_columns = (recall.head_swaps(view, scores, params, culls, keep)
                                     if params.recall else (None, None))
        return Actions(columns=scores.columns, head_culls=culls, head_folds=folds,
                       reindex=reindex, head_swaps=swapped, head_recalled=recalled_columns,
                       cold_keep=max(0, limit - limit // 4 - view.n)
                       if reindex and params.recall else None)
    order = torch.argsort(view.position)  # slots in text order
    keep = protected(view, params, order)

    def too_small(free: int) -> None:
        require(need <= free, f"budget {params.budget} too small: {n - free} of {n} live "
                f"tokens are protected and {need} must go")

    pairs = []
    if isinstance(params.repair, MergeRepair):
        free = n - int(keep.sum())
        too_small(free)
        pairs = merge.pick_pairs(scores.scores, view.position, keep,
                                 min(params.repair.max_merges, need, free - need))
    merges = tuple(merge.merge_pair(model, view, *p) for p in pairs)
    taken = keep.clone() if pairs else keep
    for _, first, second in pairs:
        taken[first] = taken[second] = True
    # ascending score, the protected and repaired slots last (a stable sort by that flag
    # keeps the score order within each part): no selection whose size depends on values
    candidates = ranked(scores.scores, order)
    candidates = candidates.index_select(0, torch.argsort(
        taken.index_select(0, candidates).to(torch.uint8), stable=True))
    k = need - len(pairs)
    picked = candidates[:k]
    # the culls and whether any of them is protected, read back at once
    read = (torch.cat((picked, taken.index_select(0, picked).any().view(1).long())).tolist()
            if k else [0])
    if read[-1]:
        too_small(n - int(keep.sum()))
    culls = tuple(sorted(read[:-1]))
    folds = (fold.fold_targets(view, culls, params.repair.min_cos, model.compiled)
             if isinstance(params.repair, FoldRepair) else ())
    recalls = ()
    if params.recall:
        rest = candidates[k:]  # the unprotected slots that stay (a selection)
        rest = rest[~taken[rest]] if scores.hot_signal is not None else rest
        recalls = recall.swaps(view, scores, params, rest)
    return Actions(columns=scores.columns, cull_slots=culls, merges=merges, folds=folds,
                   reindex=reindex, swaps=recalls,
                   cold_keep=recall.cold_kept(limit, params) if reindex and params.recall
                   else None)
