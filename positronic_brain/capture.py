"""Capture: the loop saves every stage call's inputs and outputs as plain data.

A run folder ``DIR/<run-id>/`` holds ``manifest.json`` and one file per stage call,
``<step:06d>_<stage>.pt``: a dict of tensors, ints, floats, strings, lists, tuples and
dicts only, so ``torch.load(..., weights_only=True)`` reads it and nothing is ever
unpickled. Stage dataclasses become dicts tagged with ``"__type__"`` (a name from
``positronic_brain.types``, looked up in a fixed table on the way back). Every write is
atomic (temp file + rename); the manifest lists each whole file with its sha256, so an
interrupted run leaves whole files and a manifest that says how far it got.

Stages don't know capture exists: the loop calls ``CaptureWriter.save`` between them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import platform
import time
from pathlib import Path

import torch

from . import types as _types
from .types import UserError

FORMAT = 1
STAGES = ("s0_prime", "s1_generate", "s2_score", "s3_decide", "s4_apply")
EXTEND = "s0_extend"  # stage 0 on the live state between steps (a chat turn), named by the step
FILE_KEYS = ("format", "stage", "step", "model", "inputs", "outputs", "cache_len", "arena_version")
MANIFEST_EVERY = 50  # past this many files the manifest is rewritten every N saves (and at close)


# --- plain data ---------------------------------------------------------------------------

def _plain_types() -> dict[str, type]:
    return {n: c for n, c in vars(_types).items()
            if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == _types.__name__}


def to_plain(x):
    """Dataclasses, tensors and containers -> plain data. Tensors are cloned: a view of the
    arena would otherwise save the whole preallocated storage."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__name__,
                **{f.name: to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(to_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    if isinstance(x, frozenset):
        return tuple(sorted(x))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    raise TypeError(f"cannot capture a {type(x).__name__} as plain data")


def from_plain(x):
    """The inverse of ``to_plain``: ``"__type__"`` dicts become the named dataclass."""
    if isinstance(x, dict):
        if "__type__" in x:
            cls = _plain_types().get(x["__type__"])
            if cls is None:
                raise UserError(f"unknown captured type {x['__type__']!r}")
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: from_plain(v) for k, v in x.items() if k in names})
        return {k: from_plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [from_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(from_plain(v) for v in x)
    return x


# --- files --------------------------------------------------------------------------------

def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def versions() -> dict:
    import transformers

    from . import __version__
    return {"positronic_brain": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


class CaptureWriter:
    """Writes one run folder. ``level`` is ``light`` (stage files) or ``full`` (also the
    whole live state before each stage-1 call)."""

    def __init__(self, root: str | os.PathLike, manifest: dict, level: str = "light",
                 run_id: str | None = None):
        if level not in ("light", "full"):
            raise UserError(f"capture level must be light or full, got {level!r}")
        given = run_id is not None
        base = run_id or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        for i in range(1, 1000):  # a generated id takes the next free suffix; a given one must be free
            run_id = base if i == 1 else f"{base}-{i}"
            self.dir = Path(root) / run_id
            try:
                self.dir.mkdir(parents=True, exist_ok=False)
                break
            except FileExistsError:
                if given:
                    raise UserError(f"capture folder {self.dir} exists already") from None
            except OSError as e:
                raise UserError(f"cannot create capture folder {self.dir}: {e.strerror}") from None
        self.model = manifest.get("fingerprint", manifest.get("model"))
        self.manifest = {"format": FORMAT, "run_id": run_id, "level": level,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
                         **manifest, "complete": False, "stop_reason": None, "last_step": None,
                         "last_file": None, "files": {}}
        self.level = level
        self._unsaved = 0
        self._write_manifest()

    def save(self, step: int, stage: str, inputs: dict, outputs: dict, cache_len: int,
             arena_version: int) -> Path:
        assert stage in STAGES or stage == EXTEND, stage
        name = f"{step:06d}_{stage}.pt"
        data = _to_bytes({"format": FORMAT, "stage": stage, "step": step, "model": self.model,
                          "inputs": to_plain(inputs), "outputs": to_plain(outputs),
                          "cache_len": cache_len, "arena_version": arena_version})
        return self._add(name, data, step)

    def save_state(self, step: int, state: dict) -> Path:
        """``state``: plain live state (see ``loop.live_state``), written when level is full."""
        return self._add(f"state_{step:06d}.pt", _to_bytes(to_plain(state)), step)

    def _add(self, name: str, data: bytes, step: int) -> Path:
        path = self.dir / name
        _atomic_write(path, data)
        files = self.manifest["files"]
        files[name] = sha256(data)
        self.manifest["last_step"], self.manifest["last_file"] = step, name
        self._unsaved += 1
        if len(files) <= MANIFEST_EVERY or self._unsaved >= MANIFEST_EVERY:
            self._write_manifest()
        return path

    def close(self, stop_reason: str | None, complete: bool = True) -> None:
        self.manifest["complete"] = complete
        self.manifest["stop_reason"] = stop_reason
        self._write_manifest()

    def _write_manifest(self) -> None:
        _atomic_write(self.dir / "manifest.json",
                      json.dumps(self.manifest, indent=1, sort_keys=False).encode())
        self._unsaved = 0


# --- reading ------------------------------------------------------------------------------

def read_manifest(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no manifest.json in {run_dir}: not a capture run folder") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable manifest ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise UserError(f"{path}: not a capture manifest of format {FORMAT}")
    return manifest


def load_file(path: str | os.PathLike, expected_sha256: str | None = None,
              model: str | None = None) -> dict:
    """Read one capture file as plain data; a wrong checksum, a truncated or non-plain file,
    or a file from another model raises ``UserError`` (one line). Nothing is unpickled."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if expected_sha256 is not None and sha256(data) != expected_sha256:
        raise UserError(f"{path.name}: sha256 differs from the manifest (modified or truncated)")
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, pickled objects refused by weights_only, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise UserError(f"{path.name}: not a plain-data capture file ({first})") from None
    if path.name.startswith("state_"):
        if not isinstance(obj, dict) or "arena_k" not in obj:
            raise UserError(f"{path.name}: not a captured state")
        return obj
    if not isinstance(obj, dict) or any(k not in obj for k in FILE_KEYS) \
            or obj["format"] != FORMAT or obj["stage"] not in (*STAGES, EXTEND):
        raise UserError(f"{path.name}: not a capture file of format {FORMAT}")
    if model is not None and obj["model"] != model:
        raise UserError(f"{path.name}: captured from model {obj['model']!r}, not {model!r}")
    return obj


# --- what the loop captures of the state (read-only) ---------------------------------------

VIEW_COLUMNS = ("uid", "token_id", "position", "source", "brightness", "flags", "born_step",
                "attn_sum")


def view_columns(view) -> dict:
    """The view's ledger columns and scalars (no K/V): what a scorer or inspect needs."""
    return {**{c: getattr(view, c) for c in VIEW_COLUMNS},
            "pending_token": view.pending_token, "next_position": view.next_position,
            "step": view.step, "n": view.n, "capacity": view.capacity}


def generate_outputs(gen) -> dict:
    """Stage 1's output as flat capture keys (``logits``, ``token_id``, ``top_tokens``, ...)."""
    return {**{f.name: getattr(gen, f.name) for f in dataclasses.fields(gen)},
            "top_tokens": [[i, p] for i, p in zip(gen.report.top_ids, gen.report.top_probs)]}


def state_snapshot(state) -> dict:
    """The whole live state (``full`` capture level): K/V and ledger of the live slots."""
    view = state.view()
    return {"arena_k": view.k, "arena_v": view.v,  # (L, kv_heads, n, head_dim), slot order
            "arena_log_mass": state.arena.log_mass[:, :, :view.n],  # (L, kv_heads, n)
            "ledger": {c: getattr(view, c) for c in VIEW_COLUMNS},
            "pending_token": state.pending_token, "next_position": state.next_position,
            "step": state.step}


def arena_version(state) -> int:
    """A number that changes whenever the arena's or the ledger's contents change: the
    tensors' in-place version counters plus the live counts (reads never bump them)."""
    a, m = state.arena, state.ledger
    tensors = (a.kt, a.v, a.log_mass, a.knorm, a.vnorm) + tuple(getattr(m, c) for c in m.COLUMNS)
    return hash((tuple(t._version for t in tensors), a.n, m.n, m.next_uid)) & (2 ** 62 - 1)


from .types import SOURCES as SOURCES_NAMES  # noqa: E402  (inspect maps source indices to names)
