"""Many sequences per forward: a batch of rows stepped together (``run --prompts --batch B``).

Each row is a ``Session`` of its own: its prompt, state (arena, ledger, cold store, scorer
columns, per-head map), scorer, cache parameters, positions, sampler and generator, stop
reason. A batch step runs stage 1 once for all its rows (``stages.generate.generate_rows``:
the weights read once a step, each row attending over its own live slots), then each row's
stages 2-4 as its solo step runs them (``Session.settle``): rows cull, merge, fold, recall
and re-index on their own, and stage 4 stays the only writer of each row's state. A row
finishes on its own (EOS, its token limit, the model's positions, a full arena) and the next
prompt takes its place (continuous batching). Stage 0 primes each row alone.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .capture import NO_TAPE, BatchTape
from .loop import Report, Session, arena_capacity
from .model import Model, for_rows
from .special_tokens import TokenPolicy
from .stages.generate import generate_rows
from .types import CacheParams, SamplerParams, Segment, StepRecord, require


def step_rows(model: Model, sessions: Sequence[Session],
              forces: Sequence[int | None] | None = None) -> list[StepRecord]:
    """One step of every session at once: stage 1 for all of them over ``model`` (the
    sessions' model, or ``for_rows`` of it), then each one's stages 2-4. ``forces``: each
    row's forced token (teacher forcing) or None. A row's record times its share: the batch's
    stage 1 plus its own stages 2-4."""
    t0 = time.perf_counter()
    forces = [None] * len(sessions) if forces is None else forces
    require(len(forces) == len(sessions), f"{len(sessions)} rows, {len(forces)} forced tokens")
    views = [s.begin() for s in sessions]
    gens = generate_rows(model, views, [s.sampler for s in sessions],
                         [s.generator for s in sessions], forces)
    shared = time.perf_counter() - t0
    return [s.settle(view, gen, force, time.perf_counter() - shared)
            for s, view, gen, force in zip(sessions, views, gens, forces)]


Program = Generator[tuple[Session, "int | None"], StepRecord, Any]  # ``run_programs``'


def run_programs(model: Model, programs: Iterable[tuple[int, Program]], batch: int,
                 on_done: Callable[[int, Any], None] | None = None,
                 on_batch: Callable[[list[int]], None] | None = None) -> None:
    """Run ``programs`` (index, program) ``batch`` at a time. A program is a generator over
    one session (``Session.steps`` is one): it does its own work between steps (stage 0's
    prime and extends, a change of its cache parameters), yields (its session, the step's
    forced token or None) for each step it takes, is sent the step's record, and returns a
    value, ``on_done(index, value)``'s. Each batch step runs stage 1 once for every
    program's step (``step_rows`` over ``for_rows`` of ``model``; a batch of 1 steps through
    ``Session.step``), in the order the programs came in; ``on_batch(indices)`` is told of
    the rows each step steps together (before it). A program is taken from ``programs``
    only as a place frees, so the state it makes is made when it can step."""
    require(batch >= 1, f"batch must be >= 1, got {batch}")
    stage1 = for_rows(model, batch) if batch > 1 else None
    programs, active = iter(programs), []

    def advance(index: int, program: Program, rec: StepRecord | None) -> None:
        try:
            want = next(program) if rec is None else program.send(rec)
        except StopIteration as stop:
            if on_done is not None:
                on_done(index, stop.value)
            return
        active.append((index, program, want))

    def step() -> None:  # its locals, which hold the rows, go when it returns: a
        # finished row's state is let go before the row that takes its place is made
        sessions, forces = [w[0] for _, _, w in active], [w[1] for _, _, w in active]
        records = ([sessions[0].step(forces[0])] if stage1 is None
                   else step_rows(stage1, sessions, forces))
        stepped, active[:] = list(active), []
        for (index, program, _), rec in zip(stepped, records):
            advance(index, program, rec)

    left = True
    while True:
        while left and len(active) < batch:
            nxt = next(programs, None)
            if nxt is None:
                left = False
            else:
                advance(*nxt, None)
        if not active:
            return
        if on_batch is not None:
            on_batch([i for i, _, _ in active])
        step()


def watched(steps: Program, on_record: Callable[[StepRecord], None]) -> Program:
    """``steps``, with ``on_record(record)`` told of each of its steps' records first."""
    try:
        want = next(steps)
    except StopIteration as stop:
        return stop.value
    while True:
        rec = yield want
        on_record(rec)  # outside the try: a StopIteration of its own is not a return
        try:
            want = steps.send(rec)
        except StopIteration as stop:
            return stop.value


def drive_rows(model: Model, rows: Iterator[tuple[int, Session]], batch: int,
               max_new_tokens: int, ignore_eos: bool = False,
               on_done: Callable[[int, Report], None] | None = None,
               force: Callable[[int, int], int] | None = None,
               on_step: Callable[[int, StepRecord], None] | None = None,
               on_batch: Callable[[list[int]], None] | None = None) -> None:
    """Step primed sessions ``batch`` at a time until each stops as ``Session.stream`` stops
    it (its ``max_new_tokens``, EOS unless ``ignore_eos``, a full arena, the positions):
    ``rows`` yields (index, session) pairs, taken only as places free (so a row's state is
    made when it can step); ``on_done(index, report)`` is told of each as it finishes, its
    tape closed. ``model``: the sessions' model (stage 1 of a batch runs over
    ``for_rows`` of it); a batch of 1 steps each through ``Session.step``. ``force(index,
    k)``: the token row ``index``'s step ``k`` is given (teacher forcing); ``on_step(index,
    record)`` is told of every step, ``on_batch(indices)`` of the rows each step steps
    together (before it)."""
    require(max_new_tokens >= 0, f"max-new-tokens must be >= 0, got {max_new_tokens}")
    reports: dict[int, Report] = {}  # the rows in flight

    def program(index: int, session: Session) -> Program:
        report = reports[index] = Report(session, ignore_eos)

        def seen(rec: StepRecord) -> None:
            report.add(rec)
            if on_step is not None:
                on_step(index, rec)

        forced = None if force is None else _Forced(lambda k: force(index, k), max_new_tokens)
        yield from watched(session.steps(max_new_tokens, ignore_eos, forced), seen)
        del reports[index]
        session.tape.close(session.stop_reason)
        return report

    try:
        run_programs(model, ((i, program(i, s)) for i, s in rows), batch,
                     None if on_done is None else on_done, on_batch)
    except BaseException as e:  # each row in flight keeps what it recorded, marked unfinished
        for report in reports.values():
            report.session.tape.close(type(e).__name__, complete=False)
        raise


@dataclass(frozen=True)
class _Forced(Sequence):
    """A row's forced tokens as ``Session.steps`` reads them: step ``k``'s is ``at(k)``,
    asked for only when the step comes."""

    at: Callable[[int], int]
    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k):
        return self.at(k)


def run_rows(model: Model, policy: TokenPolicy, prompts: Sequence[list[Segment]],
             sampler: SamplerParams, batch: int, max_new_tokens: int = 64,
             ignore_eos: bool = False, capacity: int | None = None,
             cache_params: CacheParams | None = None,
             on_result: Callable[[int, dict, Session], None] | None = None,
             tape: BatchTape | None = None) -> list[dict]:
    """``loop.run`` of each prompt (its segments), ``batch`` rows at a time (``drive_rows``):
    the results in input order, each the object ``run`` returns for that prompt alone (its
    tokens the same but where float rounding tips a choice: a product of several rows may
    add in another order); ``on_result(i, result, session)`` is told of each as its row
    finishes. A
    batch of 1 steps each row alone, as ``run`` does. ``tape``: the batch's capture (each
    row's tape and the rows each step stepped together), closed when the batch ends."""
    cache_params = cache_params or CacheParams()
    results: list[dict | None] = [None] * len(prompts)

    def primed() -> Iterator[tuple[int, Session]]:
        for i, segments in enumerate(prompts):
            ids = [t for s in segments for t in s.ids]
            session = Session(model, policy, sampler, cache_params,
                              tape=NO_TAPE if tape is None else tape.row(i, ids))
            session.prime(segments, capacity or arena_capacity(model, cache_params, len(ids),
                                                                max_new_tokens))
            yield i, session

    def done(i: int, report: Report) -> None:
        results[i] = report.result()
        if on_result is not None:
            on_result(i, results[i], report.session)

    try:
        drive_rows(model, primed(), batch, max_new_tokens, ignore_eos, done,
                   on_batch=None if tape is None else tape.stepped)
    except BaseException:
        if tape is not None:
            tape.close(complete=False)
        raise
    if tape is not None:
        tape.close()
    return results
