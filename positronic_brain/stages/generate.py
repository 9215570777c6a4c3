"""Stage 1: generate one token (read-only).

A manual forward of the pending token at its position over the arena's live K/V,
then the sampler. Returns the new token's K/V as outputs for stage 4 to append.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import graph, native
from ..forward import decode_rows, forward
from ..model import Model
from ..sampler import sample
from ..state import View
from ..types import GenerateOut, SamplerParams, require


def generate(model: Model, view: View, params: SamplerParams,
             generator: torch.Generator, force: int | None = None) -> GenerateOut:
    """Run ``view.pending_token`` at ``view.next_position``; sample its successor, or take
    ``force`` as it (teacher forcing: the successor is given, e.g. a text's next token).

    The repetition penalty applies to the live tokens plus the pending one. With a cold
    store (recall) the output also holds the query and its log-sum-exp per layer, with which
    stage 2 scores the cold keys.
    """
    require(force is None or 0 <= force < model.spec.vocab,
            f"forced token {force} outside the model's vocabulary of {model.spec.vocab}")
    penalty, graphed = params.repetition_penalty != 1.0, graph.chosen(model.compiled)
    # a graph has its own input (a copy from host memory waits for the device)
    ids = view.token_id.new_tensor([view.pending_token]) if penalty or not graphed else None
    if graphed:
        out = graph.stage1(model, view, want_query=view.cold is not None)
    else:
        pos = view.position.new_tensor([view.next_position])
        out = stage1_forward(model)(model, view.k, view.v, ids, pos, want_attention=True,
                                    past_log_mass=view.log_mass, want_query=view.cold is not None)
    return _sampled(view, out, params, generator, force, ids, _draw(model))


def generate_rows(model: Model, views: Sequence[View], params: Sequence[SamplerParams],
                  generators: Sequence[torch.Generator],
                  forces: Sequence[int | None]) -> list[GenerateOut]:
    """``generate`` for each row of a batch at once: one forward over every row's pending
    token (``forward.decode_rows``: the plain path, each row over its own live slots), then
    each row's sampler with its own ``params``, generator and ``force``. A native model's
    rows run the native kernels (``native.decode_rows``: each row the bits of its own step)."""
    for force in forces:
        require(force is None or 0 <= force < model.spec.vocab,
                f"forced token {force} outside the model's vocabulary of {model.spec.vocab}")
    first = views[0]
    ids = first.token_id.new_tensor([v.pending_token for v in views])
    positions = first.position.new_tensor([v.next_position for v in views])
    pasts, queries = [(v.k, v.v, v.log_mass) for v in views], [v.cold is not None for v in views]
    outs = (native.decode_rows if native.rows_apply(model, pasts) else decode_rows)(
        model, pasts, ids, positions, queries)
    draw = _draw(model)
    return [_sampled(v, out, p, g, f, ids[b:b + 1], draw)
            for b, (v, out, p, g, f) in enumerate(zip(views, outs, params, generators, forces))]


def _draw(model: Model):
    """The sampler's draw for ``model``: a native model's kernels' (``native.draw``, the same
    token as torch's), else torch's (None)."""
    return native.draw if native.chosen(model.compiled) else None


def _sampled(view: View, out, params: SamplerParams, generator: torch.Generator,
             force: int | None, ids: torch.Tensor | None, draw=None) -> GenerateOut:
    """Stage 1's output from its forward's ``out``: the next token sampled (or ``force``d)
    from the logits, the repetition penalty over the live tokens and the pending one
    (``ids``), drawn by ``draw`` (``_draw``)."""
    logits = out.logits[0]  # (V,)
    seen = torch.cat((view.token_id, ids)) if params.repetition_penalty != 1.0 else ids
    report = sample(logits, params, seen, generator, force, draw)
    return GenerateOut(input_token=view.pending_token, position=view.next_position,
                       logits=logits, token_id=report.token_id, report=report,
                       k=out.k, v=out.v, attention=out.attention, query=out.query, lse=out.lse)


def stage1_forward(model: Model):
    """The forward stage 1 calls (``Model.compiled``): ``forward``, ``forward`` through
    ``torch.compile`` (``_compiled``) or the native kernels' (``native.stage1``). A CUDA graph
    (``graph.stage1``) replays the plain forward over a fixed bucket of slots, so its model is
    given ``forward``; ``generate`` calls the graph itself, which takes the view."""
    if not model.compiled or graph.chosen(model.compiled):  # a graph's step is the plain one's
        return forward
    return native.stage1 if native.chosen(model.compiled) else _compiled()


@functools.cache
def _compiled():
    """``forward`` through ``torch.compile`` (made once), the context length dynamic, so a
    longer cache does not compile again (docs/DESIGN.md, stage 1)."""
    return torch.compile(forward, dynamic=True)
