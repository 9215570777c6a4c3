"""Stage 0: priming builds the arena and ledger with our own chunked prefill."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from positronic_brain import forward as forward_module
from positronic_brain.model import load_model, pack, packable, quantize
from positronic_brain.stages.apply import prefill as prefill_module
from positronic_brain.stages.apply import chunks, prime
from positronic_brain.types import Segment, UserError
from tests.oracle import assert_close, hf_prompt_logits
from tests.tolerance import ORACLE, forward_bound, half_oracle, products, step, sum_bound


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    merged: bool = False) -> float:
    """How far a fused attention of ``q`` (H, T, D) over ``k``/``v`` (kv_heads, S, D), in their
    dtype, may lie from the float32 softmax over the same (rounded) inputs: each score is a
    D-term sum, whose error is a relative one of its probability (in the numerator and the
    denominator, whose exp rounds once each), the normalising sum and the weighted one are
    S-term sums of probabilities adding to 1, all times the largest value; in bfloat16 the
    probabilities are rounded before they weight the values and so is the result, a step.
    ``merged``: attended in two parts merged by their log-sum-exps, whose weights are exps
    of a rounded difference, joined by a 2-term sum."""
    kk = k.float().repeat_interleave(q.shape[0] // k.shape[0], 0)
    scores = float((q.float().abs() @ kk.abs().transpose(1, 2)).max())
    relative = (2 * sum_bound(torch.float32, q.shape[-1], scores) + 2 * step(torch.float32)
                + products(torch.float32, k.shape[1], 2))
    if merged:
        relative += products(torch.float32, 2, 2)
    if q.dtype != torch.float32:
        relative += step(q.dtype)
    return relative * float(v.float().abs().max())


def test_prime_logits_equal_hf_forward_on_the_prompt(real_model, real_policy, long_text):
    ids = real_policy.encode(long_text)[:300]
    segs = [Segment(tuple(ids), "user")]
    # a small chunk makes the later chunks attend to earlier ones through the arena
    state, out = prime(real_model, segs, capacity=400, chunk=64, all_logits=True)
    assert out.logits.shape == (299, real_model.spec.vocab)
    assert_close(out.logits, hf_prompt_logits(real_model, ids[:-1]), ORACLE, "prime logits")


def test_prime_state_shapes_and_ledger(tiny_model, tiny_policy):
    segs = tiny_policy.chat([("system", "Be brief."), ("user", "Hi there")])
    ids = [i for s in segs for i in s.ids]
    state, out = prime(tiny_model, segs, capacity=64, pinned=frozenset({"system"}))
    s = tiny_model.spec
    assert state.arena.k.shape == (s.n_layers, s.n_kv_heads, 64, s.head_dim)
    # keys stored transposed: q K^T reads each key dimension as a contiguous run of slots
    # (each row padded by one cache line, so a slot's elements do not share cache sets)
    kt = state.arena.kt
    assert kt.stride(-1) == 1 and kt.stride(-2) == 64 + 16
    assert state.arena.k.data_ptr() == kt.data_ptr()
    assert state.view().k[0].transpose(1, 2).stride(-1) == 1
    assert state.arena.n == state.ledger.n == len(ids) - 1
    assert state.pending_token == ids[-1] and state.next_position == len(ids) - 1
    state.check_valid()
    view = state.view()
    assert view.token_id.tolist() == ids[:-1]
    assert view.position.tolist() == list(range(len(ids) - 1))
    assert view.uid.tolist() == list(range(len(ids) - 1))
    n_system = len(segs[0].ids)
    assert (view.flags[:n_system] == 1).all() and (view.flags[n_system:] == 0).all()
    assert out.patch.appended_slots == tuple(range(len(ids) - 1))
    # slots past the live prefix were never written
    assert not state.arena.k[:, :, state.arena.n:].any()


def test_prime_chunking_does_not_change_the_cache(tiny_model, tiny_policy):
    segs = tiny_policy.raw_prompt("chunked prefill must equal one big chunk " * 3)
    a, _ = prime(tiny_model, segs, capacity=200, chunk=7)
    b, _ = prime(tiny_model, segs, capacity=200, chunk=1000)
    n = a.arena.n
    for x in ("k", "v"):  # the same sums, chunk by chunk or in one: in other orders
        want = getattr(b.arena, x)[:, :, :n]
        bound = forward_bound(tiny_model, n, float(want.abs().max()))
        assert_close(getattr(a.arena, x)[:, :, :n], want, bound, x)


def test_cpu_prefill_attends_past_and_new_apart_as_hf(monkeypatch, tiny_model, tiny_policy):
    """On the CPU a fused prefill's chunks after the first attend to the past slots and to
    their own tokens apart (``forward.cpu_attention``, merged by log-sum-exp), the first to
    its own only; the logits are HF's, and the cache is a masked call's to rounding."""
    if tiny_model.device.type not in forward_module.APART:
        pytest.skip(f"{tiny_model.device.type} does not take past and new apart (forward.APART)")
    real, calls = forward_module.cpu_attention, []
    monkeypatch.setattr(forward_module, "cpu_attention", lambda q, k, v, *past: (
        calls.append(len(past)) or real(q, k, v, *past)))
    segs = tiny_policy.raw_prompt("a fused prefill, chunk by chunk, over grouped heads " * 3)
    ids = [i for s in segs for i in s.ids]
    state, out = prime(tiny_model, segs, capacity=200, chunk=16, all_logits=True)
    first = tiny_model.spec.n_layers
    assert calls[:first] == [0] * first and len(calls) > first and set(calls[first:]) == {2}
    assert_close(out.logits, hf_prompt_logits(tiny_model, ids[:-1]), ORACLE, "prime logits")
    monkeypatch.setattr(forward_module, "APART", ())  # a bias over [past | new] instead
    masked, _ = prime(tiny_model, segs, capacity=200, chunk=16)
    n = state.arena.n
    for x in ("k", "v"):  # past and new attended apart or joined: the sums in other orders
        want = getattr(masked.arena, x)[:, :, :n]
        bound = forward_bound(tiny_model, n, float(want.abs().max()))
        assert_close(getattr(state.arena, x)[:, :, :n], want, bound, x)


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_each_fused_attention_path_primes_what_hf_computes(monkeypatch, tiny_model,
                                                            tiny_policy, cpu_kernel):
    """Where past and new are not taken apart (a masked past, a GPU), the fused prefill
    attention given the grouped K/V heads with a mask (the CPU's), or as on a GPU: the
    first chunk with no mask (causal), later ones with each K/V head repeated for its query
    heads (``forward.fused_attention``). Both paths run here, on any device, and give HF's
    logits and the cache of the path the device takes."""
    real, causal_calls = forward_module.fused_attention, []
    monkeypatch.setattr(forward_module, "APART", ())
    monkeypatch.setattr(forward_module, "fused_attention", lambda q, k, v, bias, grouped: (
        causal_calls.append(bias is None) or real(q, k, v, bias, grouped=cpu_kernel)))
    segs = tiny_policy.raw_prompt("a fused prefill, chunk by chunk, over grouped heads " * 3)
    ids = [i for s in segs for i in s.ids]
    state, out = prime(tiny_model, segs, capacity=200, chunk=16, all_logits=True)
    spec = tiny_model.spec
    assert spec.n_kv_heads < spec.n_heads
    first = spec.n_layers  # one call per layer: the first chunk's, then later chunks'
    assert all(causal_calls[:first]) and len(causal_calls) > first
    assert not any(causal_calls[first:])
    assert_close(out.logits, hf_prompt_logits(tiny_model, ids[:-1]), ORACLE, "prime logits")
    monkeypatch.setattr(forward_module, "fused_attention", real)
    plain, _ = prime(tiny_model, segs, capacity=200, chunk=16)
    n = state.arena.n
    for x in ("k", "v"):  # another fused kernel's attention: its sums in another order
        want = getattr(plain.arena, x)[:, :, :n]
        bound = forward_bound(tiny_model, n, float(want.abs().max()))
        assert_close(getattr(state.arena, x)[:, :, :n], want, bound, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 5])
def test_every_fused_attention_branch_attends_as_the_masked_grouped_one(dtype, n):
    """Without past slots (no mask, causal: grouped heads on the CPU and in half precision,
    repeated in float32 elsewhere) or with them (masked: grouped on the CPU, repeated
    elsewhere), and one query unmasked, each branch attends as the softmax over the
    allowed slots, to the dtype's rounding; causal on the CPU, the bits of the masked call."""
    gen = torch.Generator().manual_seed(0)
    T, S, D = 6, n + 6, 8
    q = torch.randn(4, T, D, generator=gen).to(dtype)
    k, v = (torch.randn(2, S, D, generator=gen).to(dtype) for _ in range(2))
    allowed = torch.ones(T, S, dtype=torch.bool).tril_(n)
    if n:
        allowed[1::2, :n] = False
        allowed[:, 0] = False
    bias = torch.zeros(T, S, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax((q.float() @ k.float().repeat_interleave(2, 0).transpose(1, 2))
                          + bias.float(), dim=-1)
    want = probs @ v.float().repeat_interleave(2, 0)
    tol = attention_bound(q, k, v)  # the same softmax, by another kernel (in bfloat16: rounded)
    given = None if n == 0 else bias  # no past: no mask, causal
    for grouped in (True, False):
        got = forward_module.fused_attention(q, k, v, given, grouped=grouped)
        assert torch.allclose(got.float(), want, rtol=0, atol=tol), grouped
        one = forward_module.fused_attention(q[:, -1:], k, v, None if n == 0 else bias[-1:],
                                             grouped=grouped)
        assert torch.allclose(one.float(), want[:, -1:], rtol=0, atol=tol), grouped
    if n == 0:
        masked = forward_module.fused_attention(q, k, v, bias, grouped=True)
        assert torch.equal(forward_module.fused_attention(q, k, v, None, grouped=True), masked)
        assert torch.equal(forward_module.cpu_attention(q, k, v), masked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_over_past_and_new_apart_is_the_softmax_over_both(dtype):
    """``cpu_attention`` with past slots: the new queries over every past slot and causally
    over their own tokens (one query: over all), merged by log-sum-exp, is the softmax over
    [past | new] to the dtype's rounding."""
    gen = torch.Generator().manual_seed(1)
    n, T, D = 9, 6, 8
    q = torch.randn(4, T, D, generator=gen).to(dtype)
    k, v = (torch.randn(2, n + T, D, generator=gen).to(dtype) for _ in range(2))
    allowed = torch.ones(T, n + T, dtype=torch.bool).tril_(n)
    scores = q.float() @ k.float().repeat_interleave(2, 0).transpose(1, 2)
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ (
        v.float().repeat_interleave(2, 0))
    tol = attention_bound(q, k, v, merged=True)  # the same softmax, in two parts merged
    past_k = k[:, :n].transpose(1, 2).contiguous().transpose(1, 2)  # as an arena stores keys
    got = forward_module.cpu_attention(q, k[:, n:], v[:, n:], past_k, v[:, :n])
    assert got.dtype == dtype and torch.allclose(got.float(), want, rtol=0, atol=tol)
    one = forward_module.cpu_attention(q[:, -1:], k[:, n:], v[:, n:], past_k, v[:, :n])
    assert torch.allclose(one.float(), want[:, -1:], rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_off_the_cpu_grouped_heads_go_only_where_a_fused_kernel_takes_them(monkeypatch, dtype):
    """Off the CPU (``grouped`` False), torch's fused kernels take grouped K/V heads only
    causal, without a mask, in half precision (flash); a mask with grouped heads, or grouped
    heads in float32, leave its plain implementation, which builds every head's float32
    scores (64 GiB for a 32,768-token float32 chunk on an H100). So every other call gets
    one K/V head per query head."""
    calls = []
    real = forward_module.F.scaled_dot_product_attention
    monkeypatch.setattr(forward_module.F, "scaled_dot_product_attention", lambda q, k, v, **kw: (
        calls.append((k.shape[1] == q.shape[1], kw.get("attn_mask") is not None,
                      kw.get("is_causal", False), kw.get("enable_gqa", False)))
        or real(q, k, v, **kw)))
    q = torch.randn(4, 6, 8).to(dtype)
    k, v = (torch.randn(2, 9, 8).to(dtype) for _ in range(2))
    bias = torch.zeros(6, 9, dtype=dtype)
    forward_module.fused_attention(q, k[:, :6], v[:, :6], None, grouped=False)  # causal
    forward_module.fused_attention(q, k, v, bias, grouped=False)  # masked
    forward_module.fused_attention(q[:, -1:], k, v, None, grouped=False)  # one query
    half = dtype != torch.float32
    # (one K/V head per query head, masked, causal, enable_gqa)
    assert calls == [(not half, False, True, half), (True, True, False, False),
                     (True, False, False, False)]


@pytest.mark.parametrize("dtype, widen", [("float32", False), ("bfloat16", True),
                                          ("bfloat16", False)])
def test_the_last_layer_answers_only_the_last_query(monkeypatch, tiny_policy, dtype, widen):
    """Without all logits, a prefill chunk's last layer runs its attention output and MLP
    for the chunk's last token only (nothing reads the others'): the cache has the same
    bits as with all logits, and each chunk's last logits are HF's. In bfloat16 with
    ``WIDEN`` (Intel, no AMX) and without (any other CPU): fused or built scores."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    model = load_model("tiny-random", dtype)
    segs = tiny_policy.raw_prompt("only the last row of the last layer is wanted " * 3)
    ids = [i for s in segs for i in s.ids]
    every, _ = prime(model, segs, capacity=200, chunk=16, all_logits=True)
    last, out = prime(model, segs, capacity=200, chunk=16)
    n = last.arena.n
    assert torch.equal(every.arena.k[:, :, :n], last.arena.k[:, :, :n])
    assert torch.equal(every.arena.v[:, :, :n], last.arena.v[:, :, :n])
    rows = list(range(15, n, 16)) + ([n - 1] if n % 16 else [])
    want = hf_prompt_logits(model, ids[:-1])[rows]
    tol = ORACLE if dtype == "float32" else half_oracle(model) * float(want.abs().max())
    assert_close(out.logits, want, tol, "chunks' last logits")


@pytest.mark.parametrize("kind", ["packed", "int8", "plain"])
def test_wide_products_are_the_bfloat16_products_to_rounding(monkeypatch, kind):
    """On an Intel CPU without AMX (``forward.WIDEN``) a bfloat16 product of ``WIDE_ROWS`` rows or
    more multiplies the weight's bfloat16 values in float32 and rounds to bfloat16 (the
    bits of that), the bfloat16 product to rounding; fewer rows, or with
    ``WIDEN`` off, the bfloat16 product as before."""
    if kind == "packed" and not packable():
        pytest.skip("this torch has no oneDNN bfloat16 support")
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 64, generator=gen) * 0.1).bfloat16()
    b = torch.randn(48, generator=gen).bfloat16()
    weight = {"packed": pack, "int8": quantize, "plain": lambda t: t}[kind](w)
    plain = w if kind == "plain" else weight.plain
    rows = forward_module.WIDE_ROWS
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    monkeypatch.setattr(forward_module, "WIDEN", True)
    got = forward_module.linear(x, weight, b)
    few = forward_module.linear(x[:rows - 1], weight, b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x.float(), plain.float(), b.float()).bfloat16())
    monkeypatch.setattr(forward_module, "WIDEN", False)
    narrow = forward_module.linear(x, weight, b)
    assert torch.equal(few, forward_module.linear(x[:rows - 1], weight, b))
    # 64 products and the bias summed in float32 in any order (the narrow product: oneDNN's
    # where the CPU has avx512_bf16 or AMX, torch's own elsewhere), rounded to bfloat16 on
    # each side (the narrow one may round the product, then its sum with the bias)
    mag = x.float().abs() @ plain.float().abs().T + b.float().abs()
    bound = (sum_bound(torch.float32, 65) + 2 * step(torch.bfloat16)) * mag
    assert bool(((got.float() - narrow.float()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("widen", [True, False])
def test_wide_prefill_primes_what_hf_computes(monkeypatch, tiny_policy, dtype, widen):
    """A bfloat16 or int8 prefill on the CPU: with ``WIDEN`` (Intel, no AMX) its chunks attend
    through torch's fused attention and their products widen to float32 (here from 8 rows,
    so the tiny chunks do), else they build their scores in bfloat16; both give HF's logits
    to bfloat16's rounding."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    monkeypatch.setattr(forward_module, "WIDE_ROWS", 8)
    real, calls = forward_module.wide, []
    monkeypatch.setattr(forward_module, "wide", lambda x, rows: (
        calls.append(real(x, rows)) or calls[-1]))
    model = load_model("tiny-random", dtype)
    assert forward_module.builds_scores(model, False, False) is not widen
    segs = tiny_policy.raw_prompt("a bfloat16 prefill, chunk by chunk, widened or not " * 3)
    ids = [i for s in segs for i in s.ids]
    _, out = prime(model, segs, capacity=200, chunk=16, all_logits=True)
    assert any(calls) is widen
    want = hf_prompt_logits(model, ids[:-1])
    assert_close(out.logits, want, half_oracle(model) * float(want.abs().max()), "prime logits")


@pytest.mark.parametrize("dtype, masked, built", [
    ("bfloat16", False, False), ("int8", False, False), ("float32", False, False),
    ("bfloat16", True, True), ("float16", False, True)])
def test_on_a_cpu_without_amx_only_unmasked_bfloat16_prefills_leave_their_scores(
        monkeypatch, dtype, masked, built):
    """With ``WIDEN``, bfloat16 (int8's too) prefills attend through the fused kernel,
    which ``cpu_attention`` widens; over a masked past (``blend``'s rebuilds) or in float16,
    which nothing widens, they keep building their scores."""
    monkeypatch.setattr(forward_module, "WIDEN", True)
    model = load_model("tiny-random", dtype)
    assert forward_module.builds_scores(model, False, False, masked) is built


@pytest.mark.parametrize("dtype, masked, widen, built", [
    ("float32", False, True, False), ("bfloat16", False, True, False),
    ("float32", True, True, True), ("bfloat16", False, False, True)])
def test_a_prefill_gathering_statistics_on_the_cpu_builds_no_scores(monkeypatch, dtype,
                                                                    masked, widen, built):
    """The prompt's statistics come from ``cpu_attention``'s log-sum-exps where it attends
    (the CPU, no past slot masked), so gathering them builds no scores there; a folded
    slot's log-mass still does. A bfloat16 prefill where ``WIDEN`` is off (any CPU but an
    Intel one without AMX) builds its scores anyway."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    model = load_model("tiny-random", dtype)
    assert forward_module.builds_scores(model, True, False, masked) is built
    assert forward_module.builds_scores(model, True, True, masked)


@pytest.mark.parametrize("window", [None, 4])
def test_reused_score_buffers_give_the_same_bits(monkeypatch, tiny_policy, window):
    """A prefill that builds its scores (bfloat16 on a CPU with AMX, so ``WIDEN`` off here,
    with or without the prompt's statistics) reuses one set of buffers over its layers
    (``forward._score_buffers``): the cache, logits and statistics have the bits of each
    layer allocating its own."""
    monkeypatch.setattr(forward_module, "WIDEN", False)
    model = load_model("tiny-random", "bfloat16")
    segs = tiny_policy.raw_prompt("one buffer for every layer's scores " * 4)
    run = lambda: prime(model, segs, capacity=200, chunk=16, all_logits=True,  # noqa: E731
                        prefill_window=window)
    reused, out = run()
    monkeypatch.setattr(forward_module, "_score_buffers", lambda *args: None)
    fresh, plain = run()
    n = reused.arena.n
    assert torch.equal(reused.arena.k[:, :, :n], fresh.arena.k[:, :, :n])
    assert torch.equal(reused.arena.v[:, :, :n], fresh.arena.v[:, :, :n])
    assert torch.equal(out.logits, plain.logits)
    if window is not None:
        assert torch.equal(out.stats.total, plain.stats.total)
        assert torch.equal(out.stats.window, plain.stats.window)


@pytest.mark.parametrize("dtype, widen", [("float32", False), ("bfloat16", True),
                                          ("bfloat16", False)])
def test_a_prefill_writes_its_kv_into_the_arena_with_the_bits_of_a_block(monkeypatch,
                                                                         tiny_policy, dtype,
                                                                         widen):
    """Stage 0's forward hands each chunk's new K/V to stage 0's writer of the arena slots
    they take (``forward``'s ``store``), not to a block of its own that stage 0 then copies: the
    cache and logits have the same bits either way (in bfloat16 with ``WIDEN``, fused
    attention, and without, built scores)."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    model = load_model("tiny-random", dtype)
    segs = tiny_policy.raw_prompt("each chunk's keys and values go straight to the arena " * 3)
    real, given = forward_module.forward, []
    monkeypatch.setattr(prefill_module, "forward", lambda *a, **kw: (
        given.append(kw.get("store")) or real(*a, **kw)))
    direct, out = prime(model, segs, capacity=200, chunk=16, all_logits=True)
    assert len(given) > 1 and all(store is not None for store in given)
    monkeypatch.setattr(prefill_module, "slots_of", lambda *args: None)
    block, plain = prime(model, segs, capacity=200, chunk=16, all_logits=True)
    n = direct.arena.n
    assert torch.equal(direct.arena.k[:, :, :n], block.arena.k[:, :, :n])
    assert torch.equal(direct.arena.v[:, :, :n], block.arena.v[:, :, :n])
    assert torch.equal(direct.arena.knorm[:, :, :n], block.arena.knorm[:, :, :n])
    assert torch.equal(out.logits, plain.logits)


def test_single_token_prompt_caches_nothing(tiny_model):
    state, out = prime(tiny_model, [Segment((5,), "user")], capacity=4)
    assert state.arena.n == 0 and state.pending_token == 5 and out.logits.shape[0] == 0
    state.check_valid()


@pytest.mark.parametrize("segs, capacity, message", [
    ([], 8, "empty"),
    ([Segment(tuple(range(10)), "user")], 9, "capacity"),
    ([Segment((10 ** 6,), "user")], 9, "vocabulary"),
])
def test_prime_rejects_bad_input(tiny_model, segs, capacity, message):
    with pytest.raises(UserError, match=message):
        prime(tiny_model, segs, capacity=capacity)


def test_prefill_chunks_by_device(monkeypatch):
    """On the CPU 1,024 tokens a chunk through the fused attention, 256 where the forward
    builds the scores or every token's logits are wanted; on a GPU as many as keep what
    grows with the chunk within a 16th of its memory: one layer's scores, probabilities and
    mask over every head where the forward builds them, the mask's row and the MLP's
    activations where its fused kernels do not; all logits where wanted."""
    monkeypatch.setattr(prefill_module, "gpu_chunk_bytes", lambda device: 1 << 32)  # 64 GiB / 16
    spec = SimpleNamespace(n_heads=32, vocab=128_000)
    hf = SimpleNamespace(config=SimpleNamespace(intermediate_size=14_336))
    cpu = SimpleNamespace(device=torch.device("cpu"), spec=spec, hf=hf)
    gpu = SimpleNamespace(device=torch.device("cuda", 0), spec=spec, hf=hf)

    def cut(model, *args, **kwargs):
        return [(s.start, s.stop) for s in chunks(model, *args, **kwargs)]
    assert cut(cpu, 10, 2500) == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert cut(cpu, 10, 600, scores=True) == [(0, 256), (256, 512), (512, 600)]
    assert cut(cpu, 10, 600, logits=True) == cut(cpu, 10, 600, scores=True)
    assert cut(gpu, 10, 600, chunk=7)[-1] == (595, 600)  # an explicit chunk wins anywhere
    # built: 4 float32 buffers of 32 heads x 4,096 slots a token, 2 MiB, so 2,048 a chunk
    assert cut(gpu, 0, 4096, scores=True) == [(0, 2048), (2048, 4096)]
    assert cut(gpu, 0, 1024, scores=True) == [(0, 1024)]
    assert cut(gpu, 0, 4096, logits=True, scores=True)[0] == (
        0, (1 << 32) // (4 * (4 * 32 * 4096 + 128_000)))
    assert cut(gpu, 0, 100_000, scores=True)[0] == (0, 256)  # never below the CPU's chunk
    # fused: a mask row of 4,096 slots and 4 x 14,336 activations, 4 bytes each
    assert cut(gpu, 0, 4096) == [(0, 4096)]
    assert cut(gpu, 0, 100_000)[0] == (0, (1 << 32) // (4 * (100_000 + 4 * 14_336)))
    assert cut(gpu, 0, 100_000, logits=True)[0] == (
        0, (1 << 32) // (4 * (100_000 + 4 * 14_336 + 128_000)))
    assert cut(gpu, 0, 0) == []
    with pytest.raises(UserError, match="prefill chunk must be >= 1"):
        cut(cpu, 0, 10, chunk=0)
