"""Replay a captured run: rebuild the arena from the prime capture, the stage-4
patches and the stage-0 extends between steps (chat turns) (the event log), re-run every captured stage from its captured inputs, and compare
its outputs with the captured ones, bit for bit.

Stage 1 gets the captured generator state, so sampling replays exactly. Stages 2-4 get
the captured outputs of the stage before them (not the re-run ones), so a mismatch is
reported where it arises, not everywhere after it. A ``full`` capture's state files are
compared with the rebuilt arena and ledger as well.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .capture import (EXTEND, STAGES, VIEW_COLUMNS, from_plain, generate_outputs, load_file,
                      read_manifest, to_plain)
from .model import Model, load_model
from .scorers import make_scorer
from .stages.apply import apply, extend, prime
from .stages.decide import decide
from .stages.generate import generate
from .stages.score import score
from .types import GenerateOut, UserError, require


@dataclass
class Mismatch:
    file: str
    key: str
    detail: str  # "max abs diff 3e-07", "7 != 8", ...

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.detail}"


@dataclass
class ReplayReport:
    run_dir: str
    steps: int = 0  # generation steps replayed
    compared: dict[str, int] = field(default_factory=dict)  # stage -> files compared
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def diff(ours, theirs, key: str = "") -> list[tuple[str, str]]:
    """Differences between two plain structures: [(key path, detail)], tensors bit-exact."""
    if isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)):
            return [(key, f"{type(ours).__name__} vs {type(theirs).__name__}")]
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return [(key, f"{tuple(ours.shape)} {ours.dtype} vs {tuple(theirs.shape)} {theirs.dtype}")]
        if torch.equal(ours, theirs) or (ours.is_floating_point()
                                         and torch.equal(ours.isnan(), theirs.isnan())
                                         and torch.equal(ours.nan_to_num(), theirs.nan_to_num())):
            return []
        d = (ours.double() - theirs.double()).abs().nan_to_num(float("inf"))
        return [(key, f"max abs diff {float(d.max()):.3g} at {int(d.argmax())}")]
    if isinstance(theirs, dict) and isinstance(ours, dict):
        out = []
        for k in sorted(set(ours) | set(theirs), key=str):
            sub = f"{key}.{k}" if key else str(k)
            if k not in ours or k not in theirs:
                out.append((sub, "missing in " + ("replay" if k not in ours else "capture")))
            else:
                out += diff(ours[k], theirs[k], sub)
        return out
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return [(key, f"length {len(ours)} != {len(theirs)}")]
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in diff(a, b, f"{key}[{i}]")]
    if ours != theirs:
        return [(key, f"{ours!r:.60} != {theirs!r:.60}")]
    return []


def resolve_run(path: str | Path) -> Path:
    """A run folder, or a capture root holding exactly one run."""
    path = Path(path)
    require(path.is_dir(), f"{path}: no such capture folder")
    if (path / "manifest.json").is_file():
        return path
    runs = sorted(p for p in path.iterdir() if (p / "manifest.json").is_file())
    require(len(runs) == 1, f"{path} holds {len(runs)} capture runs; name one of them" if runs
            else f"{path}: no manifest.json here: not a capture run folder")
    return runs[0]


class _Run:
    """Verified access to one run folder's files."""

    def __init__(self, run_dir: Path, manifest: dict):
        self.dir, self.manifest = run_dir, manifest
        self.fingerprint = manifest.get("fingerprint")

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def load(self, name: str) -> dict:
        require(self.has(name), f"{name} is not in the manifest")
        return load_file(self.dir / name, self.manifest["files"][name], model=self.fingerprint)


def replay(run_dir: str | Path, stage: str | None = None, step: int | None = None,
           model: Model | None = None, progress: Callable[[int, int], None] | None = None
           ) -> ReplayReport:
    """Replay a run folder; ``stage``/``step`` restrict which files are compared (the state
    is still rebuilt from every patch before them). Bad files raise ``UserError``."""
    require(stage is None or stage in (*STAGES, EXTEND), f"unknown stage {stage!r}; expected "
            f"one of {', '.join((*STAGES, EXTEND))}")
    run_path = resolve_run(run_dir)
    manifest = read_manifest(run_path)
    run = _Run(run_path, manifest)
    report = ReplayReport(str(run_path))
    missing = [n for n in manifest["files"] if not (run_path / n).is_file()]
    require(not missing, f"{missing[:1]} listed in the manifest but missing")
    steps = sorted({int(n[:6]) for n in manifest["files"] if n[:6].isdigit()} - {0})
    require(run.has("000000_s0_prime.pt"), f"{run_path}: no prime capture (000000_s0_prime.pt)")
    if step is not None:
        require(step == 0 or step in steps, f"step {step} is not in this capture "
                f"(steps 1..{steps[-1] if steps else 0})")
    if not manifest.get("complete"):
        report.notes.append(f"the run did not complete (stopped: {manifest.get('stop_reason')}, "
                            f"last file {manifest.get('last_file')})")

    if model is None:
        model = load_model(manifest["model"], manifest["dtype"])
    fp = json.loads(json.dumps(model.fingerprint))
    require(fp == manifest.get("fingerprint"), f"the capture is of model {manifest.get('model')!r} "
            f"{manifest.get('dtype')}, which does not match the loaded {model.name!r}")

    def wanted(st: str, t: int) -> bool:
        return (stage is None or stage == st) and (step is None or step == t)

    def check(name: str, ours: dict, theirs: dict) -> None:
        report.compared[name[7:-3]] = report.compared.get(name[7:-3], 0) + 1
        report.mismatches += [Mismatch(name, k, d) for k, d in diff(to_plain(ours), theirs)]

    # Stage 0: re-prime from the captured prompt; the K/V it writes must equal the captured.
    f0 = run.load("000000_s0_prime.pt")
    inp = from_plain(f0["inputs"])
    state, out = prime(model, list(inp["segments"]), inp["capacity"],
                       pinned=frozenset(inp["pinned"]), seeds=tuple(inp["seeds"]))
    if wanted("s0_prime", 0):
        view = state.view()
        check("000000_s0_prime.pt", {"logits": out.logits, "patch": out.patch, "k": view.k,
                                     "v": view.v}, f0["outputs"])

    def extend_at(t: int) -> None:  # the chat turn prefilled after step t, if any
        name = f"{t:06d}_{EXTEND}.pt"
        if not run.has(name):
            return
        f, n = run.load(name), state.arena.n
        inp = from_plain(f["inputs"])
        patch = extend(model, state, list(inp["segments"]), pinned=frozenset(inp["pinned"]),
                       pending=inp["pending"])
        if wanted(EXTEND, t):
            view = state.view()
            check(name, {"patch": patch, "k": view.k[:, :, n:], "v": view.v[:, :, n:]},
                  f["outputs"])

    extend_at(0)

    for i, t in enumerate(steps):
        if step is not None and t > step:
            break
        names = [f"{t:06d}_{st}.pt" for st in STAGES[1:]]
        if not all(run.has(n) for n in names):
            report.notes.append(f"step {t} was not captured whole; replay stops before it")
            break
        view = state.view()
        if run.has(f"state_{t:06d}.pt") and (step is None or step == t):
            _check_state(run.load(f"state_{t:06d}.pt"), state, f"state_{t:06d}.pt", report)
        f1, f2, f3, f4 = (run.load(n) for n in names)
        for f, n in zip((f1, f2, f3), names):
            if f["cache_len"] != view.n:
                report.mismatches.append(Mismatch(n, "cache_len", f"{view.n} != {f['cache_len']}"))
        if len({f1["arena_version"], f2["arena_version"], f3["arena_version"]}) != 1:
            report.mismatches.append(Mismatch(names[2], "arena_version",
                                              "changed during stages 1-3 (only stage 4 may write)"))

        # 1) generate, from the captured sampler and generator state
        inp = from_plain(f1["inputs"])
        rng = torch.Generator()
        rng.set_state(inp["generator_state"])
        if wanted("s1_generate", t):
            out = generate(model, view, inp["sampler"], rng, inp.get("force"))  # teacher forcing
            check(names[0], generate_outputs(out), f1["outputs"])
        gen = GenerateOut(**{f.name: from_plain(f1["outputs"][f.name])
                             for f in dataclasses.fields(GenerateOut)})
        # 2) score the captured attention
        cache = from_plain(f2["inputs"]["cache"])
        if wanted("s2_score", t):
            check(names[1], {"out": score(view, gen.attention, make_scorer(cache))}, f2["outputs"])
        scores = from_plain(f2["outputs"]["out"])
        # 3) decide from the captured scores
        if wanted("s3_decide", t):
            check(names[2], {"out": decide(model, view, scores, from_plain(f3["inputs"]["cache"]))},
                  f3["outputs"])
        actions = from_plain(f3["outputs"]["out"])
        # 4) apply the captured generate output and actions: rebuilds the next state
        patch = apply(model, state, gen, actions)
        if wanted("s4_apply", t):
            check(names[3], {"out": patch}, f4["outputs"])
        extend_at(t)
        state.check_valid()
        report.steps += 1
        if progress:
            progress(i + 1, len(steps))
    return report


def _check_state(snap: dict, state, name: str, report: ReplayReport) -> None:
    """Compare a ``full`` state file with the rebuilt state, slot order ignored (by uid)."""
    view = state.view()
    ours_order = torch.argsort(view.uid)
    theirs_order = torch.argsort(snap["ledger"]["uid"])
    ours = {"arena_k": view.k[:, :, ours_order], "arena_v": view.v[:, :, ours_order],
            "ledger": {c: getattr(view, c)[ours_order] for c in VIEW_COLUMNS},
            "pending_token": state.pending_token, "next_position": state.next_position,
            "step": state.step}
    if "arena_log_mass" in snap:  # (captures from before folds have none)
        ours["arena_log_mass"] = state.arena.log_mass[:, :, :view.n][:, :, ours_order]
    theirs = {**snap, "arena_k": snap["arena_k"][:, :, theirs_order],
              "arena_v": snap["arena_v"][:, :, theirs_order],
              **({"arena_log_mass": snap["arena_log_mass"][:, :, theirs_order]}
                 if "arena_log_mass" in snap else {}),
              "ledger": {c: snap["ledger"][c][theirs_order] for c in VIEW_COLUMNS}}
    report.mismatches += [Mismatch(name, k, d) for k, d in diff(to_plain(ours), theirs)]


def main(run_dir: str, stage: str | None, step: int | None, out=None) -> int:
    """The ``replay`` command: exit 0 if everything matches, 1 on a mismatch."""
    from rich.console import Console

    console = Console(file=out, stderr=out is None, highlight=False)
    report = replay(run_dir, stage, step)
    for note in report.notes:
        console.print(f"note: {note}")
    counts = ", ".join(f"{n} {s}" for s, n in report.compared.items()) or "nothing"
    if report.ok:
        console.print(f"replay OK: {report.steps} steps of {report.run_dir}; compared {counts}; "
                      "all bit-exact")
        return 0
    for m in report.mismatches[:20]:
        console.print(f"MISMATCH {m}")
    console.print(f"replay FAILED: {len(report.mismatches)} mismatches in {report.run_dir}")
    return 1


__all__ = ["Mismatch", "ReplayReport", "diff", "main", "replay", "resolve_run", "UserError"]
