"""The command line's arguments: the parser, and the parameter objects built from them.

Bad input gets one line on stderr and exit code 2 (``UserError``), never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from .. import native, options, threads
from ..bench import flags, passkey, quality, ruler, speed
from ..bench import transfer as transfer_bench
from ..blend import SELECT_LAYER, check_percents
from ..capture import NO_TAPE, BatchTape, CaptureTape, Tape, manifest
from ..model import COMPILERS, DTYPES, Model, load_model, resolve_device
from ..options import add_cache_args
from ..transfer import INITS, KINDS, TrainParams
from ..types import CacheParams, SamplerParams, UserError

PROG = "positronic-brain"
BENCHES = {"speed": speed, "quality": quality, "passkey": passkey, "ruler": ruler,
           "transfer": transfer_bench}

MODEL_HELP = ("smollm2 (default), a .gguf file (llama, mistral, qwen2), a local HF folder, "
              "or a tiny random model for tests: "
              "tiny-random, tiny-random-qwen2, tiny-random-mistral, tiny-random-llama3, "
              "tiny-random-wide; random-1b (a ~1B "
              "random Llama for GPU speed runs)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage too)
        raise UserError(message)


DEVICE_HELP = "cpu, cuda, cuda:N or auto (default: CUDA when available, else the CPU)"
DEVICE_MAP_HELP = ("instead of --device, the decoder layers over several devices: auto or "
                   "balanced (accelerate's infer_auto_device_map) or a JSON file "
                   "{\"layer index, range 0-3 or module name\": \"cuda:N|cpu\"}")


MODEL, DTYPE = "smollm2", "float32"  # --model and --dtype unless given (or a file says)
AUTO = "auto"  # --compile's default: native where its kernels build (the fastest measured)


def _add_model_args(p: argparse.ArgumentParser, session: bool = False) -> None:
    """``session``: ``run``'s, where a session file names its model (the defaults are None)."""
    p.add_argument("--model", default=None if session else MODEL,
                   help=MODEL_HELP + ("; with --session, the file's unless given" if session
                                      else ""))
    p.add_argument("--dtype", default=None if session else DTYPE, choices=tuple(DTYPES),
                   help=f"default {DTYPE}" + (", or with --session the file's" if session else ""))
    where = p.add_mutually_exclusive_group()
    where.add_argument("--device", default="auto", help=DEVICE_HELP)
    where.add_argument("--device-map", default=None, metavar="auto|balanced|PATH.json",
                       help=DEVICE_MAP_HELP)
    p.add_argument("--compile", nargs="?", const=COMPILERS[0], default=AUTO,
                   choices=(AUTO, "none") + COMPILERS,
                   help="auto (default): stage 1 through native kernels built for this CPU "
                        "(make install builds them), the fastest measured, where they build, "
                        "else the plain path (a note on stderr says why); none: the plain "
                        "path; --compile: through torch.compile (the first step compiles, "
                        "tens of seconds); native: the native kernels or an error; graph: "
                        "replayed as a CUDA graph on a GPU (captured at the first step of "
                        "each power-of-two context; docs/DESIGN.md, stage 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's threads (default: the cores free when the run starts, at "
                        "most torch's own default; positronic_brain/threads.py)")


def cli_model(args, name: str, dtype: str) -> Model:
    """The model a command runs, on the threads ``--threads`` or the machine's free cores
    give (``threads.use``), placed by ``--device`` / ``--device-map`` and ``--compile``."""
    threads.use(args.threads)
    placement = model_placement(args)
    if args.compile == AUTO:  # the faster path: native where it pays and runs, else plain
        placement["compile"], note = ("", None) if args.device_map is not None else \
            native.auto([resolve_device(args.device)], dtype)
        if note:  # where it would pay but cannot run: say why
            print(f"positronic-brain: {note}", file=sys.stderr)
    return load_model(name, dtype, **placement)


def model_placement(args) -> dict:
    """``load_model``'s placement arguments from ``--device`` / ``--device-map``, and
    ``--compile``."""
    where = ({"device_map": args.device_map} if args.device_map is not None
             else {"device": args.device})
    return {**where, "compile": args.compile}


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

    _add_run_args(sub.add_parser("run", help="generate from a prompt, or go on from a saved "
                                 "session"))
    _add_bench_args(sub)
    _add_inspect_args(sub)
    _add_chat_args(sub)
    _add_compose_args(sub)
    _add_transfer_args(sub)
    _add_export_args(sub)
    _add_calibrate_args(sub)
    return parser


def _add_saved_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device and --json of a command over session files."""
    p.add_argument("--model", default=None, help="the model the sessions were saved from "
                   "(default: the one the first file names); " + MODEL_HELP)
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                   help="default: the first file's")
    p.add_argument("--device", default="cpu", help=DEVICE_HELP.replace("CUDA when available, "
                                                                       "else the CPU", "cpu"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead")


def _add_run_args(run: argparse.ArgumentParser) -> None:
    start = run.add_mutually_exclusive_group(required=True)
    start.add_argument("--prompt")
    start.add_argument("--session", metavar="FILE.pbs", default=None,
                       help="go on from a saved (or composed) session instead of a prompt, with "
                       "its own arena, sampler and cache parameters")
    start.add_argument("--prompts", metavar="FILE", default=None,
                       help="one prompt a line (- for stdin), each run as --prompt would run it; "
                       "with --json one object a prompt, a line each, in input order")
    run.add_argument("--batch", type=int, default=1, metavar="B",
                     help="with --prompts: run B prompts at a time, one stage-1 forward a step "
                     "for all of them, each with a cache of its own (default 1: one at a time)")
    run.add_argument("--system", default=None,
                     help="format as chat turns: this system prompt, then the prompt as the user")
    run.add_argument("--chat", action="store_true",
                     help="format the prompt as a user chat turn (no system prompt unless --system)")
    run.add_argument("--bos", default="auto", choices=("auto", "yes", "no"),
                     help="add the BOS token explicitly (auto: if the model family expects it)")
    _add_model_args(run, session=True)
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--capacity", type=int, default=None,
                     help="arena slots (default: prompt + max-new-tokens, within the model's positions)")
    _add_sampler_args(run)
    run.add_argument("--ignore-eos", action="store_true")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    run.add_argument("--save", metavar="PATH", default=None,
                     help="save the session when it stops (go on with --session PATH); with "
                     "--prompts PATH is a folder, one file a prompt (row-NNNNNN.pbs, from 0)")
    add_cache_args(run)
    _add_capture_args(run)


# The run options that go with --session; the others are the file's to say.
WITH_SESSION = ("session", "model", "dtype", "device", "device_map", "compile", "max_new_tokens",
                "ignore_eos", "json", "capture", "capture_level", "save")


def settled_by_session(args) -> list[str]:
    """The ``run`` options given beside ``--session`` (not at their defaults) that the session
    file settles: the prompt, the arena, the sampler and the cache parameters."""
    run = _Parser()
    _add_run_args(run)
    return [a.option_strings[0] for a in run._actions if a.option_strings
            and a.dest not in WITH_SESSION + ("help",)
            and getattr(args, a.dest, a.default) != a.default]


def _add_compose_args(sub) -> None:
    cp = sub.add_parser("compose", help="join saved sessions of one model into one context "
                        "(each part's keys re-rotated to its new positions; a partial "
                        "session's missing layers rebuilt)")
    cp.add_argument("files", metavar="FILE.pbs", nargs="+",
                    help="session files, whole or partial (export), in text order")
    cp.add_argument("--out", required=True, metavar="OUT.pbs", help="the composed session file")
    _add_saved_model_args(cp)
    g = cp.add_argument_group("measure (how far the composition is from a joint prefill of "
                              "its text; see docs/SESSIONS.md: compose)")
    g.add_argument("--measure", default=None, metavar="TEXT",
                   help="the text that follows the composed context: report each layer's K/V "
                   "deviation from a joint prefill and this text's NLL under both caches")
    g.add_argument("--recompute", default=None, metavar="R[,R...]",
                   help="with --measure: also re-run the R%% of tokens whose values deviate "
                   "most (CacheBlend's selective recompute) and report the gap each closes; "
                   "the file holds the cache recomputed at the last R")
    g.add_argument("--select-layer", type=int, default=SELECT_LAYER, metavar="N",
                   help=f"the layer whose value deviation selects them (default {SELECT_LAYER}, "
                   "the first whose K/V depend on other tokens)")


def percents(args) -> tuple[float, ...]:
    """``--recompute 5,10,100`` -> (5.0, 10.0, 100.0), each in (0, 100]; it needs
    ``--measure``. Anything else is a one-line UserError."""
    if args.recompute is None:
        return ()
    if args.measure is None:
        raise UserError("--recompute needs --measure TEXT (the continuation whose NLL it reports)")
    try:
        out = tuple(float(x) for x in args.recompute.split(","))
    except ValueError:
        raise UserError(f"--recompute takes comma-separated percentages, got "
                        f"{args.recompute!r}") from None
    check_percents(out)
    return out


def _add_export_args(sub) -> None:
    ex = sub.add_parser("export", help="write some of a session's cached tokens and layers to "
                        "a partial session file (import it with compose)")
    ex.add_argument("file", metavar="FILE.pbs", help="a session file")
    ex.add_argument("--out", required=True, metavar="OUT.pbs", help="the partial session file")
    ex.add_argument("--uids", default=None, metavar="LO-HI",
                    help="only tokens whose uid is in LO-HI (inclusive)")
    ex.add_argument("--source", default=None, metavar="S[,S...]",
                    help="only tokens of these sources (system, user, assistant, tool)")
    ex.add_argument("--min-brightness", type=float, default=None, metavar="B",
                    help="only tokens at least this bright")
    ex.add_argument("--layers", default=None, metavar="0-11,20-29",
                    help="only these layers' K/V (default: every layer)")
    _add_saved_model_args(ex)


def _add_capture_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capture (see docs/CAPTURE.md: capture, replay, inspect)")
    g.add_argument("--capture", metavar="DIR", default=None,
                   help="save every stage call's inputs and outputs to DIR/<run-id>/ (with "
                   "--prompts, one run folder a prompt: DIR/<run-id>/row-NNNNNN/)")
    g.add_argument("--capture-level", default="light", choices=("light", "full"),
                   help="full also saves the whole live state before each step")


ROW_HELP = "a batch capture's row (0 for the first prompt; a row's own folder names it too)"


def _add_inspect_args(sub) -> None:
    rp = sub.add_parser("replay", help="re-run a captured run's stages and compare bit for bit")
    rp.add_argument("run_dir", metavar="DIR", help="a capture run folder (or a root with one run)")
    rp.add_argument("--stage", default=None, help="compare only this stage (s0_prime ... "
                    "s4_apply, s0_extend, s0_restore)")
    rp.add_argument("--step", type=int, default=None, help="compare only this step")
    rp.add_argument("--row", type=int, default=None, metavar="I", help=ROW_HELP + "; the "
                    "batch is replayed whole, its rows stepping together, and only this row "
                    "compared")
    rp.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: the "
                    "capture's device if this machine has it, else the CPU; on another device "
                    "than the capture's, outputs are compared with a tolerance)")
    fk = sub.add_parser("fork", help="continue a captured run from step T with other cache or "
                        "sampler options (those not given stay the run's)")
    fk.add_argument("run_dir", metavar="DIR", help="a capture run folder (or a root with one run)")
    fk.add_argument("--step", type=int, required=True, metavar="T",
                    help="the step the fork takes over at (the parent's steps before it stay)")
    fk.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens from step T on (default: what the parent had left)")
    fk.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    fk.add_argument("--device", default=None, help="as for replay")
    fk.add_argument("--row", type=int, default=None, metavar="I", help=ROW_HELP + "; the "
                    "fork goes on alone")
    _add_sampler_args(fk)
    add_cache_args(fk)
    _add_capture_args(fk)
    keep = {"run_dir", "step", "max_new_tokens", "json", "device", "row", "capture",
            "capture_level", "help", *options.NAMES}
    fk.set_defaults(**{a.dest: None for a in fk._actions if a.dest not in keep})
    cp = sub.add_parser("compare", help="where captured runs of one prompt part, and what "
                        "each had forgotten where its loss jumped")
    cp.add_argument("run_dirs", metavar="DIR", nargs="+", help="two or more capture run folders")
    cp.add_argument("--jump", type=float, default=1.0,
                    help="a jump: NLL at least this many nats above the best run's (default 1)")
    cp.add_argument("--top", type=int, default=5, help="forgotten tokens listed per jump")
    cp.add_argument("--last", type=int, default=None, help="steps the NLL table shows (default "
                    "20) or the page holds (default 400)")
    cp.add_argument("--json", action="store_true", help="print one JSON object instead")
    cp.add_argument("--html", default=None, metavar="OUT.html", help="write one self-contained "
                    "page instead: the runs side by side at a step slider, NLL curves, jumps")
    ip = sub.add_parser("inspect", help="show a captured run (or one capture file)")
    ip.add_argument("path", metavar="PATH")
    ip.add_argument("--row", type=int, default=None, metavar="I", help=ROW_HELP)
    ip.add_argument("--step", type=int, default=None, help="the step whose context to show "
                    "(default: the last)")
    ip.add_argument("--last", type=int, default=None, help="how many steps the table shows "
                    "(default 30) or the page holds (default 400)")
    ip.add_argument("--html", default=None, metavar="OUT.html", help="write one self-contained "
                    "page instead: the text coloured by brightness at a step slider, edits "
                    "marked, cache-length and NLL curves, each token's ledger row on hover")


def _add_bench_args(sub) -> None:
    """``bench KIND``: a subcommand per benchmark, with the shared flags and its own, made
    from its config's fields (``bench.flags``)."""
    bench = sub.add_parser("bench", help="benchmarks (see docs/BENCHMARKS-GUIDE.md)")
    kinds = bench.add_subparsers(dest="kind", required=True, parser_class=_Parser)
    for name, module in BENCHES.items():
        p = kinds.add_parser(name, help=module.__doc__.split(":", 1)[1].strip().split("\n")[0])
        flags.add_shared(p, MODEL_HELP)
        flags.add_flags(p, module.FLAGS, f"bench {name} (see docs/BENCHMARKS-GUIDE.md)")


def _add_chat_args(sub) -> None:
    ch = sub.add_parser("chat", help="an interactive chat whose cache stays at a fixed budget")
    ch.add_argument("--system", default=None,
                    help="the system prompt, pinned in the cache (none unless given)")
    ch.add_argument("--script", metavar="FILE", default=None,
                    help="read user turns (and /commands) from FILE, one per line ('-': stdin), "
                    "and print the replies")
    ch.add_argument("--json", action="store_true", help="with --script: one JSON line per turn")
    ch.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply")
    ch.add_argument("--bos", default="auto", choices=("auto", "yes", "no"),
                    help="add the BOS token explicitly (auto: if the model family expects it)")
    _add_model_args(ch)
    _add_sampler_args(ch)
    add_cache_args(ch)
    _add_capture_args(ch)


def _add_calibrate_args(sub) -> None:
    ca = sub.add_parser("calibrate", help="choose --allocation duo's retrieval heads: the heads "
                        "that read a pass-key's tokens the most while the model answers it")
    ca.add_argument("--out", required=True, metavar="HEADS.json",
                    help="the heads file --allocation-heads reads (a layers x KV heads 0/1 grid)")
    ca.add_argument("--trials", type=int, default=8, help="pass-key prompts (default 8)")
    ca.add_argument("--lengths", default="1024", metavar="N[,N...]",
                    help="their lengths in tokens, in turn (default 1024)")
    ca.add_argument("--fraction", type=float, default=0.25,
                    help="the share of (layer, KV head)s chosen (default 0.25)")
    ca.add_argument("--framing", default="raw", choices=("raw", "chat"),
                    help="the prompts as raw text or as a chat turn (as bench passkey's)")
    ca.add_argument("--seed", type=int, default=1, help="the trials' keys and depths (default "
                    "1: other prompts than bench passkey's, seed 0)")
    ca.add_argument("--random", action="store_true", help="choose the --fraction at random "
                    "(seeded) instead: the baseline to measure a choice against")
    ca.add_argument("--json", action="store_true", help="print one JSON object instead")
    _add_model_args(ca)


def lengths(text: str) -> tuple[int, ...]:
    """``--lengths N[,N...]``: positive token counts."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--lengths {text!r}: token counts, comma-separated") from None
    return out


def _add_transfer_args(sub) -> None:
    tr = sub.add_parser("transfer", help="carry a session's cache to another model through a "
                        "trained K/V projector (docs/DESIGN.md: cross-model transfer)")
    actions = tr.add_subparsers(dest="action", required=True, parser_class=_Parser)
    train = actions.add_parser("train", help="train a projector of one model's K/V into "
                               "another's cache; prints the held-out KL before and after")
    apply = actions.add_parser("apply", help="a session file of the source model as one of "
                               "the target model")
    apply.add_argument("session", metavar="A.pbs", help="a session file of the source model")
    apply.add_argument("--projector", required=True, metavar="P.safetensors")
    for p in (train, apply):
        p.add_argument("--source", required=True, help="the model whose K/V are projected: "
                       + MODEL_HELP)
        p.add_argument("--target", required=True, help="the model they are projected into "
                       "(the same tokenizer)")
        p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
        p.add_argument("--device", default="auto", help=DEVICE_HELP)
    apply.add_argument("--out", required=True, metavar="B.pbs",
                       help="the target model's session file")
    train.add_argument("--text", required=True, help="topics (Python's help topics), jargon "
                       "(Debian's jargon-text) or a UTF-8 file: trained on its first part, the "
                       "KL reported on the rest")
    train.add_argument("--out", required=True, metavar="P.safetensors")
    d = TrainParams()
    train.add_argument("--steps", type=int, default=d.steps, help="Adam steps")
    train.add_argument("--lr", type=float, default=d.lr, help="Adam's learning rate")
    train.add_argument("--no-fit", dest="fit", action="store_false",
                       help="skip the least-squares fit of the linear maps before the Adam "
                       "steps (train on the KL alone)")
    train.add_argument("--batch", type=int, default=d.batch, help="windows a step")
    train.add_argument("--prefix", type=int, default=d.prefix,
                       help="a window's tokens cached by the source and projected")
    train.add_argument("--continuation", type=int, default=d.continuation,
                       help="a window's tokens the target runs over the projected cache")
    train.add_argument("--holdout", type=float, default=d.holdout,
                       help="the text's last fraction, on which the KL is reported")
    train.add_argument("--eval-windows", type=int, default=d.eval_windows,
                       help="the most held-out windows measured")
    train.add_argument("--kind", default=d.kind, choices=KINDS,
                       help="linear, or linear plus a gated MLP branch per layer")
    train.add_argument("--hidden", type=int, default=d.hidden, help="the MLP branch's width")
    train.add_argument("--init", default=d.init, choices=INITS,
                       help="random (semi-orthogonal), identity, or perturbed (the identity "
                       "plus --noise)")
    train.add_argument("--noise", type=float, default=d.noise,
                       help="perturbed: the noise's size relative to the identity")
    train.add_argument("--seed", type=int, default=d.seed)
    train.add_argument("--json", action="store_true", help="print one JSON object instead")


def train_params(args) -> TrainParams:
    """``transfer train``'s parameters, checked before any model loads."""
    return TrainParams(steps=args.steps, lr=args.lr, fit=args.fit, batch=args.batch,
                       prefix=args.prefix,
                       continuation=args.continuation, holdout=args.holdout,
                       eval_windows=args.eval_windows, kind=args.kind, hidden=args.hidden,
                       init=args.init, noise=args.noise, seed=args.seed)


def cache_params(args) -> CacheParams:
    """The cache parameters of ``run``/``chat``, checked (the scorer too) before any model loads."""
    return options.from_args(args)


def sampler_params(args) -> SamplerParams:
    return SamplerParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty, seed=args.seed)


def open_tape(args, model, sampler: SamplerParams, params: CacheParams,
              prompt_ids: list[int]) -> Tape:
    """The tape for ``--capture`` (none without it); its manifest holds every parameter."""
    if args.capture is None:
        return NO_TAPE
    return CaptureTape(args.capture, _manifest(args, model, sampler, params, prompt_ids),
                       level=args.capture_level)


def open_batch_tape(args, model, sampler: SamplerParams, params: CacheParams) -> BatchTape | None:
    """``run --prompts``' tape for ``--capture`` (None without it): each row's manifest holds
    every parameter and its own prompt."""
    if args.capture is None:
        return None
    return BatchTape(args.capture, _manifest(args, model, sampler, params, []),
                     args.capture_level, args.batch)


def _manifest(args, model, sampler: SamplerParams, params: CacheParams,
              prompt_ids: list[int]) -> dict:
    return manifest(model, sampler, params, prompt_ids, args.command,
                    {k: v for k, v in vars(args).items() if k != "command"})
