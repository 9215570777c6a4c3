"""Replay a captured run: rebuild the arena from the event log (the prime or a restored
session, the stage-4 patches, and the stage-0 calls between steps: restored sessions and chat
turns), re-run every captured stage from its captured inputs, and compare its outputs with the
captured ones, bit for bit. A restore writes the captured state with stage 0's ``restore``;
what it wrote must read back bit for bit.

Stage 1 gets the captured generator state, so sampling replays exactly. Stages 2-4 get
the captured outputs of the stage before them (not the re-run ones), so a mismatch is
reported where it arises, not everywhere after it. A ``full`` capture's state files are
compared with the rebuilt arena and ledger as well.

On another device than the capture's (its manifest says which: a CPU's model and instruction
set, a GPU's name and memory), or with other native kernels than a native run's (its
manifest records their build), kernels round differently:
floating-point outputs are compared within ``TOLERANCE`` of the dtype instead of bit for
bit, and stage 1 takes the captured token as given (a generator's state does not carry
across devices); the report says so in a note.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from . import native, threads
from .capture import (EXTEND, RESTORE, STAGES, CaptureRun, StageFile, StepFiles, batch_of,
                      extend_outputs, file_name, gen_outputs, head_map, manifest_params,
                      prime_outputs, read_batch, reads_capture, row_name, view_columns,
                      view_ledger)
from .model import (Model, compile_flag, compile_mode, device_kind, for_rows, load_model,
                    resolve_device)
from .plain import to_plain
from .sampler import make_generator
from .scorers import columns_of, make_scorer, prefill_scorer, user
from .stages.apply import add_columns, add_heads, apply, extend, prime, restore
from .stages.decide import decide
from .stages.generate import generate, generate_rows
from .stages.score import recall_query, score
from .state import State, gathered, restore_args
from .types import require


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
    tolerance: float | None = None  # None: compared bit for bit (the capture's own device)
    rows: int = 1  # a batch's rows replayed (their steps counted together)

    @property
    def ok(self) -> bool:
        return not self.mismatches


# Cross-device tolerance by the capture's dtype: |ours - theirs| <= tol * (1 + |theirs|).
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2, "int8": 5e-2}


def _equal(ours: torch.Tensor, theirs: torch.Tensor, tol: float | None) -> bool:
    if torch.equal(ours, theirs):
        return True
    if not ours.is_floating_point() or not torch.equal(ours.isnan(), theirs.isnan()):
        return False
    a, b = ours.nan_to_num(), theirs.nan_to_num()
    if tol is None:
        return torch.equal(a, b)
    return bool(((a.double() - b.double()).abs() <= tol * (1 + b.double().abs())).all())


def diff(ours, theirs, key: str = "", tol: float | None = None) -> list[tuple[str, str]]:
    """Differences between two plain structures: [(key path, detail)]; tensors bit-exact,
    or floating-point ones within ``tol`` (relative, see ``TOLERANCE``) where it is given. A
    key the capture lacks where ours is None is no difference: a field added since (such as
    ``PrefillStats.copy``), unset, is what a capture made before it recorded."""
    if isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)):
            return [(key, f"{type(ours).__name__} vs {type(theirs).__name__}")]
        if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return [(key, f"{tuple(ours.shape)} {ours.dtype} vs {tuple(theirs.shape)} {theirs.dtype}")]
        ours, theirs = ours.cpu(), theirs.cpu()
        if _equal(ours, theirs, tol):
            return []
        d = (ours.double() - theirs.double()).abs().nan_to_num(float("inf"))
        return [(key, f"max abs diff {float(d.max()):.3g} at {int(d.argmax())}")]
    if isinstance(theirs, dict) and isinstance(ours, dict):
        out = []
        for k in sorted(set(ours) | set(theirs), key=str):
            sub = f"{key}.{k}" if key else str(k)
            if k not in theirs and k in ours and ours[k] is None:
                continue
            if k not in ours or k not in theirs:
                out.append((sub, "missing in " + ("replay" if k not in ours else "capture")))
            else:
                out += diff(ours[k], theirs[k], sub, tol)
        return out
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return [(key, f"length {len(ours)} != {len(theirs)}")]
        return [d for i, (a, b) in enumerate(zip(ours, theirs))
                for d in diff(a, b, f"{key}[{i}]", tol)]
    if isinstance(ours, float) and isinstance(theirs, float) and tol is not None:
        if abs(ours - theirs) <= tol * (1 + abs(theirs)):
            return []
    if ours != theirs:
        return [(key, f"{ours!r:.60} != {theirs!r:.60}")]
    return []


class _Replay:
    """One replay: the rebuilt state, which files to compare, and the report."""

    def __init__(self, run: CaptureRun, model: Model, report: ReplayReport,
                 stage: str | None, step: int | None):
        self.run, self.model, self.report = run, model, report
        self.only_stage, self.only_step = stage, step
        self.state: State | None = None
        self.scorer = None  # the step's scorer (``begin``)
        captured_on = str(torch.device(run.manifest.get("device", "cpu")))
        here = str(model.device)
        kind, here_kind = run.manifest.get("device_kind"), device_kind(model.device)
        if kind not in (None, here_kind):  # another GPU of the same index, another CPU
            captured_on, here = f"{captured_on} ({kind})", f"{here} ({here_kind})"
        ran, runs = run.manifest.get("kernels"), native.for_model(model)
        if captured_on == here and ran != runs:  # the same device, other native kernels
            captured_on, here = (f"{captured_on} with native kernels {ran or 'not recorded'}",
                                 f"{here} with native kernels {runs}")
        batch = (run.manifest.get("parent") or {}).get("batch", 1)
        if captured_on == here and batch > 1:  # a fork of a row: its first steps ran batched
            captured_on, here = (f"{captured_on} in a batch of {batch} rows (the steps the "
                                 "fork copied)", f"{here} alone")
        if captured_on != here:
            report.tolerance = TOLERANCE[run.manifest["dtype"]]
            report.notes.append(f"captured on {captured_on}, replayed on {here}: "
                                f"floating-point outputs compared within {report.tolerance:g} "
                                "(relative), sampled tokens taken from the capture")

    def wanted(self, stage: str, t: int) -> bool:
        return self.only_stage in (None, stage) and self.only_step in (None, t)

    def check(self, f: StageFile, ours: dict) -> None:
        """Compare a re-run stage's outputs with the file's, bit for bit."""
        self.report.compared[f.stage] = self.report.compared.get(f.stage, 0) + 1
        self.report.mismatches += [Mismatch(f.name, k, d)
                                   for k, d in diff(to_plain(ours), f.outputs,
                                                              tol=self.report.tolerance)]

    def start(self) -> None:
        """Stage 0 before the first step: the prime or the restore the run starts from (a
        chat may restore a session over its prime), then a chat turn, if there was one."""
        require(self.run.has(file_name(0, STAGES[0])) or self.run.has(file_name(0, RESTORE)),
                f"{self.run.dir}: no prime or restore capture at step 0")
        self.prime()
        self.between(0)

    def between(self, t: int) -> None:
        """Stage 0 after step ``t``: a restored session, then a chat turn (each if there was
        one; a restore supersedes what came before it there)."""
        self.restore(t)
        self.extend(t)

    def prime(self) -> None:
        """Stage 0: re-prime from the captured prompt; the K/V it writes must equal the captured."""
        f = self.run.at(0, STAGES[0])
        if f is None:
            return
        inp = f.args
        params = inp["prefill"]  # the statistics' window and scorer, if it gathered them
        self.state, out = prime(self.model, list(inp["segments"]), inp["capacity"],
                                pinned=frozenset(inp["pinned"]), columns=inp["columns"],
                                cold_capacity=inp["cold_capacity"],
                                prefill_window=params and params.prefill.window,
                                scorer=params and prefill_scorer(make_scorer(params), params),
                                prefill_total=inp.get("prefill_total", True),
                                per_head=inp.get("per_head", False),
                                prefill_copy=inp.get("prefill_copy"))
        if self.wanted(f.stage, 0):
            self.check(f, prime_outputs(self.state, out))

    def restore(self, t: int) -> None:
        """The session restored after step ``t``, if one was: stage 0 writes the captured
        state whole, and what it wrote must read back bit for bit."""
        f = self.run.at(t, RESTORE)
        if f is None:
            return
        self.state = restore(self.model, **f.restored)
        if self.wanted(RESTORE, t):
            self.check(f, restore_args(self.state))

    def extend(self, t: int) -> None:
        """The chat turn prefilled after step ``t``, if there was one."""
        f = self.run.at(t, EXTEND)
        if f is None:
            return
        n, inp = self.state.arena.n, f.args
        patch = extend(self.model, self.state, list(inp["segments"]), pending=inp["pending"])
        if self.wanted(EXTEND, t):
            self.check(f, extend_outputs(self.state, n, patch))

    def step(self, files: StepFiles) -> None:
        """Stages 1-4 of one step, each from the captured outputs of the stage before it; the
        captured generate output and actions re-applied rebuild the next state."""
        view = self.begin(files)
        if self.wanted(files.generate.stage, files.step):
            sampler, rng, force = self.draw(files)
            self.check(files.generate, gen_outputs(generate(self.model, view, sampler, rng, force)))
        self.settle(files, view)

    def begin(self, files: StepFiles):
        """A step's start: the view stage 1 read, which must be the rebuilt state's. A step
        whose scorer keeps columns the state lacks (a fork with another policy) first gives
        the state them at their birth values, as ``Session`` did when it took the state over
        (stage 0)."""
        self.scorer = make_scorer(files.cache_params)
        add_columns(self.state, columns_of(self.scorer))
        if files.cache_params.allocation.per_head:  # a fork that went on per head
            add_heads(self.state)
        t, view = files.step, self.state.view()
        if files.state is not None:
            _check_state(files.state, self.state, f"state_{t:06d}.pt", self.report)
        for f in files.stages[:3]:
            if f.data["cache_len"] != view.n:
                self.report.mismatches.append(Mismatch(f.name, "cache_len",
                                                       f"{view.n} != {f.data['cache_len']}"))
        if len({f.data["arena_version"] for f in files.stages[:3]}) != 1:
            self.report.mismatches.append(Mismatch(files.decide.name, "arena_version",
                                                   "changed during stages 1-3 (only stage 4 may write)"))
        g = files.generate
        self.report.mismatches += [Mismatch(g.name, f"inputs.view.{k}", d) for k, d in diff(
            to_plain(view_columns(view)), files.view, tol=self.report.tolerance)]
        return view

    def draw(self, files: StepFiles) -> tuple:
        """Stage 1's sampler, generator (in its captured state) and forced token; on another
        device the captured token is given (the draw happened there)."""
        g = files.generate
        rng, force = make_generator(0, self.model.device), g.args["force"]
        if self.report.tolerance is None:
            rng.set_state(g.args["generator_state"].cpu())
        else:
            force = files.gen.token_id
        return g.args["sampler"], rng, force

    def settle(self, files: StepFiles, view) -> None:
        """Stages 2-4 of the step ``begin`` started: 2 and 3 from the captured outputs of the
        stage before them, 4 re-applying the captured ones (the next state)."""
        t, params, model = files.step, files.cache_params, self.model
        if self.wanted(files.score.stage, t):  # 2) score the captured attention
            recall = recall_query(view, files.gen, params, model.compiled)
            self.check(files.score, {"out": score(view, files.gen.attention, self.scorer,
                                                  recall)})
        if self.wanted(files.decide.stage, t):  # 3) decide from the captured scores
            self.check(files.decide, {"out": decide(model, view, files.scores, params)})
        patch = apply(model, self.state, files.gen, files.actions)  # 4) rebuilds the next state
        if self.wanted(files.apply.stage, t):
            self.check(files.apply, {"out": patch})


@reads_capture
def open_run(run_dir: str | Path, model: Model | None = None,
             device: str | None = None) -> tuple[CaptureRun, Model]:
    """A capture run folder and its model, checked: loaded onto ``device`` (default: the
    capture's, if this machine has it, else the CPU) unless given; a user scorer's file must
    be the one captured."""
    run = CaptureRun(run_dir)
    manifest = run.manifest
    params = manifest_params(manifest)
    user.check_unchanged(params.scorer.name if params else "", manifest.get("scorer_sha256"))  # your own scorer's file
    if model is None and device is None:
        captured = torch.device(manifest.get("device", "cpu"))
        here = captured.type == "cpu" or (torch.cuda.is_available()
                                          and (captured.index or 0) < torch.cuda.device_count())
        device = str(captured) if here else "cpu"
    compiled = compile_mode(manifest.get("compiled"))  # its stage 1 rounds as that code does
    model = model or load_model(manifest["model"], manifest["dtype"], device, compile=compiled)
    require(model.compiled == compiled,
            f"the capture ran {_compiled_words(compiled)} and the model given runs "
            f"{_compiled_words(model.compiled)}")
    run.device = model.device  # the captured tensors load there
    require(json.loads(json.dumps(model.fingerprint)) == run.fingerprint,
            f"the capture is of model {manifest.get('model')!r} {manifest.get('dtype')}, which "
            f"does not match the loaded {model.name!r}")
    return run, model


def _compiled_words(mode: str) -> str:
    """A ``Model.compiled`` as words: with the flag that gives it, or without one."""
    return f"with {compile_flag(mode)}" if mode else "without --compile"


@reads_capture
def rebuild(run: CaptureRun, model: Model, before: int) -> tuple[State, list[int]]:
    """The state a captured run had before step ``before``: its prime or restore, chat turns,
    restores and stage-4 patches re-applied from the event log (nothing re-run or compared),
    and the tokens its steps before then produced."""
    r = _Replay(run, model, ReplayReport(str(run.dir)), stage="", step=None)  # compares none
    r.start()
    tokens = []
    for t in run.steps:
        if t >= before:
            break
        files = run.step(t)
        require(files is not None, f"step {t} was not captured whole; nothing after it can be "
                "rebuilt")
        r.step(files)
        r.between(t)
        tokens.append(files.gen.token_id)
    return r.state, tokens


@reads_capture
def replay(run_dir: str | Path, stage: str | None = None, step: int | None = None,
           model: Model | None = None, progress: Callable[[int, int], None] | None = None,
           device: str | None = None, row: int | None = None) -> ReplayReport:
    """Replay a run folder; ``stage``/``step`` restrict which files are compared (the state
    is still rebuilt from every patch before them). The model loads onto ``device``
    (default: the capture's, if this machine has it, else the CPU). A batch capture, or a
    row of one, replays as a batch (``replay_batch``; ``row``: compare only that row's).
    Bad files raise ``UserError``."""
    require(stage is None or stage in (*STAGES, EXTEND, RESTORE), f"unknown stage {stage!r}; "
            f"expected one of {', '.join((*STAGES, EXTEND, RESTORE))}")
    batch = batch_of(run_dir, row)
    if batch is not None:
        return replay_batch(*batch, stage, step, model, progress, device)
    run, model = open_run(run_dir, model, device)
    manifest, steps = run.manifest, run.steps
    report = ReplayReport(str(run.dir))
    require(step is None or step == 0 or step in steps, f"step {step} is not in this capture "
            f"(steps 1..{steps[-1] if steps else 0})")
    if not manifest.get("complete"):
        report.notes.append(f"the run did not complete (stopped: {manifest.get('stop_reason')}, "
                            f"last file {manifest.get('last_file')})")
    # on the threads it ran on (recorded since they were chosen per run): a float32 product
    # of one row splits by them
    with threads.running(manifest.get("threads")):
        return _replay_steps(run, model, report, stage, step, progress)


def _replay_steps(run, model: Model, report: ReplayReport, stage: str | None,
                  step: int | None, progress) -> ReplayReport:
    """``replay``'s state rebuilt and its steps compared, in order."""
    steps = run.steps
    r = _Replay(run, model, report, stage, step)
    r.start()
    for i, t in enumerate(steps):
        if step is not None and t > step:
            break
        files = run.step(t, state=step in (None, t))
        if files is None:
            report.notes.append(f"step {t} was not captured whole; replay stops before it")
            break
        r.step(files)
        r.between(t)
        r.state.check_valid()
        report.steps += 1
        if progress:
            progress(i + 1, len(steps))
    return report


def replay_batch(folder: Path, row: int | None, stage: str | None, step: int | None,
                 model: Model | None, progress, device: str | None) -> ReplayReport:
    """``replay`` of a batch capture (``capture.BatchTape``): every row rebuilt, and the rows
    that stepped together stepped together again, stage 1 in one product over them as the
    batch ran it (``generate_rows`` over ``for_rows`` of the model, or each alone in a batch
    of one); each row's stages compared as a run's are, only row ``row``'s if given (the
    others still rebuilt: its stage 1 shared their product). ``step``: a row's step."""
    record = read_batch(folder)
    rows = {int(name.removeprefix("row-")): name for name in record["rows"]}
    require(row is None or row in rows, f"--row {row}: {folder} has no such row")
    stepped = {i for together in record["schedule"] for i, _ in together}
    runs, reports, unprimed = {}, {}, []
    for i, name in list(rows.items()):
        run, model = open_run(folder / name, model, device)
        if i not in stepped and not run.has(file_name(0, STAGES[0])):
            unprimed.append(name)  # the batch stopped while it primed: nothing to replay
            del rows[i]
            continue
        runs[i] = run
        reports[i] = ReplayReport(str(folder / name))
        if not runs[i].manifest.get("complete"):
            reports[i].notes.append(f"{name} did not complete (stopped: "
                                    f"{runs[i].manifest.get('stop_reason')})")
    require(rows, f"{folder}: the batch captured no primed row")
    require(row is None or row in rows, f"--row {row}: {folder}'s row {row} was not primed")
    require(step is None or any(step in runs[i].steps or step == 0 for i in rows
                                if row in (None, i)),
            f"step {step} is not in this capture's rows")
    if unprimed:
        reports[min(rows)].notes.append(f"{', '.join(unprimed)}: not primed (the batch "
                                        "stopped first); left out")
    replays = {i: _Replay(runs[i], model, reports[i], stage if row in (None, i) else "", step)
               for i in rows}
    with threads.running(runs[min(rows)].manifest.get("threads")):
        for r in replays.values():
            r.start()
        _step_batch(record, runs, replays, model, step, progress)
    return _merged(folder, {i: reports[i] for i in rows if row in (None, i)})


def _step_batch(record: dict, runs: dict, replays: dict, model: Model, step: int | None,
                progress) -> None:
    """``replay_batch``'s steps: the rows of each batch step as they stepped together."""
    stage1 = for_rows(model, record["size"]) if record["size"] > 1 else None
    schedule = record["schedule"]
    for k, together in enumerate(schedule):
        files = [(replays[i], runs[i].step(t, state=step in (None, t))) for i, t in together]
        cut = [(i, t) for (i, t), (_, f) in zip(together, files) if f is None]
        if cut:
            replays[cut[0][0]].report.notes.append(f"step {cut[0][1]} was not captured whole; "
                                                   "the batch's replay stops before it")
            return
        views = [r.begin(f) for r, f in files]
        wanted = [r.wanted(f.generate.stage, f.step) for r, f in files]
        if any(wanted):
            draws = [r.draw(f) for r, f in files]
            gens = ([generate(model, views[0], *draws[0])] if stage1 is None else
                    generate_rows(stage1, views, *map(list, zip(*draws))))
            for (r, f), w, gen in zip(files, wanted, gens):
                if w:
                    r.check(f.generate, gen_outputs(gen))
        for (r, f), view in zip(files, views):
            r.settle(f, view)
            r.between(f.step)
            r.state.check_valid()
            r.report.steps += 1
        if progress:
            progress(k + 1, len(schedule))


def _merged(folder: Path, reports: dict[int, ReplayReport]) -> ReplayReport:
    """The rows' reports as one, each mismatch naming its row's folder."""
    first = next(iter(reports.values()))
    out = ReplayReport(str(folder) if len(reports) > 1 else first.run_dir,
                       tolerance=first.tolerance, rows=len(reports))
    for i, r in reports.items():
        out.steps += r.steps
        for stage, n in r.compared.items():
            out.compared[stage] = out.compared.get(stage, 0) + n
        out.mismatches += [Mismatch(f"{row_name(i)}/{m.file}", m.key, m.detail)
                           for m in r.mismatches]
        out.notes += [n for n in r.notes if n not in out.notes]
    return out


def _check_state(snap: dict, state, name: str, report: ReplayReport) -> None:
    """Compare a ``full`` state file with the rebuilt state, slot order ignored (by uid; a
    per-head cache's slots as they are, each head's map naming its ledger rows)."""
    view = state.view()
    ours_order = torch.argsort(view.uid)
    theirs_order = torch.argsort(snap["ledger"]["uid"])
    slots = slice(None) if view.heads is not None else ours_order
    ours = {f"arena_{name}": gathered(state.arena, name, state.arena.n)[:, :, slots]
            for name in ("k", "v", "log_mass")} | head_map(view.heads)
    ours |= {"ledger": {c: t[ours_order] for c, t in view_ledger(view).items()},
             "origins": list(view.origins), "pending_token": state.pending_token, "next_position": state.next_position,
             "step": state.step}
    theirs_slots = slice(None) if view.heads is not None else theirs_order
    theirs = {**snap, **{k: snap[k][:, :, theirs_slots]
                         for k in ("arena_k", "arena_v", "arena_log_mass")},
              "ledger": {c: col[theirs_order] for c, col in snap["ledger"].items()}}
    report.mismatches += [Mismatch(name, k, d) for k, d in diff(to_plain(ours), theirs,
                                                                   tol=report.tolerance)]


def main(run_dir: str, stage: str | None, step: int | None, out=None,
         device: str | None = None, row: int | None = None) -> int:
    """The ``replay`` command: exit 0 if everything matches, 1 on a mismatch."""
    console = Console(file=out, stderr=out is None, highlight=False)
    if device is not None:
        resolve_device(device)  # a bad device is refused before the capture is read
    report = replay(run_dir, stage, step, device=device, row=row)
    for note in report.notes:
        console.print(f"note: {note}")
    counts = ", ".join(f"{n} {s}" for s, n in report.compared.items()) or "nothing"
    if report.ok:
        rows = f" ({report.rows} rows)" if report.rows > 1 else ""
        console.print(f"replay OK: {report.steps} steps of {report.run_dir}{rows}; compared "
                      f"{counts}; "
                      + ("all bit-exact" if report.tolerance is None
                         else "all within the tolerance"))
        return 0
    for m in report.mismatches[:20]:
        console.print(f"MISMATCH {m}")
    console.print(f"replay FAILED: {len(report.mismatches)} mismatches in {report.run_dir}")
    return 1


__all__ = ["Mismatch", "ReplayReport", "diff", "main", "open_run", "rebuild", "replay",
           "replay_batch"]
