"""Plain data: the one codec and the one atomic writer of captures and session files, and
the signed safetensors files (sessions, projectors): tensors plus a JSON header and a sha256
over both, read without unpickling anything.

``to_plain`` turns this package's frozen dataclasses (``types.py``), tensors and containers
into plain data: a dataclass becomes a dict tagged ``"__type__"``, a tensor is copied to host
memory (a view of the arena would otherwise save its whole preallocated storage, and a file
must load on any machine), a frozenset a sorted
tuple, a dtype its name. ``from_plain`` inverts it, rebuilding dataclasses only from the
fixed table of ``types.py`` classes (each field of its annotated type, ``check_types``, then
validated by their ``__post_init__``), so reading a file never runs code. ``json=True`` also
tags tuples and dicts with non-string keys, which JSON cannot hold, and refuses tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import os
import tempfile
import typing
from pathlib import Path
from types import UnionType

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from . import types as _types
from .types import UserError, require

TYPES = {n: c for n, c in vars(_types).items()
         if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == _types.__name__}


def to_plain(x, json: bool = False):
    """Dataclasses, tensors and containers -> plain data (see the module docstring)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__name__,
                **{f.name: to_plain(getattr(x, f.name), json) for f in dataclasses.fields(x)}}
    if isinstance(x, torch.Tensor) and not json:
        return x.detach().to("cpu", copy=True)
    if isinstance(x, frozenset):
        x = tuple(sorted(x))
    if isinstance(x, tuple):
        items = tuple(to_plain(v, json) for v in x)
        return {"__tuple__": list(items)} if json else items
    if isinstance(x, list):
        return [to_plain(v, json) for v in x]
    if isinstance(x, dict):
        if json and not all(isinstance(k, str) for k in x):
            return {"__pairs__": [[to_plain(k, json), to_plain(v, json)] for k, v in x.items()]}
        return {k: to_plain(v, json) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    raise TypeError(f"cannot save a {type(x).__name__} as plain data")


def from_plain(x):
    """The inverse of ``to_plain`` (either flavour)."""
    if isinstance(x, list):
        return [from_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(from_plain(v) for v in x)
    if not isinstance(x, dict):
        return x
    if "__tuple__" in x:
        return tuple(from_plain(v) for v in x["__tuple__"])
    if "__pairs__" in x:
        return {from_plain(k): from_plain(v) for k, v in x["__pairs__"]}
    if "__type__" in x:
        cls = TYPES.get(x["__type__"])
        require(cls is not None, f"unknown saved type {x['__type__']!r}")
        values = {k: from_plain(v) for k, v in x.items() if k != "__type__"}
        if x["__type__"] == "CacheParams" and "prune" in values:  # saved before Allocation
            values["allocation"] = _types.Allocation(
                "turns" if values.pop("prune") == "turns" else "token")
        check_types(cls, values, f"a saved {x['__type__']}")
        return cls(**values)
    return {k: from_plain(v) for k, v in x.items()}


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def fits(value, hint) -> bool:
    """Whether ``value`` (read from a file) is of the annotated type ``hint``: ``int`` an
    integer of 64 bits (not a bool), ``float`` a float or an integer a float holds exactly,
    a tuple's or a list's items and a dict's keys and values of theirs, one of a union's."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, UnionType):
        return any(fits(value, a) for a in args)
    if origin is tuple and args[-1:] != (Ellipsis,):
        return isinstance(value, tuple) and len(value) == len(args) and all(
            map(fits, value, args))
    if origin in (tuple, list):
        return isinstance(value, origin) and all(fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(k, args[0]) and fits(v, args[1])
                                               for k, v in value.items())
    if hint is float:
        return isinstance(value, float) or (type(value) is int and abs(value) <= 2 ** 53)
    if hint is int:
        return type(value) is int and -2 ** 63 <= value < 2 ** 64
    return hint is typing.Any or isinstance(value, origin or hint)


def check_types(cls: type, values: dict, what: str) -> None:
    """Each of ``values`` a field of the dataclass ``cls``, of its annotated type (``fits``);
    a one-line UserError naming ``what`` otherwise."""
    declared = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(declared))
    require(not unknown, f"unknown field {unknown[:1]} of {what}")
    for name, value in values.items():
        require(fits(value, _hints(cls)[name]),
                f"{what}: its {name} {value!r:.40} is not of type {declared[name]}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file and a rename: a reader sees the old file
    or the whole new one. An OS error is a one-line UserError."""
    path = output_file(path, probe=False)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # none was made where the folder is not one
            tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    return path


def output_file(out: str | os.PathLike, *inputs: str | os.PathLike, probe: bool = True) -> Path:
    """``out`` as a file about to be written, checked before the work that fills it: a file
    name, not a folder, in a folder that exists and (``probe``) takes a new file, and none of
    the ``inputs`` the work reads (it would replace them)."""
    path = Path(out)
    require(path.name not in ("", ".", ".."), f"{str(out)!r} is not a file name")
    require(path.parent.is_dir(), f"cannot write {out}: no folder {path.parent}")
    require(not path.is_dir(), f"cannot write {out}: it is a folder")
    for given in inputs:
        require(not (path.exists() and os.path.exists(given) and os.path.samefile(path, given)),
                f"{out}: a file this command reads; write to another file")
    if probe:  # a file made and taken away at once: the folder takes the write to come
        try:
            handle, trial = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=path.parent)
            os.close(handle)
            os.unlink(trial)
        except OSError as e:
            raise UserError(f"cannot write {out}: {e.strerror}") from None
    return path


# What the command running has made for its outputs before any of its work landed, in
# order (``take_back``), each (a folder, a file written in it or None for the folder
# itself): None while no command is armed (a library's caller: nothing kept).
_MADE: list[tuple[Path, str | None]] | None = None


def arm() -> None:
    """A command starts (``cli.main``): what it makes for its outputs is kept track of from
    here until its work lands (``landed``), so that a refusal can take it back."""
    global _MADE  # pylint: disable=global-statement
    _MADE = []


def landed() -> None:
    """The command's work has reached its outputs (a capture's first stage, a benchmark's
    first row, a saved session): from here on nothing it made is taken back."""
    global _MADE  # pylint: disable=global-statement
    _MADE = None


def make_folder(path: str | os.PathLike, exist_ok: bool = True) -> Path:
    """``Path(path).mkdir(parents=True, exist_ok=exist_ok)`` a folder at a time, each one
    this call made kept track of (``arm``)."""
    path = Path(path)
    for folder in [*reversed(path.parents), path]:
        try:
            os.mkdir(folder)
        except FileExistsError:
            if folder == path and not exist_ok:
                raise
            continue
        if _MADE is not None:
            _MADE.append((folder, None))
    if not path.is_dir():
        raise FileExistsError(errno.EEXIST, "it exists and is not a folder", str(path))
    return path


def made(folder: Path, file: str) -> None:
    """``folder`` (``make_folder``'s) holds ``file``, written before any of the command's work
    (a capture's manifest): if the command is refused while the folder holds nothing else,
    ``take_back`` removes the file, then the folder."""
    if _MADE is not None:
        _MADE.append((folder, file))


def take_back() -> None:
    """A refused command's outputs taken back, the last made first, if its work never landed:
    each file ``made`` alone in its folder, each folder ``make_folder`` made that is empty
    (what holds anything else stays)."""
    global _MADE  # pylint: disable=global-statement
    made_, _MADE = _MADE or [], None
    for folder, file in reversed(made_):
        with contextlib.suppress(OSError):
            if file is None:
                folder.rmdir()
            elif [p.name for p in folder.iterdir()] == [file]:
                (folder / file).unlink()


def digest(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over a file's str->str metadata (but its ``sha256`` entry) and its tensors'
    names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for key in sorted(meta):
        if key != "sha256":
            h.update(f"{key}\0{meta[key]}\0".encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_signed(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                meta: dict[str, str]) -> Path:
    """Host ``tensors`` and ``meta`` (its ``format`` first among them) as one safetensors
    file, with ``meta["sha256"]`` their ``digest``, written atomically; returns the path."""
    meta = {**meta, "sha256": digest(meta, tensors)}
    written = atomic_write(path, st_save(tensors, metadata=meta))
    landed()
    return written


def read_safetensors(path: str | os.PathLike,
                     what: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors, unchecked; a missing or unreadable file
    (truncated, not safetensors) is a one-line UserError naming ``what``."""
    path = Path(path)
    require(path.is_file(), f"no {what} at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # truncated, not safetensors, unreadable ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise UserError(f"{path}: not a readable {what} ({first})") from None


def load_signed(path: str | os.PathLike, formats: tuple[str, ...],
                what: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of a ``save_signed`` file of one of ``formats``. A missing,
    unreadable, truncated or modified file, or one of another format, is a one-line
    UserError naming ``what`` (e.g. "session file")."""
    meta, tensors = read_safetensors(path, what)
    require(meta.get("format") in formats, f"{path}: not a {what} of format "
            f"{' or '.join(formats)} (its format: {meta.get('format')!r})")
    require(meta.get("sha256") == digest(meta, tensors),
            f"{path}: the {what} is corrupt (sha256 mismatch)")
    return meta, tensors
