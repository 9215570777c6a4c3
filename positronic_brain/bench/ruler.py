"""``positronic-brain bench ruler``: RULER's tasks answered through the loop under a budget.

RULER's synthetic tasks (``ruler_tasks``: needles of several kinds, variable tracking, word
extraction; QA from a file a user gives), generated here offline and seeded, with the
model's own tokenizer, are answered greedily through the real loop (stages 1-4). Each
sample's context is compressed to the cell's budget under one of three protocols, then the
question and the answer go on uncompressed:

- ``compress``: the context is prefilled whole and compressed once, by the first step's
  culls (kvpress's protocol; with prefill scores, the scorer also sees the context's own
  attention);
- ``online``: the context streams through the budget one token a step, as a reader with a
  fixed cache reads it (decode-time eviction; with recall, culled tokens can come back);
- ``chunked``: online in chunks of ``chunk`` tokens: one stage-0 extend, then the culls.

A cell's budget is a compression ratio of the context (the fraction of its tokens removed;
the budget keeps the rest, and never fewer than the protected tokens allow); the rows give
both and the fraction really kept. Every sample is also answered with the full cache: the
model's own ceiling. A sample is primed once per protocol that can share the prime, and
each cell answers from its own deep copy. ``--capture-misses DIR`` captures every wrong
answer, so ``inspect --html`` shows when the needle was culled and whether it came back.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import options
from ..capture import CaptureTape, manifest
from ..loop import Session
from ..model import DTYPES, Model, load_model
from ..scorers import CULLING, culling, make_scorer, reads_total, takes_prefill_scores
from ..special_tokens import TokenPolicy
from ..types import CacheParams, SamplerParams, Segment, require
from ..types import option
from . import common, flags, ruler_tasks
from .common import Table, fmt

PROTOCOLS = ("compress", "online", "chunked")
DEFAULT_POLICY = CacheParams().scorer.name
TARGETS = ((0.75, 0.90), (0.875, 0.75))  # (compression ratio, score / the full cache's)
CEILING = 0.5  # the targets hold where the full cache scores at least this


def _names(text: str, known, what: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in known]
    require(names and not bad, f"--{what}: unknown {bad[:1] or 'empty list'}; expected some "
            f"of {', '.join(known)}")
    return names


def _ratios(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(t) for t in text.split(","))
    except ValueError:
        out = ()
    require(out and all(0 <= r < 1 for r in out),
            f"--ratios takes comma-separated fractions in [0, 1), got {text!r}")
    return out


def _policies(text: str) -> tuple[str, ...]:
    """``--policies``: scorers (``none``: the full cache only)."""
    return tuple(p for p in flags.scorers(text) if p != "none")


@dataclass(frozen=True)
class RulerConfig:
    """What to measure: every task at every length, ``samples`` samples each, answered with
    the full cache and in every cell (protocol x policy x ratio, with recall too if
    ``recall``)."""

    model: str = "smollm2"
    dtype: str = option("float32", "the model's precision", choices=tuple(DTYPES))
    device: str = "cpu"
    quick: bool = False
    tasks: tuple[str, ...] = option(
        ruler_tasks.SYNTHETIC, "comma-separated RULER tasks (qa_1 and qa_2 need --qa-file)",
        quick=("niah_single_1", "niah_multikey_1", "vt", "fwe"),
        read=lambda t: _names(t, ruler_tasks.TASKS, "tasks"))
    lengths: tuple[int, ...] = option((1024, 2048, 4096, 8192), "comma-separated input "
                                      "lengths in the model's tokens, answer included",
                                      quick=(1024,))
    samples: int = option(10, "samples per task and length", quick=2)
    policies: tuple[str, ...] = option(("brightness", "h2o", "tova", "streaming"),
                                       "comma-separated scorers (none: the full cache only)",
                                       read=_policies)
    ratios: tuple[float, ...] = option((0.5, 0.75, 0.875), "compression ratios: the "
                                       "fraction of the context's tokens removed",
                                       quick=(0.75,), read=_ratios)
    protocols: tuple[str, ...] = option(
        ("compress", "online"), "comma-separated: compress, online, chunked",
        quick=("compress",), read=lambda t: _names(t, PROTOCOLS, "protocols"))
    chunk: int = option(128, "chunked: the context's tokens per extend")
    new_tokens: int | None = option(None, "the most new tokens of an answer (default: the "
                                    "task's own, as RULER's)")
    recall: bool = option(False, "each cell also with recall (as run --recall): true or false",
                          read=lambda t: options.parse(t, bool, "--recall"), metavar="BOOL")
    params: tuple[tuple[str, Any], ...] = option(
        (), "cache parameters of every cell, e.g. sinks=4,recent=16", metavar="K=V,...",
        read=flags.cache_options, repeat="param")
    essay: str | None = option(None, "a UTF-8 text for the essay haystacks (default: "
                               "Python's help topics)", metavar="FILE")
    qa_file: str | None = option(None, "a SQuAD- or HotpotQA-format JSON file: qa_1/qa_2's "
                                 "questions", metavar="FILE")
    seed: int = option(0, "the samples' seed")
    write_data: str | None = option(None, "write the samples as JSONL into this folder (one "
                                    "file per task and length) and measure nothing",
                                    metavar="DIR")
    capture_misses: str | None = option(None, "capture every wrong answer into this folder "
                                        "(inspect --html shows it)", metavar="DIR")

    def __post_init__(self) -> None:
        require(self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        require(self.chunk >= 1, f"chunk must be >= 1, got {self.chunk}")
        require(self.new_tokens is None or self.new_tokens >= 1,
                f"new tokens must be >= 1, got {self.new_tokens}")
        require(all(n >= 64 for n in self.lengths), f"lengths must be >= 64, got {self.lengths}")
        bad = [p for p in self.policies if not culling(p)]
        require(not bad, f"unknown or non-culling policies {bad}; expected some of "
                f"{', '.join(CULLING)} (or none: the full cache only)")
        require(self.qa_file or not {"qa_1", "qa_2"} & set(self.tasks),
                "qa_1 and qa_2 need --qa-file (SQuAD- or HotpotQA-format JSON)")
        options.check_shared(dict(self.params), self.policies or CULLING)
        for name in ("tasks", "lengths", "policies", "ratios"):
            values = getattr(self, name)
            require(len(set(values)) == len(values), f"--{name} repeats a value: {values}")
        for p in self.policies:  # fail early: unknown fields, options of pieces that are off
            for recall in (False, True)[:1 + self.recall]:
                c = self.cache(p, 1 << 30, recall)  # any budget: the cells' own come later
                require(c.prune == "tokens" and "user" not in c.pinned, "--params: a RULER "
                        "prompt is one user turn: prune turns and pinned user tokens do not "
                        "apply")

    @classmethod
    def preset(cls, quick: bool, **kw) -> "RulerConfig":
        """The config, with each field's ``quick`` value (its metadata) for ``--quick``."""
        return flags.preset(cls, quick, **kw)

    def cache(self, policy: str, budget: int | None, recall: bool) -> CacheParams:
        given = {**dict(self.params), "policy": policy if budget else "none", "budget": budget}
        return options.cache_params(given | ({"recall": True} if recall and budget else {}),
                                    strict=False)


@dataclass(frozen=True)
class Cell:
    """One way to answer: ``policy`` at compression ``ratio`` under ``protocol`` (and
    ``recall``)."""

    protocol: str
    policy: str
    ratio: float
    recall: bool

    @property
    def method(self) -> str:
        return self.policy + ("+recall" if self.recall else "")


def cells(cfg: RulerConfig) -> list[Cell]:
    return [Cell(pr, p, r, rc) for pr in cfg.protocols for rc in (False, True)[:1 + cfg.recall]
            for p in cfg.policies for r in cfg.ratios]


# --- one sample ---------------------------------------------------------------------------

@dataclass
class Prompt:
    """A sample's input as ids: the context's ``n_context`` first, then the question and
    the answer prefix."""

    ids: list[int]
    n_context: int
    new_tokens: int

    @classmethod
    def of(cls, policy: TokenPolicy, sample, new_tokens: int | None = None) -> "Prompt":
        bos = [policy.bos_id] if policy.add_bos else []  # as the family wants
        ids, ctx = bos + policy.encode(sample.input()), bos + policy.encode(sample.context)
        n = next((i for i, (a, b) in enumerate(zip(ids, ctx)) if a != b), min(len(ids), len(ctx)))
        require(1 < n < len(ids), f"sample {sample.task}/{sample.index}: no context before the "
                "question")
        return cls(ids, n, new_tokens or ruler_tasks.TASKS[sample.task].tokens_to_generate)

    def budget(self, ratio: float, params: CacheParams) -> int:
        """The cell's budget: the context's tokens ``ratio`` leaves, but at least the
        protected ones and two more."""
        return max(round(self.n_context * (1 - ratio)), params.sinks + params.recent + 2)

    def segment(self, lo: int, hi: int) -> list[Segment]:
        return [Segment(tuple(self.ids[lo:hi]), "user")]


def _answer(session: Session, prompt: Prompt) -> list[int]:
    """After the context phase (pending: the question's first token), the rest of the
    question and the answer prefix uncompressed (one stage-0 extend), then up to the task's
    new tokens, greedy, with no cull: from here the budget (if any) holds them all."""
    p = session.cache_params
    if p.budget is not None:  # and recall's swaps spare them: they are the recent tokens
        rest = len(prompt.ids) - prompt.n_context + prompt.new_tokens + 1
        recent = max(p.recent, rest)
        session.cache_params = replace(p, recent=recent, budget=max(
            p.budget, session.state.arena.n + rest, p.sinks + recent + 1))
    if len(prompt.ids) > prompt.n_context + 1:
        session.extend(prompt.segment(prompt.n_context + 1, len(prompt.ids)))
    ids = [r.token_id for r in session.stream(prompt.new_tokens)]
    session.state.check_valid()
    return ids


def _stream_context(session: Session, prompt: Prompt, chunk: int) -> None:
    """Online (``chunk`` 1) or chunked: the context after the prime goes through the budget,
    up to the question's first token (then pending), ``chunk`` tokens an extend."""
    i, end = session.state.next_position + 1, prompt.n_context + 1
    while i < end:
        j = min(i + chunk, end)
        if j - i > 1:
            session.extend(prompt.segment(i, j - 1))
        session.step(force=prompt.ids[j - 1])
        i = j


def cell_cache(cfg: RulerConfig, cell: Cell, prompt: Prompt) -> CacheParams:
    """The cache parameters of ``cell`` for ``prompt``: its budget from its ratio."""
    cache = cfg.cache(cell.policy, prompt.n_context, cell.recall)
    return replace(cache, budget=prompt.budget(cell.ratio, cache))


def answer_cell(model: Model, policy: TokenPolicy, cell: Cell, cfg: RulerConfig,
                prompt: Prompt, primed=None, tape=None) -> tuple[list[int], int, int, str]:
    """One cell's answer to one sample: (answer ids, budget, tokens kept at the question,
    why the answer stopped).
    ``primed``: (the state primed with the whole context, its prompt statistics), which a
    ``compress`` cell answers from (a deep copy)."""
    cache = cell_cache(cfg, cell, prompt)
    budget = cache.budget
    sampler = SamplerParams(greedy=True)
    room = len(prompt.ids) - prompt.n_context + prompt.new_tokens + 2
    kw = {"tape": tape} if tape is not None else {}
    if cell.protocol == "compress":
        if primed is not None and tape is None:
            session = Session(model, policy, sampler, cache, state=copy.deepcopy(primed[0]))
            if primed[1] is not None:
                session.seed(primed[1])  # the cell's scorer columns, as its own prime's
        else:
            session = Session(model, policy, sampler, cache, **kw)
            session.prime(prompt.segment(0, prompt.n_context), prompt.n_context + room)
        session.step(force=prompt.ids[prompt.n_context])  # the one compression
    else:
        session = Session(model, policy, sampler, cache, **kw)
        session.prime(prompt.segment(0, min(budget, prompt.n_context)),
                      budget + (cfg.chunk if cell.protocol == "chunked" else 1) + room)
        _stream_context(session, prompt, 1 if cell.protocol == "online" else cfg.chunk)
    kept = session.state.arena.n
    return _answer(session, prompt), budget, kept, session.stop_reason


def run_sample(model: Model, policy: TokenPolicy, cfg: RulerConfig, sample,
               grid: list[Cell], tick=None) -> dict:
    """One sample answered with the full cache and in every cell: its row (the sample's
    facts, each answer, its score, the cell's budget and kept tokens, seconds)."""
    prompt = Prompt.of(policy, sample, cfg.new_tokens)
    t0 = time.perf_counter()
    full = Session(model, policy, SamplerParams(greedy=True), cfg.cache("none", None, False))
    caches = [cell_cache(cfg, c, prompt) for c in grid if c.protocol == "compress"]
    seeded = [s for s, c in ((make_scorer(c), c) for c in caches)
              if takes_prefill_scores(s, c, prompt.n_context)]
    stats = full.prime(prompt.segment(0, prompt.n_context), len(prompt.ids) + prompt.new_tokens + 2,
                       stats=bool(seeded), total=any(reads_total(s) for s in seeded))
    primed = (copy.deepcopy(full.state), stats) if caches else None
    full.step(force=prompt.ids[prompt.n_context])
    answers, budgets, kept = [_answer(full, prompt)], [None], [None]
    seconds = [time.perf_counter() - t0]
    if tick:
        tick()
    for cell in grid:
        t1 = time.perf_counter()
        ids, b, k, _ = answer_cell(model, policy, cell, cfg, prompt, primed)
        answers.append(ids)
        budgets.append(b)
        kept.append(k)
        seconds.append(time.perf_counter() - t1)
        if tick:
            tick()
    texts = [policy.decode(a) for a in answers]
    scores = [ruler_tasks.score(sample.task, t, sample.answers) for t in texts]
    if cfg.capture_misses:
        _capture_misses(model, policy, cfg, sample, prompt, grid, scores)
    return {"task": sample.task, "length": sample.length, "index": sample.index,
            "n_tokens": sample.n_tokens, "n_context": prompt.n_context,
            "depth": list(sample.depth), "answers": list(sample.answers), "outputs": texts,
            "scores": scores, "budgets": budgets, "kept": kept, "seconds": seconds}


def _capture_misses(model: Model, policy: TokenPolicy, cfg: RulerConfig, sample, prompt: Prompt,
                    grid: list[Cell], scores: list[float]) -> None:
    """Each cell that scored below 1 answers again on a tape: a capture that replays, in
    ``capture_misses``/TASK-LENGTH-INDEX-PROTOCOL-METHOD-RATIO."""
    for cell, s in zip(grid, scores[1:]):
        if s >= 1:
            continue
        name = (f"{sample.task}-{sample.length}-{sample.index}-{cell.protocol}-{cell.method}-"
                f"{cell.ratio}").replace("/", "_").replace(":", "_")
        cache = cell_cache(cfg, cell, prompt)
        tape = CaptureTape(Path(cfg.capture_misses) / name, manifest(
            model, SamplerParams(greedy=True), cache, prompt.ids, "bench ruler",
            {"sample": dataclasses.asdict(sample), "cell": dataclasses.asdict(cell)}))
        try:
            stop = answer_cell(model, policy, cell, cfg, prompt, tape=tape)[3]
        except BaseException as e:
            tape.close(type(e).__name__, complete=False)
            raise
        tape.close(stop)


# --- the grid -----------------------------------------------------------------------------

def _run_sample(sample) -> dict:
    w = common.WORKER
    return run_sample(w["model"], w["policy"], w["cfg"], sample, w["grid"])


def samples(cfg: RulerConfig, policy: TokenPolicy) -> list:
    return [s for task in cfg.tasks for n in cfg.lengths
            for s in ruler_tasks.generate(policy, task, n, cfg.samples, cfg.seed, cfg.essay,
                                          cfg.qa_file)]


def run_samples(cfg: RulerConfig, model: Model, policy: TokenPolicy, todo: list,
                workers: int = 1) -> list[dict]:
    """Every sample's row, in ``todo``'s order, here or in ``workers`` single-thread
    processes (a row does not depend on where it ran)."""
    grid = cells(cfg)
    return common.grid_workers(
        f"ruler: {len(todo)} samples x {1 + len(grid)} cells", todo, 1 + len(grid),
        lambda s, tick: run_sample(model, policy, cfg, s, grid, tick), _run_sample, cfg, cells,
        workers)


def write_data(cfg: RulerConfig, policy: TokenPolicy, todo: list) -> list[str]:
    """The samples as JSONL, one file per task and length, in ``write_data``."""
    out = common.prepare_out_dir(cfg.write_data)
    files = []
    for task in cfg.tasks:
        for n in cfg.lengths:
            path = out / f"{task}-{n}.jsonl"
            ruler_tasks.write_jsonl([s for s in todo if s.task == task and s.length == n], path)
            files.append(str(path))
    return files


def run(cfg: RulerConfig, command: str, workers: int = 1) -> dict:
    """Every measurement, as one JSON-ready dict."""
    t0 = time.perf_counter()
    info = common.machine()
    model = load_model(cfg.model, cfg.dtype, cfg.device)
    require(max(cfg.lengths) <= model.spec.max_positions, f"lengths {cfg.lengths}: the "
            f"model has {model.spec.max_positions} positions")
    policy = TokenPolicy(model.tokenizer)
    todo = samples(cfg, policy)
    res = {"benchmark": "ruler", "command": command, "model": cfg.model, "dtype": cfg.dtype,
           "quick": cfg.quick, "machine": info, "max_positions": model.spec.max_positions,
           "config": {**dataclasses.asdict(cfg), "base": options.settings(dict(cfg.params))}}
    if cfg.write_data:
        res.update(data=write_data(cfg, policy, todo), samples=[], rows=[], targets=[])
    else:
        res["workers"] = min(workers, len(todo))
        res["samples"] = run_samples(cfg, model, policy, todo, res["workers"])
        res["rows"] = rows(res, cells(cfg))
        res["targets"] = targets(res)
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["elapsed_s"] = time.perf_counter() - t0
    return res


# --- analysis -----------------------------------------------------------------------------

def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def rows(res: dict, grid: list[Cell]) -> list[dict]:
    """One row per (task, length, method, ratio, protocol), kvpress's leaderboard columns
    (dataset, data_dir, model, method, compression_ratio, score: 0-100) and ours."""
    out = []
    for task in res["config"]["tasks"]:
        for n in res["config"]["lengths"]:
            ss = [s for s in res["samples"] if s["task"] == task and s["length"] == n]
            full = 100 * _mean(s["scores"][0] for s in ss)
            out.append(_row(res, task, n, "full cache", None, None, ss, 0, full))
            for i, c in enumerate(grid, 1):
                out.append(_row(res, task, n, c.method, c.ratio, c.protocol, ss, i, full))
    return out


def _row(res: dict, task: str, n: int, method: str, ratio, protocol, ss: list[dict], i: int,
         full: float) -> dict:
    score = 100 * _mean(s["scores"][i] for s in ss)
    return {"dataset": "ruler", "data_dir": str(n), "model": res["model"], "method": method,
            "compression_ratio": ratio or 0.0, "score": score, "task": task,
            "protocol": protocol, "budget": _mean(s["budgets"][i] for s in ss),
            "recall": method.endswith("+recall"), "kept_fraction": _mean(
                s["kept"][i] / s["n_context"] for s in ss if s["kept"][i] is not None),
            "full_cache_score": full, "score_vs_full": score / full if full else None,
            "seconds": sum(s["seconds"][i] for s in ss), "samples": len(ss)}


def average(res: dict, protocol: str | None, method: str, ratio) -> float | None:
    """A method's mean score over the tasks and lengths at ``ratio`` under ``protocol``."""
    return _mean(r["score"] for r in res["rows"] if r["protocol"] == protocol
                 and r["method"] == method and r["compression_ratio"] == ratio)


def targets(res: dict) -> list[dict]:
    """Where the full cache scores >= 50%: the default policy keeps >= 90% of its score at
    ratio 0.75 and >= 75% at 0.875, per protocol; and it is at or above every other
    built-in's average at each ratio, per protocol (its own recall variant aside)."""
    out, cfg = [], res["config"]
    for protocol in cfg["protocols"]:
        for ratio, want in TARGETS:
            rs = [r for r in res["rows"] if r["protocol"] == protocol and
                  r["method"] == DEFAULT_POLICY and r["compression_ratio"] == ratio
                  and r["full_cache_score"] >= 100 * CEILING]
            if rs:
                worst = min(rs, key=lambda r: r["score_vs_full"])
                out.append({"what": f"{protocol}, ratio {ratio}: {DEFAULT_POLICY} / the full "
                            f"cache, the worst of {len(rs)} task-lengths ({worst['task']}, "
                            f"{worst['data_dir']})", "value": worst["score_vs_full"],
                            "target": f">= {want:.2f}", "met": worst["score_vs_full"] >= want})
        for ratio in cfg["ratios"]:
            mine = average(res, protocol, DEFAULT_POLICY, ratio)
            others = {m: average(res, protocol, m, ratio) for m in dict.fromkeys(
                r["method"] for r in res["rows"] if r["protocol"] == protocol)
                if m.split("+")[0] != DEFAULT_POLICY}
            if mine is not None and others:
                best = max(others, key=lambda m: others[m])
                out.append({"what": f"{protocol}, ratio {ratio}: {DEFAULT_POLICY}'s average "
                            f"- the best other's ({best})", "value": mine - others[best],
                            "target": ">= 0", "met": mine >= others[best]})
    return out


# --- output -------------------------------------------------------------------------------

def tables(res: dict) -> list[Table]:
    cfg = res["config"]
    if cfg.get("write_data"):
        return [Table("Samples written (JSONL)", ("file",), tuple((f,) for f in res["data"]))]
    target = Table(
        "Targets (reported, not asserted)", ("what", "value", "target", "met"),
        tuple((t["what"], fmt(t["value"], 3), t["target"], "yes" if t["met"] else "NO")
              for t in res["targets"]))
    full = [r for r in res["rows"] if r["protocol"] is None]
    ceiling = Table(
        "The full cache's score per task and length (the ceiling)",
        ("task", *map(str, cfg["lengths"])),
        tuple((t, *(fmt(next(r["score"] for r in full if r["task"] == t
                             and r["data_dir"] == str(n)), 0) for n in cfg["lengths"]))
              for t in cfg["tasks"]))
    out = [target, ceiling]
    methods = list(dict.fromkeys(r["method"] for r in res["rows"] if r["protocol"]))
    for protocol in cfg["protocols"]:
        out.append(Table(
            f"{protocol}: mean score over tasks and lengths by compression ratio "
            f"(full cache {fmt(_mean(r['score'] for r in full), 1)})",
            ("method", *(f"ratio {r}" for r in cfg["ratios"])),
            tuple((m, *(fmt(average(res, protocol, m, r), 1) for r in cfg["ratios"]))
                  for m in methods)))
    kept = [r for r in res["rows"] if r["protocol"]]
    out.append(Table(
        "Budgets: tokens kept of the context (mean), by ratio",
        ("ratio", "budget (mean)", "fraction kept at the question (mean)"),
        tuple((str(ratio), fmt(_mean(r["budget"] for r in kept if r["compression_ratio"] == ratio), 0),
               fmt(_mean(r["kept_fraction"] for r in kept if r["compression_ratio"] == ratio), 3))
              for ratio in cfg["ratios"])))
    return out


def plots(res: dict, out: Path) -> list[str]:
    """A heatmap of task x method at each ratio and protocol (matplotlib)."""
    if not res["rows"] or not [r for r in res["rows"] if r["protocol"]]:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, names = res["config"], []
    methods = list(dict.fromkeys(r["method"] for r in res["rows"] if r["protocol"]))
    for protocol in cfg["protocols"]:
        for ratio in cfg["ratios"]:
            grid = [[_mean(r["score"] for r in res["rows"] if r["task"] == t and r["method"] == m
                           and r["protocol"] == protocol and r["compression_ratio"] == ratio)
                     for m in methods] for t in cfg["tasks"]]
            fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(methods), 1 + 0.4 * len(cfg["tasks"])))
            ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
            ax.set_yticks(range(len(cfg["tasks"])), cfg["tasks"])
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, fmt(v, 0), ha="center", va="center", color="white")
            ax.set_title(f"RULER score, {protocol}, ratio {ratio}, {res['model']}")
            fig.tight_layout()
            name = f"ruler_{protocol}_{ratio}.png"
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            names.append(name)
    return names


def report_md(res: dict, images: list[str], image_dir: str, level: int = 1) -> str:
    """The markdown report; ``level`` is the heading level of its title."""
    h, cfg = "#" * level, res["config"]
    lines = [f"{h} RULER benchmark", "", common.regenerate(res, quick_version=False), "",
             f"{common.model_facts(res)}; tasks {', '.join(cfg['tasks'])}; lengths "
             f"{', '.join(map(str, cfg['lengths']))} tokens; {cfg['samples']} samples each "
             f"(seed {cfg['seed']}); {common.machine_facts(res['machine'], res.get('workers') == 1)}"
             + (f"; samples in {res['workers']} single-thread processes"
                if res.get("workers", 1) > 1 else "") + ".", ""]
    for tb in tables(res):
        lines += [f"{h}# {tb.title}", "", tb.markdown(), ""]
    if images:
        lines += [f"{h}# Plots", ""] + [f"![{n}]({image_dir}/{n})" for n in images] + [""]
    lines += [f"{h}# Method", "", __doc__.split("\n\n", 1)[1]]
    return "\n".join(lines) + "\n"


# --- the command line -----------------------------------------------------------------------

FLAGS = (RulerConfig, flags.Workers)  # the dataclasses whose fields are its flags
