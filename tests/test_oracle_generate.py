"""Greedy tokens through our loop equal Hugging Face `generate` token for token."""
import pytest
import torch

from positronic_brain.loop import run
from positronic_brain.types import SamplerParams, Segment


def _prompts(policy, long_text):
    long_ids = policy.encode(long_text)[:1100]
    return {
        "short": policy.raw_prompt("The capital of France is"),
        "chat": policy.chat([("user", "Name three colours of the rainbow.")]),
        "long-1100": [Segment(tuple(long_ids), "user")],
    }


@pytest.mark.parametrize("which", ["short", "chat", "long-1100"])
def test_greedy_ids_equal_hf_generate(real_model, real_policy, long_text, which):
    segs = _prompts(real_policy, long_text)[which]
    ids = [i for s in segs for i in s.ids]
    new = 24 if which == "long-1100" else 40
    ours = run(real_model, real_policy, segs, SamplerParams(greedy=True), max_new_tokens=new)
    with torch.no_grad():
        theirs = real_model.hf.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=new, eos_token_id=sorted(real_policy.eos_ids),
            pad_token_id=real_policy.bos_id, top_k=None, top_p=None, temperature=None)
    assert ours["prompt_ids"] == ids
    assert ours["generated_ids"] == theirs[0, len(ids):].tolist()
    assert len(ours["steps"]) == len(ours["generated_ids"])
    if ours["stop_reason"] == "eos":  # as in HF, the stop token is the last generated id
        assert real_policy.is_eos(ours["generated_ids"][-1])
