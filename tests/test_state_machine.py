"""The whole loop as a hypothesis RuleBasedStateMachine, beside a plain-Python model of it.

The model is the live token list in text order, ``[(uid, token_id, position)]``, plus the
next uid, the pending token, its source and position, the step and which uids are pinned.
Rules drive the tiny model's loop: a full step (generate -> score -> decide -> apply with
the machine's CacheParams), hand-picked culls, repairs built by stage 3's ``merge_pair``,
re-indexes, chat-style ``extend``, recalls (a cold token swapped for a hot one, with
``recall`` on; the model then also holds the cold tokens in order of entry) and a save/load
round trip of the session into a fresh state. After every rule the real state must equal the model, ``check_valid()`` must hold,
and stage 1's logits must equal Hugging Face's forward over the same cache.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from positronic_brain import options
from positronic_brain.batch import step_rows
from positronic_brain.capture import Tape
from positronic_brain.loop import Session
from positronic_brain.model import for_rows
from positronic_brain.sampler import make_generator
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import apply, extend
from positronic_brain.stages.decide import decide, removals_needed, merge_pair
from positronic_brain.stages.generate import generate, generate_rows
from positronic_brain.stages.score import recall_query, score
from positronic_brain.state import FLAG_PROTECTED
from positronic_brain.types import (SOURCES, Actions, MergeRepair, SamplerParams, Segment, Swap,
                                   UserError)
from tests.oracle import assert_close, hf_step_logits
from tests.test_properties_readonly import SETTINGS, cache_params, prompts, samplers, token_ids
from tests.tolerance import ORACLE, apart

GREEDY = SamplerParams(greedy=True)


@st.composite
def loop_params(draw):
    """Any CacheParams, or (half the time) a budget within reach of the prompt, merges (or
    whole-turn pruning) and a re-index a few steps later, so that decide does everything."""
    c = draw(cache_params())
    if c.scorer.name == "none" or draw(st.booleans()):
        return c
    budget = c.sinks + c.recent + draw(st.integers(3, 8))
    prune = draw(st.sampled_from(("token", "turns")))
    merges = max(1, c.repair.max_merges if isinstance(c.repair, MergeRepair) else 1)
    return options.cache_params({
        "budget": budget, "allocation": prune, "repair": "merge" if prune == "token" else "none",
        "positions": "compact", "reindex_at": budget + draw(st.integers(1, 12)),
        **({"max_merges": merges} if prune == "token" else {})}, c)


@st.composite
def recall_params(draw):
    """CacheParams with recall: a budget within reach, merges, a small cold store and a
    re-index a few steps later."""
    c = draw(cache_params())
    budget = c.sinks + c.recent + draw(st.integers(3, 8))
    merges = max(1, c.repair.max_merges if isinstance(c.repair, MergeRepair) else 1)
    return options.cache_params({
        "budget": budget, "policy": draw(st.sampled_from(("brightness", "h2o", "tova"))),
        "allocation": "token", "repair": "merge", "max_merges": merges, "recall": True,
        "cold_capacity": draw(st.integers(1, 12)), "recall_layers": 1,
        "recall_max": draw(st.integers(1, 3)), "positions": "compact",
        "reindex_at": budget + draw(st.integers(1, 12))}, c, strict=False)


class LoopMachine(RuleBasedStateMachine):
    model = None  # the tiny model, set by the test
    policy = None
    seen = Counter()  # what the runs did, for the test to check its own reach
    params = staticmethod(loop_params)  # the CacheParams strategy

    # --- the model's bookkeeping -------------------------------------------------------

    def _enter(self, token_id: int, position: int, source: str) -> None:
        """A token enters the cache at the end of the text with the next uid."""
        self.live.append((self.next_uid, token_id, position))
        if source in self.pins:
            self.pinned.add(self.next_uid)
        self.next_uid += 1

    def _apply(self, gen, culled=(), merges=(), reindex=False, swaps=(),
               cold_keep=None) -> None:
        """What stage 4 must do, in its order: merges, swaps, culled tokens into the cold
        store (with recall; its oldest dropped past its capacity), removals, re-index (over
        hot and cold; the oldest cold past ``cold_keep`` dropped first), append."""
        live = self.live
        for r in merges:
            i = [u for u, _, _ in live].index(r.uids[0])
            live[i] = (self.next_uid, r.token_id, live[i][2])
            self.next_uid += 1
        for sw in swaps:
            i = [u for u, _, _ in live].index(sw.uid)
            j = [u for u, _, _ in self.cold].index(sw.cold_uid)
            hot, live[i] = live[i], self.cold.pop(j)
            self.cold.append(hot)
        live.sort(key=lambda x: x[2])  # text order
        gone = set(culled) | {r.uids[1] for r in merges}
        if self.cache.recall:
            by_uid = {x[0]: x for x in live}
            self.cold += [by_uid[u] for u in culled]  # in the order stage 4 takes them
            self.cold = self.cold[max(0, len(self.cold) - self.cache.recall.cold_capacity):]
        self.live = [x for x in live if x[0] not in gone]
        self.removed += len(gone)
        self.pinned -= gone | {r.uids[0] for r in merges}
        if reindex:
            if cold_keep is not None:
                self.cold = self.cold[max(0, len(self.cold) - cold_keep):]
            rank = {u: p for p, (u, _, _) in enumerate(sorted(self.live + self.cold,
                                                              key=lambda x: x[2]))}
            self.live = [(u, t, rank[u]) for u, t, _ in self.live]
            self.cold = [(u, t, rank[u]) for u, t, _ in self.cold]
        position = len(self.live) + len(self.cold) if reindex else self.next_position
        self._enter(self.pending, position, self.pending_source)
        self.pending, self.pending_source = gen.token_id, "assistant"
        self.next_position = position + 1
        self.step += 1

    def _protected(self) -> set[int]:
        """Uids decide may not touch: sinks, the recent window, pinned tokens (only pinned
        ones when it prunes whole turns)."""
        uids = [u for u, _, _ in self.live]
        c = self.cache
        if c.allocation.kind == "turns":
            return set(self.pinned)
        return set(uids[:c.sinks]) | set(uids[max(0, len(uids) - c.recent):]) | self.pinned

    def _unpinned(self) -> list[int]:
        return [u for u, _, _ in self.live if u not in self.pinned]

    def _pairs(self) -> list[int]:
        """Text indices i of unpinned adjacent pairs (i, i + 1) with a left neighbour."""
        free = set(self._unpinned())
        return [i for i in range(1, self.n - 1)
                if self.live[i][0] in free and self.live[i + 1][0] in free]

    def _slot(self, uid: int) -> int:
        return self.session.state.ledger.live("uid").tolist().index(uid)

    def _generate(self):
        return generate(self.model, self.session.state.view(), self.session.sampler,
                        self.session.generator)

    @property
    def n(self) -> int:
        return len(self.live)

    def _room(self) -> bool:
        """An append fits (the arena's capacity and the model's positions)."""
        state = self.session.state
        return (self.n < state.arena.capacity
                and self.next_position < self.model.spec.max_positions - 1)

    def _can_step(self) -> bool:
        """decide culls down to the budget unless protected tokens alone exceed it."""
        if self.cache.budget is None:
            return self._room()
        need = removals_needed(self.n, self.cache.budget)
        return (need <= self.n - len(self._protected())
                and self.next_position < self.model.spec.max_positions - 1)

    # --- rules -------------------------------------------------------------------------

    @initialize(segments=prompts(max_len=10), data=st.data(), sampler=samplers,
                slack=st.integers(1, 24))
    def prime(self, segments, data, sampler, slack):
        cache = data.draw(self.params())
        ids = [(i, s.source) for s in segments for i in s.ids]
        self.cache, self.pins, self.pinned = cache, frozenset(cache.pinned), set()
        self.session = Session(self.model, self.policy, sampler, cache)
        self.session.prime(segments, max(len(ids), cache.budget or 0) + slack)
        self.live, self.next_uid, self.step, self.removed = [], 0, 0, 0
        self.cold = []  # (uid, token_id, position) in order of entry
        for position, (token_id, source) in enumerate(ids[:-1]):
            self._enter(token_id, position, source)
        (self.pending, self.pending_source), self.next_position = ids[-1], len(ids) - 1
        self.issued, self.was_live = set(), set()  # uids seen so far, uids live last time
        self.was_cold = set()

    @precondition(lambda self: self._can_step())
    @rule(count=st.integers(1, 6))
    def loop_steps(self, count):
        """A few loop steps in a row (the loop's main path; the model checked after each)."""
        for _ in range(count):
            if not (self._can_step() and self.loop_step()):
                break
            self.matches_the_model()

    def loop_step(self) -> bool:
        """generate -> score -> decide -> apply with the machine's CacheParams; False if
        decide refused (and nothing changed)."""
        state = self.session.state
        need = removals_needed(self.n, self.cache.budget)
        view = state.view()
        gen = self._generate()
        scores = score(view, gen.attention, self.session.scorer,
                       recall_query(view, gen, self.cache))
        try:
            actions = decide(self.model, view, scores, self.cache)
        except UserError:  # the older turns hold too few slots: refused, nothing changed
            assert self.cache.allocation.kind == "turns"
            self.seen["decide refused"] += 1
            return False
        culled = [int(view.uid[s]) for s in actions.cull_slots]
        touched = set(culled) | {u for r in actions.merges for u in r.uids}
        assert not touched & self._protected(), "decide touched a protected token"
        removed = len(touched) - len(actions.merges)
        # whole turns may free more than the budget needs
        assert removed == need or (self.cache.allocation.kind == "turns" and removed > need), \
            f"decide removed {removed}, the budget needs {need}"
        apply(self.model, state, gen, actions)
        self._apply(gen, culled, actions.merges, actions.reindex, actions.swaps,
                    actions.cold_keep)
        self.seen.update(step=1, decide_need=need, decide_cull=len(culled),
                         decide_repair=len(actions.merges),
                         decide_reindex=actions.reindex, decide_recall=len(actions.swaps),
                         decide_turns=len(culled) * (self.cache.allocation.kind == "turns"))
        return True

    @precondition(lambda self: self._room() and self._unpinned())
    @rule(data=st.data())
    def cull(self, data):
        """Hand-picked culls of unpinned tokens (sinks and recent ones too: only decide
        spares those)."""
        uids = data.draw(st.lists(st.sampled_from(self._unpinned()), min_size=1, max_size=4,
                                  unique=True))
        gen = self._generate()
        apply(self.model, self.session.state, gen,
              Actions(cull_slots=tuple(self._slot(u) for u in uids)))
        self._apply(gen, culled=uids)
        self.seen["cull"] += 1

    @precondition(lambda self: self._room() and self._pairs())
    @rule(data=st.data())
    def repair(self, data):
        """Merge an unpinned adjacent pair with a left neighbour, built by merge_pair."""
        i = data.draw(st.sampled_from(self._pairs()))
        left, first, second = (self._slot(self.live[j][0]) for j in (i - 1, i, i + 1))
        r = merge_pair(self.model, self.session.state.view(), left, first, second)
        gen = self._generate()
        apply(self.model, self.session.state, gen, Actions(merges=(r,)))
        self._apply(gen, merges=(r,))
        self.seen["repair"] += 1

    @precondition(lambda self: self._room() and self.cold and self._unpinned())
    @rule(data=st.data())
    def recall(self, data):
        """A hand-picked recall: a cold token swaps places with an unpinned hot one."""
        hot = data.draw(st.sampled_from(self._unpinned()))
        cold = data.draw(st.sampled_from([u for u, _, _ in self.cold]))
        row = self.session.state.cold.ledger.live("uid").tolist().index(cold)
        gen = self._generate()
        sw = Swap(slot=self._slot(hot), uid=hot, cold_slot=row, cold_uid=cold,
                  columns={c: 0.5 for c in self.session.state.ledger.columns})
        apply(self.model, self.session.state, gen, Actions(swaps=(sw,)))
        self._apply(gen, swaps=(sw,))
        self.seen["recall"] += 1

    @precondition(lambda self: self._room())
    @rule()
    def reindex(self):
        gen = self._generate()
        apply(self.model, self.session.state, gen, Actions(reindex=True))
        self._apply(gen, reindex=True)
        self.seen["reindex"] += 1

    @precondition(lambda self: self._room())
    @rule(data=st.data(), source=st.sampled_from(SOURCES))
    def extend_turn(self, data, source):
        """A new turn: the pending token and all new ids but the last enter the cache."""
        state = self.session.state
        room = min(state.arena.capacity - self.n,
                   self.model.spec.max_positions - 1 - self.next_position, 6)
        ids = data.draw(st.lists(token_ids, min_size=1, max_size=room))
        extend(self.model, state, [Segment(tuple(ids), source)])  # pins: state.pinned
        for token_id, src in zip([self.pending] + ids[:-1],
                                 [self.pending_source] + [source] * (len(ids) - 1)):
            self._enter(token_id, self.next_position, src)
            self.next_position += 1
        self.pending, self.pending_source = ids[-1], source
        self.seen["extend"] += 1

    @rule()
    def export_import(self):
        """Save the session and load it into a fresh state: the loop goes on from there."""
        old = self.session
        with tempfile.TemporaryDirectory() as tmp:
            self.session = load_session(self.model, save_session(old, Path(tmp) / "s.pbs"))
        assert self.session.state.arena.k.data_ptr() != old.state.arena.k.data_ptr()
        a, b = old.state.view(), self.session.state.view()
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v), "live K/V differ"
        assert torch.equal(self.session.generator.get_state(), old.generator.get_state())
        self.seen["export_import"] += 1
        self.seen["export_import after removals"] += self.removed > 0

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def matches_the_model(self):
        state = self.session.state
        state.check_valid()
        m = state.ledger
        assert state.arena.n == m.n == self.n
        ledger = [(r["uid"], r["token_id"], r["position"]) for r in m.rows()]
        assert ledger == self.live, f"ledger {ledger} != model {self.live}"
        assert (state.pending_token, state.pending_source, state.next_position, state.step,
                m.next_uid) == (self.pending, self.pending_source, self.next_position,
                                self.step, self.next_uid)
        flags = {int(u): int(f) & FLAG_PROTECTED for u, f in zip(m.live("uid"), m.live("flags"))}
        assert {u for u, f in flags.items() if f} == self.pinned, "protected flags"
        cold = [] if state.cold is None else list(zip(
            *(state.cold.ledger.live(c).tolist() for c in ("uid", "token_id", "position"))))
        assert sorted(cold) == sorted(self.cold), f"cold store {cold} != model {self.cold}"
        live = {u for u, _, _ in self.live}
        assert live & self.issued <= self.was_live | {u for u, _, _ in self.cold} | \
            self.was_cold, "a uid came back after it left the cache (not by a recall)"
        self.was_cold = {u for u, _, _ in self.cold}
        assert min(live - self.issued, default=1 << 62) > max(self.issued, default=-1), \
            "a new uid is not above every earlier one"
        self.issued |= live
        self.was_live = live

    @invariant()
    def stage1_equals_hf(self):
        view = self.session.state.view()
        if view.log_mass is not None:  # folded slots add their log-mass, which no HF cache can hold: tests/test_fold.py checks those
            return
        gen = generate(self.model, view, GREEDY, make_generator(0))
        assert_close(gen.logits, hf_step_logits(self.model, view), ORACLE,
                     f"step {view.step} logits over {view.n} slots")


@pytest.mark.usefixtures("one_thread")
def test_the_loop_against_a_plain_model(tiny_model, tiny_policy):
    LoopMachine.model, LoopMachine.policy = tiny_model, tiny_policy
    LoopMachine.seen.clear()
    run_state_machine_as_test(LoopMachine, settings=settings(
        max_examples=40, stateful_step_count=30, **SETTINGS))
    seen = dict(LoopMachine.seen)
    print(seen)
    # The examples are derandomized (seeded from the machine's source), but which ones reach
    # a merge decision depends on the model's numbers, which round differently on a GPU and
    # on another CPU (an AVX2-only AMD EPYC reached none where an Intel Xeon did): the
    # "repair" rule must have merged (stage 4) everywhere, and stage 3's choice of merges is
    # checked on fixed inputs by tests/test_loop_step3_decide.py. Which examples reach a
    # re-index also moved with which modules the process had imported before this test (the
    # whole CLI or not): 30 examples missed one, 40 reach every kind either way.
    wanted = ("step", "decide_cull", "decide_reindex", "cull", "repair", "reindex", "extend",
              "export_import", "export_import after removals")
    for kind in wanted:
        assert seen.get(kind), f"no {kind} in {seen}"


class RecallMachine(LoopMachine):
    """The same machine with recall on: culled tokens go cold, recalls swap them back."""

    params = staticmethod(recall_params)


@pytest.mark.usefixtures("one_thread")
def test_the_loop_with_recall_never_loses_a_uid(tiny_model, tiny_policy):
    RecallMachine.model, RecallMachine.policy = tiny_model, tiny_policy
    RecallMachine.seen = Counter()
    run_state_machine_as_test(RecallMachine, settings=settings(
        max_examples=15, stateful_step_count=30, **SETTINGS))
    seen = dict(RecallMachine.seen)
    print(seen)
    for kind in ("step", "decide_cull", "decide_recall", "decide_reindex", "cull", "recall",
                 "reindex", "export_import"):
        assert seen.get(kind), f"no {kind} in {seen}"


class _Recording(Tape):
    """A row's tape here: keeps its last step's stage-1 output and actions, and the uids its
    culls name (read before stage 4 writes the ledger the view reads)."""

    def generated(self, view, sampler, force, gen) -> None:
        self.view, self.gen = view, gen

    def decided(self, cache_params, actions) -> None:
        self.actions = actions
        self.culled = [int(self.view.uid[s]) for s in actions.cull_slots]


class Row:
    """One row of the batch machine: LoopMachine's plain model of one session (its
    bookkeeping, edits and invariant), stepped by the batch."""

    seen = Counter()
    params = staticmethod(lambda: st.one_of(loop_params(), recall_params()).filter(
        lambda c: c.allocation.kind != "turns"))  # a refused turn would stop every row

    def __init__(self, model, policy):
        self.model, self.policy = model, policy


for _name in ("_enter", "_apply", "_protected", "_unpinned", "_pairs", "_slot", "_generate", "n",
              "_room", "_can_step", "prime", "cull", "repair", "recall", "reindex",
              "extend_turn", "matches_the_model"):
    setattr(Row, _name, vars(LoopMachine)[_name])


ROWS = 3  # the batch's rows at most (its stage 1 packed for them)


class BatchMachine(RuleBasedStateMachine):
    """A batch of rows against one plain model each: rows start (each with cache parameters
    and a sampler of its own), finish and are edited by hand on their own; a batch step
    steps every row that can, stage 1 in one product over them (``batch.step_rows``), and
    each row's model follows what its own stage 3 decided. After every rule each row equals
    its model, and the batch's stage 1 gives each row its own forward's logits."""

    model = policy = None
    seen = Counter()

    def __init__(self):
        super().__init__()
        self.rows: list[Row] = []

    @precondition(lambda self: len(self.rows) < ROWS)
    @rule(segments=prompts(max_len=10), data=st.data(), sampler=samplers,
          slack=st.integers(1, 24))
    def start_row(self, segments, data, sampler, slack):
        row = Row(self.model, self.policy)
        Row.prime(row, segments, data, sampler, slack)
        row.session.tape = _Recording()
        self.rows.append(row)
        self.seen["start"] += 1

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def finish_row(self, data):
        self.rows.pop(data.draw(st.integers(0, len(self.rows) - 1)))
        self.seen["finish"] += 1

    @precondition(lambda self: any(r._can_step() for r in self.rows))
    @rule(count=st.integers(1, 4))
    def batch_steps(self, count):
        for _ in range(count):
            rows = [r for r in self.rows if r._can_step()]
            if not rows:
                break
            need = [removals_needed(r.n, r.cache.budget) for r in rows]
            step_rows(for_rows(self.model, ROWS), [r.session for r in rows])
            for r, n in zip(rows, need):
                tape = r.session.tape
                a, culled = tape.actions, tape.culled
                touched = set(culled) | {u for m in a.merges for u in m.uids}
                assert not touched & r._protected(), "decide touched a protected token"
                assert len(touched) - len(a.merges) == n, "decide removed other than needed"
                r._apply(tape.gen, culled, a.merges, a.reindex, a.swaps, a.cold_keep)
                self.seen.update(decide_cull=len(culled), decide_repair=len(a.merges),
                                 decide_reindex=a.reindex, decide_recall=len(a.swaps))
            self.seen["batch step"] += 1
            self.seen[f"batch step of {len(rows)}"] += 1
            self.rows_match()

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), edit=st.sampled_from(("cull", "repair", "recall", "reindex",
                                                "extend_turn")))
    def edit_row(self, data, edit):
        """A hand-made edit of one row alone (the others untouched)."""
        row = self.rows[data.draw(st.integers(0, len(self.rows) - 1))]
        ready = {"cull": row._room() and row._unpinned(), "repair": row._room() and row._pairs(),
                 "recall": row._room() and (row.cold or row.cache.recall) and row._unpinned(),
                 "reindex": row._room(), "extend_turn": row._room()}
        if not ready[edit]:
            return
        if edit == "recall" and not row.cold:  # whether one is cold depends on the numbers:
            Row.cull(row, data)  # a cull of a row with recall sends one there
            self.seen["edit cull"] += 1
            row.matches_the_model()  # (which also notes what went cold)
            if not (row._room() and row.cold and row._unpinned()):
                return
        args = {"reindex": (), "extend_turn": (data, data.draw(st.sampled_from(SOURCES)))}
        getattr(Row, edit)(row, *args.get(edit, (data,)))
        self.seen[f"edit {edit}"] += 1

    @invariant()
    def rows_match(self):
        for row in self.rows:
            row.matches_the_model()

    @invariant()
    def batch_stage1_is_each_rows(self):
        if not self.rows:
            return
        views = [r.session.state.view() for r in self.rows]
        gens = generate_rows(for_rows(self.model, ROWS), views, [GREEDY] * len(views),
                             [make_generator(0) for _ in views], [None] * len(views))
        for view, gen in zip(views, gens):
            alone = generate(self.model, view, GREEDY, make_generator(0))
            tol = apart(self.model, float(alone.logits.abs().max()), view.n + 1)
            assert (gen.logits - alone.logits).abs().max() <= tol


@pytest.mark.usefixtures("one_thread")
def test_a_batch_against_a_plain_model_per_row(tiny_model, tiny_policy):
    BatchMachine.model, BatchMachine.policy = tiny_model, tiny_policy
    BatchMachine.seen = Counter()
    run_state_machine_as_test(BatchMachine, settings=settings(
        max_examples=25, stateful_step_count=30, **SETTINGS))
    seen = dict(BatchMachine.seen)
    print(seen)
    for kind in ("start", "finish", f"batch step of {ROWS}", "batch step of 2", "decide_cull",
                 "decide_reindex", "decide_recall", "edit cull", "edit repair", "edit recall",
                 "edit reindex", "edit extend_turn"):
        assert seen.get(kind), f"no {kind} in {seen}"
