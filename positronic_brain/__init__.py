"""Positronic Brain: a staged generation loop in which the KV cache is never touched
behind your back. See README.md and docs/DESIGN.md."""
from .loop import Session, run
from .model import Model, load_model
from .special_tokens import TokenPolicy
from .state import Arena, Ledger, State, View
from .types import SamplerParams, Segment, UserError

__all__ = ["Arena", "Ledger", "Model", "SamplerParams", "Segment", "Session", "State",
           "TokenPolicy", "UserError", "View", "load_model", "run"]
__version__ = "0.1.0"
