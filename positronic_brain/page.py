"""One self-contained HTML page of captured runs: ``inspect RUN --html`` and ``compare RUN_A
RUN_B --html``.

The page holds its data as JSON in a ``<script type="application/json">`` tag and draws it
with plain JS and inline SVG (``page.html`` beside this module): nothing is fetched, nothing
serves it. Per step ``t`` it shows the cache the step's query read (the ledger before the
step, in text order), coloured by the brightness stage 2 gave it (grey for a scorer that
keeps none), the step's culls, folds and
merges, the tokens recalled at the step before, the cache length after each step and the NLL
of each step's token; hovering a token shows its ledger row (with its origin file, if it came
from one), the attention the step's query paid it (mean over layers and heads), stage 2's
score and each of the scorer's own columns by name (``scorer_columns``); in a per-head
cache, how many (layer, KV head)s hold it, its score and columns their mean over those
(``capture.token_step``). A slider
(or ``#step=T`` in the address) picks the step. Two runs (``compare``) are drawn side by side
at the same step, the tokens one run held and the other did not outlined, with the NLL of
both and the jumps ``compare`` found.
"""
from __future__ import annotations

import html
import json
import math
from importlib import resources
from pathlib import Path

import torch

from . import options
from .capture import LEDGER_COLUMNS, RESTORE, CaptureRun, file_name, manifest_params
from .plain import atomic_write, output_file
from .render import shown_brightness
from .types import SOURCES, require

DEFAULT_STEPS = 400  # steps a page holds unless told (the last ones)


def _r(x: float, digits: int) -> float | str:
    """``x`` rounded; "inf" or "-inf" (what JSON cannot hold) for a score that is."""
    x = float(x)
    return round(x, digits) if math.isfinite(x) else str(x)


def done_steps(run: CaptureRun) -> list[int]:
    """The steps whose four stage files were all captured."""
    return [t for t in run.steps if run.has(file_name(t, "s4_apply"))]


def shown_steps(last: int | None, default: int) -> int:
    """``--last``: how many of the last steps a table or page shows, ``default`` unless
    given; at least one."""
    last = default if last is None else last
    require(last >= 1, f"--last must be >= 1, got {last}")
    return last


def run_data(run: CaptureRun, token_text, last: int | None = None,
             steps: list[int] | None = None) -> dict:
    """A captured run as the page draws it: per step (``steps``, or the last ``last``,
    default ``DEFAULT_STEPS``) the live ledger the step's query read in position order, the
    attention it paid each token, the step's edits, its token and NLL, the cache length
    after it; ``vocab`` maps the token ids shown to their text."""
    last = shown_steps(last, DEFAULT_STEPS)
    done = done_steps(run)
    require(done, f"{run.dir}: no complete step captured: nothing to draw")
    shown = done[-last:] if steps is None else [t for t in done if t in set(steps)]
    require(shown, f"{run.dir}: none of the steps to draw was captured")
    # A row's changed step (not kept in a step's files): its born step, or the step it was
    # last recalled at (stage 4 rewrites the row then), or what a restored session's row said;
    # those before the shown steps count too.
    changed_at: dict[int, int] = {}
    _restored(run, 0, changed_at)
    prev_recalled: list[int] = []  # the uids the step before recalled: live now
    for t in (t for t in done if t < shown[0]):
        prev_recalled = _after(run, t, run.stage(t, "s4_apply").out, changed_at)
    vocab: dict[int, str] = {}
    steps, heads = [], None
    for t in shown:
        f = run.step(t)
        gen, patch, per = f.gen, f.patch, f.tokens
        view, scores, att = per.view, per.scores, per.attention  # a value per ledger row
        bright = shown_brightness(scores, view)
        columns = scorer_columns(scores, view)
        if per.held is not None:
            heads = f.view["heads"]["n"].numel()
        order = sorted(range(len(view["uid"])), key=lambda j: int(view["position"][j]))
        col = lambda name: [view[name][j] for j in order]  # noqa: E731
        for tok in col("token_id") + [gen.token_id]:
            vocab.setdefault(int(tok), token_text(int(tok)))
        folded = {fo.uid for fo in patch.folds}
        logp = gen.logits.float().log_softmax(-1)[gen.token_id]
        origins = (None,) + tuple(view["origins"])
        steps.append({
            "step": t, "token": gen.token_id, "nll": _r(-logp, 4),
            "cache_len": int(f.apply.data["cache_len"]),
            "uid": [int(u) for u in col("uid")], "token_id": [int(x) for x in col("token_id")],
            "position": [int(x) for x in col("position")],
            "source": [SOURCES[int(x)] for x in col("source")],
            "origin": [origins[int(x)] for x in col("origin")],
            "born": [int(x) for x in col("born_step")],
            "changed": [max(int(b), changed_at.get(int(u), -1))
                        for u, b in zip(col("uid"), col("born_step"))],
            "brightness": [None if bright is None else _r(bright[j], 2) for j in order],
            "attention": [_r(att[j], 5) for j in order],
            "score": [_r(scores.scores[j], 4) for j in order],
            "held": None if per.held is None else [int(per.held[j]) for j in order],
            "columns": {c: [_r(x[j], 4) for j in order] for c, x in columns.items()},
            "culled": [u for u in patch.culled_uids if u not in folded],
            "folded": sorted(folded),
            "merged": [[m.uids[0], m.uids[1], m.token_id, new]
                       for m, new in zip(patch.merges, patch.merged_uids)],
            "recalled": [s.cold_uid for s in patch.swaps],
            "recalled_before": prev_recalled,
            "reindexed": patch.reindex_to is not None,
        })
        prev_recalled = _after(run, t, patch, changed_at)
    m = run.manifest
    # what the run was asked for (a fork's own options), else what its last step ran with
    params = manifest_params(m) or run.step(shown[-1]).cache_params
    return {"dir": str(run.dir), "run_id": m.get("run_id"), "model": m.get("model"),
            "dtype": m.get("dtype"), "params": {k: v for k, v in options.flat(params).items()
                                                if isinstance(v, (int, float, str, bool))
                                                or v is None},
            "parent": m.get("parent"), "steps_in_run": len(done), "heads": heads,
            "max_brightness": float(params.scorer.get("max_brightness", 255.0)),
            "vocab": {str(k): v for k, v in vocab.items()}, "steps": steps}


def scorer_columns(scores, view: dict) -> dict:
    """The scorer's own columns at a step, name -> (n,): as stage 2 gave them (``scores``, a
    captured ``ScoreOut``), else as the captured view held them (float32, not the ledger's
    own)."""
    held = {c: t for c, t in view.items() if c not in LEDGER_COLUMNS
            and isinstance(t, torch.Tensor) and t.dtype == torch.float32}
    return {**held, **(scores.columns or {})}


def _after(run: CaptureRun, t: int, patch, changed_at: dict[int, int]) -> list[int]:
    """After step ``t`` (its ``patch``): the uids it recalled, changed at its step, or none
    if a session was restored next."""
    recalled = [sw.cold_uid for sw in patch.swaps]
    changed_at.update((u, patch.step) for u in recalled)
    return [] if _restored(run, t, changed_at) else recalled


def _restored(run: CaptureRun, t: int, changed_at: dict[int, int]) -> bool:
    """Whether a session was restored after step ``t``; if so, its rows' changed steps
    replace ``changed_at``."""
    f = run.at(t, RESTORE)
    if f is not None:
        cols = f.outputs["columns"]
        changed_at.clear()
        changed_at.update(zip(cols["uid"].tolist(), cols["changed_step"].tolist()))
    return f is not None


def page_file(out: str | Path) -> Path:
    """``out`` as the page's file, checked before the work that fills it: it ends in .html,
    in a folder that exists and takes a new file (``plain.output_file``)."""
    out = Path(out)
    require(out.suffix.lower() in (".html", ".htm"), f"{out}: the page's file must end in .html")
    require(out.parent.is_dir(), f"{out.parent}: no such folder for the page")
    return output_file(out)


def write(out: str | Path, title: str, runs: list[dict], comparison: dict | None = None) -> Path:
    """The page for ``runs`` (one: inspect; several: compare, with ``comparison`` from
    ``compare.compare``) written to ``out`` (``page_file``)."""
    out = page_file(out)
    data = {"title": title, "runs": runs, "compare": comparison}
    # No "<", ">" or "&" inside the <script> element, whatever the token texts hold ("</script>",
    # "<!--" before "<script" would end or hide it): JSON writes them as \u escapes.
    blob = json.dumps(data, separators=(",", ":"))
    for c in "<>&":
        blob = blob.replace(c, f"\\u{ord(c):04x}")
    head, tail = resources.files(__package__).joinpath("page.html").read_text(
        encoding="utf-8").split("{{DATA}}")
    text = head.replace("{{TITLE}}", html.escape(title)) + blob + tail
    atomic_write(out, text.encode("utf-8"))
    return out


__all__ = ["DEFAULT_STEPS", "done_steps", "page_file", "run_data", "write"]
