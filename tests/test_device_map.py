"""A model split over devices by a device map (``--device-map``): each block of layers
holds its slice of the arena where it runs, and the loop gives the single-device run's bits.
On the CPU alone the split is over two CPU placements (``cpu:0``, ``cpu:1``): the same
memory, but two blocks of layers and two blocks of the arena, through the same code."""
import json

import pytest
import torch

from positronic_brain import options
from positronic_brain.capture import NO_TAPE, CaptureTape, Tape
from positronic_brain.cli import main as cli
from positronic_brain.loop import Session
from positronic_brain.model import load_model, map_layers
from positronic_brain.replay import replay
from positronic_brain.session_io import load_session, save_session
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.state import Arena, SplitArena, gathered
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.tolerance import products

TWO_CPUS = {"model.embed_tokens": "cpu", "0": "cpu:0", "1": "cpu:1"}  # tiny-random: 2 layers
TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2
SAMPLED = SamplerParams(temperature=0.9, top_k=40, seed=3)
# budgets below the text, so stage 4 culls and moves slots every step, and the edits each makes
CACHES = {
    "merge+reindex": options.params(budget=40, sinks=2, recent=4, repair="merge", max_merges=1,
                                 reindex_at=160),
    "fold": options.params(budget=40, sinks=2, recent=4, repair="fold", fold_min_cos=-1.0),
    "recall": options.params(budget=40, sinks=2, recent=4, recall=True, recall_every=1,
                          recall_margin=0.0, reindex_at=160),
}
EDITS = {"merge+reindex": {"culled", "merged", "reindexed"}, "fold": {"culled", "folded"},
         "recall": {"culled", "recalled", "reindexed"}}
STEPS = 40


@pytest.fixture(scope="module")
def single():
    return load_model("tiny-random", "float32", "cpu")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    path = tmp_path_factory.mktemp("map") / "two-cpus.json"
    path.write_text(json.dumps(TWO_CPUS))
    return load_model("tiny-random", "float32", device_map=str(path))


class Logits(Tape):
    """Keeps every step's logits."""

    def __init__(self):
        self.logits = []

    def generated(self, view, sampler, force, gen) -> None:
        self.logits.append(gen.logits)


def _run(model, cache: CacheParams, tape: Tape = NO_TAPE, edits: set | None = None) -> Session:
    """``STEPS`` steps over ``TEXT``; the kinds of edit they made are added to ``edits``."""
    policy = TokenPolicy(model.tokenizer)
    session = Session(model, policy, SAMPLED, cache_params=cache, tape=tape)
    session.prime(policy.raw_prompt(TEXT))
    for r in session.stream(STEPS, ignore_eos=True):
        session.state.check_valid()
        if edits is not None:
            edits |= {k for k in ("culled", "merged", "folded", "reindexed", "recalled")
                      if getattr(r, k)}
    return session


def test_the_model_and_its_arena_are_split_into_two_blocks(split):
    assert split.split and split.device == torch.device("cpu")
    assert [(sl.start, sl.stop, str(d)) for sl, d in split.blocks] == [(0, 1, "cpu:0"),
                                                                       (1, 2, "cpu:1")]
    state = _run(split, CACHES["fold"]).state
    a = state.arena
    assert isinstance(a, SplitArena) and len(a.blocks) == 2
    assert [b.k.shape[0] for b in a.blocks] == [1, 1]  # each block holds its layer's slice
    assert all(b.n == a.n == state.ledger.n for b in a.blocks)
    view = state.view()
    assert isinstance(view.k, tuple) and len(view.k) == 2
    assert view.vnorm.shape == (2, split.spec.n_kv_heads, a.n)  # gathered for stage 2


@pytest.mark.parametrize("name", list(CACHES))
def test_split_gives_the_single_device_logits_bit_for_bit(single, split, name):
    taped, cache, edits = (Logits(), Logits()), CACHES[name], set()
    one, two = (_run(m, cache, t, edits) for m, t in zip((single, split), taped))
    assert edits == EDITS[name]  # the runs do what they are here to show
    assert len(taped[0].logits) == len(taped[1].logits) == STEPS
    for step, (a, b) in enumerate(zip(*(t.logits for t in taped))):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max():.3g}"
    assert one.generated_ids == two.generated_ids
    x, y = one.state, two.state
    assert isinstance(x.arena, Arena) and isinstance(y.arena, SplitArena)
    for name in ("k", "v", "log_mass", "knorm", "vnorm"):
        assert torch.equal(gathered(x.arena, name, x.arena.n), gathered(y.arena, name, y.arena.n)), name
    for c in x.ledger.COLUMNS:
        assert torch.equal(x.ledger.live(c), y.ledger.live(c)), c
    if cache.recall:
        assert y.cold.n > 0 and torch.equal(x.cold.arena.k, y.cold.arena.k)


def test_a_split_capture_replays_bit_for_bit_split_or_not(single, split, tmp_path):
    tape = CaptureTape(tmp_path, {"model": split.name, "dtype": "float32",
                                  "fingerprint": split.fingerprint}, level="full", run_id="run")
    _run(split, CACHES["merge+reindex"], tape)
    tape.close("max_new_tokens")
    for model in (split, single):
        report = replay(tmp_path / "run", model=model)
        assert report.ok and report.steps == STEPS, [str(m) for m in report.mismatches[:3]]


def test_a_split_session_continues_on_one_device(single, split, tmp_path):
    a = _run(split, CACHES["fold"])
    save_session(a, tmp_path / "s.pbs")
    b = load_session(single, tmp_path / "s.pbs")
    assert isinstance(b.state.arena, Arena)
    ids = [[r.token_id for r in s.stream(8, ignore_eos=True)] for s in (a, b)]
    assert ids[0] == ids[1]


def test_map_layers_reads_accelerate_maps_layer_keys_and_ranges(single):
    hf = single.hf
    accelerate_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
                      "model.norm": 1, "lm_head": 1}
    assert map_layers(accelerate_map, hf) == (0, [0, 1])
    assert map_layers({"": "cpu", "1": "cpu:1"}, hf) == ("cpu", ["cpu", "cpu:1"])
    assert map_layers({"0-1": "cuda:1"}, hf) == ("cuda:1", ["cuda:1", "cuda:1"])
    assert map_layers({"model.layers": "cuda:0", "model": "cpu"}, hf) == ("cpu", ["cuda:0"] * 2)


def test_auto_is_accelerates_map(single):
    """``auto`` asks accelerate's infer_auto_device_map; what does not fit on any device
    goes to 'disk' there, which the loop refuses in one line."""
    if torch.cuda.device_count() < 2:  # one device: the single-device model
        auto = load_model("tiny-random", "float32", device_map="auto")
        assert not auto.split and auto.layer_devices == (auto.device,) * 2
        assert torch.equal(auto.lm_head, single.lm_head.to(auto.device))
    with pytest.raises(UserError, match="mapped to 'disk'"):
        load_model("tiny-random", "float32", device_map="auto", max_memory={"cpu": 10_000})


@pytest.mark.parametrize("device_map, message", [
    ({"0": "cpu", "1": "disk"}, "layer 1 is mapped to 'disk'"),
    ({"0": "cpu", "1": "gpu7"}, "unknown device 'gpu7'"),
    ({"0": "cpu"}, "nothing places model.layers.1"),
    ({"0-2": "cpu"}, "no layer '0-2'"),
    ({"model.decoder": "cpu"}, "no module 'model.decoder'"),
    ({"": "cuda:99"}, "cuda:99"),
])
def test_a_bad_device_map_is_one_line_and_exit_2(capsys, tmp_path, device_map, message):
    path = tmp_path / "map.json"
    path.write_text(json.dumps(device_map))
    code = cli(["run", "--prompt", "x", "--model", "tiny-random", "--device-map", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--device-map", "missing.json"], "device map not found: 'missing.json'"),
    (["--device-map", "{bad"], "device map not found"),
    (["--device", "cpu", "--device-map", "auto"], "not allowed with argument --device"),
])
def test_device_map_arguments_are_checked(capsys, tmp_path, argv, message):
    (tmp_path / "turns").write_text("hello\n")
    code = cli(["chat", "--model", "tiny-random", "--script", str(tmp_path / "turns"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_malformed_map_file_is_one_line(tmp_path):
    path = tmp_path / "map.json"
    path.write_text("{\"0\": ")
    with pytest.raises(UserError, match=r"cannot read the device map .*map\.json"):
        load_model("tiny-random", device_map=str(path))
    path.write_text("[\"cpu\"]")
    with pytest.raises(UserError, match="not a JSON object"):
        load_model("tiny-random", device_map=str(path))
    with pytest.raises(UserError, match="a device or a device map, not both"):
        load_model("tiny-random", device="cpu", device_map={"": "cpu"})


def _gpus(n: int) -> pytest.MarkDecorator:
    count = torch.cuda.device_count()
    return pytest.mark.skipif(count < n, reason=f"needs {n} CUDA device{'s' * (n > 1)} "
                              f"(this machine has {count})")


@pytest.mark.parametrize("device_map, blocks", [
    pytest.param({"0": 0, "1": 1}, ("cuda:0", "cuda:1"), id="cuda:0+cuda:1", marks=_gpus(2)),
    pytest.param({"model.embed_tokens": 0, "0": "cpu", "1": 0}, ("cpu", "cuda:0"),
                 id="cpu+cuda:0", marks=_gpus(1)),
])
def test_split_over_real_devices_gives_the_one_gpu_logits(device_map, blocks):
    """Across real devices kernels round differently (the CPU's layer), so within a
    tolerance, teacher-forced and uncapped (a rounding difference could change a cull)."""
    one = load_model("tiny-random", "float32", "cuda:0")
    two = load_model("tiny-random", "float32", device_map=device_map)
    assert two.split and two.device == torch.device("cuda", 0)
    policy = TokenPolicy(one.tokenizer)
    force = policy.raw_prompt(TEXT[::-1])[0].ids[:STEPS]
    taped, stats = (Logits(), Logits()), []
    for model, tape in zip((one, two), taped):
        session = Session(model, policy, SAMPLED, tape=tape)
        stats.append(session.prime(policy.raw_prompt(TEXT), stats=True))
        list(session.stream(STEPS, ignore_eos=True, force=force))
        session.state.check_valid()
    assert [b.device for b in session.state.arena.blocks] == [torch.device(d) for d in blocks]
    # each device's kernels add in their own order: 9 sums in series a layer (2 RMSNorms,
    # q/k/v, scores, softmax, A.V, o, gate/up, down), each of at most the widest size's terms
    c, n = one.hf.config, session.state.next_position
    terms, L = max(c.hidden_size, c.intermediate_size, n), c.num_hidden_layers
    for a, b in zip(*(t.logits for t in taped)):
        tol = products(torch.float32, terms, 9 * L + 2, float(b.abs().max()))  # norm, head
        assert float((a - b).abs().max()) <= tol, f"max |diff| {(a - b).abs().max():.3g}"
    # the prompt's statistics gathered on each layer's own device: sums over the queries of
    # attention weights, all >= 0 (the last layer's: its norm, q/k/v, scores, softmax)
    for name in ("window", "total"):
        a, b = (getattr(s, name) for s in stats)
        tol = products(torch.float32, terms, 9 * (L - 1) + 5, float(b.abs().max()))
        assert a.device == b.device and float((a - b).abs().max()) <= tol, name
