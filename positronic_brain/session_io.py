"""Session export/import: one safetensors file; nothing is ever unpickled.

Tensors: the arena's live prefix ``arena.k`` / ``arena.v`` (L, kv_heads, n, head_dim) and
``arena.log_mass`` (L, kv_heads, n), every ledger column ``ledger.<name>`` (n,) (whatever
``Ledger.COLUMNS`` lists), with recall the cold store's rows alike (``cold.k``, ``cold.v``,
``cold.<column>``, ``cold.entered``), and the sampler's generator state ``generator``
(uint8). The
str->str safetensors header holds JSON (``plain.to_plain(..., json=True)``): the model's
fingerprint, the rest of the ledger and state (capacity, next uid, merge history, pending
token, its source and position, step), the session's plain fields (prompt and generated
ids, sampler and cache parameters, ...), the device it was saved from and a sha256 over all
of it, so a modified or truncated file is refused. The write is atomic and from host copies.
Loading checks every shape, dtype, column and token id here; ``stages.apply.restore``
(stage 0, the only writer) then writes them back onto the model's device. On the device
type it was saved from, the continuation is bit-exact; on another, kernels round
differently (equal up to the dtype's tolerance) and a generator's state does not carry
over, so sampling restarts from the sampler's seed. Format 5 added the ledger's origin
columns; a format-4 file loads with every row made in its own session.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from .loop import Session
from .model import Model
from .plain import from_plain, load_signed, read_safetensors, save_signed, to_plain
from .special_tokens import TokenPolicy
from .stages.apply import restore
from .state import Ledger, State, restore_args
from .types import UserError, require

FORMAT = "positronic-brain-session/5"
# Format 4 lacks the ledger's origin columns: its rows were all made in its own session.
FORMAT_4 = "positronic-brain-session/4"
# Session fields not saved as JSON: rebuilt on load, or (a capture's tape) owned by the
# saving process; a loaded session starts without a capture (``Session.record`` starts one).
RUNTIME = ("model", "policy", "state", "tape")


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

def session_tensors(session: Session) -> dict[str, torch.Tensor]:
    """What a session file holds as tensors, as host copies: the arena's live K/V and
    log-mass, the ledger's columns, the generator's state and the cold store's rows."""
    state = session.state
    require(state is not None, "prime the session before saving it")
    saved = restore_args(state)
    cold = saved["cold"]
    tensors = {"arena.k": saved["k"], "arena.v": saved["v"], "arena.log_mass": saved["log_mass"],
               **{f"ledger.{c}": t for c, t in saved["columns"].items()},
               "generator": session.generator.get_state()}
    if cold is not None:
        tensors |= {"cold.k": cold["k"], "cold.v": cold["v"], "cold.entered": cold["entered"],
                    **{f"cold.{c}": t for c, t in cold["columns"].items()}}
    return {k: t.to("cpu").contiguous() for k, t in tensors.items()}


def session_body(session: Session) -> dict:
    """What a session file holds as JSON besides the model's fingerprint: the rest of the
    ledger and state, the session's plain fields, the BOS choice and the device."""
    state = session.state
    require(state is not None, "prime the session before saving it")
    saved = restore_args(state)
    cold = saved["cold"]
    return {
        "capacity": saved["capacity"],
        "ledger": {k: to_plain(v, json=True) for k, v in saved["ledger_fields"].items()},
        "state": {k: to_plain(v, json=True) for k, v in saved["state_fields"].items()},
        "cold": None if cold is None else {"capacity": cold["capacity"],
                                           "next_entry": cold["next_entry"]},
        "session": {f.name: to_plain(getattr(session, f.name), json=True)
                    for f in dataclasses.fields(Session) if f.name not in RUNTIME},
        "bos": session.policy.add_bos,
        "device": str(session.model.device),
    }


def save_session(session: Session, path: str | os.PathLike) -> Path:
    """Write ``session`` (primed) to ``path`` atomically; returns the path."""
    tensors, body = session_tensors(session), session_body(session)
    return save_signed(path, tensors, {"format": FORMAT,
                                       "model": json.dumps(session.model.fingerprint),
                                       "session": json.dumps(body)})


def saved_model(path: str | os.PathLike) -> tuple[str, str]:
    """The name and dtype of the model a session file was saved from (what ``load_model``
    takes), read from its header."""
    meta = read_safetensors(path, "session file")[0]
    try:
        saved = json.loads(meta["model"])
        return str(saved["name"]), str(saved["dtype"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{path}: not a session file (no model in its header)") from None


def load_session(model: Model, path: str | os.PathLike) -> Session:
    """Read a session saved by ``save_session`` into ``model``, which must be the model it
    was saved from (architecture, dtype, rope, weights); the session continues exactly
    where it stopped. Anything else raises UserError (one line)."""
    meta, tensors = load_signed(path, (FORMAT, FORMAT_4), "session file")
    if meta["format"] == FORMAT_4:
        tensors |= _made_here(tensors)
    try:
        saved, body = json.loads(meta["model"]), json.loads(meta["session"])
        diff = _mismatch(saved, model.fingerprint)
        require(diff is None, f"saved from model {saved.get('name')!r}, it cannot load into "
                f"{model.name!r}: {diff}")
        return restore_session(model, tensors, body)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (AssertionError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: inconsistent session ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None


def restore_session(model: Model, tensors: dict[str, torch.Tensor], body: dict) -> Session:
    """A session of ``model`` from a session file's ``tensors`` and ``body``
    (``session_tensors``, ``session_body``), every shape, dtype, column and token id checked
    against ``model``, written back by stage 0 (``stages.apply.restore``). The generator's
    state carries over from the same device type only."""
    columns = {k.removeprefix("ledger."): t for k, t in tensors.items() if k.startswith("ledger.")}
    cold = _saved_cold(model, tensors, body["cold"])
    fields, ledger = from_plain(body["state"]), from_plain(body["ledger"])
    _check_saved(model, tensors, columns, body["capacity"], fields["pending_token"])
    for what, cls, saved in (("state", State, fields), ("ledger", Ledger, ledger)):
        unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(cls)})
        require(not unknown, f"unknown {what} field {unknown[:1]}")
    state = restore(model, tensors["arena.k"], tensors["arena.v"], columns, body["capacity"],
                    ledger, fields, tensors["arena.log_mass"], cold)
    session = Session(model, TokenPolicy(model.tokenizer, bos="yes" if body["bos"] else "no"),
                      state=state, **from_plain(body["session"]))
    if torch.device(body.get("device", "cpu")).type == model.device.type:
        session.generator.set_state(tensors["generator"])
    return session


def _made_here(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The origin columns of a format-4 file's ledgers: every row made in its own session."""
    out = {}
    for part in ("ledger", "cold"):
        uid = tensors.get(f"{part}.uid")
        if uid is not None:
            out[f"{part}.origin"] = torch.zeros(uid.shape, dtype=torch.int32)
            out[f"{part}.origin_uid"] = torch.full(uid.shape, -1, dtype=torch.int64)
    return out


def _saved_cold(model: Model, tensors: dict[str, torch.Tensor], body: dict | None) -> dict | None:
    """The saved cold store, checked like the arena (shapes, dtypes, columns, token ids):
    what ``restore`` takes, or None."""
    if body is None:
        return None
    s = model.spec
    k, v, entered = tensors["cold.k"], tensors["cold.v"], tensors["cold.entered"]
    n = _check_kv(model, k, v, "cold ")[2]
    require(0 <= n <= body["capacity"] and entered.shape == (n,)
            and entered.dtype == torch.int64, f"{n} cold rows in a capacity of {body['capacity']}")
    columns = {c: tensors[f"cold.{c}"] for c in Ledger.COLUMNS}
    _check_columns(columns, n)
    require(bool(((columns["token_id"] >= 0) & (columns["token_id"] < s.vocab)).all()),
            "a saved cold token id is outside the vocabulary")
    return {"k": k, "v": v, "columns": columns, "entered": entered, **body}


def _check_kv(model: Model, k: torch.Tensor, v: torch.Tensor, what: str = "") -> tuple:
    """Saved K/V (L, kv_heads, n, head_dim) of ``model``'s shape and dtype: their shape."""
    s = model.spec
    n = k.shape[2] if k.dim() == 4 else -1
    shape = (s.n_layers, s.n_kv_heads, n, s.head_dim)
    require(tuple(k.shape) == tuple(v.shape) == shape and k.dtype == v.dtype == model.dtype,
            f"saved {what}K/V {tuple(k.shape)} {k.dtype} do not fit this model's {shape} "
            f"{model.dtype}")
    return shape


def _check_columns(columns: dict[str, torch.Tensor], n: int) -> None:
    """Exactly ``Ledger.COLUMNS``, each (n,) of its dtype."""
    require(sorted(columns) == sorted(Ledger.COLUMNS),
            f"ledger columns {sorted(columns)} differ from {sorted(Ledger.COLUMNS)}")
    empty = Ledger.allocate(1)
    for c in Ledger.COLUMNS:
        want = getattr(empty, c).dtype
        require(columns[c].shape == (n,) and columns[c].dtype == want,
                f"ledger column {c}: {tuple(columns[c].shape)} {columns[c].dtype}, "
                f"expected ({n},) {want}")


def _check_saved(model: Model, tensors: dict[str, torch.Tensor], columns: dict[str, torch.Tensor],
                 capacity: int, pending_token: int) -> None:
    """Every saved tensor fits ``model`` and the ledger: shapes, dtypes, columns, token ids."""
    s = model.spec
    k, v, log_mass = tensors["arena.k"], tensors["arena.v"], tensors["arena.log_mass"]
    shape = _check_kv(model, k, v)
    n = shape[2]
    require(0 <= n <= capacity <= s.max_positions,
            f"{n} live slots in a capacity of {capacity} (the model has {s.max_positions} positions)")
    require(tuple(log_mass.shape) == shape[:3] and log_mass.dtype == torch.float32
            and bool(torch.isfinite(log_mass).all()) and bool((log_mass >= 0).all()),
            f"saved log-mass {tuple(log_mass.shape)} {log_mass.dtype} does not fit {shape[:3]}")
    _check_columns(columns, n)
    saved = columns["token_id"]
    ids = torch.cat((saved, torch.tensor([pending_token], device=saved.device)))
    require(bool(((ids >= 0) & (ids < s.vocab)).all()), "a saved token id is outside the vocabulary")
