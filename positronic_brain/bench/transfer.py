"""``positronic-brain bench transfer``: what a cache carried into another context keeps.

The benchmark is a list of sections (``SECTIONS``), each measured on the same loaded model
and reported under its own heading, with its own tables and method:

- ``compose``: a text is split into parts, each primed in a session of its own, and the
  sessions are composed (``compose.compose``) into the text's context; ``blend.measure``
  then compares the composed cache with a joint prefill of the same text: each layer's K/V
  deviation, each part's, and the NLL of the text's next tokens under the composed cache,
  the joint prefill and CacheBlend's selective recompute at each R. Repeated over several
  texts (Python's help topics long enough, in sorted-key order).
- ``partial``: a text's first part primed as the target, its next two parts as a document
  primed alone, the document imported into the target with some of its layers and the
  others rebuilt there (``partial.partial_bench``), and the NLL of the text's next tokens
  for each layer subset against the full transfer.
- ``projector``: SmolLM2's projector onto itself (``transfer.projector_bench``) trained from
  the identity perturbed, which it must learn back: the held-out KL before and after.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..blend import SELECT_LAYER, check_percents, measure
from ..compose import Part, compose
from ..partial import partial_bench
from ..transfer import TrainParams, projector_bench
from ..loop import Session
from ..model import Model, load_model
from ..special_tokens import TokenPolicy
from ..types import CacheParams, Segment, UserError, require
from . import common, flags
from .common import Table, fmt
from .result import Machine, Result, model_facts


@dataclass(frozen=True)
class TransferConfig:
    """What to measure. Compose: ``texts`` texts, each ``parts`` parts of ``part_tokens``
    cached tokens, then ``continuation`` tokens whose NLL is measured; recompute at each of
    ``percents``, selected at ``select_layer``."""

    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    quick: bool = False
    texts: int = field(default=8, metadata={"quick": 2})
    parts: int = 4
    part_tokens: int = field(default=256, metadata={"quick": 128})
    continuation: int = field(default=128, metadata={"quick": 64})
    percents: tuple[float, ...] = (5, 10, 20, 50, 100)
    select_layer: int = SELECT_LAYER
    projector_steps: int = field(default=TrainParams.steps, metadata={"quick": 100})
    projector_tokens: int = field(default=16384, metadata={"quick": 8192})

    def __post_init__(self) -> None:
        require(self.texts >= 1 and self.parts >= 1 and self.part_tokens >= 1
                and self.continuation >= 1, "texts, parts, part tokens and continuation must "
                "be >= 1")
        check_percents(self.percents)

    @classmethod
    def preset(cls, quick: bool, **kw) -> "TransferConfig":
        """The config, with each field's ``quick`` value (its metadata) for ``--quick``."""
        return flags.preset(cls, quick, **kw)

    def fitted(self, max_positions: int) -> "TransferConfig":
        """Parts short enough that the composed text and the continuation fit the model's
        positions."""
        room = (max_positions - self.continuation - 1) // self.parts
        require(room >= 1, f"the model's {max_positions} positions leave no room for "
                f"{self.parts} parts and {self.continuation} continuation tokens")
        return dataclasses.replace(self, part_tokens=min(self.part_tokens, room))

    @property
    def text_tokens(self) -> int:
        """Tokens a text needs: the parts, the pending token, the continuation."""
        return self.parts * self.part_tokens + 1 + self.continuation


@dataclass(frozen=True)
class Section:
    """One part of the benchmark, under its own heading: ``measure(model, policy, cfg,
    tick)`` -> its result (the field of ``Sections`` named ``name``; ``tick`` advances the
    progress bar, ``steps(cfg)`` times in all); ``facts(cfg)``, what it measured (a
    sentence); ``tables`` and ``plots(result, out, model)`` (PNG file names written into
    ``out``) of its result; ``method``, how it measures (markdown)."""

    name: str
    title: str
    measure: Callable[[Model, TokenPolicy, TransferConfig, Callable[[], None]], Any]
    steps: Callable[[TransferConfig], int]
    facts: Callable[[TransferConfig], str]
    tables: Callable[[Any], list[Table]]
    plots: Callable[[Any, Path, str], list[str]]
    method: str


# --- compose ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class KV:
    """A cache's deviation from the joint prefill's: ||K - K joint|| / ||K joint|| over
    every layer, row, head and dimension (V alike)."""

    k: float
    v: float


@dataclass(frozen=True)
class Deviation(KV):
    """A composed cache's deviation from the joint prefill: in all, per layer and per part
    (the mean of its tokens')."""

    layer_k: list[float]
    layer_v: list[float]
    part_k: list[float]
    part_v: list[float]


@dataclass(frozen=True)
class Recompute:
    """A text's composed cache with R% of its rows recomputed (``blend.measure``'s): the
    rows, the continuation's NLL, the gap closed (None where composed equals joint) and the
    deviation left."""

    percent: float
    rows: int
    nll: float
    gap_closed: float | None
    deviation: KV


@dataclass(frozen=True)
class NLL:
    """The continuation's NLL under the composed cache and under the joint prefill."""

    composed: float
    joint: float


@dataclass(frozen=True)
class ComposeRun:
    """One text composed from its parts and measured against its joint prefill."""

    text: str
    tokens: int
    nll: NLL
    recompute: list[Recompute]
    deviation: Deviation
    seconds: float


@dataclass(frozen=True)
class CurvePoint:
    """One R over the texts: the means, and the range of the gap closed."""

    percent: float
    rows: float | None
    nll: float | None
    gap_closed: float | None
    gap_min: float | None
    gap_max: float | None
    k: float | None
    v: float | None


@dataclass(frozen=True)
class ComposeSummary:
    """Means over the texts: the NLLs, the deviation in all, per layer and per part, and
    each R's point of the curve."""

    nll_composed: float | None
    nll_joint: float | None
    k: float | None
    v: float | None
    layer_k: list[float | None]
    layer_v: list[float | None]
    part_k: list[float | None]
    part_v: list[float | None]
    curve: list[CurvePoint]


@dataclass(frozen=True)
class Compose:
    """The compose section: each text's run and their means."""

    runs: list[ComposeRun]
    summary: ComposeSummary


def topic_texts(policy: TokenPolicy, count: int, tokens: int) -> list[tuple[str, list[int]]]:
    """The first ``count`` of Python's help topics (sorted-key order) with at least
    ``tokens`` tokens: (key, ids)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        ids = policy.encode(topics[key])
        if len(ids) >= tokens:
            out.append((key, ids))
        if len(out) == count:
            return out
    raise UserError(f"only {len(out)} of Python's help topics have {tokens} tokens; "
                    f"{count} wanted")


def composed(model: Model, policy: TokenPolicy, ids: list[int], parts: int, size: int) -> Session:
    """``ids[:parts * size]`` in ``parts`` sessions of their own (each primed with its
    ``size`` tokens and the next part's first token pending), composed; the last part's
    pending token is ``ids[parts * size]``."""
    sessions = []
    for i in range(parts):
        s = Session(model, policy, cache_params=CacheParams(scorer="none"))
        s.prime([Segment(tuple(ids[i * size:(i + 1) * size + 1]), "user")], size + 1)
        sessions.append(Part.of(s, f"part {i + 1}"))
    return compose(model, sessions)


def compose_section(model: Model, policy: TokenPolicy, cfg: TransferConfig,
                    tick: Callable[[], None]) -> Compose:
    """Each text composed from its parts and measured against its joint prefill."""
    runs = []
    n = cfg.parts * cfg.part_tokens
    for key, ids in topic_texts(policy, cfg.texts, cfg.text_tokens):
        t0 = time.perf_counter()
        session = composed(model, policy, ids, cfg.parts, cfg.part_tokens)
        report, _ = measure(model, session.state, ids[n + 1:n + 1 + cfg.continuation],
                            cfg.percents, cfg.select_layer)
        d = report["deviation"]
        by_part = [slice(i * cfg.part_tokens, (i + 1) * cfg.part_tokens) for i in range(cfg.parts)]
        runs.append(ComposeRun(
            text=key, tokens=len(ids), nll=NLL(**report["nll"]),
            recompute=[Recompute(**{**x, "deviation": KV(**x["deviation"])})
                       for x in report["recompute"]],
            deviation=Deviation(d["k"], d["v"], d["layer_k"], d["layer_v"],
                                [statistics.fmean(d["token_k"][p]) for p in by_part],
                                [statistics.fmean(d["token_v"][p]) for p in by_part]),
            seconds=time.perf_counter() - t0))
        tick()
    return Compose(runs, _summary(runs))


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _summary(runs: list[ComposeRun]) -> ComposeSummary:
    """Means over the texts: NLLs, each R's gap closed (and its range), each layer's and
    part's deviation."""
    dev = [r.deviation for r in runs]
    curve = []
    for i, first in enumerate(runs[0].recompute):
        at = [r.recompute[i] for r in runs]
        gaps = [x.gap_closed for x in at if x.gap_closed is not None]
        curve.append(CurvePoint(first.percent, _mean(x.rows for x in at),
                                _mean(x.nll for x in at), _mean(gaps), min(gaps, default=None),
                                max(gaps, default=None), _mean(x.deviation.k for x in at),
                                _mean(x.deviation.v for x in at)))
    return ComposeSummary(
        _mean(r.nll.composed for r in runs), _mean(r.nll.joint for r in runs),
        _mean(d.k for d in dev), _mean(d.v for d in dev),
        *([_mean(col) for col in zip(*(getattr(d, name) for d in dev))]
          for name in ("layer_k", "layer_v", "part_k", "part_v")),
        curve=curve)


def compose_tables(c: Compose) -> list[Table]:
    s, runs = c.summary, c.runs
    rows = [("composed", "0", fmt(s.nll_composed, 4), "0", "", fmt(s.k, 4), fmt(s.v, 4)),
            ("joint prefill", "all", fmt(s.nll_joint, 4), "1", "", "0", "0")]
    rows += [(f"recompute {x.percent:g}%", fmt(x.rows, 0), fmt(x.nll, 4),
              fmt(x.gap_closed, 3), f"{fmt(x.gap_min, 3)} to {fmt(x.gap_max, 3)}",
              fmt(x.k, 4), fmt(x.v, 4)) for x in s.curve]
    per_text = tuple((r.text, fmt(r.nll.composed, 4), fmt(r.nll.joint, 4),
                      *(fmt(x.gap_closed, 3) for x in r.recompute)) for r in runs)
    return [
        Table(f"Compose: the continuation's NLL under each cache (mean over {len(runs)} texts)",
              ("cache", "rows recomputed", "NLL", "gap closed", "gap closed, range",
               "K deviation", "V deviation"), tuple(rows),
              "Gap closed = (NLL composed - NLL) / (NLL composed - NLL joint), per text, then "
              "the mean. Deviation = ||K - K joint|| / ||K joint|| over every layer, row, head "
              "and dimension (V alike)."),
        Table("Compose: gap closed per text", ("text", "NLL composed", "NLL joint",
                                              *(f"{x.percent:g}%" for x in s.curve)),
              per_text),
        Table("Compose: deviation from the joint prefill by part (mean per-token relative "
              "deviation)", ("part", "K", "V"),
              tuple((str(i + 1), fmt(k, 4), fmt(v, 4))
                    for i, (k, v) in enumerate(zip(s.part_k, s.part_v)))),
        Table("Compose: deviation from the joint prefill by layer", ("layer", "K", "V"),
              tuple((str(i), fmt(k, 4), fmt(v, 4))
                    for i, (k, v) in enumerate(zip(s.layer_k, s.layer_v)))),
    ]


COMPOSE_METHOD = """\
- **Texts**: Python's help topics (`pydoc_data.topics`) in sorted-key order, the first
  that have enough tokens for the parts, the pending token and the continuation.
- **Composed cache**: the text's first parts x part tokens, each part primed in a session
  of its own (its first token at position 0) with the next part's first token pending, then
  composed in order (`compose.compose`: each part's positions moved past the parts before
  it, its keys re-rotated exactly); the last part's pending token is the text's next token.
  No part saw the parts before it: the first part's rows equal the joint prefill's (to float
  rounding), the others' deviate from layer 1 on (layer 0's K/V are each token's own).
- **Joint prefill**: the same tokens at the same positions through one causal prefill
  (`blend.Blend`, chunked as stage 0's prefill). Deviation per layer: ||K - K joint|| /
  ||K joint|| over the layer's rows, heads and dimensions; per part: the mean of each
  token's over every layer, head and dimension.
- **NLL**: the text's next tokens (the continuation) teacher-forced over each cache, their
  mean negative log-likelihood.
- **Recompute R%** (CacheBlend's selective recompute): the ceiling of R% of the rows, those
  whose values deviate most from the joint prefill's at the selection layer, re-run in
  text order at their positions through one masked read-only forward over the composed
  cache: each sees the rows not selected before it and the selected ones before it
  (causally), so every layer's new K/V are CacheBlend's recompute of that layer; their K/V
  replace the composed ones. R = 100 is the joint prefill (`tests/test_blend.py`).
  CacheBlend selects at run time from its first layers; here the deviation is read off
  the joint prefill. Gap closed = (NLL composed - NLL at R) / (NLL composed - NLL joint)."""


def compose_facts(c: TransferConfig) -> str:
    return (f"{c.texts} texts, each {c.parts} parts of {c.part_tokens} tokens and "
            f"{c.continuation} continuation tokens; recompute at "
            f"{', '.join(f'{p:g}' for p in c.percents)}% of the rows, selected by their "
            f"value deviation at layer {c.select_layer}.")


def compose_plots(c: Compose, out: Path, model: str) -> list[str]:
    """Gap closed against R, per text and their mean."""
    series = {r.text: ([x.percent for x in r.recompute], [x.gap_closed for x in r.recompute], ":")
              for r in c.runs if all(x.gap_closed is not None for x in r.recompute)}
    curve = c.summary.curve
    series["mean"] = ([x.percent for x in curve], [x.gap_closed for x in curve],
                      {"linestyle": "-", "color": "black"})
    common.line_plot(out / "compose_gap_closed.png",
                     f"Compose: gap closed by recomputing R% of the rows, {model}",
                     "R (% of the rows recomputed)", "gap closed (NLL)", series)
    return ["compose_gap_closed.png"]


# --- partial transfer ------------------------------------------------------------------------

@dataclass(frozen=True)
class Subset:
    """The document imported with a subset of its layers, the others rebuilt in the
    target's context: the continuation's NLL, its difference from the full transfer's and
    the seconds compose took (in ``Partial.subsets``, the means over the texts)."""

    subset: str
    layers: str
    transferred: int
    rebuilt: int
    nll: float
    vs_full: float
    seconds: float


@dataclass(frozen=True)
class FullTransfer:
    """The whole document session composed after the target, no layer rebuilt."""

    nll: float
    seconds: float


@dataclass(frozen=True)
class PartialRun:
    """One text's transfers (``partial.partial_bench``'s report): the tokens the target,
    the document and the continuation hold, the full transfer and each subset."""

    text: str
    model: str
    dtype: str
    n_layers: int
    target_cached: int
    doc_cached: int
    continuation_tokens: int
    full: FullTransfer
    subsets: list[Subset]


@dataclass(frozen=True)
class Partial:
    """The partial section: each text's run, the full transfer's mean NLL and each
    subset's means."""

    runs: list[PartialRun]
    full: float | None
    subsets: list[Subset]


def partial_section(model: Model, policy: TokenPolicy, cfg: TransferConfig,
                    tick: Callable[[], None]) -> Partial:
    """Per text: part 1 the target, parts 2-3 the document, the continuation after them."""
    runs, size = [], cfg.part_tokens
    for key, ids in topic_texts(policy, cfg.texts, 3 * size + cfg.continuation):
        target, doc = policy.decode(ids[:size]), policy.decode(ids[size:3 * size])
        cont = policy.decode(ids[3 * size:3 * size + cfg.continuation])
        report = partial_bench(model, policy, target, doc, cont)
        runs.append(PartialRun(text=key, **{**report, "full": FullTransfer(**report["full"]),
                                            "subsets": [Subset(**x) for x in report["subsets"]]}))
        tick()
    subsets = [dataclasses.replace(r, **{name: _mean(getattr(run.subsets[i], name) for run in runs)
                                         for name in ("nll", "vs_full", "seconds")})
               for i, r in enumerate(runs[0].subsets)]
    return Partial(runs, _mean(r.full.nll for r in runs), subsets)


def partial_tables(c: Partial) -> list[Table]:
    rows = [("full transfer", "all", "0", f"{c.full:.4f}", "0", "")]
    rows += [(r.subset, r.layers, str(r.transferred), f"{r.nll:.4f}",
              f"{r.vs_full:+.4f}", f"{r.seconds:.2f}") for r in c.subsets]
    return [Table("Partial transfer: the continuation's NLL by layers transferred (mean over "
                  "texts)", ("subset", "layers transferred", "count", "NLL", "vs full",
                             "compose s (rebuild)"), tuple(rows),
                  "Layers not transferred are rebuilt by a forward of the document in the "
                  "target's context; subset none rebuilds them all (the joint prefill).")]


def partial_facts(c: TransferConfig) -> str:
    return (f"{c.texts} texts: part 1 ({c.part_tokens} tokens) the target, parts 2-3 "
            f"the document, then {c.continuation} continuation tokens.")


PARTIAL_METHOD = """- **Sessions**: the target (the text's first part) and the document (its next two parts)
  are each primed alone from their decoded text; the document is exported with every cached
  token and a subset of its layers (`export --layers`) and imported after the target
  (`compose`), each missing layer rebuilt by a forward of the document's tokens over the
  target's cache (what a prefill there computes).
- **Full transfer**: the whole document session composed after the target, no layer
  rebuilt. **NLL**: the continuation teacher-forced over the composed cache.
"""


# --- projector --------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ProjectorRun(TrainParams):
    """The projector's training: its ``TrainParams`` and ``transfer.train_projector``'s
    report (the held-out KL before, after the fit and after the Adam steps)."""

    source: str
    target: str
    layer_map: list[int]
    train_windows: int
    held_out_windows: int
    tokens: int
    kl_before: float
    kl_fit: float | None
    kl_after: float
    seconds: float


def projector_section(model: Model, policy: TokenPolicy, cfg: TransferConfig,
                      tick: Callable[[], None]) -> ProjectorRun:
    """The model's projector onto itself from the perturbed identity, on help-topic text."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += policy.encode(topics[key])
        if len(ids) >= cfg.projector_tokens:
            break
    report = projector_bench(model, ids[:cfg.projector_tokens], cfg.projector_steps)
    tick()
    return ProjectorRun(**report)


def projector_tables(c: ProjectorRun) -> list[Table]:
    return [Table("Projector onto the same model from the perturbed identity: held-out KL",
                  ("projector", "held-out KL (nats/token)", "train windows",
                   "held-out windows", "steps", "seconds"),
                  (("before training", f"{c.kl_before:.4f}", "", "", "", ""),
                   ("after the least-squares fit", f"{c.kl_fit:.4f}", str(c.train_windows),
                    str(c.held_out_windows), "0", ""),
                   ("after the fit and the Adam steps", f"{c.kl_after:.4f}",
                    str(c.train_windows), str(c.held_out_windows), str(c.steps),
                    f"{c.seconds:.0f}")),
                  f"Windows of {c.prefix} prefix + {c.continuation} continuation tokens; "
                  f"KL(B with its own prefix cache || B with the projected one).")]


def projector_facts(c: TransferConfig) -> str:
    return (f"{c.projector_tokens} tokens of help-topic text (the first 80% trains), "
            f"{c.projector_steps} steps.")


PROJECTOR_METHOD = """- **Projector**: per layer a linear map of the un-rotated keys and of the values
  (`transfer.Projector`), initialised as the identity plus Gaussian noise (`--init
  perturbed`), then trained as `transfer train` trains: each map set to the least-squares
  fit of the model's own un-rotated keys (values) on the source's, over the training
  windows' prefixes (`transfer.fit_linear`), then Adam steps on KL(the model with its own
  prefix cache || the model with the projected cache) over the continuation tokens'
  next-token distributions.
- **Held out**: windows from the text's last 20%, never trained on; before = the perturbed
  projector, then after the fit, then after the fit and the Adam steps; seconds = both.
- Onto the same model the fit lands on the model's own map, which no step can improve:
  Adam moves every weight by about the learning rate a step however small its gradient,
  so what the steps add to the held-out KL is their sampling noise. Between two different
  models the steps tune what the K/V's least-squares distance does not see.
"""


SECTIONS = (Section("compose", "Compose: a text from parts primed apart", compose_section,
                    lambda cfg: cfg.texts, compose_facts, compose_tables, compose_plots,
                    COMPOSE_METHOD),
            Section("partial", "Partial transfer: some layers carried, the rest rebuilt",
                    partial_section, lambda cfg: cfg.texts, partial_facts, partial_tables,
                    lambda c, out, model: [], PARTIAL_METHOD),
            Section("projector", "Projector: a cache mapped onto a model and learnt back",
                    projector_section, lambda cfg: 1, projector_facts, projector_tables,
                    lambda c, out, model: [], PROJECTOR_METHOD))


# --- the benchmark ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Sections:
    """Each section's result, under its ``Section``'s name."""

    compose: Compose
    partial: Partial
    projector: ProjectorRun


@dataclass(kw_only=True)
class TransferResult(Result):
    """A run: its config (the parts fitted to the model's positions), the model's dtype and
    positions, and each section's result."""

    config: TransferConfig
    dtype: str
    max_positions: int
    sections: Sections


def run(cfg: TransferConfig, command: str) -> TransferResult:
    """Every section, in one result."""
    t0 = time.perf_counter()
    machine = Machine.now()
    model = load_model(cfg.model, cfg.dtype, cfg.device)
    cfg = cfg.fitted(model.spec.max_positions)
    policy = TokenPolicy(model.tokenizer)
    with common.progress() as task:
        sections = {s.name: s.measure(model, policy, cfg, task(s.name, s.steps(cfg)))
                    for s in SECTIONS}
    return TransferResult(benchmark="transfer", command=command, model=cfg.model,
                          quick=cfg.quick, machine=machine.ended(), config=cfg, dtype=cfg.dtype,
                          max_positions=model.spec.max_positions, sections=Sections(**sections),
                          elapsed_s=time.perf_counter() - t0)


def tables(res: TransferResult) -> list[Table]:
    return [t for s, r in _measured(res) for t in s.tables(r)]


def _measured(res: TransferResult) -> list[tuple[Section, Any]]:
    return [(s, getattr(res.sections, s.name)) for s in SECTIONS]


def plots(res: TransferResult, out: Path) -> list[str]:
    """Every section's PNG plots into ``out``; returns their file names."""
    return [name for s, r in _measured(res) for name in s.plots(r, out, res.model)]


def report_md(res: TransferResult, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report, a heading per section; ``level`` is its title's. ``images``:
    the plots' file names, each under the section whose name it starts with."""
    h = "#" * level
    lines = [f"{h} Transfer benchmark: caches carried into another context", "",
             res.regenerate(), "",
             f"{model_facts(res)}; "
             f"{res.machine.facts()}.", ""]
    for s, r in _measured(res):
        lines += [f"{h}# {s.title}", "", s.facts(res.config), ""]
        for tb in s.tables(r):
            lines += [f"{h}## {tb.title}", "", tb.markdown(), ""]
        lines += [f"![{name}]({image_dir}/{name})" for name in images
                  if name.startswith(s.name)]
        lines += ["", f"{h}## Method", "", s.method, ""]
    return "\n".join(lines) + "\n"


FLAGS = (TransferConfig,)  # the dataclasses whose fields are its flags (none but the shared)
