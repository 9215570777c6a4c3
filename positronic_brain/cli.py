"""The command line: ``positronic-brain run|bench``.

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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage too)
        raise UserError(message)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), tiny-random, tiny-random-qwen2, or a local HF folder")
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
    bench.add_argument("kind", choices=("speed",))
    bench.add_argument("--quick", action="store_true", help="fewer, smaller measurements (make bench)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    bench.add_argument("--out", default=None,
                       help="folder for report.md, results.json and the PNG plots")
    bench.add_argument("--report", default=None,
                       help="write the markdown report here instead of OUT/report.md")
    bench.add_argument("--model", default="smollm2",
                       help="smollm2 (default), tiny-random, tiny-random-qwen2, or a local HF folder")
    _add_inspect_args(sub)
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
    from .types import AGGREGATIONS, POLICIES, CacheParams

    d = CacheParams()
    g = p.add_argument_group("cache (see README: budgets, policies, repair, positions)")
    g.add_argument("--budget", type=int, default=None,
                   help="live cache slots after each step (default: no culling)")
    g.add_argument("--policy", default=d.policy, help=f"scorer: {'|'.join(POLICIES)}")
    g.add_argument("--repair", default=d.repair, help="none|merge: merge dim adjacent pairs")
    g.add_argument("--positions", default=d.positions,
                   help="compact (re-index before the model's max positions) | keep (stop there)")
    g.add_argument("--reindex-at", type=int, default=None,
                   help="compact when the next position reaches this (default: max positions)")
    g.add_argument("--sinks", type=int, default=d.sinks, help="first tokens never culled")
    g.add_argument("--recent", type=int, default=d.recent, help="last tokens never culled")
    g.add_argument("--decay", type=float, default=d.decay, help="brightness lost per step")
    g.add_argument("--gain", type=float, default=d.gain, help="brightness per unit attention")
    g.add_argument("--aggregate", default=d.aggregate,
                   help=f"attention over layers-heads: {'|'.join(AGGREGATIONS)}")


def _cache(args):
    from .types import CacheParams

    return CacheParams(budget=args.budget, policy=args.policy, repair=args.repair,
                       positions=args.positions, reindex_at=args.reindex_at, sinks=args.sinks,
                       recent=args.recent, decay=args.decay, gain=args.gain,
                       aggregate=args.aggregate, seed=args.seed)


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
                 on_text=None if args.json else echo, cache=cache, capture=capture)
    if args.json:
        json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    if not args.json:
        steps = result["steps"]
        if steps:
            ms = sorted(s["ms"] for s in steps)[len(steps) // 2]
            culled = sum(len(s["culled"]) for s in steps)
            repaired = sum(len(s["repaired"]) for s in steps)
            reindexed = sum(s["reindexed"] for s in steps)
            print(f"[{len(steps)} tokens, median {ms:.1f} ms/token, cache {steps[-1]['cache_len']}"
                  f" slots, culled {culled}, repaired {repaired}, re-indexed {reindexed}, "
                  f"stop: {result['stop_reason']}]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import speed

    return speed.main(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"run": cmd_run, "bench": cmd_bench, "replay": cmd_replay,
                "inspect": cmd_inspect}[args.command](args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
