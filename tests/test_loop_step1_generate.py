"""Stage 1: a read-only forward of the pending token, equal to Hugging Face's forward."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from positronic_brain.loop import Session
from positronic_brain.model import PackedWeight, load_model, packable
from positronic_brain.sampler import make_generator, sample
from positronic_brain.stages.apply import apply, prime
from positronic_brain.stages.generate import generate
from positronic_brain.types import SamplerParams
from tests.oracle import assert_close, hf_step_logits
from tests.tolerance import ORACLE, sum_bound

GREEDY = SamplerParams(greedy=True)


def _fingerprint(state):
    """Everything stage 1 must not change: versions, pointers and contents."""
    a, m = state.arena, state.ledger
    tensors = [a.k, a.v] + [getattr(m, c) for c in m.COLUMNS]
    return ([t._version for t in tensors], [t.data_ptr() for t in tensors],
            [t.clone() for t in tensors], (a.n, m.n, m.next_uid, dict(m.merged),
                                           state.pending_token, state.next_position, state.step))


def _assert_unchanged(before, after):
    assert before[0] == after[0], "a tensor's _version changed"
    assert before[1] == after[1], "a tensor's data_ptr changed"
    for x, y in zip(before[2], after[2]):
        assert torch.equal(x, y), "tensor contents changed"
    assert before[3] == after[3], "scalar state changed"


def test_stage1_logits_equal_hf_for_64_greedy_steps(real_model, real_policy):
    """At every step: stage-1 logits == HF model() on a DynamicCache of the same live K/V."""
    session = Session(real_model, real_policy, GREEDY)
    session.prime(real_policy.raw_prompt("The history of the printing press begins"), 128)
    for _ in range(64):
        view = session.state.view()
        before = _fingerprint(session.state)
        gen = generate(real_model, view, GREEDY, session.generator)
        _assert_unchanged(before, _fingerprint(session.state))
        assert_close(gen.logits, hf_step_logits(real_model, view), ORACLE,
                     f"step {session.state.step} logits")
        apply(real_model, session.state, gen)
        assert session.state.arena.n == session.state.ledger.n
        session.state.check_valid()


def test_stage1_outputs(tiny_model, tiny_policy):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("hello world"), capacity=32)
    s = tiny_model.spec
    gen = generate(tiny_model, state.view(), GREEDY, make_generator(0))
    n = state.arena.n
    assert gen.logits.shape == (s.vocab,) and gen.logits.dtype == torch.float32
    assert gen.k.shape == gen.v.shape == (s.n_layers, s.n_kv_heads, 1, s.head_dim)
    assert gen.attention.shape == (s.n_layers, s.n_heads, n)
    # the attention row over live slots plus the token itself sums to 1: without the token,
    # at most 1, to the rounding of n + 1 probabilities normalised there and summed here
    total = gen.attention.sum(-1)
    assert (total <= 1 + sum_bound(torch.float32, n + 1)).all() and (gen.attention >= 0).all()
    assert gen.token_id == int(gen.logits.argmax()) == gen.report.top_ids[0]
    assert gen.input_token == state.pending_token and gen.position == state.next_position


@pytest.mark.parametrize("report_top", [1, 2, 5])
def test_greedy_takes_the_first_of_tied_maxima(report_top):
    """Greedy is the argmax: the lowest id among equal maxima, whatever order the report's
    ranking gives them; a unique maximum is the report's first token."""
    params = SamplerParams(greedy=True, report_top=report_top)
    seen, gen = torch.empty(0, dtype=torch.int64), make_generator(0)
    for ties in ([7, 40], [3, 11, 12], [40, 7, 63]):
        logits = torch.randn(64, generator=torch.Generator().manual_seed(len(ties)))
        logits[ties] = 10.0
        assert sample(logits, params, seen, gen).token_id == min(ties)
        logits[ties[-1]] = 11.0
        report = sample(logits, params, seen, gen)
        assert report.token_id == ties[-1] == report.top_ids[0]


def test_a_draw_follows_the_probabilities_and_never_takes_a_removed_token():
    """A sampled token is drawn with its probability after the rule (here top-k 3 of 16 at
    temperature 2): 6,000 draws from one seeded generator never take a removed token, and
    each kept token's count lies within 5 standard deviations of its binomial expectation
    (a uniform draw over the three would be 5 to 15 of them off). A distribution whose whole
    mass is on the first or the last token always draws it."""
    logits = torch.randn(16, generator=torch.Generator().manual_seed(3))
    params, seen = SamplerParams(temperature=2.0, top_k=3), torch.empty(0, dtype=torch.int64)
    probs = (logits / 2.0).topk(3)
    p = dict(zip(probs.indices.tolist(), (probs.values.softmax(-1)).tolist()))
    gen, n, counts = make_generator(11), 6000, {}
    for _ in range(n):
        t = sample(logits, params, seen, gen).token_id
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(p), f"drew removed tokens: {set(counts) - set(p)}"
    for t, q in p.items():
        assert abs(counts.get(t, 0) - n * q) <= 5 * (n * q * (1 - q)) ** 0.5, (t, counts, p)
    for at in (0, 15):
        one = torch.full((16,), -1e4)
        one[at] = 0.0
        assert {sample(one, SamplerParams(), seen, gen).token_id for _ in range(50)} == {at}


def test_stage1_is_deterministic_and_sampling_is_seeded(tiny_model, tiny_policy):
    state, _ = prime(tiny_model, tiny_policy.raw_prompt("abc"), capacity=16)
    p = SamplerParams(temperature=1.5, seed=7)
    a = generate(tiny_model, state.view(), p, make_generator(7, tiny_model.device))
    b = generate(tiny_model, state.view(), p, make_generator(7, tiny_model.device))
    assert torch.equal(a.logits, b.logits) and a.token_id == b.token_id
    assert torch.equal(a.k, b.k) and torch.equal(a.attention, b.attention)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_stage1_equals_hf_on_tiny_models(name):
    from positronic_brain.model import load_model
    from positronic_brain.special_tokens import TokenPolicy

    model = load_model(name)
    policy = TokenPolicy(model.tokenizer)
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=1))
    session.prime(policy.raw_prompt("a tiny model still has to be exact"), 64)
    for _ in range(10):
        view = session.state.view()
        gen = generate(model, view, session.sampler, session.generator)
        assert_close(gen.logits, hf_step_logits(model, view), ORACLE, f"{name} logits")
        apply(model, session.state, gen)


@pytest.mark.skipif(not packable(), reason="this torch has no oneDNN bfloat16 support")
def test_bfloat16_weights_are_packed_and_their_product_has_f_linears_bits():
    """bfloat16 projections and the lm_head are oneDNN-packed copies for our forward (HF
    keeps the plain weights); their product equals F.linear on the plain weight bit for
    bit, for a decode row, a prefill chunk and with a bias, also through the operator a
    compiled stage 1 calls."""
    from positronic_brain.forward import linear

    model = load_model("tiny-random", "bfloat16")
    w, hf = model.layers[0], model.hf.model.layers[0]
    plain = {"qkv_w": torch.cat([hf.self_attn.q_proj.weight, hf.self_attn.k_proj.weight,
                                 hf.self_attn.v_proj.weight]),
             "o_w": hf.self_attn.o_proj.weight, "down_w": hf.mlp.down_proj.weight}
    g = torch.Generator().manual_seed(0)
    for name, weight in [(n, getattr(w, n)) for n in plain] + [("lm_head", model.lm_head)]:
        assert isinstance(weight, PackedWeight) and weight.w.dtype == torch.bfloat16, name
        ref = plain.get(name, model.hf.lm_head.weight)
        for rows in (1, 7):
            x = torch.randn(rows, ref.shape[1], generator=g).bfloat16()
            b = torch.randn(ref.shape[0], generator=g).bfloat16()
            assert torch.equal(linear(x, weight), F.linear(x, ref)), (name, rows)
            assert torch.equal(linear(x, weight, b), F.linear(x, ref, b)), (name, rows, "bias")
            # the operator a compiled stage 1 calls: the same product
            assert torch.equal(torch.ops.positronic_brain.packed_linear(x, weight.w, b),
                               F.linear(x, ref, b)), (name, rows, "operator")


def test_float32_weights_are_input_major_shared_with_hf_and_linear_equals_f_linear(real_model):
    """One weight storage per projection, read by our forward and HF's modules alike; the
    one-row split product equals F.linear to float rounding, also with a bias, and other
    shapes or layouts take F.linear itself."""
    from positronic_brain.forward import linear

    w = real_model.layers[0]
    hf = real_model.hf.model.layers[0]
    for ours, theirs in ((w.qkv_w, hf.self_attn.k_proj.weight), (w.o_w, hf.self_attn.o_proj.weight),
                         (w.gate_up_w, hf.mlp.up_proj.weight), (w.down_w, hf.mlp.down_proj.weight),
                         (real_model.lm_head, real_model.hf.model.embed_tokens.weight)):
        assert ours.stride() == (1, ours.shape[0]), "float32 weights are stored input-major"
        assert ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
    # nothing keeps the loader's memory map of the checkpoint (every weight a second time)
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert "model.safetensors" not in maps.read_text(), "the checkpoint is still mapped"
    g = torch.Generator().manual_seed(0)
    for weight in (w.qkv_w, w.down_w, real_model.lm_head):
        x = torch.randn(1, weight.shape[1], generator=g)
        b = torch.randn(weight.shape[0], generator=g)
        want = torch.nn.functional.linear(x, weight.contiguous(), b)
        got = linear(x, weight, b)
        assert got.shape == want.shape
        # the inputs and the bias summed in parts, in another order
        bound = sum_bound(torch.float32, x.shape[1] + 1) * (
            x.abs() @ weight.abs().T + b.abs())
        assert bool(((got - want).abs() <= bound).all()), "split one-row product"
    x = torch.randn(3, 576, generator=g)  # several rows: F.linear itself
    assert torch.equal(linear(x, w.o_w), torch.nn.functional.linear(x, w.o_w))


@pytest.mark.parametrize("dtype, widen", [("float32", False), ("bfloat16", True),
                                          ("bfloat16", False)])
def test_a_kv_only_forward_gives_the_same_kv_bits_without_logits(monkeypatch, tiny_policy,
                                                                  dtype, widen):
    """Repairs and re-prefills want only the new K/V: ``kv_only`` stops the last layer after
    its K/V projection and skips the lm_head, and the K/V keep the full forward's bits,
    with and without a mask and a score bias (unmasked in bfloat16, fused attention with
    ``WIDEN``, Intel without AMX, built scores without it)."""
    from positronic_brain import forward as forward_module
    from positronic_brain.forward import forward
    from positronic_brain.types import UserError

    monkeypatch.setattr(forward_module, "WIDEN", widen)
    model = load_model("tiny-random", dtype)
    session = Session(model, tiny_policy, GREEDY)
    session.prime(tiny_policy.raw_prompt("only the keys and values of the new tokens"))
    view = session.state.view()
    n = view.n
    ids, pos = torch.tensor([5, 9, 2]), torch.arange(n, n + 3)
    bias = torch.rand(view.k.shape[:3], generator=torch.Generator().manual_seed(0))
    mask = torch.rand(3, n, generator=torch.Generator().manual_seed(1)) > 0.3
    for kw in ({}, {"past_mask": mask, "past_log_mass": bias}):
        full = forward(model, view.k, view.v, ids, pos, **kw)
        kv = forward(model, view.k, view.v, ids, pos, kv_only=True, **kw)
        assert kv.logits is None and kv.attention is None
        assert torch.equal(kv.k, full.k) and torch.equal(kv.v, full.v)
    with pytest.raises(UserError, match="kv_only"):
        forward(model, view.k, view.v, ids, pos, kv_only=True, want_attention=True)
