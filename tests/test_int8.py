"""``--dtype int8``: weight-only int8 (per output row, symmetric) products over bfloat16
activations and K/V. Its oracle is Hugging Face's forward on the same weights: the model's
modules hold the dequantized values, so HF computes with what the int8 products read."""
import json

import pytest
import torch
import torch.nn.functional as F

from positronic_brain import forward as forward_module
from positronic_brain.cli import main as cli
from positronic_brain.forward import INT8_INPUTS, INT8_ROWS, linear
from positronic_brain.loop import Session
from positronic_brain.model import (MATRICES, TINY_CONFIGS, Int8Weight, check_dtype, load_model,
                                    quantize)
from positronic_brain.replay import replay
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.apply import apply, prime
from positronic_brain.stages.generate import generate
from positronic_brain.types import SamplerParams, UserError
from tests.oracle import hf_prompt_logits, hf_step_logits
from tests.tolerance import half_oracle, step, sum_bound, unit

TINY = [n for n in TINY_CONFIGS if n.startswith("tiny-random")]
# Logits are held to HF's by ``half_oracle``, relative to the largest: 4 steps of bfloat16
# through the tiny models, 8 through SmolLM2's 30 layers, where on the prompt below bfloat16
# itself, whose products have F.linear's bits, has reached 3.7 and the int8 product, which
# rounds otherwise, 5.8.


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())


def _product_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None = None) -> bool:
    """``got`` (an int8 product of ``x`` by ``w``, plus ``b``) within rounding of ``want``
    (float32, of the dequantized weight ``w``): the sum in float32 in another order; the
    bfloat16 weight's rounding (above ``INT8_ROWS``), the result's and its sum with the
    bias's, half a step each."""
    mag = x.float().abs() @ w.float().abs().t() + (0 if b is None else b.float().abs())
    bound = (sum_bound(torch.float32, x.shape[1] + 1) + 1.5 * step(torch.bfloat16)) * mag
    return bool(((got.float() - want).abs() <= bound).all())


@pytest.mark.parametrize("name", TINY)
def test_int8_weights_are_what_hf_computes_with(name):
    """Every projection and the lm_head are int8 with a bfloat16 scale per output row,
    |q| <= 127; HF's modules hold views of the dequantized bfloat16 values (the embedding
    too where it is tied to the lm_head), within half a step of the bfloat16 weights."""
    model, ref = load_model(name, "int8"), load_model(name, "bfloat16")
    assert model.precision == "int8" and model.dtype == torch.bfloat16
    assert model.fingerprint["dtype"] == "int8"
    for i, (w, r) in enumerate(zip(model.layers, ref.hf.model.layers)):
        hf = model.hf.model.layers[i]
        plain = {"qkv_w": [r.self_attn.q_proj, r.self_attn.k_proj, r.self_attn.v_proj],
                 "o_w": [r.self_attn.o_proj], "gate_up_w": [r.mlp.gate_proj, r.mlp.up_proj],
                 "down_w": [r.mlp.down_proj]}
        for name_ in MATRICES:
            q = getattr(w, name_)
            assert isinstance(q, Int8Weight) and q.q.dtype == torch.int8, name_
            assert q.scale.dtype == torch.bfloat16 and q.scale.shape == (q.shape[0],)
            assert int(q.q.abs().max()) <= 127
            exact = q.q.float() * q.scale.float()[:, None]
            assert torch.equal(q.plain, exact.bfloat16()), f"{name_}: plain is not q * scale"
            before = torch.cat([m.weight for m in plain[name_]]).float()
            # half a step of the scale, and the float32 rounding of w / scale (below 128)
            half = q.scale.float()[:, None] * (0.5 + 128 * unit(torch.float32))
            assert bool(((exact - before).abs() <= half).all())
        assert hf.self_attn.o_proj.weight.data_ptr() == w.o_w.plain.data_ptr()
        assert torch.equal(hf.self_attn.q_proj.weight, w.qkv_w.plain[: hf.self_attn.q_proj.weight.shape[0]])
    assert model.hf.lm_head.weight.data_ptr() == model.lm_head.plain.data_ptr()
    if model.hf.config.tie_word_embeddings:
        assert model.embed.data_ptr() == model.lm_head.plain.data_ptr()


def test_int8_product_is_the_exact_product_to_bfloat16_rounding():
    """A decode row and a few rows multiply by the int8 weight; more than ``INT8_ROWS`` by its
    bfloat16 values; either is the float32 product of the dequantized weight to within
    bfloat16's rounding of the result, with or without a bias."""
    model = load_model("tiny-random", "int8")
    g = torch.Generator().manual_seed(0)
    for name in MATRICES:
        w = getattr(model.layers[1], name)
        exact = w.q.float() * w.scale.float()[:, None]
        for rows in (1, 3, INT8_ROWS, INT8_ROWS + 1, 40):
            x = torch.randn(rows, w.shape[1], generator=g).bfloat16()
            b = torch.randn(w.shape[0], generator=g).bfloat16()
            want = x.float() @ exact.t()
            assert _product_close(linear(x, w), want, x, exact), (name, rows)
            got = linear(x, w, b)
            assert _product_close(got, want + b.float(), x, exact, b), (name, rows, "bias")
        x = torch.randn(INT8_ROWS + 1, w.shape[1], generator=g).bfloat16()
        assert torch.equal(linear(x, w), F.linear(x, w.plain))  # a prefill chunk's product


def test_an_int8_weight_of_any_input_size_multiplies_correctly():
    """torch's int8 product gives garbage (or crashes) unless the inputs are a multiple of
    ``INT8_INPUTS``: a weight of another size multiplies by its bfloat16 values."""
    g = torch.Generator().manual_seed(1)
    for inputs in (40, 100, 16):
        w = quantize(torch.randn(13, inputs, generator=g).bfloat16())
        x = torch.randn(1, inputs, generator=g).bfloat16()
        exact = w.q.float() * w.scale.float()[:, None]
        assert _product_close(linear(x, w), x.float() @ exact.t(), x, exact), inputs
        if inputs % INT8_INPUTS:
            assert torch.equal(linear(x, w), F.linear(x, w.plain)), inputs


@pytest.mark.parametrize("widen", [True, False])
@pytest.mark.parametrize("name", TINY)
def test_int8_prefill_and_stage1_equal_hf_on_the_same_weights(monkeypatch, name, widen):
    """The prefill attends through the fused kernel with ``WIDEN`` (Intel without AMX) and
    builds its scores without (any other CPU)."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    model = load_model(name, "int8")
    policy = TokenPolicy(model.tokenizer)
    ids = policy.raw_prompt("int8 weights, bfloat16 activations, and still the oracle")
    state, out = prime(model, ids, capacity=96)
    flat = [i for s in ids for i in s.ids]
    assert _rel(out.logits[-1], hf_prompt_logits(model, flat[:-1])[-1]) <= half_oracle(model)
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=1), state=state)
    for _ in range(8):
        view = session.state.view()
        gen = generate(model, view, session.sampler, session.generator)
        assert gen.k.dtype == torch.bfloat16
        assert _rel(gen.logits, hf_step_logits(model, view)) <= half_oracle(model), f"{name} step"
        apply(model, session.state, gen)


@pytest.mark.parametrize("widen", [True, False])
def test_real_model_int8_follows_hf_greedily(monkeypatch, real_policy, widen):
    """SmolLM2 in int8: 16 greedy steps, each step's logits within bfloat16 rounding of HF's on
    the same weights, and the same next token: HF's argmax or, where HF's bfloat16 logits tie
    (argmax takes the first), one of the tied tokens. The prompt's prefill with ``WIDEN``
    and without."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    model = load_model("smollm2", "int8")
    session = Session(model, real_policy, SamplerParams(greedy=True))
    session.prime(real_policy.raw_prompt("The capital of France is"))
    for _ in range(16):
        view = session.state.view()
        gen = generate(model, view, session.sampler, session.generator)
        want = hf_step_logits(model, view)
        assert want[gen.token_id] == want.max() and _rel(gen.logits, want) <= half_oracle(model)
        apply(model, session.state, gen)


def test_int8_runs_on_the_cpu_only():
    with pytest.raises(UserError, match="CPU only"):
        check_dtype("int8", torch.device("cuda"))


@pytest.mark.parametrize("widen", [True, False])
def test_int8_capture_replays_bit_exact(monkeypatch, tmp_path, capsys, widen):
    monkeypatch.setattr(forward_module, "WIDEN", widen)  # either prefill replays its bits
    args = ["run", "--model", "tiny-random", "--dtype", "int8", "--prompt", "int8 capture",
            "--max-new-tokens", "10", "--ignore-eos", "--seed", "3", "--budget", "8", "--sinks",
            "1", "--recent", "2", "--capture", str(tmp_path), "--json"]
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "int8"
    report = replay(out["capture"])
    assert report.ok and report.tolerance is None
