"""Every kind of file the project reads, corrupted by Hypothesis: session files (whole,
composed, partial), capture files (stage files, state files, the manifest), projector files
and the user scorer file whose sha256 a capture recorded.

Corruptions: bit flips, truncation at any byte, zeroed blocks and edits of the safetensors
header, as they come (a signed file's sha256 no longer matches, a capture file's no longer
matches its manifest's), or re-signed after an edit: tensors of other shapes, dtypes or
values, keys dropped or added, JSON or plain-data values of the wrong type, negative, huge or
unknown, entries dropped or added, and capture manifests that are valid JSON but wrong.

Each corruption is refused in one line (``UserError``: exit 2 on the command line, no
traceback, no output file left behind) or reads as a state that passes ``check_valid`` and
goes on: a loaded session steps, a capture replays (a difference it finds is a mismatch
report, not an error). A corruption that was not re-signed is refused wherever the file is
read, or reads as the very state the file held. Each valid file is built once per module;
most corruptions go through the functions the commands call, a few through the command line
itself (in this process)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from positronic_brain import options
from positronic_brain import compare, fork, inspector, replay
from positronic_brain.capture import FORMAT, CaptureTape, resolve_run, sha256
from positronic_brain.chat import Chat
from positronic_brain.cli import main as cli
from positronic_brain.compose import compose_files
from positronic_brain.loop import Session
from positronic_brain.model import load_model
from positronic_brain.partial import save_partial
from positronic_brain.plain import digest
from positronic_brain.session_io import load_session, save_session, saved_model
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.transfer import (KVShape, Projector, apply_projector, load_projector,
                                       save_projector)
from positronic_brain.types import CacheParams, SamplerParams, UserError

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])

PROMPT = "a captured run"
CAPTURES = ("primed", "restored", "chat")  # the capture runs whose files are corrupted
SCORER = textwrap.dedent('''
    """Keep the tokens whose values are longest."""
    from dataclasses import dataclass

    from positronic_brain.types import ScoreOut


    @dataclass(frozen=True)
    class LongValues:
        def score(self, view, attention):
            return ScoreOut(scores=view.vnorm.float().mean(dim=(0, 1)))
''')

# What a JSON or plain-data value may be replaced by: wrong types, negative, huge, not
# finite, unknown, empty, a saved type of no such name.
WRONG = [-1, -2 ** 63, 2 ** 64, 10 ** 30, 0, 1.5, -0.5, float("inf"), float("nan"), "", "x",
         "s1_generate", "positronic-brain-session/99", None, True, False, [], {}, [1, 2],
         {"__type__": "Nope"}, {"__tuple__": [1]}, {"__pairs__": [[1]]}]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32,
          torch.int64, torch.uint8, torch.bool]
FILLS = [float("nan"), float("inf"), -float("inf"), -1.0, 1e30, 0.0, 2.0 ** 40, -2.0 ** 40]
SHAPES = ["drop last", "add last", "unsqueeze", "flatten", "empty", "transpose"]


# --- the valid files, built once --------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_thread_here():
    """One thread for the whole module, its valid files included (tiny-model ops are too
    small to split, and a prefill's rounding depends on the split)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models():
    return load_model("tiny-random"), load_model("tiny-random-wide")


def _captured(root: Path, *argv: str) -> Path:
    """A capture run of ``run argv`` (tiny-random, 2 steps) under ``root``."""
    assert cli(["run", "--device", "cpu", "--compile", "none", "--max-new-tokens", "2",
                "--ignore-eos", *argv,
                "--capture", str(root)]) == 0
    return resolve_run(root)


@pytest.fixture(scope="module")
def made(tmp_path_factory, models) -> dict:
    """Every valid file: session files (one with a cold store and merges, another, the two
    composed, a partial export), projector files (linear, mlp), a user scorer's file and
    capture runs (primed, restored from a session file, a chat of two turns, each at level
    full; run by the user scorer)."""
    model, wide = models
    policy = TokenPolicy(model.tokenizer)
    d = tmp_path_factory.mktemp("valid")
    a = Session(model, policy, SamplerParams(temperature=1.0, top_k=40, seed=11),
                options.params(budget=20, sinks=2, recent=4, recall=True, repair="merge",
                            max_merges=1))
    a.prime(policy.raw_prompt("a session that culls and recalls"), 64)
    for _ in range(12):
        a.step()
    assert a.state.cold.n > 0 and a.state.ledger.merged
    b = Session(model, policy, SamplerParams(greedy=True))
    b.prime(policy.raw_prompt("a second part"), 40)
    b.step()
    out = {"a": save_session(a, d / "a.pbs"), "b": save_session(b, d / "b.pbs"),
           "ab": d / "ab.pbs", "part": d / "part.pbs"}
    compose_files(model, [out["a"], out["b"]], out["ab"])
    save_partial(a, out["part"], uids=(0, 40), layers=(1,))
    gen = torch.Generator().manual_seed(0)
    src, tgt = KVShape.of(model), KVShape.of(wide)
    for kind, hidden in (("linear", 0), ("mlp", 8)):
        p = Projector(src, tgt, kind=kind, hidden=hidden)
        p.initialise("random", gen, 0.0, *((torch.randn(s.layers, s.kv_heads, 32, s.head_dim,
                                                         generator=gen),) * 2
                                           for s in (src, tgt)))
        out[kind] = save_projector(p, d / f"{kind}.safetensors")
    out["scorer"] = d / "mine.py"
    out["scorer"].write_text(SCORER)
    tiny, sampled = ["--model", "tiny-random"], ["--temperature", "0.9", "--seed", "3"]
    out["primed"] = _captured(d / "primed", *tiny, *sampled, "--prompt", PROMPT, "--budget", "12",
                              "--sinks", "2", "--recent", "4", "--repair", "merge", "--recall",
                              "--capture-level", "full")
    out["restored"] = _captured(d / "restored", "--session", str(out["a"]),
                                "--capture-level", "full")
    out["scored"] = _captured(d / "scored", *tiny, *sampled, "--prompt", PROMPT, "--budget", "12",
                              "--sinks", "2", "--recent", "4",
                              "--policy", f"{out['scorer']}:LongValues")
    cache, sampler = CacheParams(budget=96, sinks=2, recent=4), SamplerParams(temperature=0.9)
    tape = CaptureTape(d / "chat", {
        "model": model.name, "dtype": "float32", "fingerprint": model.fingerprint,
        "device": "cpu", "params": {"cache_params": dataclasses.asdict(cache),
                                    "sampler": dataclasses.asdict(sampler)}}, level="full")
    chat = Chat(model, policy, system="You are terse.", sampler=sampler, cache_params=cache,
                max_new_tokens=1, tape=tape)
    for turn in ("one", "two"):  # the second turn: stage 0 between steps (s0_extend)
        chat.say(turn)
    tape.close(chat.session.stop_reason)
    out["chat"] = tape.dir
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory, made) -> Path:
    """Where corrupted copies go: the capture runs are copied here, and every file an example
    changes is put back after it."""
    w = tmp_path_factory.mktemp("work")
    for name in CAPTURES + ("scored",):
        shutil.copytree(made[name], w / name)
    return w


# --- checks ---------------------------------------------------------------------------------

def refused_or(read):
    """``read()``'s result, or None where it refused in one clear line (a ``UserError``);
    anything else it raises fails the test."""
    try:
        return read()
    except UserError as e:
        message = str(e)
        assert message.strip() and "\n" not in message and len(message) < 1000, message
        return None


def goes_on(session: Session) -> None:
    """A loaded session's state is valid and steps (stages 1-4) to a valid state."""
    session.state.check_valid()
    session.step()
    session.state.check_valid()


def saved(session: Session, path: Path) -> tuple[dict, dict]:
    """A session as a file holds it: its metadata and tensors (not the file's bytes, whose
    metadata safetensors writes in no fixed order)."""
    return safetensors_parts(save_session(session, path).read_bytes())[1:]


def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    """Whether two ``saved`` sessions are the same."""
    return a[0] == b[0] and sorted(a[1]) == sorted(b[1]) and all(
        torch.equal(t, b[1][k]) for k, t in a[1].items())


# --- corruptions ----------------------------------------------------------------------------

def damage_bytes(data, raw: bytes) -> bytes:
    """Bit flips, a truncation at any byte, or a zeroed block of ``raw``."""
    n, out = len(raw), bytearray(raw)
    how = data.draw(st.sampled_from(["flip", "truncate", "zero"]), label="damage")
    if how == "flip":
        for at in data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4), label="at"):
            out[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif how == "truncate":
        del out[data.draw(st.integers(0, n - 1), label="length"):]
    else:
        start = data.draw(st.integers(0, n - 1), label="start")
        end = min(n, start + data.draw(st.integers(1, 4096), label="zeroed"))
        out[start:end] = bytes(end - start)
    return bytes(out)


def _paths(obj, at=()) -> list[tuple]:
    """Every path into nested dicts, lists and tuples (of a list, its first, middle and last
    items only), the root first."""
    out = [at]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, at + (k,))
    elif isinstance(obj, (list, tuple)) and obj:
        for i in sorted({0, len(obj) // 2, len(obj) - 1}):
            out += _paths(obj[i], at + (i,))
    return out


def damage_tensor(data, t: torch.Tensor) -> torch.Tensor:
    """``t`` of another shape, another dtype, or with a value replaced (not finite, negative,
    huge)."""
    how = data.draw(st.sampled_from(["shape", "dtype", "value"]), label="tensor")
    if how == "dtype":
        return t.to(data.draw(st.sampled_from(DTYPES), label="dtype"))
    if how == "shape":
        shape = data.draw(st.sampled_from(SHAPES), label="shape")
        last = t.shape[-1] if t.dim() else 0
        if shape == "drop last" and last:
            return t[..., :-1].contiguous()
        if shape == "add last" and last:
            return torch.cat([t, t[..., -1:]], -1)
        if shape == "flatten":
            return t.reshape(-1)
        if shape == "empty":
            return t.reshape(-1)[:0]
        if shape == "transpose" and t.dim() >= 2:
            return t.transpose(0, -1).contiguous()
        return t.unsqueeze(0)
    t = t.clone()
    if t.numel():
        at = data.draw(st.integers(0, t.numel() - 1), label="index")
        if t.dtype == torch.bool:
            fill = not bool(t.reshape(-1)[at])
        elif t.is_floating_point():
            fill = data.draw(st.sampled_from(FILLS), label="fill")
        else:
            info = torch.iinfo(t.dtype)
            fill = data.draw(st.sampled_from([-1, info.max, info.min]), label="fill")
        t.reshape(-1)[at] = fill
    return t


DROP = object()  # what an edit returns to drop the value it was given


def _edited(obj, path: tuple, edit):
    """Nested plain data ``obj`` with the value at ``path`` replaced by ``edit(value)`` (or
    dropped where it returns ``DROP``); the containers on the path rebuilt, nothing changed
    in place."""
    if not path:
        return edit(obj)
    key, value = path[0], _edited(obj[path[0]], path[1:], edit)
    if isinstance(obj, dict):
        out = dict(obj)
    else:
        out = list(obj)
    if value is DROP:
        del out[key]
    else:
        out[key] = value
    return tuple(out) if isinstance(obj, tuple) else out


def damage_plain(data, obj, tensors: bool = False, under: tuple | None = None):
    """Nested plain data ``obj`` with one value replaced (by one of ``WRONG``; a tensor also
    by ``damage_tensor`` where ``tensors``), dropped, or an entry added to a container; the
    value at ``under`` or inside it (default: the root, or an entry of the top level drawn
    first, so that each gets its share)."""
    if under is None and isinstance(obj, dict):
        under = data.draw(st.sampled_from([()] + [(k,) for k in obj]), label="under")
    paths = [p for p in _paths(obj) if p[:len(under or ())] == (under or ())]
    path = data.draw(st.sampled_from(paths), label="path")
    how = data.draw(st.sampled_from(["replace", "drop", "add"]), label="edit")

    def edit(value):
        if how == "drop" and path:
            return DROP
        if how == "add" and isinstance(value, dict):
            return {**value, "extra": data.draw(st.sampled_from(WRONG), label="added")}
        if how == "add" and isinstance(value, (list, tuple)):
            return value + type(value)([value[-1] if value else 1])
        if tensors and isinstance(value, torch.Tensor) and data.draw(st.booleans(),
                                                                     label="as a tensor"):
            return damage_tensor(data, value)
        return copy.deepcopy(data.draw(st.sampled_from(WRONG), label="value"))

    return _edited(obj, path, edit)


def safetensors_parts(raw: bytes) -> tuple[dict, dict, dict]:
    """A safetensors file's header (its tensor table), metadata and tensors."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return header, header.pop("__metadata__", {}), st_load(raw)


def damage_signed(data, raw: bytes) -> tuple[bytes, bool]:
    """A signed safetensors file (session, projector) corrupted: its bytes as they are, or
    its header's table edited (neither re-signed); or, re-signed or not, a metadata entry
    edited, a tensor dropped, added, or of another shape, dtype or value. Returns the bytes
    and whether they were re-signed."""
    how = data.draw(st.sampled_from(["bytes", "table", "meta", "meta", "drop", "add", "tensor",
                                     "tensor", "tensor"]), label="how")
    if how == "bytes":
        return damage_bytes(data, raw), False
    header, meta, tensors = safetensors_parts(raw)
    if how == "table":
        name = data.draw(st.sampled_from(sorted(header)), label="entry")
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="key")
        header[name][key] = data.draw(st.sampled_from(
            {"dtype": ["F16", "I64", "BOOL", "U8", "F64", "XX"],
             "shape": [[], [0], [1, 2, 3], [10 ** 12], [-1]],
             "data_offsets": [[0, 0], [0, 10 ** 9], [5, 3], [-1, 4]]}[key]), label="value")
        table = json.dumps({"__metadata__": meta, **header}).encode()
        table += b" " * (-len(table) % 8)
        return len(table).to_bytes(8, "little") + table + raw[8 + int.from_bytes(
            raw[:8], "little"):], False
    resign = data.draw(st.sampled_from([True, True, True, False]), label="re-signed")
    if how == "meta":
        key = data.draw(st.sampled_from(sorted(k for k in meta if k != "sha256")), label="meta")
        edit = data.draw(st.sampled_from(["json", "text", "drop"]), label="meta edit")
        if edit == "drop":
            del meta[key]
        elif edit == "text":
            meta[key] = data.draw(st.sampled_from(["", "x", "{", "null", "[]", "1e999"]),
                                  label="text")
        else:
            try:
                meta[key] = json.dumps(damage_plain(data, json.loads(meta[key])))
            except ValueError:  # the format: a plain string
                meta[key] = data.draw(st.sampled_from([str(w) for w in WRONG]), label="format")
    elif how == "drop":
        del tensors[data.draw(st.sampled_from(sorted(tensors)), label="dropped")]
    elif how == "add":
        name = data.draw(st.sampled_from(["ledger.extra", "cold.k", "arena.q", "k.extra",
                                          *sorted(tensors)]), label="added")
        tensors[name + ("" if name not in tensors else "x")] = torch.zeros(3)
    else:
        name = data.draw(st.sampled_from(sorted(tensors)), label="tensor name")
        tensors[name] = damage_tensor(data, tensors[name]).contiguous()
    if resign:
        meta["sha256"] = digest(meta, tensors)
    return st_save(tensors, metadata=meta), resign


# --- session files ----------------------------------------------------------------------------

SESSIONS = {"whole": "a", "composed": "ab", "partial": "part"}


def read_session(via: str, model, path: Path, other: Path, out: Path) -> Session | None:
    """The session file ``path`` read as ``run --session`` reads it (the model its header
    names, ``saved_model``, then ``load_session``) or as ``compose`` does (``compose_files``,
    after ``other`` where ``path`` is partial, else before it; the composed file loaded back
    and removed); None where it was refused, and a refused compose left no file."""
    if via == "run":
        named = refused_or(lambda: saved_model(path))
        if named is not None and named != ("tiny-random", "float32"):
            model = refused_or(lambda: load_model(*named))
        return None if named is None or model is None else refused_or(
            lambda: load_session(model, path))
    parts = [other, path] if path.name == "part.pbs" else [path, other]
    if refused_or(lambda: compose_files(model, parts, out)) is None:
        assert not out.exists()
        return None
    session = load_session(model, out)
    out.unlink()
    return session


@pytest.fixture(scope="module")
def expected(made, models, work) -> dict:
    """What each valid session file reads as, each way (``read_session``), saved again."""
    out = {}
    for kind, name in SESSIONS.items():
        path = work / made[name].name
        path.write_bytes(made[name].read_bytes())
        for via in ("run", "compose"):
            session = read_session(via, models[0], path, made["b"], work / "out.pbs")
            out[kind, via] = None if session is None else saved(session, work / "x.pbs")
    assert out["partial", "run"] is None and all(v for k, v in out.items() if k[1] == "compose")
    return out


@pytest.mark.parametrize("kind", sorted(SESSIONS))
@SETTINGS
@given(data=st.data())
def test_a_corrupted_session_file_is_refused_or_goes_on(kind, models, made, work, expected,
                                                        data):
    """Whole, composed and partial session files, read by ``run --session`` and by
    ``compose``."""
    original = made[SESSIONS[kind]]
    bad, resigned = damage_signed(data, original.read_bytes())
    path = work / original.name
    path.write_bytes(bad)
    via = data.draw(st.sampled_from(["run", "compose"]), label="via")
    session = read_session(via, models[0], path, made["b"], work / "out.pbs")
    if session is None:
        return
    if not resigned:  # the bytes changed where no check reads them: the very same session
        assert same(saved(session, work / "x.pbs"), expected[kind, via])
    goes_on(session)


# --- projector files --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source_session(made, models) -> Session:
    return load_session(models[0], made["a"])


@SETTINGS
@given(data=st.data())
def test_a_corrupted_projector_file_is_refused_or_carries_a_session(models, made, work,
                                                                    source_session, data):
    """Linear and MLP projector files, read by ``transfer apply`` (``load_projector``); one
    that loads carries a session into the target model, which goes on."""
    kind = data.draw(st.sampled_from(["linear", "mlp"]), label="kind")
    bad, resigned = damage_signed(data, made[kind].read_bytes())
    path = work / "p.safetensors"
    path.write_bytes(bad)
    projector = refused_or(lambda: load_projector(path, *models))
    if projector is None:
        return
    if not resigned:
        valid = load_projector(made[kind], *models)
        assert projector.header == valid.header
        assert all(torch.equal(t, valid.state_dict()[k]) for k, t in projector.state_dict().items())
    session = refused_or(lambda: apply_projector(projector, source_session, models[1], "a.pbs"))
    if session is not None:
        goes_on(session)


# --- capture files ----------------------------------------------------------------------------

COMMANDS = ("replay", "fork", "inspect", "compare")


def capture_command(data, command: str, run: Path, made: dict, model, root: Path,
                    file: str | None = None, intact: bool = False) -> bool:
    """``command`` on the capture run ``run`` (a copy of ``made[run.name]``) through the
    function the command line calls: whether it went through (False: refused in one line).
    ``inspect`` may take the ``file`` alone; ``compare`` compares it with the valid run; a
    ``fork`` (from one of its steps) captures into ``root``: one that was refused left nothing
    there, one that went through captured a run that replays, bit for bit where the run's
    files are ``intact`` (the manifest's sha256 refuses any other), and a file the fork
    copies without reading is the parent's as the manifest signed it."""
    if command == "replay":
        return refused_or(lambda: replay.main(str(run), None, None, out=io.StringIO())) is not None
    if command == "inspect":
        path = run / file if file and data.draw(st.booleans(), label="the file alone") else run
        return refused_or(lambda: inspector.main(str(path), out=io.StringIO())) is not None
    if command == "compare":
        return refused_or(lambda: compare.main([str(run), str(made[run.name])])) is not None
    valid = json.loads((made[run.name] / "manifest.json").read_text())["files"]
    steps = sorted({int(n[:6]) for n in valid if n[:6].isdigit() and int(n[:6]) > 0})
    step = data.draw(st.sampled_from(steps), label="fork step")
    if refused_or(lambda: fork.fork(str(run), step, max_new_tokens=1, capture=str(root),
                                    command="fork")) is None:
        assert not root.exists() or not any(root.iterdir())
        return False
    report = refused_or(lambda: replay.replay(resolve_run(root), model=model))
    assert not intact or (report is not None and report.ok), report
    return True


@contextlib.contextmanager
def restored(*paths: Path):
    """``paths`` as they are now once the block ends (their bytes put back)."""
    saved = {p: p.read_bytes() for p in paths}
    try:
        yield
    finally:
        for p, b in saved.items():
            p.write_bytes(b)


@pytest.mark.parametrize("kind", ["stage", "state"])
@SETTINGS
@given(data=st.data())
def test_a_corrupted_capture_file_is_refused_or_replays(kind, models, made, work, data):
    """Stage files (stage 0's prime, restore and chat turn, stages 1-4) and state files of a
    primed, a restored and a chat run, damaged as they are or re-signed in the manifest (its
    sha256 of the file updated), read by ``replay``, ``fork``, ``inspect`` and ``compare``."""
    run = work / data.draw(st.sampled_from(CAPTURES), label="run")
    manifest = json.loads((run / "manifest.json").read_text())
    name = data.draw(st.sampled_from(sorted(n for n in manifest["files"]
                                            if n.startswith("state_") == (kind == "state"))),
                     label="file")
    raw = (run / name).read_bytes()
    with restored(run / name, run / "manifest.json"):
        if data.draw(st.booleans(), label="plain edit"):
            buf = io.BytesIO()
            torch.save(damage_plain(data, torch.load(io.BytesIO(raw), weights_only=True),
                                    tensors=True), buf)
            bad = buf.getvalue()
        else:
            bad = damage_bytes(data, raw)
        (run / name).write_bytes(bad)
        resigned = data.draw(st.sampled_from([True, True, False]), label="re-signed")
        if resigned:
            manifest["files"][name] = sha256(bad)
            (run / "manifest.json").write_text(json.dumps(manifest, indent=1))
        command = data.draw(st.sampled_from(COMMANDS), label="command")
        root = work / "fork"
        try:
            went = capture_command(data, command, run, made, models[0], root, name,
                                   intact=not resigned)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if command == "replay" and not resigned and bad != raw:
            assert not went, "replay read a file whose sha256 is not the manifest's"


@SETTINGS
@given(data=st.data())
def test_a_wrong_manifest_is_refused_or_replays(models, made, work, data):
    """The manifest of a primed, a restored and a chat run: damaged bytes, or valid JSON with
    a value of the wrong type, negative, huge or unknown, an entry dropped or added."""
    run = work / data.draw(st.sampled_from(CAPTURES), label="run")
    path = run / "manifest.json"
    raw = path.read_bytes()
    with restored(path):
        if data.draw(st.booleans(), label="bytes"):
            path.write_bytes(damage_bytes(data, raw))
        else:
            path.write_text(json.dumps(damage_plain(data, json.loads(raw)), indent=1))
        command = data.draw(st.sampled_from(COMMANDS), label="command")
        root = work / "fork"
        try:
            capture_command(data, command, run, made, models[0], root)
        finally:
            shutil.rmtree(root, ignore_errors=True)


# --- a user scorer's file -----------------------------------------------------------------------

SCORER_EDITS = [SCORER + "\n# edited\n", SCORER.replace("vnorm", "knorm"), "",
                SCORER.replace("LongValues", "Other"), "raise RuntimeError('not this one')\n"]


@SETTINGS
@given(data=st.data())
def test_a_changed_user_scorer_file_is_refused(models, made, work, data):
    """The file of a user scorer a capture ran (its sha256 in the manifest) damaged, edited
    or gone, or the manifest's record of it wrong: ``replay`` and ``fork`` refuse a file
    that is not the one recorded."""
    run, scorer = work / "scored", made["scorer"]
    raw = scorer.read_bytes()
    manifest = json.loads((run / "manifest.json").read_text())
    with restored(scorer, run / "manifest.json"):
        how = data.draw(st.sampled_from(["bytes", "edit", "gone", "record"]), label="how")
        if how == "bytes":
            scorer.write_bytes(damage_bytes(data, raw))
        elif how == "edit":
            scorer.write_text(data.draw(st.sampled_from(SCORER_EDITS), label="edit"))
        elif how == "gone":
            scorer.unlink()
        else:
            under = data.draw(st.sampled_from([("scorer_sha256",),
                                               ("params", "cache_params", "scorer")]),
                              label="record")
            (run / "manifest.json").write_text(json.dumps(damage_plain(data, manifest,
                                                                       under=under), indent=1))
        changed = not scorer.exists() or scorer.read_bytes() != raw
        command = data.draw(st.sampled_from(["replay", "fork"]), label="command")
        root = work / "fork"
        try:
            went = capture_command(data, command, run, made, models[0], root,
                                   intact=how != "record")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if changed:
            assert not went, "a scorer file other than the one captured was run"


# --- the command line ---------------------------------------------------------------------------

def _flipped(raw: bytes) -> bytes:
    return raw[:len(raw) // 2] + bytes([raw[len(raw) // 2] ^ 0x10]) + raw[len(raw) // 2 + 1:]


def _resigned(raw: bytes, edit) -> bytes:
    """A signed file's bytes after ``edit(meta, tensors)``, signed again."""
    _, meta, tensors = safetensors_parts(raw)
    edit(meta, tensors)
    return st_save(tensors, metadata={**meta, "sha256": digest(meta, tensors)})


def _session_meta(meta: dict, key: str, value) -> None:
    body = json.loads(meta["session"])
    body[key] = value
    meta["session"] = json.dumps(body)


def _shorter_k(meta: dict, tensors: dict) -> None:
    tensors["arena.k"] = tensors["arena.k"][..., :-1].contiguous()


def _half_precision(meta: dict, tensors: dict) -> None:
    tensors["k.weight"] = tensors["k.weight"].half()


RUN, COMPOSE, REPLAY = ["run", "--max-new-tokens", "1", "--session"], ["compose", "--out", "{out}"], \
    ["replay", "{run}"]
TRANSFER = ["transfer", "apply", "--source", "tiny-random", "--target", "tiny-random-wide",
            "--out", "{out}"]
FORK = ["fork", "{run}", "--step", "2", "--capture", "{fork}"]
# one corruption per line: (the file damaged, its damage, the command line)
CLI_CASES = {
    "run --session: a flipped bit": ("a.pbs", _flipped, RUN + ["{file}"]),
    "run --session: a truncated file": ("a.pbs", lambda raw: raw[:len(raw) // 3], RUN + ["{file}"]),
    "run --session: K re-signed a dim short": (
        "a.pbs", lambda raw: _resigned(raw, _shorter_k), RUN + ["{file}"]),
    "compose: a zeroed block in a partial file": (
        "part.pbs", lambda raw: raw[:4000] + bytes(2000) + raw[6000:], COMPOSE + ["{b}", "{file}"]),
    "compose: a capacity re-signed negative": (
        "ab.pbs", lambda raw: _resigned(raw, lambda m, t: _session_meta(m, "capacity", -1)),
        COMPOSE + ["{file}", "{b}"]),
    "transfer apply: a flipped bit in the session": (
        "a.pbs", _flipped, TRANSFER + ["{file}", "--projector", "{linear}"]),
    "transfer apply: a projector re-signed in float16": (
        "linear.safetensors", lambda raw: _resigned(raw, _half_precision),
        TRANSFER + ["{a}", "--projector", "{file}"]),
    "replay: a flipped bit in a stage file": ("000001_s2_score.pt", _flipped, REPLAY),
    "replay: a manifest of an unknown format": (
        "manifest.json", lambda raw: raw.replace(f'"format": {FORMAT}'.encode(), b'"format": 99'), REPLAY),
    "inspect: a truncated stage file alone": (
        "000002_s1_generate.pt", lambda raw: raw[:len(raw) // 2], ["inspect", "{file}"]),
    "inspect: a manifest listing a negative step": (
        "manifest.json", lambda raw: raw.replace(b'"last_step": 2', b'"last_step": -2')
        .replace(b"000002_s4", b"-00002_s4"), ["inspect", "{run}"]),
    "fork: a truncated state file": ("state_000001.pt", lambda raw: raw[:100], FORK),
    "compare: a zeroed stage-1 file": (
        "000001_s1_generate.pt", lambda raw: bytes(len(raw)), ["compare", "{run}", "{primed}"]),
    "replay: an edited scorer file": ("mine.py", lambda raw: raw + b"# edited\n", REPLAY),
    "fork: a scorer file gone": ("mine.py", lambda raw: None, FORK),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_the_command_line_refuses_in_one_line_and_writes_nothing(case, made, tmp_path, capsys):
    """A few corruptions of each kind through the command line itself: exit code 2, one
    line on stderr, no traceback, no output file."""
    what, damage, argv = CLI_CASES[case]
    run = shutil.copytree(made["scored" if what == "mine.py" else "primed"], tmp_path / "run")
    valid = made["scorer"].parent  # a user scorer's file is damaged where the capture ran it
    source = run / what if (run / what).exists() else valid / what
    target = source if source.parent != valid or what == "mine.py" else tmp_path / what
    paths = {"file": target, "run": run, "primed": made["primed"], "out": tmp_path / "out.pbs",
             "fork": tmp_path / "fork", **{k: made[k] for k in ("a", "b", "linear")}}
    with restored(source):
        bad = damage(source.read_bytes())
        if bad is None:
            target.unlink()
        else:
            target.write_bytes(bad)
        code = cli([a.format(**paths) for a in argv] + ["--device", "cpu"] * (argv[0] not in (
            "inspect", "compare")))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("positronic-brain: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and not paths["out"].exists() and not paths["fork"].exists()
