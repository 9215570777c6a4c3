"""The read-only manual forward: T new tokens over the arena's live K/V.

Used by stage 0 (chunked prefill), stage 1 (T = 1) and repair (with some live slots
masked). It reads weights and the live K/V views and never writes to them: the new tokens'
K/V are returned as outputs (a prefill's written where stage 0 says: the arena's next
slots, not live yet), and attention over ``[live keys, new keys]`` is computed as two
score blocks joined by one softmax, so the past is never concatenated (docs/BENCHMARKS.md
says what the bfloat16 product still copies inside a layer); a prefill that wants no
scores (``builds_scores``) has torch's fused attention attend instead.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .model import Int8Weight, Model, PackedWeight, cpu_line
from .types import ForwardOut, require


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without launching an operator when it already is (a no-op ``to`` still
    goes through the dispatcher: dozens of them per token in float32)."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in float32, cast back, then scale. On the CPU one fused
    kernel does the first two for any dtype (it computes in float32 and rounds once: the
    same bits, ``tests/test_op_count.py``); elsewhere the casts are explicit."""
    if x.is_cpu:
        return w * F.rms_norm(x, (x.shape[-1],), eps=eps)
    return w * as_dtype(F.rms_norm(as_dtype(x, torch.float32), (x.shape[-1],), eps=eps), x.dtype)


INT8_ROWS = 16  # the most rows an int8 product multiplies by its int8 weight (``linear``): on
# SmolLM2's gate/up and two cores, the int8 product is the faster up to 16 rows, not from 24
INT8_INPUTS = 16  # torch's int8 product needs a multiple of 16 inputs (else garbage or a crash)
# An Intel CPU without AMX multiplies bfloat16 matrices slower than float32 ones: on the
# Xeon of docs/BENCHMARKS.md's native run (avx512_bf16, no AMX) oneDNN's bfloat16 product of
# a prefill chunk by SmolLM2's weights was slower than the float32 product with both
# operands widened first, and torch's bfloat16 flash attention slower than its float32 one.
# The AMD EPYC of its other run (avx512_bf16, no AMX) is the other way round: a bfloat16
# prefill there was the faster (BENCHMARKS.md has both). On the first kind (``WIDEN``) a
# bfloat16 product of at least ``WIDE_ROWS`` rows (a prefill chunk's) widens its operands to
# float32 and rounds its result to bfloat16 (``wide``): the same products, summed in float32
# as the bfloat16 product sums them, equal to it up to float rounding. From 96 rows widened
# timed faster.
WIDEN = (cpu_line("vendor_id").endswith("GenuineIntel")
         and not torch.cpu._is_amx_tile_supported())  # torch's own test (private; since 2.3)
WIDE_ROWS = 128


def wide(x: torch.Tensor, rows: int) -> bool:
    """Whether a product over ``rows`` rows of ``x`` widens to float32 (``WIDEN``)."""
    return rows >= WIDE_ROWS and WIDEN and x.dtype == torch.bfloat16 and x.is_cpu


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product by a packed bfloat16 weight (``model.pack``), as an operator
    ``torch.compile`` calls as it is (``torch.ops.positronic_brain.packed_linear``): inductor
    has its own lowering of oneDNN's, which takes only weights it packed itself, so a
    compiled stage 1 reaches the packed weights here. Defined through torch's plain
    operator library, whose call costs a third of what ``torch.library.custom_op``'s does."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


_OPS = torch.library.Library("positronic_brain", "DEF")  # the operators live while it does
_OPS.define("packed_linear(Tensor x, Tensor w, Tensor? b) -> Tensor")
_OPS.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("positronic_brain::packed_linear")
def _packed_linear_shape(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    del b
    return x.new_empty(x.shape[0], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight | Int8Weight,
           b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except for an int8 weight (``model.Int8Weight``: torch's weight-only
    int8 product up to ``INT8_ROWS`` rows, which reads half a bfloat16 weight's bytes; for
    more rows, a prefill chunk, where it is slower than the bfloat16 product, or inputs not a
    multiple of ``INT8_INPUTS``, which that product gets wrong, ``F.linear`` on its bfloat16
    values), a packed bfloat16 weight (``model.pack``: oneDNN's own
    product) and one float32 row (a decode step) with an input-major weight
    (``w.t()`` contiguous, as ``load_model`` stores float32 weights): MKL would compute that
    matrix-vector product on one thread, so the weight's input rows are split into one
    part per thread, the partial products run as one ``bmm`` (each thread reads its part in
    storage order) and are summed: faster than ``F.linear`` on SmolLM2's shapes (``bench
    speed``); equal to it up to float rounding (the sum is split in a different order).
    A bfloat16 product of many rows on an Intel CPU without AMX (``wide``) multiplies in float32
    whatever the weight's kind (an int8 weight's bfloat16 values)."""
    if wide(x, x.shape[0]):
        plain = w.plain if isinstance(w, (PackedWeight, Int8Weight)) else w
        return F.linear(x.float(), plain.float(), None if b is None else b.float()).to(x.dtype)
    if isinstance(w, Int8Weight):
        if x.shape[0] > INT8_ROWS or w.shape[1] % INT8_INPUTS:
            return F.linear(x, w.plain, b)
        y = torch.ops.aten._weight_int8pack_mm(x, w.q, w.scale)
        return y if b is None else y + b
    if isinstance(w, PackedWeight):  # compiled, through the operator inductor calls as it is
        compiled = torch.compiler.is_compiling()
        return (torch.ops.positronic_brain.packed_linear if compiled else packed_linear)(x, w.w, b)
    # compiled (``Model.compiled``), inductor multiplies as it sees fit: the split is eager's
    parts = 1 if torch.compiler.is_compiling() else torch.get_num_threads()
    if (x.shape[0] != 1 or not x.is_cpu or w.dtype != torch.float32 or parts < 2 or w.shape[1] % parts
            or w.stride() != (1, w.shape[0])):
        return F.linear(x, w, b)
    rows, out = w.shape[1] // parts, w.shape[0]  # each part's input rows
    w_parts = w.as_strided((parts, rows, out), (rows * out, out, 1))  # one op: w.t() in parts
    y = torch.bmm(x.reshape(parts, 1, rows), w_parts).sum(0)
    return y if b is None else y + b


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def rope_cos_sin(model: Model, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin from the model's own rotary embedding: each (T, head_dim)."""
    dummy = torch.empty(1, dtype=dtype, device=positions.device)
    cos, sin = model.rotary(dummy, positions.view(1, -1))
    return cos[0], sin[0]


def rope_tables(model: Model, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin (H + kv_heads, T, head_dim) that rope the q and k heads at once, as x * cos +
    roll(x, D/2) * sin (= apply_rope, since rotate_half(x) = roll(x, D/2) with its first half
    negated: sin's first half is). q's rows carry the 1/sqrt(D) score scale, which for a
    power-of-two scale (D = 64) gives exactly (rope q) * scale."""
    s = model.spec
    H, KVH, D = s.n_heads, s.n_kv_heads, s.head_dim
    cos, sin = rope_cos_sin(model, positions, dtype)  # (T, D)
    sin = torch.cat((-sin[:, : D // 2], sin[:, D // 2:]), dim=-1)
    if model.device.type == "cpu":
        heads = torch.tensor([D ** -0.5] * H + [1.0] * KVH, dtype=dtype).view(H + KVH, 1, 1)
    else:  # made there: a copy from host memory waits for it (and a CUDA graph replays it stale)
        heads = torch.ones(H + KVH, 1, 1, dtype=dtype, device=model.device)
        heads[:H] = D ** -0.5
    return cos * heads, sin * heads


def rerotation(model: Model, old: torch.Tensor, new: torch.Tensor):
    """cos/sin (T, head_dim) float32 of the rotation moving a RoPE'd key from ``old`` (T,)
    to ``new`` (T,) positions: R(theta_new) R(theta_old)^-1, built from the model's own
    angles by the angle-difference formulas (not from the delta new - old), so the result
    equals the model's RoPE at ``new`` to float rounding even where theta is large.

    Exact only because each rotation is a fixed function of position: it would not hold for
    RoPE variants whose frequencies change with the sequence length (dynamic NTK, longrope)
    or that scale cos/sin (attention_scaling != 1 would be applied twice); model loading
    refuses those.
    """
    cos_o, sin_o = rope_cos_sin(model, old, torch.float32)
    cos_n, sin_n = rope_cos_sin(model, new, torch.float32)
    return cos_n * cos_o + sin_n * sin_o, sin_n * cos_o - cos_n * sin_o


def rerotate(model: Model, k: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Keys ``k`` (..., n, head_dim) RoPE'd at positions ``old`` (n,), rotated to ``new``
    (n,) by ``rerotation``, in float32 as stage 4's re-index does; a key whose position
    does not change keeps its exact bits."""
    moved = old != new
    if not bool(moved.any()):
        return k
    cos, sin = rerotation(model, old, new)
    x = k.float()
    return torch.where(moved.unsqueeze(-1), apply_rope(x, cos, sin), x).to(k.dtype)


Past = torch.Tensor | tuple[torch.Tensor, ...]  # (L, ...), or one (L_b, ...) per block of layers


def _blocks(past: Past) -> tuple[torch.Tensor, ...]:
    """An arena tensor's blocks of layers: itself, or a split arena's blocks."""
    return (past,) if isinstance(past, torch.Tensor) else past


def _layers(past: Past) -> tuple[torch.Tensor, ...]:
    """One tensor per layer of an arena tensor (L, ...), or of a split arena's blocks."""
    return tuple(t for block in _blocks(past) for t in block.unbind(0))


def _gather(ts: list[torch.Tensor], device: torch.device, split: bool) -> torch.Tensor:
    """Per-layer outputs stacked (L, ...) on ``device`` (from the layers' devices if split)."""
    return torch.stack([t.to(device) for t in ts] if split else ts)


def _stacked(ks: list[torch.Tensor], vs: list[torch.Tensor], device: torch.device,
             split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The new K/V kept per layer, each stacked (L, kv_heads, T, head_dim) (``_gather``)."""
    return _gather(ks, device, split), _gather(vs, device, split)


APART = ("cpu",)  # devices whose fused prefill attention is ``cpu_attention`` (no past mask)


def builds_scores(model: Model, statistics: bool, log_mass: bool, masked: bool = False) -> bool:
    """Whether ``forward`` builds the scores of several new tokens (a prefill): with a folded
    slot's ``log_mass`` wanted; with the prompt's ``statistics`` wanted unless
    ``cpu_attention`` attends (every layer on the CPU, no past slot ``masked``: its
    log-sum-exps give them, ``_received_lse``); and in half precision on the CPU, as HF's eager attention
    does, but for bfloat16 (int8's too) on an Intel CPU without AMX (``WIDEN``) and no past
    slot ``masked``, where ``cpu_attention`` widens (the fused attention is the faster there
    even unwidened); else
    torch's fused attention (``fused_attention``) attends, which never builds them.
    ``stages.apply.chunks`` sizes prefill chunks by it."""
    apart = all(d.type in APART for d in model.layer_devices) and not masked
    wide_cpu = WIDEN and model.dtype == torch.bfloat16 and not masked
    return log_mass or (statistics and not apart) or (
        model.dtype != torch.float32 and model.device.type == "cpu" and not wide_cpu)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    bias: torch.Tensor | None, grouped: bool) -> torch.Tensor:
    """torch's fused attention (H, T, D) of the new queries ``q`` (H, T, D), scaled already,
    over ``k``/``v`` (kv_heads, S, D) plus ``bias`` (T, S): 0 where a query may attend,
    -inf where not (``q``'s dtype). ``bias`` None: causal if T > 1 (the keys are the
    queries' own: a first chunk, with no past), else unmasked. Causal, the kernel gets no
    mask but the causal flag, and skips the blocks the triangle hides (on the CPU the same
    bits as with the mask). ``grouped``: the kernel is given the grouped K/V heads (the
    CPU's flash kernel takes them with a mask). Else, as on a GPU, where a mask with grouped
    heads, or grouped heads in float32, leave only torch's plain implementation, which
    builds every head's float32 scores: the grouped heads go only to the flash kernel,
    causal in half precision; otherwise each K/V head is repeated for its group of query
    heads, which the memory-efficient kernel takes, masked or in float32. (A GPU without the
    flash kernel, before sm80 or past its head size, would take the plain implementation
    for the causal call, which ``stages.apply.chunks`` does not budget for.) The same
    attention; its bits are the kernel's."""
    q, causal = q.unsqueeze(0), bias is None and q.shape[1] > 1
    if grouped or (causal and q.dtype in (torch.float16, torch.bfloat16)):
        return F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=bias,
                                              is_causal=causal, scale=1.0, enable_gqa=True)[0]
    g = q.shape[1] // k.shape[0]
    k, v = (x.repeat_interleave(g, dim=0)[None] for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                          scale=1.0)[0]


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  past_k: torch.Tensor | None = None,
                  past_v: torch.Tensor | None = None, lse: bool = False):
    """torch's CPU flash kernel (H, T, D) for the new queries ``q`` (H, T, D), scaled
    already, over their own ``k``/``v`` (kv_heads, T, D), causal (one query, the last:
    all of them), and over every past slot ``past_k``/``past_v`` (kv_heads, n, D) apart,
    the two merged by their log-sum-exps: the kernel then skips the blocks the causal
    triangle hides, which a bias over [past slots | new tokens] would have it compute and
    add, and only the past keys are copied (out of the arena's transposed layout), not past
    and new joined. The kernel takes grouped K/V heads. Alone (no past), the bits of
    ``fused_attention``'s causal call; with the past, the same attention to float rounding.
    Many bfloat16 queries on an Intel CPU without AMX (``wide``) attend in float32, the result
    rounded to bfloat16. ``lse``: also each query's log-sum-exp over every key it attends
    (H, T) float32, the softmax's denominator (``_received_lse``)."""
    dtype = q.dtype
    if wide(q, q.shape[1]):
        q, k, v, past_k, past_v = (
            t if t is None else t.to(torch.float32, memory_format=torch.contiguous_format)
            for t in (q, k, v, past_k, past_v))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, own = flash(q[None], k[None], v[None], 0.0, q.shape[1] > 1, scale=1.0)[:2]
    if past_k is None:
        both, out = own, out[0].to(dtype)
    else:
        past, past_lse = flash(q[None], past_k.contiguous()[None], past_v[None], 0.0, False,
                               scale=1.0)[:2]
        both = torch.logaddexp(own, past_lse)
        out = (out * (own - both).exp_()[..., None]).add_(
            past * (past_lse - both).exp_()[..., None])[0].to(dtype)
    return (out, both[0].float()) if lse else out


def _score_buffers(bufs: dict, qg: torch.Tensor, n: int, T: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffers every layer of a prefill that builds its scores reuses on ``qg``'s device
    (made at its first layer there): one block in the model's dtype seen as the products
    over the ``n`` past slots (kv_heads, group x ``T``, n) and, once they are joined into
    the scores, as the probabilities cast back (kv_heads, group x T, n + T), and the float32
    scores (that shape), which the softmax overwrites with its probabilities. Each
    layer allocating its own, at thousands of slots tens of MB each, had the allocator map
    fresh pages and fault them in every time."""
    if qg.device not in bufs:
        KVH, rows = qg.shape[:2]
        block = torch.empty(KVH * rows * (n + T), dtype=dtype, device=qg.device)
        bufs[qg.device] = (block[: KVH * rows * n].view(KVH, rows, n),
                           torch.empty(KVH, rows, n + T, device=qg.device),
                           block.view(KVH, rows, n + T))
    return bufs[qg.device]


def _qkv(x: torch.Tensor, w, cos_qk: torch.Tensor, sin_qk: torch.Tensor, spec):
    """A layer's first half for the new tokens ``x`` (T, hidden): its RMSNorm, the joined q/k/v
    product, q and k roped at once (``rope_tables``). Returns qk (H + KVH, T, D), its q
    (H, T, D) and k (KVH, T, D) parts, and v (KVH, T, D); one token's are views of its row
    (moving a size-1 dimension)."""
    H, KVH, D = spec.n_heads, spec.n_kv_heads, spec.head_dim
    T = x.shape[0]
    h = rms_norm(x, w.ln1, spec.rms_eps)
    qk, v = linear(h, w.qkv_w, w.qkv_b).split(((H + KVH) * D, KVH * D), dim=1)
    qk = qk.view(H + KVH, 1, D) if T == 1 else qk.view(T, H + KVH, D).transpose(0, 1)
    qk = qk * cos_qk + qk.roll(D // 2, -1) * sin_qk
    q, k = qk.split((H, KVH))
    v = v.view(KVH, 1, D) if T == 1 else v.view(T, KVH, D).transpose(0, 1)
    return qk, q, k, v


def _scores(qg: torch.Tensor, k: torch.Tensor, past_kt: torch.Tensor,
            log_mass: torch.Tensor | None, mask_past: torch.Tensor | None,
            mask_new: torch.Tensor | None, g: int, buf) -> tuple[torch.Tensor, torch.Tensor]:
    """The built scores of the grouped queries ``qg`` (KVH, g Tq, D) over the past keys
    ``past_kt`` (KVH, D, n) and the new ``k`` (KVH, T, D), each block plus its log-mass and
    mask (None: none), joined (KVH, g Tq, n + T), and their float32 softmax. In the model's
    dtype, as its products round them; float32 from the first addition on (the softmax
    takes them to float32 itself: the same bits as a cast); joined in the wider dtype (a
    float32 block casts the other as it joins: the same bits as casting first). ``buf``
    (``_score_buffers``, or None): a prefill's buffers, whose softmax overwrites its scores
    row by row."""
    KVH, rows, _ = qg.shape
    Tq, n, T = rows // g, past_kt.shape[2], k.shape[1]
    s_past = torch.bmm(qg, past_kt, out=None if buf is None else buf[0])
    s_new = torch.bmm(qg, k.transpose(1, 2))  # (KVH, gT, T)
    if log_mass is not None:
        s_past = as_dtype(s_past, torch.float32) + log_mass.unsqueeze(1)  # (KVH, 1, n)
    if mask_past is not None:
        s_past = (s_past.view(KVH, g, Tq, n) + mask_past).view(KVH, rows, n)
    if mask_new is not None:
        s_new = (s_new.view(KVH, g, Tq, T) + mask_new).view(KVH, rows, T)
    scores = torch.cat((s_past, s_new), dim=-1, out=None if buf is None else buf[1])
    p = torch.softmax(scores, dim=-1, dtype=torch.float32, out=None if buf is None else scores)
    return scores, p


def _weigh(p: torch.Tensor, v: torch.Tensor, past_v: torch.Tensor, buf,
           dtype: torch.dtype) -> torch.Tensor:
    """The softmax ``p`` (KVH, g Tq, n + T) float32, in the model's ``dtype``, times the past
    values ``past_v`` (KVH, n, D) and the new ``v`` (KVH, T, D): (KVH, g Tq, D)."""
    n, T = past_v.shape[1], v.shape[1]
    p = as_dtype(p, dtype) if buf is None or dtype == torch.float32 else buf[2].copy_(p)
    p_past, p_new = p.split((n, T), dim=-1)
    if p.dtype != torch.float32 and p.device.type != "cpu":
        # a half-precision product on a GPU over weights whose rows are n + T apart
        # (a stride not aligned as cuBLAS's fast kernels want) falls to a kernel for
        # small products; over a contiguous copy it does not (docs/DESIGN.md, stage 1)
        p_past = p_past.contiguous()
    # one new token: its weights times its value is an outer product, each element
    # one rounded product as in the matrix product (the same bits), without the
    # fixed cost of a product call (oneDNN's bfloat16 one: tens of µs on the CPU)
    new = p_new * v if T == 1 else torch.bmm(p_new, v)
    return torch.bmm(p_past, past_v) + new


def _tail(x: torch.Tensor, out: torch.Tensor, w, eps: float) -> torch.Tensor:
    """A layer's second half: the attention's output ``out`` (T, H D) through o_proj onto the
    residual ``x``, then the MLP's residual."""
    x = x + linear(out, w.o_w, w.o_b)
    h = rms_norm(x, w.ln2, eps)
    gate, up = _gate_up(h, w.gate_up_w, w.gate_up_b)
    return x + linear(w.act(gate).mul_(up), w.down_w, w.down_b)


def _recall(queries: list[torch.Tensor], last_scores: list[torch.Tensor], dev: torch.device,
            split: bool, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's last query (H + KVH, 1, D) and its score row stacked once (a few
    operators per token, not a few per layer): the queries (L, H, D) and their scores'
    log-sum-exps (L, H) float32."""
    query = _gather(queries, dev, split)[:, :heads, 0].contiguous()  # (L, H, D)
    lse = as_dtype(_gather(last_scores, dev, split), torch.float32).logsumexp(-1)
    return query, lse.view(len(queries), heads)


def _past_views(past_k: Past, past_v: Past, past_log_mass: Past | None) -> tuple:
    """Per layer, the past keys as stored, transposed (KVH, D, n), the values (KVH, n, D)
    and the log-mass (KVH, n) or None: one operator each instead of a select per layer. An
    arena's keys are stored transposed, so each key dimension is one contiguous run of
    slots: the fast layout for q K^T."""
    return (_layers(tuple(block.transpose(2, 3) for block in _blocks(past_k))), _layers(past_v),
            None if past_log_mass is None else _layers(past_log_mass))


def _past_bias(past_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``past_mask`` (T, n) bool as the additive bias built scores take (0 or -inf, float32),
    or None."""
    return (None if past_mask is None else torch.zeros(past_mask.shape, device=device)
            .masked_fill_(~past_mask, float("-inf")))


@torch.no_grad()
def decode(model: Model, past_k: Past, past_v: Past, ids: torch.Tensor,
           positions: torch.Tensor, past_mask: torch.Tensor | None = None,
           want_attention: bool = False, past_log_mass: Past | None = None,
           kv_only: bool = False, want_query: bool = False) -> ForwardOut:
    """``forward`` of one new token (``ids`` (1,)): a decode step, a merge's forwards. Its
    scores are built, so its softmax row is the attention row (``want_attention``), each
    layer's stacked after the loop (one operator, not one a layer), as are its new K/V."""
    s = model.spec
    L, H, KVH, D = s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    g, n, dev, moves = H // KVH, _blocks(past_k)[0].shape[2], model.device, model.moves
    x = F.embedding(ids, model.embed)  # (1, hidden)
    cos_qk, sin_qk = rope_tables(model, positions, model.dtype)  # (H + KVH, 1, D)
    mask = _past_bias(past_mask, dev)
    past_kt, past_vs, log_mass = _past_views(past_k, past_v, past_log_mass)
    new_k, new_v, rows, queries, last_scores = [], [], [], [], []
    for i, w in enumerate(model.layers):
        if moves and i in moves:  # this layer runs on another device: take what it reads there
            x, cos_qk, sin_qk, mask = (t if t is None else t.to(moves[i])
                                       for t in (x, cos_qk, sin_qk, mask))
        qk, q, k, v = _qkv(x, w, cos_qk, sin_qk, s)
        new_k.append(k)
        new_v.append(v)
        if kv_only and i == L - 1:
            k, v = _stacked(new_k, new_v, dev, bool(moves))
            return ForwardOut(logits=None, k=k, v=v, attention=None)
        scores, p = _scores(q.reshape(KVH, g, D), k, past_kt[i],  # heads of a KV group: GQA
                            None if log_mass is None else log_mass[i], mask, None, g, None)
        if want_query:
            queries.append(qk)
            last_scores.append(scores)
        if want_attention:
            rows.append(p)  # (KVH, g, n + 1): the one query's row
        x = _tail(x, _weigh(p, v, past_vs[i], None, model.dtype).reshape(1, H * D), w, s.rms_eps)
    x = x.to(dev) if moves else x
    logits = linear(rms_norm(x, model.final_norm, s.rms_eps), model.lm_head).float()
    query, lse = _recall(queries, last_scores, dev, bool(moves), H) if want_query else (None, None)
    attention = (_gather(rows, dev, bool(moves)).view(L, H, n + 1)[..., :n] if want_attention
                 else None)
    k, v = _stacked(new_k, new_v, dev, bool(moves))
    return ForwardOut(logits=logits, k=k, v=v, attention=attention, query=query, lse=lse)


@torch.no_grad()
def decode_rows(model: Model, pasts: Sequence[tuple], ids: torch.Tensor, positions: torch.Tensor,
                queries: Sequence[bool]) -> list[ForwardOut]:
    """``decode`` of one new token in each of B rows (a batch's stage 1): ``ids`` and
    ``positions`` (B,), row b over its own live K/V ``pasts[b]`` = (past_k, past_v,
    past_log_mass) as ``decode`` takes them (one device). The weight products take the B
    rows at once (each weight read once a step); each row attends over its own slots alone,
    so rows hold different numbers of them with nothing padded. Row b's output is
    ``decode``'s with ``want_attention`` (and ``want_query`` where ``queries[b]``), to float
    rounding: a product of B rows may add in another order than a product of one."""
    s = model.spec
    L, H, KVH, D = s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    require(not model.moves, "a batch runs on one device (no --device-map)")
    g, B = H // KVH, len(pasts)
    x = F.embedding(ids, model.embed)  # (B, hidden)
    cos_qk, sin_qk = rope_tables(model, positions, model.dtype)  # (H + KVH, B, D)
    views = [_past_views(*p) for p in pasts]
    new_k, new_v = [], []
    rows, last = [[] for _ in range(B)], [([], []) if want else None for want in queries]
    for i, w in enumerate(model.layers):
        qk, q, k, v = _qkv(x, w, cos_qk, sin_qk, s)  # (H + KVH | H | KVH | KVH, B, D)
        new_k.append(k)
        new_v.append(v)
        outs = []
        for b, (past_kt, past_vs, log_mass) in enumerate(views):
            scores, p = _scores(q[:, b].reshape(KVH, g, D), k[:, b:b + 1], past_kt[i],
                                None if log_mass is None else log_mass[i], None, None, g, None)
            if last[b] is not None:
                last[b][0].append(qk[:, b:b + 1])
                last[b][1].append(scores)
            rows[b].append(p)
            outs.append(_weigh(p, v[:, b:b + 1], past_vs[i], None, model.dtype).view(H * D))
        x = _tail(x, torch.stack(outs), w, s.rms_eps)
    logits = linear(rms_norm(x, model.final_norm, s.rms_eps), model.lm_head).float()
    k, v = torch.stack(new_k), torch.stack(new_v)  # (L, KVH, B, D)
    out = []
    for b, (_, past_vs, _) in enumerate(views):
        n = past_vs[0].shape[1]
        query, lse = (None, None) if last[b] is None else _recall(*last[b], model.device, False, H)
        out.append(ForwardOut(logits=logits[b:b + 1], k=k[:, :, b:b + 1], v=v[:, :, b:b + 1],
                              attention=torch.stack(rows[b]).view(L, H, n + 1)[..., :n],
                              query=query, lse=lse))
    return out


Store = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, its new k, v): stage 0's


@torch.no_grad()
def forward(model: Model, past_k: Past, past_v: Past, ids: torch.Tensor,
            positions: torch.Tensor, past_mask: torch.Tensor | None = None,
            want_attention: bool = False, all_logits: bool = False,
            past_log_mass: Past | None = None, kv_only: bool = False, want_query: bool = False,
            received_from: int | None = None, window_only: bool = False,
            window_peak: bool = False, store: Store | None = None) -> ForwardOut:
    """Run ``ids`` (T,) at ``positions`` (T,) over live K/V ``past_k/past_v``
    (L, kv_heads, n, head_dim). The new tokens attend causally to each other and to
    every live slot, except where ``past_mask`` (T, n) bool is False. ``past_log_mass``
    (L, kv_heads, n) float32 is added to every query's scores on the live slots (a folded
    slot's log-mass). On a model split over devices (``Model.split``), each of these is a
    tuple of one tensor per block of layers, on the block's device; the hidden state moves
    from device to device between layers (``Model.moves``), and every output is on the
    model's main device. One token runs ``decode``; several choose how they attend once
    (``_Prefill.plan``).

    Returns logits (T or 1, V) float32, the new K/V (L, kv_heads, T, head_dim) with RoPE
    applied, and optionally the last new query's attention on the live slots (L, H, n).
    ``kv_only``: only the new K/V (the same bits): the last layer stops after its K/V
    projection, and ``logits`` is None.
    ``want_query``: also the last query per layer (L, H, head_dim), roped and scaled as its
    scores use it, and the log-sum-exp of its scores (L, H) float32, so a key k that was not
    in the cache would have received exp(q.k - lse) next to the others (recall).
    ``received_from`` (stage 0's prompt statistics): also the attention each live slot and
    each new token received, per layer and head, summed over the new queries, each query's
    weight on its own token left out (as stage 1's row leaves out the pending token's):
    ``received`` (L, H, n + T) float32 over all of them, ``received_window`` over those from
    row ``received_from`` on (None: none; ``window_peak``: the most one paid, not the sum),
    ``window_only``: that one only. ``store`` (stage 0's prefill on one device) takes each
    layer's new K/V (``stages.apply.rows.store_layer``); ``k`` and ``v`` are then None.
    """
    require(not (kv_only and (want_attention or want_query or received_from is not None)),
            "kv_only skips the last layer's attention")
    require(received_from is None or (past_mask is None and past_log_mass is None),
            "the prompt's statistics are of an unmasked prefill")
    require(store is None or not (kv_only or model.moves), "store: one device, not kv_only")
    if ids.shape[0] == 1 and store is None and received_from is None:
        return decode(model, past_k, past_v, ids, positions, past_mask, want_attention,
                      past_log_mass, kv_only, want_query)
    s, dev, moves, T = model.spec, model.device, model.moves, ids.shape[0]
    L, H = s.n_layers, s.n_heads
    x = F.embedding(ids, model.embed)  # (T, hidden)
    cos_qk, sin_qk = rope_tables(model, positions, model.dtype)  # (H + KVH, T, D)
    # the new K/V to stage 0's ``store`` (DESIGN.md, stage 0) or into one block (a layer's
    # are views of its q/k/v products, else alive to the end); several devices': stacked after
    new_k, new_v = [], []
    kv = (torch.empty(2, L, s.n_kv_heads, T, s.head_dim, dtype=model.dtype, device=dev)
          if T > 1 and not moves and store is None else None)
    c = _Prefill.plan(model, past_k, past_v, past_mask, past_log_mass, T, want_attention,
                      want_query, received_from, window_only, window_peak)
    last_only = not (all_logits or kv_only or want_attention or want_query)
    for i, w in enumerate(model.layers):
        if moves and i in moves:  # this layer runs on another device: take what it reads there
            x, cos_qk, sin_qk = (t.to(moves[i]) for t in (x, cos_qk, sin_qk))
            c.move(moves[i])
        qk, q, k, v = _qkv(x, w, cos_qk, sin_qk, s)  # (H + KVH | H | KVH | KVH, T, D)
        if store is not None:
            store(i, k, v)
        elif kv is None:
            new_k.append(k)
            new_v.append(v)
        else:
            kv[0][i], kv[1][i] = k, v
        if kv_only and i == L - 1:
            k, v = kv if kv is not None else _stacked(new_k, new_v, dev, bool(moves))
            return ForwardOut(logits=None, k=k, v=v, attention=None)
        if last_only and i == L - 1 and T > 1:  # from here only the last token's row is wanted
            c.last_only(i, q, k)
            x, q = x[-1:], q[:, -1:]
        x = _tail(x, _joined(c.attend(i, qk, q, k, v), H, s.head_dim), w, s.rms_eps)
    x = x.to(dev) if moves else x
    logits = linear(rms_norm(x if all_logits else x[-1:], model.final_norm, s.rms_eps),
                    model.lm_head).float()
    query, lse = (_recall(c.queries, c.last_scores, dev, bool(moves), H) if want_query
                  else (None, None))
    k, v = (None, None) if store is not None else kv if kv is not None else _stacked(
        new_k, new_v, dev, bool(moves))
    return ForwardOut(logits=logits, k=k, v=v,
                      attention=None if c.attention is None else c.attention[..., :c.n],
                      query=query, lse=lse, received=c.received, received_window=c.window)


def _joined(out: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The heads' outputs (H, Tq, D) as rows (Tq, H * D); with one query the transpose
    moves nothing."""
    Tq = out.numel() // (heads * head_dim)
    return (out.reshape(Tq, heads * head_dim) if Tq == 1 else
            out.reshape(heads, Tq, head_dim).transpose(0, 1).reshape(Tq, heads * head_dim))


@dataclass(eq=False)
class _Prefill:  # pylint: disable=too-many-instance-attributes
    """How a forward of several new tokens attends, chosen once per call (``plan``), and
    what it gathers on the way: one of three paths, with the masks, past views and output
    buffers it needs; ``attend`` runs it for one layer."""

    spec: object
    dtype: torch.dtype
    T: int
    n: int
    fused: bool  # torch's fused attention (else the scores are built)
    masked: bool  # some past slot is masked (else, fused on the CPU: ``cpu_attention``)
    past_ks: tuple | None  # per layer (KVH, n, D), for the fused paths
    past_kt: tuple  # per layer (KVH, D, n): the arena's keys as stored
    past_vs: tuple
    log_mass: tuple | None
    bias: torch.Tensor | None = None  # the fused kernel's (T, n + T)
    mask_past: torch.Tensor | None = None  # the built scores' (T, n) and (T, T)
    mask_new: torch.Tensor | None = None
    attention: torch.Tensor | None = None  # (L, H, n + T): the last query's row per layer
    queries: list | None = None  # each layer's last query and score row (want_query)
    last_scores: list | None = None
    received_from: int | None = None
    received: torch.Tensor | None = None  # the statistics (L, H, n + T), over all queries
    window: torch.Tensor | None = None  # ... over those from ``received_from`` on
    peak: bool = False  # ``window`` holds the most one of its queries paid, not their sum
    bufs: dict = field(default_factory=dict)  # the score buffers per device (``_score_buffers``)

    @classmethod
    def plan(cls, model: Model, past_k: Past, past_v: Past, past_mask: torch.Tensor | None,
             past_log_mass: Past | None, T: int, want_attention: bool, want_query: bool,
             received_from: int | None, window_only: bool,
             window_peak: bool = False) -> "_Prefill":
        """Several new tokens with nothing wanted but the K/V and logits attend through
        torch's fused attention, unless the prefill builds its scores anyway
        (``builds_scores``). What may be attended is an additive bias, 0 or -inf: for the
        fused kernel one over [live slots | new tokens] (the live slots unless masked,
        causal after), in the queries' dtype (what the kernel would turn a boolean mask into
        in every layer), none where the CPU takes the past slots and the new tokens apart
        (``APART``, no past slot masked) or where there is no past (causal); else one over
        the score columns of each block, None where nothing is masked."""
        s, dev, dtype = model.spec, model.device, model.dtype
        n, L = _blocks(past_k)[0].shape[2], s.n_layers
        def rows() -> torch.Tensor:  # one float32 row a layer and head, for every column
            return torch.empty(L, s.n_heads, n + T, dtype=torch.float32, device=dev)

        fused = (T > 1 and not want_attention and not want_query
                 and not builds_scores(model, received_from is not None,
                                       past_log_mass is not None, past_mask is not None))
        c = cls(s, dtype, T, n, fused, past_mask is not None,
                _layers(past_k) if fused else None,
                *_past_views(past_k, past_v, past_log_mass),
                attention=rows() if want_attention else None,
                queries=[] if want_query else None, last_scores=[] if want_query else None,
                received_from=received_from,
                received=rows() if received_from is not None and not window_only else None,
                window=rows() if received_from is not None and received_from < T else None,
                peak=window_peak)
        if fused and (past_mask is not None or (n and (dev.type not in APART or model.moves))):
            allowed = torch.ones(T, n + T, dtype=torch.bool, device=dev).tril_(n)
            if past_mask is not None:
                allowed[:, :n] = past_mask
            c.bias = torch.zeros(T, n + T, dtype=dtype, device=dev).masked_fill_(
                ~allowed, float("-inf"))
        elif not fused:
            c.mask_past = _past_bias(past_mask, dev)
            if T > 1:  # causal among the new
                c.mask_new = torch.full((T, T), float("-inf"), device=dev).triu_(1)
        return c

    def move(self, device: torch.device) -> None:
        """The masks to ``device``, where the next layers run."""
        self.bias, self.mask_past, self.mask_new = (
            t if t is None else t.to(device) for t in (self.bias, self.mask_past, self.mask_new))

    def sums(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``i``'s rows of ``received`` and ``window`` (each None: not wanted)."""
        return tuple(None if x is None else x[i] for x in (self.received, self.window))

    def last_only(self, i: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Layer ``i``, the last, answers the last query only, in a forward that wants nothing
        but the new K/V, the last token's logits and the statistics (the other queries'
        outputs there feed nothing; every K/V is computed before): its statistics are taken
        before its queries are cut (``_received_lse`` takes every query apart), and its
        masks cut to that query's row."""
        if self.received_from is not None:
            _received_lse(q, k, self.past_kt[i] if self.n else None, None, self.received_from,
                          *self.sums(i), peak=self.peak)
        self.bias, self.mask_past, self.mask_new = (
            t if t is None else t[-1:] for t in (self.bias, self.mask_past, self.mask_new))

    def attend(self, i: int, qk: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention of the queries ``q`` (H, Tq, D) over the past and the new
        ``k``/``v`` (KVH, T, D) on the chosen path: (H or KVH groups, Tq, D)."""
        T, n, Tq = self.T, self.n, q.shape[1]
        if self.fused and not self.masked and q.device.type in APART:  # the layer's device
            past = (self.past_ks[i], self.past_vs[i]) if n else ()
            if self.received_from is None or Tq < T:
                return cpu_attention(q, k, v, *past)
            # the statistics from the kernel's log-sum-exps (``builds_scores``)
            out, lse = cpu_attention(q, k, v, *past, lse=True)
            _received_lse(q, k, self.past_kt[i] if n else None, lse, self.received_from,
                          *self.sums(i), peak=self.peak)
            return out
        if self.fused:
            keys = torch.cat((self.past_ks[i], k), 1)
            values = torch.cat((self.past_vs[i], v), 1)
            return fused_attention(q, keys, values, self.bias, grouped=q.device.type == "cpu")
        KVH, H, D = self.spec.n_kv_heads, self.spec.n_heads, self.spec.head_dim
        g = H // KVH
        qg = q.reshape(KVH, g * Tq, D)  # heads of one KV group share its keys (GQA)
        buf = (_score_buffers(self.bufs, qg, n, T, self.dtype)
               if Tq > 1 and self.queries is None else None)
        scores, p = _scores(qg, k, self.past_kt[i],
                            None if self.log_mass is None else self.log_mass[i],
                            self.mask_past, self.mask_new, g, buf)  # (KVH, gT, n + T)
        if self.queries is not None:  # the last query and its scores as they are
            self.queries.append(qk[:, -1:])  # (H + KVH, 1, D)
            self.last_scores.append(scores.view(KVH, g, T, n + T)[:, :, -1])
        if self.attention is not None:
            self.attention[i] = p.view(KVH, g, T, n + T)[:, :, -1].reshape(H, n + T)
        if self.received_from is not None and Tq == T:
            _received(p.view(KVH, g, T, n + T), n, self.received_from, *self.sums(i),
                      peak=self.peak)
        return _weigh(p, v, self.past_vs[i], buf, self.dtype)  # (KVH, gT, D)


def _gate_up(h: torch.Tensor, w: torch.Tensor | PackedWeight | Int8Weight,
             b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate and up projections of ``h`` from their joined weight: one product
    split by views for one row (a decode step), two over the weight's halves for several
    rows of a plain weight (a prefill chunk), where the joined product is the slower (on the
    CPU in float32; the same bits) and
    leaves gate and up strided for the elementwise kernels after (on a GPU those were the
    slower for it: docs/DESIGN.md, stage 0)."""
    if h.shape[0] == 1 or not isinstance(w, torch.Tensor):
        return linear(h, w, b).chunk(2, dim=-1)
    half = w.shape[0] // 2
    bs = (None, None) if b is None else b.split(half)
    return linear(h, w[:half], bs[0]), linear(h, w[half:], bs[1])


def _received(p: torch.Tensor, n: int, start: int, out: torch.Tensor | None,
              window: torch.Tensor | None, peak: bool = False) -> None:
    """One layer's softmax ``p`` (KVH, g, T, n + T): into ``out`` (H, n + T) the weight each
    column received summed over the T queries, a query's own column (n + t for query t) left
    out, so a new token counts only what later queries paid it; into ``window`` the same over
    the queries from row ``start`` on (each None: not wanted); ``peak``: the most one of
    those queries paid, not their sum."""
    KVH, g = p.shape[:2]
    H = KVH * g
    earlier = p[..., n:].tril(-1)  # (KVH, g, T, T): the new queries' weights on earlier new tokens
    if out is not None:
        out[:, :n] = p[..., :n].sum(2).reshape(H, n)
        out[:, n:] = earlier.sum(2).reshape(H, -1)
    if window is not None:
        reduce = torch.amax if peak else torch.sum
        window[:, :n] = reduce(p[:, :, start:, :n], 2).reshape(H, n)
        window[:, n:] = reduce(earlier[:, :, start:], 2).reshape(H, -1)


LSE_ROWS = 128  # queries per block of ``_received_lse``


def _received_lse(q: torch.Tensor, k: torch.Tensor, past_kt: torch.Tensor | None,
                  lse: torch.Tensor | None, start: int, out: torch.Tensor | None,
                  window: torch.Tensor | None, peak: bool = False) -> None:
    """What ``_received`` takes from a built softmax, where none was built (a prefill that
    ``cpu_attention`` attended, or a last layer that answers only the last query): each
    weight made as exp(q.k - lse) from the queries ``q`` (H, T, D), their log-sum-exps
    ``lse`` (H, T) (None: from the scores made here), the past keys ``past_kt``
    (KVH, D, n) (None: no past) and the new ``k`` (KVH, T, D), ``LSE_ROWS`` queries at a
    time, each block summed as it is made (the scores of all T queries are never held at
    once; without ``out``, only the window's rows are made). The products are float32, as a
    widened attention's are. The sums are made on ``q``'s device: in ``out`` and ``window``
    where they are there, else in buffers copied into them at the end (a layer of a split
    model may run elsewhere than the main device, where they are)."""
    H, T, D = q.shape
    KVH = k.shape[0]
    g, n = H // KVH, 0 if past_kt is None else past_kt.shape[2]
    queries = q.float().view(KVH, g, T, D)
    new_kt, past_kt = k.float().transpose(1, 2), None if past_kt is None else past_kt.float()
    lse = None if lse is None else lse.view(KVH, g, T, 1)
    sums = [None if x is None else x.zero_() if x.device == q.device else
            torch.zeros(x.shape, device=q.device) for x in (out, window)]
    total, last = sums
    if total is None and last is None:
        return
    # the peak alone: the most of q.k - lse over the queries, one exp at the end (exp rises
    # monotonically), not an exp of every weight
    exponents = peak and total is None
    if exponents:
        last.fill_(float("-inf"))
    for a in range(0 if total is not None else start, T, LSE_ROWS):
        b = min(T, a + LSE_ROWS)
        qb = queries[:, :, a:b].reshape(KVH, g * (b - a), D)
        # the new tokens up to the block's last, then the past slots
        parts = [(torch.matmul(qb, new_kt[..., :b]).view(KVH, g, b - a, b), slice(n, n + b))]
        if past_kt is not None:
            parts.append((torch.matmul(qb, past_kt).view(KVH, g, b - a, n), slice(0, n)))
        if lse is None:  # each query's over the tokens up to its own and the past slots
            parts[0][0].masked_fill_(
                torch.ones(b - a, b, dtype=torch.bool, device=q.device).triu_(a + 1),
                float("-inf"))
            rows = functools.reduce(torch.logaddexp, (w.logsumexp(-1, keepdim=True)
                                                      for w, _ in parts))
        else:
            rows = lse[:, :, a:b]
        for j, (w, cols) in enumerate(parts):
            if exponents:
                w = w.sub_(rows)
                if j == 0:  # each query's on the new tokens before its own: its own and
                    # later ones (columns a.. only) left out
                    w[..., a:].masked_fill_(torch.ones(b - a, b - a, dtype=torch.bool,
                                                       device=q.device).triu_(), float("-inf"))
                torch.maximum(last[:, cols], w.amax(2).view(H, -1), out=last[:, cols])
                continue
            w = w.sub_(rows).exp_()
            if j == 0:  # each query's weights on the new tokens before its own
                w = w.tril_(a - 1)
            if total is not None:
                total[:, cols] += w.sum(2).view(H, -1)
            if last is not None and b > start and peak:  # the weights are >= 0: from 0
                torch.maximum(last[:, cols], w[:, :, max(0, start - a):].amax(2).view(H, -1),
                              out=last[:, cols])
            elif last is not None and b > start:
                last[:, cols] += w[:, :, max(0, start - a):].sum(2).view(H, -1)
    if exponents:
        last.exp_()
    for x, made in zip((out, window), sums):
        if x is not made:  # made elsewhere
            x.copy_(made)
