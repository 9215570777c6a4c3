"""The README's scorer with a column of its own, as a user would write it: nothing in the
package knows it (tests/test_scorer_columns.py runs it through the CLI and the API)."""
from dataclasses import dataclass
from typing import ClassVar

from positronic_brain.types import ScoreOut


@dataclass(frozen=True)
class Ema:
    """Keep the tokens whose attention, averaged over time, is highest."""
    decay: float = 0.9
    columns: ClassVar[dict[str, float]] = {"ema": 0.0}   # per-token state: name -> value at birth

    def score(self, view, attention):
        share = view.n * attention.mean(dim=(0, 1))      # (n,) 1 = a uniform share
        ema = self.decay * view.columns["ema"] + (1 - self.decay) * share
        return ScoreOut(scores=ema, columns={"ema": ema})
