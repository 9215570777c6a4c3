"""``--compile``: stage 1's one-token forward through ``torch.compile`` (``inductor``) or
through native kernels (``--compile native``). Each rounds differently from the plain path,
so it is held to the same oracle (Hugging Face's forward on the same cache: ``ORACLE`` in
float32, bfloat16's rounding otherwise) and to the plain path; inductor's must be one graph
that a longer context does not compile again; a compiled capture replays bit for bit
(compiled the same way)."""
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from positronic_brain import forward as fw
from positronic_brain import model as model_module
from positronic_brain import native
from positronic_brain.cli import main as cli
from positronic_brain.loop import Session
from positronic_brain.model import PackedWeight, load_model, packable
from positronic_brain.replay import replay
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.apply import apply, prime
from positronic_brain.stages.generate import generate, stage1_forward
from positronic_brain.types import SamplerParams, UserError
from tests.oracle import assert_close, hf_step_logits, plain_step
from tests.tolerance import ORACLE, apart, half_oracle


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing and counts its own graphs and graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


CPU_CASES = [("tiny-random", "float32", "cpu"), ("tiny-random-qwen2", "float32", "cpu"),
             ("tiny-random-mistral", "float32", "cpu"), ("tiny-random-llama3", "float32", "cpu"),
             ("tiny-random", "int8", "cpu"), ("tiny-random-qwen2", "bfloat16", "cpu")]


@pytest.mark.parametrize("mode,name,dtype,device", [
    *(("inductor", *case) for case in CPU_CASES),
    pytest.param("inductor", "tiny-random", "float32", "cuda", marks=CUDA),
    pytest.param("inductor", "tiny-random-qwen2", "bfloat16", "cuda", marks=CUDA),
    *(("native", *case) for case in CPU_CASES), ("native", "tiny-random", "bfloat16", "cpu")])
def test_compiled_stage1_equals_hf_and_the_plain_path(mode, name, dtype, device):
    """Eight sampled steps over a growing cache: each compiled step's logits equal HF's on the
    same live K/V and the plain path's, its new K/V and attention row (the scorers' input)
    the plain path's; inductor's all ran one compiled graph, without a graph break."""
    model = load_model(name, dtype, device, compile=mode)
    plain = dataclasses.replace(model, compiled="")  # the same weights, uncompiled
    # bfloat16 on the CPU multiplies by oneDNN's packed weights, compiled too
    packed = dtype == "bfloat16" and device == "cpu" and packable()
    assert model.compiled and all(isinstance(w.qkv_w, PackedWeight) == packed
                                  for w in model.layers)
    policy = TokenPolicy(model.tokenizer)
    # primed by the plain copy, so the compiled model's first use is its first one-token call
    state, _ = prime(plain, policy.raw_prompt("compiled, and still the oracle"), capacity=96)
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=2), state=state)
    for i in range(8):
        view = session.state.view()
        gen = generate(model, view, session.sampler, session.generator)
        ref = plain_step(plain, view)
        # the native kernels ran, not their fallback
        assert mode != "native" or native.applies(
            model, view.k, view.token_id.new_tensor([view.pending_token]), None, False, None)
        want = hf_step_logits(model, view)
        n, last, size = view.n + 1, model.spec.n_layers - 1, float(want.abs().max())
        # the contracts: float32's, and in half precision a few bfloat16 steps (a bound summed
        # over the logits' sums tells nothing there: tolerance.half_oracle)
        half = half_oracle(model) * size
        assert_close(gen.logits, want, ORACLE if dtype == "float32" else half,
                     f"{name} step {i} vs HF")
        ours = apart(model, float(ref.logits.abs().max()), n) if dtype == "float32" else half
        assert_close(gen.logits, ref.logits[0], ours, f"{name} step {i} vs plain")
        # the last layer's attention weights (float32 in every dtype), each off by its own
        # size times its score's error: its norm, q/k/v, scores and softmax
        assert_close(gen.attention, ref.attention,
                     apart(model, float(ref.attention.abs().max()), n, last, 4),
                     f"{name} step {i} attention")
        # the last layer's new key: its norm, q/k/v and RoPE
        assert_close(gen.k, ref.k, apart(model, float(ref.k.abs().max()), n, last, 3),
                     f"{name} step {i} keys")
        assert gen.k.dtype == model.dtype
        apply(model, session.state, gen)
    assert mode != "inductor" or (counters["stats"]["unique_graphs"] == 1
                                  and not counters["graph_break"])


@pytest.mark.parametrize("mode", ("inductor", "native"))
def test_compiled_recall_query_equals_the_plain_path(mode):
    """With recall, stage 1 also returns each layer's query and log-sum-exp: compiled (by
    inductor, a graph of its own), they equal the plain path's."""
    model = load_model("tiny-random", "float32", compile=mode)
    state, _ = prime(model, TokenPolicy(model.tokenizer).raw_prompt("what recall asks"),
                     capacity=64)
    view = state.view()
    args = (view.k, view.v, view.token_id.new_tensor([view.pending_token]),
            view.token_id.new_tensor([view.next_position]))
    ours = stage1_forward(model)(model, *args, want_attention=True, want_query=True)
    ref = fw.forward(dataclasses.replace(model, compiled=""), *args, want_attention=True,
                     want_query=True)
    n, last = view.n + 1, model.spec.n_layers - 1
    # the last layer's query: its norm, q/k/v and RoPE
    assert_close(ours.query, ref.query,
                 apart(model, float(ref.query.abs().max()), n, last, 3), "query")
    # a log-sum-exp moves by its scores' errors weighted by their softmax a, and
    # sum a |s| <= |lse| + sum a (lse - s) = |lse| + entropy(a) <= |lse| + log n
    size = float(ref.lse.abs().max()) + math.log(n)
    assert_close(ours.lse, ref.lse, apart(model, size, n, last, 4), "log-sum-exp")
    assert mode != "inductor" or (counters["stats"]["unique_graphs"] == 1
                                  and not counters["graph_break"])


@pytest.mark.parametrize("repair,done,graphs", [("merge", "merged", 1), ("fold", "folded", 2)])
def test_only_stage1_compiles(capsys, repair, done, graphs):
    """A run with repairs: a merge's two forwards run uncompiled, so stage 1 is the only graph;
    with fold, stage 1 with a folded slot's log-mass is a second one. A longer context never
    compiles again, and nothing breaks a graph."""
    args = ["run", "--model", "tiny-random", "--compile", "--prompt", "repairs under a small "
            "budget, compiled", "--max-new-tokens", "24", "--ignore-eos", "--seed", "1",
            "--budget", "12", "--sinks", "1", "--recent", "2", "--repair", repair, "--json"]
    assert cli(args) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    assert totals[done] > 0, totals
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


def test_native_falls_back_to_the_plain_forward_where_it_does_not_apply():
    """float16 has no native kernels: its stage 1 runs ``forward``, the plain model's bits
    (as a prefill, a masked past or a split model do)."""
    model = load_model("tiny-random", "float16", compile="native")
    state, _ = prime(model, TokenPolicy(model.tokenizer).raw_prompt("half precision"),
                     capacity=32)
    view = state.view()
    args = (view.k, view.v, view.token_id.new_tensor([view.pending_token]),
            view.token_id.new_tensor([view.next_position]))
    assert not native.applies(model, view.k, args[2], None, False, None)
    ours = stage1_forward(model)(model, *args, want_attention=True)
    ref = fw.forward(dataclasses.replace(model, compiled=""), *args, want_attention=True)
    assert torch.equal(ours.logits, ref.logits) and torch.equal(ours.attention, ref.attention)


@pytest.mark.parametrize("flag,mode", [(["--compile"], "inductor"),
                                       (["--compile", "native"], "native")])
def test_compiled_capture_replays_bit_exact(tmp_path, capsys, flag, mode):
    """A compiled run's capture says how and replays compiled so, bit for bit."""
    args = ["run", "--model", "tiny-random", "--dtype", "int8", *flag, "--prompt",
            "a compiled capture", "--max-new-tokens", "8", "--ignore-eos", "--seed", "3",
            "--budget", "8", "--sinks", "1", "--recent", "2", "--capture", str(tmp_path), "--json"]
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    manifest = json.loads((Path(out["capture"]) / "manifest.json").read_text())
    assert manifest["compiled"] == mode == out["compiled"] and manifest["dtype"] == "int8"
    assert manifest["kernels"] == (native.build() if mode == "native" else None)
    report = replay(out["capture"])
    assert report.ok and report.tolerance is None and not report.notes
    if mode == "native":  # other native kernels (or none recorded): compared within tolerance
        path = Path(out["capture"]) / "manifest.json"
        for kernels, words in (("0123456789ab", "0123456789ab"), (None, "not recorded")):
            path.write_text(json.dumps({**manifest, "kernels": kernels}))
            report = replay(out["capture"])
            assert report.ok and report.tolerance is not None
            assert report.notes[0].startswith(
                f"captured on cpu with native kernels {words}, replayed on cpu with native "
                f"kernels {native.build()}: floating-point outputs compared within")
    with pytest.raises(UserError, match=f"ran {' '.join(['with', *flag])} and the model given "
                                        "runs without --compile"):
        replay(out["capture"], model=load_model("tiny-random", "int8"))


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("kernel,flags,total", [
    ("cold_max", ("--recall", "--recall-every", "2"), "recalled"),
    ("fold_into", ("--repair", "fold"), "folded")])
def test_a_native_run_scores_and_decides_natively_and_replays_bit_exact(
        tmp_path, capsys, monkeypatch, dtype, kernel, flags, total):
    """A native model's stages 2-3 run native kernels where there is one: recall's scan of
    the cold keys (``native.cold_max``) and fold's target search (``native.fold_into``);
    tokens come back or fold, and the capture replays it bit for bit."""
    calls = []
    real = getattr(native, kernel)
    monkeypatch.setattr(native, kernel, lambda *a: calls.append(1) or real(*a))
    args = ["run", "--model", "tiny-random", "--dtype", dtype, "--compile", "native",
            "--prompt", "bring back what the query attends to, " * 3, "--max-new-tokens", "24",
            "--ignore-eos", "--seed", "2", "--budget", "16", "--sinks", "1", "--recent", "2",
            *flags, "--capture", str(tmp_path), "--json"]
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["totals"][total] > 0 and len(calls) >= 12, (out["totals"], len(calls))
    calls.clear()
    report = replay(out["capture"])
    assert report.ok and report.tolerance is None and calls


def test_a_capture_from_before_compile_modes_replays_as_inductor():
    """Older captures say ``compiled: true`` for torch.compile."""
    assert model_module.compile_mode(True) == "inductor"
    assert model_module.compile_mode(False) == model_module.compile_mode(None) == ""
    with pytest.raises(UserError, match="compile must be one of inductor, native, graph, got 'jit'"):
        model_module.compile_mode("jit")


def test_compile_needs_a_compiler_on_the_cpu_and_triton_on_a_gpu(monkeypatch):
    monkeypatch.setattr(model_module.shutil, "which", lambda _: None)
    with pytest.raises(UserError, match="needs a C.. compiler"):
        load_model("tiny-random", "float32", compile=True)
    monkeypatch.setattr(model_module.importlib.util, "find_spec", lambda _: None)
    with pytest.raises(UserError, match="needs triton"):
        model_module.check_compile([torch.device("cuda", 0)])


def test_native_needs_the_cpu_a_compiler_and_ninja(monkeypatch):
    """Where the kernels cannot be built, loading says why in one line."""
    cpu = [torch.device("cpu")]
    with pytest.raises(UserError, match="--compile native runs on the CPU only"):
        model_module.check_compile([torch.device("cuda", 0)], "native")
    monkeypatch.setattr(model_module.shutil, "which", lambda _: None)
    with pytest.raises(UserError, match="--compile native on the CPU needs a C.. compiler"):
        model_module.check_compile(cpu, "native")
    monkeypatch.setattr(model_module.shutil, "which",
                        lambda name: None if name == "ninja" else name)
    real = model_module.importlib.util.find_spec
    monkeypatch.setattr(model_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "ninja" else real(name, *a))
    with pytest.raises(UserError, match="--compile native needs ninja"):
        model_module.check_compile(cpu, "native")


def test_compile_takes_only_its_modes(capsys):
    assert cli(["run", "--model", "tiny-random", "--compile", "jit", "--prompt", "x"]) == 2
    assert "invalid choice: 'jit'" in capsys.readouterr().err
