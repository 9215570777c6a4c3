"""The one-shot commands: ``run``, ``bench``, ``fork``, ``compare``, ``replay``, ``inspect``,
``compose``, ``transfer``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import compare, compose, fork, inspector, replay, transfer
from ..bench import passkey, quality, speed
from ..loop import run
from ..model import load_model
from ..session_io import load_session, save_session, saved_model
from ..special_tokens import TokenPolicy
from ..types import Totals, UserError, require
from .args import (BENCH_KINDS, QUALITY_ONLY, cache_params, model_placement, open_tape,
                   sampler_params, train_params)

BENCHES = dict(zip(BENCH_KINDS, (speed.main, quality.main, passkey.main)))


def cmd_run(args) -> int:
    sampler, params = sampler_params(args), cache_params(args)  # before the (slower) model load
    if args.prompt == "":
        raise UserError("the prompt is empty")
    if args.max_new_tokens < 0:
        raise UserError(f"max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.capacity is not None and args.capacity < 1:
        raise UserError(f"capacity must be >= 1, got {args.capacity}")
    model = load_model(args.model, args.dtype, **model_placement(args))
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

    tape = open_tape(args, model, sampler, params, [i for s in segments for i in s.ids])
    result = run(model, policy, segments, sampler, max_new_tokens=args.max_new_tokens,
                 ignore_eos=args.ignore_eos, capacity=args.capacity,
                 on_text=None if args.json else echo, cache_params=params, tape=tape)
    if args.json:
        json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    steps = result["steps"]
    if not args.json and steps:
        ms = sorted(s["ms"] for s in steps)[len(steps) // 2]
        print(f"[{len(steps)} tokens, median {ms:.1f} ms/token, cache {steps[-1]['cache_len']} "
              f"slots, {Totals(**result['totals']).edits()}, stop: {result['stop_reason']}]",
              file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    if args.kind == "passkey":
        return passkey.main(args)  # takes --dtype, --budgets, --policies; refuses the rest
    passkey.refuse_own(args)
    only = [f"--{f}" for f in QUALITY_ONLY if getattr(args, f) is not None]
    if args.kind != "quality" and only:
        raise UserError(f"{', '.join(only)}: for bench quality only")
    if args.kind == "speed" and args.jobs is not None:
        raise UserError("--jobs: for bench quality and bench passkey only")
    return BENCHES[args.kind](args)


def cmd_fork(args) -> int:
    def echo(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = fork.fork(args.run_dir, args.step, fork.cache_overrides(args),
                       fork.sampler_overrides(args), args.max_new_tokens, args.capture,
                       args.capture_level, args.command, args.device,
                       None if args.json else echo)
    if args.json:
        json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    print(f"[fork of {result['parent']['run']} at step {args.step}: {len(result['steps'])} "
          f"tokens, {Totals(**result['totals']).edits()}, stop: {result['stop_reason']}"
          + (f", capture {result['capture']}" if "capture" in result else "") + "]",
          file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    return compare.main(args.run_dirs, args.jump, args.top, args.json, args.last, args.html)


def cmd_replay(args) -> int:
    return replay.main(args.run_dir, args.stage, args.step, device=args.device)


def cmd_inspect(args) -> int:
    return inspector.main(args.path, args.step, args.last, html=args.html)


def cmd_compose(args) -> int:
    name, dtype = saved_model(args.files[0])
    model = load_model(args.model or name, args.dtype or dtype, args.device)
    out = compose.compose_files(model, args.files, args.out)
    if args.json:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
    else:
        parts = " + ".join(f"{p['label']} {p['cached']}" for p in out["parts"])
        print(f"[composed {parts} cached tokens: {out['cached']} at positions < "
              f"{out['next_position']}"
              + (f", {out['cold']} cold" if out["cold"] else "") + f" -> {out['out']}]")
    return 0


def cmd_transfer(args) -> int:
    out = Path(args.out)
    require(out.parent.is_dir(), f"--out {out}: no folder {out.parent}")
    if args.action == "train":
        return _transfer_train(args, out)
    source, target = (load_model(name, args.dtype, args.device)
                      for name in (args.source, args.target))
    projector = transfer.load_projector(args.projector, source, target)
    session = transfer.apply_projector(projector, load_session(source, args.session), target,
                                       Path(args.session).name)
    save_session(session, out)
    print(f"[{args.session} ({source.name}, {session.state.arena.n} cached tokens) -> {out} "
          f"({target.name})]", file=sys.stderr)
    return 0


def _transfer_train(args, out: Path) -> int:
    params = train_params(args)  # before the (slower) model loads
    text = quality.read_text(args.text)
    source, target = (load_model(name, args.dtype, args.device)
                      for name in (args.source, args.target))
    ids = TokenPolicy(source.tokenizer, bos="no").encode(text)
    every = max(1, params.steps // 10)

    def progress(step: int, loss: float) -> None:
        if step % every == 0:
            print(f"[step {step}/{params.steps}: KL {loss:.4f}]", file=sys.stderr, flush=True)

    projector, report = transfer.train_projector(source, target, ids, params,
                                                 None if args.json else progress)
    report["out"] = str(transfer.save_projector(projector, out))
    if args.json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"held-out KL {report['kl_before']:.4f} -> {report['kl_after']:.4f} nats/token "
              f"({report['held_out_windows']} windows of {params.prefix} + "
              f"{params.continuation} tokens; {params.steps} steps, {report['seconds']:.0f} s) "
              f"-> {out}")
    return 0
