"""The one-shot commands: ``run``, ``bench``, ``fork``, ``compare``, ``replay``, ``inspect``,
``compose``, ``export``, ``transfer``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import (calibrate, capture, compare, compose, fork, inspector, options, partial, replay,
               transfer)
from ..batch import run_rows
from ..bench import flags, quality
from ..bench.common import Table, fmt, print_tables
from ..loop import drive, run
from ..model import load_model
from ..plain import make_folder, output_file
from ..session_io import load_session, save_session, saved_model, spans
from ..special_tokens import TokenPolicy
from ..types import Totals, UserError, require
from .args import (BENCHES, DTYPE, MODEL, cache_params, cli_model, lengths, open_batch_tape,
                   open_tape, percents, sampler_params, settled_by_session, train_params)


def _echo(delta: str) -> None:
    sys.stdout.write(delta)
    sys.stdout.flush()


def cmd_run(args) -> int:
    if args.max_new_tokens < 0:
        raise UserError(f"max-new-tokens must be >= 0, got {args.max_new_tokens}")
    require(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    require(args.batch == 1 or args.prompts is not None, "--batch takes --prompts FILE")
    if args.session is not None:
        return _report(args, _run_session(args))
    sampler, params = sampler_params(args), cache_params(args)  # before the (slower) model load
    texts = _prompts(args.prompts) if args.prompts is not None else [args.prompt]
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("the prompt is empty")
    if args.capacity is not None and args.capacity < 1:
        raise UserError(f"capacity must be >= 1, got {args.capacity}")
    save = _save_to(args)
    require(args.batch == 1 or args.device_map is None,
            "--batch runs its rows on one device: it takes no --device-map")
    model = cli_model(args, args.model or MODEL, args.dtype or DTYPE)
    require(args.capacity is None or args.capacity <= model.spec.max_positions,
            f"capacity must be at most the model's {model.spec.max_positions} positions (the "
            f"live slots never outnumber them), got {args.capacity}")
    policy = TokenPolicy(model.tokenizer, bos=args.bos)
    prompts = [_segments(args, policy, text) for text in texts]
    if args.prompts is not None:
        for line, segments in enumerate(prompts, 1):
            n = sum(len(s.ids) for s in segments)
            require(n <= model.spec.max_positions, f"{args.prompts}: line {line}: the prompt "
                    f"is {n} tokens, more than the model's {model.spec.max_positions} positions")
            require(args.capacity is None or n <= args.capacity, f"{args.prompts}: line "
                    f"{line}: the prompt is {n} tokens, more than --capacity {args.capacity}")
        return _run_prompts(args, model, policy, prompts, sampler, params, save)
    segments = prompts[0]
    tape = open_tape(args, model, sampler, params, [i for s in segments for i in s.ids])
    return _report(args, run(model, policy, segments, sampler, max_new_tokens=args.max_new_tokens,
                             ignore_eos=args.ignore_eos, capacity=args.capacity,
                             on_text=None if args.json else _echo, cache_params=params,
                             tape=tape, on_end=save and (lambda s: _save(s, save))))


def _save_to(args) -> Path | None:
    """``--save``'s file (``--prompt``, ``--session``) or folder (``--prompts``, made if
    missing), checked before any work; None without it."""
    if args.save is None:
        return None
    if args.prompts is None:
        return output_file(args.save, *(args.session,) * (args.session is not None))
    folder = Path(args.save)
    require(not folder.exists() or folder.is_dir(), f"--save {folder}: with --prompts, a "
            "folder (one session file a prompt), and this is a file")
    require(folder.parent.is_dir(), f"--save {folder}: no folder {folder.parent}")
    try:  # taken back, if empty, when the command is refused
        return make_folder(folder)
    except OSError as e:
        raise UserError(f"--save {folder}: cannot make the folder: {e.strerror}") from None


def _save(session, out: Path) -> None:
    """Save a session that stopped, saying where on stderr."""
    written = save_session(session, out)
    print(f"[saved {written}: go on with --session {written}]", file=sys.stderr)


def _segments(args, policy: TokenPolicy, text: str) -> list:
    """A prompt's segments as ``run`` formats it: chat turns with ``--system`` or ``--chat``,
    else the raw text."""
    if args.system is not None or args.chat:
        turns = ([("system", args.system)] if args.system is not None else []) \
            + [("user", text)]
        return policy.chat(turns)
    return policy.raw_prompt(text)


def _prompts(path: str) -> list[str]:
    """``--prompts``' lines (``-``: stdin), one prompt each; an empty line or file is refused,
    naming it."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: {e.strerror if isinstance(e, OSError) else e}") from e
    lines = text.splitlines()
    require(lines, f"--prompts {path}: no prompt in it")
    for i, line in enumerate(lines, 1):
        require(line.strip(), f"{path}: line {i} is empty (one prompt a line)")
    return lines


def _run_prompts(args, model, policy: TokenPolicy, prompts: list, sampler, params,
                 save: Path | None) -> int:
    """``run --prompts``: each prompt's result as ``run`` reports it, in input order, printed
    as soon as every prompt before it has finished; with ``save``, each row's session saved
    there as it stops."""
    done: dict[int, dict] = {}
    printed = 0

    def finished(i: int, result: dict, session) -> None:
        nonlocal printed
        if save is not None:
            _save(session, save / f"{capture.row_name(i)}.pbs")
        done[i] = result
        while printed in done:
            result = done.pop(printed)
            if not args.json:
                _echo(result["text"])
            _report(args, result)
            printed += 1

    run_rows(model, policy, prompts, sampler, args.batch, max_new_tokens=args.max_new_tokens,
             ignore_eos=args.ignore_eos, capacity=args.capacity, cache_params=params,
             on_result=finished, tape=open_batch_tape(args, model, sampler, params))
    return 0


def _run_session(args) -> dict:
    """``run --session FILE``: the saved session goes on, with its own arena, sampler and cache
    parameters; with ``--capture`` its capture starts from the state the file restored."""
    settled = settled_by_session(args)
    if settled:
        raise UserError(f"{', '.join(settled)}: not with --session (the session goes on with "
                        "its own prompt, arena, sampler and cache parameters)")
    save = _save_to(args)
    name, dtype = saved_model(args.session)
    model = cli_model(args, args.model or name, args.dtype or dtype)
    session = load_session(model, args.session)
    if args.capture is not None:
        session.record(open_tape(args, model, session.sampler, session.cache_params,
                                 session.prompt_ids), args.session)
    result = drive(session, args.max_new_tokens, args.ignore_eos, None if args.json else _echo)
    if save is not None:
        _save(session, save)
    return result


def _report(args, result: dict) -> int:
    """Print a run's result: its JSON, or a summary line after the streamed text."""
    if args.json:
        json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    steps = result["steps"]
    if not args.json and steps:
        ms = sorted(s["ms"] for s in steps)[len(steps) // 2]
        kv = result["kv"]
        print(f"[{len(steps)} tokens, median {ms:.1f} ms/token, cache {steps[-1]['cache_len']} "
              f"slots ({kv['pairs']:,} K/V pairs, {kv['bytes'] / 2 ** 20:.2f} MiB, "
              f"{kv['fraction']:.0%} of the full cache), {Totals(**result['totals']).edits()}, "
              f"stop: {result['stop_reason']}]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    return flags.main(args, BENCHES[args.kind])  # its parser took only its own flags


def cmd_fork(args) -> int:
    result = fork.fork(capture.resolve_run(args.run_dir, args.row), args.step,
                       options.given(args), fork.sampler_overrides(args), args.max_new_tokens, args.capture,
                       args.capture_level, args.command, args.device,
                       None if args.json else _echo)
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
    return replay.main(args.run_dir, args.stage, args.step, device=args.device, row=args.row)


def cmd_inspect(args) -> int:
    return inspector.main(args.path, args.step, args.last, html=args.html, row=args.row)


def _saved_model(args, path: str):
    """The model a session file was saved from, unless --model / --dtype say otherwise."""
    name, dtype = saved_model(path)
    return load_model(args.model or name, args.dtype or dtype, args.device)


def cmd_compose(args) -> int:
    recompute = percents(args)  # before the (slower) model load
    model = _saved_model(args, args.files[0])
    continuation = None if args.measure is None else TokenPolicy(model.tokenizer).encode(args.measure)
    out = compose.compose_files(model, args.files, args.out, continuation, recompute,
                                args.select_layer)
    if args.json:
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    parts = " + ".join(f"{p['label']} {p['cached']}" + ("" if p["layers"] is None else
                                                       f" (layers {spans(p['layers'])})")
                       for p in out["parts"])
    print(f"[composed {parts} cached tokens: {out['cached']} at positions < "
          f"{out['next_position']}"
          + (f", {out['cold']} cold" if out["cold"] else "") + f" -> {out['out']}]")
    if "measure" in out:
        print_tables(measure_tables(out["measure"]))
    return 0


def cmd_export(args) -> int:
    filters = {"uids": None if args.uids is None else partial.parse_span(args.uids, "--uids"),
               "sources": None if args.source is None else tuple(args.source.split(",")),
               "min_brightness": args.min_brightness,
               "layers": None if args.layers is None else partial.parse_layers(args.layers)}
    out = partial.export_file(_saved_model(args, args.file), args.file, args.out, **filters)
    print(json.dumps(out) if args.json else f"[exported {out['rows']} of {out['of']} cached "
          f"tokens, layers {spans(out['layers'])} of {out['n_layers']} -> {out['out']}]")
    return 0


def measure_tables(m: dict) -> list[Table]:
    """``compose --measure``'s report as tables: the deviation per layer, then the
    continuation's NLL under each cache."""
    d = m["deviation"]
    layers = tuple((str(i), f"{k:.4f}", f"{v:.4f}")
                   for i, (k, v) in enumerate(zip(d["layer_k"], d["layer_v"])))
    nll = m["nll"]
    rows = [("composed", "0", f"{nll['composed']:.4f}", "0", f"{d['k']:.4f}", f"{d['v']:.4f}"),
            ("joint prefill", str(m["tokens"]), f"{nll['joint']:.4f}", "1", "0", "0")]
    rows += [(f"recompute {r['percent']:g}%", str(r["rows"]), f"{r['nll']:.4f}",
              fmt(r["gap_closed"], 3), f"{r['deviation']['k']:.4f}", f"{r['deviation']['v']:.4f}")
             for r in m["recompute"]]
    return [Table("Deviation from a joint prefill of the same text, per layer: ||composed - "
                  "joint|| / ||joint||", ("layer", "K", "V"),
                  layers + (("all", f"{d['k']:.4f}", f"{d['v']:.4f}"),)),
            Table(f"The continuation's NLL ({m['continuation']} tokens) under each cache",
                  ("cache", "rows recomputed", "NLL", "gap closed", "K deviation",
                   "V deviation"), tuple(rows),
                  f"Rows recomputed: those whose values deviate most at layer "
                  f"{m['select_layer']}. Gap closed: (composed - NLL) / (composed - joint).")]


def cmd_calibrate(args) -> int:
    """``calibrate``: the retrieval heads chosen, written where ``--out`` says (checked
    before the work), their scores as a table or JSON."""
    out = output_file(args.out)
    sizes = lengths(args.lengths)
    model = cli_model(args, args.model, args.dtype)
    found = (calibrate.at_random(model, args.fraction, args.seed) if args.random else
             calibrate.calibrate(model, TokenPolicy(model.tokenizer), args.trials, sizes,
                                 args.fraction, args.seed, args.framing))
    written = calibrate.write(found, out)
    heads = [[int(a), int(b)] for a, b in found.heads.nonzero().tolist()]
    if args.json:
        print(json.dumps({"model": model.name, "dtype": model.precision, "trials": found.trials,
                          "steps": found.steps, "fraction": args.fraction,
                          "scores": found.scores.tolist(), "heads": heads,
                          "out": str(written)}))
        return 0
    kv = found.scores.shape[1]
    rows = tuple((str(layer), *(f"{float(x):.3f}{' *' if c else ''}"
                                for x, c in zip(found.scores[layer], found.heads[layer])))
                 for layer in range(found.scores.shape[0]))
    title = ("heads drawn at random (* chosen)" if args.random else f"attention on the key "
             f"({found.trials} trials, {found.steps} answer tokens; * chosen)")
    print_tables([Table(title, ("layer", *(f"KV head {h}" for h in range(kv))), rows)])
    print(f"[{len(heads)} of {found.heads.numel()} heads -> {written}: "
          f"--allocation duo --allocation-heads {written}]", file=sys.stderr)
    return 0


def cmd_transfer(args) -> int:
    reads = (args.text,) if args.action == "train" else (args.session, args.projector)
    out = output_file(args.out, *reads)
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
        fitted = "" if report["kl_fit"] is None else f"{report['kl_fit']:.4f} (fit) -> "
        print(f"held-out KL {report['kl_before']:.4f} -> {fitted}{report['kl_after']:.4f} "
              f"nats/token "
              f"({report['held_out_windows']} windows of {params.prefix} + "
              f"{params.continuation} tokens; {params.steps} steps, {report['seconds']:.0f} s) "
              f"-> {out}")
    return 0
