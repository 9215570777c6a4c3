"""Stage 1 with native kernels (``--compile native``; docs/DESIGN.md, stage 1).

One decode token on the CPU spends a third of its time in a thousand small operators
between the weight products, and each of them costs several times its warm time there:
every product streams megabytes of weights through the caches and evicts the code and data
the next operator needs. ``native.cpp`` does all of a layer's work between its
products in four loops over raw rows (RMSNorm, the residual, RoPE, attention with the
softmax rows the scorers read, SiLU times up), and the products themselves (``linear``:
rows times the matrix's plain values, reading the next rows ahead; a batch's B rows in one
pass, ``decode_rows``), compiled for this machine at first use (``kernels``). Two more
serve a native model's stages 2-3: recall's scan of the cold keys (``cold_max``) and
fold's target search (``fold_into``); one a native model's sampler: torch's multinomial
draw, the same token and generator state, without a logarithm for every token (``draw``).

Each kernel rounds where the plain path's operators do, so only the order of a sum differs
(and, with AVX512_BF16's pair products, a bfloat16 product's denormals, flushed to zero):
stage 1 agrees with the plain one to float rounding (not bit for bit), like a compiled one.
Anything else, a prefill, several devices, a GPU or a masked past, runs ``forward``.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from .forward import forward, rope_tables
from .model import (NATIVE, Int8Weight, Model, PackedWeight, cache_dir, check_compile,
                    check_dtype, cpu_flags)
from .state import ColdView, View
from .types import ForwardOut, RecallQuery, UserError

SOURCE = Path(__file__).with_name("native.cpp")


@functools.cache
def build() -> str:
    """The kernels' build: a digest of the source, this machine's instruction set (they are
    built with ``-march=native``) and torch. Besides the device (``model.device_kind``) it
    decides a native model's bits, so a capture records it (``for_model``)."""
    return hashlib.sha256(SOURCE.read_bytes() + cpu_flags().encode()
                          + torch.__version__.encode()).hexdigest()[:12]


def slower(devices, dtype: str) -> str | None:
    """Why the plain stage 1 is the faster path for a model of ``dtype`` on ``devices``
    (``--compile auto`` then takes it without a word), or None where these kernels are:
    on one CPU whose AVX-512 vector loops they run (their scalar loops measured slower
    than the plain path: docs/BENCHMARKS.md), computing in float32 or bfloat16 (int8's
    weights too)."""
    if {torch.device(d).type for d in devices} != {"cpu"}:
        return "the native kernels run on the CPU only"
    if check_dtype(dtype, torch.device("cpu")) not in KERNEL_DTYPES:
        return f"the native kernels compute in float32 or bfloat16, not {dtype}"
    if "avx512f" not in cpu_flags().split():
        return "this CPU has no AVX-512F: the native kernels' scalar loops are slower here"
    return None


@functools.cache
def unavailable() -> str | None:
    """Why these kernels cannot run on this machine (no C++ compiler or ninja, or their
    build fails), or None once they are built: tried once per process."""
    try:
        kernels()
    except UserError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 -- a failed build (the compiler's error)
        return f"the native kernels did not build ({type(e).__name__})"
    return None


def auto(devices, dtype: str) -> tuple[str, str | None]:
    """``--compile auto``'s choice for a model of ``dtype`` on ``devices``: ``NATIVE`` where
    these kernels pay (``slower``) and run, else the plain path (""); and, where they would
    pay but cannot run, why (a note for stderr)."""
    if slower(devices, dtype):
        return "", None
    missing = unavailable()
    return ("", f"--compile auto: the plain stage 1 ({missing})") if missing else (NATIVE, None)


def chosen(compiled: str) -> bool:
    """Whether a model compiled as ``compiled`` (its ``Model.compiled``) runs these kernels."""
    return compiled == NATIVE


def for_model(model: Model) -> str | None:
    """The kernels' ``build`` a ``model`` runs: None unless it is native (``chosen``)."""
    return build() if chosen(model.compiled) else None


def build_folder(key: str) -> Path:
    """Where the kernels of ``key`` (a ``build``) are built and loaded from: one folder per
    torch installation too, since the build file names torch's include and library paths,
    and two environments sharing one folder would each rebuild it after the other's load
    (the same bits: ``build`` is what a capture records)."""
    install = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()
    return cache_dir() / f"native-{key}-{install[:8]}"


# compiles the AVX-512 loops out: the scalar ones, as a CPU without AVX-512F runs them
SCALAR_FLAGS = ["-mno-avx512f"]
# compiles AVX512_BF16's pair products out: the loops a CPU with AVX-512F but not them runs
NO_PAIRS_FLAGS = ["-mno-avx512bf16"]


@functools.cache
def kernels(scalar: bool = False, pairs: bool = True):
    """The compiled kernels, built once per ``build`` (tens of seconds the first time; then
    loaded from the build folder named by it, whichever checkout of the source asks for
    them). ``scalar`` builds them without their AVX-512 loops (``SCALAR_FLAGS``), ``pairs``
    False without AVX512_BF16's (``NO_PAIRS_FLAGS``), so that the loops a CPU without them
    runs can be tested on one that has them."""
    check_compile([torch.device("cpu")], NATIVE)  # a compiler, and ninja
    if shutil.which("ninja") is None:  # torch runs ninja from the PATH: the package's own
        import ninja  # pylint: disable=import-outside-toplevel
        os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, os.environ.get("PATH", "")))
    from torch.utils.cpp_extension import load  # pylint: disable=import-outside-toplevel
    key = build() + ("_scalar" if scalar else "") + ("" if pairs else "_nopairs")
    folder = build_folder(key)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w", encoding="utf-8") as held:
        # one build at a time, by a lock the system lets go when its process dies: torch's
        # own lock file, left behind by a build that was killed, would make every later
        # load wait for ever; while this one is held, that file is such a leftover
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        # built from the folder's own copy of the source: torch rebuilds when the build file
        # changes, and it names the source's path, so every checkout (a clone, a worktree)
        # building from its own would rebuild the kernels after another's load
        source, text = folder / SOURCE.name, SOURCE.read_bytes()
        if not source.exists() or source.read_bytes() != text:
            source.write_bytes(text)
        # no floating-point contraction: each product and sum rounds as torch's operators do
        return load(name=f"positronic_brain_native_{key}", sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off",
                                  "-fno-math-errno", "-fopenmp",
                                  *(SCALAR_FLAGS if scalar else []),
                                  *([] if pairs else NO_PAIRS_FLAGS)],
                    extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


def applies(model: Model, past_k, ids: torch.Tensor, past_mask, kv_only: bool,
            received_from) -> bool:
    """Whether ``decode`` runs this forward: one new token on one CPU, nothing masked, the
    live keys stored transposed (each key dimension a run of slots), float32 or bfloat16
    activations (int8's too) and a SiLU MLP."""
    return (ids.shape[0] == 1 and past_mask is None and not kv_only and received_from is None
            and model.dtype in KERNEL_DTYPES and _kernel_keys(past_k) and not model.moves
            and type(model.layers[0].act).__name__ in SILU)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute in


def _kernel_keys(k) -> bool:
    """Whether live keys ``k`` (L, KVH, n, D) are as the kernels read them: one CPU block
    of a kernel dtype, stored transposed (each key dimension a run of slots)."""
    return (isinstance(k, torch.Tensor) and k.is_cpu and k.stride(2) == 1
            and k.dtype in KERNEL_DTYPES)


def cold_max(cold: ColdView, recall: RecallQuery, log_w: torch.Tensor | None) -> torch.Tensor:
    """Each cold key's largest q.k - lse (+ ``log_w``, (len(layers), KVH, c) float32) over
    the recall layers and all query heads, (c,) float32: ``score.cold_logits(cold, recall,
    group_max=True)`` (+ log_w) maxed over layers and heads, in one pass over the keys."""
    return kernels().cold_max(recall.query, recall.lse, cold.k,
                              _NONE if log_w is None else log_w, list(recall.layers))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int | None:
    """``torch.multinomial(probs, 1, generator=generator)``'s token by the kernels' ``draw``
    (a native model's sampler): the same token, the generator left in the same state,
    without a logarithm for every token of the vocabulary. None where ``probs`` are not
    float32 on the CPU or torch would refuse them (torch's draw then, and its error)."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        return None
    token = kernels().draw(probs.contiguous(), generator)
    return None if token < 0 else token


def fold_into(view: View, culls: torch.Tensor, min_cos: float) -> torch.Tensor | None:
    """``decide.fold_targets``' targets (L, KVH, m) int64 for the culled slots ``culls``
    (m,), from one native pass over each layer and head's live keys; None where the view's
    keys are not one transposed float32 or bfloat16 CPU block (a split arena, rows stored as
    rows, float16)."""
    if not _kernel_keys(view.k):
        return None
    return kernels().fold_into(view.k.transpose(2, 3), view.knorm, culls, min_cos)


SILU = ("SiLU", "SiLUActivation")  # the MLP activations ``silu_mul`` computes


def stage1(model: Model, past_k, past_v, ids: torch.Tensor, positions: torch.Tensor,
           past_mask: torch.Tensor | None = None, want_attention: bool = False,
           all_logits: bool = False, past_log_mass=None, kv_only: bool = False,
           want_query: bool = False, received_from: int | None = None) -> ForwardOut:
    """``forward``'s signature and outputs: ``decode`` where it ``applies``, else ``forward``."""
    if applies(model, past_k, ids, past_mask, kv_only, received_from):
        return decode(model, past_k, past_v, ids, positions, want_attention, past_log_mass,
                      want_query)
    return forward(model, past_k, past_v, ids, positions, past_mask, want_attention,
                   all_logits, past_log_mass, kv_only, want_query, received_from)


@torch.no_grad()
def decode(model: Model, past_k: torch.Tensor, past_v: torch.Tensor, ids: torch.Tensor,
           positions: torch.Tensor, want_attention: bool, past_log_mass: torch.Tensor | None,
           want_query: bool) -> ForwardOut:
    """One token through the model (``forward``'s outputs for T = 1): per layer its three
    products and the kernels between them, all native; ``decode_rows`` of one row."""
    out = decode_rows(model, [(past_k, past_v, past_log_mass)], ids, positions,
                      [want_query])[0]
    return out if want_attention else dataclasses.replace(out, attention=None)


def rows_apply(model: Model, pasts) -> bool:
    """Whether ``decode_rows`` runs a batch's stage 1: a native model (``chosen``) whose
    every row's past is as ``decode`` takes it (``applies``)."""
    one = torch.zeros(1, dtype=torch.long)
    return chosen(model.compiled) and all(applies(model, k, one, None, False, None)
                                          for k, _, _ in pasts)


@torch.no_grad()
def decode_rows(model: Model, pasts, ids: torch.Tensor, positions: torch.Tensor,
                queries) -> list[ForwardOut]:
    """``forward.decode_rows`` natively: each product takes the B rows at once (``linear``:
    every weight read once for all of them, each row's sums as its own step sums them), and
    each row attends over its own slots (``attend_rows``: all the rows in one pass), so every
    row gets the bits ``decode`` gives it alone."""
    nat, s = kernels(), model.spec
    H, KVH, D, eps, B = s.n_heads, s.n_kv_heads, s.head_dim, s.rms_eps, len(pasts)
    cos_qk, sin_qk = rope_tables(model, positions, model.dtype)  # (H + KVH, B, D)
    rows = [_Row(k, v, m, s.n_layers, H) for k, v, m in pasts]
    want = any(queries)
    x = F.embedding(ids, model.embed)  # (B, hidden): fresh rows, updated in place
    h = nat.rms_norm(x, model.layers[0].ln1, eps)
    qkvs, qks, lses = [], [], []
    for i, w in enumerate(model.layers):
        qkv = nat.linear(h, *_product(w.qkv_w, w.qkv_b))  # (B, (H + 2 KVH) D)
        out, qk, lse = nat.attend_rows(qkv, cos_qk, sin_qk, *zip(*(r.layer(i) for r in rows)),
                                       H, KVH, want)
        qkvs.append(qkv)
        qks.append(qk)
        lses.append(lse)
        x, h = nat.add_rms_norm(x, nat.linear(out, *_product(w.o_w, w.o_b)), w.ln2, eps)
        a = nat.silu_mul(nat.linear(h, *_product(w.gate_up_w, w.gate_up_b)))
        last = i + 1 == len(model.layers)
        x, h = nat.add_rms_norm(x, nat.linear(a, *_product(w.down_w, w.down_b)),
                                model.final_norm if last else model.layers[i + 1].ln1, eps)
    logits = nat.linear(h, *_product(model.lm_head, None)).float()
    news = torch.stack(qkvs)[:, :, (H + KVH) * D:].view(s.n_layers, B, KVH, 1, D)
    qks = torch.stack(qks)  # (L, B, H + KVH, 1, D)
    lses = torch.stack(lses) if want else None  # (L, B, H)
    return [ForwardOut(logits=logits[b:b + 1], k=qks[:, b, H:].contiguous(),
                       v=news[:, b].contiguous(), attention=r.p[..., :r.n],
                       query=qks[:, b, :H, 0].contiguous() if q else None,
                       lse=lses[:, b].contiguous() if q else None)
            for b, (r, q) in enumerate(zip(rows, queries))]


class _Row:  # pylint: disable=too-few-public-methods
    """One row of ``decode_rows``: its past as ``attend_rows`` reads it and its softmax rows
    (written in place)."""

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor, log_mass, L: int, H: int):
        self.n = past_k.shape[2]
        self.kts, self.vs = past_k.transpose(2, 3).unbind(0), past_v.unbind(0)
        self.masses = log_mass.unbind(0) if log_mass is not None else (_NONE,) * L
        self.p = torch.empty(L, H, self.n + 1, dtype=torch.float32)

    def layer(self, i: int) -> tuple:
        """Layer ``i``'s keys transposed, values, log-masses and softmax rows."""
        return self.kts[i], self.vs[i], self.masses[i], self.p[i]


_NONE = torch.empty(0)  # no scale, bias or log-mass


def _product(w: torch.Tensor | PackedWeight | Int8Weight,
             b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A matrix (and bias) as the native ``linear`` takes it, ``forward.linear``'s weights
    read natively: its plain values, an int8 matrix's scales, the bias (each empty where
    there is none)."""
    if isinstance(w, Int8Weight):
        return w.q, w.scale, _NONE if b is None else b
    return w.plain if isinstance(w, PackedWeight) else w, _NONE, _NONE if b is None else b
