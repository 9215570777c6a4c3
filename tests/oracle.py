"""The oracle: Hugging Face's own forward (code nobody here wrote) on the same cache."""
from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from positronic_brain.forward import forward
from positronic_brain.model import Model, hf_forward
from positronic_brain.state import View
from positronic_brain.types import ForwardOut


def dynamic_cache(view: View) -> DynamicCache:
    """A DynamicCache holding copies of the live K/V (any slot order), batch 1."""
    return DynamicCache(ddp_cache_data=[(view.k[i][None].clone(), view.v[i][None].clone())
                                        for i in range(view.k.shape[0])])


@torch.no_grad()
def hf_step_logits(model: Model, view: View) -> torch.Tensor:
    """HF logits (V,) for the pending token at its position over the live cache."""
    out = hf_forward(model.hf, torch.tensor([[view.pending_token]], device=model.device),
                     dynamic_cache(view), use_cache=True,
                     position_ids=torch.tensor([[view.next_position]], device=model.device))
    return out.logits[0, -1].float()


@torch.no_grad()
def hf_prompt_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """HF logits (T, V) of a plain forward over ``ids`` from an empty cache."""
    return hf_forward(model.hf, torch.tensor([ids], device=model.device)).logits[0].float()


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, atol: float, what: str) -> None:
    diff = (ours.float().cpu() - theirs.float().cpu()).abs()
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    assert float(diff.max()) <= atol, \
        f"{what}: max abs diff {float(diff.max()):.3g} > {atol} (mean {float(diff.mean()):.3g})"


def plain_step(model: Model, view: View, **kwargs) -> ForwardOut:
    """The plain forward of the view's pending token at its position over its live K/V (what
    a plain stage 1 runs), with its attention row and ``kwargs`` (``forward``'s)."""
    return forward(model, view.k, view.v, view.token_id.new_tensor([view.pending_token]),
                   view.token_id.new_tensor([view.next_position]), want_attention=True, **kwargs)


# --- per-head caches ----------------------------------------------------------------------------

PER_HEAD = "positronic_per_head"  # HF's eager attention, each KV head over its own tokens


def _per_head_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                        held=None, **kwargs):
    """Hugging Face's eager attention (``eager_attention_forward``, its weights and
    softmax) where each query head sees only the cached tokens its KV head holds:
    ``held[layer]`` (KVH, n) is False where that head does not hold the cached token
    (the tokens past the cache, this forward's own, every head holds), or, as floats, what
    each head adds to its scores of each cached token (a fold's log-mass; -inf: not held)."""
    keep = held[module.layer_idx].to(query.device)
    if keep.dtype == torch.bool:  # held or not; else a bias: a fold's log-mass, -inf if not held
        keep = torch.zeros(keep.shape, device=query.device).masked_fill(~keep, -math.inf)
    new = key.shape[2] - keep.shape[1]
    keep = torch.cat((keep, keep.new_zeros(keep.shape[0], new)), 1)
    keep = keep.repeat_interleave(module.num_key_value_groups, 0)  # (H, T): query heads
    cut = keep.to(query.dtype).clamp(min=torch.finfo(query.dtype).min)[None, :, None, :]
    mask = cut if attention_mask is None else attention_mask + cut
    return eager_attention_forward(module, query, key, value, mask, scaling, dropout, **kwargs)


AttentionInterface.register(PER_HEAD, _per_head_attention)
AttentionMaskInterface.register(PER_HEAD, eager_mask)


@contextmanager
def per_head(model: Model):
    """The model's Hugging Face forward with ``_per_head_attention`` (a ``held`` keyword
    then says what each head holds), its own attention back afterwards."""
    config = model.hf.config
    before = config._attn_implementation
    config._attn_implementation = PER_HEAD
    try:
        yield
    finally:
        config._attn_implementation = before


@torch.no_grad()
def hf_step_logits_per_head(model: Model, view: View, held: torch.Tensor) -> torch.Tensor:
    """HF logits (V,) for the pending token at its position over the union of live tokens
    (the view's), each (layer, KV head) attending only to those ``held`` (L, KVH, n) says
    it holds: the oracle for caches whose heads keep different tokens."""
    require_shape = (view.k.shape[0], view.k.shape[1], view.k.shape[2])
    assert tuple(held.shape) == require_shape, f"held {tuple(held.shape)} != {require_shape}"
    with per_head(model):
        out = hf_forward(model.hf, torch.tensor([[view.pending_token]], device=model.device),
                         dynamic_cache(view), use_cache=True, held=held,
                         position_ids=torch.tensor([[view.next_position]], device=model.device))
    return out.logits[0, -1].float()


def per_head_state_logits(model: Model, state) -> torch.Tensor:
    """HF's logits over the union of the tokens the heads hold, each head masked to its own,
    its K/V for them taken from the slots it holds them in, a folded slot's log-mass added."""
    view, h, m = state.view(), state.heads, state.ledger
    L, KVH = h.n.shape
    k = torch.zeros(L, KVH, m.n, view.k.shape[-1])
    v = torch.zeros_like(k)
    held = torch.full((L, KVH, m.n), -math.inf)  # each head's bias: its log-mass where held
    layer, head, slot = h.live(state.arena.n).nonzero().unbind(1)
    row = h.row[layer, head, slot]
    k[layer, head, row] = view.k[layer, head, slot]
    v[layer, head, row] = view.v[layer, head, slot]
    held[layer, head, row] = state.arena.log_mass[layer, head, slot]
    return hf_step_logits_per_head(model, SimpleNamespace(
        k=k, v=v, pending_token=view.pending_token, next_position=view.next_position), held)
