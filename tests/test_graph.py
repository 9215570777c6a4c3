"""``--compile graph``: stage 1 over a fixed number of the arena's slots (``graph.bucket``),
the free ones masked, replayed as a CUDA graph on a GPU. It rounds otherwise than the plain
step (the masked columns change how sums are blocked), so it is held to Hugging Face's
forward (``ORACLE`` in float32, ``half_oracle`` in bfloat16) and to the plain step within
``tolerance.apart``; a graph run's capture replays bit for bit; the fixed-shape forward is
one graph to ``torch.compile(fullgraph=True)`` on the CPU. On the CPU the graph is the
forward run as it is (``model.check_compile`` refuses the mode there for users: nothing
launches), which is what these tests run where no GPU is at hand."""
import dataclasses
import json
import math

import pytest
import torch
from torch._dynamo.utils import counters

from positronic_brain import graph
from positronic_brain.capture import CaptureTape
from positronic_brain.cli import main as cli
from positronic_brain.loop import Session
from positronic_brain.model import load_model
from positronic_brain.replay import replay
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.apply import apply, prime
from positronic_brain.stages.generate import generate
from positronic_brain.types import CacheParams, SamplerParams, Segment, UserError
from tests.oracle import assert_close, hf_step_logits, plain_step
from tests.tolerance import ORACLE, apart, half_oracle

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _graph_model(name: str, dtype: str, device: str):
    """A model whose stage 1 is the graph's: loaded so on a GPU, marked so on the CPU (where
    loading refuses the mode: see the module's docstring)."""
    if device == "cuda":
        return load_model(name, dtype, device, compile="graph")
    return dataclasses.replace(load_model(name, dtype, device), compiled="graph")


def test_buckets_hold_the_live_slots_in_at_most_twice_their_reads():
    for capacity in (1, 200, 256, 300, 4096, 5000):
        sizes = set()
        for n in range(0, capacity + 1):
            m = graph.bucket(n, capacity)
            sizes.add(m)
            assert n <= m <= capacity
            assert m == capacity or (m >= graph.SMALLEST and m & (m - 1) == 0 and m < 2 * max(n, 129))
        # a session captures a few graphs, not one a length
        assert len(sizes) <= 2 + max(0, math.ceil(math.log2(capacity / graph.SMALLEST)))


@pytest.mark.parametrize("name,dtype,device", [
    ("tiny-random", "float32", "cpu"), ("tiny-random-qwen2", "bfloat16", "cpu"),
    pytest.param("tiny-random", "float32", "cuda", marks=CUDA),
    pytest.param("tiny-random-qwen2", "bfloat16", "cuda", marks=CUDA)])
def test_graph_step_equals_hf_and_the_plain_path(name, dtype, device):
    """Sampled steps over a cache that grows from one bucket into the next: each graph step's
    logits equal HF's on the same live K/V and the plain step's, its attention row (cut to
    the live slots) and new K/V the plain step's."""
    model = _graph_model(name, dtype, device)
    plain = dataclasses.replace(model, compiled="")
    policy = TokenPolicy(model.tokenizer)
    state, _ = prime(plain, [Segment(tuple(range(7, 252)), "user")], capacity=300)
    assert 240 < state.arena.n < graph.SMALLEST - 4  # the steps cross into the next bucket
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=4), state=state)
    half = dtype != "float32"
    for i in range(20):
        view = session.state.view()
        gen = generate(model, view, session.sampler, session.generator)
        ref = plain_step(plain, view)
        want = hf_step_logits(model, view)
        m = graph.bucket(view.n, view.capacity) + 1  # the slots a softmax sums over
        size, last = float(want.abs().max()), model.spec.n_layers - 1
        assert_close(gen.logits, want, half_oracle(model) * size if half else ORACLE,
                     f"{name} step {i} vs HF")
        assert_close(gen.logits, ref.logits[0],
                     half_oracle(model) * size if half else apart(model, size, m),
                     f"{name} step {i} vs plain")
        assert_close(gen.attention, ref.attention,
                     apart(model, float(ref.attention.abs().max()), m, last, 4),
                     f"{name} step {i} attention")
        assert_close(gen.k, ref.k, apart(model, float(ref.k.abs().max()), m, last, 3),
                     f"{name} step {i} keys")
        assert gen.attention.shape == (model.spec.n_layers, model.spec.n_heads, view.n)
        apply(model, session.state, gen)
    assert session.state.arena.n > graph.SMALLEST


def test_graph_reads_folded_slots_log_mass_and_gives_recall_its_query():
    """Where slots were folded (a log-mass to add), with the query and its log-sum-exp
    wanted (as recall wants them), the graph's step equals the plain step's outputs."""
    model = load_model("tiny-random", "float32")
    gmodel = dataclasses.replace(model, compiled="graph")
    policy = TokenPolicy(model.tokenizer)
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=1),
                      CacheParams(budget=24, sinks=1, recent=2, repair="fold"))
    session.prime(policy.raw_prompt("fold what the budget leaves out, and recall it " * 3))
    folded = 0
    for _ in range(16):
        view = session.state.view()
        folded += view.log_mass is not None
        ours = graph.stage1(gmodel, view, want_query=True)
        ref = plain_step(model, view, past_log_mass=view.log_mass, want_query=True)
        m, last = graph.bucket(view.n, view.capacity) + 1, model.spec.n_layers - 1
        for what, then in (("logits", None), ("attention", 4), ("query", 3)):
            x = getattr(ref, what)
            assert_close(getattr(ours, what), x,
                         apart(model, float(x.abs().max()), m, None if then is None else last,
                               2 if then is None else then), what)
        # a log-sum-exp moves by its scores' errors weighted by their softmax (test_compile)
        size = float(ref.lse.abs().max()) + math.log(m)
        assert_close(ours.lse, ref.lse, apart(model, size, m, last, 4), "log-sum-exp")
        session.step()
    assert folded >= 4, folded


def test_the_fixed_shape_forward_is_one_graph_to_torch_compile():
    """``torch.compile(fullgraph=True)`` traces the fixed-shape forward whole (a graph break
    raises), once for every live count and position at a bucket, and gives the eager
    forward's logits."""
    torch._dynamo.reset()
    counters.clear()
    model = load_model("tiny-random", "float32")
    state, _ = prime(model, TokenPolicy(model.tokenizer).raw_prompt("traced whole " * 8),
                     capacity=300)
    view = state.view()
    m = graph.bucket(view.n, view.capacity)
    k, v = graph.slots(view.k, m), graph.slots(view.v, m)
    traced = torch.compile(graph.fixed_forward, fullgraph=True, dynamic=False)
    try:
        for live in (view.n, view.n - 5):
            args = (model, k, v, None, view.token_id.new_tensor([view.pending_token]),
                    view.token_id.new_tensor([live]), torch.tensor(live), True)
            ours, eager = traced(*args), graph.fixed_forward(*args)
            size = float(eager.logits.abs().max())
            assert_close(ours.logits, eager.logits, apart(model, size, m + 1), "logits")
            assert_close(ours.lse, eager.lse, apart(model, float(eager.lse.abs().max())
                                                    + math.log(m + 1), m + 1), "log-sum-exp")
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    finally:
        torch._dynamo.reset()


def test_a_graph_capture_replays_bit_exact(tmp_path):
    """A graph run's capture records the mode and replays through the graph, bit for bit."""
    model = _graph_model("tiny-random", "float32", "cpu")
    policy = TokenPolicy(model.tokenizer)
    tape = CaptureTape(tmp_path, {"model": model.name, "dtype": "float32", "compiled": "graph",
                                  "fingerprint": model.fingerprint}, level="full", run_id="run")
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=3),
                      CacheParams(budget=12, sinks=1, recent=2, repair="fold"), tape=tape)
    session.prime(policy.raw_prompt("a captured graph run"))
    for _ in session.stream(12, ignore_eos=True):
        pass
    tape.close("max_new_tokens")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["compiled"] == "graph"
    report = replay(tmp_path / "run", model=model)
    assert report.ok and report.steps == 12 and report.tolerance is None, report.mismatches[:3]


def test_graph_runs_on_one_gpu_only(capsys):
    with pytest.raises(UserError, match="--compile graph runs on one CUDA GPU only"):
        load_model("tiny-random", "float32", "cpu", compile="graph")
    assert cli(["run", "--model", "tiny-random", "--device", "cpu", "--compile", "graph",
                "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().endswith("--compile graph runs on one CUDA GPU only")


@CUDA
def test_a_graph_step_replays_without_a_host_sync_and_as_its_eager_forward():
    """After its capture, a graph step waits for nothing on the host (CUDA's sync debug mode
    raises on any), and a replay gives the bits of the eager fixed-shape forward it holds."""
    model = _graph_model("tiny-random", "bfloat16", "cuda")
    state, _ = prime(model, TokenPolicy(model.tokenizer).raw_prompt("no sync " * 8),
                     capacity=300)
    view = state.view()
    graph.stage1(model, view, want_query=True)  # captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = graph.stage1(model, view, want_query=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    m = graph.bucket(view.n, view.capacity)
    eager = graph.fixed_forward(model, graph.slots(view.k, m), graph.slots(view.v, m), None,
                                view.token_id.new_tensor([view.pending_token]),
                                view.token_id.new_tensor([view.next_position]),
                                torch.tensor(view.n, device="cuda"), True)
    assert torch.equal(ours.logits, eager.logits) and torch.equal(ours.query, eager.query)
    assert torch.equal(ours.attention, eager.attention[..., :view.n])
