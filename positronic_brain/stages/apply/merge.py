"""Stage 4's part of merge repair: the merged token written over the pair's first slot (its
partner goes with the culls); stage 3 chose it (``stages.decide.merge``)."""
from __future__ import annotations

import torch

from ...state import State
from ...types import Merge
from .rows import birth_values, write


def merge(state: State, r: Merge, step: int) -> int:
    """Rewrite slot ``r.slots[0]`` as the merged token (a fresh uid; source kept; each
    scorer column the pair's max or its birth value, as its ``Column.merge`` says); its
    partner is removed with the culls. Returns the new uid."""
    m = state.ledger
    s, t = r.slots
    uid = m.next_uid
    m.next_uid += 1
    m.merged[uid] = r.uids
    for name, spec in m.specs.items():
        col = m.columns[name]
        col[s] = (torch.maximum(col[s], col[t]) if spec.merge == "max"
                  else birth_values(spec.births, m.device)[m.source[s].long()])
    m.uid[s], m.token_id[s], m.position[s] = uid, r.token_id, r.position
    m.born_step[s] = m.changed_step[s] = step
    m.flags[s] = 0
    m.origin[s], m.origin_uid[s] = 0, -1
    write(state.arena, s, r.k, r.v)
    return uid
