"""llama.cpp as bench speed's contender: why it is not measured where it cannot be, the
targets it brings, and (where llama_cpp and its converter are installed: make
bench-llamacpp) that it decodes the same model at a fixed context."""
import dataclasses
import importlib.util

import pytest

from positronic_brain.bench import llamacpp
from positronic_brain.bench.result import Machine
from positronic_brain.bench.speed import (DecodeRow, LlamacppRow, PrefillRow, SpeedConfig,
                                          SpeedResult, targets)
from positronic_brain.model import load_model


def test_without_llama_cpp_the_reason_is_given(monkeypatch, tiny_model):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert "llama_cpp is not installed" in llamacpp.unavailable(tiny_model, "float32")


def test_without_the_converter_the_reason_is_given(monkeypatch, tmp_path):
    tiny_model = load_model("tiny-random", "float32", "cpu")  # llama.cpp runs on the CPU
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    monkeypatch.setattr(llamacpp.sys, "prefix", str(tmp_path))
    assert "convert_hf_to_gguf.py was not found" in llamacpp.unavailable(tiny_model, "float32")
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.converter() == tmp_path / "convert_hf_to_gguf.py"
    # a model built in memory has no folder for the converter to read
    assert "no Hugging Face folder" in llamacpp.unavailable(tiny_model, "float32")
    assert "no llama.cpp counterpart" in llamacpp.unavailable(tiny_model, "float16")


def _decode(dtype, n, ours, hf, llama=None):
    more = dict(llamacpp_ms=llama, llamacpp_ratio=ours / llama, llamacpp_agrees=True) if llama else {}
    return DecodeRow(dtype=dtype, context=n, ours_ms=ours, hf_ms=hf, ratio=ours / hf,
                     floor_ms=0.5 * ours, **more)


def _prefill(dtype, tokens, ratio, window_ratio=None):
    """A prefill row with its ratios (its times are not read by the targets)."""
    return PrefillRow(dtype=dtype, tokens=tokens, hf_ms=1.0, hf_tok_s=1.0, ours_ms=1.0,
                      ours_tok_s=1.0, ratio=ratio, window_ratio=window_ratio)


def _result(prefill, decode):
    """A CPU run's speed result of these rows; llama.cpp measured in float32 only."""
    return SpeedResult(benchmark="speed", command="", model="tiny-random", quick=True,
                       machine=Machine.now(), config=SpeedConfig(device="cpu"),
                       bandwidth_gb_s=1.0, peak_rss_mb=0.0, prefill=prefill, decode=decode,
                       llamacpp=[LlamacppRow("float32", True),
                                 LlamacppRow("bfloat16", False, "not installed")])


def test_targets_compare_with_llama_cpp_where_measured_else_with_the_yardstick():
    res = _result([_prefill(d, t, 0.9 if d == "float32" else 1.1, 1.05)
                   for d in ("float32", "bfloat16") for t in (256, 1024, 4096)],
                  [_decode("float32", n, 10.0, 20.0, 12.0) for n in (256, 1024)]
                  + [_decode("bfloat16", n, 10.0, 50.0) for n in (256, 1024, 2048, 4096)])
    got = {(t.dtype, t.what): (round(t.value, 3), t.target, t.met) for t in targets(res)}
    # float32: every context against llama.cpp F32 (10 / 12 = 0.83 <= 0.9)
    assert got[("float32", "stage 1 / llama.cpp decode at 256 (same precision)")] == (0.833, "<= 0.9", True)
    assert ("float32", "stage 1 / llama.cpp decode at 1024 (same precision)") in got
    # bfloat16 without llama.cpp: the in-run yardstick at 1024 and 4096 (10 / 50 = 0.2)
    yard = "(the yardstick where llama.cpp is not measured)"
    assert got[("bfloat16", f"stage 1 / HF decode at 1024 {yard}")] == (0.2, "<= 0.25", True)
    assert got[("bfloat16", f"stage 1 / HF decode at 4096 {yard}")] == (0.2, "<= 0.2", True)
    assert not any("2048" in what and "yardstick" in what for _, what in got)
    assert got[("bfloat16", "share of the bandwidth limit at 1024 (floor / stage 1)")] == \
        (0.5, ">= 0.6", False)
    assert got[("float32", "stage 0 / HF prefill tokens/s at 1024")] == (0.9, ">= 1.0", False)
    assert got[("bfloat16", "stage 0 / HF prefill tokens/s at 4096")] == (1.1, ">= 1.0", True)
    assert not any("prefill tokens/s at 256" in what for _, what in got)
    window = ("float32", "stage 0 / HF prefill tokens/s at 1024, with the prompt's window")
    assert got[window] == (1.05, ">= 1.0", True)
    res.prefill = [_prefill("float32", 1024, 1.2)]  # a run from before
    assert [t.what for t in targets(res) if "prefill" in t.what] == [
        "stage 0 / HF prefill tokens/s at 1024"]
    assert not any("native" in what for _, what in got)  # no native stage 1 in this run


def test_a_native_stage1_is_held_to_the_same_targets():
    """Where the run has stage 1 with native kernels, it gets the rows stage 1 gets beyond
    HF's: against llama.cpp where measured, else the yardstick, and the bandwidth share."""
    decode = [_decode("float32", 1024, 10.0, 20.0, 12.0), _decode("bfloat16", 1024, 10.0, 50.0)]
    # native: 8 / 12 = 0.67 of llama.cpp; 5 / 50 of HF
    decode = [dataclasses.replace(r, native_ms=ms, native_hf_ratio=ms / r.hf_ms,
                                  native_llamacpp_ratio=ms / r.llamacpp_ms if r.llamacpp_ms else None)
              for r, ms in zip(decode, (8.0, 5.0))]
    res = _result([], decode)
    got = {(t.dtype, t.what): (round(t.value, 3), t.met) for t in targets(res)}
    yard = "(the yardstick where llama.cpp is not measured)"
    assert got[("float32", "stage 1 native / llama.cpp decode at 1024 (same precision)")] == \
        (0.667, True)
    assert got[("bfloat16", f"stage 1 native / HF decode at 1024 {yard}")] == (0.1, True)
    assert got[("bfloat16", "share of the bandwidth limit at 1024 (floor / stage 1 native)")] \
        == (1.0, True)  # floor 5 ms / 5 ms


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_llama_cpp_decodes_the_same_model_at_a_fixed_context(dtype):
    from positronic_brain.model import load_model
    from positronic_brain.sampler import make_generator
    from positronic_brain.special_tokens import TokenPolicy
    from positronic_brain.stages.apply import prime
    from positronic_brain.stages.generate import generate
    from positronic_brain.types import SamplerParams, Segment

    model = load_model("smollm2", dtype)
    why = llamacpp.unavailable(model, dtype)
    if why:
        pytest.skip(why)
    ids = TokenPolicy(model.tokenizer).encode(
        "The capital of France is Paris. The capital of Italy is Rome. The capital of "
        "Spain is Madrid. The capital of Germany is")
    state, _ = prime(model, [Segment(tuple(ids), "user")], capacity=len(ids) + 4)
    ours = generate(model, state.view(), SamplerParams(greedy=True), make_generator(0)).token_id
    llama = llamacpp.Contender(model, dtype, n_ctx=64)
    try:
        llama.prefill(ids[:-1])
        first = llama.decode(ids[-1])
        assert llama.decode(ids[-1]) == first  # the context stayed at len(ids) - 1
        assert llama.llm.n_tokens == len(ids)
        assert first == ours, model.tokenizer.decode([first, ours])
    finally:
        llama.close()
