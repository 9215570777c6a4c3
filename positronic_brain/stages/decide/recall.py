"""Stage 3's part of recall (``Recall``): on a step whose scores carry the hot signals (and, on
a step that scans the cold store, the cold ones), the best cold tokens swap places with the
dimmest hot ones left after the culls when their signal is the higher by the margin
(``swaps``); a re-index keeps the newest cold tokens (``cold_kept``). Stage 2 gives the
signals (``stages.score.recall``), stage 4 moves the tokens (``stages.apply.recall``)."""
from __future__ import annotations

import math

import torch

from ...state import View
from ..score.recall import recall_layers
from ...types import CacheParams, ScoreOut, Swap


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
    culled again at once), ``signal``: its signal times the queries since it was born
    (H2O's average starts at the attention it would get now), or ``top``: the column's
    largest live value (kvzip, whose most-attention column never decays: kept, a recalled
    token would be the dimmest and go cold again at the next swap). TOVA scores this step's
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
    tops = {name: float(view.columns[name].max()) for name, spec in view.specs.items()
            if spec.recall == "top" and out}
    return tuple(Swap(slot=slot, uid=uid, cold_slot=row, cold_uid=cold_uid,
                      columns={name: spec.births[source] if spec.recall == "birth" else
                               tops[name] if spec.recall == "top" else total
                               for name, spec in view.specs.items() if spec.recall != "keep"})
                 for (slot, uid, row, cold_uid, source, _), total in zip(out, sums))


def head_swaps(view: View, scores: ScoreOut, params: CacheParams, culls: torch.Tensor,
               keep: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, torch.Tensor] | None]:
    """``swaps`` in a per-head cache, each (layer, KV head) of the recall layers on its own
    (its hot and cold slots, its signals: ``score.head_signals``): its anchors bring back
    the cold slots that follow them within the span, and the i-th of those takes the place
    of the i-th dimmest of its unprotected hot slots that stay (``culls`` (L, KVH, n) not,
    ``keep`` (n,) not), where its signal beats that slot's by the margin over the head's
    own live count. Returns the swaps (k, 4): (layer, KV head, hot slot, cold slot), and the
    recalled entries' new scorer column values (``Column.recall``), or (None, None)."""
    cold = view.cold
    if scores.hot_signal is None or cold is None or not cold.n:
        return None, None
    layers = torch.tensor(recall_layers(params, view.heads.n.shape[0]), device=keep.device)
    victims, ok_victim = _victims(view, scores.scores[layers], culls[layers], keep, layers,
                                  params.recall.swaps)
    picks, signal = _head_picks(view, scores, params, layers, victims.shape[-1])
    hot = scores.hot_signal.gather(-1, victims)
    margin = params.recall.margin / view.heads.n[layers].unsqueeze(-1)
    go = ok_victim & (picks >= 0) & (signal > hot + margin)
    l, kvh, i = go.nonzero().unbind(1)
    if not l.numel():
        return None, None
    swaps = torch.stack((layers[l], kvh, victims[l, kvh, i], picks[l, kvh, i]), 1)
    row = cold.heads.row[layers[l], kvh, picks[l, kvh, i]]
    signal = signal[l, kvh, i]
    values = {}
    for name, spec in view.specs.items():
        if spec.recall == "birth":
            births = torch.tensor(spec.births, dtype=torch.float32, device=row.device)
            values[name] = births[cold.source[row].long()]
        elif spec.recall == "signal":  # its signal x the queries since it was born
            values[name] = (signal.double() * (view.step + 2 - cold.born_step[row])).float()
        elif spec.recall == "top":  # the column's largest live value
            values[name] = view.columns[name].max().expand(row.shape[0]).clone()
    return swaps, values


def _victims(view: View, scores: torch.Tensor, culls: torch.Tensor, keep: torch.Tensor,
             layers: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each recall layer's heads' ``count`` dimmest hot slots that may go and stay this step
    (ascending score, of equal ones the earliest position): (l, KVH, count) slots, and
    whether each is one."""
    h = view.heads
    width = h.row.shape[2]
    live = h.live(width)[layers]
    at = h.row[layers].clamp(min=0)
    free = live & ~keep[at] & ~culls
    by_pos = torch.argsort(torch.where(live, view.position[at], view.next_position), dim=-1,
                           stable=True)
    order = by_pos.gather(-1, torch.argsort(scores.float().gather(-1, by_pos), dim=-1,
                                            stable=True))
    order = order.gather(-1, torch.argsort((~free).gather(-1, order).to(torch.uint8), dim=-1,
                                           stable=True))[..., :count]
    return order, free.gather(-1, order)


def _best_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``_best`` along the last dimension of ``x`` (..., m; no NaN): each row's ``k``
    largest, largest first, ties in index order, as ``argsort(x, descending=True,
    stable=True)[..., :k]`` gives them, without sorting whole rows (a scan step's thousands
    of cold slots a head)."""
    if 4 * k >= x.shape[-1]:
        return torch.argsort(x, dim=-1, descending=True, stable=True)[..., :k]
    kth = torch.topk(x, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, tied = x > kth, x == kth
    room = k - above.sum(-1, keepdim=True)  # the first this many tied ones, in index order
    picked = above | (tied & (torch.cumsum(tied, -1) <= room))
    at = picked.nonzero()[:, -1].view(*x.shape[:-1], k)  # index order, k a row
    return at.gather(-1, torch.argsort(x.gather(-1, at), dim=-1, descending=True, stable=True))


def _head_picks(view: View, scores: ScoreOut, params: CacheParams, layers: torch.Tensor,
                room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``recalled`` for each recall layer's heads at once: up to ``room`` cold slots of each
    (l, KVH, room; -1: none) in the order they would come back, and their anchors' signals.
    The anchors of a head are its tokens, hot or cold, of the highest signal (enough for
    ``room`` cold ones past every hot one; hot ones alone on a step without a scan)."""
    cold, h, span = view.cold, view.heads, params.recall.span
    ch = cold.heads
    width, cw = h.row.shape[2], ch.row.shape[2]
    hot_pos = view.position[h.row[layers].clamp(min=0)]
    cold_pos = cold.position[ch.row[layers].clamp(min=0)]
    held = h.live(width)[layers].sum(-1, keepdim=True)
    if scores.cold_signal is None:
        signal, position, anchors = scores.hot_signal, hot_pos, held
    else:  # cold slots, then hot ones
        signal = torch.cat((scores.cold_signal, scores.hot_signal), -1)
        position = torch.cat((cold_pos, hot_pos), -1)
        anchors = held + room
    a = min(signal.shape[-1], int(anchors.max()))
    if a == 0:
        none = torch.full(signal.shape[:2] + (room,), -1, dtype=torch.long, device=signal.device)
        return none, torch.full(none.shape, -math.inf, device=signal.device)
    order = _best_rows(signal, a)
    usable = torch.isfinite(signal.gather(-1, order)) & (
        torch.arange(a, device=order.device) < anchors)
    dev, last = order.device, view.next_position + span
    # a table of each head's cold slot at each position (-1: none), read at the span after
    # each anchor
    row_at = torch.full(cold_pos.shape[:2] + (last,), -1, dtype=torch.long, device=dev)
    cold_live = ch.live(cw)[layers]
    row_at.scatter_(-1, torch.where(cold_live, cold_pos, last - 1),
                    torch.where(cold_live, torch.arange(cw, device=dev), -1).expand_as(cold_pos))
    start = torch.where(usable, position.gather(-1, order), last - span)
    at = row_at.gather(-1, (start.unsqueeze(-1) + torch.arange(span, device=dev)).flatten(2))
    at = at.view(*order.shape, span)
    place = torch.arange(a, device=dev).view(1, 1, a, 1).expand_as(at)
    ok = (at >= 0) & usable.unsqueeze(-1)
    best = torch.full(cold_pos.shape, a, dtype=torch.long, device=dev)
    best.scatter_reduce_(-1, torch.where(ok, at, 0).flatten(2),
                         torch.where(ok, place, a).flatten(2), reduce="amin")
    key = torch.where(best < a, best * last + cold_pos, torch.iinfo(torch.long).max)
    k = min(room, cw)
    first = torch.topk(key, k, dim=-1, largest=False, sorted=True)
    picks = torch.where(first.values < torch.iinfo(torch.long).max, first.indices, -1)
    signal = signal.gather(-1, order.gather(-1, best.gather(-1, first.indices).clamp(max=a - 1)))
    if k < room:  # fewer cold slots than victims
        pad = (0, room - k)
        picks = torch.nn.functional.pad(picks, pad, value=-1)
        signal = torch.nn.functional.pad(signal, pad, value=-math.inf)
    return picks, signal
