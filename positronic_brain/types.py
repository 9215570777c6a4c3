"""Shared types: configuration, stage inputs/outputs, errors.

Everything that crosses a stage boundary is defined here, as frozen dataclasses
holding tensors and plain Python values.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# Provenance of a cached token (the ledger stores the index into this tuple).
SOURCES = ("system", "user", "assistant", "tool")


class UserError(ValueError):
    """Bad input from a user: the CLI prints it on one line and exits 2."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


@contextlib.contextmanager
def inconsistent(where, what: str, name_refusals: bool = False) -> Iterator[None]:
    """What a file's contents make its reader raise (a value of another type, shape or range
    than the code writes, an entry missing) as a one-line ``UserError``: "``where``:
    inconsistent ``what`` (...)". ``name_refusals``: the reader's own refusals name
    ``where`` too."""
    try:
        yield
    except UserError as e:
        if name_refusals:
            raise UserError(f"{where}: {e}") from None
        raise
    except (AssertionError, AttributeError, IndexError, KeyError, OverflowError, RuntimeError,
            TypeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise UserError(f"{where}: inconsistent {what} ({type(e).__name__}: {first})") from None


def require_seed(seed: int) -> None:
    """A seed torch's generators take (64 bits: in [-2**63, 2**64))."""
    require(-2 ** 63 <= seed < 2 ** 64, f"the seed must fit in 64 bits, got {seed}")


@dataclass(frozen=True)
class SamplerParams:
    """Sampling rule applied to one row of logits.

    Order (as in Hugging Face `generate`): repetition penalty, temperature,
    top-k, top-p, min-p. `greedy` (or temperature 0) takes the argmax.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int = 0
    report_top: int = 5  # how many alternatives the sampler reports

    def __post_init__(self) -> None:
        require(math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be >= 0, got {self.temperature}")
        require(self.top_k >= 0, f"top-k must be >= 0, got {self.top_k}")
        require(0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p}")
        require(0 <= self.min_p < 1, f"min-p must be in [0, 1), got {self.min_p}")
        require(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition penalty must be > 0, got {self.repetition_penalty}")
        require(self.report_top >= 1, f"report_top must be >= 1, got {self.report_top}")
        require_seed(self.seed)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass(frozen=True)
class Segment:
    """A run of prompt token ids with one source (what the special-token policy emits)."""

    ids: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        require(self.source in SOURCES, f"unknown source {self.source!r}; expected one of {SOURCES}")


@dataclass(frozen=True)
class ForwardOut:
    """Output of the read-only manual forward of T new tokens over n live slots."""

    logits: torch.Tensor | None  # (T', V) float32; T' = T or 1 (last row only); None: kv_only
    k: torch.Tensor  # (L, kv_heads, T, head_dim) new keys, RoPE applied at their positions
    v: torch.Tensor  # (L, kv_heads, T, head_dim)
    attention: torch.Tensor | None  # (L, heads, n) float32: last new query's weights on live slots
    query: torch.Tensor | None = None  # (L, heads, head_dim): last query, roped and scaled
    lse: torch.Tensor | None = None  # (L, heads) float32: log-sum-exp of its scores (softmax's)
    # the attention each live slot and new token received from the new queries (L, heads, n + T)
    # float32, a query's own token left out: from all of them, and from those of a window
    received: torch.Tensor | None = None
    received_window: torch.Tensor | None = None


@dataclass(frozen=True)
class SamplerReport:
    token_id: int
    top_ids: tuple[int, ...]  # most likely after the sampling rule's processing, best first
    top_probs: tuple[float, ...]


@dataclass(frozen=True)
class GenerateOut:
    """Stage 1 output: everything stage 4 needs to append the pending token."""

    input_token: int  # the pending token that was run
    position: int  # its position
    logits: torch.Tensor  # (V,) float32, raw model logits
    token_id: int  # the sampled next token (the new pending token)
    report: SamplerReport
    k: torch.Tensor  # (L, kv_heads, 1, head_dim)
    v: torch.Tensor  # (L, kv_heads, 1, head_dim)
    attention: torch.Tensor  # (L, heads, n) float32 over live slots (slot order)
    # with recall: the query (L, heads, head_dim) in the model's dtype, roped and scaled, and
    # its softmax's log-sum-exp (L, heads) float32, so a cold key k would get exp(q.k - lse)
    query: torch.Tensor | None = None
    lse: torch.Tensor | None = None


MERGE_RULES = ("max", "birth")  # what a merged pair's token keeps of a column
RECALL_RULES = ("keep", "birth", "signal")  # what a recalled token's column becomes


@dataclass(frozen=True)
class Column:
    """A scorer's own per-token column in the ledger (float32, one value per token, hot or
    cold), declared by the scorer's ``columns`` (name -> ``Column``, or a float: its value at
    birth). ``birth``: a new token's value, one for every source or one per source (SOURCES
    order). ``merge``: a merged pair's token keeps the ``max`` of the two, or starts at its
    ``birth`` value. ``recall``: a token brought back from the cold store ``keep``s the value
    it went cold with, starts at its ``birth`` value, or takes ``signal``: the recall signal
    it beat the hot token with times the queries since it was born (an accumulated
    attention's worth). Values stay finite and within [``low``, ``high``] (None: unbounded),
    which stage 4 checks before it writes them."""

    birth: float | tuple[float, ...] = 0.0
    merge: str = "max"
    recall: str = "keep"
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        require(self.merge in MERGE_RULES, f"a column's merge rule must be one of "
                f"{', '.join(MERGE_RULES)}, got {self.merge!r}")
        require(self.recall in RECALL_RULES, f"a column's recall rule must be one of "
                f"{', '.join(RECALL_RULES)}, got {self.recall!r}")
        b = self.birth if isinstance(self.birth, tuple) else (self.birth,)
        require(all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b),
                f"a column's birth value is a number or a tuple of them, got {self.birth!r:.40}")
        births = self.births
        require(len(births) == len(SOURCES), f"a column's birth value is one number or one "
                f"per source ({len(SOURCES)}), got {len(births)}")
        require(all(math.isfinite(x) and self.holds(x) for x in births), f"a column's birth values {births} must be finite "
                f"and within [{self.low}, {self.high}]")

    @property
    def births(self) -> tuple[float, ...]:
        """The birth value of each source (SOURCES order)."""
        b = self.birth
        return tuple(float(x) for x in b) if isinstance(b, tuple) else (float(b),) * len(SOURCES)

    def holds(self, x: float) -> bool:
        """Whether ``x`` is within [low, high]."""
        return (self.low is None or x >= self.low) and (self.high is None or x <= self.high)


REPAIRS = ("none", "merge", "fold")
AGGREGATIONS = ("all-mean", "all-max", "last-mean", "last-max", "max-max")  # layers-heads over attention
SIGNALS = ("value", "attention")  # what brightness gains from: value-weighted attention or plain


@dataclass(frozen=True)
class CacheParams:
    """What to keep in the cache and how (stages 2-4).

    ``budget``: live slots after each step (None = never cull). ``scorer``: the stage-2
    scorer (``scorers.SCORERS``; the CLI calls it the policy).
    ``repair``: ``merge`` turns up to ``max_merges`` of each step's removals into merges of
    a dim adjacent pair; ``fold`` folds every culled token's K/V into the surviving slot
    whose key is most alike (per layer and KV head), weighted by how many tokens each
    holds, and that slot's attention scores get log(tokens held) added; where the best
    cosine is below ``fold_min_cos`` the token is only dropped. ``positions``: ``compact``
    re-indexes to 0..n-1 when the next
    position would reach ``reindex_at`` (default: the model's max positions); ``keep``
    never does (the run stops there). Protected from culls and repairs: the first
    ``sinks`` live tokens, the last ``recent`` ones, and tokens whose source is ``pinned``.
    ``prune``: ``tokens`` culls single tokens by score; ``turns`` drops whole oldest chat
    turns instead (a user turn with everything up to the next one; never the last, never
    pinned tokens; sinks, recent and repairs do not apply).
    ``recall``: a culled token goes to a cold store (at most ``cold_capacity`` tokens, the
    oldest to enter dropped for good past it) instead of away; every ``recall_every`` steps
    the current query scores the cold keys over ``recall_layers`` layers (evenly spread over
    those brightness reads; None: all of them), hot and cold alike ``recall_aggregate``d,
    and up to ``recall_max`` cold tokens swap places with the dimmest unprotected hot ones
    they beat: those the query attends to most, each with the cold tokens that follow it
    within ``recall_span`` positions, and those that follow a hot token it attends to most,
    where their signal beats the hot one's by more than ``recall_margin`` uniform shares
    (1/n of the live slots' attention). It takes no
    ``fold`` repair (a folded token lives on inside its survivor) and no ``turns`` pruning.
    Brightness: new tokens start at ``seeds[source]`` (in SOURCES order); each step
    b <- clamp(b - decay + gain * share, 0, max_brightness), where share is n times the
    token's ``signal`` (``value``: attention weighted by its value norm relative to the mean
    live one; ``attention``: plain), ``aggregate``d over layers-heads: 1 = a uniform share.
    Brightness leaves out the first ``skip_layers`` fraction of the layers (rounded), whose
    attention is spread broadly and says little about which tokens matter.
    ``prefill_scores``: stage 0 also gathers the prompt's own attention (``PrefillStats``:
    what its last ``prefill_window`` queries paid each token, and what every later query
    did) and seeds the scorer's ledger columns from it (each scorer's ``prefill``), so the
    first cull of a prompt longer than the budget sees the whole prompt's view. None (the
    default): the scorer's own ``prefill_default``, for a prompt longer than the budget
    (``scorers.takes_prefill_scores``; a session records the value it resolved to at the prime).
    """

    budget: int | None = None
    scorer: str = "brightness"  # a name in scorers.SCORERS or a user scorer (scorers.user)
    repair: str = "none"
    positions: str = "compact"
    sinks: int = 4
    recent: int = 16
    pinned: tuple[str, ...] = ("system",)
    decay: float = 0.5
    gain: float = 2.34
    max_brightness: float = 255.0
    seeds: tuple[float, ...] | None = None  # None: every source at max_brightness
    aggregate: str = "all-mean"
    signal: str = "value"
    skip_layers: float = 0.2
    max_merges: int = 1
    fold_min_cos: float = 0.8
    reindex_at: int | None = None
    random_seed: int = 0  # the random scorer's seed
    prune: str = "tokens"
    recall: bool = False
    cold_capacity: int = 16384
    recall_every: int = 4
    recall_max: int = 4
    recall_layers: int | None = None
    recall_span: int = 8
    recall_aggregate: str = "max-max"
    recall_margin: float = 0.0
    prefill_scores: bool | None = None  # None: the scorer's own default
    prefill_window: int = 8
    scorer_params: str = ""  # a user scorer's own fields: "name=value,..." (the CLI's --param)

    def param_dict(self) -> dict[str, str]:
        """``scorer_params`` as {name: value text}."""
        items = [i.strip() for i in self.scorer_params.split(",") if i.strip()]
        return dict(i.split("=", 1) for i in items)

    def __post_init__(self) -> None:
        items = [i for i in self.scorer_params.split(",") if i.strip()]
        bad = [i for i in items if "=" not in i or not i.split("=", 1)[0].strip().isidentifier()]
        require(not bad, f"--param takes NAME=VALUE (no commas in values), got {bad[:1]}")
        require(self.repair in REPAIRS,
                f"repair must be one of {', '.join(REPAIRS)}, got {self.repair!r}")
        require(self.positions in ("keep", "compact"),
                f"positions must be keep or compact, got {self.positions!r}")
        for how in (self.aggregate, self.recall_aggregate):
            require(how in AGGREGATIONS, f"unknown aggregation {how!r}; "
                    f"expected one of {', '.join(AGGREGATIONS)}")
        require(self.signal in SIGNALS, f"signal must be one of {', '.join(SIGNALS)}, "
                f"got {self.signal!r}")
        require(0 <= self.skip_layers < 1,
                f"skip layers must be a fraction in [0, 1), got {self.skip_layers}")
        require(-1 <= self.fold_min_cos <= 1,
                f"fold min cos must be a cosine in [-1, 1], got {self.fold_min_cos}")
        require(self.prefill_scores is None or isinstance(self.prefill_scores, bool),
                f"prefill scores must be on, off or unset (None), got {self.prefill_scores!r}")
        require(self.sinks >= 0, f"sinks must be >= 0, got {self.sinks}")
        require(self.recent >= 0, f"recent must be >= 0, got {self.recent}")
        require(all(s in SOURCES for s in self.pinned), f"pinned sources must be among {SOURCES}")
        for name in ("decay", "gain"):
            v = getattr(self, name)
            require(math.isfinite(v) and v >= 0, f"{name} must be >= 0, got {v}")
        require(math.isfinite(self.max_brightness) and 0 < self.max_brightness <= 255,
                f"max brightness must be in (0, 255], got {self.max_brightness}")
        if self.seeds is None:
            object.__setattr__(self, "seeds", (float(self.max_brightness),) * len(SOURCES))
        require(len(self.seeds) == len(SOURCES)
                and all(0 <= s <= self.max_brightness for s in self.seeds),
                f"seeds must be {len(SOURCES)} values in [0, max brightness]")
        require(self.max_merges >= 0, f"max merges must be >= 0, got {self.max_merges}")
        require(self.prune in ("tokens", "turns"),
                f"prune must be tokens or turns, got {self.prune!r}")
        require(self.prune == "tokens" or self.repair == "none",
                "prune turns drops whole turns; it takes no token repairs")
        for name in ("cold_capacity", "recall_every", "recall_max", "recall_layers", "recall_span",
                     "prefill_window"):
            require(getattr(self, name) is None or getattr(self, name) >= 1,
                    f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        require(self.recall_margin >= 0, f"recall margin must be >= 0, got {self.recall_margin}")
        if self.recall:
            require(self.budget is not None, "recall brings back culled tokens; it needs a budget")
            require(self.repair != "fold", "recall keeps culled tokens whole; it takes no fold "
                    "repair")
            require(self.prune == "tokens", "recall swaps single tokens; it takes no prune turns")
        if self.budget is not None:
            require(self.scorer != "none", "policy none never culls; it takes no budget")
            need = self.sinks + self.recent + 1
            require(self.budget >= need, f"budget {self.budget} is smaller than sinks + recent "
                    f"+ 1 = {need}")
        if self.reindex_at is not None:
            require(self.reindex_at > (self.budget or 1),
                    f"reindex-at must be > the budget (and > 1), got {self.reindex_at}")

    def check_positions(self, max_positions: int) -> None:
        """Refuse a budget or re-index point a model of ``max_positions`` cannot hold."""
        require(self.reindex_at is None or self.reindex_at <= max_positions,
                f"reindex-at {self.reindex_at} is past the model's {max_positions} positions")
        require(self.budget is None or self.budget < max_positions,
                f"budget {self.budget} must be below the model's {max_positions} positions")

    def reindex_position(self, max_positions: int) -> int:
        """The next position at which ``compact`` re-indexes: ``reindex_at``, capped by the
        model's positions."""
        return min(self.reindex_at or max_positions, max_positions)


@dataclass(frozen=True)
class ScoreOut:
    """Stage 2 output: a score per live slot (higher = keep) and the new values of the
    scorer's own per-token columns for stage 4 to write (name -> (n,) float32; a column
    left out is unchanged)."""

    scores: torch.Tensor  # (n,) float32
    columns: dict[str, torch.Tensor] | None = None
    # with recall: the attention signal each hot slot got (n,) and, on a step that scans the
    # cold store, each cold row would have got (c,), aggregated alike over the recall layers
    # (stage 3 compares them)
    hot_signal: torch.Tensor | None = None
    cold_signal: torch.Tensor | None = None


@dataclass(frozen=True)
class RecallQuery:
    """Stage 2's recall input: stage 1's query (L, heads, head_dim) and its softmax's
    log-sum-exp (L, heads), the ``layers`` whose attention gives the signals, how it becomes
    one value per token (CacheParams' ``signal`` and ``aggregate``), and whether this step
    ``scan``s the cold keys too (every ``recall_every``-th step; else the hot signals only),
    with the ``native`` kernel where stage 1 runs natively (``--compile native``)."""

    query: torch.Tensor
    lse: torch.Tensor
    layers: tuple[int, ...]
    signal: str
    aggregate: str
    scan: bool = True
    native: bool = False


@dataclass(frozen=True)
class Swap:
    """A recall: cold row ``cold_slot`` (uid ``cold_uid``) takes hot slot ``slot`` (uid
    ``uid``), whose token goes cold in its place; the recalled token's scorer ``columns``
    named here take these values (the others keep theirs: ``Column.recall``, ``decide.swaps``)."""

    slot: int
    uid: int
    cold_slot: int
    cold_uid: int
    columns: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Merge:
    """Merge the adjacent live pair (slots[0], slots[1]) (text order) into one token at
    ``position`` (the first one's): the model's argmax there given the text to its left."""

    slots: tuple[int, int]
    uids: tuple[int, int]
    token_id: int
    position: int
    k: torch.Tensor  # (L, kv_heads, 1, head_dim), RoPE at ``position``
    v: torch.Tensor  # (L, kv_heads, 1, head_dim)


@dataclass(frozen=True)
class Fold:
    """Fold culled slot ``slot`` (uid ``uid``) into surviving slots ``into`` (L, kv_heads)
    int64, one per layer and KV head (-1: none there): there the slot's K and V become the
    mass-weighted mean of both and its log-mass their log-sum-exp."""

    slot: int
    uid: int
    into: torch.Tensor  # (L, kv_heads) int64 slots, -1 = no fold there


@dataclass(frozen=True)
class Actions:
    """Stage 3 output: the patch stage 4 applies besides the append."""

    columns: dict[str, torch.Tensor] | None = None  # the scorer's columns' new values (n,)
    cull_slots: tuple[int, ...] = ()
    merges: tuple[Merge, ...] = ()
    folds: tuple[Fold, ...] = ()  # culled slots whose K/V fold into survivors
    reindex: bool = False  # positions become 0..n-1 in text order (keys re-rotated)
    swaps: tuple[Swap, ...] = ()  # recalls: cold tokens that take dim hot slots
    cold_keep: int | None = None  # with recall, the cold rows a re-index keeps (newest first)


NO_ACTIONS = Actions()


@dataclass(frozen=True)
class Patch:
    """What stage 0/4 changed in one application (the capture's event-log entry): with the
    previous state, enough to replay it. Stage 4's order: the scorer's columns, merges
    (slot ``slots[0]`` rewritten; ``slots[1]`` removed with the culls), folds, swaps (recalls),
    culled tokens into the cold store (with recall), removals (``moves`` fill the holes),
    re-index (of the cold store too), append. A prime's patch (step 0) holds the appended
    prompt slots and, with prefill scores, the scorer columns seeded after them."""

    step: int
    columns: dict[str, torch.Tensor] | None = None  # (n,) each, written before anything else
    merges: tuple[Merge, ...] = ()
    merged_uids: tuple[int, ...] = ()  # the new uid of each repair
    folds: tuple[Fold, ...] = ()  # applied after merges, before removals
    culled_slots: tuple[int, ...] = ()
    culled_uids: tuple[int, ...] = ()
    moves: tuple[tuple[int, int], ...] = ()  # (from_slot, to_slot) that filled removal holes
    swaps: tuple[Swap, ...] = ()  # recalls, applied after folds, before removals
    cooled_uids: tuple[int, ...] = ()  # culled tokens that went into the cold store
    dropped_uids: tuple[int, ...] = ()  # cold tokens dropped for good (capacity, re-index)
    cold_reindex_to: torch.Tensor | None = None  # (c,) the cold rows' new positions (row order)
    reindex_from: torch.Tensor | None = None  # (n',) old positions of the live slots (slot order)
    reindex_to: torch.Tensor | None = None  # (n',) their new positions
    appended_slots: tuple[int, ...] = ()
    appended_uids: tuple[int, ...] = ()
    appended_positions: tuple[int, ...] = ()
    appended_k: torch.Tensor | None = None  # (L, kv_heads, 1, head_dim) as written (stage 4)
    appended_v: torch.Tensor | None = None
    rebuilt: bool = False  # a failure part-way rebuilt the arena from the ledger


@dataclass(frozen=True)
class PrefillStats:
    """Stage 0's statistics of the prompt's own attention over its n prefilled tokens (slot
    order, which is prompt order at the prime; ``uid`` names them), per layer and head, each
    query's weight on its own token left out (stage 1's row leaves out the pending token's):
    ``window``, the mean over the last ``window_queries`` prefilled queries of what each paid
    to every token (SnapKV's observation window; a token at or after a query gets nothing
    from it); ``total``, the sum over every prefilled query (the attention H2O would have
    gathered; None where the prime was asked for the window only), of which each token got
    ``queries``, the n - 1 - i queries after it. The pending token, stage 1's first query, is
    not among them."""

    uid: torch.Tensor  # (n,) int64
    window: torch.Tensor  # (L, heads, n) float32
    window_queries: int
    total: torch.Tensor | None  # (L, heads, n) float32
    queries: torch.Tensor  # (n,) float32


@dataclass(frozen=True)
class PrimeOut:
    """Stage 0 output besides the new state."""

    logits: torch.Tensor  # (T', V) float32: every cached prompt token's logits, or the last row
    patch: Patch  # with prefill scores, the scorer columns it seeded
    stats: PrefillStats | None = None  # the prompt's attention statistics, when gathered


@dataclass(frozen=True)
class StepRecord:
    """What the loop reports per generated token (plain values only). One word for each
    kind of edit: ``culled`` uids (folded ones too), ``merged`` pairs, how many culled
    tokens were ``folded``, whether positions were ``reindexed``."""

    step: int
    token_id: int
    cache_len: int
    ms: float
    top_ids: tuple[int, ...] = ()
    top_probs: tuple[float, ...] = ()
    logprob: float = 0.0  # log p(token_id) under the raw logits (its NLL when teacher-forced)
    culled: tuple[int, ...] = field(default=())  # uids
    merged: tuple[tuple[tuple[int, int], int, int], ...] = ()  # ((old uids), token_id, new uid)
    folded: int = 0  # culled tokens whose K/V were folded into survivors
    reindexed: bool = False
    recalled: tuple[int, ...] = ()  # uids brought back from the cold store

    @classmethod
    def of(cls, state, gen: GenerateOut, patch: Patch, ms: float) -> "StepRecord":
        """The record of the step that ran ``gen`` and applied ``patch`` to ``state``."""
        return cls(step=state.step, token_id=gen.token_id, cache_len=state.arena.n,
                   ms=round(ms, 3), top_ids=gen.report.top_ids, top_probs=gen.report.top_probs,
                   logprob=float(gen.logits.log_softmax(-1)[gen.token_id]),
                   culled=patch.culled_uids,
                   merged=tuple((r.uids, r.token_id, u)
                                for r, u in zip(patch.merges, patch.merged_uids)),
                   folded=len(patch.folds), reindexed=patch.reindex_to is not None,
                   recalled=tuple(s.cold_uid for s in patch.swaps))

    def as_json(self) -> dict:
        """The ``--json`` step object."""
        return {"step": self.step, "token_id": self.token_id, "logprob": self.logprob,
                "cache_len": self.cache_len, "ms": self.ms, "top": [[i, p] for i, p in zip(self.top_ids, self.top_probs)],
                "culled": list(self.culled),
                "merged": [{"uids": list(u), "token_id": t, "uid": new}
                           for u, t, new in self.merged],
                "folded": self.folded, "reindexed": self.reindexed,
                "recalled": list(self.recalled)}


@dataclass
class Totals:
    """Running counts over step records: the one tally every report (run, chat, bench) uses."""

    steps: int = 0
    ms: float = 0.0
    culled: int = 0
    merged: int = 0
    folded: int = 0
    reindexed: int = 0
    recalled: int = 0

    def add(self, rec: StepRecord) -> None:
        self.steps += 1
        self.ms += rec.ms
        self.culled += len(rec.culled)
        self.merged += len(rec.merged)
        self.folded += rec.folded
        self.reindexed += rec.reindexed
        self.recalled += len(rec.recalled)

    @classmethod
    def of(cls, records) -> "Totals":
        t = cls()
        for rec in records:
            t.add(rec)
        return t

    @property
    def ms_per_token(self) -> float:
        return round(self.ms / self.steps, 3) if self.steps else 0.0

    def edits(self) -> str:
        """``culled 12 (folded 3), merged 1, re-indexed 0, recalled 2``: the edits, as every UI
        words them."""
        return (f"culled {self.culled} (folded {self.folded}), merged {self.merged}, "
                f"re-indexed {self.reindexed}, recalled {self.recalled}")
