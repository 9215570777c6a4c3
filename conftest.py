"""Session-scoped fixtures: the real model is loaded (and primed) once per test session;
tests that need no weights use the tiny random model."""
from __future__ import annotations

import os

import pytest
import torch

from positronic_brain.model import load_model  # the package sets the offline environment
from positronic_brain.special_tokens import TokenPolicy

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# A fixed English text, long enough for the long-context tests, shipped with Python itself.
LONG_TEXT_TOPIC = "assignment"


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct, float32 (the oracle tests' tolerance is for fp32)."""
    return load_model("smollm2", "float32")


@pytest.fixture(scope="session")
def real_policy(real_model):
    return TokenPolicy(real_model.tokenizer)


@pytest.fixture(scope="session")
def tiny_model():
    return load_model("tiny-random", "float32")


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
    from positronic_brain.types import CacheParams, SamplerParams

    cache = CacheParams(budget=24, sinks=2, recent=6, repair="merge", max_merges=1,
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
