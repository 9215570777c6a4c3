"""Stage 3's part of recall (``Recall``): on a step whose scores carry the hot signals (and, on
a step that scans the cold store, the cold ones), the best cold tokens swap places with the
dimmest hot ones left after the culls when their signal is the higher by the margin
(``swaps``); a re-index keeps the newest cold tokens (``cold_kept``). Stage 2 gives the
signals (``stages.score.recall``), stage 4 moves the tokens (``stages.apply.recall``)."""
from __future__ import annotations

import torch

from ...state import View
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
