"""Stage 3 with ``--allocation turns`` (a chat's): the removals are the oldest whole chat turns
instead of single tokens (``oldest_turns``), and how much room a new turn has (``turn_room``)."""
from __future__ import annotations

import torch

from ...state import FLAG_PROTECTED, View
from ...types import SOURCES, CacheParams, require


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
        if params.allocation.kind == "turns":
            users = view.position[view.source == SOURCES.index("user")]
            first = int(users.min()) if users.numel() else view.next_position + 1
            kept += int((~pinned & (view.position < first)).sum())
    reply = reply if params.allocation.kind == "turns" else 0
    return params.budget - kept - reply - 1, kept, reply
