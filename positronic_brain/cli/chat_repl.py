"""``positronic-brain chat``: the interactive REPL (and its script mode) over ``chat.Chat``.

A reply streams into a live view; ``/context``, ``/stats``, ``/save``, ``/load``, ``/quit``
are commands. Ctrl-C stops a reply (the step in flight finishes), Ctrl-D quits.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import nullcontext

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..chat import Chat
from ..render import context_text, origin_counts, origin_legend, sparkline
from ..session_io import load_session, save_session
from ..special_tokens import TokenPolicy
from ..types import Totals, UserError
from .args import PROG, cache_params, cli_model, open_tape, sampler_params

CHAT_HELP = "/context  /stats  /save PATH  /load PATH  /quit   (Ctrl-C stops a reply, Ctrl-D quits)"


def _rss_mb() -> float | None:
    """This process's resident memory now (MiB), from /proc (Linux); None elsewhere."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20, 1)


def _chat_reply(chat, text: str, console, args, live: bool) -> None:
    """Stream one reply: a live view, or plain text on stdout (script mode; none with
    --json, which prints one JSON line per turn). Ctrl-C stops the reply, not the program:
    the step in flight finishes, the state stays valid."""
    stop: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    events, shown = chat.stream(text), Text()
    budget = chat.session.cache_params.budget
    try:
        with Live(shown, console=console, refresh_per_second=12, vertical_overflow="visible",
                  transient=False) if live else nullcontext() as view:
            for ev in events:
                if live:
                    shown.append(ev.text)
                    view.update(Group(shown, Text(f"cache {ev.record.cache_len}/{budget}  "
                                                  f"{ev.record.ms:.0f} ms/token", style="dim")))
                elif not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                if stop:
                    break
            if live:
                view.update(shown)
    finally:
        events.close()
        signal.signal(signal.SIGINT, previous)
    r, st, turn = chat.last, chat.stats(), Totals.of(chat.last.steps)
    if args.json:
        print(json.dumps({"turn": st["turns"], "user": text, "reply": r.text,
                          "reply_ids": list(r.ids), "stop_reason": r.stop_reason,
                          "tokens": len(r.steps), "ms_per_token": round(r.ms_per_token, 3),
                          **{k: getattr(turn, k) for k in ("culled", "folded", "merged",
                                                           "reindexed", "recalled")},
                          "rss_mb": _rss_mb(),
                          **{k: st[k] for k in ("cache_len", "budget", "max_position")}}))
        return
    if not live:
        sys.stdout.write("\n")
    if live:
        console.print(f"[dim][{len(r.steps)} tokens, {r.ms_per_token:.1f} ms/token, cache "
                      f"{st['cache_len']}/{budget}, {chat.totals.edits()} so far; stop: "
                      f"{r.stop_reason}][/]")


def _chat_stats_view(chat):
    table = Table.grid(padding=(0, 2))
    for k, v in chat.stats().items():
        table.add_row(k.replace("_", " "), str(v))
    lens = list(chat.cache_lens)
    table.add_row("cache length", f"{sparkline(lens)}  (last {len(lens)} steps)" if lens else "")
    return table


def _chat_context_view(chat):
    rows, culled, merged = chat.context()
    params = chat.session.cache_params
    return Panel(Group(context_text(rows, chat.policy.token_text, culled=culled, merged=merged,
                                    max_brightness=params.scorer.get("max_brightness", 255.0)),
                       origin_legend(rows)),
                 title=f"context: {len(rows) - len(culled)} live / budget {params.budget}",
                 subtitle=f"bright … dim by brightness, [strike red]culled this turn[/] "
                 f"({len(culled)}), [bold underline cyan]merged[/] ({len(merged)})")


def _chat_command(chat, line: str, console, args):
    """One /command; returns the chat to go on with (None: quit)."""
    name, _, path = line.strip().partition(" ")
    path = path.strip()
    if name == "/quit":
        return None
    if name in ("/save", "/load") and not path:
        raise UserError(f"{name} needs a PATH")
    if name == "/save":
        out = {"saved": str(save_session(chat.session, path))}
    elif name == "/load":
        session = load_session(chat.session.model, path)
        session.record(chat.session.tape, path)  # the capture goes on from the loaded state
        chat, out = Chat.resume(session, chat.max_new_tokens), {"loaded": path}
    elif name == "/stats":
        out = {"stats": chat.stats()}
        if not args.json:
            console.print(_chat_stats_view(chat))
            return chat
    elif name == "/context":
        view = _chat_context_view(chat)
        if not args.json:
            console.print(view)
            return chat
        rows = chat.context()[0]
        out = {"context": view.renderable.renderables[0].plain, "origins": origin_counts(rows)}
    elif name == "/help":
        out = {"help": CHAT_HELP}
    else:
        raise UserError(f"unknown command {name!r}; commands: {CHAT_HELP}")
    if args.json:
        print(json.dumps(out))
    else:
        console.print(" ".join(f"{k}: {v}" for k, v in out.items()))
    return chat


def _chat_line(chat, line: str, console, args, live: bool):
    if line.lstrip().startswith("/"):
        return _chat_command(chat, line, console, args)
    _chat_reply(chat, line, console, args, live)
    return chat


def _typed_lines(console):
    """What the user types; Ctrl-C at the prompt only clears the line, Ctrl-D ends."""
    while True:
        try:
            yield console.input("[bold green]you>[/] ")
        except EOFError:
            return
        except KeyboardInterrupt:
            console.print()


def cmd_chat(args) -> int:
    """The ``chat`` command: a live terminal REPL, or a script of turns (``--script``)."""
    sampler, params = sampler_params(args), cache_params(args)
    if args.json and args.script is None:
        raise UserError("--json needs --script")
    lines = None
    if args.script is not None:
        try:
            lines = (sys.stdin.read() if args.script == "-"
                     else open(args.script, encoding="utf-8").read())
        except OSError as e:
            raise UserError(f"cannot read the script {args.script}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"the script {args.script} is not UTF-8 text (byte {e.start})") \
                from None
        lines = lines.splitlines()
    model = cli_model(args, args.model, args.dtype)
    policy = TokenPolicy(model.tokenizer, bos=args.bos)
    chat = Chat(model, policy, args.system, sampler, params, args.max_new_tokens,
                open_tape(args, model, sampler, params, []))
    console = Console(highlight=False)
    errors, t0, rss0 = 0, time.perf_counter(), _rss_mb()
    if lines is None:
        console.print(f"[dim]{model.name} {args.dtype}, budget {chat.session.cache_params.budget}, "
                      f"allocation {params.allocation.kind}. {CHAT_HELP}[/]")
    try:
        for i, line in enumerate(_typed_lines(console) if lines is None else lines, 1):
            if lines is not None and not line.strip():
                continue  # blank lines in a script are not turns
            try:
                after = _chat_line(chat, line, console, args, live=lines is None)
            except UserError as e:
                print(f"{PROG}: error: {f'line {i}: ' if lines else ''}{e}", file=sys.stderr)
                errors += 1
                continue
            if after is None:
                break
            chat = after
    finally:
        chat.session.tape.close(chat.session.stop_reason)
    if lines is not None:
        st = chat.stats()
        print(f"[{st['turns']} turns, {st['steps']} tokens in {time.perf_counter() - t0:.1f} s, "
              f"{st['ms_per_token']:.1f} ms/token, cache {st['cache_len']}/{st['budget']}, "
              f"max position {st['max_position']}, {chat.totals.edits()}, "
              f"RSS {rss0} -> {_rss_mb()} MiB, "
              f"errors {errors}]", file=sys.stderr)
    return 2 if errors and lines is not None else 0  # a script with refused lines failed
