"""The operators one stage-1 call launches stay under the figures reached, so the count per
token cannot silently grow (each operator is a fixed dispatcher cost; `bench speed` reports
the count, 1,382 in float32 and 1,049 in bfloat16 and int8 for SmolLM2's 30 layers). The count is
linear in the layers: a fixed part (embedding, final norm, lm_head, sampling) and a part
per layer. Where fewer operators replace explicit casts, they give the same bits."""
import pytest
import torch
import torch.nn.functional as F

from positronic_brain.bench.common import operators
from positronic_brain.bench.speed import settle_operators
from positronic_brain.forward import rms_norm
from positronic_brain.loop import Session
from positronic_brain.model import TINY_CONFIGS, load_model
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.sampler import make_generator
from positronic_brain.stages.apply import prime
from positronic_brain.stages.generate import generate
from positronic_brain.types import CacheParams, SamplerParams, Segment

# (per layer, fixed) top-level operators of one CPU stage-1 call, as measured; q/k/v biases
# (qwen2) add one a layer where the product does not take them (float32, int8)
BOUNDS = {"float32": (45, 63), "bfloat16": (34, 61), "int8": (34, 61)}
GREEDY = SamplerParams(greedy=True)
# top-level operators of stages 2-4 of a whole-token step at the budget (brightness, one
# cull, no repair), as measured: a row's own cost in a batch, where stage 1 is shared (the
# new token takes the culled slot: no slot moves)
SETTLE_BOUND = 106


def _count(model) -> int:
    state, _ = prime(model, [Segment(tuple(range(3, 60)), "user")], capacity=80)
    view, gen = state.view(), make_generator(0)
    generate(model, view, GREEDY, gen)  # warm: a first call may launch set-up operators
    return operators(lambda: generate(model, view, GREEDY, gen))[0]


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
@pytest.mark.parametrize("name", [n for n in TINY_CONFIGS if n.startswith("tiny-random")])
def test_stage1_operator_count_stays_under_the_bound(name, dtype):
    model = load_model(name, dtype, "cpu")
    per_layer, fixed = BOUNDS[dtype]
    bound = per_layer * model.spec.n_layers + fixed
    assert _count(model) <= bound, f"{name} {dtype}: more than {bound} operators per token"


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
def test_real_model_operator_count(real_model, dtype):
    model = real_model if dtype == "float32" else load_model("smollm2", dtype)
    per_layer, fixed = BOUNDS[dtype]
    assert _count(model) <= per_layer * model.spec.n_layers + fixed


def test_the_fused_casts_give_the_same_bits():
    """Stage 1 in bfloat16 lets the CPU's fused RMSNorm and the softmax take their inputs
    to float32 themselves: bit for bit what the explicit casts (Hugging Face's) give."""
    g = torch.Generator().manual_seed(0)
    for rows, width, size in ((1, 576, 3.0), (17, 576, 40.0), (3, 64, 0.01)):
        x = (torch.randn(rows, width, generator=g) * size).bfloat16()
        w = torch.randn(width, generator=g).bfloat16()
        ours = rms_norm(x, w, 1e-5)
        assert torch.equal(ours, w * F.rms_norm(x.float(), (width,), eps=1e-5).bfloat16())
    for n in (2, 129, 4097):
        scores = (torch.randn(3, 3, n, generator=g) * 20).bfloat16()
        assert torch.equal(torch.softmax(scores, -1, dtype=torch.float32),
                           torch.softmax(scores.float(), -1))


def test_a_step_s_stages_2_to_4_operator_count_stays_under_the_bound():
    """Stages 2-4 of one step launch at most ``SETTLE_BOUND`` operators: in a batch of rows
    they run once a row, so each is a row's fixed cost beside the shared stage 1 (the
    ledger's columns of a dtype move as one table, ``Ledger.tables``)."""
    model = load_model("tiny-random", "float32", "cpu")
    session = Session(model, TokenPolicy(model.tokenizer), GREEDY,
                      CacheParams(budget=40, sinks=2, recent=4))
    session.prime([Segment(tuple(range(3, 60)), "user")], 80)
    for _ in range(2):  # warm, and at the budget: every step culls one
        session.step()
    dropped = session.state.ledger.dropped
    count = settle_operators(session)
    assert session.state.ledger.dropped == dropped + 1 and session.state.arena.n == 40
    assert count <= SETTLE_BOUND, f"stages 2-4 launched {count} operators"
