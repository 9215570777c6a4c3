"""The sampler: one row of logits -> one token, with a report of the alternatives."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .types import SamplerParams, SamplerReport


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The sampler's only source of randomness, on the model's device (a draw happens where
    the logits are)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def process(logits: torch.Tensor, params: SamplerParams, seen: torch.Tensor | None) -> torch.Tensor:
    """Apply the sampling rule to raw logits (V,) -> processed logits (V,) float32 (-inf = removed).

    ``seen`` (S,) int64: token ids the repetition penalty applies to (None: it is 1).
    """
    x = logits.float()  # the logits themselves where they are float32: nothing below writes x
    if params.repetition_penalty != 1.0 and seen.numel():
        # The standard sign rule: shrink positive logits, push negative ones further down.
        sel = x.gather(0, seen)
        x = x.scatter(0, seen, torch.where(sel > 0, sel / params.repetition_penalty,
                                       sel * params.repetition_penalty))
    if params.is_greedy:
        return x
    if params.temperature != 1.0:  # x / 1 is x, bit for bit
        x = x / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        remove = cum <= 1 - params.top_p
        remove[-1] = False  # always keep the most likely token
        x = x.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: SamplerParams, seen: torch.Tensor | None,
           generator: torch.Generator, force: int | None = None,
           draw: Callable[[torch.Tensor, torch.Generator], int | None] | None = None
           ) -> SamplerReport:
    """Pick the next token from raw logits (V,). Greedy takes the argmax; otherwise one
    multinomial draw from ``generator`` (whose state is the only randomness): torch's, or
    ``draw(probs, generator)``'s where it gives one (``native.draw``: the same token and
    generator state, faster). ``force`` (teacher forcing) is taken as is, without a draw;
    the report still ranks the others."""
    x = process(logits, params, seen)
    probs = x.softmax(-1)
    top = torch.topk(probs, min(params.report_top, probs.numel()))
    drawn = force is None and not params.is_greedy
    token = draw(probs, generator) if drawn and draw is not None else None
    torch_draw = ((torch.multinomial(probs, 1, generator=generator).double(),)
                  if drawn and token is None else ())
    # read back at once (one wait for the device, not one a value): ids and float32
    # probabilities are exact in float64
    read = torch.cat((top.indices.double(), top.values.double(), *torch_draw)).tolist()
    k = top.indices.shape[0]
    ids, ps = [int(i) for i in read[:k]], read[k:2 * k]
    if force is not None:
        token = force
    elif params.is_greedy:
        # the report's first token is the argmax when its probability is above the
        # second's (a larger probability comes only from a larger logit); an argmax over
        # the vocabulary (tens of µs on the CPU) only settles a tie
        token = ids[0] if len(ps) > 1 and ps[0] > ps[1] else int(torch.argmax(x))
    elif token is None:
        token = int(read[-1])
    return SamplerReport(token_id=token, top_ids=tuple(ids),
                         top_probs=tuple(round(p, 6) for p in ps))
