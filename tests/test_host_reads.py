"""What a step reads back from the device (``bench.common.host_reads``): on a GPU each read
waits for every launched kernel to finish, so the loop cannot run ahead of the device. The
loop's boundary reads the sampled token and its report (stage 1's sampler, one read) and the
step record's log-probability; stages 2-4 should read nothing. Today stage 3 still reads its
culls (``Actions`` holds them as host integers) and stage 4 its checks of the actions
(one read each, where each read several values one by one before): the figures reached,
which these tests hold so that no read creeps back, until decisions stay on the device."""
import dataclasses

import pytest
import torch

from positronic_brain import options
from positronic_brain.bench.common import cuda_syncs, host_reads
from positronic_brain.loop import Session
from positronic_brain.model import load_model
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.apply import apply
from positronic_brain.stages.decide import decide
from positronic_brain.stages.generate import generate
from positronic_brain.stages.score import recall_query, score
from positronic_brain.types import CacheParams, SamplerParams

# per stage (1-4): the reads of a culling step, as reached (stage 1's is the sampler's: the
# loop boundary's); fold's stage 3 also reads its culls' uids and which of them fold, and its
# stage 4 selects each fold's pairs (``stages.apply.fold._fold_block`` says why), one read a fold more
CULLING = (1, 0, 1, 1)
FOLDING = (1, 0, 2, 1)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random", "float32")


def _stage_reads(model, params: CacheParams, steps: int = 6) -> list[tuple[int, ...]]:
    """Each stage's reads in each of ``steps`` steps past the budget, stage by stage (stage
    4's less one a fold)."""
    policy = TokenPolicy(model.tokenizer)
    session = Session(model, policy, SamplerParams(temperature=1.0, seed=5), params)
    session.prime(policy.raw_prompt("what does a step read back from the device? " * 2))
    out = []
    for _ in range(steps):
        state, kept = session.state, {}
        view = state.view()

        def stage1():
            kept["gen"] = generate(model, view, session.sampler, session.generator)

        def stage2():
            recall = recall_query(view, kept["gen"], params, model.compiled)
            kept["scores"] = score(view, kept["gen"].attention, session.scorer, recall)

        def stage3():
            kept["actions"] = decide(model, view, kept["scores"], params)

        def stage4():
            apply(model, state, kept["gen"], kept["actions"])

        reads = [sum(host_reads(f).values()) for f in (stage1, stage2, stage3, stage4)]
        assert kept["actions"].cull_slots, "the step culls (the budget is reached)"
        reads[3] -= len(kept["actions"].folds)
        out.append(tuple(reads))
    return out


@pytest.mark.parametrize("scorer", ["brightness", "h2o", "tova", "knorm", "keydiff", "kvzip",
                                    "streaming", "random"])
def test_a_culling_step_reads_its_culls_and_its_checks_once(model, scorer):
    for reads in _stage_reads(model, CacheParams(budget=24, scorer=scorer)):
        assert all(r <= c for r, c in zip(reads, CULLING)), (scorer, reads)


def test_a_graph_step_reads_only_the_sampler_s_report(model):
    """Stage 1 as a graph (the CPU runs its forward as it is) reads nothing but the report."""
    graphed = dataclasses.replace(model, compiled="graph")
    for reads in _stage_reads(graphed, CacheParams(budget=24)):
        assert reads[0] == 1 and all(r <= c for r, c in zip(reads, CULLING)), reads


def test_a_folding_step_reads_its_targets_too(model):
    params = options.params(budget=24, repair="fold", fold_min_cos=-1.0)  # every cull folds
    for reads in _stage_reads(model, params):
        assert all(r <= c for r, c in zip(reads, FOLDING)), reads


def test_the_count_sees_each_kind_of_read():
    """What the count counts: a value read (``item``, ``int()``, a truth value), a
    selection sized by values (a boolean mask, ``nonzero``), ``tolist``; not the
    operators that stay on the device."""
    x = torch.arange(6.0)
    mask = x > 2
    for fn, n in ((lambda: x.sum().item(), 1), (lambda: int(x[0]), 1), (lambda: bool(x[1] > 0), 1),
                  (lambda: x[mask], 1), (lambda: mask.nonzero(), 1), (lambda: x.tolist(), 1),
                  (lambda: torch.equal(x, x), 1),
                  (lambda: (x * 2 + 1).softmax(0).index_fill_(0, torch.tensor([1]), 0.0), 0)):
        assert sum(host_reads(fn).values()) == n


def test_cuda_counts_its_own_waits_where_there_is_cuda():
    """``cuda_syncs`` (bench speed's loop rows on a GPU): CUDA's count of the host's waits,
    a value read back among them; nothing to count without CUDA."""
    if not torch.cuda.is_available():
        assert cuda_syncs(lambda: torch.ones(3).sum().item()) is None
        return
    x = torch.ones(3, device="cuda")
    assert cuda_syncs(lambda: x.sum().item()) >= 1
    assert cuda_syncs(lambda: (x * 2).sum()) == 0
