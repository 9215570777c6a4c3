"""Positronic Brain: a staged generation loop in which the KV cache is never touched
behind your back. See README.md and docs/DESIGN.md."""
import os

# Offline, always, before anything imports transformers: nothing may reach a model hub.
# And, where torch is imported after this, its CPU allocator puts every tensor of 2 MB or
# more on transparent huge pages: a slot's key is one element in each of thousands of key
# rows, each row on its own 4 KB page, so moving a slot misses the TLB once per row; on
# 2 MB pages, once per 64 rows (THP_MEM_ALLOC_ENABLE=0 turns it off).
for _var, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                     ("TOKENIZERS_PARALLELISM", "false"), ("THP_MEM_ALLOC_ENABLE", "1")):
    os.environ.setdefault(_var, _value)

from .loop import Session, run  # noqa: E402  (after the environment)
from .model import Model, load_model
from .special_tokens import TokenPolicy
from .state import Arena, Ledger, State, View
from .types import SamplerParams, Segment, UserError
from .version import __version__

__all__ = ["Arena", "Ledger", "Model", "SamplerParams", "Segment", "Session", "State",
           "TokenPolicy", "UserError", "View", "__version__", "load_model", "run"]
