"""Cross-model K/V transfer: a trained projector from one model's cache into another's.

A session of model A (the source) becomes a session of model B (the target) whose cache
holds A's K/V projected into B's: the same ledger rows, pending token, positions and session
fields, so B continues a text it never read. The two must share a tokenizer.

Keys are cached after RoPE, and no linear map turns A's rotation at position p into B's at
every p: a key is rotated back to position 0 with A's own rope (``forward.rerotation``),
projected, and rotated to its position with B's. Values are projected as they are.

Per target layer j the projector reads source layer ``layer_map[j]`` (default: the one at
the same relative depth) and maps each token's keys, and its values, from A's
kv_heads x head_dim to B's: a linear map, and with ``kind`` mlp also a small MLP residual
branch scaled by a gate per layer (sigmoid of a learned scalar, starting nearly closed), as
C2C gates each layer's fused cache.

Training (``train_projector``) cuts the text into windows of a prefix and a continuation:
A prefills the prefix (our forward), the projector maps its K/V into B's cache, B runs the
continuation over that cache (Hugging Face's own forward, differentiable in the cache) and
the loss is the KL from B's next-token distributions with its own prefix cache to these.
The text's first part trains: first (``fit``) each linear map is set to the least-squares
fit of B's own un-rotated keys (values) of the training prefixes on A's, between per
dimension sizes (``_Maps``), then Adam steps on the KL; the held-out KL is measured on the
rest.

A projector file is a signed safetensors file (``plain.save_signed``) of format ``FORMAT``:
its tensors are the maps' parameters and sizes, its JSON header gives both models' K/V
shapes, the layer map, the kind and the MLP width, and loading checks every tensor's name,
shape and dtype against it.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from .forward import apply_rope, forward, rerotation, rope_cos_sin
from .loop import Session
from .model import Model, hf_forward
from .plain import load_signed, save_signed, to_plain
from .session_io import restore_session, session_body, session_tensors
from .special_tokens import require_same_tokens
from .stages.apply import arena
from .types import UserError, require, require_seed

FORMAT = "positronic-brain-projector/2"
KINDS = ("linear", "mlp")
# random: a random semi-orthogonal map (norms kept); identity: the identity cut to shape;
# perturbed: the identity plus Gaussian noise (a start a model's map onto itself must undo)
INITS = ("random", "identity", "perturbed")
GATE_INIT = -4.0  # sigmoid(-4) = 0.018: the MLP branch starts nearly closed


@dataclass(frozen=True)
class KVShape:
    """A model's cached K/V per token: layers x KV heads x head_dim."""

    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        require(all(isinstance(x, int) and x > 0 for x in asdict(self).values()),
                f"K/V shape {asdict(self)}: positive integers expected")

    @classmethod
    def of(cls, model: Model) -> "KVShape":
        s = model.spec
        return cls(s.n_layers, s.n_kv_heads, s.head_dim)

    @property
    def width(self) -> int:
        return self.kv_heads * self.head_dim

    def __str__(self) -> str:
        return f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} dims"


def default_layer_map(source_layers: int, target_layers: int) -> tuple[int, ...]:
    """Target layer j reads the source layer at the same relative depth,
    round(j (La - 1) / (Lb - 1))."""
    span = max(target_layers - 1, 1)
    return tuple(round(j * (source_layers - 1) / span) for j in range(target_layers))


class _Maps(nn.Module):
    """The keys' or the values' maps, one per target layer, stacked: ``weight``
    (Lb, out, in) and ``bias`` (Lb, out) between sizes measured when training started, the
    inputs' root mean square per dimension ``scale_in`` (Lb, in) and the target's own
    outputs' ``scale_out`` (Lb, out): y = scale_out (W x / scale_in + b), so that an Adam step
    moves every output by the same fraction of its size, whatever the dimensions' sizes;
    with a hidden width also the MLP branch ``up`` (Lb, hidden, in), ``down`` (Lb, out,
    hidden) and its ``gate`` (Lb,), inside the same scales."""

    def __init__(self, layers: int, width_in: int, width_out: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.register_buffer("scale_in", torch.ones(layers, width_in))
        self.register_buffer("scale_out", torch.ones(layers, width_out))
        self.weight = nn.Parameter(torch.zeros(layers, width_out, width_in))
        self.bias = nn.Parameter(torch.zeros(layers, width_out))
        if hidden:
            self.up = nn.Parameter(torch.zeros(layers, hidden, width_in))
            self.down = nn.Parameter(torch.zeros(layers, width_out, hidden))
            self.gate = nn.Parameter(torch.full((layers,), GATE_INIT))

    @torch.no_grad()
    def initialise(self, init: str, generator: torch.Generator, noise: float,
                   x: torch.Tensor, y: torch.Tensor) -> None:
        """The scales from the inputs ``x`` (Lb, n, in) and the target's own outputs ``y``
        (Lb, n, out) (each at least 1/100 of the layer's mean); the map as ``init`` says
        (``INITS``: the identity maps each output to the input of the same index, the noise
        is relative to each output's size), the bias 0; the MLP's matrices random with
        unit gain, its gate nearly closed."""
        width_in = self.weight.shape[2]
        for scale, sample in ((self.scale_in, x), (self.scale_out, y)):
            rms = sample.square().mean(1).sqrt()
            scale.copy_(torch.maximum(rms, rms.mean(-1, keepdim=True) / 100))
        self.bias.zero_()
        if init == "random":
            for w in self.weight:
                nn.init.orthogonal_(w, generator=generator)
        else:
            eye = torch.eye(*self.weight.shape[1:])
            self.weight.copy_(eye * self.scale_in.unsqueeze(1) / self.scale_out.unsqueeze(2))
        if init == "perturbed":
            self.weight += torch.randn(self.weight.shape, generator=generator) * (
                noise / math.sqrt(width_in))
        if self.hidden:
            nn.init.normal_(self.up, std=width_in ** -0.5, generator=generator)
            nn.init.normal_(self.down, std=self.hidden ** -0.5, generator=generator)
            self.gate.fill_(GATE_INIT)

    @torch.no_grad()
    def solve(self, xtx: torch.Tensor, xty: torch.Tensor, ridge: float) -> None:
        """The linear map and bias that least-squares fit the scaled outputs to the scaled
        inputs, from the sums ``xtx`` (Lb, in + 1, in + 1) and ``xty`` (Lb, in + 1, out) of
        ``scaled``'s pairs, with ``ridge`` times the mean diagonal added to the diagonal."""
        diagonal = xtx.diagonal(dim1=1, dim2=2)
        damped = xtx + torch.diag_embed(ridge * diagonal.mean(-1, keepdim=True).expand_as(diagonal))
        solution = torch.cholesky_solve(xty, torch.linalg.cholesky(damped))  # (Lb, in + 1, out)
        self.weight.copy_(solution[:, :-1].transpose(1, 2))
        self.bias.copy_(solution[:, -1])

    def scaled(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (Lb, n, in) over ``scale_in`` with a column of ones (the bias's), and the
        target's own outputs (Lb, n, out) over ``scale_out``, float64: ``solve``'s pairs."""
        x = (x / self.scale_in.unsqueeze(1)).double()
        return torch.cat([x, x.new_ones(*x.shape[:2], 1)], -1), \
            (y / self.scale_out.unsqueeze(1)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(Lb, n, in) -> (Lb, n, out)."""
        x = x / self.scale_in.unsqueeze(1)
        y = torch.baddbmm(self.bias.unsqueeze(1), x, self.weight.transpose(1, 2))
        if self.hidden:
            branch = torch.bmm(F.silu(torch.bmm(x, self.up.transpose(1, 2))),
                               self.down.transpose(1, 2))
            y = y + torch.sigmoid(self.gate).view(-1, 1, 1) * branch
        return y * self.scale_out.unsqueeze(1)


class Projector(nn.Module):
    """Per target layer, a map of the keys (at position 0) and one of the values from the
    source layer ``layer_map[j]``'s (KVa * Da) per token to the target's (KVb * Db).
    Parameters ``k.*`` and ``v.*`` (``_Maps``), float32."""

    def __init__(self, source: KVShape, target: KVShape, layer_map: Sequence[int] | None = None,
                 kind: str = "linear", hidden: int = 0):
        super().__init__()
        require(kind in KINDS, f"unknown projector kind {kind!r}; expected one of {KINDS}")
        require(isinstance(hidden, int) and hidden >= 0 and (hidden > 0) == (kind == "mlp"),
                f"a {kind} projector takes {'a positive' if kind == 'mlp' else 'no'} hidden "
                f"width, got {hidden!r}")
        layer_map = tuple(default_layer_map(source.layers, target.layers)
                          if layer_map is None else layer_map)
        require(len(layer_map) == target.layers
                and all(isinstance(i, int) and 0 <= i < source.layers for i in layer_map),
                f"layer map {list(layer_map)}: one source layer (0..{source.layers - 1}) per "
                f"target layer ({target.layers})")
        self.source, self.target, self.layer_map = source, target, layer_map
        self.kind, self.hidden = kind, hidden
        self.k = _Maps(target.layers, source.width, target.width, hidden)
        self.v = _Maps(target.layers, source.width, target.width, hidden)
        self.register_buffer("index", torch.tensor(layer_map), persistent=False)

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Source keys at position 0 and values, (La, KVa, n, Da) float32 each -> the
        target's (Lb, KVb, n, Db), keys at position 0."""
        t, n = self.target, k.shape[2]
        return tuple(maps(self._inputs(x)).view(t.layers, n, t.kv_heads, t.head_dim).transpose(1, 2)
                     for maps, x in ((self.k, k), (self.v, v)))

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Source K or V (La, KVa, n, Da) -> each target layer's inputs (Lb, n, KVa * Da)."""
        return x.index_select(0, self.index).transpose(1, 2).reshape(len(self.layer_map),
                                                                     x.shape[2], -1)

    def initialise(self, init: str, generator: torch.Generator, noise: float,
                   source: tuple[torch.Tensor, torch.Tensor],
                   target: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Both maps (``_Maps.initialise``) from a sample of source keys at position 0 and
        values, (La, KVa, n, Da) float32 each, and the target's own of the same tokens,
        (Lb, KVb, n, Db)."""
        for maps, x, y in zip((self.k, self.v), source, target):
            maps.initialise(init, generator, noise, self._inputs(x), self._outputs(y))

    def _outputs(self, y: torch.Tensor) -> torch.Tensor:
        """Target K or V (Lb, KVb, n, Db) -> each target layer's outputs (Lb, n, KVb * Db)."""
        return y.transpose(1, 2).reshape(self.target.layers, y.shape[2], -1)

    @property
    def header(self) -> dict:
        """What the file's header holds: enough to rebuild the module and check the models."""
        return {"source": asdict(self.source), "target": asdict(self.target),
                "layer_map": list(self.layer_map), "kind": self.kind, "hidden": self.hidden}

    def check_fits(self, source: Model, target: Model) -> None:
        """A UserError unless ``source`` and ``target`` have the K/V shapes it maps."""
        for what, shape, model in (("from", self.source, source), ("into", self.target, target)):
            require(KVShape.of(model) == shape, f"the projector maps {what} {shape}, but "
                    f"{model.name!r} has {KVShape.of(model)}")


def at_zero(model: Model, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys (L, KVH, n, D) roped at ``positions`` (n,) rotated back to position 0 with
    ``model``'s rope, R(0) R(p)^-1 (``forward.rerotation``): float32 on its device."""
    pos = positions.to(model.device)
    cos, sin = rerotation(model, pos, torch.zeros_like(pos))
    return apply_rope(k.to(model.device, torch.float32), cos, sin)


def project(projector: Projector, source: Model, target: Model, k: torch.Tensor,
            v: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's cached K/V (La, KVa, n, Da), keys roped at ``positions`` (n,), as the
    target's (Lb, KVb, n, Db) float32 on the projector's device, keys roped at the same
    positions with the target's rope: rotated back to position 0 with the source's rope,
    mapped, rotated forward. Differentiable in the projector's parameters."""
    dev = projector.index.device
    kb, vb = projector(at_zero(source, k, positions).to(dev), v.to(dev, torch.float32))
    cos, sin = rope_cos_sin(target, positions.to(target.device), torch.float32)
    return apply_rope(kb, cos.to(dev), sin.to(dev)), vb


# --- training ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainParams:
    """How ``train_projector`` trains: with ``fit``, first the least-squares fit of the
    linear maps (``fit_linear``) over the training windows' prefixes; then ``steps`` Adam
    steps on the KL from ``lr`` down to 0 (cosine),
    each over ``batch`` windows of ``prefix`` + ``continuation`` tokens from the text's
    first 1 - ``holdout``; the held-out KL over at most ``eval_windows`` windows of the
    rest. ``init`` (``INITS``; ``noise``: perturbed's, relative to the identity), ``kind``
    (``KINDS``) and ``hidden`` (the MLP branch's width) shape the projector; ``seed`` makes
    it all repeatable."""

    steps: int = 300
    lr: float = 1e-4
    fit: bool = True
    batch: int = 4
    prefix: int = 64
    continuation: int = 16
    holdout: float = 0.2
    eval_windows: int = 16
    kind: str = "linear"
    hidden: int = 256
    init: str = "random"
    noise: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "prefix", "continuation", "eval_windows", "hidden"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        require(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        require_seed(self.seed)
        require(self.lr > 0, f"the learning rate must be > 0, got {self.lr}")
        require(0 < self.holdout < 1, f"holdout must be in (0, 1), got {self.holdout}")
        require(self.kind in KINDS,
                f"unknown projector kind {self.kind!r}; expected one of {KINDS}")
        require(self.init in INITS, f"unknown init {self.init!r}; expected one of {INITS}")
        require(self.noise >= 0, f"noise must be >= 0, got {self.noise}")


def split_windows(ids: Sequence[int], params: TrainParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows (W, prefix + continuation) of ``ids``: the training ones from
    the first 1 - holdout of the text, at most ``eval_windows`` held-out ones from the rest."""
    ids = torch.tensor(list(ids), dtype=torch.int64)
    size = params.prefix + params.continuation
    cut = int(len(ids) * (1 - params.holdout))
    train = ids[:cut - cut % size].view(-1, size)
    rest = ids[cut:]
    held = rest[:len(rest) - len(rest) % size].view(-1, size)[:params.eval_windows]
    require(len(train) > 0 and len(held) > 0, f"a text of {len(ids)} tokens leaves no window of "
            f"{params.prefix} + {params.continuation} tokens to train on and one to hold out "
            f"(holdout {params.holdout})")
    return train, held


@torch.no_grad()
def _prefix_kv(model: Model, prefixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's K/V of each prefix (W, P) as a prime caches them: (L, KVH, W * P, D)
    each, the windows side by side, keys roped at 0..P-1."""
    past_k, past_v, _ = arena(model, 0).past(0)
    positions = torch.arange(prefixes.shape[1], device=model.device)
    outs = [forward(model, past_k, past_v, ids.to(model.device), positions, kv_only=True)
            for ids in prefixes]
    return torch.cat([o.k for o in outs], 2), torch.cat([o.v for o in outs], 2)


@torch.no_grad()
def _own_logp(target: Model, windows: torch.Tensor, prefix: int) -> torch.Tensor:
    """The target's log-probs (W, C, V) after each continuation token with its own cache of
    the prefix (one forward over the whole window)."""
    c = windows.shape[1] - prefix
    out = hf_forward(target.hf, windows.to(target.device), logits_to_keep=c)
    return out.logits.float().log_softmax(-1)


def _projected_logp(target: Model, k: torch.Tensor, v: torch.Tensor, continuations: torch.Tensor,
                    prefix: int) -> torch.Tensor:
    """The target's log-probs (W, C, V) after each continuation token (W, C), at positions
    P.., over a cache of the projected prefixes ``k``/``v`` (Lb, KVb, W * P, Db): Hugging
    Face's forward on a fresh ``DynamicCache`` of them, differentiable in them."""
    w, c = continuations.shape
    layers, kv_heads, _, head_dim = k.shape

    def batched(x: torch.Tensor) -> torch.Tensor:  # (Lb, W, KVb, P, Db) in the target's dtype
        return x.view(layers, kv_heads, w, prefix, head_dim).transpose(1, 2).to(target.dtype)

    k, v = batched(k), batched(v)
    cache = DynamicCache(ddp_cache_data=[(k[i].to(d), v[i].to(d))
                                         for i, d in enumerate(target.layer_devices)])
    positions = torch.arange(prefix, prefix + c, device=target.device).expand(w, c)
    out = hf_forward(target.hf, continuations.to(target.device), cache, position_ids=positions,
                     use_cache=True)
    return out.logits.float().log_softmax(-1)


def window_kl(projector: Projector, source: Model, target: Model, windows: torch.Tensor,
              prefix: int) -> torch.Tensor:
    """Mean KL (nats per token) from the target's next-token distributions over each
    window's continuation with its own prefix cache to those with the source's prefix cache
    projected: a scalar, differentiable in the projector's parameters."""
    k, v = _prefix_kv(source, windows[:, :prefix])
    positions = torch.arange(prefix).repeat(len(windows))
    kb, vb = project(projector, source, target, k, v, positions)
    own = _own_logp(target, windows, prefix).to(kb.device)
    projected = _projected_logp(target, kb, vb, windows[:, prefix:], prefix).to(kb.device)
    return (own.exp() * (own - projected)).sum(-1).mean()


@torch.no_grad()
def _paired_kv(source: Model, target: Model, prefixes: torch.Tensor,
               device: torch.device | str = "cpu") -> tuple[tuple, tuple]:
    """The source's and the target's own K/V of each prefix (W, P), keys at position 0,
    float32 on ``device``: ((k, v) of the source, (k, v) of the target), each (L, KVH,
    W * P, D)."""
    positions = torch.arange(prefixes.shape[1]).repeat(len(prefixes))
    k, v = _prefix_kv(source, prefixes)
    kb, vb = (k, v) if source is target else _prefix_kv(target, prefixes)
    return tuple((at_zero(m, keys, positions).to(device), values.to(device, torch.float32))
                 for m, keys, values in ((source, k, v), (target, kb, vb)))


@torch.no_grad()
def fit_linear(projector: Projector, source: Model, target: Model, windows: torch.Tensor,
               prefix: int, batch: int, ridge: float = 1e-3) -> None:
    """Set the projector's linear maps (not an MLP branch) to the least-squares fit of the
    target's own keys at position 0 and values to the source's, over the prefixes of
    ``windows`` (W, >= prefix), ``batch`` at a time (``_Maps.solve``)."""
    sums: dict[str, list[torch.Tensor]] = {}
    for w in windows.split(batch):
        ours, theirs = _paired_kv(source, target, w[:, :prefix], projector.index.device)
        for name, x, y in zip("kv", ours, theirs):
            maps = getattr(projector, name)
            xs, ys = maps.scaled(projector._inputs(x),  # pylint: disable=protected-access
                                 projector._outputs(y))  # pylint: disable=protected-access
            pair = [xs.transpose(1, 2) @ xs, xs.transpose(1, 2) @ ys]
            sums[name] = pair if name not in sums else [a + b for a, b in zip(sums[name], pair)]
    for name, (xtx, xty) in sums.items():
        getattr(projector, name).solve(xtx, xty, ridge)


@torch.no_grad()
def held_out_kl(projector: Projector, source: Model, target: Model, windows: torch.Tensor,
                prefix: int, batch: int) -> float:
    """``window_kl`` over all ``windows``, ``batch`` at a time: the mean per token."""
    total = sum(float(window_kl(projector, source, target, w, prefix)) * len(w)
                for w in windows.split(batch))
    return total / len(windows)


def train_projector(source: Model, target: Model, ids: Sequence[int],
                    params: TrainParams = TrainParams(),
                    on_step: Callable[[int, float], None] | None = None) -> tuple[Projector, dict]:
    """A projector of ``source``'s K/V into ``target``'s cache trained on the token ``ids``
    (``split_windows``), and its report: the held-out KL (nats per token) before
    (``kl_before``, the initialised projector), after the fit (``kl_fit``, None without
    one) and after the Adam steps too (``kl_after``), the windows, tokens and seconds
    trained (the fit's and the steps'). ``on_step(step, loss)`` follows each step."""
    require_same_tokens(source.tokenizer, target.tokenizer)
    train, held = split_windows(ids, params)
    generator = torch.Generator().manual_seed(params.seed)
    projector = Projector(KVShape.of(source), KVShape.of(target), kind=params.kind,
                          hidden=params.hidden if params.kind == "mlp" else 0)
    sample = train[:params.batch, :params.prefix]  # the sizes: the first windows'
    projector.initialise(params.init, generator, params.noise,
                         *_paired_kv(source, target, sample))
    projector.to(target.device)
    # each step's windows: the training windows in a fresh random order per pass
    passes = math.ceil(max(params.steps, 1) * params.batch / len(train))
    order = torch.cat([torch.randperm(len(train), generator=generator) for _ in range(passes)])
    before = held_out_kl(projector, source, target, held, params.prefix, params.batch)
    seconds, fitted = 0.0, None
    if params.fit:
        t0 = time.perf_counter()
        fit_linear(projector, source, target, train, params.prefix, params.batch)
        seconds = time.perf_counter() - t0
        fitted = held_out_kl(projector, source, target, held, params.prefix, params.batch)
    t0 = time.perf_counter()
    optimizer = torch.optim.Adam(projector.parameters(), lr=params.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(params.steps, 1))
    for step in range(params.steps):
        windows = train[order[step * params.batch:(step + 1) * params.batch]]
        loss = window_kl(projector, source, target, windows, params.prefix)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(step + 1, float(loss.detach()))
    seconds += time.perf_counter() - t0
    after = held_out_kl(projector, source, target, held, params.prefix, params.batch)
    return projector, {
        "source": source.name, "target": target.name, **asdict(params),
        "layer_map": list(projector.layer_map), "train_windows": len(train),
        "held_out_windows": len(held), "tokens": params.steps * params.batch * train.shape[1]
        + (len(train) * params.prefix if params.fit else 0),
        "kl_before": before, "kl_fit": fitted, "kl_after": after, "seconds": seconds}


def projector_bench(model: Model, ids: Sequence[int], steps: int = TrainParams.steps,
                    seed: int = 0) -> dict:
    """A model's projector onto itself trained from the identity perturbed (which it must
    learn back: held-out KL near 0): ``train_projector``'s report."""
    return train_projector(model, model, ids, TrainParams(steps=steps, seed=seed,
                                                          init="perturbed"))[1]


# --- files and sessions -----------------------------------------------------------------------

def save_projector(projector: Projector, path: str | os.PathLike) -> Path:
    """Write ``projector`` to ``path`` atomically (see the module docstring); returns it."""
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous()
               for name, t in projector.state_dict().items()}
    return save_signed(path, tensors, {"format": FORMAT,
                                       "projector": json.dumps(projector.header)})


def load_projector(path: str | os.PathLike, source: Model | None = None,
                   target: Model | None = None) -> Projector:
    """Read a projector ``save_projector`` wrote (on the CPU), checked against its header
    and, if given, against the ``source`` and ``target`` models; a missing, damaged or
    inconsistent file, or one for models of other K/V shapes, is a one-line UserError."""
    meta, tensors = load_signed(path, (FORMAT,), "projector file")
    try:
        h = json.loads(meta["projector"])
        require(isinstance(h["layer_map"], list), f"layer map {h['layer_map']!r:.40}: a list")
        args = (KVShape(**h["source"]), KVShape(**h["target"]), h["layer_map"], h["kind"],
                h["hidden"])
        with torch.device("meta"):  # the header's shapes, before it takes any memory
            expected = Projector(*args).state_dict()
        require(sorted(tensors) == sorted(expected),
                f"tensors {sorted(tensors)} differ from {sorted(expected)}")
        for name, t in expected.items():
            got = tensors[name]
            least = 0.0 if ".scale" in name else -math.inf  # a scale divides
            require(got.shape == t.shape and got.dtype == torch.float32
                    and bool(torch.isfinite(got).all()) and bool((got > least).all()),
                    f"tensor {name}: {tuple(got.shape)} {got.dtype}, expected "
                    f"{tuple(t.shape)} torch.float32, finite"
                    + (" and positive" if least == 0 else ""))
        projector = Projector(*args)
        projector.load_state_dict(tensors)
        if source is not None and target is not None:
            projector.check_fits(source, target)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{path}: not a projector header ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return projector.eval()


@torch.no_grad()
def apply_projector(projector: Projector, session: Session, target: Model,
                    label: str) -> Session:
    """A session of ``target`` continuing ``session`` (of the projector's source model, saved
    as the file ``label``): its hot and cold K/V projected (``project``), everything else
    (ledger rows, pending token, positions, sampler and cache parameters, ids, the
    generator) as it was, checked and written by stage 0 as a loaded session file is
    (``session_io.restore_session``). Each row's origin is ``label`` (its uid there the
    same); a row that came from elsewhere keeps that origin. Folded slots (``--repair
    fold``) are refused: each KV head holds its own mix of tokens there, which a map mixing
    the heads cannot carry."""
    source = session.model
    projector.check_fits(source, target)
    require_same_tokens(source.tokenizer, target.tokenizer)
    tensors, body = session_tensors(session), session_body(session)
    require("heads.n" not in tensors, "the session is a per-head cache (--allocation "
            f"{session.cache_params.allocation.kind}): a projector cannot carry its heads' "
            "own tokens yet")
    require(not bool((tensors["arena.log_mass"] > 0).any()), "the session holds folded slots "
            "(--repair fold): a projector cannot carry a per-head mix of tokens")
    for part, rows in (("arena", "ledger"), ("cold", "cold")):  # the hot rows, the cold ones
        if f"{part}.k" in tensors:
            k, v = project(projector, source, target, tensors[f"{part}.k"],
                           tensors[f"{part}.v"], tensors[f"{rows}.position"])
            tensors[f"{part}.k"], tensors[f"{part}.v"] = (x.to("cpu", target.dtype) for x in (k, v))
            here = tensors[f"{rows}.origin"] == 0  # origin k becomes k + 1 behind the label
            tensors[f"{rows}.origin_uid"] = torch.where(here, tensors[f"{rows}.uid"],
                                                        tensors[f"{rows}.origin_uid"])
            tensors[f"{rows}.origin"] = tensors[f"{rows}.origin"] + 1
    body["ledger"]["origins"] = to_plain((label,) + session.state.ledger.origins, json=True)
    tensors["arena.log_mass"] = torch.zeros(tensors["arena.k"].shape[:3])
    return restore_session(target, tensors, body)
