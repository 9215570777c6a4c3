"""Capture: the tape the loop records every stage call on, and the only reader of it.

A run folder ``DIR/<run-id>/`` holds ``manifest.json`` and one file per stage call,
``<step:06d>_<stage>.pt`` (``file_name``), plus ``state_<step:06d>.pt`` (the whole live
state before a step, level ``full``). Steps are the tape's: the t-th generation step it
recorded is step t, whatever step the state counts (a session restored from a file goes on
from its own). A file is a dict of plain data only (``plain.py``), so
``torch.load(..., weights_only=True)`` reads it and nothing is ever unpickled. Every write
is atomic; the manifest lists each whole file with its sha256, so an interrupted run leaves
whole files and a manifest that says how far it got.

The schema lives here alone: ``Tape`` is what the loop calls beside each stage (the no-op
tape records nothing), ``CaptureTape`` writes it, and ``CaptureRun`` / ``StepFiles`` read
it back for replay and inspect. An input that is another stage's output is stored once,
where that stage wrote it. This version reads capture format ``FORMAT`` only.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import platform
import re
import time
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import torch
import transformers

from . import native, threads
from .model import Model, device_kind
from .plain import atomic_write, from_plain, landed, made, make_folder, sha256, to_plain
from .scorers import user
from .state import VIEW_COLUMNS, gathered, restore_args
from .types import CacheParams, GenerateOut, SamplerParams, UserError, inconsistent, require
from .version import __version__

FORMAT = 10  # 10: stage 4 appends into a hole its culls leave (format 9's runs moved a slot)
STAGES = ("s0_prime", "s1_generate", "s2_score", "s3_decide", "s4_apply")
BATCH = "batch.json"  # a batch capture's record of its rows and steps (``BatchTape``)
EXTEND = "s0_extend"  # stage 0 on the live state between steps (a chat turn), named by the step
RESTORE = "s0_restore"  # stage 0 writing a whole saved state (a session file), named likewise
FILE_KEYS = ("format", "stage", "step", "model", "inputs", "outputs", "cache_len", "arena_version")
MANIFEST_EVERY = 50  # past this many files the manifest is rewritten every N saves (and at close)
# what a file keeps of the view's own ledger columns (what scorers read), with its scorer columns
LEDGER_COLUMNS = VIEW_COLUMNS
_NAME = re.compile(r"(\d{6})_(s\d_\w+)\.pt")
_STATE = re.compile(r"state_(\d{6})\.pt")


def file_name(step: int, stage: str) -> str:
    return f"{step:06d}_{stage}.pt"


def state_file_name(step: int) -> str:
    return f"state_{step:06d}.pt"


def parse_name(name: str) -> tuple[int, str] | None:
    """``"000012_s2_score.pt"`` -> (12, "s2_score"); None for any other file."""
    m = _NAME.fullmatch(name)
    return (int(m[1]), m[2]) if m else None


def versions() -> dict:
    return {"positronic_brain": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def arena_version(state) -> int:
    """A number that changes whenever the arena's or the ledger's contents change: the
    tensors' in-place version counters plus the live counts (reads never bump them)."""
    a, m, cold = state.arena, state.ledger, state.cold
    tensors = tuple(t for b in a.blocks for t in (b.kt, b.v, b.log_mass, b.knorm, b.vnorm)) + tuple(
        m.col(c) for c in m.names)
    counts = (a.n, m.n, m.next_uid)
    if cold is not None:
        c = cold.arena
        tensors += (c.kt, c.v, c.knorm, c.vnorm, cold.entered) + tuple(
            cold.ledger.col(c) for c in cold.ledger.names) + (
            () if cold.heads is None else (cold.heads.row, cold.heads.n))
        counts += (cold.n, cold.next_entry, id(c.kt))  # id: a grown store is new storage
    return hash((tuple(t._version for t in tensors), counts)) & (2 ** 62 - 1)


def view_ledger(view) -> dict:
    """The view's ledger columns, the scorer's by their names: name -> (n,)."""
    return {**{c: getattr(view, c) for c in LEDGER_COLUMNS}, **view.columns}


def view_columns(view) -> dict:
    """The view's ledger columns and scalars (no K/V): what a scorer or inspect reads; a
    per-head cache's head map too (``heads``: the ledger row of each (layer, KV head, slot)
    stage 1 reads, -1 where free, and each head's count)."""
    return {**view_ledger(view),
            "pending_token": view.pending_token, "next_position": view.next_position,
            "step": view.step, "n": view.n, "capacity": view.capacity,
            "origins": list(view.origins), **head_map(view.heads)}


def head_map(h) -> dict:
    """A head map as a capture file keeps it (nothing for a whole-token cache)."""
    return {} if h is None else {"heads": {"row": h.row, "n": h.n}}


def manifest_params(manifest: dict) -> CacheParams | None:
    """The cache parameters a manifest records (``params.cache_params``, plain data in
    JSON's flavour; None where it records none)."""
    saved = (manifest.get("params") or {}).get("cache_params")
    if saved is None:
        return None
    with inconsistent("manifest.json", "cache parameters"):
        params = from_plain(saved)
        require(isinstance(params, CacheParams), "not a CacheParams")
    return params


def gen_outputs(gen: GenerateOut) -> dict:
    """Stage 1's output as flat keys (``logits``, ``token_id``, ``report``, ...)."""
    return {f.name: getattr(gen, f.name) for f in fields(gen)}


def prime_outputs(state, out) -> dict:
    """What stage 0's prime gave: its logits, its patch, the K/V it wrote and the prompt's
    attention statistics (None: not gathered)."""
    a = state.arena
    return {"logits": out.logits, "patch": out.patch, "k": gathered(a, "k", a.n),
            "v": gathered(a, "v", a.n), "stats": out.stats}


def extend_outputs(state, n_before: int, patch) -> dict:
    """What stage 0's extend gave: its patch and the K/V of the slots it added (a per-head
    cache's: each head's slots past the widest head's count before, and its head map)."""
    a = state.arena
    return {"patch": patch, "k": gathered(a, "k", a.n)[:, :, n_before:],
            "v": gathered(a, "v", a.n)[:, :, n_before:], **head_map(state.heads)}


def _snapshot(state) -> dict:
    """The whole live state (level ``full``): K/V, log-mass and ledger of the live slots."""
    view, a = state.view(), state.arena
    return {"arena_k": gathered(a, "k", a.n),  # (L, kv_heads, n, head_dim), slot order
            "arena_v": gathered(a, "v", a.n),
            "arena_log_mass": gathered(a, "log_mass", a.n),  # (L, kv_heads, n)
            "ledger": view_ledger(view),
            "origins": list(view.origins),
            "pending_token": state.pending_token, "next_position": state.next_position,
            "step": state.step, **head_map(view.heads)}


# --- the tape the loop records on ---------------------------------------------------------

class Tape:
    """Records nothing: what a session without a capture runs with. The loop calls each
    method beside its stage; ``CaptureTape`` writes them."""

    dir: Path | None = None

    def primed(self, state, segments, capacity, out, prefill, copy=None) -> None: ...
    def restored(self, state, source: str) -> None: ...
    def extended(self, state, segments, pending, n_before: int, patch) -> None: ...
    def begin(self, state, generator) -> None: ...
    def generated(self, view, sampler, force, gen) -> None: ...
    def scored(self, view, cache_params, scores) -> None: ...
    def decided(self, cache_params, actions) -> None: ...
    def applied(self, patch) -> None: ...
    def close(self, stop_reason: str | None, complete: bool = True) -> None: ...


NO_TAPE = Tape()


def manifest(model: Model, sampler: SamplerParams, params: CacheParams, prompt_ids: list[int],
             command: str, args: dict | None = None) -> dict:
    """A run's manifest: everything replay needs to run it again as it ran (the model, its
    precision, device, kernels and threads, the sampler, the cache parameters, the scorer
    file's digest, the prompt), and ``args``, the command's own."""
    return {
        "model": model.name, "dtype": model.precision, "compiled": model.compiled,
        "threads": threads.current()["count"], "device": str(model.device),
        "device_kind": device_kind(model.device),
        "kernels": native.for_model(model), "fingerprint": model.fingerprint,
        "command": command, "seed": sampler.seed,
        "params": {"args": args or {}, "sampler": dataclasses.asdict(sampler),
                   "cache_params": to_plain(params, json=True)},
        "scorer_sha256": user.file_sha256(params.scorer.name), "prompt_ids": prompt_ids}


def new_folder(root: str | os.PathLike, run_id: str | None = None) -> Path:
    """A capture's own new folder ``root/<run-id>``: ``run_id``, which must be free, or a
    generated one (the time and process, with the next free suffix)."""
    require(str(root).strip(), f"--capture {str(root)!r} is not a folder name")
    given = run_id is not None
    base = run_id or time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    for i in range(1, 1000):
        folder = Path(root) / (base if i == 1 else f"{base}-{i}")
        try:
            return make_folder(folder, exist_ok=False)
        except FileExistsError:
            if given:
                raise UserError(f"capture folder {folder} exists already") from None
        except OSError as e:
            raise UserError(f"cannot create capture folder {folder}: {e.strerror}") from None
    raise UserError(f"no free capture folder for {base} in {root}")


class CaptureTape(Tape):
    """Writes one run folder. ``level`` is ``light`` (stage files) or ``full`` (also the
    whole live state before each stage-1 call)."""

    def __init__(self, root: str | os.PathLike, manifest: dict, level: str = "light",
                 run_id: str | None = None):
        require(level in ("light", "full"), f"capture level must be light or full, got {level!r}")
        self.dir = new_folder(root, run_id)
        run_id = self.dir.name
        self.model = manifest.get("fingerprint", manifest.get("model"))
        self.manifest = {"format": FORMAT, "run_id": run_id, "level": level,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
                         **manifest, "complete": False, "stop_reason": None, "last_step": None,
                         "last_file": None, "files": {}}
        self.level = level
        self._unsaved = 0
        self._state = None  # the state the current step records
        self._offset = 0  # the tape's step minus the state's
        self._write_manifest()
        made(self.dir, "manifest.json")  # gone with the folder if the command is refused

    def _follow(self, state, step: int) -> None:
        """Record ``state`` from here on, its step now being the tape's ``step``."""
        self._state, self._offset = state, step - state.step

    def copy_from(self, files: dict[str, tuple[int, bytes]], before: int, state) -> None:
        """Take a run's ``files`` of what happened before step ``before`` (``CaptureRun.
        files_before``; ``fork``), byte for byte: they replay as they did there. ``state``
        is the state the run had then (``replay.rebuild``), which goes on here."""
        for name, (step, data) in files.items():
            self._add(name, data, step)
        self._follow(state, before - 1)
        self._write_manifest()

    # the loop's calls, one per stage
    def primed(self, state, segments, capacity, out, prefill, copy=None) -> None:
        """``prefill``: the cache parameters the prime gathered the prompt's statistics
        with (its window; its scorer, if ``prefill.scores``); None if it gathered none.
        ``prefill_total``: whether they include the total over every query; ``copy``: the
        ids of the repeat instruction of KVzip's reconstruction, if it ran one."""
        self._follow(state, 0)
        self._stage(0, "s0_prime", {"segments": segments, "capacity": capacity,
                                    "pinned": state.pinned, "columns": state.ledger.specs,
                                    "cold_capacity": None if state.cold is None else state.cold.capacity,
                                    "prefill": prefill,
                                    "prefill_total": out.stats is not None
                                    and out.stats.total is not None,
                                    "prefill_copy": copy,
                                    "per_head": state.heads is not None},
                    prime_outputs(state, out))

    def restored(self, state, source: str) -> None:
        """Stage 0 restored ``state`` whole from ``source`` (a session file): the capture
        goes on from it at the tape's current step. A chat turn recorded there before is
        superseded (a restore replaces everything), so replay does not re-run it."""
        step = 0 if self._state is None else self._state.step + self._offset
        self._follow(state, step)
        superseded = file_name(step, EXTEND)
        if self.manifest["files"].pop(superseded, None) is not None:
            self._write_manifest()  # no longer listed, then gone
            (self.dir / superseded).unlink()
        self._stage(state.step, RESTORE, {"source": source}, restore_args(state))

    def extended(self, state, segments, pending, n_before: int, patch) -> None:
        self._state = state
        self._stage(state.step, EXTEND, {"segments": segments, "pending": pending},
                    extend_outputs(state, n_before, patch))

    def begin(self, state, generator) -> None:
        """A step starts: its state, and the sampler's generator state before it (an input)."""
        self._state, self._rng = state, generator.get_state()
        if self.level == "full":
            t = state.step + 1 + self._offset
            self._add(state_file_name(t), _to_bytes(to_plain(_snapshot(state))), t)

    def generated(self, view, sampler, force, gen) -> None:
        self._stage(view.step + 1, "s1_generate",
                    {"view": view_columns(view), "sampler": sampler,
                     "generator_state": self._rng, "force": force}, gen_outputs(gen))

    def scored(self, view, cache_params, scores) -> None:
        self._stage(view.step + 1, "s2_score",
                    {"cache_params": cache_params, "value_norms": view.vnorm}, {"out": scores})

    def decided(self, cache_params, actions) -> None:  # its parameters are stage 2's
        self._stage(self._state.step + 1, "s3_decide", {}, {"out": actions})

    def applied(self, patch) -> None:
        self._stage(patch.step, "s4_apply", {}, {"out": patch})

    def close(self, stop_reason: str | None, complete: bool = True) -> None:
        self.manifest["complete"] = complete
        self.manifest["stop_reason"] = stop_reason
        self._write_manifest()

    # files
    def _stage(self, step: int, stage: str, inputs: dict, outputs: dict) -> Path:
        """Write the file of ``stage`` at the state's ``step`` (the tape's step named)."""
        s = self._state
        return self.save(step + self._offset, stage, inputs, outputs, cache_len=s.ledger.n,
                         arena_version=arena_version(s))

    def save(self, step: int, stage: str, inputs: dict, outputs: dict, cache_len: int,
             arena_version: int) -> Path:
        """Write one stage file (``file_name(step, stage)``)."""
        assert stage in (*STAGES, EXTEND, RESTORE), stage
        data = _to_bytes({"format": FORMAT, "stage": stage, "step": step, "model": self.model,
                          "inputs": to_plain(inputs), "outputs": to_plain(outputs),
                          "cache_len": cache_len, "arena_version": arena_version})
        return self._add(file_name(step, stage), data, step)

    def _add(self, name: str, data: bytes, step: int) -> Path:
        path = atomic_write(self.dir / name, data)
        landed()  # the capture holds the work: kept whatever follows
        files = self.manifest["files"]
        files[name] = sha256(data)
        self.manifest["last_step"], self.manifest["last_file"] = step, name
        self._unsaved += 1
        if len(files) <= MANIFEST_EVERY or self._unsaved >= MANIFEST_EVERY:
            self._write_manifest()
        return path

    def _write_manifest(self) -> None:
        atomic_write(self.dir / "manifest.json", json.dumps(self.manifest, indent=1).encode())
        self._unsaved = 0


def row_name(index: int) -> str:
    """The run folder of a batch's row ``index`` (its prompt's place in the input)."""
    return f"row-{index:06d}"


class BatchTape:
    """Writes a batch's capture (``run --prompts --capture``): the folder ``root/<run-id>/``
    holds one run folder a row (``row_name``: a whole capture of that row, its manifest
    naming the batch) and ``BATCH`` (the batch's size, and which rows stepped together at
    each of its steps, each at its own step): a row's stage 1 ran in one product with the
    others', so replay steps them together again (``replay.replay_batch``)."""

    def __init__(self, root: str | os.PathLike, manifest: dict, level: str, size: int):
        require(level in ("light", "full"), f"capture level must be light or full, got {level!r}")
        self.dir = new_folder(root)
        self.manifest, self.level = manifest, level
        self.steps: dict[int, int] = {}  # a row's steps so far
        self.record = {"format": FORMAT, "run_id": self.dir.name, "size": size, "rows": [],
                       "schedule": [], "complete": False}
        self._write()
        made(self.dir, BATCH)  # gone with the folder if the command is refused (rows first)

    def row(self, index: int, prompt_ids: list[int]) -> CaptureTape:
        """Row ``index``'s tape (its prompt ``prompt_ids``)."""
        self.record["rows"].append(row_name(index))
        self.steps[index] = 0
        return CaptureTape(self.dir, {**self.manifest, "prompt_ids": prompt_ids, "batch": {
            "run_id": self.dir.name, "row": index, "size": self.record["size"]}},
            self.level, run_id=row_name(index))

    def stepped(self, rows: list[int]) -> None:
        """``rows`` (their indices) step together now, each its next step."""
        for i in rows:
            self.steps[i] += 1
        self.record["schedule"].append([[i, self.steps[i]] for i in rows])
        if len(self.record["schedule"]) % MANIFEST_EVERY == 0:
            self._write()

    def close(self, complete: bool = True) -> None:
        self.record["complete"] = complete
        self._write()

    def _write(self) -> None:
        atomic_write(self.dir / BATCH, json.dumps(self.record).encode())


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --- reading ------------------------------------------------------------------------------

def read_manifest(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no manifest.json in {run_dir}: not a capture run folder") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable manifest ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UserError(f"{path}: not a capture manifest of format {FORMAT}")
    require(manifest.get("format") == FORMAT, f"{path}: capture format {manifest.get('format')} "
            f"is not read by this version, which reads format {FORMAT}; capture the run again")
    return manifest


def _read(path: Path, expected_sha256: str | None) -> bytes:
    """A capture file's bytes, checked against the manifest's ``expected_sha256`` (if given)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if expected_sha256 is not None and sha256(data) != expected_sha256:
        raise UserError(f"{path.name}: sha256 differs from the manifest (modified or truncated)")
    return data


def load_file(path: str | os.PathLike, expected_sha256: str | None = None,
              model: dict | str | None = None, device: torch.device | str = "cpu") -> dict:
    """Read one capture file as plain data, its tensors onto ``device``; a wrong checksum, a
    truncated or non-plain file, or a file from another model raises ``UserError`` (one
    line). Nothing is unpickled."""
    path = Path(path)
    data = _read(path, expected_sha256)
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location=device)
    except Exception as e:  # truncated zip, pickled objects refused by weights_only, ...
        first = (str(e).strip().splitlines() or [""])[0][:120]
        why = first if any(c.isalpha() for c in first) else type(e).__name__  # not a bare code
        raise UserError(f"{path.name}: not a plain-data capture file ({why})") from None
    if path.name.startswith("state_"):
        require(isinstance(obj, dict) and "arena_k" in obj, f"{path.name}: not a captured state")
        return obj
    if not isinstance(obj, dict) or any(k not in obj for k in FILE_KEYS) \
            or obj["stage"] not in (*STAGES, EXTEND, RESTORE):
        raise UserError(f"{path.name}: not a capture file of format {FORMAT}")
    require(obj["format"] == FORMAT, f"{path.name}: capture format {obj['format']} is not read "
            f"by this version, which reads format {FORMAT}")
    if model is not None and obj["model"] != model:
        raise UserError(f"{path.name}: captured from model {obj['model']!r}, not {model!r}")
    return obj


def reads_capture(fn):
    """``fn``, whose first argument names a capture (a run, its folder, or several
    folders), with ``types.inconsistent``'s errors naming it."""
    @functools.wraps(fn)
    def checked(where, *args, **kwargs):
        named = getattr(where, "dir", where)
        with inconsistent(", ".join(map(str, named)) if isinstance(named, list) else named,
                          "capture"):
            return fn(where, *args, **kwargs)
    return checked


def _one(path: Path) -> Path:
    """``path`` if it is a run or batch folder, else the one run or batch a capture root holds."""
    require(path.is_dir(), f"{path}: no such capture folder")
    if (path / "manifest.json").is_file() or (path / BATCH).is_file():
        return path
    runs = sorted(p for p in path.iterdir()
                  if (p / "manifest.json").is_file() or (p / BATCH).is_file())
    require(len(runs) == 1, f"{path} holds {len(runs)} capture runs; name one of them" if runs
            else f"{path}: no manifest.json here: not a capture run folder")
    return runs[0]


def read_batch(folder: Path) -> dict:
    """A batch capture's record (``BATCH``), checked."""
    path = folder / BATCH
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable ({type(e).__name__})") from None
    require(isinstance(record, dict) and record.get("format") == FORMAT
            and isinstance(record.get("rows"), list) and isinstance(record.get("schedule"), list),
            f"{path}: not a batch capture of format {FORMAT}")
    return record


def batch_of(path: str | os.PathLike, row: int | None = None) -> tuple[Path, int | None] | None:
    """The batch capture ``path`` names and the row asked for: a batch folder (or a root
    holding one) and ``row``, or a row's run folder and its row; None for a run of one
    prompt (``row`` refused)."""
    path = _one(Path(path))
    if (path / BATCH).is_file():
        return path, row
    batch = read_manifest(path).get("batch")
    if batch is None:
        require(row is None, f"--row {row}: {path} is not a batch capture (a run of one "
                "prompt, not a batch capture's row)")
        return None
    require(row in (None, batch["row"]), f"--row {row}: {path} is row {batch['row']} of a batch")
    return path.parent, batch["row"]


def resolve_run(path: str | os.PathLike, row: int | None = None) -> Path:
    """A run folder: ``path``, the one run a capture root holds, or with ``row`` that row's
    of a batch capture (which has no run of its own without one)."""
    found = batch_of(path, row)
    if found is None:
        return _one(Path(path))
    folder, row = found
    rows = read_batch(folder)["rows"]
    require(row is not None, f"{folder} is a batch capture of {len(rows)} rows: name one "
            "with --row I (0 for the first prompt)")
    require(row_name(row) in rows, f"--row {row}: {folder} has no such row (its rows: "
            f"{', '.join(r.removeprefix('row-').lstrip('0') or '0' for r in rows[:8])}"
            f"{', ...' if len(rows) > 8 else ''})")
    return folder / row_name(row)


class CaptureRun:
    """A run folder, checked against its manifest; its files by step and stage."""

    def __init__(self, path: str | os.PathLike, row: int | None = None):
        self.dir = resolve_run(path, row)
        self.manifest = read_manifest(self.dir)
        self.fingerprint = self.manifest.get("fingerprint")
        self.device = torch.device("cpu")  # where loaded tensors go: replay sets its model's
        files = self.manifest["files"]
        missing = [n for n in files if not (self.dir / n).is_file()]
        require(not missing, f"{missing[:1]} listed in the manifest but missing")
        named = [p for p in map(parse_name, files) if p]
        self.steps = sorted({t for t, st in named if st in STAGES[1:]})  # generation steps

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def files_before(self, before: int) -> dict[str, tuple[int, bytes]]:
        """The step and bytes of each file of what happened before step ``before`` (its
        prime or restore, chat turns, steps and their state files), each checked against
        the manifest's sha256 (``UserError``, one line)."""
        out = {}
        for name, expected in self.manifest["files"].items():
            parsed, snap = parse_name(name), _STATE.fullmatch(name)
            step = parsed[0] if parsed else int(snap[1]) if snap else None
            if step is not None and step < before:
                out[name] = (step, _read(self.dir / name, expected))
        return out

    def load(self, name: str) -> dict:
        require(self.has(name), f"{name} is not in the manifest")
        return load_file(self.dir / name, self.manifest["files"][name], model=self.fingerprint,
                         device=self.device)

    def at(self, step: int, stage: str) -> "StageFile | None":
        """The stage-0 call ``stage`` (``s0_prime``, ``s0_restore``, ``s0_extend``) made after
        step ``step`` (0: before the first), if one was."""
        name = file_name(step, stage)
        return StageFile(name, self.load(name)) if self.has(name) else None

    def restores(self) -> list["StageFile"]:
        """The sessions restored in the run (its ``s0_restore`` files), in step order."""
        named = sorted(p for p in map(parse_name, self.manifest["files"]) if p and p[1] == RESTORE)
        return [self.stage(*p) for p in named]

    def stage(self, t: int, stage: str) -> "StageFile":
        name = file_name(t, stage)
        return StageFile(name, self.load(name))

    def step(self, t: int, state: bool = False) -> "StepFiles | None":
        """Step ``t``'s four stage files (and, with ``state``, its ``full`` state file if there
        is one); None unless all four were captured."""
        names = [file_name(t, st) for st in STAGES[1:]]
        if not all(map(self.has, names)):
            return None
        snap = state_file_name(t)
        return StepFiles(t, *(StageFile(n, self.load(n)) for n in names),
                         state=self.load(snap) if state and self.has(snap) else None)


@dataclass(frozen=True)
class StageFile:
    """One stage call: its file name and plain contents (``inputs``, ``outputs``, ...)."""

    name: str
    data: dict

    @property
    def stage(self) -> str:
        return self.data["stage"]

    @property
    def inputs(self) -> dict:
        return self.data["inputs"]

    @property
    def outputs(self) -> dict:
        return self.data["outputs"]

    @cached_property
    def args(self) -> dict:
        """The inputs as the objects the stage took (dataclasses rebuilt)."""
        return from_plain(self.inputs)

    @property
    def out(self):
        """Stages 2-4: the output dataclass (ScoreOut, Actions, Patch)."""
        return from_plain(self.outputs["out"])

    @property
    def restored(self) -> dict:
        """``s0_restore``: the state it wrote, as ``restore`` takes it back."""
        return from_plain(self.outputs)


@dataclass(frozen=True)
class StepFiles:
    """The files of one generation step, typed: what each stage took and gave."""

    step: int
    generate: StageFile
    score: StageFile
    decide: StageFile
    apply: StageFile
    state: dict | None = None  # level full: the live state before the step

    @property
    def stages(self) -> tuple[StageFile, ...]:
        return (self.generate, self.score, self.decide, self.apply)

    @property
    def view(self) -> dict:
        """The ledger columns and scalars the step started from (plain)."""
        return self.generate.inputs["view"]

    @cached_property
    def gen(self) -> GenerateOut:
        out = self.generate.outputs
        return GenerateOut(**{f.name: from_plain(out[f.name]) for f in fields(GenerateOut)})

    @property
    def cache_params(self):
        """The cache parameters of stages 2 and 3 (stored once, with stage 2)."""
        return self.score.args["cache_params"]

    @property
    def scores(self):
        return self.score.out

    @property
    def actions(self):
        return self.decide.out

    @property
    def patch(self):
        return self.apply.out

    @cached_property
    def tokens(self) -> "TokenStep":
        """The step as one value per ledger row (``token_step``)."""
        return token_step(self.view, self.scores, self.gen.attention)


@dataclass(frozen=True)
class TokenStep:
    """A step's view, scores and attention as one value per ledger row, as inspect and
    the page draw them."""

    view: dict  # the captured view, a per-head cache's scorer columns one value a row
    scores: object  # ScoreOut, ``scores`` and ``columns`` one value a row
    attention: torch.Tensor  # (n,) what the step's query paid each row, mean of layers and heads
    held: torch.Tensor | None  # (n,) how many (layer, KV head)s hold each row; None: whole tokens


def row_attention(view: dict, attention: torch.Tensor) -> torch.Tensor:
    """What stage 1's query paid each ledger row of a captured ``view`` (n,), the mean over
    layers and heads of its ``attention`` (L, H, slots); in a per-head cache (its ``heads``
    map) over each head's slots, a head that does not hold a row paying it nothing."""
    h = view.get("heads")
    if h is None:
        return attention.float().mean(dim=(0, 1))
    row = h["row"]
    L, KVH, width = row.shape
    live = row >= 0
    paid = attention.float().view(L, KVH, -1, width).sum(2)[live]
    n = len(view["uid"])
    return torch.zeros(n).index_add_(0, row[live], paid) / (attention.shape[0] * attention.shape[1])


def token_step(view: dict, scores, attention: torch.Tensor) -> TokenStep:
    """A step's view, its ``scores`` (a ScoreOut) and stage 1's ``attention`` (L, H, slots)
    per ledger row. A whole-token cache's slot i is row i. A per-head cache's values are
    over each head's slots (its ``heads`` map): a row's attention is what every head paid
    it (nothing from a head that does not hold it), its score and scorer columns the mean
    over the heads that hold it."""
    h = view.get("heads")
    att = row_attention(view, attention)
    if h is None:
        return TokenStep(view, scores, att, None)
    row = h["row"]
    L, KVH, _ = row.shape
    n = len(view["uid"])
    live = row >= 0
    at = row[live]
    held = torch.bincount(at, minlength=n)
    heads = torch.arange(L * KVH).view(L, KVH, 1).expand_as(row)[live]
    holds = torch.zeros(n, L * KVH)
    holds[at, heads] = 1.0
    per = held.clamp(min=1).float()

    def mean(x: torch.Tensor) -> torch.Tensor:  # (n, L, KVH) -> (n,) over the holders
        return (x.float().reshape(n, -1) * holds).sum(1) / per

    own = {c for c in view if c not in LEDGER_COLUMNS and isinstance(view[c], torch.Tensor)
           and view[c].dim() == 3}
    flat = {**view, **{c: mean(view[c]) for c in own}}
    score = torch.zeros(n).index_add_(0, at, scores.scores.float()[live]) / per
    columns = {c: mean(x) for c, x in (scores.columns or {}).items()}
    return TokenStep(flat, dataclasses.replace(scores, scores=score, columns=columns), att, held)
