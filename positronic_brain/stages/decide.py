"""Stage 3: decide culls, merges, folds and the re-index (read-only).

Budget rule: below the budget nothing is culled; at or above it, enough slots are removed
that the live count after the append equals the budget. Removed are the lowest-scored
unprotected slots (ties: the earlier position first); protected are the first ``sinks``
live tokens, the last ``recent`` ones, and pinned tokens (FLAG_PROTECTED). With repair
``merge``, up to its ``max_merges`` removals are instead merges of a dim adjacent pair (text
order, lowest summed score, pairs never overlap) into the single token the model ranks best
at the pair's first position given the text to its left: two read-only forwards with the
right-hand slots masked out, the second of which yields the new token's K/V. With repair
``fold``, every culled token's K/V fold into the surviving slot whose key is most alike
(cosine, per layer and KV head; ``fold_targets``); stage 4 does the arithmetic.
With prune ``turns``, the removals are instead the oldest whole chat turns (``oldest_turns``).
With recall, on a step whose scores carry the hot signals (and, on a step that scans the
cold store, the cold ones), the best cold tokens swap places with the dimmest hot ones left
after the culls when their signal is the higher by the margin (``swaps``).
"""
from __future__ import annotations

import torch

from .. import native
from ..forward import forward
from ..model import Model
from ..state import FLAG_PROTECTED, View, stored_keys
from ..types import (SOURCES, Actions, CacheParams, Fold, FoldRepair, Merge, MergeRepair,
                     ScoreOut, Swap, require)


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
    return by_pos[torch.argsort(scores[by_pos], stable=True)]


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


def fold_targets(view: View, culls: tuple[int, ...], min_cos: float = -1.0,
                 compiled: str = "") -> tuple[Fold, ...]:
    """For each culled slot, per layer and KV head, the surviving slot whose key has the
    highest cosine similarity to its key (ties: the lowest slot); -1 where that cosine is
    below ``min_cos`` (the token is only dropped there); none for a slot dropped everywhere.
    With a native model (``compiled``), one native pass over the keys where it applies."""
    if not culls or len(culls) >= view.n:
        return ()
    c = view.uid.new_tensor(culls)
    into = native.fold_into(view, c, min_cos) if native.chosen(compiled) else None
    if into is None:
        into = _fold_search(view, c, min_cos)
    # each culled slot's uid and whether it folds anywhere, read back at once
    read = torch.cat((view.uid[c], (into >= 0).flatten(0, 1).any(0).long())).tolist()
    return tuple(Fold(slot=s, uid=read[j], into=into[:, :, j])
                 for j, s in enumerate(culls) if read[len(culls) + j])


def _fold_search(view: View, c: torch.Tensor, min_cos: float) -> torch.Tensor:
    """``fold_targets``' targets (L, KVH, m) for the culled slots ``c`` (m,), in torch."""
    if isinstance(view.k, torch.Tensor):
        dots = _dots(view.k, c)
    else:  # a split arena: each block where it lives, the dots gathered
        dots = torch.cat([_dots(k, c.to(k.device)).to(c.device) for k in view.k])
    norms = view.knorm.clamp_min(1e-12)  # (L, KVH, n)
    sim = dots / norms.unsqueeze(2)
    sim.index_fill_(-1, c, float("-inf"))  # never into a slot that goes too
    best, into = sim.max(-1)  # (L, KVH, c)
    return into.masked_fill_(best / norms[:, :, c] < min_cos, -1)


def _dots(k: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The dot products of the keys of slots ``c`` (m,) with every live key ``k`` (L,
    kv_heads, n, head_dim): (L, kv_heads, m, n) float32."""
    L, KVH, n, D = k.shape
    # bfloat16 reads the arena's dense key block (same bits; dead columns dropped below)
    keys = k.transpose(2, 3).reshape(L * KVH, D, n)
    if keys.dtype != torch.float32:
        keys = stored_keys(k)
    dots = torch.bmm(k[:, :, c].reshape(L * KVH, c.numel(), D), keys)
    return dots[..., :n].float().reshape(L, KVH, c.numel(), n)


def cold_kept(limit: int, params: CacheParams) -> int:
    """How many cold tokens a re-index keeps (the newest to enter): hot and cold together
    then take at most 3/4 of the ``limit`` positions, so the next re-index is at least a
    quarter of them away (each re-rotates every cold key)."""
    return max(0, limit - limit // 4 - params.budget)


def recalled(view: View, scores: ScoreOut, params: CacheParams, room: int) -> list[tuple[int, float]]:
    """Up to ``room`` cold rows to bring back, best first: [(row, signal)]. The anchors are
    the tokens, hot or cold, with the highest signal this step (hot ones only on a step that
    does not scan the cold store: ``cold_signal`` None); each brings back the cold tokens
    that follow it in the text within recall's ``span`` positions (a cold anchor itself too),
    with its signal. What a query attends to in an earlier passage, the next queries tend to
    read on from (a text repeating one, a fact spread over several tokens): a hot anchor
    prefetches what comes after it before the query needs it. A cold row taken by several
    anchors goes with the best; rows come in the anchors' order, then in text order."""
    cold, span = view.cold, params.recall.span
    c = cold.n
    if scores.cold_signal is None:  # hot slots only
        signal, position = scores.hot_signal, view.position
    else:  # cold rows, then hot slots
        signal = torch.cat((scores.cold_signal, scores.hot_signal))
        position = torch.cat((cold.position, view.position))
    N = signal.numel()
    finite = torch.isfinite(signal).nonzero()[:, 0]
    # the anchors, best first: enough for ``room`` cold ones past every hot one
    anchors = finite[_best(signal[finite], room + scores.hot_signal.numel())]
    # A cold row follows an anchor within the span when 0 <= its position - the anchor's <
    # span: read from a table of the cold row at each position (-1: none; positions are
    # unique and below the next one), span entries per anchor
    dev = signal.device
    row_at = torch.full((view.next_position + span,), -1, dtype=torch.int64, device=dev)
    row_at[cold.position] = torch.arange(c, device=dev)
    at = row_at[position[anchors][:, None] + torch.arange(span, device=dev)]  # (m, span)
    ok = at >= 0
    place = torch.arange(anchors.numel(), device=dev)[:, None].expand_as(at)
    best = torch.full((c,), N, dtype=place.dtype, device=dev)  # the best anchor's place
    best.scatter_reduce_(0, at[ok], place[ok], reduce="amin")
    # each row once, at its best anchor: in the anchors' order, then in text order
    rows = at[ok & (best[at.clamp_min(0)] == place)][:room]
    return list(zip(rows.tolist(), signal[anchors[best[rows]]].tolist()))


def _best(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` largest of ``x`` (1-D, no NaN), largest first, ties in index
    order: ``argsort(x, descending=True, stable=True)[:k]``, without sorting all of ``x``
    when ``k`` is a small part of it (a scan step's anchors among thousands of cold rows)."""
    if k <= 0 or 4 * k >= x.numel():
        return torch.argsort(x, descending=True, stable=True)[:k]
    kth = torch.topk(x, k, sorted=False).values.min()
    above, tied = (x > kth).nonzero()[:, 0], (x == kth).nonzero()[:, 0]
    picked = torch.cat((above, tied[: k - above.numel()])).sort().values  # index order
    return picked[torch.argsort(x[picked], descending=True, stable=True)]


def swaps(view: View, scores: ScoreOut, params: CacheParams,
          candidates: torch.Tensor) -> tuple[Swap, ...]:
    """Recalls: the i-th cold row to bring back (``recalled``: the best by ``cold_signal``,
    each with its span) takes the slot of the i-th dimmest of ``candidates`` (unprotected hot
    slots that stay this step, ascending score), for i < recall's ``swaps``, wherever its signal
    beats that slot's ``hot_signal`` by more than recall's ``margin`` / n (uniform shares of
    the n live slots): a margin keeps a token that is about as useful as the one it would
    replace from trading places with it step after step.

    A recalled token's scorer columns follow their ``Column.recall``: ``keep`` the value it
    went cold with, ``birth`` (brightness: its source's seed, as a new token, so it is not
    culled again at once) or ``signal``: its signal times the queries since it was born
    (H2O's average starts at the attention it would get now). TOVA scores this step's
    attention, so it keeps what it recalled while the query attends to it; streaming keeps
    the most recent tokens and so culls a recalled one again first."""
    if scores.hot_signal is None or view.cold is None or not view.cold.n:
        return ()
    cold = view.cold
    victims = candidates[: params.recall.swaps]
    picks = recalled(view, scores, params, victims.numel())
    if not picks:
        return ()
    victims = victims[: len(picks)]
    rows = torch.tensor([r for r, _ in picks], device=victims.device)
    margin = params.recall.margin / view.n
    out = [(slot, uid, row, cold_uid, source, signal * (view.step + 1 - born + 1))
           for slot, uid, hot, (row, signal), cold_uid, source, born in zip(  # read once
               victims.tolist(), view.uid[victims].tolist(), scores.hot_signal[victims].tolist(),
               picks, cold.uid[rows].tolist(), cold.source[rows].tolist(),
               cold.born_step[rows].tolist())
           if signal > hot + margin]  # signal x the queries since it was born
    # as float32 holds them (what the column will)
    sums = torch.tensor([x[-1] for x in out], dtype=torch.float32, device="cpu").tolist()
    return tuple(Swap(slot=slot, uid=uid, cold_slot=row, cold_uid=cold_uid,
                      columns={name: spec.births[source] if spec.recall == "birth" else total
                               for name, spec in view.specs.items() if spec.recall != "keep"})
                 for (slot, uid, row, cold_uid, source, _), total in zip(out, sums))


def oldest_turns(view: View, need: int) -> tuple[int, ...]:
    """Slots of the fewest oldest whole turns that free ``need`` slots. A turn is a run of
    user tokens (text order) and everything after it up to the next such run (the reply);
    the last turn (the one being answered) and pinned tokens always stay."""
    order = torch.argsort(view.position)  # (n,) slots in text order
    user = view.source[order] == SOURCES.index("user")  # (n,)
    starts = (user & ~torch.cat((user.new_zeros(1), user[:-1]))).nonzero()[:, 0].tolist()
    free = (view.flags[order] & FLAG_PROTECTED) == 0  # (n,)
    culls: list[int] = []
    for a, b in zip(starts, starts[1:]):  # every turn but the last
        if len(culls) >= need:
            break
        culls += order[a:b][free[a:b]].tolist()
    require(len(culls) >= need, f"budget too small for whole turns: {need} slots must go, "
            f"the older turns hold {len(culls)}")
    return tuple(sorted(culls))


def turn_room(view: View | None, params: CacheParams, reply: int) -> tuple[int, int, int]:
    """How many tokens a new chat turn may add to the cache ``view`` (None: nothing cached)
    under ``params.budget`` and how many no cull may remove: the pinned tokens and, when
    whole turns are pruned, whatever precedes the first turn, since only older turns can
    make room then (and a ``reply`` of that many tokens must fit too): (room, kept, the
    tokens held back for the reply)."""
    kept = 0
    if view is not None:
        pinned = (view.flags & FLAG_PROTECTED) != 0  # (n,)
        kept = int(pinned.sum())
        if params.prune == "turns":
            users = view.position[view.source == SOURCES.index("user")]
            first = int(users.min()) if users.numel() else view.next_position + 1
            kept += int((~pinned & (view.position < first)).sum())
    reply = reply if params.prune == "turns" else 0
    return params.budget - kept - reply - 1, kept, reply


def decide(model: Model, view: View, scores: ScoreOut, params: CacheParams) -> Actions:
    """Scores (n,) -> the actions stage 4 applies (culls, merges, folds, re-index, new columns)."""
    n = view.n
    need = removals_needed(n, params.budget)
    limit = params.positions.reindex_position(model.spec.max_positions)
    reindex = params.positions.mode == "compact" and view.next_position + 1 >= limit
    if params.prune == "turns":
        return Actions(columns=scores.columns, cull_slots=oldest_turns(view, need), reindex=reindex)
    order = torch.argsort(view.position)  # slots in text order
    keep = protected(view, params, order)

    def too_small(free: int) -> None:
        require(need <= free, f"budget {params.budget} too small: {n - free} of {n} live "
                f"tokens are protected and {need} must go")

    pairs = []
    if isinstance(params.repair, MergeRepair):
        free = n - int(keep.sum())
        too_small(free)
        pairs = pick_pairs(scores.scores, view.position, keep,
                           min(params.repair.max_merges, need, free - need))
    merges = tuple(merge_pair(model, view, *p) for p in pairs)
    taken = keep.clone() if pairs else keep
    for _, first, second in pairs:
        taken[first] = taken[second] = True
    # ascending score, the protected and repaired slots last (a stable sort by that flag
    # keeps the score order within each part): no selection whose size depends on values
    candidates = ranked(scores.scores, order)
    candidates = candidates[torch.argsort(taken[candidates].to(torch.uint8), stable=True)]
    k = need - len(pairs)
    picked = candidates[:k]
    # the culls and whether any of them is protected, read back at once
    read = torch.cat((picked, taken[picked].any().view(1).long())).tolist() if k else [0]
    if read[-1]:
        too_small(n - int(keep.sum()))
    culls = tuple(sorted(read[:-1]))
    folds = (fold_targets(view, culls, params.repair.min_cos, model.compiled)
             if isinstance(params.repair, FoldRepair) else ())
    rest = candidates[k:]  # the unprotected slots that stay, with recall (a selection)
    rest = rest[~taken[rest]] if scores.hot_signal is not None else rest
    return Actions(columns=scores.columns, cull_slots=culls,
                   merges=merges, folds=folds, reindex=reindex,
                   cold_keep=cold_kept(limit, params) if reindex and params.recall else None,
                   swaps=swaps(view, scores, params, rest))
