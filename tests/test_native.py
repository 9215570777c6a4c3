"""The native kernels (``--compile native``) against the plain path's operators, at real
head sizes, where their vector loops run (the tiny models' 16-wide heads take the scalar
ones): one layer's attention over strided views of an arena, with and without a folded
slot's log-mass, RMSNorm with the residual, SiLU times up, and one row times each kind of
weight matrix. Each runs on a CPU with AVX-512F built for it, built without AVX512_BF16's
pair products (``native.kernels(pairs=False)``, where the CPU has them) and built without
the AVX-512 loops (``native.kernels(scalar=True)``), as a CPU without them runs them. The bounds
are the error model's (tests/tolerance.py): the kernels and the plain operators may add each
sum in another order."""
import fcntl
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from positronic_brain import native
from positronic_brain.threads import running
from positronic_brain.types import SamplerParams
from positronic_brain.forward import INT8_INPUTS, linear
from positronic_brain.model import cpu_flags, quantize
from positronic_brain.sampler import make_generator, sample
from tests.tolerance import dot, step, sum_bound, unit

F32, B16 = torch.float32, torch.bfloat16
BUILD = native.kernels  # a build by its flags (``nat`` patches native.kernels)


@pytest.fixture(scope="module", params=["native", "nopairs", "scalar"])
def nat(request):
    """The kernels as built for this CPU, then without AVX512_BF16's pair products (as a CPU
    with AVX-512F but not them runs bfloat16 products), then without their AVX-512 loops;
    native.cold_max, native.fold_into and native.decode_rows call the same build."""
    scalar, pairs, flags = request.param == "scalar", request.param != "nopairs", cpu_flags()
    if scalar and "avx512f" not in flags.split():
        pytest.skip("this CPU has no AVX-512F: its native build already runs the scalar loops")
    if not pairs and "avx512_bf16" not in flags.split():
        pytest.skip("this CPU has no AVX512_BF16: its native build already runs without the "
                    "pair products")
    built = native.kernels  # cached per build
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "kernels", lambda: built(scalar, pairs))
        yield built(scalar, pairs)


def reference(qkv, cos, sin, kt, v, log_mass, H, KVH):
    """The plain path's operators (``forward.forward`` for one token) on one layer."""
    D, n = cos.shape[-1], kt.shape[-1]
    qk = qkv[0, :(H + KVH) * D].view(H + KVH, 1, D)
    qk = qk * cos + qk.roll(D // 2, -1) * sin
    q, k = qk.split((H, KVH))
    vn = qkv[0, (H + KVH) * D:].view(KVH, 1, D)
    qg = q.reshape(KVH, H // KVH, D)
    s_past = torch.matmul(qg, kt)
    if log_mass is not None:
        s_past = s_past.float() + log_mass.unsqueeze(1)
    scores = torch.cat((s_past, torch.matmul(qg, k.transpose(1, 2))), dim=-1)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    lse = scores.float().logsumexp(-1).reshape(H)
    p_past, p_new = p.to(qkv.dtype).split((n, 1), dim=-1)
    out = torch.matmul(p_past, v) + p_new * vn
    return out.reshape(1, H * D), qk, p, lse


def attention_bounds(qk, kt, v, qkv, H, KVH, dtype, p):
    """How far attend's output, weights and log-sum-exps may lie from the plain operators'
    (``p``: their weights), each adding in its own order: a score q.k sums D terms (in
    bfloat16 it is rounded to it, a step apart at most); the log-sum-exp sums n + 1 exps; a
    weight is off by exp(its score's error + the log-sum-exp's) - 1 of itself; the output
    sums n + 1 weights times values (in bfloat16 the weights are rounded first and the
    output once more)."""
    D, n = kt.shape[1], kt.shape[-1]
    q, k = qk.double().split((H, KVH))
    keys = torch.cat((kt.double(), k.transpose(1, 2)), -1)  # (KVH, D, n + 1)
    values = torch.cat((v.double(), qkv[0, (H + KVH) * D:].double().view(KVH, 1, D)), 1)
    qg = q.reshape(KVH, H // KVH, D)
    scores = (qg @ keys).abs()
    e_score = sum_bound(F32, D, 1.0) * (qg.abs() @ keys.abs()) + 2 * step(F32) * scores
    if dtype == B16:
        e_score += step(B16) * scores
    e_lse = e_score.amax(-1) + sum_bound(F32, n + 1)  # (KVH, G)
    e_p = p.double() * torch.expm1(e_score + e_lse[..., None])
    rounded = step(B16) * p.double() if dtype == B16 else 0.0
    out = p.double() @ values.abs()  # the sum of |terms| per output
    e_out = (e_p + rounded) @ values.abs() + sum_bound(F32, n + 1, 1.0) * out
    if dtype == B16:
        e_out += step(B16) * out
    return e_out.reshape(1, H * D), e_p, e_lse.reshape(H)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("D,H,KVH,n,mass", [(64, 9, 3, 1000, False), (64, 9, 3, 77, True),
                                            (128, 8, 2, 130, False), (64, 4, 4, 1, True),
                                            (32, 14, 2, 600, True), (64, 6, 3, 0, False)])
def test_attend_equals_the_plain_operators(nat, dtype, D, H, KVH, n, mass):
    gen = torch.Generator().manual_seed(n + D)
    cap = n + 37  # the live slots are a prefix of a longer arena: strided views
    qkv = torch.randn(1, (H + 2 * KVH) * D, generator=gen).to(dtype)
    angle = torch.rand(H + KVH, 1, D, generator=gen) * 6.3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    kt = torch.randn(KVH, D, cap, generator=gen).to(dtype)[..., :n]
    v = torch.randn(KVH, cap, D, generator=gen).to(dtype)[:, :n]
    log_mass = torch.rand(KVH, cap, generator=gen)[:, :n] * 2 if mass else None
    p = torch.full((H, n + 1), float("nan"))  # written in place, every value
    out, qk, lse = nat.attend_rows(qkv, cos, sin, [kt], [v], [torch.empty(0) if log_mass is None
                                                           else log_mass], [p], H, KVH, True)
    qk, lse = qk[0], lse[0]
    p = p.view(KVH, H // KVH, n + 1)
    want = reference(qkv, cos, sin, kt, v, log_mass, H, KVH)
    assert qk.dtype == out.dtype == dtype and p.dtype == lse.dtype == torch.float32
    assert torch.equal(qk, want[1])  # RoPE: the same three roundings, the same bits
    bounds = attention_bounds(want[1], kt, v, qkv, H, KVH, dtype, want[2])
    for what, ours, theirs, bound in zip(("out", "p", "lse"), (out, p, lse),
                                         (want[0], want[2], want[3]), bounds):
        assert ((ours.double() - theirs.double()).abs() <= bound).all(), what


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_attend_sums_in_the_same_order_on_any_number_of_threads(nat, dtype):
    """The slots' chunks share the threads; their sums add in chunk order whatever the
    number of threads."""
    gen = torch.Generator().manual_seed(9)
    H, KVH, D, n = 9, 3, 64, 1500
    qkv = torch.randn(1, (H + 2 * KVH) * D, generator=gen).to(dtype)
    cos, sin = (torch.randn(H + KVH, 1, D, generator=gen).to(dtype) for _ in range(2))
    kt = torch.randn(KVH, D, n, generator=gen).to(dtype)
    v = torch.randn(KVH, n, D, generator=gen).to(dtype)

    def run():
        p = torch.empty(H, n + 1)
        return (*nat.attend_rows(qkv, cos, sin, [kt], [v], [torch.empty(0)], [p], H, KVH, True),
                p)
    with running(1):
        one = run()
    with running(2):  # two at least, whatever the suite's own threads
        assert all(torch.equal(a, b) for a, b in zip(run(), one))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_attend_rows_gives_each_row_its_bits_alone(nat, dtype):
    """B rows of different lengths (none, one chunk, several; with and without log-masses)
    in one call: each row's output, q/k heads, weights and log-sum-exps are the bits it gets
    alone, on one thread or two."""
    gen = torch.Generator().manual_seed(4)
    H, KVH, D, ns = 9, 3, 64, (0, 1, 300, 1025, 77)
    B = len(ns)
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen).to(dtype)
    cos, sin = (torch.randn(H + KVH, B, D, generator=gen).to(dtype) for _ in range(2))
    kts = [torch.randn(KVH, D, n + 5, generator=gen).to(dtype)[..., :n] for n in ns]
    vs = [torch.randn(KVH, n + 5, D, generator=gen).to(dtype)[:, :n] for n in ns]
    masses = [torch.rand(KVH, n, generator=gen) if b % 2 else torch.empty(0)
              for b, n in enumerate(ns)]

    def alone(b):
        p = torch.empty(H, ns[b] + 1)
        out, qk, lse = nat.attend_rows(qkv[b:b + 1], cos[:, b:b + 1].contiguous(),
                                       sin[:, b:b + 1].contiguous(), [kts[b]], [vs[b]],
                                       [masses[b]], [p], H, KVH, True)
        return out[0], qk[0], lse[0], p

    def together():
        ps = [torch.empty(H, n + 1) for n in ns]
        out, qk, lse = nat.attend_rows(qkv, cos, sin, kts, vs, masses, ps, H, KVH, True)
        return [(out[b], qk[b], lse[b], ps[b]) for b in range(B)]
    with running(1):
        solo = [alone(b) for b in range(B)]
    for threads in (1, 2):
        with running(threads):
            for b, (row, want) in enumerate(zip(together(), solo)):
                assert all(torch.equal(x, y) for x, y in zip(row, want)), (threads, b)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_add_rms_norm_and_silu_mul_equal_the_plain_operators(nat, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 576, generator=gen).to(dtype)
    y, w = torch.randn(1, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    want_x = x + y
    want_h = w * F.rms_norm(want_x, (576,), eps=1e-5)
    got_x, got_h = nat.add_rms_norm(x.clone(), y, w, 1e-5)
    assert torch.equal(got_x, want_x)  # the residual: one rounded sum
    # the mean square sums 576 positive terms (relative), then a square root, a division and
    # two products round in float32; in bfloat16 the plain path rounds twice to it, a step each
    rel = sum_bound(F32, 576) + 4 * step(F32) + (2 * step(B16) if dtype == B16 else 0.0)
    for got in (got_h, nat.rms_norm(want_x, w, 1e-5)):
        assert ((got.double() - want_h.double()).abs() <= rel * want_h.double().abs()).all()
    gate_up = torch.randn(1, 2 * 1536, generator=gen).to(dtype) * 4
    gate_up[0, :3] = torch.tensor([-88.5, -88.4, -88.69])  # exp(-gate) past 2^127: finite
    gate, up = gate_up.chunk(2, dim=-1)
    # no sums: an exp (two units in a vector loop or libm), a sum, a division and a product,
    # and in bfloat16 the plain path's two roundings to it against the kernel's one
    want = (F.silu(gate) * up).double()
    rel = 5 * step(F32) + (2 * step(B16) if dtype == B16 else 0.0)
    assert ((nat.silu_mul(gate_up).double() - want).abs() <= rel * want.abs()).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_silu_mul_gives_the_same_bits_in_16_lanes_and_one_by_one(nat, dtype):
    """Each value of a 31-wide row goes through the 16-lane loop in one call and the
    one-by-one tail in the other (the row rotated by 16): the same bits, for values that
    underflow exp, overflow it, and signed zeros."""
    gen = torch.Generator().manual_seed(6)
    tiny = torch.finfo(F32).tiny  # the least normal float
    gate = torch.cat((torch.tensor([-100.0, -88.0, -87.0, 0.0, -0.0, 89.0, tiny, -tiny]),
                      torch.randn(23, generator=gen) * 6))
    up = torch.randn(31, generator=gen)
    order = torch.arange(31).roll(-15)  # 15..30, 0..14: the tail's values first
    row = torch.cat((gate, up)).to(dtype).view(1, 62)
    one = nat.silu_mul(row)
    other = nat.silu_mul(torch.cat((gate[order], up[order])).to(dtype).view(1, 62))
    bits = torch.int32 if dtype == F32 else torch.int16
    assert torch.equal(one[0, order].view(bits), other[0].view(bits))
    # and the build without the AVX-512 loops (its one-by-one loop) gives the same bits
    assert torch.equal(BUILD(True, True).silu_mul(row).view(bits), one.view(bits))


SHAPES = [(960, 576), (576, 1536), (13, 70), (130, 33), (7, 1)]  # blocks, tails, one input


def _weights(out, inp, gen):
    """(name, x dtype, forward.linear's weight, the native kernel's w and scale) of one
    float32 matrix: row-major and input-major float32, bfloat16, int8."""
    w = torch.randn(out, inp, generator=gen) * 0.05
    b16 = w.bfloat16()
    q = quantize(b16.clone())
    yield "float32", torch.float32, w, w, None
    yield "float32 input-major", torch.float32, w.t().contiguous().t(), w.t().contiguous().t(), None
    yield "bfloat16", torch.bfloat16, b16, b16, None
    yield "int8", torch.bfloat16, q, q.q, q.scale


@pytest.mark.parametrize("out,inp", SHAPES)
@pytest.mark.parametrize("bias", (False, True))
def test_linear_equals_the_plain_product(nat, out, inp, bias):
    """One row times each kind of weight: float32 to its rounding; bfloat16 and int8 (the
    sum times the row's scale) within a bfloat16 step of the float64 product, as the plain
    product is."""
    gen = torch.Generator().manual_seed(out * inp)
    for name, dtype, plain, w, scale in _weights(out, inp, gen):
        x = torch.randn(1, inp, generator=gen).to(dtype)
        b = torch.randn(out, generator=gen).to(dtype) if bias else None
        got = nat.linear(x, w, torch.empty(0) if scale is None else scale,
                         torch.empty(0) if b is None else b)
        assert got.dtype == dtype and got.shape == (1, out), name
        scaled = 1 if scale is None else scale.double()
        product = F.linear(x.double(), w.double()) * scaled
        exact = product if b is None else product + b.double()
        summed = product.abs() + (0 if b is None else b.double().abs())
        # a float32 sum of inp terms in any order, the scale's product and the bias's sum
        # rounding once each; bfloat16 and int8 round the product and the sum with the bias
        # to bfloat16, once each
        bound = dot(x, w, F32, exact=True) * scaled + 2 * unit(F32) * summed
        if dtype == B16:
            bound = bound + 2 * unit(B16) * summed
        assert ((got.double() - exact).abs() <= bound).all(), name
        if dtype == F32 or name == "bfloat16" or inp % INT8_INPUTS == 0:  # else forward.linear
            # multiplies by the int8 matrix's bfloat16 values, each rounded: another product
            theirs = linear(x, plain, b).double()  # the same bound from the exact: twice of it
            assert ((got.double() - theirs).abs() <= 2 * bound).all(), name


def test_linear_sums_in_the_same_order_on_any_number_of_threads(nat):
    gen = torch.Generator().manual_seed(3)
    for name, dtype, _, w, scale in _weights(576, 1536, gen):
        x = torch.randn(1, 1536, generator=gen).to(dtype)
        scale = torch.empty(0) if scale is None else scale
        with running(1):
            one = nat.linear(x, w, scale, torch.empty(0))
        with running(2):  # two at least, whatever the suite's own threads
            assert torch.equal(nat.linear(x, w, scale, torch.empty(0)), one), name


@pytest.mark.parametrize("out,inp", [(96, 576), (37, 70)])
def test_linear_of_rows_gives_each_row_its_own_bits(nat, out, inp):
    """B rows at once (a batch's products: each weight read once for all of them) give each
    row the bits it gets alone, for every kind of weight, B up to past the kernels' groups."""
    gen = torch.Generator().manual_seed(out + inp)
    for name, dtype, _, w, scale in _weights(out, inp, gen):
        scale = torch.empty(0) if scale is None else scale
        b = torch.randn(out, generator=gen).to(dtype)
        for B in (2, 5, 9, 17):
            x = torch.randn(B, inp, generator=gen).to(dtype)
            rows = nat.linear(x, w, scale, b)
            assert rows.shape == (B, out) and rows.dtype == dtype, name
            for r in range(B):
                assert torch.equal(rows[r:r + 1], nat.linear(x[r:r + 1], w, scale, b)), \
                    (name, B, r)


@pytest.mark.parametrize("name,dtype", [("tiny-random", "float32"), ("tiny-random", "bfloat16"),
                                        ("tiny-random", "int8"),
                                        ("tiny-random-llama3", "bfloat16")])
def test_a_batch_s_native_rows_are_their_own_native_steps(nat, name, dtype):
    """``native.decode_rows`` (a native model's batch stage 1): rows of different lengths,
    one with a folded slot's log-mass and one with recall's query, each give exactly what
    the native ``decode`` gives that row alone: logits, new K/V, attention, query and
    log-sum-exp."""
    from positronic_brain.model import load_model
    from positronic_brain.special_tokens import TokenPolicy
    from positronic_brain.stages.apply import prime
    model = load_model(name, dtype, compile="native")
    policy, gen = TokenPolicy(model.tokenizer), torch.Generator().manual_seed(5)
    views = [prime(model, policy.raw_prompt(text), capacity=64)[0].view()
             for text in ("a row", "a longer row of the batch", "one more", "and the last")]
    pasts = [(v.k, v.v, v.log_mass) for v in views]
    s = model.spec
    pasts[1] = (pasts[1][0], pasts[1][1], torch.rand(s.n_layers, s.n_kv_heads, views[1].n,
                                                     generator=gen))
    ids = torch.tensor([v.pending_token for v in views])
    positions = torch.tensor([v.next_position for v in views])
    queries = [False, True, False, True]
    assert native.rows_apply(model, pasts)
    rows = native.decode_rows(model, pasts, ids, positions, queries)
    for b, (got, (k, v, mass), want_query) in enumerate(zip(rows, pasts, queries)):
        alone = native.decode(model, k, v, ids[b:b + 1], positions[b:b + 1], True, mass,
                              want_query)
        for field in ("logits", "k", "v", "attention", "query", "lse"):
            a, w = getattr(got, field), getattr(alone, field)
            assert (a is None and w is None) or (torch.equal(a, w) and a.stride() == w.stride()
                                                 and a.is_contiguous() == w.is_contiguous()), \
                (b, field)
        assert (got.query is not None) == want_query


def test_linear_refuses_what_it_cannot_multiply(nat):
    x, none = torch.randn(1, 8), torch.empty(0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        nat.linear(x, torch.randn(4, 8).bfloat16(), none, none)
    with pytest.raises(RuntimeError, match="matrix"):
        nat.linear(x, torch.randn(4, 9), none, none)
    with pytest.raises(RuntimeError, match="row-major"):
        nat.linear(x, torch.randn(4, 16)[:, ::2], none, none)
    with pytest.raises(RuntimeError, match="scale per output"):
        nat.linear(x.bfloat16(), torch.zeros(4, 8, dtype=torch.int8), none, none)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("c,layers,weighted,D", [(1000, (1, 2, 4), True, 64),
                                                 (77, (0,), False, 64), (1, (3, 4), True, 64),
                                                 (40, (0, 2), True, 256)])
def test_cold_max_is_the_scan_s_maximum(nat, dtype, c, layers, weighted, D):
    """Recall's native scan: each cold key's largest q.k - lse (+ its log value weight) over
    the layers and heads, as the plain scan's products and maxima give it (at SmolLM2's
    head size and one past 128, groups of three query heads, over a strided store's rows)."""
    from positronic_brain.stages.score import cold_logits
    from positronic_brain.state import ColdView
    from positronic_brain.types import RecallQuery
    gen = torch.Generator().manual_seed(c)
    L, H, KVH = 5, 9, 3
    k = torch.randn(L, KVH, c + 50, D, generator=gen).to(dtype)[:, :, :c]  # a store's prefix
    q = torch.randn(L, H, D, generator=gen).to(dtype)
    lse = torch.randn(L, H, generator=gen) * 3
    log_w = torch.randn(len(layers), KVH, c, generator=gen) if weighted else None
    cold = ColdView(k=k, v=k, vnorm=k.float().norm(dim=-1), uid=torch.arange(c),
                    position=torch.arange(c), source=torch.zeros(c), born_step=torch.zeros(c))
    rq = RecallQuery(query=q, lse=lse, layers=layers, signal="attention", aggregate="max-max")
    want = cold_logits(cold, rq, group_max=True)[:, :, 0]  # (l, KVH, c)
    want = (want if log_w is None else want + log_w).amax((0, 1))
    with running(2):  # two at least, whatever the suite's own threads
        got = native.cold_max(cold, rq, log_w)
    assert got.shape == (c,) and got.dtype == torch.float32
    with running(1):  # blocks of keys share the threads; each key's sums are the same on one
        assert torch.equal(native.cold_max(cold, rq, log_w), got)
    # each q.k sums D terms (rounded to bfloat16 there, a step apart at most from another
    # order), then the log-sum-exp (and log weight) is taken off in float32; a maximum of
    # values each within its bound is within the largest bound
    qk = (q.double()[list(layers)].view(len(layers), KVH, H // KVH, D)
          @ k.double()[list(layers)].transpose(2, 3))  # (l, KVH, G, c)
    mag = (q.double()[list(layers)].abs().view(len(layers), KVH, H // KVH, D)
           @ k.double()[list(layers)].abs().transpose(2, 3))
    rest = lse.double()[list(layers)].abs().view(len(layers), KVH, H // KVH, 1)
    if log_w is not None:
        rest = rest + log_w.double().abs()[:, :, None]
    bound = sum_bound(F32, D, 1.0) * mag + 2 * step(F32) * (qk.abs() + rest)
    if dtype == B16:
        bound += step(B16) * qk.abs()
    assert ((got.double() - want.double()).abs() <= bound.amax((0, 1, 2))).all()


def test_cold_max_refuses_what_it_cannot_scan(nat):
    q, lse = torch.randn(2, 4, 16), torch.randn(2, 4)
    k, none = torch.randn(2, 2, 5, 16), torch.empty(0)
    with pytest.raises(RuntimeError, match="one dtype"):
        nat.cold_max(q, lse, k.bfloat16(), none, [0])
    with pytest.raises(RuntimeError, match="out of range"):
        nat.cold_max(q, lse, k, none, [2])
    with pytest.raises(RuntimeError, match="log_w must be"):
        nat.cold_max(q, lse, k, torch.zeros(2, 2, 5), [0])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("n,culls", [(1000, (3,)), (1000, (0, 17, 300, 512, 999)), (50, (7, 8))])
def test_fold_into_finds_the_plain_targets(tiny_model, dtype, n, culls):
    """Fold's native target search (a native model's stage 3) against the plain one, at
    SmolLM2's head size over an arena's transposed keys: the same slots (a bfloat16 product
    rounds once: from another sum order a target may be another slot as alike to a step),
    and the same drops below the cosine threshold."""
    import dataclasses

    from positronic_brain.stages.decide import fold_targets
    from positronic_brain.state import Arena, Ledger, State
    spec = dataclasses.replace(tiny_model.spec, n_layers=3, n_kv_heads=3, head_dim=64)
    a = Arena.allocate(spec, 1024, dtype)
    a.kt.copy_(torch.randn(a.kt.shape, generator=torch.Generator().manual_seed(n)))
    a.n = n
    a.renorm(0, n)
    m = Ledger.allocate(a.capacity)
    m.n = n
    m.uid[:n] = torch.arange(n)
    view = State(a, m).view()
    keys = view.k.float()  # (L, KVH, n, D)

    def cosine(slot, into):  # (L, KVH): the culled key's with each target's, over its norm
        target = keys.gather(2, into.clamp_min(0)[..., None, None].expand(-1, -1, 1, 64))
        dots = (keys[:, :, slot] * target[:, :, 0]).sum(-1)
        return dots / view.knorm.gather(2, into.clamp_min(0)[..., None])[..., 0]
    # a culled key a's likeness to b is a.b / |b|: 64 terms whose |a_i b_i| add to at most
    # |a| |b|, a division, and in bfloat16 the product rounded once to it, a step apart at most
    rel = sum_bound(F32, 64) + 2 * step(F32) + (step(B16) if dtype == B16 else 0.0)
    for min_cos in (-1.0, 0.4):  # 0.4: some layers and heads fold nowhere
        got = fold_targets(view, culls, min_cos, "native")
        want = fold_targets(view, culls, min_cos)
        assert [f.slot for f in got] == [f.slot for f in want]
        for g, w in zip(got, want):
            same = g.into == w.into
            # where they differ, both fold (or neither) into keys as alike as rounding allows:
            # a tie within the two searches' bounds
            both = (g.into >= 0) & (w.into >= 0)
            diff = cosine(g.slot, g.into) - cosine(w.slot, w.into)
            tie = 2 * rel * keys[:, :, g.slot].norm(dim=-1)  # both searches' bounds
            assert same.float().mean() >= 0.9 and (diff.abs() <= tie)[both & ~same].all()
    assert bool((native.fold_into(view, torch.tensor(culls), 0.4) == -1).any())
    with pytest.raises(RuntimeError, match="is not live"):
        native.kernels().fold_into(view.k.transpose(2, 3), view.knorm,
                                   torch.tensor([n]), -1.0)


def test_run_takes_the_native_kernels_by_default_where_they_pay(capsys):
    """``--compile auto`` (run's default): native where the kernels are the faster path
    (``native.slower`` finds no reason) and run here (``native.unavailable``, else the
    plain path with one line on stderr saying why); the plain path without a word where it
    is the faster (float16, which the kernels do not compute in; a CPU without AVX-512F);
    ``none`` the plain path."""
    import json  # pylint: disable=import-outside-toplevel

    from positronic_brain.cli import main  # pylint: disable=import-outside-toplevel

    def run(*argv):
        rc = main(["run", "--model", "tiny-random", "--prompt", "auto or not", "--greedy",
                   "--max-new-tokens", "3", "--json", *argv])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out)["compiled"], err

    missing = None if native.slower(["cpu"], "float32") else native.unavailable()
    compiled, err = run()
    assert compiled == ("native" if native.slower(["cpu"], "float32") is None and missing is None
                        else "")
    assert err == ("" if missing is None else f"positronic-brain: --compile auto: the plain "
                                              f"stage 1 ({missing})\n")
    assert run("--compile", "none") == ("", "")
    assert run("--dtype", "float16") == ("", "")
    assert "not float16" in native.slower(["cpu"], "float16")


def test_a_build_killed_part_way_holds_no_later_load():
    """torch's lock file in the build folder, left by a build whose process was killed,
    would make every later load wait for ever; the build's own lock (let go by the system
    when its holder dies) shows it to be a leftover, and the next load removes it."""
    folder = native.build_folder(native.build())
    with open(folder / "build.flock", "w", encoding="utf-8") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # no load in another process is under way
        (folder / "lock").write_text("")
    code = "from positronic_brain import native; native.kernels()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(folder / "build.flock", "w", encoding="utf-8") as held:
        # read under the build's lock: a load in another process (a test's worker, a run
        # beside the suite) holds torch's lock file while it loads
        fcntl.flock(held, fcntl.LOCK_EX)
        assert not (folder / "lock").exists()


def test_another_checkout_of_the_same_source_loads_without_a_rebuild(tmp_path):
    """The build names its source by the build folder's own copy, so a second checkout (a
    clone or a worktree elsewhere, the same source) loads the kernels built for the first
    instead of building them again (tens of seconds each time the two take turns)."""
    native.kernels()
    folder = native.build_folder(native.build())
    (built,) = folder.glob("*.so")
    before = built.stat().st_mtime_ns
    elsewhere = tmp_path / "checkout" / "native.cpp"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(native.SOURCE.read_bytes())
    code = (f"from pathlib import Path; from positronic_brain import native; "
            f"native.SOURCE = Path({str(elsewhere)!r}); native.kernels()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(folder / "build.flock", "w", encoding="utf-8") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # read while no load in another process writes
        assert built.stat().st_mtime_ns == before
        assert str(folder / "native.cpp") in (folder / "build.ninja").read_text()


def _draws(draw, p: torch.Tensor, seed: int, times: int = 3) -> tuple[list[int], torch.Tensor]:
    """``times`` tokens drawn by ``draw(p, generator)`` from a generator seeded ``seed``, and
    the generator's state after them."""
    gen = torch.Generator().manual_seed(seed)
    return [int(draw(p, gen)) for _ in range(times)], gen.get_state()


def _torch_draw(p, gen):
    return torch.multinomial(p, 1, generator=gen)


def _same_draws(nat, p: torch.Tensor, seed: int) -> None:
    (ours, state), (theirs, their_state) = _draws(nat.draw, p, seed), _draws(_torch_draw, p, seed)
    assert ours == theirs and torch.equal(state, their_state), (seed, ours, theirs)


def test_draw_is_torch_s_multinomial_draw(nat):
    """The sampler's ``draw`` takes the token torch.multinomial(p, 1) takes from the same
    generator and leaves the generator in the same state, over vocabularies of 1 to 49,152
    tokens, flat and peaked distributions, exact zeros (a rule's removed tokens),
    probabilities too small to be normal floats and weights too large for their ratios to
    stay finite; what torch refuses (a NaN, an infinity, a negative weight, all zero) it
    leaves to torch (-1), the generator untouched."""
    g = torch.Generator().manual_seed(0)
    for i in range(240):
        V = (1, 2, 16, 1000, 49152)[i % 5]
        p = (torch.randn(V, generator=g) * (0.01, 1.0, 5.0, 30.0, 200.0)[i // 5 % 5]).softmax(-1)
        if i % 7 == 3:
            p = torch.where(torch.rand(V, generator=g) < 0.5, 0.0, p)
            p[i % V] += 0.5  # never all zero
        if i % 11 == 5:
            p = p / 1e30  # some below the smallest normal float
        if i % 13 == 6:
            p = p / p.max() * torch.finfo(torch.float32).max  # ratios past the largest float
        _same_draws(nat, p, i)
    for bad in ([0.5, float("nan")], [0.0, 0.0], [-0.1, 1.0], [1.0, float("inf")]):
        gen = torch.Generator().manual_seed(1)
        before = gen.get_state()
        assert nat.draw(torch.tensor(bad), gen) == -1 and torch.equal(gen.get_state(), before)


def test_draw_decides_ties_and_near_misses_as_torch(nat):
    """Weights made from the generator's own uniforms (the u_i torch's exponential variates
    come from, read from a copy of the generator): ratios p_i / u_i a float step either side
    of the winner's ratio over the skip's margin, exact ties of the float ratios before and
    after the winner (the first index wins), and a winner at the first and the last token."""
    V, margin = 4096, 1.0 + 2.0 ** -20
    for seed in range(12):
        u = torch.rand(V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        q = (-torch.log1p(-u)).float()  # torch's variates, as ``exponential_`` makes them
        p = torch.rand(V, generator=torch.Generator().manual_seed(100 + seed))
        best = (p / q).argmax()
        top = (p / q)[best]
        near = torch.arange(seed % 7, V, 5)  # p / u at the skip's bound, and a step off it
        bound = (top.double() * u[near] / margin).float()
        step = torch.tensor([-1.0, 0.0, 1.0])[torch.arange(near.numel()) % 3]
        p[near] = torch.nextafter(bound, bound + step)
        tied = torch.arange(seed % 3, V, 97)  # ratios equal to the best's, where they can be
        p[tied] = (top * q[tied]).where((top * q[tied]) / q[tied] == top, p[tied])
        if seed % 4 == 1:
            p[0] = p.max() * 2 / q[0].item() * q[0]
        if seed % 4 == 2:
            p[-1] = p.max() * 4
        _same_draws(nat, p, seed)


def test_the_sampler_draws_with_the_kernels_as_without(nat):
    """Sampling with the kernels' draw (a native model's) gives the reports and leaves the
    generator as sampling with torch's, under each rule."""
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(1)) * 4
    seen = torch.arange(100)
    calls = []

    def spy(p, gen):  # the kernels' draw, counted
        calls.append(1)
        return native.draw(p, gen)

    for params in (SamplerParams(), SamplerParams(temperature=0.7, top_p=0.9),
                   SamplerParams(top_k=50, repetition_penalty=1.3), SamplerParams(min_p=0.05)):
        runs = []
        for draw in (spy, None):
            gen = make_generator(7)
            runs.append(([sample(logits, params, seen, gen, draw=draw) for _ in range(20)],
                         gen.get_state()))
        assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1]), params
    assert len(calls) == 80
