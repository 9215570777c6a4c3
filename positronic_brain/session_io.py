"""Session export/import: one safetensors file; nothing is ever unpickled.

Tensors: the arena's live prefix ``arena.k`` / ``arena.v`` (L, kv_heads, n, head_dim) and
``arena.log_mass`` (L, kv_heads, n), every ledger column ``ledger.<name>`` (n,) (whatever
``Ledger.COLUMNS`` lists), with recall the cold store's rows alike (``cold.k``, ``cold.v``,
``cold.<column>``, ``cold.entered``), a per-head cache's map ``heads.row`` (L, kv_heads, n:
the ledger row each slot holds, -1 where free) and ``heads.n`` (L, kv_heads) (its ledger
then holds every token some head holds, its scorer columns a value a head; format 8), and
the sampler's generator state ``generator`` (uint8). The
str->str safetensors header holds JSON (``plain.to_plain(..., json=True)``): the model's
fingerprint, the rest of the ledger and state (capacity, next uid, merge history, pending
token, its source and position, step), the session's plain fields (prompt and generated
ids, sampler and cache parameters, ...), the device it was saved from and a sha256 over all
of it, so a modified or truncated file is refused. The write is atomic and from host copies.
Loading checks every shape, dtype, column and token id (K/V finite) and every header
field's type and range here; ``stages.apply.restore`` (stage 0, the only writer) then
writes them back onto the model's device. On the device
type it was saved from, the continuation is bit-exact; on another, kernels round
differently (equal up to the dtype's tolerance) and a generator's state does not carry
over, so sampling restarts from the sampler's seed. The scorer's own ledger columns are
saved like the ledger's, declared by the ledger field ``specs``. Format 6 made them the
scorer's; formats 4 and 5, whose every ledger held brightness (born at the ledger's
``seeds``) and H2O's attn_sum, load with those two as the built-ins declare them. Format 5
added the ledger's origin columns; a format-4 file loads with every row made in its own
session.

A partial session file (``save_session``'s ``rows`` and ``layers``) holds some rows and the
K/V and log-mass of some layers (``arena.k`` (layers held, kv_heads, n, head_dim)), no cold
store, and names the layers in the header entry ``partial``; its accounts (next uid, merge
history, tokens dropped) are the whole session's. ``load_session`` refuses it: only
``compose`` imports it (``load_saved``), rebuilding the missing layers.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from . import options
from .loop import Session
from .model import Model
from .plain import check_types, from_plain, load_signed, read_safetensors, save_signed, to_plain
from .special_tokens import TokenPolicy
from .stages.apply import restore
from .scorers.brightness import Brightness
from .scorers.h2o import H2O
from .state import LEDGER_TENSORS, STATE_PARTS, Ledger, State, key_norms, restore_args
from .types import SOURCES, UserError, inconsistent, require

FORMAT = "positronic-brain-session/9"
# Format 8 held no per-head cold store (``cold.heads.row``, ``cold.heads.n``); it reads as 9.
FORMAT_8 = "positronic-brain-session/8"
# Format 7 held no per-head cache (``heads.row``, ``heads.n``); it reads as 8 without them.
FORMAT_7 = "positronic-brain-session/7"
# Format 6 held CacheParams' 30 flat fields (``_flat_params``).
FORMAT_6 = "positronic-brain-session/6"
# Format 5's ledgers all hold brightness and attn_sum, brightness born at its ``seeds``.
FORMAT_5 = "positronic-brain-session/5"
# Format 4 lacks the ledger's origin columns too: its rows were all made in its own session.
FORMAT_4 = "positronic-brain-session/4"
# Session fields not saved as JSON: rebuilt on load, or (a capture's tape) owned by the
# saving process; a loaded session starts without a capture (``Session.record`` starts one).
RUNTIME = ("model", "policy", "state", "tape")
PARTIAL = "partial"  # the header entry of a partial session file: {"layers": [...]}
# the state's and the ledger's fields a file holds as JSON (not their tensors)
STATE_FIELDS = tuple(f.name for f in dataclasses.fields(State) if f.name not in STATE_PARTS)
LEDGER_FIELDS = tuple(f.name for f in dataclasses.fields(Ledger) if f.name not in LEDGER_TENSORS)


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

def session_tensors(session: Session, rows: torch.Tensor | None = None,
                    layers: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """What a session file holds as tensors, as host copies: the arena's live K/V and
    log-mass, the ledger's columns, the generator's state and the cold store's rows. ``rows``
    (live slots) and ``layers`` (ascending), either given: those rows (all when None) with
    those layers' K/V and log-mass (all when None), no cold store (a partial file)."""
    state = session.state
    require(state is not None, "prime the session before saving it")
    saved = restore_args(state)
    partial = rows is not None or layers is not None
    require(not partial or saved["heads"] is None, "a per-head cache cannot be exported in "
            "part yet (its heads hold other rows)")
    rows = slice(None) if rows is None else rows.to(saved["columns"]["uid"].device)
    cold = None if partial else saved["cold"]
    tensors = {**{f"arena.{x}": _picked(saved[x], layers, rows) for x in ("k", "v", "log_mass")},
               **{f"ledger.{c}": t[rows] for c, t in saved["columns"].items()},
               "generator": session.generator.get_state()}
    if cold is not None:
        tensors |= {"cold.k": cold["k"], "cold.v": cold["v"], "cold.entered": cold["entered"],
                    **{f"cold.{c}": t for c, t in cold["columns"].items()},
                    **{f"cold.heads.{x}": t for x, t in (cold["heads"] or {}).items()}}
    if saved["heads"] is not None:
        tensors |= {f"heads.{x}": t for x, t in saved["heads"].items()}
    return {k: t.to("cpu").contiguous() for k, t in tensors.items()}


def _picked(t: torch.Tensor, layers: tuple[int, ...] | None,
            rows: torch.Tensor | slice) -> torch.Tensor:
    """``t`` (L, kv_heads, n, ...) at ``layers`` (None: all, uncopied) and ``rows``."""
    return (t if layers is None else t[list(layers)])[:, :, rows]


def session_body(session: Session, partial: bool = False) -> dict:
    """What a session file holds as JSON besides the model's fingerprint: the rest of the
    ledger and state, the session's plain fields, the BOS choice and the device (``partial``:
    no cold store)."""
    state = session.state
    require(state is not None, "prime the session before saving it")
    saved = restore_args(state)
    cold = None if partial else saved["cold"]
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


def save_session(session: Session, path: str | os.PathLike, rows: torch.Tensor | None = None,
                 layers: tuple[int, ...] | None = None) -> Path:
    """Write ``session`` (primed) to ``path`` atomically; returns the path. ``rows`` (live
    slots) and ``layers`` (ascending), either given, make it a partial session file: those
    rows (all when None) with those layers' K/V and log-mass (all when None), no cold store."""
    partial = rows is not None or layers is not None
    tensors, body = session_tensors(session, rows, layers), session_body(session, partial)
    meta = {"format": FORMAT, "model": json.dumps(session.model.fingerprint),
            "session": json.dumps(body)}
    if partial:
        every = range(session.model.spec.n_layers)
        meta[PARTIAL] = json.dumps({"layers": list(every if layers is None else layers)})
    return save_signed(path, tensors, meta)


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
    where it stopped. Anything else, a partial session file included, raises UserError (one
    line)."""
    session, partial = load_saved(model, path)
    if partial is not None:
        raise UserError(f"{path}: a partial session ({partial['k'].shape[2]} rows, layers "
                        f"{spans(partial['layers'])} of {model.spec.n_layers}): import it "
                        "with compose")
    return session


def spans(ints: tuple[int, ...]) -> str:
    """Ascending integers as runs, ``0-11,20,22-29`` (``none`` when there are none)."""
    runs: list[list[int]] = []
    for i in ints:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


def load_saved(model: Model, path: str | os.PathLike) -> tuple[Session, dict | None]:
    """Read a session file, whole or partial, into ``model`` (checked as ``load_session``
    says). A whole one: (the session, None). A partial one: a session without a state (its
    sampler with the generator's state, cache parameters and text record) and what the file
    holds of its state, as ``compose.Part`` takes it: ``k``, ``v`` (layers held, kv_heads,
    n, head_dim), ``log_mass``, ``columns``, ``capacity``, ``state_fields``,
    ``ledger_fields`` and ``layers`` (the layers held, ascending)."""
    meta, tensors = load_signed(path, (FORMAT, FORMAT_8, FORMAT_7, FORMAT_6, FORMAT_5,
                                             FORMAT_4),
                                "session file")
    if meta["format"] == FORMAT_4:
        tensors |= _made_here(tensors)
    with inconsistent(path, "session", name_refusals=True):
        saved, body = json.loads(meta["model"]), json.loads(meta["session"])
        if meta["format"] in (FORMAT_5, FORMAT_4):
            body["ledger"] = _declared(body["ledger"])
        if meta["format"] in (FORMAT_6, FORMAT_5, FORMAT_4):
            body["session"] = _flat_params(body["session"])
        diff = _mismatch(saved, model.fingerprint)
        require(diff is None, f"saved from model {saved.get('name')!r}, it cannot load into "
                f"{model.name!r}: {diff}")
        if PARTIAL not in meta:
            return restore_session(model, tensors, body), None
        layers = _held(model, meta)
        columns, fields, ledger = _checked(model, tensors, body, len(layers))
        dev = model.device  # a part's rows join the others there
        partial = {**{x: tensors[f"arena.{x}"].to(dev) for x in ("k", "v", "log_mass")},
                   "columns": {c: t.to(dev) for c, t in columns.items()},
                   "capacity": body["capacity"], "state_fields": fields,
                   "ledger_fields": ledger, "layers": layers}
        return _session(model, tensors, body, None), partial


def restore_session(model: Model, tensors: dict[str, torch.Tensor], body: dict) -> Session:
    """A session of ``model`` from a session file's ``tensors`` and ``body``
    (``session_tensors``, ``session_body``), every shape, dtype, column and token id checked
    against ``model``, written back by stage 0 (``stages.apply.restore``). The generator's
    state carries over from the same device type only."""
    columns, fields, ledger = _checked(model, tensors, body, model.spec.n_layers)
    cold = _saved_cold(model, tensors, body["cold"], ledger)
    require(cold is None or (cold["heads"] is None) == ("heads.n" not in tensors),
            "a per-head cold store beside a whole-token cache, or the other way")
    state = restore(model, tensors["arena.k"], tensors["arena.v"], columns, body["capacity"],
                    ledger, fields, tensors["arena.log_mass"], cold, _saved_heads(tensors))
    return _session(model, tensors, body, state)


def _checked(model: Model, tensors: dict[str, torch.Tensor], body: dict,
             layers: int) -> tuple[dict, dict, dict]:
    """A file's ledger columns, state and ledger fields, checked against ``model`` (of
    whose layers it holds ``layers``)."""
    columns = {k.removeprefix("ledger."): t for k, t in tensors.items() if k.startswith("ledger.")}
    fields = from_plain(body["state"])
    ledger = {"origins": (), **from_plain(body["ledger"])}  # format 4: every row made here
    _check_fields(model, fields, ledger)
    _check_saved(model, tensors, columns, body["capacity"], fields["pending_token"], layers,
                 ledger)
    return columns, fields, ledger


def _check_fields(model: Model, fields: dict, ledger: dict) -> None:
    """A file's state and ledger fields: each one there and of its type, the counts and
    the next position (within the model's) not negative, the sources known."""
    for what, cls, saved, names in (("state", State, fields, STATE_FIELDS),
                                    ("ledger", Ledger, ledger, LEDGER_FIELDS)):
        require(sorted(saved) == sorted(names),
                f"{what} fields {sorted(saved)} differ from {sorted(names)}")
        check_types(cls, saved, f"the saved {what}")
    counts = (fields["step"], ledger["next_uid"], ledger["dropped"])
    require(0 <= fields["next_position"] <= model.spec.max_positions
            and all(0 <= c < 2 ** 63 for c in counts),
            f"next position {fields['next_position']}, step, next uid or dropped {counts} out "
            f"of range (the model has {model.spec.max_positions} positions)")
    require(fields["pending_source"] in SOURCES and set(fields["pinned"]) <= set(SOURCES),
            f"unknown sources {fields['pending_source']!r:.40}, {fields['pinned']!r:.40}")


def _flat_params(session: dict) -> dict:
    """A format 4-6 file's session fields (plain JSON) as this format has them: its cache
    parameters, CacheParams' 30 flat fields then, are the options of the same names
    (``scorer`` is ``policy``, ``scorer_params`` the ``param`` items), each where its
    scorer or piece takes it."""
    flat = {k: from_plain(v) for k, v in session["cache_params"].items() if k != "__type__"}
    flat["policy"] = flat.pop("scorer")
    flat["param"] = [i for i in flat.pop("scorer_params", "").split(",") if i.strip()]
    flat["allocation"] = "turns" if flat.pop("prune", "tokens") == "turns" else "token"
    params = options.cache_params(flat, strict=False)
    return {**session, "cache_params": to_plain(params, json=True)}


def _declared(ledger: dict) -> dict:
    """A format-4 or -5 file's ledger fields (plain JSON) as format 6 has them: its
    ``seeds`` become the declarations of the two scorer columns every ledger held then,
    brightness (at most 255) and attn_sum, as ``Brightness`` and ``H2O`` declare them."""
    seeds = from_plain(ledger.pop("seeds"))
    require(isinstance(seeds, tuple), f"seeds {seeds!r:.60} are not a tuple")
    specs = {**Brightness.declared(seeds, 255.0), **H2O.columns}
    return {**ledger, "specs": to_plain(specs, json=True)}


def _session(model: Model, tensors: dict[str, torch.Tensor], body: dict,
             state: State | None) -> Session:
    """The file's session around ``state``; the generator's state carries over from the
    same device type only."""
    saved = from_plain(body["session"])
    check_types(Session, saved, "the saved session")
    session = Session(model, TokenPolicy(model.tokenizer, bos="yes" if body["bos"] else "no"),
                      state=state, **saved)
    if torch.device(body.get("device", "cpu")).type == model.device.type:
        session.generator.set_state(tensors["generator"])
    return session


def _held(model: Model, meta: dict[str, str]) -> tuple[int, ...]:
    """The layers a session file holds: a partial one's, checked (ascending, distinct, of
    ``model``); every layer for a whole one."""
    every = tuple(range(model.spec.n_layers))
    if PARTIAL not in meta:
        return every
    layers = tuple(json.loads(meta[PARTIAL])["layers"])
    require(all(type(i) is int for i in layers) and list(layers) == sorted(set(layers))
            and set(layers) <= set(every), f"partial layers {list(layers)[:4]} are not "
            f"ascending layers of the model's {len(every)}")
    return layers


def _made_here(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The origin columns of a format-4 file's ledgers: every row made in its own session."""
    out = {}
    for part in ("ledger", "cold"):
        uid = tensors.get(f"{part}.uid")
        if uid is not None:
            out[f"{part}.origin"] = torch.zeros(uid.shape, dtype=torch.int32)
            out[f"{part}.origin_uid"] = torch.full(uid.shape, -1, dtype=torch.int64)
    return out


def _saved_cold(model: Model, tensors: dict[str, torch.Tensor], body: dict | None,
                ledger: dict) -> dict | None:
    """The saved cold store, checked like the arena (shapes, dtypes, columns and origins as
    the ``ledger`` fields declare them, token ids): what ``restore`` takes, or None."""
    if body is None:
        return None
    s = model.spec
    require(all(type(body.get(x)) is int and 0 <= body[x] < 2 ** 63
                for x in ("capacity", "next_entry")),
            f"cold store {body!r:.60}: its capacity and next entry must be counts")
    k, v, entered = tensors["cold.k"], tensors["cold.v"], tensors["cold.entered"]
    shape = _check_kv(model, k, v, "cold ")
    heads = _saved_heads(tensors, "cold.heads.")
    columns = {c.removeprefix("cold."): t for c, t in tensors.items()
               if c.startswith("cold.") and not c.startswith("cold.heads.")
               and c not in ("cold.k", "cold.v", "cold.entered")}
    n = shape[2] if heads is None else _check_heads(heads, shape, columns)
    require(0 <= shape[2] <= body["capacity"] and entered.shape == (n,)
            and entered.dtype == torch.int64, f"{n} cold rows in a capacity of {body['capacity']}")
    _check_columns(columns, n, ledger, () if heads is None else shape[:2])
    require(bool(((columns["token_id"] >= 0) & (columns["token_id"] < s.vocab)).all()),
            "a saved cold token id is outside the vocabulary")
    return {"k": k, "v": v, "columns": columns, "entered": entered, "heads": heads, **body}


def _check_kv(model: Model, k: torch.Tensor, v: torch.Tensor, what: str = "",
              layers: int | None = None) -> tuple:
    """Saved K/V (L, kv_heads, n, head_dim) of ``model``'s shape and dtype (``layers``
    instead of L: a partial file's), finite with finite float32 norms: their shape."""
    s = model.spec
    n = k.shape[2] if k.dim() == 4 else -1
    shape = (s.n_layers if layers is None else layers, s.n_kv_heads, n, s.head_dim)
    require(tuple(k.shape) == tuple(v.shape) == shape and k.dtype == v.dtype == model.dtype,
            f"saved {what}K/V {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype} do not "
            f"fit this model's {shape} {model.dtype}")
    require(all(bool(torch.isfinite(key_norms(x)).all()) for x in (k, v)),
            f"saved {what}K/V hold values that are not finite, or whose norms are not")
    return shape


def _check_columns(columns: dict[str, torch.Tensor], n: int, ledger: dict,
                   per_head: tuple[int, ...] = ()) -> None:
    """Exactly ``Ledger.COLUMNS`` and the scorer columns the ``ledger`` fields' ``specs``
    declare, each (n,) of its dtype (a per-head cache's scorer columns (n, *``per_head``):
    (L, kv_heads)); each row's origin in the fields' ``origins`` table (origin uid -1 for
    the rows made here, and only for them)."""
    empty = Ledger.allocate(1, ledger["specs"])
    require(sorted(columns) == sorted(empty.names),
            f"ledger columns {sorted(columns)} differ from {sorted(empty.names)}")
    for c in empty.names:
        want = empty.col(c).dtype
        shape = (n,) + (per_head if c in empty.columns else ())
        require(columns[c].shape == shape and columns[c].dtype == want,
                f"ledger column {c}: {tuple(columns[c].shape)} {columns[c].dtype}, "
                f"expected {shape} {want}")
    origin, there = columns["origin"], columns["origin_uid"]
    require(bool(((origin >= 0) & (origin <= len(ledger["origins"]))).all())
            and bool(((origin == 0) == (there == -1)).all()) and bool((there >= -1).all()),
            f"a row's origin is outside the file's {len(ledger['origins'])} origins, or its "
            "origin uid does not fit it")


def _saved_heads(tensors: dict[str, torch.Tensor],
                 prefix: str = "heads.") -> dict[str, torch.Tensor] | None:
    """A per-head cache's saved map, ``row`` and ``n`` (None: a whole-token file; with
    ``prefix`` ``cold.heads.``, its cold store's)."""
    return ({x: tensors[f"{prefix}{x}"] for x in ("row", "n")} if f"{prefix}n" in tensors
            else None)


def _check_heads(heads: dict[str, torch.Tensor], shape: tuple,
                 columns: dict[str, torch.Tensor]) -> int:
    """A per-head cache's saved map (``row`` (L, kv_heads, n), ``n`` (L, kv_heads); the
    arena's K/V ``shape``) of int64 within its slots and ledger rows: the ledger's rows."""
    row, count = heads["row"], heads["n"]
    rows = columns["uid"].shape[0] if "uid" in columns else -1
    require(tuple(row.shape) == shape[:3] and tuple(count.shape) == shape[:2]
            and row.dtype == count.dtype == torch.int64, f"saved head map "
            f"{tuple(row.shape)} {row.dtype} and counts {tuple(count.shape)} {count.dtype} do "
            f"not fit {shape[:3]} torch.int64")
    require(rows >= 0 and bool(((row >= -1) & (row < rows)).all())
            and bool(((count >= 0) & (count <= shape[2])).all()), f"a saved head holds a "
            f"row outside the ledger's {rows}, or more slots than the arena's {shape[2]}")
    return rows


def _check_saved(model: Model, tensors: dict[str, torch.Tensor], columns: dict[str, torch.Tensor],
                 capacity: int, pending_token: int, layers: int, ledger: dict) -> None:
    """Every saved tensor fits ``model`` (``layers`` of its layers) and the ledger: shapes,
    dtypes, columns, token ids."""
    s = model.spec
    k, v, log_mass = tensors["arena.k"], tensors["arena.v"], tensors["arena.log_mass"]
    shape = _check_kv(model, k, v, layers=layers)
    n = shape[2]
    require(type(capacity) is int and 0 <= n <= capacity <= s.max_positions,
            f"{n} live slots in a capacity of {capacity} (the model has {s.max_positions} positions)")
    require(tuple(log_mass.shape) == shape[:3] and log_mass.dtype == torch.float32
            and bool(torch.isfinite(log_mass).all()) and bool((log_mass >= 0).all()),
            f"saved log-mass {tuple(log_mass.shape)} {log_mass.dtype} does not fit {shape[:3]} "
            "torch.float32, finite and >= 0")
    heads = _saved_heads(tensors)
    rows = n if heads is None else _check_heads(heads, shape, columns)
    _check_columns(columns, rows, ledger, () if heads is None else shape[:2])
    saved = columns["token_id"]
    ids = torch.cat((saved, torch.tensor([pending_token], device=saved.device)))
    require(bool(((ids >= 0) & (ids < s.vocab)).all()), "a saved token id is outside the vocabulary")
