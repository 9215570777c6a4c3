"""Architectures: every tiny random config (Llama, Qwen2 with q/k/v biases, Mistral with a
sliding window, Llama-3 rope scaling) primes and generates exactly as Hugging Face does."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from positronic_brain.loop import Session
from positronic_brain.model import TINY_CONFIGS, byte_tokenizer, load_model
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.apply import apply, prime
from positronic_brain.stages.generate import generate
from positronic_brain.types import SamplerParams, Segment, UserError
from tests.oracle import assert_close, hf_prompt_logits, hf_step_logits
from tests.tolerance import ORACLE, step

STEPS = 8


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_prime_and_stage1_equal_hf(name, monkeypatch):
    if name == "random-1b":  # its shapes, on 2 of its 16 identical layers (its weights are GBs)
        monkeypatch.setitem(TINY_CONFIGS, name, TINY_CONFIGS[name] | {"num_hidden_layers": 2})
    model = load_model(name)
    policy = TokenPolicy(model.tokenizer)
    # the last step runs the last allowed position (the window's last one for Mistral); the
    # ~1B model (a plain Llama at GPU sizes: what it adds is its shapes) a shorter run, as
    # each of its steps costs an HF forward of seconds on a CPU
    steps, limit = (2, 48) if name == "random-1b" else (STEPS, 160)
    limit = min(model.spec.max_positions, limit)
    length = limit - steps + 1
    ids = (policy.encode("every architecture must match its own reference forward. ") * 3)[:length]
    assert len(ids) == length
    state, out = prime(model, [Segment(tuple(ids), "user")], capacity=limit,
                       chunk=48, all_logits=True)
    assert_close(out.logits, hf_prompt_logits(model, ids[:-1]), ORACLE, f"{name} prime logits")
    sampler = SamplerParams(temperature=1.0, seed=3)
    session = Session(model, policy, sampler, state=state)
    for _ in range(steps):
        view = state.view()
        gen = generate(model, view, sampler, session.generator)
        assert_close(gen.logits, hf_step_logits(model, view), ORACLE,
                     f"{name} stage-1 logits at position {view.next_position}")
        apply(model, state, gen)
    state.check_valid()
    assert state.next_position == limit


def test_llama3_rope_scaling_is_read_from_the_config():
    """transformers 5 keeps rope settings in config.rope_parameters; the model's own rotary
    embedding (which our forward calls) applies the llama3 frequency bands."""
    model = load_model("tiny-random-llama3")
    rp = model.hf.config.rope_parameters
    assert rp["rope_type"] == "llama3" and model.rotary.rope_type == "llama3"
    assert model.rotary.attention_scaling == 1.0
    d = model.spec.head_dim
    plain = 1.0 / rp["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    ratio = model.rotary.inv_freq / plain  # 1: high-frequency band, 1/factor: low, between: smoothed
    # the rotary's 1 / theta ** x against the test's: the power and the reciprocal a float32
    # step apart each at most (another pow kernel), 3 divisions (two by the factor) half a step
    assert ratio[0] == 1.0 and torch.isclose(ratio[-1], torch.tensor(1 / rp["factor"]),
                                             rtol=4 * step(torch.float32), atol=0)
    assert ((ratio < 1) & (ratio > 1 / rp["factor"])).any()


def test_mistral_positions_stay_inside_the_sliding_window():
    model = load_model("tiny-random-mistral")
    window = TINY_CONFIGS["tiny-random-mistral"]["sliding_window"]
    assert model.hf.config.sliding_window == window == model.spec.max_positions
    policy = TokenPolicy(model.tokenizer)
    session = Session(model, policy, SamplerParams(greedy=True))
    session.prime(policy.raw_prompt("x" * (window - 4)), capacity=window + 8)
    # the pending token sits at position window - 5: five steps reach the window's last one
    assert len(list(session.stream(10, ignore_eos=True))) == 5
    assert session.stop_reason == "max_positions"
    with pytest.raises(UserError, match="positions"):
        session.prime(policy.raw_prompt("x" * (window + 1)), capacity=window + 8)


@pytest.mark.parametrize("rope, message", [
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
     "unsupported rope scaling 'yarn': it scales cos/sin"),
    (dict(rope_type="dynamic", factor=2.0), "unsupported rope scaling 'dynamic'"),
    (dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
          original_max_position_embeddings=128), "unsupported rope scaling 'longrope'"),
])
def test_unsupported_rope_scaling_is_refused_in_one_line(tmp_path, rope, message):
    tok = byte_tokenizer()
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64,
                                  intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, max_position_embeddings=512,
                                  rope_parameters=dict(rope_theta=10000.0, **rope))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=message) as e:
        load_model(str(tmp_path))
    assert "\n" not in str(e.value)
