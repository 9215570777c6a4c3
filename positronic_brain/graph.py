"""Stage 1 at a fixed shape (``--compile graph``): on a GPU, captured once as a CUDA graph
and replayed every step.

A plain step launches each of its several hundred operators from Python, and on a GPU that
launching, not reading memory, is what it waits for (docs/BENCHMARKS.md, the GPU section).
A CUDA graph replays a captured sequence of kernels with one launch, but only over the
same tensors at the same addresses with the same shapes. So the forward here reads a fixed
number of the arena's slots, ``bucket(n, capacity)`` (the live ones and free ones after
them, masked), where the arena lives for the whole session, and takes the pending token,
its position and the live count from device tensors of its own that are written before
each replay (``fill_``, a kernel with the value as its argument: nothing is copied from
host memory, which a graph would replay stale). One graph per (arena, bucket, log-mass or
not, query or not); a longer context moves to the next bucket, a power of two, so a step
reads at most twice the live slots and a session captures a few graphs, not one a length.

The forward is ``forward.decode`` itself with a past mask: the same operators as a masked
plain step. Its outputs are copied out of the graph's memory after each replay
(the next replay overwrites it), the attention row cut to the live slots. The masked
columns change how the softmax's sums and the weighted values' sum are blocked, not what
they sum (a masked weight is exactly 0), so a graph step equals the plain step to float
rounding, not bit for bit, and Hugging Face's forward to the dtype's tolerance
(tests/test_graph.py); a capture records ``compiled: graph`` and replays bit-exact.

On the CPU nothing launches: ``--compile graph`` is refused there (``model.check_compile``),
but the fixed-shape forward runs as it is (the tests run it so, and trace it with
``torch.compile(fullgraph=True)``, which must see no graph break).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from .forward import decode
from .model import GRAPH, Model
from .state import View
from .types import ForwardOut

SMALLEST = 256  # the smallest bucket of slots a graph reads
KEPT = 16  # graphs kept (the least recently replayed dropped first)


def chosen(compiled: str) -> bool:
    """Whether a model compiled as ``compiled`` (its ``Model.compiled``) runs stage 1 here."""
    return compiled == GRAPH


def bucket(n: int, capacity: int) -> int:
    """The slots a step over ``n`` live slots of an arena of ``capacity`` reads: the
    smallest power of two from ``SMALLEST`` that holds them, at most the capacity."""
    return min(capacity, max(SMALLEST, 1 << max(n - 1, 0).bit_length()))


def slots(t: torch.Tensor, m: int) -> torch.Tensor:
    """The arena tensor ``t`` (a view of its first n slots, (L, kv_heads, n, ...)) seen over
    its first ``m`` slots instead: the same storage, strides and offset (``m`` at most the
    arena's capacity, which the view's strides were made for)."""
    shape = (*t.shape[:2], m, *t.shape[3:])
    return t.as_strided(shape, t.stride(), t.storage_offset())


@torch.no_grad()
def fixed_forward(model: Model, k: torch.Tensor, v: torch.Tensor, log_mass: torch.Tensor | None,
                  ids: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                  want_query: bool) -> ForwardOut:
    """``decode`` of one token ``ids`` (1,) at ``positions`` (1,) over all m slots of ``k``/``v``
    (L, kv_heads, m, head_dim) and ``log_mass`` (L, kv_heads, m) or None, of which the first
    ``live`` (a 0-d int64 tensor on the device) are attended and the rest masked. Every
    shape depends on m alone; no value is read on the host."""
    m = k.shape[2]
    mask = (torch.arange(m, device=k.device) < live).view(1, m)
    return decode(model, k, v, ids, positions, past_mask=mask, want_attention=True,
                  past_log_mass=log_mass, want_query=want_query)


@dataclasses.dataclass(eq=False)
class _Captured:
    """One captured graph: its inputs (written before each replay) and outputs."""

    model: Model  # held so that the key's id() is not reused while the graph lives
    ids: torch.Tensor
    positions: torch.Tensor
    live: torch.Tensor
    run: object  # replays the graph (a GPU) or runs the forward (the CPU)
    out: ForwardOut | None = None


_GRAPHS: OrderedDict = OrderedDict()


def stage1(model: Model, view: View, want_query: bool) -> ForwardOut:
    """Stage 1's forward of ``view.pending_token`` at ``view.next_position`` through the graph
    for this view's arena and bucket (captured at its first use), its outputs copied out and
    the attention row cut to the live slots: ``forward``'s outputs for one token."""
    n = view.n
    m = bucket(n, view.capacity)
    k, v = slots(view.k, m), slots(view.v, m)
    log_mass = None if view.log_mass is None else slots(view.log_mass, m)
    key = (id(model), m, want_query, k.data_ptr(), v.data_ptr(), k.stride(), v.stride(),
           None if log_mass is None else (log_mass.data_ptr(), log_mass.stride()))
    graph = _GRAPHS.get(key)
    if graph is None:
        graph = _GRAPHS[key] = _capture(model, k, v, log_mass, want_query)
        while len(_GRAPHS) > KEPT:
            _GRAPHS.popitem(last=False)
    _GRAPHS.move_to_end(key)
    graph.ids.fill_(view.pending_token)
    graph.positions.fill_(view.next_position)
    graph.live.fill_(n)
    out = graph.run()
    return ForwardOut(logits=out.logits.clone(), k=out.k.clone(), v=out.v.clone(),
                      attention=out.attention[..., :n].clone(),
                      query=None if out.query is None else out.query.clone(),
                      lse=None if out.lse is None else out.lse.clone())


def _capture(model: Model, k: torch.Tensor, v: torch.Tensor, log_mass: torch.Tensor | None,
             want_query: bool) -> _Captured:
    """A graph over these slots: on a GPU, ``fixed_forward`` run twice on a side stream (torch's
    recipe: the allocator and libraries settle before a capture) then captured; elsewhere the
    forward itself, run at each call."""
    dev = k.device
    ids = torch.zeros(1, dtype=torch.long, device=dev)
    positions = torch.zeros(1, dtype=torch.long, device=dev)
    live = torch.zeros((), dtype=torch.long, device=dev)
    captured = _Captured(model, ids, positions, live, run=None)

    def call() -> ForwardOut:
        return fixed_forward(model, k, v, log_mass, ids, positions, live, want_query)

    if dev.type != "cuda":
        captured.run = call
        return captured
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.out = call()

    def replay() -> ForwardOut:
        graph.replay()
        return captured.out

    captured.run = replay
    return captured
