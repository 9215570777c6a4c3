"""Session export/import: one safetensors file; nothing is ever unpickled.

Tensors: the arena's live prefix ``arena.k`` / ``arena.v`` (L, kv_heads, n, head_dim) and
``arena.log_mass`` (L, kv_heads, n) (folded slots; optional on reading), every
ledger column ``ledger.<name>`` (n,) (whatever ``Ledger.COLUMNS`` lists) and the sampler's
generator state ``generator`` (uint8). The str->str safetensors header holds JSON: the model's
fingerprint, the rest of the ledger and state (capacity, next uid, repair history, pending
token, its source and position, step), the session's plain fields (prompt and generated ids,
sampler and cache params, ...) and a sha256 over all of it, so a modified or truncated file
is refused. The write is atomic (temp file + rename). The arena and ledger are written back
by ``stages.apply.restore``, the only module that writes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from . import types as _types
from .capture import _atomic_write
from .loop import Session
from .model import Model
from .special_tokens import TokenPolicy
from .stages.apply import restore
from .state import Ledger, State
from .types import UserError, require

FORMAT = "positronic-brain-session/1"
# Session fields not saved as JSON: rebuilt on load, or (a capture run folder) owned by the
# saving process; a loaded session starts without a capture.
RUNTIME = ("model", "policy", "state", "capture")


# --- plain JSON with exact types: tuples, int-keyed dicts and our frozen dataclasses ------

def _plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__name__,
                **{f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, tuple):
        return {"__tuple__": [_plain(v) for v in x]}
    if isinstance(x, dict):
        return {"__pairs__": [[_plain(k), _plain(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot save a {type(x).__name__} in a session file")


def _unplain(x):
    if isinstance(x, list):
        return [_unplain(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tuple__" in x:
        return tuple(_unplain(v) for v in x["__tuple__"])
    if "__pairs__" in x:
        return {_unplain(k): _unplain(v) for k, v in x["__pairs__"]}
    cls = getattr(_types, str(x.get("__type__")), None)  # only our own frozen dataclasses
    require(dataclasses.is_dataclass(cls) and cls.__module__ == _types.__name__,
            f"unknown saved type {x.get('__type__')!r}")
    return cls(**{k: _unplain(v) for k, v in x.items() if k != "__type__"})  # validated


def _unplain_fields(d: dict) -> dict:
    return {k: _unplain(v) for k, v in d.items()}


def _digest(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(meta):
        if key != "sha256":
            h.update(f"{key}\0{meta[key]}\0".encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mismatch(saved: dict, ours: dict) -> str | None:
    """The first difference between two model fingerprints, named; None when they agree."""
    checks = [("architecture", saved.get("model_type"), ours["model_type"]),
              ("dtype", saved.get("dtype"), ours["dtype"])]
    checks += [(k, v, ours["spec"].get(k)) for k, v in (saved.get("spec") or {}).items()]
    checks += [("rope parameters", saved.get("rope"), ours["rope"]),
               ("weights", saved.get("weights"), ours["weights"])]
    for what, theirs, mine in checks:
        if theirs != mine:
            return f"{what} {theirs} != {mine}"
    return None


# --- export / import ----------------------------------------------------------------------

def save_session(session: Session, path: str | os.PathLike) -> Path:
    """Write ``session`` (primed) to ``path`` atomically; returns the path."""
    state = session.state
    require(state is not None, "prime the session before saving it")
    a, m = state.arena, state.ledger
    tensors = {"arena.k": a.k[:, :, :a.n].contiguous(), "arena.v": a.v[:, :, :a.n].contiguous(),
               "arena.log_mass": a.log_mass[:, :, :a.n].contiguous(),
               **{f"ledger.{c}": m.live(c).contiguous() for c in Ledger.COLUMNS},
               "generator": session.generator.get_state()}
    body = {
        "capacity": a.capacity,
        "ledger": {f.name: _plain(getattr(m, f.name)) for f in dataclasses.fields(Ledger)
                   if f.name not in Ledger.COLUMNS and f.name != "n"},
        "state": {f.name: _plain(getattr(state, f.name)) for f in dataclasses.fields(State)
                  if f.name not in ("arena", "ledger")},
        "session": {f.name: _plain(getattr(session, f.name)) for f in dataclasses.fields(Session)
                    if f.name not in RUNTIME},
        "bos": session.policy.add_bos,
    }
    meta = {"format": FORMAT, "model": json.dumps(session.model.fingerprint),
            "session": json.dumps(body)}
    meta["sha256"] = _digest(meta, tensors)
    path = Path(path)
    try:
        _atomic_write(path, st_save(tensors, metadata=meta))
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    return path


def load_session(model: Model, path: str | os.PathLike) -> Session:
    """Read a session saved by ``save_session`` into ``model``, which must be the model it
    was saved from (architecture, dtype, rope, weights); the session continues exactly
    where it stopped. Anything else raises UserError (one line)."""
    path = Path(path)
    require(path.is_file(), f"no session file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # truncated, not safetensors, unreadable ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise UserError(f"{path}: not a readable session file ({first})") from None
    require(meta.get("format") == FORMAT, f"{path}: not a session file of format {FORMAT}")
    require(meta.get("sha256") == _digest(meta, tensors),
            f"{path}: the session file is corrupt (sha256 mismatch)")
    try:
        saved, body = json.loads(meta["model"]), json.loads(meta["session"])
        diff = _mismatch(saved, model.fingerprint)
        require(diff is None, f"saved from model {saved.get('name')!r}, it cannot load into "
                f"{model.name!r}: {diff}")
        state = restore(model, tensors["arena.k"], tensors["arena.v"],
                        {k.removeprefix("ledger."): t for k, t in tensors.items()
                         if k.startswith("ledger.")},  # restore names a missing/extra column
                        body["capacity"], _unplain_fields(body["ledger"]),
                        _unplain_fields(body["state"]), tensors.get("arena.log_mass"))
        session = Session(model, TokenPolicy(model.tokenizer, bos="yes" if body["bos"] else "no"),
                          state=state, **_unplain_fields(body["session"]))
        session.generator.set_state(tensors["generator"])
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (AssertionError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: inconsistent session ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return session
