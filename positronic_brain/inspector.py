"""``positronic-brain inspect PATH``: a captured run (or one capture file) for a person.

For a run folder: the manifest; per step the chosen token and its top alternatives with
the step's culls, merges and re-index; the context at a step as text coloured by
brightness, culled tokens struck through and merged tokens marked; cache length over
steps. With ``--html OUT``: the same as one self-contained page (``page``). For one file:
its keys with shapes, dtypes and small values.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from . import page
from .capture import CaptureRun, file_name, load_file, reads_capture
from .model import compile_mode, load_model
from .render import context_text, origin_legend, shown_brightness, sparkline, steps_table
from .special_tokens import TokenPolicy
from .types import SOURCES, require


def _tree(label: str, x, tree: Tree | None = None) -> Tree:
    tree = tree or Tree(label)
    if isinstance(x, dict):
        for k, v in x.items():
            if k == "__type__":
                continue
            if isinstance(v, (dict, list, tuple)) and v and not _scalars(v):
                _tree(str(k), v, tree.add(f"[bold]{k}[/]" + (f" ({v['__type__']})"
                                                            if isinstance(v, dict) and "__type__" in v
                                                            else "")))
            else:
                tree.add(f"[bold]{k}[/]: {_short(v)}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x[:20]):
            _tree(str(i), v, tree.add(f"[{i}]")) if isinstance(v, (dict, list, tuple)) \
                else tree.add(f"[{i}] {_short(v)}")
        if len(x) > 20:
            tree.add(f"... {len(x) - 20} more")
    return tree


def _scalars(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(e, (int, float, str)) for e in v)


def _short(v) -> str:
    if isinstance(v, torch.Tensor):
        s = f"tensor {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
        if v.numel() and v.numel() <= 8:
            s += f" {v.tolist()}"
        elif v.numel() and v.is_floating_point():
            s += f" min {float(v.min()):.4g} max {float(v.max()):.4g}"
        return s
    r = repr(v)
    return r if len(r) <= 100 else r[:97] + "..."


def inspect_file(path: Path, console: Console) -> None:
    data = load_file(path)
    head = {k: data[k] for k in ("stage", "step", "cache_len", "arena_version") if k in data}
    console.print(_tree(f"{path.name}  " + "  ".join(f"{k}={v}" for k, v in head.items()),
                        {k: data[k] for k in ("inputs", "outputs") if k in data}
                        if "inputs" in data else data))


def inspect_run(run: CaptureRun, console: Console, step: int | None = None, last: int = 30) -> None:
    manifest = run.manifest
    info = Table.grid(padding=(0, 2))
    for k in ("run_id", "model", "dtype", "level", "complete", "stop_reason", "last_step"):
        info.add_row(k, str(manifest.get(k)))
    info.add_row("compiled", compile_mode(manifest.get("compiled")) or "no")
    info.add_row("threads", str(manifest.get("threads", "not recorded")))
    if "batch" in manifest:
        b = manifest["batch"]
        info.add_row("batch", f"row {b['row']} of batch {b['run_id']} (stepped {b['size']} "
                     "rows at a time)")
    for k, v in (manifest.get("params") or {}).items():
        info.add_row(k, _short(v))
    for f in run.restores():
        origins = f.outputs["ledger_fields"]["origins"]
        info.add_row("restored", f"after step {f.data['step']}: {f.inputs['source']}, "
                     f"{f.data['cache_len']} cached tokens"
                     + (f" (rows from {', '.join(origins)})" if origins else ""))
    info.add_row("versions", ", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items()))
    console.print(Panel(info, title=f"capture {run.dir}"))

    policy = TokenPolicy(load_model(manifest["model"], manifest["dtype"]).tokenizer)
    done = [t for t in run.steps if run.has(file_name(t, "s4_apply"))]
    shown = [f for f in map(run.step, done[-last:]) if f is not None]
    rows = [{"step": f.step, "token_id": f.gen.token_id, "top": list(zip(f.gen.report.top_ids,
                                                                         f.gen.report.top_probs)),
             "cache_len": f.apply.data["cache_len"], "culled": f.patch.culled_uids,
             "merged": f.patch.merges, "reindexed": f.patch.reindex_to is not None}
            for f in shown]
    console.print(steps_table(rows, policy.token_text, title=f"steps ({len(done)} in all)"))
    lengths = [run.stage(t, "s4_apply").data["cache_len"] for t in done[-2000:]]
    if lengths:
        console.print(f"cache length over steps  {min(lengths)}..{max(lengths)}  "
                      f"{sparkline(lengths)}")

    t = step if step is not None else (done[-1] if done else None)
    require(t is None or t in done, f"step {t} is not in this capture")
    if t is None:
        return
    f = run.step(t)
    per, patch = f.tokens, f.patch
    view, out = per.view, per.scores  # the ledger before the step, its scores: a value a row
    bright = shown_brightness(out, view)
    bright = [None] * len(view["uid"]) if bright is None else [float(b) for b in bright]
    origins = [None] + list(view["origins"])
    ledger = [{"uid": int(u), "token_id": int(tok), "position": int(pos),
               "source": SOURCES[int(src)], "brightness": b, "origin": origins[int(o)]}
              for u, tok, pos, src, b, o in zip(view["uid"], view["token_id"], view["position"],
                                                 view["source"], bright, view["origin"])]
    merged = [u for r in patch.merges for u in r.uids]
    legend = Text.assemble(("bright", "rgb(255,225,60)"), " … ", ("dim", "rgb(70,70,90)"), "   ",
                           ("culled", "strike red"), "   ", ("merged pair", "bold underline cyan"))
    held = [] if per.held is None else [Text(
        f"per head: each token held by {int(per.held.min())}..{int(per.held.max())} of "
        f"{f.view['heads']['n'].numel()} (layer, KV head)s, {float(per.held.float().mean()):.1f} "
        "on average; brightness and scores are the mean of the heads holding it")]
    console.print(Panel(Group(context_text(ledger, policy.token_text, culled=patch.culled_uids,
                                           merged=merged,
                                           max_brightness=f.cache_params.scorer.get("max_brightness", 255.0)),
                              Text(""), legend, origin_legend(ledger), *held),
                        title=f"context at step {t} ({len(ledger)} live slots, "
                              f"{len(patch.culled_uids)} culled, {len(patch.merges)} merged)"))


def write_page(run: CaptureRun, out: str, last: int | None = None) -> Path:
    """``inspect RUN --html OUT``: the run's page (``page``)."""
    manifest = run.manifest
    policy = TokenPolicy(load_model(manifest["model"], manifest["dtype"]).tokenizer)
    data = page.run_data(run, policy.token_text, last)
    return page.write(out, f"positronic-brain run {run.dir.name}", [data])


@reads_capture
def main(path: str, step: int | None = None, last: int | None = None, out=None,
         html: str | None = None, row: int | None = None) -> int:
    console = Console(file=out, highlight=False)
    p = Path(path)
    require(p.exists(), f"{p}: no such file or folder")
    last = page.shown_steps(last, page.DEFAULT_STEPS if html is not None else 30)
    if html is not None:
        require(p.is_dir(), f"{p}: --html draws a capture run folder, not one file")
        require(step is None, "--step: the page has a slider over every step (or #step=T)")
        page.page_file(html)  # before the work
        written = write_page(CaptureRun(p, row), html, last)
        print(f"wrote {written}", file=sys.stderr)
        return 0
    require(row is None or p.is_dir(), f"--row {row}: {p} is one capture file")
    with console.capture() as shown:  # printed only once all of it is read and checked
        if p.is_file():
            inspect_file(p, console)
        else:
            inspect_run(CaptureRun(p, row), console, step, last)
    console.file.write(shown.get())
    return 0
