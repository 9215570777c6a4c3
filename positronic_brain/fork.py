"""Fork a captured run at step T: what if these options had been in charge from there?

The state the run had before step T is rebuilt from its event log (the prime or restored
session, chat turns and stage-4 patches, as replay rebuilds it); then generation goes on with
the run's own cache and sampler parameters, each replaced by any given here. With none given,
the fork reproduces the parent to its end bit for bit (the sampler's generator takes the
state it had before step T, unless the seed changes). A fork's capture holds the parent's
files of the steps before T, byte for byte, then its own, and names its parent run and step:
it replays like any capture. Forced tokens (teacher forcing) are not carried on: a fork
samples. A fork keeps the parent's arena (its capacity) and cold store: recall cannot be
switched on where the parent had none. A row of a batch capture (``--row``) forks alone: its
stage 1 from T on reads that row only, not one product over the batch's rows, so the fork
follows the row within float rounding, not bit for bit, and its capture replays within the
dtype's tolerance (the steps copied from the batch's row ran in that product).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from . import native
from . import options
from .capture import CaptureTape, manifest_params, reads_capture
from .loop import Session, drive
from .model import device_kind
from .replay import open_run, rebuild
from .plain import to_plain
from .scorers import user
from .special_tokens import TokenPolicy
from .types import SamplerParams, require

# the parent's manifest keys a fork's capture does not inherit (its own run's)
OWN = ("format", "run_id", "level", "created", "versions", "complete", "stop_reason",
       "last_step", "last_file", "files", "parent", "scorer_sha256", "batch")


@reads_capture
def fork(run_dir: str | Path, step: int, cache: dict | None = None, sampler: dict | None = None,
         max_new_tokens: int | None = None, capture: str | None = None,
         level: str = "light", command: str = "", device: str | None = None,
         on_text=None) -> dict:
    """Fork the capture ``run_dir`` before its step ``step`` with ``cache`` and ``sampler``
    overrides (cache options by their flat names, ``options``; SamplerParams fields); ``max_new_tokens`` defaults to what the
    parent had left from there. Returns the fork's run as ``loop.run`` does, plus its
    parent."""
    run, model = open_run(run_dir, device=device)
    manifest, steps = run.manifest, run.steps
    require(step in steps, f"step {step} is not in this capture (steps "
            f"{f'1..{steps[-1]}' if steps else 'none'})")
    params = manifest["params"]
    was = manifest_params(manifest)
    require(was is not None, f"{run_dir}: its manifest records no cache parameters")
    cache = dict(cache or {})
    if "policy" in cache:
        cache["policy"] = user.absolute(cache["policy"])
    cache_params = options.cache_params(cache, was)  # a bad scorer refused before the rebuild
    old_sampler = SamplerParams(**_tuples(params["sampler"]))
    new_sampler = dataclasses.replace(old_sampler, **(sampler or {}))
    args = params.get("args", {})
    left = args.get("max_new_tokens", step) - (step - 1)
    max_new_tokens = left if max_new_tokens is None else max_new_tokens
    require(max_new_tokens >= 0, f"max-new-tokens must be >= 0, got {max_new_tokens}")
    state, tokens = rebuild(run, model, step)
    state.check_valid()
    at = run.step(step)
    require(at is not None, f"step {step} was not captured whole; a fork cannot start there")
    require(not cache_params.recall or state.cold is not None,
            "the parent run has no cold store: a fork cannot switch recall on")
    require(cache_params.budget is None or cache_params.budget <= state.arena.capacity,
            f"budget {cache_params.budget} is more than the parent's arena of "
            f"{state.arena.capacity} slots")
    session = Session(model, TokenPolicy(model.tokenizer), new_sampler, cache_params,
                      state=state)
    if new_sampler.seed == old_sampler.seed:  # the generator as it was before step T
        session.generator.set_state(at.generate.args["generator_state"].cpu())
    session.prompt_ids = list(manifest.get("prompt_ids", []))
    session.generated_ids = list(tokens)
    ignore_eos = bool(args.get("ignore_eos", False))
    if capture is not None:  # made once everything the fork reads of its parent is read
        copied = run.files_before(step)
        own = {k: v for k, v in manifest.items() if k not in OWN}
        session.tape = CaptureTape(capture, {
            **own, "command": command, "device": str(model.device),
            "device_kind": _both(manifest.get("device_kind"), device_kind(model.device)),
            "kernels": _both(manifest.get("kernels"), native.for_model(model)),
            "params": {**params, "cache_params": to_plain(cache_params, json=True),
                       "sampler": dataclasses.asdict(new_sampler)},
            "scorer_sha256": user.file_sha256(cache_params.scorer.name),
            "parent": {"run": str(run.dir.resolve()), "run_id": manifest.get("run_id"),
                       "step": step, "batch": manifest.get("batch", {}).get(
                           "size", (manifest.get("parent") or {}).get("batch", 1))}},
            level=level)
        session.tape.copy_from(copied, step, state)
    out = drive(session, max_new_tokens, ignore_eos, on_text)
    return {**out, "parent": {"run": str(run.dir.resolve()), "step": step}}


def _both(parent, here):
    """What a fork's manifest records of something that decides its bits (``device_kind``,
    ``kernels``): ``here``'s, or, where the parent's (whose files before the fork are
    copied) differs, both, which no device or build matches, so that replay compares the
    fork within the dtype's tolerance and says so."""
    return here if parent == here else f"{parent} (the parent's steps), {here}"


def _tuples(d: dict) -> dict:
    """A manifest's parameters (JSON lists) as the dataclasses hold them (tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def overrides(args, fields) -> dict:
    """The options given on the command line among ``fields`` (the fork parser's defaults
    are None: a missing one keeps the parent's)."""
    return {f.name: getattr(args, f.name) for f in fields
            if getattr(args, f.name, None) is not None}


def sampler_overrides(args) -> dict:
    return overrides(args, dataclasses.fields(SamplerParams))
