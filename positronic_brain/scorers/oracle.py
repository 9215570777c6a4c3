"""Hindsight oracle (bench quality only): keep the tokens the rest of the text will attend to.

A full-cache pass over the same text records, at every step, the attention the pending
token (the query) paid to each earlier token, ``aggregate``d to one value per token
(``AttentionRecorder``). Its suffix sums say how much attention each token will still
receive after a given query; the oracle scores a live token by that sum, so the token the
future needs least goes first (a Belady-style reference for culling by attention). It
cannot be built from ``CacheParams``: ``make_scorer`` refuses it, the benchmark passes one
to ``Session(scorer=...)``. It is no strict bound on perplexity: the full cache's attention is
not what a culled cache's queries would pay, nor is attention mass all a token is worth.

Tokens are indexed by their index in the streamed text: bench quality streams each grid
window on its own, from an empty cache, with a recorder and an oracle of its own, so there
"the text" is the window. In a teacher-forced run primed with the text's first token and
nothing merged, a token's uid is its text index and the pending token at step
``view.step`` is the text's token ``view.step``; both are checked against the text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import aggregate
from ..state import View
from ..types import ScoreOut

NAME = "oracle"
ONLY_BENCH = "the oracle needs a full-cache pass over the same text: bench quality only"


def suffix_sums(rows: torch.Tensor) -> torch.Tensor:
    """(T, T) attention rows (query, key) -> (T, T) float32: entry [q, j] = the attention the
    queries after q pay to token j (the sum of rows q+1..T-1). Summed in float64."""
    a = rows.double()
    return (a.flip(0).cumsum(0).flip(0) - a).float()


@dataclass(frozen=True, eq=False)
class Oracle:
    """``future[q, j]``: the attention token j receives after query q in the full-cache pass
    ((T, T) float32: at T = 1536 9 MiB, at 8192 256 MiB); ``token_ids``: the text's first T
    tokens (T,), against which uids are checked."""

    future: torch.Tensor = field(repr=False)
    token_ids: torch.Tensor = field(repr=False)

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        q, T = view.step, self.future.shape[0]  # the pending token's text index
        assert q < T and view.pending_token == int(self.token_ids[q]), \
            f"step {view.step}: the pending token is not the text's token {q}"
        uid = view.uid.cpu()  # the oracle's tables stay in host memory
        assert view.n == 0 or (int(uid.max()) < q and torch.equal(
            self.token_ids[uid], view.token_id.cpu())), "a live uid is not a text index (a merge?)"
        return ScoreOut(scores=self.future[q, uid].to(view.uid.device))


class AttentionRecorder:
    """A stage-2 scorer for the full-cache pass: it scores nothing (zeros, like ``none``) and
    records the first ``size`` queries' attention rows (query q = ``view.step``, over the
    live tokens by uid) as one value per token (``aggregate``). ``oracle()`` then builds the
    oracle for the text ``token_ids`` (its first ``size`` tokens)."""

    def __init__(self, size: int, how: str, token_ids) -> None:
        self.how = how
        # (query, key), in host memory: 9 MiB at 1536, 256 MiB at 8192
        self.rows = torch.zeros(size, size, device="cpu")
        self.token_ids = torch.as_tensor(list(token_ids)[:size], dtype=torch.int64,
                                         device="cpu")
        assert self.token_ids.numel() == size, f"the text has fewer than {size} tokens"

    def score(self, view: View, attention: torch.Tensor) -> ScoreOut:
        q, size = view.step, self.rows.shape[0]
        if q < size:
            assert torch.equal(view.uid.cpu(), torch.arange(q, device="cpu")) and \
                view.pending_token == int(self.token_ids[q]), \
                f"step {q}: not a full cache over the text"
            self.rows[q, :q] = aggregate(attention, self.how)
        return ScoreOut(scores=torch.zeros(view.n, device=view.uid.device))

    def oracle(self) -> Oracle:
        return Oracle(future=suffix_sums(self.rows), token_ids=self.token_ids)
