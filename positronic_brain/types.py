"""Shared types: configuration, stage inputs/outputs, errors.

Everything that crosses a stage boundary is defined here, as frozen dataclasses
holding tensors and plain Python values.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
RECALL_RULES = ("keep", "birth", "signal", "top")  # what a recalled token's column becomes


@dataclass(frozen=True)
class Column:
    """A scorer's own per-token column in the ledger (float32, one value per token, hot or
    cold), declared by the scorer's ``columns`` (name -> ``Column``, or a float: its value at
    birth). ``birth``: a new token's value, one for every source or one per source (SOURCES
    order). ``merge``: a merged pair's token keeps the ``max`` of the two, or starts at its
    ``birth`` value. ``recall``: a token brought back from the cold store ``keep``s the value
    it went cold with, starts at its ``birth`` value, or takes ``signal``: the recall signal
    it beat the hot token with times the queries since it was born (an accumulated
    attention's worth), or ``top``: the column's largest live value, so a score that never
    decays does not send it cold again at the next swap. Values stay finite and within
    [``low``, ``high``] (None: unbounded), which stage 4 checks before it writes them."""

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


AGGREGATIONS = ("all-mean", "all-max", "last-mean", "last-max", "max-max")  # layers-heads over attention
SIGNALS = ("value", "attention")  # what brightness gains from: value-weighted attention or plain
# what a cull removes: whole tokens, whole chat turns, or each (layer, KV head)'s own tokens
ALLOCATIONS = ("token", "turns", "head", "pyramid", "adaptive", "duo")
PER_HEAD = ALLOCATIONS[2:]
POSITIONS = ("compact", "keep")


def option(default, help: str, flag: str | None = None, **extra):  # noqa: A002 (argparse's word)
    """A config field with its one help string and, where it is not the field's name after
    its class's ``PREFIX``, its option's name (``flag``; ``choices`` and ``metavar`` too):
    the CLI's flags, ``bench --params`` and the flag reference are made from these fields
    (``options``)."""
    return field(default=default, metadata={"help": help, "flag": flag, **extra})


def _at_least_one(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        require(value is None or value >= 1,
                f"{type(config).__name__.lower()} {name.replace('_', ' ')} must be >= 1, got {value}")


@dataclass(frozen=True)
class Positions:
    """What happens as positions reach the model's last one."""

    PREFIX: ClassVar[str] = ""
    mode: str = option("compact", "compact: re-index to 0..n-1 when the next position would "
                       "reach --reindex-at; keep: never (the run stops there)",
                       flag="positions", choices=POSITIONS)
    reindex_at: int | None = option(None, "compact when the next position reaches this "
                                    "(default: the model's max positions)")

    def __post_init__(self) -> None:
        require(self.mode in POSITIONS,
                f"positions must be {' or '.join(POSITIONS)}, got {self.mode!r}")

    def check(self, params: "CacheParams") -> None:
        require(self.reindex_at is None or self.reindex_at > (params.budget or 1),
                f"reindex-at must be > the budget (and > 1), got {self.reindex_at}")

    def check_model(self, max_positions: int) -> None:
        require(self.reindex_at is None or self.reindex_at <= max_positions,
                f"reindex-at {self.reindex_at} is past the model's {max_positions} positions")

    def reindex_position(self, max_positions: int) -> int:
        """The next position at which ``compact`` re-indexes: ``reindex_at``, capped by the
        model's positions."""
        return min(self.reindex_at or max_positions, max_positions)


@dataclass(frozen=True)
class ScorerSpec:
    """The stage-2 scorer: its ``name`` (a key of ``scorers.SCORERS``, or a scorer of the
    user's own: ``scorers.user``) and the fields of its dataclass given here (``params``:
    (field, value) pairs, sorted; a dict is taken too); the rest take the scorer's own
    defaults. ``scorers.make_scorer`` builds it and checks them."""

    name: str = "brightness"
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        items = self.params.items() if isinstance(self.params, dict) else self.params
        require(all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                    for p in items), f"a scorer's params are (field, value) pairs, "
                f"got {self.params!r:.60}")
        object.__setattr__(self, "params", tuple(sorted(items)))

    def get(self, name: str, default=None):
        """The value given for the field ``name``, else ``default``."""
        return self._given.get(name, default)

    @functools.cached_property
    def _given(self) -> dict[str, Any]:  # read on every recall step: made once
        return dict(self.params)


@dataclass(frozen=True)
class Prefill:
    """Prefill scores: stage 0 also gathers the prompt's own attention (``PrefillStats``:
    what its last ``window`` queries paid each token, and what every later query did) and
    seeds the scorer's ledger columns from it (each scorer's ``prefill``), so the first cull
    of a prompt longer than the budget sees the whole prompt's view."""

    PREFIX: ClassVar[str] = "prefill"
    scores: bool | None = option(
        None, "seed the scorer's per-token values from the prompt's own attention at the "
        "prime (brightness, h2o), so the first cull sees the whole prompt (unset: the "
        "scorer's own default, for a prompt longer than the budget; "
        "scorers.takes_prefill_scores)")
    window: int = option(8, "the prompt's last W queries are the scorers' observation window",
                         metavar="W")

    def __post_init__(self) -> None:
        require(self.scores is None or isinstance(self.scores, bool),
                f"prefill scores must be on, off or unset (None), got {self.scores!r}")
        _at_least_one(self, "window")


@dataclass(frozen=True)
class MergeRepair:
    """Repair: up to ``max_merges`` of each step's removals become merges of a dim adjacent
    pair instead (``stages.decide``)."""

    name: ClassVar[str] = "merge"
    PREFIX: ClassVar[str] = ""
    max_merges: int = option(1, "merge: the most removals a step turned into merges")

    def __post_init__(self) -> None:
        require(self.max_merges >= 0, f"max merges must be >= 0, got {self.max_merges}")

    def check(self, params: "CacheParams") -> None:
        require(params.allocation.kind == "token", f"--allocation {params.allocation.kind} "
                "takes no merge repair (a merge makes a whole new token)")


@dataclass(frozen=True)
class FoldRepair:
    """Repair: every culled token's K/V is folded into the surviving slot whose key is most
    alike (per layer and KV head), weighted by how many tokens each holds, and that slot's
    attention scores get log(tokens held) added; where the best cosine is below ``min_cos``
    the token is only dropped."""

    name: ClassVar[str] = "fold"
    PREFIX: ClassVar[str] = "fold"
    min_cos: float = option(0.8, "fold only where the key cosine reaches this (elsewhere "
                            "just drop)")

    def __post_init__(self) -> None:
        require(-1 <= self.min_cos <= 1,
                f"fold min cos must be a cosine in [-1, 1], got {self.min_cos}")

    def check(self, params: "CacheParams") -> None:
        require(params.allocation.kind != "turns", "--allocation turns takes no repair")


REPAIRS = {"none": None, "merge": MergeRepair, "fold": FoldRepair}


def repair_class(name: str) -> type | None:
    """The repair piece's class ``name`` picks (None: no repair), or a one-line error."""
    require(name in REPAIRS, f"repair must be one of {', '.join(REPAIRS)}, got {name!r}")
    return REPAIRS[name]


@dataclass(frozen=True)
class Recall:
    """A culled token goes to a cold store (at most ``cold_capacity`` tokens, the oldest to
    enter dropped for good past it) instead of away; every ``every`` steps the current query
    scores the cold keys over ``layers`` layers (evenly spread over those the scorer reads;
    None: all of them), hot and cold alike ``aggregate``d, and up to ``swaps`` cold tokens
    swap places with the dimmest unprotected hot ones they beat: those the query attends to
    most, each with the cold tokens that follow it within ``span`` positions, and those that
    follow a hot token it attends to most, where their signal beats the hot one's by more
    than ``margin`` uniform shares (1/n of the live slots' attention)."""

    PREFIX: ClassVar[str] = "recall"
    cold_capacity: int = option(16384, "recall: the most cold tokens kept (the oldest dropped "
                                "past it; per head: a head's, the earliest in the text "
                                "dropped)", flag="cold_capacity")
    every: int = option(4, "recall: score the cold store every K steps", metavar="K")
    swaps: int = option(4, "recall: the most tokens swapped in per step (per head: a head's)",
                        flag="recall_max")
    layers: int | None = option(None, "recall: how many layers score the cold keys (default: "
                                "every layer the scorer reads; per head: every layer)")
    span: int = option(8, "recall: a recalled token comes back with the cold tokens that "
                       "follow it within this many positions")
    aggregate: str = option("max-max", "recall: attention over layers-heads, hot and cold "
                            "alike", choices=AGGREGATIONS)
    margin: float = option(0.0, "recall: a cold token swaps in only if it beats the hot one "
                           "by more than M uniform shares (1/n of the attention)", metavar="M")

    def __post_init__(self) -> None:
        _at_least_one(self, "cold_capacity", "every", "swaps", "layers", "span")
        require(self.aggregate in AGGREGATIONS, f"unknown aggregation {self.aggregate!r}; "
                f"expected one of {', '.join(AGGREGATIONS)}")
        require(math.isfinite(self.margin) and self.margin >= 0,
                f"recall margin must be >= 0, got {self.margin}")

    def check(self, params: "CacheParams") -> None:
        require(params.budget is not None, "recall brings back culled tokens; it needs a budget")
        require(not isinstance(params.repair, FoldRepair), "recall keeps culled tokens whole; it "
                "takes no fold repair")
        require(params.allocation.kind != "turns", "recall swaps single tokens; it takes no "
                "--allocation turns")


@dataclass(frozen=True)
class Allocation:
    """What a cull removes and how the budget is shared. ``token``: whole tokens, every
    layer and KV head keeping the same ``budget`` of them; ``turns``: the oldest whole chat
    turns instead of single tokens (a chat's; sinks, recent and repairs do not apply). The
    rest are per-head caches (``stages.apply.heads``), in which each (layer, KV head) keeps
    tokens of its own, by its own scores (a scorer's ``score_heads``): ``head``, each
    keeps ``budget``; ``pyramid`` (PyramidKV), lower layers keep more, the scored part
    falling linearly by ``beta`` or shared by the ``layers`` weights given; ``adaptive``
    (AdaKV), a layer's ``budget x KV heads`` shared among its heads by score, each first
    keeping its best ``floor`` share of the budget; ``duo`` (DuoAttention), the streaming
    heads keep the sinks and the recent window alone and the retrieval heads (the file
    ``heads``) share the rest. Every allocation keeps at most ``budget x layers x KV
    heads`` K/V pairs: they compare at equal memory."""

    PREFIX: ClassVar[str] = "allocation"
    kind: str = option("token", "what a cull removes: token (whole tokens), turns (the oldest "
                       "whole chat turns), or per (layer, KV head): head, pyramid, adaptive, "
                       "duo", flag="allocation", choices=ALLOCATIONS)
    # ``of``: the one kind a field is for (``options`` heads its help with it, and refuses
    # it under another kind)
    beta: float = option(20.0, "the first layer's scored share is 2 x beta - 1 times the last "
                         "one's", of="pyramid")
    layers: tuple[float, ...] = option((), "each layer's weight in the share of the scored "
                                       "budget (one a layer; default: the beta schedule)",
                                       metavar="W,W,...", of="pyramid")
    floor: float = option(0.2, "the share of the budget each head keeps by its own scores "
                          "before the layer's shares", of="adaptive")
    heads: str | None = option(None, "a JSON file naming the retrieval heads ([[layer, "
                               "kv_head], ...] or a layers x KV heads grid of 0/1)",
                               metavar="FILE", of="duo")

    def __post_init__(self) -> None:
        require(self.kind in ALLOCATIONS,
                f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.kind!r}")
        require(math.isfinite(self.beta) and self.beta >= 1,
                f"allocation beta must be >= 1, got {self.beta}")
        require(0 <= self.floor <= 1, f"allocation floor must be in [0, 1], got {self.floor}")
        require(all(math.isfinite(w) and w >= 0 for w in self.layers)
                and (not self.layers or sum(self.layers) > 0),
                "allocation layers are weights >= 0, not all 0")

    @property
    def per_head(self) -> bool:
        """Whether each (layer, KV head) keeps tokens of its own."""
        return self.kind in PER_HEAD

    @property
    def above_protected(self) -> bool:
        """Whether the heads' budgets are shares above the protected tokens (the sinks, the
        recent window, the appended token), so that a wider window moves them:
        ``pyramid`` and ``duo`` (``stages.decide.allocation.budgets``)."""
        return self.kind in ("pyramid", "duo")

    def check(self, params: "CacheParams") -> None:
        require(not self.per_head or params.budget is not None,
                f"--allocation {self.kind} shares a budget: give --budget")


@dataclass(frozen=True)
class CacheParams:
    """What to keep in the cache and how (stages 2-4): what every run shares, and its pieces.

    ``budget``: live slots after each step (None = never cull). Protected from culls and
    repairs: the first ``sinks`` live tokens, the last ``recent`` ones, and tokens whose
    source is ``pinned``. ``positions``: ``Positions``. ``scorer``: the stage-2 scorer and
    its fields (``ScorerSpec``; the CLI calls it the policy); ``prefill``: whether and how
    the prime seeds its columns (``Prefill``). ``allocation``: what a cull removes, whole
    tokens, whole oldest chat turns (a user turn with everything up to the next one; never
    the last, never pinned tokens) or each (layer, KV head)'s own tokens, and how the budget
    is shared among them (``Allocation``). ``repair``: None, ``MergeRepair`` or ``FoldRepair``; ``recall``: None or ``Recall``. Each
    piece checks its own fields and its rules with the rest (its ``check``).

    Shorthands: ``scorer`` takes a name, ``repair`` a name in ``REPAIRS``, ``recall`` a
    bool, ``positions`` a mode and ``allocation`` a kind, for the piece with its defaults.
    """

    budget: int | None = option(None, "live cache slots after each step, a (layer, KV head)'s "
                                "on average with a per-head allocation (default: no culling)")
    sinks: int = option(4, "first tokens never culled")
    recent: int = option(16, "last tokens never culled")
    pinned: tuple[str, ...] = option(("system",), "sources never culled (of "
                                     f"{', '.join(SOURCES)})")
    positions: Positions = Positions()
    scorer: ScorerSpec = ScorerSpec()
    prefill: Prefill = Prefill()
    allocation: Allocation = Allocation()
    repair: MergeRepair | FoldRepair | None = None
    recall: Recall | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scorer, str):
            object.__setattr__(self, "scorer", ScorerSpec(self.scorer))
        if isinstance(self.repair, str):
            kind = repair_class(self.repair)
            object.__setattr__(self, "repair", kind and kind())
        if isinstance(self.recall, bool):
            object.__setattr__(self, "recall", Recall() if self.recall else None)
        if isinstance(self.positions, str):
            object.__setattr__(self, "positions", Positions(self.positions))
        if isinstance(self.allocation, str):
            object.__setattr__(self, "allocation", Allocation(self.allocation))
        require(self.sinks >= 0, f"sinks must be >= 0, got {self.sinks}")
        require(self.recent >= 0, f"recent must be >= 0, got {self.recent}")
        require(all(s in SOURCES for s in self.pinned), f"pinned sources must be among {SOURCES}")
        if self.budget is not None:
            require(self.scorer.name != "none", "policy none never culls; it takes no budget")
            need = self.sinks + self.recent + 1
            require(self.budget >= need, f"budget {self.budget} is smaller than sinks + recent "
                    f"+ 1 = {need}")
        for piece in (self.positions, self.allocation, self.repair, self.recall):
            if piece is not None:
                piece.check(self)

    @property
    def repair_name(self) -> str:
        """``none``, ``merge`` or ``fold``."""
        return self.repair.name if self.repair else "none"

    def check_positions(self, max_positions: int) -> None:
        """Refuse a budget or re-index point a model of ``max_positions`` cannot hold."""
        self.positions.check_model(max_positions)
        require(self.budget is None or self.budget < max_positions,
                f"budget {self.budget} must be below the model's {max_positions} positions")


@dataclass(frozen=True)
class ScoreOut:
    """Stage 2 output: a score per live slot (higher = keep) and the new values of the
    scorer's own per-token columns for stage 4 to write (name -> (n,) float32; a column
    left out is unchanged)."""

    scores: torch.Tensor  # (n,) float32; a per-head cache's (L, kv_heads, n), over each head's slots
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
    head_culls: torch.Tensor | None = None  # per-head caches: (L, kv_heads, n) slots culled
    # per-head fold repair: (L, kv_heads, n) the slot of its head each culled slot folds
    # into (-1: none; it is only dropped)
    head_folds: torch.Tensor | None = None
    # per-head recall: (k, 4) int64 rows (layer, KV head, hot slot, cold slot), each head's
    # hot slot trading places with its cold one, and the recalled entries' scorer columns
    # that take new values there (name -> (k,) float32; ``Column.recall``)
    head_swaps: torch.Tensor | None = None
    head_recalled: dict[str, torch.Tensor] | None = None


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
    head_culls: torch.Tensor | None = None  # per-head caches: (L, kv_heads, n) slots culled
    head_folds: torch.Tensor | None = None  # and the slots they folded into (Actions')
    head_swaps: torch.Tensor | None = None  # per-head recalls (Actions'), before the culls
    head_recalled_uids: tuple[int, ...] = ()  # the token each of them brought back


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
    not among them. ``copy`` (None where not asked for): the most attention any query of a
    read-only reconstruction of the prompt paid each token (KVzip's score;
    ``stages.apply.prefill.reconstruction``)."""

    uid: torch.Tensor  # (n,) int64
    window: torch.Tensor  # (L, heads, n) float32
    window_queries: int
    total: torch.Tensor | None  # (L, heads, n) float32
    queries: torch.Tensor  # (n,) float32
    copy: torch.Tensor | None = None  # (L, heads, n) float32: ``reconstruction``'s


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
    folded: int = 0  # culled tokens whose K/V were folded into survivors (per head: slots)
    reindexed: bool = False
    recalled: tuple[int, ...] = ()  # uids brought back from the cold store (per head: a head's)

    @classmethod
    def of(cls, state, gen: GenerateOut, patch: Patch, ms: float) -> "StepRecord":
        """The record of the step that ran ``gen`` and applied ``patch`` to ``state``."""
        return cls(step=state.step, token_id=gen.token_id, cache_len=state.arena.n,
                   ms=round(ms, 3), top_ids=gen.report.top_ids, top_probs=gen.report.top_probs,
                   logprob=float(gen.logits.log_softmax(-1)[gen.token_id]),
                   culled=patch.culled_uids,
                   merged=tuple((r.uids, r.token_id, u)
                                for r, u in zip(patch.merges, patch.merged_uids)),
                   folded=len(patch.folds) if patch.head_folds is None
                   else int((patch.head_folds >= 0).sum()), reindexed=patch.reindex_to is not None,
                   recalled=tuple(s.cold_uid for s in patch.swaps) + patch.head_recalled_uids)

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
