"""``positronic-brain bench speed``: how fast the staged loop is, next to Hugging Face.

All in one process, per dtype (float32, bfloat16, and on the CPU int8: weight-only int8
over bfloat16, HF running the same dequantized weights), medians of several repetitions:

1. prefill: stage 0 (``prime``) vs one HF forward that builds a ``DynamicCache``; stage 0
   also gathering the prompt's attention statistics as the default scorer's prefill scores
   take them (the window; a prompt longer than the budget), and with their total as H2O's
   do (off by default);
2. decode: stage 1 (``generate``) over a primed arena vs HF ``model()`` decoding one token
   on a ``DynamicCache`` of the same context (cropped back after every call, so the
   context stays fixed), alternating the two so they see the same machine load; HF runs
   a copy of the model with its weights row-major, as its own loader leaves them;
3. bytes allocated per decode step (stage 1 reads the past; HF concatenates it);
4. a full loop step (stages 1-4: brightness scoring, cull and repair at a budget; and
   with recall over some 8,000 cold tokens) vs stage 1 alone, and the cost of one cull, one repair and one re-index vs context;
5. the machine's copy bandwidth, turned into the physical floor of ms/token (every
   weight and the live K/V read once per token), and the peak RSS.

Every context shorter than the largest is measured on a prefix view of one primed arena:
a causal model's cache over the first n tokens is the same whatever follows them.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..loop import Session, copy_ids
from ..model import (CPU_ONLY, DTYPES, GRAPH, NATIVE, Int8Weight, Model, PackedWeight, compile_flag, hf_forward,
                     load_model)
from ..sampler import make_generator
from ..special_tokens import TokenPolicy
from ..stages.apply import apply, prime
from ..stages.decide import decide, fold_targets, merge_pair
from ..stages.generate import generate
from ..stages.score import recall_layers, recall_query, score
from ..state import State, View
from ..types import (Actions, CacheParams, FoldRepair, Prefill, Recall, SamplerParams, Segment,
                     option, require)
from . import busy, common, flags, llamacpp, throughput
from .. import native, options
from .common import Table, fmt, fmt_bytes
from .result import Machine, Result, Target, target_table
from .busy import BusyRow
from .throughput import BatchRow

GREEDY = SamplerParams(greedy=True)
PARTS = ("stage", "loop", "batch", "busy")  # what a run measures (``SpeedConfig.parts``)
CPU_PARTS = ("busy",)  # the parts a GPU run does not take
# Targets from the project's issues: reported, never asserted.
DECODE_TARGETS = {1024: 0.8, 2048: 0.8, 4096: 0.6}  # stage 1 / HF ms per token, on the CPU
GPU_DECODE_TARGET = 1.0  # on a GPU, at every context
LOOP_TARGET = 1.10  # a full loop step / stage 1 alone
RECALL_LOOP_TARGET = 1.15  # ... with recall, over the cold store's ``recall_cold`` tokens
PER_HEAD_TARGET = 1.15  # a per-head loop step / the whole-token one, the same scorer
# the loop's settings: (policy, repair, with recall); the per-head pair with the plain stage 1
LOOP_SETTINGS = (("brightness", "none", False), ("brightness", "merge", False),
                 ("brightness", "fold", False), ("brightness", "none", True))
PER_HEAD_SETTINGS = (("h2o", "none", False), ("h2o@head", "none", False),
                     ("h2o", "none", True), ("h2o@head", "none", True))
GRAPH_FLOOR_TARGET = 3.0  # on a GPU, stage 1 as a graph / the bandwidth floor, every context
EDIT_TARGET = 1.5  # an edit's stage 4 at the longest context / at the shortest (O(1))
# stage 1 / llama.cpp ms per token at equal precision, at these contexts (None: every one)
LLAMACPP_TARGETS = {"bfloat16": (1.0, (1024, 2048, 4096)), "float32": (0.9, None)}
YARDSTICK_TARGETS = {1024: 0.25, 4096: 0.20}  # bfloat16 stage 1 / HF, where llama.cpp is not measured
BANDWIDTH_TARGET = 0.60  # bfloat16 at 1024: the floor / stage 1 (the share of the bandwidth limit)
PREFILL_TARGET = 1.0  # stage 0 / HF prefill tokens/s ...
PREFILL_TARGET_TOKENS = (1024, 4096)  # ... at these prompt lengths ...
PREFILL_TARGET_DTYPES = ("float32", "bfloat16")  # ... in these dtypes


def device_parts(device: str) -> tuple[str, ...]:
    """The parts a run on ``device`` takes unless told: every one (on a GPU, not
    ``CPU_PARTS``)."""
    return PARTS if device == "cpu" else tuple(p for p in PARTS if p not in CPU_PARTS)


@dataclass(frozen=True)
class SpeedConfig:
    """What to measure. ``contexts``: live slots for decode; ``prefill``: prompt lengths."""

    model: str = "smollm2"
    quick: bool = False
    device: str = "cpu"
    dtypes: tuple[str, ...] = option(("float32", "bfloat16", "int8"), "the precisions, "
                                     "comma-separated (default on a GPU: the first two)",
                                     choices=tuple(DTYPES))
    contexts: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    prefill: tuple[int, ...] = (1024, 4096)
    reps: int = 21  # decode and loop repetitions (after 2 warm-up rounds)
    prefill_reps: int = 3
    edit_reps: int = 7  # cull / repair / re-index repetitions per context
    budget: int = 512  # the loop's live slots
    recall_cold: int = 8000  # the loop with recall: cold tokens (at most what the positions hold)
    bandwidth_mb: int = 512
    parts: tuple[str, ...] = option(PARTS, "what to measure: stage (stages 0 and 1 against "
                                    "HF and llama.cpp, operators, allocations, edits), loop, "
                                    "batch (throughput of B rows), busy (run beside one "
                                    "other busy process); default: all",
                                    choices=PARTS)
    batches: tuple[int, ...] = option((1, 2, 4, 8, 16), "batch: the rows a step, "
                                      "comma-separated (--quick: 1,4,8)")
    batch_contexts: tuple[int, ...] = (1024, 4096)  # its stage 1's live slots a row
    batch_reps: int = 5
    loop_reps: int = 25  # batch: the whole loop's rounds (a step of B rows is a few tens of ms)
    busy_reps: int = 5  # busy: repetitions of idle and busy in turn

    def __post_init__(self) -> None:
        require(len(self.contexts) > 0 and all(c >= 1 for c in self.contexts),
                f"contexts must be >= 1, got {self.contexts}")
        require(len(self.prefill) > 0 and all(c >= 1 for c in self.prefill),
                f"prefill lengths must be >= 1, got {self.prefill}")
        for name in ("contexts", "prefill"):
            xs = getattr(self, name)
            require(tuple(sorted(set(xs))) == xs, f"{name} must be increasing, got {xs}")
        require(min(self.reps, self.prefill_reps, self.edit_reps) >= 1, "repetitions must be >= 1")
        require(self.budget >= 32, f"budget must be >= 32, got {self.budget}")
        require(all(b >= 1 for b in self.batches) and all(c >= 1 for c in self.batch_contexts)
                and min(self.batch_reps, self.loop_reps, self.busy_reps) >= 1,
                "batches, their contexts and repetitions must be >= 1")
        require(self.parts and set(self.parts) <= set(PARTS),
                f"parts must be some of {', '.join(PARTS)}, got {self.parts}")
        require(self.device == "cpu" or not set(self.parts) & set(CPU_PARTS),
                f"--parts {','.join(sorted(set(self.parts) & set(CPU_PARTS)))} measures the "
                f"CPU only, not {self.device}")

    @classmethod
    def preset(cls, quick: bool, model: str = "smollm2", device: str = "cpu",
               **given) -> "SpeedConfig":
        """The CPU's contexts, or on a GPU 1k-32k (bandwidth over a buffer that dwarfs its
        caches); then the fields ``given`` (its flags)."""
        return dataclasses.replace(cls._preset(quick, model, device), **given)

    @classmethod
    def _preset(cls, quick: bool, model: str, device: str) -> "SpeedConfig":
        gpu = device != "cpu"
        full = dict(model=model, device=device)
        if gpu:
            full.update(contexts=(1024, 2048, 4096, 8192, 16384, 32768), prefill=(1024, 4096),
                        bandwidth_mb=2048, parts=device_parts(device),
                        dtypes=tuple(d for d in cls.dtypes if d not in CPU_ONLY))
        if not quick:
            return cls(**full)
        return cls(**{**full, "quick": True, "contexts": (1024, 4096) if gpu else (128, 256, 512, 1024),
                      "prefill": (1024,), "reps": 7, "prefill_reps": 2, "edit_reps": 3,
                      "recall_cold": 1024, "batches": (1, 4, 8), "batch_contexts": (1024,),
                      "batch_reps": 3, "loop_reps": 5, "busy_reps": 2,
                      "bandwidth_mb": 2048 if gpu else 128})

    def fitted(self, max_positions: int) -> "SpeedConfig":
        """Drop what the model's positions cannot hold (the pending token needs one more)."""
        contexts = tuple(c for c in self.contexts if c < max_positions)
        require(contexts, f"the model's {max_positions} positions fit none of the contexts "
                f"{self.contexts}")
        prefill = tuple(c for c in self.prefill if c < max_positions) or (contexts[-1],)
        budget = min(self.budget, max_positions // 2)
        steps = (self.reps + 2) * Recall().every  # the loop's rounds of steps
        cold = min(self.recall_cold, max_positions - budget - steps - 8)
        batch_contexts = (tuple(c for c in self.batch_contexts if c < max_positions)
                          or (contexts[-1],))
        return dataclasses.replace(self, contexts=contexts, prefill=prefill, budget=budget,
                                   recall_cold=cold, batch_contexts=batch_contexts)


# --- the result ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PrefillRow:
    """Stage 0 vs HF prefill at one prompt length: ms and tokens/s of each, plain
    (``ours_*``), gathering the prompt's window (``window_*``), its total too (``total_*``),
    or the window and KVzip's copy (``copy_*``); the ratios are HF's time / stage 0's
    (speeds: above 1, stage 0 is faster)."""

    dtype: str
    tokens: int
    hf_ms: float
    hf_tok_s: float
    ours_ms: float
    ours_tok_s: float
    window_ms: float | None = None
    window_tok_s: float | None = None
    total_ms: float | None = None
    total_tok_s: float | None = None
    copy_ms: float | None = None
    copy_tok_s: float | None = None
    ratio: float
    window_ratio: float | None = None
    total_ratio: float | None = None
    copy_ratio: float | None = None


@dataclass(frozen=True, kw_only=True)
class DecodeRow:
    """Stage 1 vs HF decode at one context, ms per token (medians) and stage 1 / HF;
    llama.cpp's (``llamacpp_*``) and each ``COMPILED`` stage 1's (``KEY_*``: ms, / stage 1,
    / HF, / llama.cpp, and whether its next token is stage 1's) where the run has them; the
    bandwidth floor (``floor_ms``: weights and live K/V read once)."""

    dtype: str
    context: int
    ours_ms: float
    hf_ms: float
    ratio: float
    llamacpp_ms: float | None = None
    llamacpp_ratio: float | None = None
    llamacpp_agrees: bool | None = None
    compiled_ms: float | None = None
    compiled_ratio: float | None = None
    compiled_hf_ratio: float | None = None
    compiled_agrees: bool | None = None
    compiled_llamacpp_ratio: float | None = None
    native_ms: float | None = None
    native_ratio: float | None = None
    native_hf_ratio: float | None = None
    native_agrees: bool | None = None
    native_llamacpp_ratio: float | None = None
    graph_ms: float | None = None
    graph_ratio: float | None = None
    graph_hf_ratio: float | None = None
    graph_agrees: bool | None = None
    graph_llamacpp_ratio: float | None = None
    floor_ms: float | None = None


@dataclass(frozen=True)
class AllocRow:
    """Bytes allocated by one decode step at one context, stage 1's and HF's."""

    dtype: str
    context: int
    ours_bytes: int
    hf_bytes: int


@dataclass(frozen=True, kw_only=True)
class LoopRow:
    """A full loop step vs stage 1 alone at the budget (``context``), for one repair (with
    `` + recall``: over ``cold`` cold tokens, scanned every ``recall_every`` steps) and one
    way of running stage 1 (``stage1``): each stage's median ms, the step's, their median
    ratio (``overhead``), the host reads and CUDA syncs a step, and the operators stages
    2-4 launch a step (``settle_operators``)."""

    dtype: str
    stage1: str = "plain"
    policy: str = "brightness"  # ``NAME@ALLOCATION`` for a per-head one (``flags.cell_policy``)
    repair: str
    context: int
    host_reads: float | None = None
    cuda_syncs: float | None = None
    cold: int = 0
    recall_every: int = 1
    cold_bytes_per_token: int | None = None
    scan_bytes: int | None = None
    settle_ops: float | None = None  # top-level operators of stages 2-4, a step
    stage1_ms: float
    score_ms: float
    decide_ms: float
    step_ms: float
    overhead: float


@dataclass(frozen=True, kw_only=True)
class EditRow:
    """Stage 4's median ms at one context: the append alone, with a cull, with a cull and a
    re-index, a merge (its stage-3 forwards and its stage 4) and a fold (its stage-3
    target search and its stage 4)."""

    dtype: str
    context: int
    append_ms: float
    cull_ms: float
    reindex_ms: float
    repair_forward_ms: float
    repair_apply_ms: float
    fold_targets_ms: float | None = None
    fold_apply_ms: float | None = None


@dataclass(frozen=True)
class MemoryRow:
    """A dtype's bytes: the weights a decode step reads, the K/V and the cold store per
    token, and the floor of a step (the weights read once)."""

    dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    floor_ms: float
    cold_bytes_per_token: int | None = None


@dataclass(frozen=True)
class OpsRow:
    """The operators one stage-1 call launches at ``context``: how many, and the most
    frequent names with their counts."""

    dtype: str
    context: int
    ops: int
    top: list[tuple[str, int]]


@dataclass(frozen=True)
class CompileRow:
    """A copy of the model loaded with ``compile`` ``mode``: seconds its loading and first
    stage-1 call took, or why it failed."""

    dtype: str
    mode: str
    compile_s: float | None
    why_not: str | None


@dataclass(frozen=True)
class LlamacppRow:
    """llama.cpp in a dtype: measured (its GGUF's file name), or why not."""

    dtype: str
    measured: bool
    why_not: str | None = None
    gguf: str | None = None


@dataclass(frozen=True)
class DecodeFit:
    """ms per token = ``fixed_ms`` + ``ms_per_1k`` per 1k context tokens, for ``who``
    (``ours``: stage 1, or ``hf``) in a dtype."""

    dtype: str
    who: str
    fixed_ms: float
    ms_per_1k: float


@dataclass(frozen=True)
class AllocFit:
    """Bytes allocated per step = ``fixed_bytes`` + ``bytes_per_token`` per context token,
    for ``who`` in a dtype, next to one copy of the past (``kv_bytes_per_token``)."""

    dtype: str
    who: str
    fixed_bytes: int
    bytes_per_token: float
    kv_bytes_per_token: int


@dataclass(kw_only=True)
class SpeedResult(Result):
    """A run: its config (fitted to the model's positions), the copy bandwidth, each
    measurement's rows over the dtypes, the decode's and the allocations' fits, and the
    peak RSS."""

    config: SpeedConfig
    bandwidth_gb_s: float
    prefill: list[PrefillRow] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    alloc: list[AllocRow] = field(default_factory=list)
    loop: list[LoopRow] = field(default_factory=list)
    edits: list[EditRow] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    ops: list[OpsRow] = field(default_factory=list)
    llamacpp: list[LlamacppRow] = field(default_factory=list)
    compile: list[CompileRow] = field(default_factory=list)
    decode_fit: list[DecodeFit] = field(default_factory=list)
    alloc_fit: list[AllocFit] = field(default_factory=list)
    batch: list[BatchRow] = field(default_factory=list)
    busy: list[BusyRow] = field(default_factory=list)
    peak_rss_mb: float


# --- contenders ---------------------------------------------------------------------------

def random_prompt(model: Model, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids (speed does not depend on which tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.spec.vocab, (n,), generator=g, device="cpu").tolist()


def prefix_view(view: View, n: int, pending_token: int) -> View:
    """The view a prime of the first ``n`` cached tokens would give: slices, no copies."""
    cut = {}
    for f in dataclasses.fields(view):
        x = getattr(view, f.name)
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[2] == view.n:
            cut[f.name] = x[:, :, :n]  # K/V, bias and norms: (L, kv_heads, n, ...)
        elif isinstance(x, torch.Tensor) and x.dim() == 1 and x.shape[0] == view.n:
            cut[f.name] = x[:n]  # (n,) ledger columns
    return dataclasses.replace(view, **cut, pending_token=pending_token, next_position=n)


def hf_cache(view: View):
    """A DynamicCache holding a row-major copy of the live K/V (batch 1), laid out as HF's
    own cache would be."""
    from transformers import DynamicCache

    row = torch.contiguous_format
    return DynamicCache(ddp_cache_data=[(view.k[i][None].clone(memory_format=row),
                                         view.v[i][None].clone(memory_format=row))
                                        for i in range(view.k.shape[0])])


def stock_hf(model: Model) -> torch.nn.Module:
    """The comparator: a copy of Hugging Face's model with every weight row-major, as its
    own loader leaves them (``load_model`` stores float32 weights input-major, and HF's
    modules hold views of them). A tied embedding stays tied."""
    if all(p.is_contiguous() for p in model.hf.parameters()):
        return model.hf
    # deepcopy takes each parameter's row-major copy from the memo instead of copying it
    memo = {id(p): torch.nn.Parameter(p.detach().contiguous(), requires_grad=False)
            for p in model.hf.parameters()}
    return copy.deepcopy(model.hf, memo)


@torch.no_grad()
def hf_decode(hf: torch.nn.Module, cache, token: int, position: int) -> int:
    """HF's own decode of one token; grows ``cache`` by one row (crop it back)."""
    dev = hf.device
    out = hf_forward(hf, torch.tensor([[token]], device=dev), cache,
                     position_ids=torch.tensor([[position]], device=dev), use_cache=True)
    return int(out.logits[0, -1].argmax())


@torch.no_grad()
def hf_prefill(hf: torch.nn.Module, ids: list[int]) -> None:
    """HF's own prefill: one forward that builds a DynamicCache (last logits only, as ours)."""
    hf_forward(hf, torch.tensor([ids], device=hf.device), use_cache=True, logits_to_keep=1)


def weight_bytes(model: Model) -> int:
    """Bytes of weights one decode step reads (each storage once; the embedding row is
    negligible unless the table is also the tied lm_head)."""
    def read(t) -> list[torch.Tensor]:  # what a one-row product reads of a weight
        if isinstance(t, Int8Weight):
            return [t.q, t.scale]
        return [t.w] if isinstance(t, PackedWeight) else [t]

    tensors = [model.final_norm, *read(model.lm_head)]
    for w in model.layers:
        tensors += [x for f in dataclasses.fields(w)
                    if isinstance(t := getattr(w, f.name), (torch.Tensor, PackedWeight, Int8Weight))
                    for x in read(t)]
    unique = {(id(t), t.numel() * t.element_size()) if t.is_mkldnn  # packed: no storage
              else (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
              for t in tensors}
    return sum(dict(unique).values())


def headroom(cfg: SpeedConfig) -> int:
    """Arena slots beyond the longest context: the edit measurements append as they go."""
    return 4 * cfg.edit_reps + 8


def kv_bytes_per_token(model: Model) -> int:
    s = model.spec
    return 2 * s.n_layers * s.n_kv_heads * s.head_dim * torch.finfo(model.dtype).bits // 8


def linear_fit(xs, ys) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b)."""
    if len(xs) < 2:
        return float(ys[0]), 0.0
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


# --- measurements -------------------------------------------------------------------------

def measure_prefill(model: Model, hf, cfg: SpeedConfig, task) -> tuple[list[PrefillRow], dict]:
    """Stage 0 vs HF prefill at each length: plain, and gathering the prompt's statistics
    (``window_*``: the window over the default prefill window's queries, as the default
    scorer's prefill scores gather them; ``total_*``: with the total too, as H2O's do;
    ``copy_*``: the window and KVzip's reconstruction, as kvzip's do); returns rows and
    {longest length: its state}."""
    rows, states = [], {}
    dt = model.precision
    tick = task(f"{dt} prefill", len(cfg.prefill) * cfg.prefill_reps)
    warm = random_prompt(model, 65, seed=1)
    prime(model, [Segment(tuple(warm), "user")], capacity=65)
    hf_prefill(hf, warm[:64])
    window = Prefill().window
    instruction = copy_ids(TokenPolicy(model.tokenizer))
    for length in cfg.prefill:
        ids = random_prompt(model, length + 1)  # the last prompt token stays pending
        segs, capacity, kept = [Segment(tuple(ids), "user")], length + headroom(cfg), {}

        def ours():
            kept["state"] = prime(model, segs, capacity=capacity)[0]

        t = common.interleaved_ms({
            "ours": ours, "hf": lambda: hf_prefill(hf, ids[:length]),
            "window": lambda: prime(model, segs, capacity, prefill_window=window,
                                    prefill_total=False),
            "total": lambda: prime(model, segs, capacity, prefill_window=window),
            "copy": lambda: prime(model, segs, capacity, prefill_window=window,
                                  prefill_total=False, prefill_copy=instruction)},
            cfg.prefill_reps, warmup=0, tick=tick)
        ms = {k: common.median(v) for k, v in t.items()}
        states = {length: kept.pop("state")}  # the longest is kept for decode
        rows.append(PrefillRow(
            dtype=dt, tokens=length, hf_ms=ms["hf"], hf_tok_s=length / ms["hf"] * 1e3,
            **{f"{k}_{x}": v for k in ("ours", "window", "total", "copy") for x, v in (
                ("ms", ms[k]), ("tok_s", length / ms[k] * 1e3))},
            ratio=common.median_ratio(t["hf"], t["ours"]),
            window_ratio=common.median_ratio(t["hf"], t["window"]),
            total_ratio=common.median_ratio(t["hf"], t["total"]),
            copy_ratio=common.median_ratio(t["hf"], t["copy"])))
    return rows, states


def measure_decode(model: Model, hf, full: View, ids: list[int], cfg: SpeedConfig,  # pylint: disable=too-many-arguments
                   task, llama: llamacpp.Contender | None = None,
                   compiled: dict[str, Model] | None = None) -> list[DecodeRow]:
    """Stage 1 vs HF decode (and llama.cpp's, if ``llama``; stage 1 of each model in
    ``compiled``, loaded with a ``compile`` mode: ``COMPILED``), ms per token, at each context
    (prefixes of ``full``; llama.cpp's context is evaluated up to each in turn)."""
    compiled = compiled or {}
    dt = model.precision
    tick = task(f"{dt} decode", len(cfg.contexts) * cfg.reps)
    rows = []
    for n in cfg.contexts:
        view = prefix_view(full, n, ids[n])
        cache = hf_cache(view)
        gen = make_generator(0, model.device)
        contenders = {"ours": lambda: generate(model, view, GREEDY, gen),
                      "hf": lambda: hf_decode(hf, cache, ids[n], n)}
        if llama is not None:
            llama.prefill(ids[:n])
            contenders["llama.cpp"] = lambda: llama.decode(ids[n])
        for key, other in compiled.items():
            contenders[key] = functools.partial(generate, other, view, GREEDY, gen)
        t = common.interleaved_ms(contenders, cfg.reps, warmup=2,
                                  after={"hf": lambda: cache.crop(-1)}, tick=tick)
        row = {"dtype": dt, "context": n, "ours_ms": common.median(t["ours"]),
               "hf_ms": common.median(t["hf"]), "ratio": common.median_ratio(t["ours"], t["hf"])}
        token = generate(model, view, GREEDY, gen).token_id  # stage 1's next token
        if llama is not None:  # the same next token: the same model at both ends
            row.update(llamacpp_ms=common.median(t["llama.cpp"]),
                       llamacpp_ratio=common.median_ratio(t["ours"], t["llama.cpp"]),
                       llamacpp_agrees=llama.decode(ids[n]) == token)
        for key, other in compiled.items():
            row.update({f"{key}_ms": common.median(t[key]),
                        f"{key}_ratio": common.median_ratio(t[key], t["ours"]),
                        f"{key}_hf_ratio": common.median_ratio(t[key], t["hf"]),
                        f"{key}_agrees": generate(other, view, GREEDY, gen).token_id == token})
            if llama is not None:
                row[f"{key}_llamacpp_ratio"] = common.median_ratio(t[key], t["llama.cpp"])
        rows.append(DecodeRow(**row))
        del cache
    return rows


def measure_alloc(model: Model, hf, full: View, ids: list[int], cfg: SpeedConfig,
                  task) -> list[AllocRow]:
    """Bytes of new tensor storage one decode step creates, at each context."""
    dt = model.precision
    tick = task(f"{dt} allocations", len(cfg.contexts))
    rows = []
    for n in cfg.contexts:
        view = prefix_view(full, n, ids[n])
        cache = hf_cache(view)
        ours = common.bytes_allocated(
            lambda: generate(model, view, GREEDY, make_generator(0, model.device)))
        theirs = common.bytes_allocated(lambda: hf_decode(hf, cache, ids[n], n))
        rows.append(AllocRow(dt, n, ours, theirs))
        del cache
        tick()
    return rows


def measure_loop(model: Model, cfg: SpeedConfig, task) -> list[LoopRow]:
    """A full loop step (stages 1-4, brightness scorer, at the budget: one removal per
    step) vs stage 1 alone on the same view, for each repair (none, merge, fold), and
    without repair with recall over ``recall_cold`` cold tokens (the prompt's first step
    culls them into the cold store); with the plain stage 1, also h2o's with whole tokens
    and with every (layer, KV head) culling its own, each with and without recall
    (``PER_HEAD_SETTINGS``). A row's
    ``stage1`` is how the model runs stage 1: plain, or a ``Model.compiled`` mode."""
    dt, how = model.precision, model.stage1_path
    rows = []
    for policy, repair, recall in LOOP_SETTINGS + (() if model.compiled else PER_HEAD_SETTINGS):
        cold = cfg.recall_cold if recall else 0
        what = repair + (" + recall" if cold else "")
        tick = task(f"{dt} {how} loop ({policy}, {what})", cfg.reps)
        params = options.cache_params({**flags.cell_policy(policy), "budget": cfg.budget,
                                       "repair": repair, "recall": recall})
        session = Session(model, TokenPolicy(model.tokenizer), GREEDY, params)
        session.prime([Segment(tuple(random_prompt(model, cfg.budget + 1 + cold, seed=2)),
                               "user")])
        gen, scorer = make_generator(0, model.device), session.scorer
        kept, every = {}, params.recall.every if cold else 1
        each = dataclasses.replace(params, recall=params.recall and Recall(every=1))  # stages 2-3 timed as a recall step

        def stage1():  # with recall, timed without its query (that counts as recall's cost)
            view = kept["view"] = session.state.view()
            kept["gen"] = generate(model, dataclasses.replace(view, cold=None), GREEDY, gen)

        def query():  # untimed: with recall, stage 1's output with the query, for stages 2-3
            kept["gen"] = generate(model, kept["view"], GREEDY, gen)

        def stage2():
            recall = recall_query(kept["view"], kept["gen"], each, model.compiled)
            kept["scores"] = score(kept["view"], kept["gen"].attention, scorer, recall)

        def steps():  # with recall, one round of ``recall_every`` steps: the mean step
            for _ in range(every):
                session.step()

        t = common.interleaved_ms(
            {"stage 1": stage1, "stage 2": stage2,
             "stage 3": lambda: decide(model, kept["view"], kept["scores"], each),
             "loop step": steps},
            cfg.reps, warmup=2, after={"stage 1": query} if cold else None, tick=tick)
        t["loop step"] = [x / every for x in t["loop step"]]
        assert session.state.arena.n == cfg.budget, "the loop is not at its budget"
        ms = {k: common.median(v) for k, v in t.items()}
        # the values one round of steps reads back to the host, a step (each waits for the
        # device to drain on a GPU)
        reads = sum(common.host_reads(steps).values()) / every
        syncs = common.cuda_syncs(steps) if model.device.type == "cuda" else None
        store = session.state.cold
        stored = (store.n, store.bytes_per_token, scan_bytes(params, store.arena.k, store.n)
                  ) if cold else (0, None, None)  # before the operators' round steps on
        rows.append(LoopRow(
            dtype=dt, stage1=how, policy=policy, repair=what, context=cfg.budget,
            host_reads=reads, settle_ops=settle_operators(session, every),
            cuda_syncs=None if syncs is None else syncs / every, cold=stored[0],
            recall_every=every, cold_bytes_per_token=stored[1], scan_bytes=stored[2],
            stage1_ms=ms["stage 1"], score_ms=ms["stage 2"], decide_ms=ms["stage 3"],
            step_ms=ms["loop step"], overhead=common.median_ratio(t["loop step"], t["stage 1"])))
    return rows


def settle_operators(session: Session, steps: int = 1) -> float:
    """The top-level operators (``common.operators``) stages 2-4 launch a step, the mean
    over ``steps`` more steps of ``session``: in a batch of rows they run once a row, beside
    the one stage 1 the rows share, so each is a row's fixed cost a step."""
    total = 0
    for _ in range(steps):
        view = session.begin()
        gen = generate(session.model, view, session.sampler, session.generator)
        total += common.operators(lambda: session.settle(view, gen, None, 0.0))[0]
    return total / steps


def _middle_triple(view: View) -> tuple[int, int, int]:
    """Three text-adjacent slots in the middle of the context (left, first, second)."""
    order = torch.argsort(view.position)
    i = view.n // 2
    return int(order[i - 1]), int(order[i]), int(order[i + 1])


def measure_edits(model: Model, primed: State, cfg: SpeedConfig, task) -> list[EditRow]:
    """Stage 4 cost of one cull, one merge repair (plus its stage-3 forwards), one fold
    (plus its stage-3 target search) and a full re-index, at each context from the longest
    down (culls of the tail shrink the arena). Each measured application also appends the
    pending token, as every step does; the cull keeps the context fixed. The fold is
    measured last at each context: from then on the arena holds folded slots, as in any
    fold run."""
    dt = model.precision
    tick = task(f"{dt} cull / repair / fold / re-index", len(cfg.contexts) * cfg.edit_reps)
    gen_rng = make_generator(0, model.device)
    rows = []

    def timed_apply(actions_of) -> float:
        """Median ms of stage 4 with ``actions_of(view)`` (stage 1 runs untimed first)."""
        samples = []
        for _ in range(cfg.edit_reps):
            view = primed.view()
            gen = generate(model, view, GREEDY, gen_rng)
            actions = actions_of(view)
            common.sync()
            t0 = time.perf_counter()
            apply(model, primed, gen, actions)
            common.sync()
            samples.append((time.perf_counter() - t0) * 1e3)
        return common.median(samples)

    for n in reversed(cfg.contexts):
        view = primed.view()  # shrink to n live slots (after the append): cull the tail
        apply(model, primed, generate(model, view, GREEDY, gen_rng),
              Actions(cull_slots=tuple(range(n - 1, view.n))))
        cull = timed_apply(lambda v: Actions(cull_slots=(v.n // 2,)))
        # the first token in text order goes, so every later key moves to a new position
        reindex = timed_apply(lambda v: Actions(cull_slots=(int(torch.argmin(v.position)),),
                                                reindex=True))
        found, repair_apply = [], []
        for _ in range(cfg.edit_reps):
            view = primed.view()
            gen = generate(model, view, GREEDY, gen_rng)
            common.sync()
            t0 = time.perf_counter()
            r = merge_pair(model, view, *_middle_triple(view))
            common.sync()
            t1 = time.perf_counter()
            apply(model, primed, gen, Actions(merges=(r,)))
            common.sync()
            t2 = time.perf_counter()
            found.append((t1 - t0) * 1e3)
            repair_apply.append((t2 - t1) * 1e3)
            tick()
        assert primed.arena.n == n, "an edit changed the context"
        targets, fold_apply = [], []
        for _ in range(cfg.edit_reps):
            view = primed.view()
            gen = generate(model, view, GREEDY, gen_rng)
            slot = view.n // 2
            common.sync()
            t0 = time.perf_counter()
            folds = fold_targets(view, (slot,), FoldRepair().min_cos)
            common.sync()
            t1 = time.perf_counter()
            apply(model, primed, gen, Actions(cull_slots=(slot,), folds=folds))
            common.sync()
            t2 = time.perf_counter()
            targets.append((t1 - t0) * 1e3)
            fold_apply.append((t2 - t1) * 1e3)
        assert primed.arena.n == n, "a fold changed the context"
        append = timed_apply(lambda v: Actions())  # last: the context grows by one each time
        rows.append(EditRow(dtype=dt, context=n, append_ms=append, cull_ms=cull,
                            reindex_ms=reindex, repair_forward_ms=common.median(found),
                            repair_apply_ms=common.median(repair_apply),
                            fold_targets_ms=common.median(targets),
                            fold_apply_ms=common.median(fold_apply)))
    return rows[::-1]


def measure_ops(model: Model, full: View, ids: list[int], cfg: SpeedConfig) -> OpsRow:
    """The operators one stage-1 call launches, at the context nearest 1024."""
    n = min(cfg.contexts, key=lambda c: abs(c - 1024))
    view = prefix_view(full, n, ids[n])
    gen = make_generator(0, model.device)
    generate(model, view, GREEDY, gen)  # warm: first calls may launch set-up operators
    count, top = common.operators(lambda: generate(model, view, GREEDY, gen))
    return OpsRow(model.precision, n, count, top)


@dataclass(frozen=True)
class Compiled:
    """One of the decode table's other stage 1s: the ``compile`` mode its model loads with,
    and its own table's title and what its note says the loading took."""

    mode: str
    title: str
    took: str
    after: str


# a decode row's key (its fields' prefix) -> that stage 1
COMPILED = {
    "compiled": Compiled("inductor",
                         "Stage 1 compiled (`--compile`: torch.compile, context length dynamic)",
                         "Compiling took", " (the first stage-1 call; inductor's on-disk cache "
                         "shortens a second run's)"),
    "native": Compiled(NATIVE, "Stage 1 native (`--compile native`: the weight products "
                       "and the work between them in native kernels)",
                       "Loading the model with its kernels and the first stage-1 call took",
                       " (building the kernels the first time on a machine takes tens of "
                       "seconds more)"),
    "graph": Compiled(GRAPH, "Stage 1 as a CUDA graph (`--compile graph`: over a fixed "
                      "power-of-two bucket of the arena's slots, the free ones masked, captured "
                      "once a bucket and replayed)",
                      "Loading the model and the first stage-1 call (its first capture) took",
                      " (each bucket a context reaches captures once more, at its first step)")}


def compile_model(cfg: SpeedConfig, dtype: str, full: View, ids: list[int],
                  task, mode: str = "inductor") -> tuple[Model | None, CompileRow]:
    """The model loaded again with ``compile`` ``mode``, and what loading it and its first
    stage-1 call took (inductor compiles at that call, a longer context again only past
    4,095 slots; the native kernels are built, or found built, as the model loads); or None
    and why, if compiling failed, so the rest of the run still reports."""
    tick = task(f"{dtype} compile {mode}", 1)
    try:
        t0 = time.perf_counter()
        model = load_model(cfg.model, dtype, cfg.device, compile=mode)
        n = cfg.contexts[0]
        generate(model, prefix_view(full, n, ids[n]), GREEDY, make_generator(0, model.device))
        common.sync()
        return model, CompileRow(dtype, mode, time.perf_counter() - t0, None)
    except Exception as e:  # pylint: disable=broad-exception-caught  # reported, not raised
        return None, CompileRow(dtype, mode, None, reason(e))
    finally:
        tick()


def reason(e: BaseException) -> str:
    """An exception as one short line: its type and first non-empty line, the compiler's
    own error where torch wraps it (``BackendCompilerFailed``'s first line only says which
    backend raised)."""
    e = getattr(e, "inner_exception", None) or e
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def scan_bytes(params: CacheParams, k: torch.Tensor, cold: int) -> int:
    """The bytes of cold keys ``k`` (L, kv_heads, capacity, head_dim) a scan step reads:
    ``cold`` rows of every recall layer and KV head."""
    L, kv_heads, _, head_dim = k.shape
    return len(recall_layers(params, L)) * kv_heads * cold * head_dim * k.element_size()


def measure_dtype(cfg: SpeedConfig, dtype: str, bandwidth: float,
                  task) -> tuple[SpeedConfig, dict[str, list]]:
    """Every measurement in ``dtype``: the config fitted to the model's positions, and the
    rows by the name of their ``SpeedResult`` field."""
    gc.collect()  # the last dtype's models and states, whatever cycles hold them
    model = load_model(cfg.model, dtype, cfg.device)
    cfg = cfg.fitted(model.spec.max_positions)
    rows = measure_stage(model, cfg, task) if "stage" in cfg.parts else {}
    loop, others = [], rows.pop("compiled", [])
    if "loop" in cfg.parts:
        loop = measure_loop(model, cfg, task)
        for other in others:  # the same loop over stage 1 native or graph
            loop += measure_loop(other, cfg, task)
    wb, kvb = weight_bytes(model), kv_bytes_per_token(model)
    batch, busy_rows = [], []
    natives = native_models(cfg, dtype, others) if {"batch", "busy"} & set(cfg.parts) else []
    if "batch" in cfg.parts:  # the plain path's rows, then the native kernels' where they run
        for rows_model in [model] + natives:
            batch += throughput.measure(rows_model, cfg, task, random_prompt, wb, kvb)
    if "busy" in cfg.parts:  # run on a machine doing something else (the CPU only)
        busy_rows = busy.measure(busy.run_model(model, cfg.device, dtype, natives),
                                 cfg.busy_reps, task, random_prompt)
    # the physical floor: weights + live K/V read once per token
    rows["decode"] = [dataclasses.replace(r, floor_ms=(wb + r.context * kvb) /
                                          (bandwidth * 1e9) * 1e3) for r in rows.get("decode", ())]
    memory = MemoryRow(dtype, wb, kvb, wb / (bandwidth * 1e9) * 1e3,
                       next((r.cold_bytes_per_token for r in loop if r.cold), None))
    return cfg, {"prefill": [], "alloc": [], "edits": [], "ops": [], "compile": [],
                 "llamacpp": [], **rows, "memory": [memory], "loop": loop, "batch": batch,
                 "busy": busy_rows}


def native_models(cfg: SpeedConfig, dtype: str, others: list[Model]) -> list[Model]:
    """The native model of ``others`` (the stage part's), else one loaded here; none where
    the native kernels do not pay or do not build on this machine (``native.slower``)."""
    if native.slower([cfg.device], dtype) is not None or native.unavailable() is not None:
        return []
    have = [m for m in others if m.compiled == NATIVE]
    return have or [load_model(cfg.model, dtype, cfg.device, compile=NATIVE)]


def measure_stage(model: Model, cfg: SpeedConfig, task) -> dict[str, list]:
    """The ``stage`` part in ``model``'s dtype: stage 0 and stage 1 against HF (and
    llama.cpp where it is at hand), the compiled copies, operators, allocations and edits;
    ``compiled``: the native or graph copies, for the loop to run over too."""
    dtype = model.precision
    hf = stock_hf(model)
    prefill, states = measure_prefill(model, hf, cfg, task)
    longest = max(cfg.contexts[-1], cfg.prefill[-1])
    ids = random_prompt(model, longest + 1)
    primed = states.pop(longest, None) or prime(
        model, [Segment(tuple(ids), "user")], capacity=longest + headroom(cfg))[0]
    del states
    view = primed.view()
    why_not = llamacpp.unavailable(model, dtype)
    llama = None if why_not else llamacpp.Contender(model, dtype, cfg.contexts[-1] + 8)
    compiled, compile_info = {}, []
    for key, how in COMPILED.items():
        if {NATIVE: cfg.device != "cpu", GRAPH: cfg.device == "cpu"}.get(how.mode):
            continue  # the native kernels are the CPU's, CUDA graphs a GPU's
        other, info = compile_model(cfg, dtype, view, ids, task, how.mode)
        compile_info.append(info)
        if other is not None:
            compiled[key] = other
    decode = measure_decode(model, hf, view, ids, cfg, task, llama, compiled)
    loops = [compiled.pop(key) for key in ("native", "graph") if key in compiled]
    del compiled
    if llama is not None:
        llama.close()
    ops = measure_ops(model, view, ids, cfg)
    # the profiler's memory events count host allocations: on a GPU, nothing to compare
    alloc = measure_alloc(model, hf, view, ids, cfg, task) if cfg.device == "cpu" else []
    del hf
    del view
    edits = measure_edits(model, primed, cfg, task)  # changes the primed arena: last
    return {"prefill": prefill, "decode": decode, "alloc": alloc, "edits": edits,
            "ops": [ops], "compile": compile_info, "compiled": loops,
            "llamacpp": [LlamacppRow(dtype, llama is not None, why_not,
                                     llama and llama.path.name)]}


def run(cfg: SpeedConfig, command: str) -> SpeedResult:
    """Every measurement, in one result."""
    t0 = time.perf_counter()
    machine = Machine.now()
    parts = []
    with common.progress() as task:
        tick = task("copy bandwidth", 1)
        bandwidth = common.copy_bandwidth_gbs(cfg.bandwidth_mb, device=cfg.device)
        tick()
        for dtype in cfg.dtypes:
            parts.append(measure_dtype(cfg, dtype, bandwidth, task))
    rows = {key: [r for _, p in parts for r in p[key]] for key in parts[0][1]}
    res = SpeedResult(benchmark="speed", command=command, model=cfg.model, quick=cfg.quick,
                      machine=machine.ended(), config=parts[0][0], bandwidth_gb_s=bandwidth,
                      **rows, decode_fit=decode_fit(rows["decode"]),
                      alloc_fit=alloc_fit(rows["alloc"], rows["memory"]),
                      peak_rss_mb=common.peak_rss_mb(), elapsed_s=time.perf_counter() - t0)
    res.targets = targets(res)
    return res


# --- analysis -----------------------------------------------------------------------------

def _by_dtype(rows: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(r.dtype, []).append(r)
    return out


def decode_fit(decode: list[DecodeRow]) -> list[DecodeFit]:
    """ms/token = fixed + per_1k * context/1000, for stage 1 and HF, per dtype."""
    fits = []
    for dt, rows in _by_dtype(decode).items():
        xs = [r.context / 1000 for r in rows]
        for who in ("ours", "hf"):
            a, b = linear_fit(xs, [getattr(r, f"{who}_ms") for r in rows])
            fits.append(DecodeFit(dt, who, a, b))
    return fits


def alloc_fit(alloc: list[AllocRow], memory: list[MemoryRow]) -> list[AllocFit]:
    """Bytes allocated per step = fixed + per_token * context, per dtype."""
    kv = {m.dtype: m.kv_bytes_per_token for m in memory}
    fits = []
    for dt, rows in _by_dtype(alloc).items():
        xs = [r.context for r in rows]
        for who in ("ours", "hf"):
            a, b = linear_fit(xs, [getattr(r, f"{who}_bytes") for r in rows])
            fits.append(AllocFit(dt, who, round(a), round(b, 1), kv[dt]))
    return fits


def _loop_what(row: LoopRow) -> str:
    """A loop row's setting in words: its repair, with recall the cold store it scans, a
    stage 1 other than the plain one, a scorer other than brightness."""
    repair = row.repair.removesuffix(" + recall")
    how = "" if row.stage1 == "plain" else f", stage 1 {row.stage1}"
    how += "" if row.policy == "brightness" else f", {row.policy}"
    if not row.cold:
        return f"{repair} repair{how}"
    return (f"{repair} repair, recall over {row.cold} cold tokens, scanned every "
            f"{row.recall_every} steps{how}")


def _per_head_targets(res: SpeedResult) -> list[Target]:
    """Each per-head loop row's step over the whole-token step of its scorer (same dtype
    and stage 1), without recall (the issue's target is of eviction)."""
    out = []
    for r in res.loop:
        name, _, kind = r.policy.partition("@")
        token = next((x for x in res.loop if (x.dtype, x.stage1, x.policy, x.repair)
                      == (r.dtype, r.stage1, name, r.repair)), None)
        if kind and token is not None and not r.cold:  # with recall: the table's rows alone
            ratio = r.step_ms / token.step_ms
            out.append(Target(f"loop step, {r.policy} / {name} at budget {r.context}", ratio,
                              f"<= {PER_HEAD_TARGET}", ratio <= PER_HEAD_TARGET, r.dtype))
    return out


def loop_target(row: LoopRow) -> float:
    return RECALL_LOOP_TARGET if row.cold else LOOP_TARGET


def _cpu_decode_targets(res: SpeedResult, who: str, ms: str, hf: str,
                        llama_ratio: str) -> list[Target]:
    """The CPU's decode targets beyond HF's for ``who``, from a decode row's fields ``ms``
    (its ms per token), ``hf`` and ``llama_ratio`` (its ratios to HF and llama.cpp): against
    llama.cpp at the same precision where it was measured, else bfloat16's yardstick against
    HF; and bfloat16's share of the bandwidth limit at 1024."""
    out: list[Target] = []
    llama = {x.dtype for x in res.llamacpp if x.measured}
    for r in res.decode:
        if getattr(r, ms) is None:
            continue
        limit, contexts = LLAMACPP_TARGETS.get(r.dtype, (None, ()))
        if r.dtype in llama and (contexts is None or r.context in contexts):
            ratio = getattr(r, llama_ratio)
            out.append(Target(f"{who} / llama.cpp decode at {r.context} (same precision)",
                              ratio, f"<= {limit}", ratio <= limit, r.dtype))
        elif r.dtype == "bfloat16" and r.dtype not in llama and r.context in YARDSTICK_TARGETS:
            t, ratio = YARDSTICK_TARGETS[r.context], getattr(r, hf)
            out.append(Target(f"{who} / HF decode at {r.context} (the yardstick where "
                                    "llama.cpp is not measured)", ratio, f"<= {t}",
                                    ratio <= t, r.dtype, context=r.context))
    for r in res.decode:
        if getattr(r, ms) is not None and r.dtype == "bfloat16" and r.context == 1024:
            share = r.floor_ms / getattr(r, ms)
            out.append(Target(f"share of the bandwidth limit at 1024 (floor / {who})", share,
                              f">= {BANDWIDTH_TARGET}", share >= BANDWIDTH_TARGET, r.dtype))
    return out


def targets(res: SpeedResult) -> list[Target]:
    out: list[Target] = []
    gpu = res.config.device != "cpu"
    for r in res.decode:
        if gpu or r.context in DECODE_TARGETS:
            t = GPU_DECODE_TARGET if gpu else DECODE_TARGETS[r.context]
            out.append(Target(f"stage 1 / HF decode at {r.context}", r.ratio, f"<= {t}",
                                    r.ratio <= t, r.dtype, context=r.context))
    if not gpu:  # stage 1, then stage 1 with native kernels where the run has it
        out += _cpu_decode_targets(res, "stage 1", "ours_ms", "ratio", "llamacpp_ratio")
        out += _cpu_decode_targets(res, "stage 1 native", "native_ms", "native_hf_ratio",
                                   "native_llamacpp_ratio")
    for r in res.decode:
        if gpu and r.graph_ms is not None:
            ratio = r.graph_ms / r.floor_ms
            out.append(Target(f"stage 1 graph / the bandwidth floor at {r.context}", ratio,
                                    f"<= {GRAPH_FLOOR_TARGET}", ratio <= GRAPH_FLOOR_TARGET,
                                    r.dtype, context=r.context))
    for r in res.prefill:
        if r.tokens in PREFILL_TARGET_TOKENS and r.dtype in PREFILL_TARGET_DTYPES:
            for key, what in (("ratio", ""), ("window_ratio", ", with the prompt's window")):
                value = getattr(r, key)
                if value is None:  # a run from before the statistics were timed
                    continue
                out.append(Target(f"stage 0 / HF prefill tokens/s at {r.tokens}{what}", value,
                                  f">= {PREFILL_TARGET}", value >= PREFILL_TARGET, r.dtype))
    for r in res.loop:
        if r.policy == "brightness":
            t = loop_target(r)
            out.append(Target(f"loop step / stage 1 at budget {r.context} ({_loop_what(r)})",
                              r.overhead, f"<= {t}", r.overhead <= t, r.dtype))
    out += _per_head_targets(res)
    out += throughput.targets(res.batch)
    out += busy.targets(res.busy)
    for f in res.alloc_fit:
        if f.who == "ours":  # one copy of the past would cost >= kv_bytes_per_token
            out.append(Target("stage 1 bytes allocated per context token per step: less "
                              "than one copy of the past", f.bytes_per_token,
                              f"< {f.kv_bytes_per_token:,} B (K/V per token)",
                              f.bytes_per_token < f.kv_bytes_per_token, f.dtype, "B"))
            out.append(Target("stage 1 bytes allocated per context token per step: flat",
                              f.bytes_per_token, "0 B", f.bytes_per_token <= 0, f.dtype, "B"))
    for dt, rows in _by_dtype(res.edits).items():
        lo, hi = rows[0], rows[-1]
        for key, what in (("cull_ms", "one cull"), ("repair_apply_ms", "one merge repair"),
                          ("fold_apply_ms", "one fold")):
            if getattr(lo, key) is None:
                continue  # a run from before folds were timed
            ratio = getattr(hi, key) / getattr(lo, key)
            out.append(Target(f"{what}, stage 4: ms at context {hi.context} / at "
                              f"{lo.context} (O(1))", ratio, f"<= {EDIT_TARGET}",
                              ratio <= EDIT_TARGET, dt))
    return out


def _compiled_table(res: SpeedResult, key: str, measured: bool):
    """The decode table's ``key`` contender (a ``COMPILED`` key) against stage 1, or None if
    the run has none."""
    how = COMPILED[key]
    rows = [r for r in res.decode if getattr(r, f"{key}_ms") is not None]
    tried = [c for c in res.compile if c.mode == how.mode]
    if not rows and not tried:
        return None
    return Table(
        how.title, ("dtype", "context", "stage 1 ms", f"{key} ms", f"{key} / stage 1", f"{key} / HF")
        + ((f"{key} / llama.cpp",) if measured else ()) + ("same next token",),
        tuple((r.dtype, str(r.context), fmt(r.ours_ms, 2), fmt(getattr(r, f"{key}_ms"), 2),
               fmt(getattr(r, f"{key}_ratio"), 2), fmt(getattr(r, f"{key}_hf_ratio"), 2))
              + ((fmt(getattr(r, f"{key}_llamacpp_ratio"), 2),) if measured else ())
              + ("yes" if getattr(r, f"{key}_agrees") else "no",) for r in rows),
        f"Timed in the same rounds as the decode table above, on a second copy of the model "
        f"loaded with `{compile_flag(how.mode)}` (docs/DESIGN.md, stage 1). {how.took} " + "; ".join(
            f"{c.dtype} {c.compile_s:.0f} s" if c.why_not is None
            else f"{c.dtype} failed, not measured ({c.why_not})" for c in tried)
        + how.after + ".")


def _graph_floor_notes(res: SpeedResult) -> list[str]:
    """Why stage 1 as a graph stayed above ``GRAPH_FLOOR_TARGET`` times the floor, per dtype:
    its cost fitted over the contexts (fixed + per 1k tokens) against the floor's (the
    weights, and the K/V per 1k tokens), and the operators its graph replays as kernels."""
    notes = []
    for dt, rows in _by_dtype([r for r in res.decode if r.graph_ms is not None]).items():
        missed = [r for r in rows if r.graph_ms / r.floor_ms > GRAPH_FLOOR_TARGET]
        if not missed:
            continue
        memory = {m.dtype: m for m in res.memory}
        ops = {o.dtype: o for o in res.ops}
        bandwidth = res.bandwidth_gb_s * 1e9
        fixed, per_1k = linear_fit([r.context / 1000 for r in rows], [r.graph_ms for r in rows])
        kv_1k = memory[dt].kv_bytes_per_token * 1000 / bandwidth * 1e3
        notes.append(
            f"- **{dt}, stage 1 graph over the floor at {', '.join(str(r.context) for r in missed)}: "
            f"{min(r.graph_ms / r.floor_ms for r in missed):.2f}-"
            f"{max(r.graph_ms / r.floor_ms for r in missed):.2f}x, target <= "
            f"{GRAPH_FLOOR_TARGET}.** Fitted over the contexts the graph costs {fixed:.2f} ms + "
            f"{per_1k:.3f} ms per 1k context tokens; the floor {memory[dt].floor_ms:.2f} ms of "
            f"weights + {kv_1k:.3f} ms of K/V per 1k tokens. " + (
                f"Its fixed part is {fixed / memory[dt].floor_ms:.1f}x the weights' reads: the "
                f"graph replays each of the step's {ops[dt].ops:,} operators as a kernel of "
                f"its own, most of them a few microseconds of elementwise work; fusing them is "
                f"what is left. " if fixed > GRAPH_FLOOR_TARGET * memory[dt].floor_ms / 2 else "")
            + (f"Its attention grows {per_1k / kv_1k:.0f}x faster than the K/V it reads."
               if per_1k > 2 * kv_1k else ""))
    return notes


def missed_notes(res: SpeedResult) -> list[str]:
    """Why a target was missed, from the run's own numbers."""
    fits = {(f.dtype, f.who): f for f in res.decode_fit}
    floor = {m.dtype: m for m in res.memory}
    notes = []
    for t in res.targets:
        if t.met or not (t.context is not None and t.what.startswith("stage 1 / HF decode")):
            continue
        n, dt = t.context, t.dtype
        r = next(r for r in res.decode if r.dtype == dt and r.context == n)
        ours, hf = fits[(dt, "ours")], fits[(dt, "hf")]
        notes.append(
            f"- **{dt}, context {n}: {r.ratio:.2f}x, target {t.target}.** Stage 1 takes "
            f"{r.ours_ms:.1f} ms, HF {r.hf_ms:.1f} ms. Fitted over the contexts, stage 1 "
            f"costs {ours.fixed_ms:.1f} ms + {ours.ms_per_1k:.2f} ms per 1k context tokens, "
            f"HF {hf.fixed_ms:.1f} ms + {hf.ms_per_1k:.2f} ms. The fixed part is the same "
            f"weight reads for both ({fmt_bytes(floor[dt].weight_bytes)} per token; "
            f"{floor[dt].floor_ms:.1f} ms at the measured copy bandwidth): even with free "
            f"attention stage 1 could not go below {ours.fixed_ms / r.hf_ms:.2f}x of HF "
            f"here. " + (
                "Stage 1's attention over the live K/V grows faster with the context than "
                "HF's whole context-dependent part in this run, so our attention is what "
                "misses." if ours.ms_per_1k > hf.ms_per_1k else
                "Stage 1's context-dependent part grows no faster than HF's, so the ratio is "
                "bounded by how slow HF's context-dependent part is, not by our attention."))
    notes += _graph_floor_notes(res)
    for r in res.loop:
        if r.policy != "brightness" or r.overhead <= loop_target(r):
            continue
        rest = r.step_ms - r.stage1_ms - r.score_ms - r.decide_ms
        why = (f" Stage 3 decides each merge repair with two read-only one-token forwards (the "
               f"model's argmax at the pair's place, then the merged token's K/V, which stops "
               f"at the last layer's K/V and skips the lm_head): "
               f"{r.decide_ms / r.stage1_ms:.2f} stage-1 costs here, so a step that "
               f"repairs cannot stay within {LOOP_TARGET}x; repairing on every k-th step only "
               f"would divide that part by k."
               if r.repair == "merge" else
               f" Stage 2 scores the {r.cold} cold keys of every layer brightness reads"
               f" (`--recall-layers`, `--recall-every` trade that away)." if r.cold else "")
        if r.scan_bytes:
            why += _scan_floor(res, r)
        if r.cold and r.recall_every > 1:
            notes.append(
                f"- **{r.dtype}, loop step ({_loop_what(r)}): {r.overhead:.2f}x "
                f"stage 1 (the mean of {r.recall_every} steps, one of which scans the cold "
                f"store), target <= {loop_target(r)}.** Stage 1 {r.stage1_ms:.1f} ms; on the recall step "
                f"stage 2 {r.score_ms:.2f} ms and stage 3 {r.decide_ms:.1f} ms." + why)
            continue
        notes.append(
            f"- **{r.dtype}, loop step ({_loop_what(r)}): {r.overhead:.2f}x "
            f"stage 1, target <= {loop_target(r)}.** Stage 1 {r.stage1_ms:.1f} ms, stage 2 "
            f"{r.score_ms:.2f} ms, stage 3 {r.decide_ms:.1f} ms, " + (
                f"the rest of the step (stage 4, bookkeeping) {rest:.1f} ms." if rest >= 0 else
                "the rest of the step (stage 4, bookkeeping) lost in the noise (the step's "
                "median is below the sum of the stages' medians).") + why)
    for f in res.alloc_fit:
        if f.who == "ours" and f.bytes_per_token > 0:
            notes.append(
                f"- **{f.dtype}, stage 1's allocation grows by {f.bytes_per_token:,.0f} B "
                f"per context token, target flat.** "
                + ("All" if f.bytes_per_token < f.kv_bytes_per_token else "Part")
                + " of it is the attention weights: in each layer the scores over the live "
                  "slots, the scores joined with the new token's and their softmax, plus the "
                  "float32 attention row stage 1 returns for stage 2. The scorers need that "
                  "row; a fused kernel that never builds the scores "
                  "(`scaled_dot_product_attention`) would not give it.")
        if f.who == "ours" and f.bytes_per_token >= f.kv_bytes_per_token:
            notes.append(
                f"- **{f.dtype}, stage 1 allocates {f.bytes_per_token:,.0f} B per context "
                f"token per step, target < {f.kv_bytes_per_token} B.** Our code reads the "
                f"arena's live K/V in place, but they are views into the longer arena, and "
                f"oneDNN's batched bfloat16 product copies a strided operand before it "
                f"multiplies, in every layer. The count comes from the allocator's own events, "
                f"so it sees copies made inside a kernel.")
    return notes


def _scan_floor(res: SpeedResult, r: LoopRow) -> str:
    """How close a recall row could come to its target if reading the cold keys were the
    only cost: the scan's bytes per step at the measured copy bandwidth, on top of the same
    loop without recall."""
    per_step = r.scan_bytes / r.recall_every
    floor = per_step / (res.bandwidth_gb_s * 1e9) * 1e3
    plain = next((x for x in res.loop if x.dtype == r.dtype
                  and x.stage1 == r.stage1 and x.repair == "none"), None)
    least = "" if plain is None else (
        f" The same loop without recall costs {plain.overhead:.2f}x, so with every other "
        f"part of recall free the step could not go below "
        f"{plain.overhead + floor / r.stage1_ms:.2f}x here.")
    return (f" The scan reads {fmt_bytes(r.scan_bytes)} of cold keys, "
            f"{fmt_bytes(per_step)} a step over {r.recall_every} steps: {floor:.2f} ms a step "
            f"at the measured copy bandwidth ({res.bandwidth_gb_s:.1f} GB/s)." + least)


# --- output -------------------------------------------------------------------------------

def llamacpp_note(llama) -> str:
    """What the run says about llama.cpp: measured (which GGUF, which K/V), or why not."""
    notes = []
    for x in llama:
        if x.measured:
            weights, kv = llamacpp.PRECISIONS[x.dtype]
            notes.append(f"llama.cpp in {x.dtype}: `{x.gguf}` ({weights.upper()} weights "
                         f"written by llama.cpp's converter from the same folder, {kv} K/V "
                         "cache), same threads, alternating with the others.")
        else:
            notes.append(f"llama.cpp in {x.dtype} was not measured: {x.why_not}.")
    return " ".join(notes) + (" " if notes else "")


def tables(res: SpeedResult) -> list[Table]:
    llama = res.llamacpp
    measured = any(x.measured for x in llama)
    decode = Table(
        "Decode: ms per token (median), stage 1 vs HF model() + DynamicCache"
        + (" and llama.cpp" if measured else ""),
        ("dtype", "context", "stage 1 ms", "HF ms", "stage 1 / HF")
        + (("llama.cpp ms", "stage 1 / llama.cpp", "same next token") if measured else ())
        + ("floor ms", "floor / stage 1"),
        tuple((r.dtype, str(r.context), fmt(r.ours_ms, 2), fmt(r.hf_ms, 2),
               fmt(r.ratio, 2))
              + ((fmt(r.llamacpp_ms, 2), fmt(r.llamacpp_ratio, 2),
                  {True: "yes", False: "no", None: "–"}[r.llamacpp_agrees])
                 if measured else ())
              + (fmt(r.floor_ms, 2), f"{r.floor_ms / r.ours_ms:.0%}")
              for r in res.decode),
        llamacpp_note(llama) + "stage 1 / HF below 1: stage 1 is faster. "
        "floor: weights + live K/V read once per token at the measured copy bandwidth "
        f"({res.bandwidth_gb_s:.1f} GB/s). HF runs a copy of the model with its weights "
        "row-major, as its own loader leaves them (for int8, the dequantized bfloat16 "
        "weights); stage 1 reads float32 weights stored input-major, bfloat16 weights packed "
        "by oneDNN and int8 weights through torch's weight-only int8 product.")
    fit = Table(
        "Decode cost model: ms/token = fixed + per 1k context tokens (least squares)",
        ("dtype", "who", "fixed ms", "ms per 1k tokens"),
        tuple((f.dtype, "stage 1" if f.who == "ours" else "HF", fmt(f.fixed_ms, 2),
               fmt(f.ms_per_1k, 2)) for f in res.decode_fit))
    alloc = Table(
        "Bytes allocated per decode step",
        ("dtype", "context", "stage 1", "HF", "HF / stage 1 (above 1: stage 1 allocates less)"),
        tuple((r.dtype, str(r.context), fmt_bytes(r.ours_bytes), fmt_bytes(r.hf_bytes),
               fmt(r.hf_bytes / r.ours_bytes, 1)) for r in res.alloc),
        "Growth per context token: " + "; ".join(
            f"{f.dtype} {'stage 1' if f.who == 'ours' else 'HF'} "
            f"{f.bytes_per_token:,.0f} B" for f in res.alloc_fit)
        + " (one copy of the past K/V would be " + ", ".join(
            f"{m.kv_bytes_per_token:,} B in {m.dtype}" for m in res.memory) + ").")
    prefill = Table(
        "Prefill (stage 0 prime vs one HF forward building a DynamicCache; stage 0 also "
        "gathering the prompt's statistics: their window, as the default scorer's prefill "
        "scores do, the window and total, as H2O's do, and the window and KVzip's copy of "
        "the prompt, as kvzip's do)",
        ("dtype", "tokens", "stage 0 ms", "HF ms", "stage 0 tok/s", "HF tok/s",
         "stage 0 / HF speed (below 1: stage 0 is slower)", "with window ms",
         "with window / HF speed", "with total ms", "with total / HF speed", "with copy ms",
         "with copy / HF speed"),
        tuple((r.dtype, str(r.tokens), fmt(r.ours_ms, 1), fmt(r.hf_ms, 1),
               fmt(r.ours_tok_s, 0), fmt(r.hf_tok_s, 0), fmt(r.ratio, 2),
               *(fmt(getattr(r, k), d) if getattr(r, k) is not None else "-" for k, d in (
                   ("window_ms", 1), ("window_ratio", 2), ("total_ms", 1), ("total_ratio", 2),
                   ("copy_ms", 1), ("copy_ratio", 2))))
              for r in res.prefill))
    loop = Table(
        "Loop step (stages 1-4, one removal per step at the budget)",
        ("dtype", "stage 1", "policy", "repair", "live slots", "stage 1 ms", "stage 2 ms", "stage 3 ms",
         "step ms", "step / stage 1", "host reads a step", "CUDA syncs a step",
         "stages 2-4 operators a step"),
        tuple((r.dtype, r.stage1, r.policy, r.repair, str(r.context),
               fmt(r.stage1_ms, 2),
               fmt(r.score_ms, 2), fmt(r.decide_ms, 2), fmt(r.step_ms, 2),
               fmt(r.overhead, 2), fmt(r.host_reads, 1), fmt(r.cuda_syncs, 1),
               fmt(r.settle_ops, 0))
              for r in res.loop),
        "Medians per stage, timed on the same view within each repetition; the step is "
        "`Session.step` (all four stages). The brightness scorer; with the plain stage 1 also "
        "h2o with whole tokens and with every (layer, KV head) culling its own (`h2o@head`, "
        "the same K/V memory), each without and with recall (per head: each head's own cold "
        "store). With recall, stage 1 is timed as without it: the "
        "query and log-sum-exp it also hands stage 2 count as recall's cost, in the step. "
        "Stage 1 native or graph: the same loop on the `--compile native` (the CPU) or "
        "`--compile graph` (a GPU) copy (stages 2-4 as they are), so the same stages 2-4 "
        "weigh more against a shorter stage 1. Host reads: the values a step reads back from "
        "the device (`common.host_reads`; each waits for the device to drain on a GPU), "
        "counted over one more round of steps; CUDA syncs: the waits CUDA itself counts in "
        "that round (`common.cuda_syncs`: also copies from host memory), on a GPU only. "
        "Stages 2-4 operators: the top-level operators (as in the operators table) stages "
        "2-4 launch a step, over another round: in a batch of rows they run once a row, "
        "each a fixed cost beside the stage 1 the rows share.")
    edits = Table(
        "Cost of one edit vs context (stage 4 `apply`, which always appends the pending token too)",
        ("dtype", "context", "append only ms", "+ 1 cull ms", "+ cull + full re-index ms",
         "merge: stage 3 forwards ms", "merge: stage 4 ms", "fold: stage 3 targets ms",
         "fold: stage 4 ms"),
        tuple((r.dtype, str(r.context), fmt(r.append_ms, 3), fmt(r.cull_ms, 3),
               fmt(r.reindex_ms, 3), fmt(r.repair_forward_ms, 2),
               fmt(r.repair_apply_ms, 3), fmt(r.fold_targets_ms, 3),
               fmt(r.fold_apply_ms, 3)) for r in res.edits),
        "Re-index culls the first token, so every other key is re-rotated to a new position. "
        "Stage 4 of an edit is O(1) in the context; the decisions in stage 3 are not: a merge "
        "runs two one-token forwards over the context, and a fold's target search reads "
        "every live key once.")
    compiled = [_compiled_table(res, key, measured) for key in COMPILED]
    ops = Table(
        "Operators launched per token (stage 1)",
        ("dtype", "context", "operators", "most frequent"),
        tuple((r.dtype, str(r.context), f"{r.ops:,}",
               ", ".join(f"{name} {k}" for name, k in r.top))
              for r in res.ops),
        "Top-level operators of one stage-1 call (the profiler's CPU events with no parent): "
        "each passes through torch's dispatcher, a fixed cost however little it computes.")
    memory = Table(
        "Memory",
        ("dtype", "weights read per token", "K/V per token", "cold store per token (recall)",
         "floor ms/token (weights only)"),
        tuple((m.dtype, fmt_bytes(m.weight_bytes), fmt_bytes(m.kv_bytes_per_token),
               fmt_bytes(m.cold_bytes_per_token), fmt(m.floor_ms, 2))
              for m in res.memory),
        f"Copy bandwidth {res.bandwidth_gb_s:.1f} GB/s; peak RSS of the whole run "
        f"{res.peak_rss_mb:,.0f} MiB (the process: every dtype's models and arenas and "
        "HF's copies and caches, not the loop alone).")
    target = target_table(
        res.targets, 2,
        "Ratios: stage 1 / HF, stage 1 / llama.cpp and loop step / stage 1 are times (below "
        "1 = faster than the other; 1.10 = 10% over stage 1); stage 0 / HF prefill is a "
        "speed (above 1 = faster than HF); the edit rows divide the cost at the longest "
        "context by the cost at the shortest (1 = flat).")
    # on a GPU no allocations are counted (the profiler's events are the host allocator's)
    return [t for t in (target, decode, *compiled, fit, ops, alloc, loop,
                        throughput.table(res.batch), busy.table(res.busy), edits, prefill,
                        memory)
            if t is not None and t.rows]


def plots(res: SpeedResult, out: Path) -> list[str]:
    """PNG plots into ``out``; returns their file names."""
    decode, alloc = {}, {}
    for dt, rows in _by_dtype(res.decode).items():
        xs = [r.context for r in rows]
        decode[f"stage 1 {dt}"] = (xs, [r.ours_ms for r in rows], "-")
        decode[f"HF {dt}"] = (xs, [r.hf_ms for r in rows], "--")
        decode[f"floor {dt}"] = (xs, [r.floor_ms for r in rows], ":")
        if rows[0].llamacpp_ms is not None:
            decode[f"llama.cpp {dt}"] = (xs, [r.llamacpp_ms for r in rows], "-.")
    for dt, rows in _by_dtype(res.alloc).items():
        xs = [r.context for r in rows]
        alloc[f"stage 1 {dt}"] = (xs, [r.ours_bytes / 2 ** 20 for r in rows], "-")
        alloc[f"HF {dt}"] = (xs, [r.hf_bytes / 2 ** 20 for r in rows], "--")
    if decode:  # a run of the stage part
        common.line_plot(out / "decode_ms.png", f"Decode ms/token, {res.model}",
                         "context (tokens)", "ms per token (median)", decode)
    if alloc:
        common.line_plot(out / "alloc_bytes.png", "Bytes allocated per decode step",
                         "context (tokens)", "MiB allocated per step", alloc, logy=True)
    edits = {}
    for dt, rows in _by_dtype(res.edits).items():
        xs = [r.context for r in rows]
        edits[f"cull {dt}"] = (xs, [r.cull_ms for r in rows], "-")
        edits[f"cull + re-index {dt}"] = (xs, [r.reindex_ms for r in rows], "-")
        edits[f"merge (stages 3+4) {dt}"] = (
            xs, [r.repair_forward_ms + r.repair_apply_ms for r in rows], "--")
        if rows[0].fold_apply_ms is not None:
            edits[f"fold (stages 3+4) {dt}"] = (
                xs, [r.fold_targets_ms + r.fold_apply_ms for r in rows], "-.")
    if edits:
        common.line_plot(out / "edits_ms.png", "One edit (incl. the append)",
                         "context (tokens)", "ms (median)", edits, logy=True)
    return ((["decode_ms.png"] if decode else []) + (["alloc_bytes.png"] if alloc else [])
            + (["edits_ms.png"] if edits else []))


def report_md(res: SpeedResult, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report; ``level`` is the heading level of its title."""
    h = "#" * level
    m = res.machine
    lines = [
        f"{h} Speed benchmark" + ("" if res.config.device == "cpu"
                                    else f" on a GPU ({res.config.device})"),
        "",
        res.regenerate(),
        "",
        f"Model `{res.model}`{' (quick)' if res.quick else ''}; "
        + (f"{m.gpu}; " if m.gpu else "") + f"{m.cpu}, {m.cores} cores, "
        f"{m.torch_threads} torch threads; torch {m.torch}, transformers "
        f"{m.transformers}; load average {m.loadavg_start[0]} at the start, "
        f"{m.loadavg_end[0]} at the end (other processes share the cores; medians of "
        f"{res.config.reps} decode / {res.config.prefill_reps} prefill / "
        f"{res.config.batch_reps} batch stage 1 / {res.config.loop_reps} batch loop"
        + (f" / {res.config.busy_reps} busy" if "busy" in res.config.parts else "")
        + " repetitions, "
        "contenders alternating within each repetition).",
        "",
    ]
    for t in tables(res):
        lines += [f"{h}# {t.title}", "", t.markdown(), ""]
        if t.title.startswith("Targets"):
            notes = missed_notes(res)
            if notes:
                lines += [f"{h}## Missed targets, and why", "", *notes, ""]
    if images:
        lines += [f"{h}# Plots", ""]
        lines += [f"![{name}]({image_dir}/{name})" for name in images]
    lines += ["", f"{h}# Method", "", METHOD]
    return "\n".join(lines) + "\n"


METHOD = """\
- **Decode**: one prime of the longest context per dtype; every shorter context is a
  prefix view of that arena (what a prime of those tokens alone would produce, since the
  model is causal). Stage 1 is `stages.generate.generate` (forward, attention row for the
  scorers, greedy sampler). HF is `model(input_ids, position_ids, cache)` (the cache by
  the name the installed transformers takes, `model.hf_forward`) plus an argmax on a `DynamicCache` holding a copy of the same K/V, cropped back by one row
  after every call so the context stays fixed. Two warm-up rounds, then the median of the
  repetitions; stage 1 and HF alternate within each repetition, same threads.
- **Compiled**, **native** and **graph**: copies of the model loaded with `compile`
  (`--compile`), with `compile="native"` (`--compile native`; the CPU only) and with
  `compile="graph"` (`--compile graph`; a GPU only), each one's loading and first
  stage-1 call (the compilation, or the first capture) timed apart, then timed as further
  contenders in the same rounds on the same views.
- **llama.cpp** (where `llama_cpp` and llama.cpp's converter are installed: `make
  bench-llamacpp`): the model's own Hugging Face folder written as a GGUF by llama.cpp's
  `convert_hf_to_gguf.py` (F32 weights and an f32 K/V cache for float32; BF16 weights and
  llama.cpp's default f16 K/V cache for bfloat16; Q8_0 weights, int8 in blocks of 32 with
  a float16 scale each, and the f16 K/V cache for int8), the same token ids evaluated up to each
  context, then one token decoded at that context per repetition and dropped from its
  cache again, alternating with stage 1 and HF, with as many threads as torch uses. "same
  next token": llama.cpp's greedy token equals stage 1's at that context.
- **Allocations**: the CPU allocator's own events (the torch profiler with memory
  profiling) during one decode step per context: every allocation, also those an
  operator's kernel makes for itself; views and in-place writes cost nothing. HF's
  `DynamicCache` concatenates the past with the new row in every layer, so its allocation
  grows with the K/V. Stage 1 only reads the arena: in float32 its growth is the attention
  weights (a few floats per head per context token); in bfloat16 (int8's too), oneDNN's batched
  product first copies a strided operand (the live K and V of each layer are views into
  the longer arena), so there its growth is about one copy of the past.
- **Prefill**: stage 0 `prime` (chunked, writes the arena and ledger) vs one HF forward over
  the same tokens building a `DynamicCache`, last-position logits only for both.
- **Busy** (the CPU only): `run`'s loop with no flags (`--compile auto`'s stage 1, no
  budget, the default sampler) beside one other process spinning on a core, against the machine as the
  benchmark found it, in turn within each repetition; on the threads `run` would choose
  when each timing starts (`threads.choose`: the cores free) and on torch's default (every
  core, whose threads spin-wait on the one the other process holds).
- **Floor**: the copy bandwidth of a tensor far larger than the caches (bytes read +
  written, as STREAM counts a copy) turned into the time to read every weight a decode step
  touches plus the live K/V once; `floor / stage 1` is how close decode is to it.
"""


FLAGS = (SpeedConfig,)  # the dataclasses whose fields are its flags (those with a help string)


def section(cfg: SpeedConfig) -> str:
    """The report's section: ``speed``, or ``speed-cuda`` for a GPU run."""
    return "speed" + ("" if cfg.device == "cpu" else "-" + torch.device(cfg.device).type)
