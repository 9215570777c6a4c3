"""The loop: prime once, then one token per step through the four stages.

    state = stage0.prime(model, segments, capacity)                 # mutation (+ prefill scores)
    repeat:
        gen     = stage1.generate(model, view, sampler)             # read-only
        scores  = stage2.score(view, gen.attention, scorer, recall) # read-only
        actions = stage3.decide(model, view, scores, cache_params)  # read-only
        patch   = stage4.apply(model, state, gen, actions)          # the only mutation

The loop iterates and reports; a ``Tape`` (``capture.py``) records each stage call beside
it. Stages don't know the tape exists.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import InitVar, asdict, dataclass, field, replace

from . import graph, threads
from .capture import NO_TAPE, Tape
from .model import Model
from .sampler import make_generator
from .scorers import (SCORERS, columns_of, make_scorer, prefill_scorer, reads_copy, reads_total,
                      takes_prefill_scores)
from .special_tokens import TextStream, TokenPolicy
from .stages.apply import add_cold_store, add_columns, add_heads, apply, extend, prime, seed
from .stages.apply.prefill import copy_room
from .stages.decide import decide
from .stages.decide.allocation import budgets
from .stages.generate import generate
from .stages.score import recall_query, score
from .state import State, View
from .types import (PER_HEAD, CacheParams, GenerateOut, Patch, PrefillStats, SamplerParams,
                    Segment, StepRecord, Totals, UserError, require)


# KVzip's repeat instruction (``stages.apply.prefill.reconstruction``): the prompt is copied
# after it, a scorer that reads the reconstruction (``scorers.reads_copy``) seeded from that.
COPY_INSTRUCTION = "\n\nRepeat the previous context exactly.\n\n"


def copy_ids(policy: TokenPolicy) -> tuple[int, ...]:
    """``COPY_INSTRUCTION``'s ids as ``policy`` encodes them (stage 0 holds no tokenizer)."""
    return tuple(policy.encode(COPY_INSTRUCTION))


def check_copy(model: Model, policy: TokenPolicy, n_prompt: int) -> None:
    """Refuse in one line a prompt of ``n_prompt`` tokens that leaves too few positions for
    KVzip's reconstruction (``stages.apply.prefill.copy_room``): a benchmark's check before
    any work."""
    copy_room(model, n_prompt - 1, copy_ids(policy))


def arena_capacity(model: Model, cache_params: CacheParams, n_prompt: int,
                   new_tokens: int | None = None, room: int = 0) -> int:
    """The arena's slots. With a budget: the budget plus ``room`` (a chat turn's), or the
    prompt if longer (the first step then culls down to the budget); with a per-head
    allocation, the most one head may hold (``head_capacity``). Without: the prompt plus
    ``new_tokens``, or the model's positions when that is unknown; never more."""
    limit = model.spec.max_positions
    if cache_params.budget is not None:
        return max(head_capacity(model, cache_params) + room, n_prompt)
    return max(1, min(n_prompt + new_tokens, limit)) if new_tokens is not None else limit


def head_capacity(model: Model, params: CacheParams) -> int:
    """The most slots one (layer, KV head) may hold under ``params``' budget: the budget, or
    under a per-head allocation its largest head's (``adaptive``: a layer's whole share,
    ``budget x KV heads``, less what the other heads keep protected)."""
    spec = model.spec
    if not params.allocation.per_head:
        return params.budget
    per = budgets(params, spec.n_layers, spec.n_kv_heads)
    if per is not None:
        return int(per.max())
    return params.budget * spec.n_kv_heads - (spec.n_kv_heads - 1) * (params.sinks + params.recent)


def cold_capacity(cache_params: CacheParams) -> int | None:
    """The cold store's capacity a prime allocates: with recall, its ``cold_capacity``; else None."""
    return cache_params.recall.cold_capacity if cache_params.recall else None


@dataclass
class Session:
    """One generation session over one model: a state plus the sampler's generator."""

    model: Model
    policy: TokenPolicy
    sampler: SamplerParams = field(default_factory=SamplerParams)
    cache_params: CacheParams = field(default_factory=CacheParams)
    state: State | None = None
    prompt_ids: list[int] = field(default_factory=list)
    generated_ids: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    tape: Tape = NO_TAPE
    scorer: InitVar[object] = None  # a prebuilt stage-2 scorer (bench quality's oracle)

    def __post_init__(self, scorer: object = None) -> None:
        self.generator = make_generator(self.sampler.seed, self.model.device)
        self.scorer = make_scorer(self.cache_params) if scorer is None else scorer
        self.cache_params.check_positions(self.model.spec.max_positions)
        per_head = self.cache_params.allocation.per_head
        require(not per_head or hasattr(self.scorer, "score_heads"), f"policy "
                f"{self.cache_params.scorer.name} scores whole tokens; --allocation "
                f"{self.cache_params.allocation.kind} takes a per-head one "
                f"({', '.join(n for n, c in SCORERS.items() if hasattr(c, 'score_heads'))}, "
                "or a scorer with score_heads)")
        require(not per_head or not graph.chosen(self.model.compiled), "a per-head cache "
                "takes no --compile graph yet (its fixed bucket reads every head's slots)")
        if self.state is not None:  # stage 0: what this scorer and recall need of a state
            add_columns(self.state, columns_of(self.scorer))  # made without them
            if self.state.cold is None and self.cache_params.recall:
                add_cold_store(self.model, self.state, self.cache_params.recall.cold_capacity)
            require(per_head or self.state.heads is None, "the state is a per-head cache: it "
                    f"goes on per head (--allocation {'|'.join(PER_HEAD)})")
            if per_head:
                add_heads(self.state)

    def prime(self, segments: list[Segment], capacity: int | None = None,
              stats: bool = False, total: bool = True, copy: bool = False
              ) -> PrefillStats | None:
        """Stage 0 over the prompt segments (what the special-token policy produced), into
        an arena of ``capacity`` slots (default: ``arena_capacity``). Where
        ``scorers.takes_prefill_scores`` says so (the resolved value is kept in
        ``cache_params``), stage 0 also gathers the prompt's attention statistics and seeds
        the scorer's columns from them (their ``total`` only if it reads it:
        ``scorers.reads_total``); ``stats`` gathers them whatever the scorer (a copy of the
        prime is then seeded with ``seed``), the total too unless ``total`` is False (no
        scorer seeded from them reads it), and KVzip's reconstruction with ``copy`` (or where
        the scorer reads it: ``scorers.reads_copy``), after ``COPY_INSTRUCTION``. Returns them
        (None: not gathered)."""
        n_prompt = sum(len(s.ids) for s in segments)
        before = self.cache_params
        try:
            return self._prime(segments, capacity, stats, total, copy, n_prompt)
        except UserError:  # refused: the session as it was
            self.cache_params = before
            raise

    def _prime(self, segments: list[Segment], capacity: int | None, stats: bool, total: bool,
               copy: bool, n_prompt: int) -> PrefillStats | None:
        params = self._resolve_prefill(n_prompt)
        capacity = capacity or arena_capacity(self.model, params, n_prompt)
        budget = params.budget
        require(budget is None or capacity >= budget,
                f"capacity {capacity} is smaller than the budget {budget}")
        scorer = prefill_scorer(self.scorer, params)
        gather = stats or scorer is not None
        instruction = (copy_ids(self.policy)
                       if gather and ((stats and copy) or reads_copy(scorer)) else None)
        self.state, out = prime(self.model, segments, capacity, pinned=frozenset(params.pinned),
                                columns=columns_of(self.scorer),
                                cold_capacity=cold_capacity(params),
                                prefill_window=params.prefill.window if gather else None,
                                scorer=scorer, prefill_total=(stats and total) or reads_total(scorer),
                                per_head=params.allocation.per_head,
                                prefill_copy=instruction)
        self.tape.primed(self.state, segments, capacity, out, params if gather else None,
                         instruction)
        self.prompt_ids = [i for s in segments for i in s.ids]
        self.generated_ids = []
        self.stop_reason = None
        return out.stats

    def record(self, tape: Tape, source: str) -> None:
        """Capture on ``tape`` from here on, starting with the whole state as it is (restored
        from ``source``, a session file): replay restores it with stage 0 and goes on."""
        require(self.state is not None, "prime or load the session before capturing it")
        self.tape = tape
        tape.restored(self.state, source)

    def seed(self, stats: PrefillStats) -> None:
        """Stage 0: seed the scorer's columns from the statistics of the prime this state is
        a copy of (``prime(stats=True)``), as a prime with these cache parameters would have
        (nothing where ``scorers.takes_prefill_scores`` says no)."""
        require(self.state is not None and self.state.step == 0,
                "seed a freshly primed session (before any step)")
        params = self._resolve_prefill(self.state.arena.n + 1)  # the prompt: pending too
        seed(self.state, prefill_scorer(self.scorer, params), stats)

    def _resolve_prefill(self, n_prompt: int) -> CacheParams:
        """The cache parameters with ``prefill.scores`` as this prime of ``n_prompt`` tokens
        takes it (unset: the scorer's default), kept: captures, sessions and forks record
        what ran, not what a later default would make of it."""
        params = self.cache_params
        if params.prefill.scores is None:
            self.cache_params = replace(params, prefill=replace(
                params.prefill, scores=takes_prefill_scores(self.scorer, params, n_prompt)))
        return self.cache_params

    def extend(self, segments: list[Segment], pending: int | None = None) -> Patch:
        """Stage 0 on the live state (a chat turn): prefill the pending token and the new
        segments but their last id, which becomes pending (``pending`` replaces the old
        pending token first). Recorded at the current step; replay re-runs it there."""
        require(self.state is not None, "prime the session before extending it")
        n = self.state.arena.n
        patch = extend(self.model, self.state, segments, pending=pending)
        self.tape.extended(self.state, segments, pending, n, patch)
        return patch

    def step(self, force: int | None = None) -> StepRecord:
        """One token through the stages. ``force`` (teacher forcing) is the next pending
        token instead of a sampled one; the record's ``logprob`` is the model's for it."""
        t0, view = time.perf_counter(), self.begin()
        gen = generate(self.model, view, self.sampler, self.generator, force)  # 1) read-only
        return self.settle(view, gen, force, t0)

    def begin(self) -> View:
        """A step's start: the view stage 1 reads (the tape told a step begins)."""
        require(self.state is not None, "prime the session before stepping")
        self.tape.begin(self.state, self.generator)  # a recording tape keeps its state (an input)
        return self.state.view()

    def settle(self, view: View, gen: GenerateOut, force: int | None, t0: float) -> StepRecord:
        """Stages 2-4 of the step ``begin`` started, whose stage 1 gave ``gen`` (``force``: the
        token it was given); the record's time counts from ``t0``."""
        tape = self.tape
        tape.generated(view, self.sampler, force, gen)
        recall = recall_query(view, gen, self.cache_params, self.model.compiled)
        scores = score(view, gen.attention, self.scorer, recall)  # 2) read-only
        tape.scored(view, self.cache_params, scores)
        actions = decide(self.model, view, scores, self.cache_params)  # 3) read-only
        tape.decided(self.cache_params, actions)
        patch = apply(self.model, self.state, gen, actions)  # 4) the only mutation
        tape.applied(patch)
        self.generated_ids.append(gen.token_id)
        return StepRecord.of(self.state, gen, patch, (time.perf_counter() - t0) * 1e3)

    def full(self) -> bool:
        """Whether no step fits (stop reason ``capacity``: an arena without a budget is full;
        ``max_positions``: the pending token is past the model's positions)."""
        if self.cache_params.budget is None and self.state.arena.n >= self.state.arena.capacity:
            self.stop_reason = "capacity"
        elif self.state.next_position >= self.model.spec.max_positions:
            self.stop_reason = "max_positions"
        else:
            return False
        return True

    def stream(self, max_new_tokens: int, ignore_eos: bool = False,
               force: Sequence[int] | None = None) -> Iterator[StepRecord]:
        """Step until ``max_new_tokens``, EOS (kept as the last generated token, as with
        Hugging Face ``generate``) or a full arena. With ``force`` (teacher forcing), step
        i's next pending token is ``force[i]`` rather than a sampled one."""
        steps = self.steps(max_new_tokens, ignore_eos, force)
        want = next(steps, None)
        while want is not None:
            rec = self.step(want[1])
            yield rec
            want = _sent(steps, rec)

    def steps(self, max_new_tokens: int, ignore_eos: bool = False,
              force: Sequence[int] | None = None) -> Generator[tuple["Session", int | None],
                                                                StepRecord, None]:
        """``stream``'s steps as a program (``batch.run_programs``): yields (this session,
        the step's forced token or None) for each step it takes and is sent the step's
        record; it stops as ``stream`` does."""
        require(self.state is not None, "prime the session before streaming")
        require(max_new_tokens >= 0, f"max-new-tokens must be >= 0, got {max_new_tokens}")
        require(force is None or len(force) >= max_new_tokens,
                f"{max_new_tokens} steps need as many forced tokens, got {len(force or ())}")
        self.stop_reason = "max_new_tokens"
        for i in range(max_new_tokens):
            if self.full():
                return
            rec = yield self, (None if force is None else force[i])
            if not ignore_eos and self.policy.is_eos(rec.token_id):
                self.stop_reason = "eos"
                return


def _sent(steps: Generator, value):
    """``steps.send(value)``: its next yield, or None where it returned (a StopIteration
    raised anywhere else is not caught)."""
    try:
        return steps.send(value)
    except StopIteration:
        return None


def run(model: Model, policy: TokenPolicy, segments: list[Segment], sampler: SamplerParams,
        max_new_tokens: int = 64, ignore_eos: bool = False, capacity: int | None = None,
        on_text=None, cache_params: CacheParams | None = None, tape: Tape = NO_TAPE,
        on_end: Callable[[Session], None] | None = None) -> dict:
    """Prime and generate; returns the run as plain JSON-ready values (``totals``: the
    run's ``Totals``).

    ``capacity`` defaults to ``arena_capacity`` for the prompt and ``max_new_tokens``.
    ``on_text(delta)`` receives the streamed text; ``on_end(session)`` the session when it
    stops (to save it). The tape is closed when the run ends (marked incomplete if it fails).
    """
    cache_params = cache_params or CacheParams()
    n_prompt = sum(len(s.ids) for s in segments)
    capacity = capacity or arena_capacity(model, cache_params, n_prompt, max_new_tokens)
    session = Session(model, policy, sampler, cache_params, tape=tape)
    result = drive(session, max_new_tokens, ignore_eos, on_text,
                   lambda: session.prime(segments, capacity))
    if on_end is not None:
        on_end(session)
    return result


def drive(session: Session, max_new_tokens: int, ignore_eos: bool = False, on_text=None,
          start=None) -> dict:
    """``run``'s generation on a session (after ``start()``, its prime, if given): the run
    as plain JSON-ready values; the session's tape is closed when it ends."""
    report = Report(session, ignore_eos, on_text)
    try:
        if start is not None:
            start()
        for rec in session.stream(max_new_tokens, ignore_eos):
            report.add(rec)
    except BaseException as e:
        session.tape.close(type(e).__name__, complete=False)
        raise
    session.tape.close(session.stop_reason)
    return report.result()


@dataclass
class Report:
    """What a run reports of its session's steps (``drive``'s; each row's of a batch):
    each step's record, the totals and the text, streamed to ``on_text(delta)``."""

    session: Session
    ignore_eos: bool = False
    on_text: Callable[[str], None] | None = None
    steps: list[dict] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)

    def __post_init__(self) -> None:
        self.text = TextStream(self.session.policy)

    def add(self, rec: StepRecord) -> None:
        self.steps.append(rec.as_json())
        self.totals.add(rec)
        if self.ignore_eos or not self.session.policy.is_eos(rec.token_id):  # the stop
            delta = self.text.push(rec.token_id)  # token ends the text
            if self.on_text and delta:
                self.on_text(delta)

    def result(self) -> dict:
        """The run as plain JSON-ready values (the state checked first)."""
        session, model, tape = self.session, self.session.model, self.session.tape
        session.state.check_valid()
        return {
            "model": model.name,
            "dtype": model.precision,
            "compiled": model.compiled,
            "threads": threads.current(),
            "prompt_ids": session.prompt_ids,
            "generated_ids": session.generated_ids,
            "text": self.text.text,
            "stop_reason": session.stop_reason,
            "steps": self.steps,
            "totals": asdict(self.totals),
            "ledger": session.state.ledger.rows(),
            "kv": session.state.kv_memory(),
            "pending_token": session.state.pending_token,
            **({"capture": str(tape.dir)} if tape.dir else {}),
        }
