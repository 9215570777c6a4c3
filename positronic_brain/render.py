"""Terminal rendering (rich) of the loop's plain data: the context coloured by brightness,
culls struck through, repairs marked; per-step tables; cache length over steps.

Used by ``inspect`` and the live views of ``run``/``chat``. It takes token texts from a
callable (the special-token policy's ``token_text``) and never touches a tokenizer.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"
SOURCE_MARK = {"system": "bold", "user": "", "assistant": "italic", "tool": "underline"}
# A background per origin file (a composed or transferred session's rows), in table order.
ORIGIN_BG = ("on rgb(30,45,90)", "on rgb(30,75,45)", "on rgb(85,35,35)", "on rgb(75,60,20)",
             "on rgb(60,30,80)", "on rgb(20,70,75)")


def brightness_style(b: float | None, max_b: float) -> str:
    """Dim grey (0) to bright yellow (max), as an rgb colour; no colour for None (a ledger
    without a brightness column)."""
    if b is None:
        return ""
    f = 0.0 if max_b <= 0 else min(max(b / max_b, 0.0), 1.0)
    lo, hi = (70, 70, 90), (255, 225, 60)
    r, g, bl = (int(a + (c - a) * f) for a, c in zip(lo, hi))
    return f"rgb({r},{g},{bl})"


def shown_brightness(scores, view: dict):
    """What a step's context is coloured by: the brightness its scorer gave (``scores``, a
    captured ``ScoreOut``), else the column as the view (a captured one) held it; None for
    a ledger without a brightness column."""
    given = (scores.columns or {}).get("brightness")
    return given if given is not None else view.get("brightness")


def context_text(rows: Iterable[dict], token_text: Callable[[int], str],
                 culled: Iterable[int] = (), merged: Iterable[int] = (),
                 max_brightness: float = 255.0) -> Text:
    """``rows``: ledger rows ``{uid, token_id, position, source, brightness}`` and optionally
    ``origin`` (a file's label, None: made here), any order (shown in position order).
    Culled uids are struck through in red; merged-in tokens are underlined in cyan; rows
    from another file sit on that file's background (``origin_legend``)."""
    culled, merged = set(culled), set(merged)
    backgrounds = _origin_backgrounds(rows := list(rows))
    text = Text()
    for row in sorted(rows, key=lambda r: r["position"]):
        piece = token_text(row["token_id"])
        if row["uid"] in culled:
            style = "strike red"
        elif row["uid"] in merged:
            style = "bold underline cyan"
        else:
            style = f"{brightness_style(row.get('brightness'), max_brightness)} " \
                    f"{SOURCE_MARK.get(row.get('source', 'user'), '')}".strip()
        text.append(piece, style=f"{style} {backgrounds.get(row.get('origin'), '')}".strip())
    return text


def _origin_backgrounds(rows: list[dict]) -> dict[str, str]:
    """Each origin file among ``rows`` -> its background, in order of first appearance."""
    labels = dict.fromkeys(r["origin"] for r in sorted(rows, key=lambda r: r["position"])
                           if r.get("origin"))
    return {label: ORIGIN_BG[i % len(ORIGIN_BG)] for i, label in enumerate(labels)}


def origin_counts(rows: Iterable[dict]) -> dict[str, int]:
    """Each origin file among ``rows`` (in text order of first appearance) -> its rows."""
    rows = sorted(rows, key=lambda r: r["position"])
    return {label: sum(r.get("origin") == label for r in rows)
            for label in _origin_backgrounds(rows)}


def origin_legend(rows: Iterable[dict]) -> Text:
    """One line naming each origin file's background and its row count (empty: none)."""
    rows = list(rows)
    text = Text()
    for (label, bg), count in zip(_origin_backgrounds(rows).items(), origin_counts(rows).values()):
        text.append(f" {label} ({count}) ", style=bg)
        text.append("  ")
    return text


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """Values as one line of block characters (down-sampled to ``width``)."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [values[int(i * step)] for i in range(width)]
    lo, hi = min(values), max(values)
    span = hi - lo or 1
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1))] for v in values)


def steps_table(steps: Sequence[dict], token_text: Callable[[int], str], title: str = "steps",
                limit: int = 40) -> Table:
    """One row per step: chosen token, top alternatives with probabilities, cache length,
    culls/merges. ``steps``: dicts with step, token_id, cache_len and optional top,
    culled, merged, reindexed, ms. Shows the last ``limit`` steps."""
    table = Table(title=title, show_lines=False, header_style="bold")
    for col, kw in (("step", {"justify": "right"}), ("token", {}), ("top alternatives", {}),
                    ("cache", {"justify": "right"}), ("patch", {}), ("ms", {"justify": "right"})):
        table.add_column(col, **kw)
    for s in steps[-limit:]:
        top = "  ".join(f"{token_text(i)!r} {p:.2f}" for i, p in s.get("top", [])[:4])
        patch = []
        if s.get("culled"):
            patch.append(f"-{len(s['culled'])}")
        if s.get("merged"):
            patch.append(f"merge {len(s['merged'])}")
        if s.get("reindexed"):
            patch.append("reindex")
        ms = s.get("ms")
        table.add_row(str(s["step"]), repr(token_text(s["token_id"])), top, str(s["cache_len"]),
                      " ".join(patch), "" if ms is None else f"{ms:.1f}")
    return table
