"""Stage 3's part of fold repair (``FoldRepair``): every culled token's K/V fold into the
surviving slot whose key is most alike (cosine, per layer and KV head); stage 4 does the
arithmetic (``stages.apply.fold``)."""
from __future__ import annotations

import torch

from ... import native
from ...state import View, stored_keys
from ...types import Fold


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


def head_fold_targets(view: View, culls: torch.Tensor, min_cos: float = -1.0) -> torch.Tensor:
    """A per-head cache's folds: for each slot a head culls (``culls`` (L, KVH, n)), the
    surviving slot of the same head whose key has the highest cosine to its key (ties: the
    lowest slot), -1 where that is below ``min_cos`` or the slot is not culled: (L, KVH, n)."""
    L, KVH, n = culls.shape
    out = torch.full((L, KVH, n), -1, dtype=torch.long, device=culls.device)
    count = culls.sum(-1)  # (L, KVH)
    m = int(count.max()) if n else 0
    if m == 0:
        return out
    # each head's culled slots first, in slot order (m of them, the short heads padded)
    order = torch.argsort((~culls).to(torch.uint8), dim=-1, stable=True)[:, :, :m]  # (L, KVH, m)
    real = torch.arange(m, device=culls.device) < count.unsqueeze(-1)
    k = view.k.float()  # (L, KVH, n, D)
    picked = k.gather(2, order.unsqueeze(-1).expand(L, KVH, m, k.shape[-1]))
    norms = view.knorm.clamp_min(1e-12)  # (L, KVH, n)
    sim = picked @ k.transpose(2, 3) / norms.unsqueeze(2)  # (L, KVH, m, n)
    gone = culls | ~view.heads.live(n)  # never into a slot that goes too, or a free one
    sim.masked_fill_(gone.unsqueeze(2), float("-inf"))
    best, into = sim.max(-1)  # (L, KVH, m)
    into.masked_fill_((best / norms.gather(-1, order) < min_cos) | ~real, -1)
    return out.scatter_(-1, order, into)  # a short head's padding: slots it keeps, -1

