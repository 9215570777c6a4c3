"""A user's own scorer, named where a built-in's name goes (``--policy``, ``--policies``):

- ``path/to/file.py:ClassName``: loaded from that file (the CLI makes the path absolute; a
  capture records the file's sha256 and replay refuses a file that changed since);
- ``package.module:ClassName``: imported;
- an installed package's entry point in the group ``positronic_brain.scorers`` (its name).

The class is a dataclass with ``score(view, attention) -> ScoreOut`` (and optionally
``prefill(view, stats) -> ScoreOut``, taken when ``--prefill-scores`` is on, or unset and
a class attribute ``prefill_default`` is true), like the built-ins, and may declare ledger
columns of its own (``columns``: ``scorers.columns_of``). Its fields are its options, as a
built-in's are: ``--param NAME=VALUE`` (``ScorerSpec.params``, read by the field's type:
``options``) or its default; one named as a ``CacheParams`` field takes that value. ``Guarded`` runs it in stage 2: a scorer that
raises, returns the wrong type or shape, non-finite values, or writes to what it reads is
one line naming it and the problem, before stage 4 could write anything. It reads copies of
the view's ledger columns, so a write there loses nothing; a write to the K/V or the
attention (views of the arena and of stage 1's output, not copied) is detected, not undone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import math
import sys
from importlib.metadata import entry_points
from pathlib import Path

import torch

from ..state import VIEW_COLUMNS
from ..types import ScoreOut, UserError, require

GROUP = "positronic_brain.scorers"
_CLASSES: dict[tuple[str, str], type] = {}  # (spec, file sha256 or "") -> class


def is_user(name: str) -> bool:
    """Whether ``name`` names a user scorer (not a built-in)."""
    return ":" in name or name in entry_points(group=GROUP).names


def file_of(name: str) -> Path | None:
    """The file of a ``path.py:Class`` spec (None for the other kinds)."""
    target = name.rsplit(":", 1)[0] if ":" in name else ""
    return Path(target) if target.endswith(".py") else None


def absolute(name: str) -> str:
    """``name`` with a file spec's path made absolute (a capture replays from anywhere)."""
    path = file_of(name)
    return name if path is None else f"{path.resolve()}:{name.rsplit(':', 1)[1]}"


def file_sha256(name: str) -> str | None:
    """The sha256 of a file spec's file (None for the other kinds)."""
    path = file_of(name)
    if path is None:
        return None
    require(path.is_file(), f"scorer {name}: no such file {path}")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_unchanged(name: str, sha256: str | None) -> None:
    """Refuse (one line) a scorer file whose sha256 is not the one a capture recorded."""
    if sha256 is not None:
        now = file_sha256(name)
        require(now == sha256, f"scorer {name}: the file changed since the capture "
                f"(sha256 {str(now)[:12]}..., recorded {str(sha256)[:12]}...)")


def load(name: str) -> type:
    """The scorer class ``name`` names (file, module or entry point), checked."""
    sha = file_sha256(name) or ""
    if (name, sha) in _CLASSES:
        return _CLASSES[(name, sha)]
    try:
        if ":" in name:
            target, attr = name.rsplit(":", 1)
            path = file_of(name)
            if path is not None:
                spec = importlib.util.spec_from_file_location(f"positronic_user_{sha[:16]}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module  # dataclasses look their module up
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(target)
            cls = getattr(module, attr, None)
            require(cls is not None, f"scorer {name}: {target} has no {attr!r}")
        else:
            (ep,) = [e for e in entry_points(group=GROUP) if e.name == name]
            cls = ep.load()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's code: any error is one line
        raise UserError(f"scorer {name}: cannot load it: {type(e).__name__}: {e}") from None
    require(isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and callable(getattr(cls, "score", None)),
            f"scorer {name}: not a dataclass with a score(view, attention) method")
    _CLASSES[(name, sha)] = cls
    return cls


def _tensors(*objs) -> list[torch.Tensor]:
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif dataclasses.is_dataclass(o):
            out += _tensors(*(getattr(o, f.name) for f in dataclasses.fields(o)))
    return out


@dataclasses.dataclass(frozen=True)
class Guarded:
    """A user scorer run so that its failures are one line (``UserError``) naming it."""

    name: str
    inner: object

    def __getattr__(self, attr):  # its own fields and methods (``prefill``, if it has one)
        if attr == "prefill" and not hasattr(self.inner, "prefill"):
            raise AttributeError(attr)
        if attr == "prefill":
            return lambda view, stats: self._call("prefill", view.n, view, stats)
        return getattr(self.inner, attr)

    def score(self, view, attention: torch.Tensor) -> ScoreOut:
        return self._call("score", view.n, view, attention)

    def _call(self, method: str, n: int, view, *args) -> ScoreOut:
        # copies of the view's ledger columns (its own ones too): a write to them loses nothing
        view = dataclasses.replace(view, **{c: getattr(view, c).clone() for c in VIEW_COLUMNS},
                                   columns={c: t.clone() for c, t in view.columns.items()})
        read = _tensors(view, *args) + list(view.columns.values())
        versions = [t._version for t in read]
        try:
            out = getattr(self.inner, method)(view, *args)
        except Exception as e:  # noqa: BLE001 -- the user's code: any error is one line
            raise UserError(f"scorer {self.name}: {method} raised {type(e).__name__}: {e}") \
                from None
        bad = self._problem(out, n, view.specs) or (
            "it wrote to its input (the view or the attention are read-only)"
            if [t._version for t in read] != versions else None)
        require(bad is None, f"scorer {self.name}: {method}: {bad}")
        return out

    @staticmethod
    def _problem(out, n: int, declared: dict) -> str | None:
        if not isinstance(out, ScoreOut):
            return f"returned {type(out).__name__}, not a ScoreOut"
        columns = out.columns or {}
        if not isinstance(columns, dict) or set(columns) - set(declared):
            return (f"its columns {sorted(columns) if isinstance(columns, dict) else columns} "
                    f"are not among the ledger's ({', '.join(declared) or 'none'})")
        for col, t in {"scores": out.scores, **columns}.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                return f"{col} has shape {shape}, not ({n},)"
            # one read a tensor: its lowest and highest value (a NaN or an infinity shows)
            lo, hi = torch.stack(t.float().aminmax()).tolist() if n else (0.0, 0.0)
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return f"{col} holds NaN or infinite values"
            spec = declared.get(col) if col != "scores" else None
            if spec is not None and n and not (t.dtype == torch.float32 and spec.holds(lo)
                                               and spec.holds(hi)):
                return (f"its column {col} ({t.dtype}) must be float32 within "
                        f"[{spec.low}, {spec.high}]")
        return None
