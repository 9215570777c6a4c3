"""The command line: ``positronic-brain run|chat|bench|replay|inspect``.

Bad input gets one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .types import UserError  # noqa: E402

PROG = "positronic-brain"


MODEL_HELP = ("smollm2 (default), a .gguf file (llama, mistral, qwen2), a local HF folder, "
              "or a tiny random model for tests: "
              "tiny-random, tiny-random-qwen2, tiny-random-mistral, tiny-random-llama3")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage too)
        raise UserError(message)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help=MODEL_HELP)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


def _add_sampler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="A staged generation loop in which the KV cache "
                     "is never touched behind your back.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="generate from a prompt")
    run.add_argument("--prompt", required=True)
    run.add_argument("--system", default=None,
                     help="format as chat turns: this system prompt, then the prompt as the user")
    run.add_argument("--chat", action="store_true",
                     help="format the prompt as a user chat turn (no system prompt unless --system)")
    run.add_argument("--bos", default="auto", choices=("auto", "yes", "no"),
                     help="add the BOS token explicitly (auto: if the model family expects it)")
    _add_model_args(run)
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--capacity", type=int, default=None,
                     help="arena slots (default: prompt + max-new-tokens, within the model's positions)")
    _add_sampler_args(run)
    run.add_argument("--ignore-eos", action="store_true")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_cache_args(run)
    _add_capture_args(run)

    bench = sub.add_parser("bench", help="benchmarks (see docs/BENCHMARKS.md)")
    bench.add_argument("kind", choices=("speed", "quality", "passkey"))
    bench.add_argument("--quick", action="store_true", help="fewer, smaller measurements (make bench)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    bench.add_argument("--out", default=None,
                       help="folder for report.md, results.json and the PNG plots")
    bench.add_argument("--report", default=None,
                       help="also write the report into this shared document (e.g. "
                       "docs/BENCHMARKS.md), as its own section between markers")
    bench.add_argument("--model", default="smollm2",
                       help=MODEL_HELP)
    _add_quality_args(bench)
    from .bench.passkey import add_args as _add_passkey_args
    _add_passkey_args(bench)
    _add_inspect_args(sub)
    _add_chat_args(sub)
    return parser


def _add_capture_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capture (see README: capture, replay, inspect)")
    g.add_argument("--capture", metavar="DIR", default=None,
                   help="save every stage call's inputs and outputs to DIR/<run-id>/")
    g.add_argument("--capture-level", default="light", choices=("light", "full"),
                   help="full also saves the whole live state before each step")


def _add_inspect_args(sub) -> None:
    rp = sub.add_parser("replay", help="re-run a captured run's stages and compare bit for bit")
    rp.add_argument("run_dir", metavar="DIR", help="a capture run folder (or a root with one run)")
    rp.add_argument("--stage", default=None, help="compare only this stage (s0_prime ... s4_apply)")
    rp.add_argument("--step", type=int, default=None, help="compare only this step")
    ip = sub.add_parser("inspect", help="show a captured run (or one capture file)")
    ip.add_argument("path", metavar="PATH")
    ip.add_argument("--step", type=int, default=None, help="the step whose context to show "
                    "(default: the last)")
    ip.add_argument("--last", type=int, default=30, help="how many steps the table shows")


def open_capture(args, model, sampler, cache, prompt_ids: list[int]):
    """A CaptureWriter for ``--capture`` (None without it); the manifest holds every parameter."""
    if args.capture is None:
        return None
    from dataclasses import asdict

    from .capture import CaptureWriter

    params = {k: v for k, v in vars(args).items() if k not in ("command",)}
    return CaptureWriter(args.capture, {
        "model": model.name, "dtype": str(model.dtype).removeprefix("torch."),
        "fingerprint": model.fingerprint, "command": args.command, "seed": sampler.seed,
        "params": {"args": params, "sampler": asdict(sampler), "cache": asdict(cache)},
        "prompt_ids": prompt_ids}, level=args.capture_level)


def cmd_replay(args) -> int:
    from .replay import main as replay_main

    return replay_main(args.run_dir, args.stage, args.step)


def cmd_inspect(args) -> int:
    from .inspector import main as inspect_main

    return inspect_main(args.path, args.step, args.last)


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    from .scorers import SCORERS
    from .types import AGGREGATIONS, SIGNALS, CacheParams

    d = CacheParams()
    g = p.add_argument_group("cache (see README: budgets, policies, repair, positions)")
    g.add_argument("--budget", type=int, default=None,
                   help="live cache slots after each step (default: no culling)")
    g.add_argument("--policy", dest="scorer", default=d.scorer,
                   help=f"the stage-2 scorer: {'|'.join(SCORERS)}")
    g.add_argument("--repair", default=d.repair,
                   help="none|merge|fold: merge dim adjacent pairs; fold culled K/V into the "
                        "most alike survivor")
    g.add_argument("--fold-min-cos", type=float, default=d.fold_min_cos,
                   help="fold only where the key cosine reaches this (elsewhere just drop)")
    g.add_argument("--positions", default=d.positions,
                   help="compact (re-index before the model's max positions) | keep (stop there)")
    g.add_argument("--reindex-at", type=int, default=None,
                   help="compact when the next position reaches this (default: max positions)")
    g.add_argument("--sinks", type=int, default=d.sinks, help="first tokens never culled")
    g.add_argument("--recent", type=int, default=d.recent, help="last tokens never culled")
    g.add_argument("--decay", type=float, default=d.decay, help="brightness lost per step")
    g.add_argument("--gain", type=float, default=d.gain,
                   help="brightness per uniform share of attention (n x attention)")
    g.add_argument("--signal", default=d.signal,
                   help=f"what brightness gains from: {'|'.join(SIGNALS)} (value: attention x "
                        "value norm / mean value norm)")
    g.add_argument("--aggregate", default=d.aggregate,
                   help=f"attention over layers-heads: {'|'.join(AGGREGATIONS)}")
    g.add_argument("--skip-layers", type=float, default=d.skip_layers,
                   help="fraction of the first layers brightness leaves out")


def _cache(args):
    from .types import CacheParams

    return CacheParams(budget=args.budget, scorer=args.scorer, repair=args.repair,
                       positions=args.positions, reindex_at=args.reindex_at, sinks=args.sinks,
                       recent=args.recent, decay=args.decay, gain=args.gain,
                       aggregate=args.aggregate, signal=args.signal,
                       skip_layers=args.skip_layers, fold_min_cos=args.fold_min_cos)


def _sampler(args):
    from .types import SamplerParams

    return SamplerParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty, seed=args.seed)


def cmd_run(args) -> int:
    from .loop import run
    from .model import load_model
    from .special_tokens import TokenPolicy

    sampler = _sampler(args)  # validate before the (slower) model load
    cache = _cache(args)
    if args.prompt == "":
        raise UserError("the prompt is empty")
    if args.max_new_tokens < 0:
        raise UserError(f"max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.capacity is not None and args.capacity < 1:
        raise UserError(f"capacity must be >= 1, got {args.capacity}")
    model = load_model(args.model, args.dtype)
    policy = TokenPolicy(model.tokenizer, bos=args.bos)
    if args.system is not None or args.chat:
        turns = ([("system", args.system)] if args.system is not None else []) \
            + [("user", args.prompt)]
        segments = policy.chat(turns)
    else:
        segments = policy.raw_prompt(args.prompt)

    def echo(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    capture = open_capture(args, model, sampler, cache, [i for s in segments for i in s.ids])
    result = run(model, policy, segments, sampler, max_new_tokens=args.max_new_tokens,
                 ignore_eos=args.ignore_eos, capacity=args.capacity,
                 on_text=None if args.json else echo, cache_params=cache, capture=capture)
    if args.json:
        json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    if not args.json:
        steps = result["steps"]
        if steps:
            ms = sorted(s["ms"] for s in steps)[len(steps) // 2]
            culled = sum(len(s["culled"]) for s in steps)
            repaired = sum(len(s["repaired"]) for s in steps)
            folded = sum(s["folded"] for s in steps)
            reindexed = sum(s["reindexed"] for s in steps)
            print(f"[{len(steps)} tokens, median {ms:.1f} ms/token, cache {steps[-1]['cache_len']}"
                  f" slots, culled {culled} (folded {folded}), repaired {repaired}, "
                  f"re-indexed {reindexed}, "
                  f"stop: {result['stop_reason']}]", file=sys.stderr)
    return 0


QUALITY_ONLY = ("dtype", "text", "slice", "at", "budgets", "policies", "repairs", "params", "tokens",
                "long", "jobs")


def _add_quality_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bench quality (streaming perplexity; see docs/BENCHMARKS.md)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="default float32")
    g.add_argument("--text", default=None, help="a UTF-8 file (default: Python's help topics)")
    g.add_argument("--slice", default=None, choices=("eval", "tune"),
                   help="eval (default): from the text's start; tune: from its middle")
    g.add_argument("--at", type=float, default=None, metavar="F",
                   help="the tune slice starts F of the way into the text (0.5 <= F < 1; "
                        "default 0.5)")
    g.add_argument("--budgets", default=None, help="comma-separated, e.g. 128,256,512")
    g.add_argument("--policies", default=None,
                   help="comma-separated scorers (default: brightness,streaming,h2o,tova,random)")
    g.add_argument("--repairs", default=None, help="comma-separated (default: none,merge,fold)")
    g.add_argument("--params", default=None, metavar="K=V,...",
                   help="cache parameters of every run, e.g. decay=1,gain=200,sinks=4")
    g.add_argument("--tokens", type=int, default=None, help="scored tokens per configuration")
    g.add_argument("--long", type=int, default=None,
                   help="scored tokens of the run past the model's positions (0 = none)")
    g.add_argument("--jobs", type=int, default=None,
                   help="runs in parallel, one single-thread process each (default: CPU cores)")


def cmd_bench(args) -> int:
    from .bench import passkey, quality, speed

    if args.kind == "passkey":
        return passkey.main(args)  # takes --dtype, --budgets, --policies; refuses the rest
    passkey.refuse_own(args)
    only = [f"--{f}" for f in QUALITY_ONLY if getattr(args, f) is not None]
    if args.kind != "quality" and only:
        raise UserError(f"{', '.join(only)}: for bench quality only")
    return {"speed": speed.main, "quality": quality.main}[args.kind](args)


def _add_chat_args(sub) -> None:
    ch = sub.add_parser("chat", help="an interactive chat whose cache stays at a fixed budget")
    ch.add_argument("--system", default=None,
                    help="the system prompt, pinned in the cache (none unless given)")
    ch.add_argument("--script", metavar="FILE", default=None,
                    help="read user turns (and /commands) from FILE, one per line ('-': stdin), "
                    "and print the replies")
    ch.add_argument("--json", action="store_true", help="with --script: one JSON line per turn")
    ch.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply")
    ch.add_argument("--prune", default="tokens", choices=("tokens", "turns"),
                    help="over the budget, cull single tokens by score (tokens) or drop the "
                    "oldest whole turns (turns)")
    ch.add_argument("--bos", default="auto", choices=("auto", "yes", "no"),
                    help="add the BOS token explicitly (auto: if the model family expects it)")
    _add_model_args(ch)
    _add_sampler_args(ch)
    _add_cache_args(ch)
    _add_capture_args(ch)


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
    import signal
    from contextlib import nullcontext

    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

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
    r, st = chat.last, chat.stats()
    if args.json:
        print(json.dumps({"turn": st["turns"], "user": text, "reply": r.text,
                          "reply_ids": list(r.ids), "stop_reason": r.stop_reason,
                          "tokens": len(r.steps), "ms_per_token": round(r.ms_per_token, 3),
                          "culled": sum(len(s.culled) for s in r.steps),
                          "repaired": sum(len(s.repaired) for s in r.steps),
                          "reindexed": sum(s.reindexed for s in r.steps), "rss_mb": _rss_mb(),
                          **{k: st[k] for k in ("cache_len", "budget", "max_position")}}))
        return
    if not live:
        sys.stdout.write("\n")
    if live:
        console.print(f"[dim][{len(r.steps)} tokens, {r.ms_per_token:.1f} ms/token, cache "
                      f"{st['cache_len']}/{budget}, culled {st['culled']}, merged "
                      f"{st['repaired']}, re-indexed {st['reindexed']} so far; stop: "
                      f"{r.stop_reason}][/]")


def _chat_stats_view(chat):
    from rich.table import Table

    from .render import sparkline

    table = Table.grid(padding=(0, 2))
    for k, v in chat.stats().items():
        table.add_row(k.replace("_", " "), str(v))
    lens = list(chat.cache_lens)
    table.add_row("cache length", f"{sparkline(lens)}  (last {len(lens)} steps)" if lens else "")
    return table


def _chat_context_view(chat):
    from rich.panel import Panel

    from .render import context_text

    rows, culled, merged = chat.context()
    cache = chat.session.cache_params
    return Panel(context_text(rows, chat.policy.token_text, culled=culled, repaired=merged,
                              max_brightness=cache.max_brightness),
                 title=f"context: {len(rows) - len(culled)} live / budget {cache.budget}",
                 subtitle=f"bright … dim by brightness, [strike red]culled this turn[/] "
                 f"({len(culled)}), [bold underline cyan]merged[/] ({len(merged)})")


def _chat_command(chat, line: str, console, args):
    """One /command; returns the chat to go on with (None: quit)."""
    from .chat import Chat
    from .session_io import load_session, save_session

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
        if chat.session.capture:  # a loaded session starts without one: the event log ends here
            chat.session.capture.close("loaded a session")
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
        out = {"context": view.renderable.plain}
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
    import time
    from dataclasses import replace

    from rich.console import Console

    from .chat import Chat
    from .model import load_model
    from .special_tokens import TokenPolicy

    sampler, cache = _sampler(args), replace(_cache(args), prune=args.prune)
    if args.json and args.script is None:
        raise UserError("--json needs --script")
    lines = None
    if args.script is not None:
        try:
            lines = (sys.stdin.read() if args.script == "-" else open(args.script).read())
        except OSError as e:
            raise UserError(f"cannot read the script {args.script}: {e.strerror}") from None
        lines = lines.splitlines()
    model = load_model(args.model, args.dtype)
    policy = TokenPolicy(model.tokenizer, bos=args.bos)
    chat = Chat(model, policy, args.system, sampler, cache, args.max_new_tokens,
                open_capture(args, model, sampler, cache, []))
    console = Console(highlight=False)
    errors, t0, rss0 = 0, time.perf_counter(), _rss_mb()
    if lines is None:
        console.print(f"[dim]{model.name} {args.dtype}, budget {cache.budget}, prune "
                      f"{cache.prune}. {CHAT_HELP}[/]")
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
        if chat.session.capture:
            chat.session.capture.close(chat.session.stop_reason)
    if lines is not None:
        st = chat.stats()
        print(f"[{st['turns']} turns, {st['steps']} tokens in {time.perf_counter() - t0:.1f} s, "
              f"{st['ms_per_token']:.1f} ms/token, cache {st['cache_len']}/{st['budget']}, "
              f"max position {st['max_position']}, culled {st['culled']}, merged "
              f"{st['repaired']}, re-indexed {st['reindexed']}, RSS {rss0} -> {_rss_mb()} MiB, "
              f"errors {errors}]", file=sys.stderr)
    return 2 if errors and lines is not None else 0  # a script with refused lines failed


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"run": cmd_run, "bench": cmd_bench, "replay": cmd_replay,
                "inspect": cmd_inspect, "chat": cmd_chat}[args.command](args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
