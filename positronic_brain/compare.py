"""``compare RUN_A RUN_B [...]``: where captured runs of the same prompt part, and what each
one had forgotten where its loss jumped.

Read from each capture's stage-1 files: step t's token (the one it generated), its NLL under
that run's logits (-log p; teacher-forced runs of one text share their tokens, so their NLLs
compare token for token), the live cache the query read (uids) and the attention it paid.
A jump: a step where a run's NLL is at least ``jump`` nats above the lowest run's there.
For each jump, what was forgotten: the tokens the best run still held and the jumping run
no longer did, those the best run's query attended to most first (attention averaged over
layers and heads). Uids name the same token in every run while the streams agree (the same
prompt, the same tokens appended in the same order); after the first divergence they may
not, so jumps are reported up to it.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from . import page
from .capture import CaptureRun, manifest_params, reads_capture, row_attention
from .model import load_model
from .special_tokens import TokenPolicy
from .types import require

JUMP = 1.0  # nats above the best run at that step
TOP = 5  # forgotten tokens listed per jump


@dataclass
class Run:
    """One capture's steps: tokens, NLLs, the cache each query read and its attention."""

    dir: str
    label: str
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    uids: list[torch.Tensor] = field(default_factory=list)  # per step: (n,) the cache read
    token_ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    attention: list[torch.Tensor] = field(default_factory=list)  # per step: (n,) mean


def label(run: CaptureRun) -> str:
    p = manifest_params(run.manifest)
    what = [p.scorer.name, f"budget {p.budget}"] if p else ["?"]
    what += [f"repair {p.repair_name}"] if p and p.repair else []
    what += ["recall"] if p and p.recall else []
    parent = run.manifest.get("parent")
    what += [f"fork at step {parent['step']}"] if parent else []
    return f"{run.dir.name} ({', '.join(what)})"


@reads_capture
def load(path: str) -> Run:
    run = CaptureRun(path)
    r = Run(str(run.dir), label(run), list(run.manifest.get("prompt_ids", [])))
    for t in run.steps:
        f = run.stage(t, "s1_generate")
        out, view = f.outputs, f.inputs["view"]
        token = int(out["token_id"])
        r.tokens.append(token)
        r.nll.append(-float(out["logits"].float().log_softmax(-1)[token]))
        r.uids.append(view["uid"])
        r.token_ids.append(view["token_id"])
        r.positions.append(view["position"])
        r.attention.append(row_attention(view, out["attention"]))
    return r


def first_divergence(runs: list[Run]) -> int | None:
    """The first step at which the runs' tokens differ (None: never, over their common
    length; a shorter run parts where it ends)."""
    n = min(len(r.tokens) for r in runs)
    for i in range(n):
        if len({r.tokens[i] for r in runs}) > 1:
            return i + 1
    return n + 1 if any(len(r.tokens) != n for r in runs) else None


def forgotten(lost: Run, kept: Run, i: int, top: int, decode) -> list[dict]:
    """At step index ``i``: what ``kept`` read and ``lost`` no longer held, most attended
    first."""
    gone = ~torch.isin(kept.uids[i], lost.uids[i])
    idx = gone.nonzero()[:, 0]
    att = kept.attention[i][idx]
    order = idx[torch.argsort(att, descending=True, stable=True)][:top]
    return [{"uid": int(kept.uids[i][j]), "token_id": int(kept.token_ids[i][j]),
             "text": decode([int(kept.token_ids[i][j])]),
             "position": int(kept.positions[i][j]), "attention": float(kept.attention[i][j])}
            for j in order.tolist()]


def compare(paths: list[str], jump: float = JUMP, top: int = TOP, decode=None) -> dict:
    require(len(paths) >= 2, "compare needs at least two runs")
    require(jump >= 0 and top >= 1, f"--jump must be >= 0 and --top >= 1, got {jump}, {top}")
    runs = [load(p) for p in paths]
    require(all(r.prompt_ids == runs[0].prompt_ids for r in runs),
            "the runs are not of the same prompt (their prompt ids differ)")
    decode = decode or (lambda ids: str(ids[0]))
    parted = first_divergence(runs)
    n = min(len(r.tokens) for r in runs)
    steps, jumps = [], []
    for i in range(n):
        nll = [r.nll[i] for r in runs]
        steps.append({"step": i + 1, "tokens": [r.tokens[i] for r in runs], "nll": nll})
        if parted is not None and i + 1 > parted:
            continue  # uids no longer name the same tokens
        best = min(range(len(runs)), key=lambda k: nll[k])
        for k, r in enumerate(runs):
            if k != best and nll[k] - nll[best] >= jump:
                jumps.append({"step": i + 1, "run": k, "nll": nll[k], "other": best,
                              "other_nll": nll[best],
                              "forgotten": forgotten(r, runs[best], i, top, decode)})
    return {"runs": [{"dir": r.dir, "label": r.label, "steps": len(r.tokens),
                      "mean_nll": sum(r.nll) / max(1, len(r.nll))} for r in runs],
            "first_divergence": parted, "jump": jump, "steps": steps, "jumps": jumps}


@reads_capture
def main(paths: list[str], jump: float = JUMP, top: int = TOP, as_json: bool = False,
         last: int | None = None, html: str | None = None) -> int:
    require(len(paths) >= 2, "compare needs at least two runs")
    require(not (as_json and html), "--json and --html: one at a time")
    last = page.shown_steps(last, page.DEFAULT_STEPS if html is not None else 20)
    if html is not None:
        page.page_file(html)  # before the work
    manifest = CaptureRun(paths[0]).manifest
    policy = TokenPolicy(load_model(manifest["model"], manifest["dtype"]).tokenizer)
    decode = policy.decode
    res = compare(paths, jump, top, decode)
    if html is not None:
        captures = [CaptureRun(p) for p in paths]
        common = sorted(set.intersection(*(set(page.done_steps(c)) for c in captures)))
        require(common, "the runs share no captured step to draw side by side")
        common = common[-last:]
        runs = [page.run_data(c, policy.token_text, last, steps=common) for c in captures]
        written = page.write(html, "positronic-brain compare " + " vs ".join(
            Path(r["dir"]).name for r in runs), runs, res)
        print(f"wrote {written}", file=sys.stderr)
        return 0
    if as_json:
        json.dump(res, sys.stdout)
        sys.stdout.write("\n")
        return 0
    console = Console(highlight=False)
    runs = res["runs"]
    for k, r in enumerate(runs):
        console.print(f"run {k}: {r['label']}: {r['steps']} steps, mean NLL {r['mean_nll']:.3f}")
    parted = res["first_divergence"]
    console.print("the token streams never part" if parted is None
                  else f"the token streams part at step {parted}")
    t = Table(title=f"NLL per step (the last {last})", title_justify="left")
    t.add_column("step", justify="right")
    for k in range(len(runs)):
        t.add_column(f"run {k} token")
        t.add_column(f"run {k} NLL", justify="right")
    for s in res["steps"][-last:]:
        t.add_row(str(s["step"]), *[x for tok, v in zip(s["tokens"], s["nll"])
                                    for x in (repr(decode([tok])), f"{v:.3f}")])
    console.print(t)
    j = Table(title=f"Jumps (NLL >= {jump} nats above the best run), up to the parting",
              title_justify="left")
    for c in ("step", "run", "NLL", "best run", "its NLL", "forgotten (most attended first)"):
        j.add_column(c)
    for x in res["jumps"]:
        lost = ", ".join(f"{f['text']!r}@{f['position']} ({f['attention']:.3f})"
                         for f in x["forgotten"]) or "nothing: it held all the best run did"
        j.add_row(str(x["step"]), str(x["run"]), f"{x['nll']:.3f}", str(x["other"]),
                  f"{x['other_nll']:.3f}", lost)
    console.print(j)
    return 0


__all__ = ["Run", "compare", "first_divergence", "forgotten", "main"]
