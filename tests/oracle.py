"""The oracle: Hugging Face's own forward (code nobody here wrote) on the same cache."""
from __future__ import annotations

import torch
from transformers import DynamicCache

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
