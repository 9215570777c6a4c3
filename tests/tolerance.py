"""The suite's error model: how far apart two floating-point computations of one value may
lie, from the dtype, the number of terms a sum adds and whether the order of summation may
differ. Every numerical comparison in tests/ takes its bound from here (with a one-line
reason at the call) or asserts equal bits, where the same kernels add in the same order.

A sum of n rounded terms lies within gamma(n) * sum|term| of the exact sum. The worst case is
gamma(n) = n u / (1 - n u), u the dtype's unit roundoff; rounding errors that behave as
independent random variables (Higham & Mary, "A new approach to probabilistic rounding error
analysis", 2019, Theorem 3.1) give gamma(n) = LAMBDA sqrt(n) u with probability at least
1 - 2 exp(-LAMBDA^2 / 2) per sum: 3e-8 for LAMBDA = 6. Which order a CPU's kernel adds in
(oneDNN's packing and blocking, AVX-512 or AVX2 loops, AMX tiles, the number of threads)
differs between an Intel Xeon and an AMD EPYC, so a bound that holds for any order is the one
that holds on every machine. Two computations that may each add in any order are each within
gamma(n) * sum|term| of the exact sum, so within twice that of each other.

Comparisons through a whole network (stage 1's logits against Hugging Face's) are held to the
project's stated contract, ``ORACLE``, not to a bound derived per product.
"""
from __future__ import annotations

import math

import torch

# the unit roundoff u of each dtype: half the distance from 1 to the next number
UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
        torch.bfloat16: 2.0 ** -8}
LAMBDA = 6.0

# The contract (README, docs/DESIGN.md): in float32 stage 1's logits (and a prime's, and any
# K/V our forward computes) lie within 1e-4 of Hugging Face's own forward over the same cache.
ORACLE = 1e-4


def unit(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``: one rounding's largest relative error."""
    return UNIT[dtype]


def step(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers just above 1 (2u): one step of its rounding,
    relative."""
    return 2 * UNIT[dtype]


def gamma(dtype: torch.dtype, terms: int) -> float:
    """The relative bound on a sum of ``terms`` rounded terms in ``dtype`` (in units of
    sum|term|), in any order, with the result's own rounding."""
    return LAMBDA * math.sqrt(max(terms, 1) + 1) * UNIT[dtype]


def sum_bound(dtype: torch.dtype, terms: int, magnitude: float = 1.0,
              reordered: bool = True) -> float:
    """How far two computations of a sum of ``terms`` terms whose absolute values add to
    ``magnitude`` may lie apart in ``dtype``: 0 where both add in the same order (equal bits),
    2 gamma(terms) magnitude where either may add in another."""
    return 2 * gamma(dtype, terms) * magnitude if reordered else 0.0


def products(dtype: torch.dtype, terms: int, depth: int, magnitude: float = 1.0) -> float:
    """How far two computations of a value reached through ``depth`` sums in series (each of
    at most ``terms`` terms of about ``magnitude`` in all) may lie apart, each free to add in
    its own order: the per-sum bound, summed along the chain (first order: each sum's error
    carried through the rest unamplified, as in a well-conditioned model)."""
    return depth * sum_bound(dtype, terms, magnitude)


def dot(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> torch.Tensor:
    """The componentwise bound on ``x @ w.T`` (rows of ``x`` times rows of ``w``) computed in
    ``dtype`` against another computation of it: 2 gamma(n) |x| @ |w|.T, n the inner length;
    against the exact (float64) product, where only one side rounds, half of that."""
    magnitude = x.double().abs() @ w.double().abs().T
    return (1 if exact else 2) * gamma(dtype, x.shape[-1]) * magnitude


def depth(model, layer: int | None = None, then: int = 2) -> int:
    """The sums in series from the embedding through ``model``'s forward: 9 a layer (2
    RMSNorms, q/k/v, scores, softmax, A.V, o, gate/up, down) before ``layer`` (default: all of
    them, for the logits), then ``then`` more (the final norm and the head; a layer's norm and
    K/V projection)."""
    return 9 * (model.spec.n_layers if layer is None else layer) + then


def model_bound(model, magnitude: float, context: int, layer: int | None = None,
                then: int = 2) -> float:
    """How far two of our float32 forwards of ``model`` that add in other orders (chunks,
    masks, a decode step's products, thread counts, past and new attended apart or joined)
    may put a value of about ``magnitude``: ``depth`` sums in series, each of at most the
    widest of the hidden, intermediate and context sizes."""
    c = model.hf.config
    return products(torch.float32, max(c.hidden_size, c.intermediate_size, context),
                    depth(model, layer, then), magnitude)


def apart(model, magnitude: float, context: int, layer: int | None = None,
          then: int = 2) -> float:
    """How far two of our forwards of ``model`` that add in other orders (compiled, native,
    a fixed-shape graph step against the plain one) may put a value of about ``magnitude``
    (``model_bound``). In bfloat16 (int8's activations too) each sum's result is also rounded
    to bfloat16, where the float32 sums may straddle a rounding: a step apart at most each
    (first order, unamplified). Which CPU's kernels run (oneDNN's packed product, AMX,
    avx512_bf16, or float32 products rounded after, ``forward.WIDEN``) changes which values
    straddle, not how far."""
    bound = model_bound(model, magnitude, context, layer, then)
    return bound + (depth(model, layer, then) * step(torch.bfloat16) * magnitude
                    if model.dtype != torch.float32 else 0.0)


def forward_bound(model, slots: int, magnitude: float, logits: bool = False,
                  more: int = 0) -> float:
    """``model_bound`` of a forward's new K/V over ``slots`` tokens (at its last layer;
    ``logits``: of its logits), with ``more`` sums after (a norm of the K/V)."""
    return model_bound(model, magnitude, slots, None if logits else model.spec.n_layers - 1,
                       2 + more)


def logits_size(model) -> float:
    """A bound on ``model``'s logits: the final norm's output is at most sqrt(hidden) times
    its largest weight long, and a logit is its dot product with a head row
    (Cauchy-Schwarz)."""
    head = model.hf.lm_head.weight.detach().float().norm(dim=1).max()
    return float(math.sqrt(model.spec.hidden) * model.final_norm.abs().max() * head)


def nll_bound(model, context: int, logits: float | None = None) -> float:
    """How far two computations of a token's NLL may lie apart: twice their logits' bound
    (a log-softmax moves by at most the spread of its inputs' errors; ``logits``, default two
    of our float32 forwards in other orders) plus its log-sum-exp's V terms."""
    if logits is None:
        logits = model_bound(model, logits_size(model), context)
    return 2 * logits + sum_bound(torch.float32, model.spec.vocab)


def half_oracle(model) -> float:
    """Our half-precision logits' distance from HF's on the same weights, relative to the
    largest: a stated contract, as float32's is ``ORACLE``, not a derived bound. Each of
    ``depth``'s sums rounds its result to bfloat16 on both sides, one step apart at most,
    and a first-order bound summed over them (20 for the tiny models, 272 for SmolLM2) tells
    nothing: 0.16 of the largest logit through 2 layers, more than the logits through 30.
    Held to 4 steps of bfloat16 through the tiny models' 2 or 3 layers, 8 through SmolLM2's
    30 (where tests/test_int8.py's prompt has reached 3.7 in bfloat16, 5.8 in int8, whose
    products round otherwise)."""
    return (4 if model.spec.n_layers <= 3 else 8) * step(torch.bfloat16)


def rotation_bound(keys: torch.Tensor, sums: int, tables: int) -> float:
    """How far two RoPE rotations of ``keys`` (..., head_dim) to one position may lie apart
    where the longer takes ``sums`` 2-term sums in series (x cos + y sin; a re-rotation's
    cos and sin are such sums of the two positions' own) and ``tables`` more of a position's
    rotation and its inverse (R^T R = cos^2 + sin^2, off 1 by 2 steps with cos and sin each
    within an ulp). Each sum's terms add to at most |x| + |y| <= sqrt(2) |(x, y)|, however
    the pair turns."""
    half = keys.shape[-1] // 2
    x = keys.float()
    m = math.sqrt(2) * float((x.square() + x.roll(half, -1).square()).sqrt().max())
    return products(torch.float32, 2, sums, m) + 2 * tables * step(torch.float32) * m
