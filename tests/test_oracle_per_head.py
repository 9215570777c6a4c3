"""The oracle for caches whose heads keep different tokens (``oracle.hf_step_logits_per_head``):
Hugging Face's own forward over the union of live tokens, each KV head masked to the tokens
it holds through transformers' attention registry. Checked against what it must agree with
before any stage 1 is held to it: every head holding every token is the plain oracle; a
token no head holds is the plain oracle without it; a head's K/V for a token it does not
hold changes nothing, for a token it holds changes the logits."""
from types import SimpleNamespace

import pytest
import torch

from positronic_brain.loop import Session
from positronic_brain.types import CacheParams, SamplerParams, Segment
from tests.oracle import assert_close, hf_step_logits, hf_step_logits_per_head
from tests.tolerance import ORACLE


@pytest.fixture
def view(tiny_model, tiny_policy):
    """A live cache of 40 tokens (no budget) with a pending token."""
    session = Session(tiny_model, tiny_policy, SamplerParams(greedy=True), CacheParams())
    session.prime([Segment(tuple(tiny_policy.encode("the quick brown fox jumps over the "
                                                    "lazy dog and runs far away " * 3))[:40],
                           "user")])
    v = session.state.view()
    return SimpleNamespace(k=v.k.clone(), v=v.v.clone(), pending_token=v.pending_token,
                           next_position=v.next_position)


def _held(view) -> torch.Tensor:
    return torch.ones(view.k.shape[:3], dtype=torch.bool)


def test_every_head_holding_every_token_is_the_plain_oracle(tiny_model, view):
    assert_close(hf_step_logits_per_head(tiny_model, view, _held(view)),
                 hf_step_logits(tiny_model, view), ORACLE, "all held")


def test_a_token_no_head_holds_is_the_plain_oracle_without_it(tiny_model, view):
    held = _held(view)
    held[:, :, 7] = False
    keep = [i for i in range(view.k.shape[2]) if i != 7]
    without = SimpleNamespace(k=view.k[:, :, keep], v=view.v[:, :, keep],
                              pending_token=view.pending_token,
                              next_position=view.next_position)
    assert_close(hf_step_logits_per_head(tiny_model, view, held),
                 hf_step_logits(tiny_model, without), ORACLE, "token 7 held by no head")


def test_a_head_reads_only_the_tokens_it_holds(tiny_model, view):
    """Layer 1's KV head 0 drops tokens 3-9, every other head keeps them: noise in what
    that head dropped changes nothing; in what another head holds, it does."""
    held = _held(view)
    held[1, 0, 3:10] = False
    want = hf_step_logits_per_head(tiny_model, view, held)
    for name in ("k", "v"):
        noisy = SimpleNamespace(**vars(view))
        setattr(noisy, name, getattr(view, name).clone())
        getattr(noisy, name)[1, 0, 3:10] += 5 * torch.randn_like(getattr(noisy, name)[1, 0, 3:10])
        assert torch.equal(hf_step_logits_per_head(tiny_model, noisy, held), want), name
        if view.k.shape[1] > 1:  # another head holds those tokens: it reads them
            getattr(noisy, name)[1, 1, 3:10] += 5
            assert not torch.equal(hf_step_logits_per_head(tiny_model, noisy, held), want)
    assert not torch.equal(want, hf_step_logits_per_head(tiny_model, view, _held(view)))
