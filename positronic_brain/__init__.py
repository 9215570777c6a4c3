"""Positronic Brain: a staged generation loop in which the KV cache is never touched
behind your back. See README.md and docs/DESIGN.md."""
import os

# Offline, always, before anything imports transformers: nothing may reach a model hub.
for _var, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                     ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_var, _value)

from .loop import Session, run  # noqa: E402  (after the environment)
from .model import Model, load_model
from .special_tokens import TokenPolicy
from .state import Arena, Ledger, State, View
from .types import SamplerParams, Segment, UserError
from .version import __version__

__all__ = ["Arena", "Ledger", "Model", "SamplerParams", "Segment", "Session", "State",
           "TokenPolicy", "UserError", "View", "__version__", "load_model", "run"]
