"""The chat engine: multi-turn chat over one session whose cache is held at a fixed budget.

    chat = Chat(model, policy, system="You are terse.", cache_params=CacheParams(budget=512))
    print(chat.say("Name a prime number."))
    for event in chat.stream("And another one?"):
        print(event.text, end="")

The system prompt (exactly the one given, or none) is primed once and pinned. Each user turn
is stage 0 on the live state (``Session.extend``): it closes the previous reply, prefills the
user turn and opens the assistant turn, so the cache holds exactly the ids that priming the
whole conversation would (the model's own end-of-turn token, sampled and still pending, is
cached as it is; a reply cut short gets the marker added). Culls, repairs and re-indexes
happen in the steps (stages 2-4) as in any run; with ``CacheParams(allocation="turns")`` the
oldest whole turns go instead. A turn that cannot fit is refused before anything changes.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .capture import NO_TAPE, Tape
from .loop import Session, arena_capacity
from .model import Model
from .special_tokens import TextStream, TokenPolicy
from .stages.decide import turn_room
from .streaming import StreamEvent
from .types import CacheParams, SamplerParams, Segment, StepRecord, Totals, require

DEFAULT_BUDGET = 1024  # or a quarter of the model's positions, if less


@dataclass(frozen=True)
class Reply:
    """One assistant turn: its text and ids (the stop token left out) and its steps."""

    text: str
    ids: tuple[int, ...]
    stop_reason: str | None  # eos, max_new_tokens, cancelled, capacity, max_positions
    steps: tuple[StepRecord, ...]

    @property
    def ms_per_token(self) -> float:
        return statistics.median(r.ms for r in self.steps) if self.steps else 0.0


class Chat:
    """A conversation: ``say(text) -> reply text`` or ``stream(text)`` (StreamEvents).

    A chat always has a budget (``cache_params.budget`` None: DEFAULT_BUDGET). With compact
    positions it re-indexes early enough (``Positions.reindex_at`` at most max positions - budget) that
    a turn always finds positions; the arena holds 2 x budget slots, room for the cache at the
    budget plus a new turn until the next step culls back down to it.
    """

    def __init__(self, model: Model, policy: TokenPolicy, system: str | None = None,
                 sampler: SamplerParams | None = None, cache_params: CacheParams | None = None,
                 max_new_tokens: int = 256, tape: Tape = NO_TAPE,
                 session: Session | None = None):
        require(policy.chat_format is not None,
                "no chat format known for this tokenizer (ChatML or Llama-3 markers)")
        require(max_new_tokens >= 1, f"max-new-tokens must be >= 1, got {max_new_tokens}")
        self.policy, self.max_new_tokens = policy, max_new_tokens
        self.close_ids = policy.encode(policy.chat_format.turn_close)  # e.g. <|im_end|> \n
        if session is None:
            session = Session(model, policy, sampler or SamplerParams(),
                              self._chat_params(model, cache_params or CacheParams()), tape=tape)
        self.session = session
        state, params = session.state, session.cache_params
        self.capacity = state.arena.capacity if state else \
            arena_capacity(model, params, 0, room=params.budget or 0)
        self.transcript: list[tuple[str, str | tuple[int, ...]]] = []  # this process's turns
        self.last: Reply | None = None
        self.turns, self.totals = 0, Totals()
        self.cache_lens: deque[int] = deque(maxlen=240)  # the last steps' cache lengths
        self._turn_rows: list[dict] = []  # the ledger when the current turn opened
        if system is not None:
            require(session.state is None, "a resumed session has its system prompt already")
            self._prime_system(system)
        self.max_position = session.state.next_position if session.state else -1

    @classmethod
    def resume(cls, session: Session, max_new_tokens: int = 256) -> "Chat":
        """Continue a conversation from a session (e.g. ``session_io.load_session``)."""
        return cls(session.model, session.policy, max_new_tokens=max_new_tokens, session=session)

    @staticmethod
    def _chat_params(model: Model, params: CacheParams) -> CacheParams:
        limit = model.spec.max_positions
        budget = params.budget or min(DEFAULT_BUDGET, limit // 4)
        require(2 * budget < limit, f"a chat budget must be below half the model's {limit} "
                f"positions (room for a turn past the budget), got {budget}")
        positions = params.positions
        if positions.mode == "compact":
            positions = dataclasses.replace(
                positions, reindex_at=positions.reindex_position(limit - budget))
        return dataclasses.replace(params, budget=budget, positions=positions)

    def _prime_system(self, system: str) -> None:
        segments = self.policy.chat([("system", system)], add_generation_prompt=False)
        n, params = sum(len(s.ids) for s in segments), self.session.cache_params
        need = max(n, params.sinks) + (params.recent if params.allocation.kind != "turns" else 0) + 1
        require(need < params.budget, f"the system prompt has {n} tokens: it leaves no room "
                f"for a turn in the budget of {params.budget}")
        self.session.prime(segments, self.capacity)
        self.transcript.append(("system", system))

    # --- a turn -------------------------------------------------------------------------------

    def next_segments(self, text: str) -> tuple[list[Segment], int | None]:
        """What the turn ``text`` prefills: the close of the previous reply (if open), the user
        turn and the opened assistant turn; and the id replacing the pending token (a stop
        token other than the end-of-turn marker), or None. Raises UserError if it cannot fit."""
        require(text.strip() != "", "the turn is empty")
        p, state = self.policy, self.session.state
        if state is None:  # nothing cached yet: the first turn is primed (BOS as the family wants)
            turn, close, pending = p.chat([("user", text)]), [], None
        else:
            turn, close, pending = p.chat([("user", text)], bos=False), self._close(), None
            if close and p.is_eos(state.pending_token):  # the reply's stop token is the marker
                close, pending = close[1:], None if state.pending_token == close[0] else close[0]
        segments = ([Segment(tuple(close), state.pending_source)] if close else []) + turn
        self._check_fits(sum(len(x.ids) for x in segments))
        return segments, pending

    def _close(self) -> list[int]:
        """The end-of-turn ids still missing after the cached text and the pending token."""
        state, close = self.session.state, self.close_ids
        view, k = state.view(), len(close) - 1
        if view.n >= k:
            tail = view.token_id[torch.argsort(view.position)[view.n - k:]].tolist()  # last k
            if tail + [state.pending_token] == close:
                return []
        return close

    def _check_fits(self, turn_len: int) -> None:
        """The turn must fit the room stage 3 leaves it (``decide.turn_room``)."""
        params, state = self.session.cache_params, self.session.state
        if params.budget is None:  # a resumed session without one: only the arena limits
            return
        room, kept, reply = turn_room(state and state.view(), params, self.max_new_tokens)
        require(turn_len <= room, f"the turn adds {turn_len} tokens; the budget of "
                f"{params.budget} leaves room for {max(room, 0)} ({kept} kept"
                + (f", {reply} for the reply)" if reply else ")"))

    def stream(self, text: str) -> Iterator[StreamEvent]:
        """Say ``text``; yields one StreamEvent per generated token (a stop token's text is
        ""). Closing the iteration early ends the reply there (stop reason ``cancelled``); the
        next turn closes it. The turn is checked (and refused) before anything changes."""
        segments, pending = self.next_segments(text)
        s = self.session
        if s.state is None:
            s.prime(segments, self.capacity)
        else:
            s.extend(segments, pending)
        self.transcript.append(("user", text))
        self.turns += 1
        self.max_position = max(self.max_position, s.state.next_position)
        self._turn_rows = s.state.ledger.rows()
        out, ids, steps, done = TextStream(self.policy), [], [], False
        records = s.stream(self.max_new_tokens)
        try:
            for rec in records:
                self._tally(rec)
                steps.append(rec)
                stop = self.policy.is_eos(rec.token_id)
                if not stop:
                    ids.append(rec.token_id)
                yield StreamEvent("" if stop else out.push(rec.token_id), rec)
            done = True
        finally:
            records.close()
            if not done:
                s.stop_reason = "cancelled"
            self.transcript.append(("assistant", tuple(ids)))
            self.last = Reply(self.policy.decode(ids), tuple(ids), s.stop_reason, tuple(steps))

    def say(self, text: str) -> str:
        """Say ``text``; returns the whole reply's text (details in ``self.last``)."""
        for _ in self.stream(text):
            pass
        return self.last.text

    def _tally(self, rec: StepRecord) -> None:
        self.totals.add(rec)
        self.cache_lens.append(rec.cache_len)
        self.max_position = max(self.max_position, self.session.state.next_position)

    # --- what the terminal shows --------------------------------------------------------------

    def stats(self) -> dict:
        """Plain values: turns, cache length/budget/capacity, positions, ms/token (mean over
        all steps; the last reply's median) and the edits so far (``Totals``)."""
        s, t, state = self.session, self.totals, self.session.state
        return {"turns": self.turns, "cache_len": state.arena.n if state else 0,
                "budget": s.cache_params.budget, "capacity": self.capacity,
                "allocation": s.cache_params.allocation.kind, "policy": s.cache_params.scorer.name,
                "next_position": state.next_position if state else 0,
                "max_position": self.max_position, "steps": t.steps,
                "ms_per_token": t.ms_per_token,
                "last_ms_per_token": round(self.last.ms_per_token, 3) if self.last else 0.0,
                "culled": t.culled, "folded": t.folded, "merged": t.merged,
                "reindexed": t.reindexed, "recalled": t.recalled,
                "cold_len": state.cold.n if state and state.cold else 0}

    def context(self) -> tuple[list[dict], set[int], set[int]]:
        """Ledger rows to show (the live ones, and those culled since the current turn
        opened, at their old positions), the culled uids, and the live merged-in uids."""
        state = self.session.state
        if state is None:
            return [], set(), set()
        live = state.ledger.rows()
        uids = {r["uid"] for r in live}
        gone = [r for r in self._turn_rows if r["uid"] not in uids]
        return live + gone, {r["uid"] for r in gone}, set(state.ledger.merged) & uids

    def context_ids(self) -> list[int]:
        """The cached ids in text order, then the pending token."""
        state = self.session.state
        if state is None:
            return []
        return [r["token_id"] for r in state.ledger.rows()] + [state.pending_token]
