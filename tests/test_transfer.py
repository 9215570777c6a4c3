"""Cross-model K/V transfer: a projector trained from one tiny random model's cache into
another's (other widths and depths, the same tokenizer) lowers the held-out KL; its file
round-trips and is refused in one line when damaged or for other models; a projected
session loads into the target model and continues over exactly the projected cache."""
import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from positronic_brain import options
import positronic_brain.transfer as transfer
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.model import byte_tokenizer, hf_forward, load_model
from positronic_brain.session_io import load_session, save_session
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.generate import generate
from positronic_brain.transfer import (KVShape, Projector, TrainParams, apply_projector,
                                       default_layer_map, held_out_kl, load_projector, project,
                                       save_projector, split_windows, train_projector)
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.damage import damaged
from tests.oracle import assert_close
from tests.tolerance import ORACLE, forward_bound, rotation_bound, step, sum_bound, unit

SOURCE, TARGET = "tiny-random", "tiny-random-wide"
QUICK = TrainParams(steps=60, prefix=24, continuation=8, batch=4, eval_windows=8, seed=5)
RECALL = options.params(budget=24, sinks=2, recent=4, recall=True, recall_max=4, recall_layers=2,
                     reindex_at=70)


@pytest.fixture(scope="module")
def models():
    return load_model(SOURCE), load_model(TARGET)


@pytest.fixture(scope="module")
def ids(models, long_text) -> list[int]:
    return TokenPolicy(models[0].tokenizer).encode(long_text[:6000])


@pytest.fixture(scope="module")
def trained(models, ids):
    return train_projector(*models, ids, QUICK)


@torch.no_grad()
def _kl_rounding(model, windows: torch.Tensor) -> float:
    """The most ``held_out_kl`` gives a projector that changes nothing, from ``model`` onto
    itself, over ``windows``: computed, E_p[log p - log q] is the KL, at most D^2 / 2
    (Hoeffding's lemma) for logits D apart (HF's forward over the whole window against
    one over the prefix's cache: the same sums in other orders), plus each side's
    log-softmax error: its vocabulary-wide normalising sum, and the log-probs rounded at
    their size (below log V + twice the largest logit)."""
    logits = hf_forward(model.hf, windows.to(model.device)).logits
    top, vocab = float(logits.abs().max()), logits.shape[-1]
    apart = forward_bound(model, windows.shape[1], top, logits=True)
    return (apart ** 2 / 2 + sum_bound(torch.float32, vocab)
            + step(torch.float32) * (math.log(vocab) + 2 * top))


def test_the_tiny_pair_differs_in_every_kv_dimension_but_head_dim(models):
    a, b = (KVShape.of(m) for m in models)
    assert (a.layers, a.kv_heads, a.width) != (b.layers, b.kv_heads, b.width)
    assert models[0].spec.hidden != models[1].spec.hidden


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_training_lowers_the_held_out_kl(models, ids, trained, kind):
    """Fixed seed; the untrained projector (random semi-orthogonal) is the baseline. The fit
    does most of it; the Adam steps after it do not undo it."""
    report = trained[1] if kind == "linear" else \
        train_projector(*models, ids, dataclasses.replace(QUICK, kind="mlp", hidden=32))[1]
    assert report["kl_fit"] < 0.5 * report["kl_before"], report
    assert report["kl_after"] < 0.5 * report["kl_before"], report
    assert report["kl_after"] < 1.1 * report["kl_fit"], report
    assert report["kind"] == kind and report["steps"] == QUICK.steps
    assert report["train_windows"] > report["held_out_windows"] == QUICK.eval_windows
    assert report["layer_map"] == [0, 0, 1]


def test_the_kl_alone_lowers_the_held_out_kl(models, ids):
    """Without the fit, Adam on the KL alone (C2C's training) still learns."""
    report = train_projector(*models, ids, dataclasses.replace(QUICK, fit=False, lr=3e-3))[1]
    assert report["kl_fit"] is None
    assert report["kl_after"] < 0.7 * report["kl_before"], report


def test_the_fit_of_a_model_onto_itself_learns_the_identity_back(models, ids):
    """From the perturbed identity, the least-squares fit over the training prefixes lands
    on the identity: the held-out KL is near 0, held-out K/V come back as they were."""
    model = models[1]
    params = dataclasses.replace(QUICK, init="perturbed", steps=0)
    projector, report = train_projector(model, model, ids, params)
    # the perturbation's KL is far above what rounding leaves an unchanged projector
    assert report["kl_before"] > 100 * _kl_rounding(model, split_windows(ids, QUICK)[1]), report
    # what the fit (its map biased by fit_linear's ridge) must remove of it: a threshold of
    # the fit's quality, as the 0.5 and 0.7 above, not a rounding tolerance
    assert report["kl_fit"] < 0.001 * report["kl_before"], report
    assert torch.equal(projector.k.scale_in, projector.k.scale_out)  # its own sizes both sides
    session = _session(model, SamplerParams(greedy=True), options.params(budget=24, reindex_at=70))
    view = apply_projector(projector, session, model, "s.pbs").state.view()
    own = session.state.view()
    # the fit's quality again, not rounding: its ridge's bias (0.3% where this was written)
    for got, want in ((view.k, own.k), (view.v, own.v)):
        assert float((got - want).norm() / want.norm()) < 0.01


def test_the_least_squares_solve_recovers_a_map_between_widths():
    """``_Maps.solve`` over ``scaled`` pairs finds an affine map from 8 inputs of unequal
    sizes to 5 outputs exactly (a tiny ridge)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 300, 8, generator=g) * (torch.rand(2, 1, 8, generator=g) * 5 + 0.1)
    w, b = torch.randn(2, 5, 8, generator=g), torch.randn(2, 1, 5, generator=g)
    y = x @ w.transpose(1, 2) + b
    maps = transfer._Maps(2, 8, 5, 0)  # pylint: disable=protected-access
    maps.initialise("random", g, 0.0, x, y)
    xs, ys = maps.scaled(x, y)
    xtx, ridge = xs.transpose(1, 2) @ xs, 1e-9
    maps.solve(xtx, xs.transpose(1, 2) @ ys, ridge)
    # y's own rounding is fitted too: its projection on the inputs' span, at most its norm
    # over the samples; the ridge pulls the map toward 0 by ridge x mean diagonal / the
    # smallest eigenvalue; the map's product (8 inputs and the bias) in float32
    noise = unit(torch.float32) * (y.abs() + y.norm(dim=1, keepdim=True))
    eig = torch.linalg.eigvalsh(xtx)
    pull = ridge * float((xtx.diagonal(dim1=1, dim2=2).mean(-1) / eig[:, 0]).max())
    mag = x.abs() @ w.abs().transpose(1, 2) + b.abs()
    bound = noise + (sum_bound(torch.float32, 10) + pull) * mag
    assert bool(((maps(x).detach() - y).abs() <= bound).all()), "the fitted map"


def test_training_is_repeatable_with_a_seed(models, ids):
    few = dataclasses.replace(QUICK, steps=3, eval_windows=1)
    a, b = (train_projector(*models, ids, few)[0].state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = train_projector(*models, ids, dataclasses.replace(few, seed=6))[0].state_dict()
    assert not torch.equal(a["k.weight"], c["k.weight"])


def test_the_held_out_windows_follow_the_training_ones(ids):
    train, held = split_windows(ids, QUICK)
    size = QUICK.prefix + QUICK.continuation
    assert train.shape[1] == held.shape[1] == size
    cut = int(len(ids) * (1 - QUICK.holdout))
    assert train.numel() <= cut and held[0].tolist() == ids[cut:cut + size]
    with pytest.raises(UserError, match="no window"):
        split_windows(ids[:40], QUICK)


def test_an_identity_projector_of_a_model_onto_itself_changes_nothing(models, ids):
    """Un-rotating with the source's rope and rotating with the target's is exact: a model's
    own K/V through the identity come back as they were, and the KL is 0."""
    model = models[1]
    shape = KVShape.of(model)
    projector = Projector(shape, shape)
    _, held = split_windows(ids, QUICK)
    k, v = _sample(shape)
    projector.initialise("identity", torch.Generator(), 0.0, (k * 10, v), (k * 10, v))
    assert held_out_kl(projector, model, model, held, QUICK.prefix, 4) <= _kl_rounding(
        model, held)
    session = _session(model, SamplerParams(greedy=True), options.params(budget=24, reindex_at=70))
    moved = apply_projector(projector, session, model, "s.pbs")
    view, back = session.state.view(), moved.state.view()
    # the identity map: a value over its scale, times scale / scale (2 roundings), times its
    # scale again, 5 roundings; keys also rotated to 0 and back (3 sums, R(p)^T R(p))
    maps = 5 * unit(torch.float32)
    bound = rotation_bound(view.k, 3, 1) + maps * float(view.k.abs().max())
    assert_close(back.k, view.k, bound, "keys through the identity")
    assert_close(back.v, view.v, maps * float(view.v.abs().max()), "values through the identity")
    # every row comes from s.pbs, as the same uid; moved on again, it keeps that origin
    again = apply_projector(projector, moved, model, "moved.pbs").state.ledger
    assert moved.state.ledger.origins == ("s.pbs",) and again.origins == ("moved.pbs", "s.pbs")
    for ledger, origin in ((moved.state.ledger, 1), (again, 2)):
        assert bool((ledger.live("origin") == origin).all())
        assert torch.equal(ledger.live("origin_uid"), view.uid)


def _sample(shape: KVShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Random source keys and values (La, KVa, 32, Da), each input dimension of its own size."""
    g = torch.Generator().manual_seed(2)
    size = torch.rand(shape.layers, shape.kv_heads, 1, shape.head_dim, generator=g) * 4 + 0.1
    return tuple(torch.randn(shape.layers, shape.kv_heads, 32, shape.head_dim, generator=g) * size
                 for _ in range(2))


def test_the_maps_work_between_sizes_and_the_identity_is_kept(models):
    """The maps read each input dimension over its size and make each output at the
    target's own size: an Adam step moves every output by the same fraction. The identity
    between two sets of sizes still maps each input to the output of the same index."""
    shape = KVShape.of(models[0])
    projector = Projector(shape, shape)
    k, v = _sample(shape)
    projector.initialise("identity", torch.Generator(), 0.0, (k, v), (k * 3, v))
    inputs = projector._inputs(k)  # pylint: disable=protected-access
    # the same operators on the same inputs: the same bits
    assert torch.equal(projector.k.scale_in, inputs.square().mean(1).sqrt())
    # 3 k rounded, squared, its mean over the 32 samples, its root; then 3 x that: relative
    rms = sum_bound(torch.float32, inputs.shape[1]) + 2 * step(torch.float32)
    assert torch.allclose(projector.k.scale_out, 3 * projector.k.scale_in, rtol=rms, atol=0)
    # the identity map between sizes: 5 roundings of each key (as above)
    bound = 5 * unit(torch.float32) * float(k.abs().max())
    assert_close(projector(k, v)[0].detach(), k, bound, "the identity between sizes")


def test_layer_map_defaults_to_the_same_relative_depth():
    assert default_layer_map(30, 30) == tuple(range(30))
    assert default_layer_map(2, 3) == (0, 0, 1)
    assert default_layer_map(3, 2) == (0, 2)
    assert default_layer_map(4, 1) == (0,)
    with pytest.raises(UserError, match="layer map"):
        Projector(KVShape(2, 2, 16), KVShape(3, 3, 16), layer_map=(0, 1, 2))


@pytest.mark.parametrize("bad, message", [
    (dict(steps=-1), "steps"), (dict(lr=0.0), "learning rate"), (dict(holdout=1.0), "holdout"),
    (dict(kind="conv"), "kind"), (dict(init="zeros"), "init"), (dict(prefix=0), "prefix"),
])
def test_bad_training_parameters_are_refused(bad, message):
    with pytest.raises(UserError, match=message):
        TrainParams(**bad)


# --- files ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def projector_file(trained, tmp_path_factory) -> Path:
    return save_projector(trained[0], tmp_path_factory.mktemp("projector") / "p.safetensors")


def test_the_projector_file_round_trips(trained, projector_file, models):
    loaded = load_projector(projector_file, *models)
    assert loaded.header == trained[0].header
    saved = trained[0].state_dict()
    assert all(torch.equal(saved[k], t) for k, t in loaded.state_dict().items())
    assert sorted(p.name for p in projector_file.parent.iterdir()) == ["p.safetensors"]


def test_an_mlp_projector_file_round_trips(tmp_path):
    p = Projector(KVShape(2, 2, 16), KVShape(3, 3, 16), kind="mlp", hidden=8)
    p.initialise("random", torch.Generator().manual_seed(1), 0.0, _sample(KVShape(2, 2, 16)),
                 _sample(KVShape(3, 3, 16)))
    q = load_projector(save_projector(p, tmp_path / "mlp.safetensors"))
    assert q.header == p.header and sorted(q.state_dict()) == sorted(p.state_dict())
    assert {"k.up", "k.down", "k.gate", "v.gate"} <= set(q.state_dict())
    assert float(torch.sigmoid(q.k.gate.detach()).max()) < 0.05  # the branch starts nearly closed


def test_the_file_is_plain_safetensors_and_nothing_is_unpickled(projector_file):
    header_len = int.from_bytes(projector_file.read_bytes()[:8], "little")
    header = json.loads(projector_file.read_bytes()[8:8 + header_len])
    assert set(header.pop("__metadata__")) == {"format", "projector", "sha256"}
    assert {k.split(".")[0] for k in header} == {"k", "v"}
    tree = ast.parse(Path(transfer.__file__).read_text())
    names = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))}
    assert not names & {"pickle", "torch.load", "load_file"}


KIND_EDIT = (b'\\"kind\\": \\"linear\\"', b'\\"kind\\": \\"LINEAR\\"')  # in the header


@pytest.mark.parametrize("how, message", [
    ("truncated", "not a readable projector file"),
    ("flipped", r"corrupt \(sha256 mismatch\)"),
    ("header", r"corrupt \(sha256 mismatch\)"),
])
def test_a_damaged_projector_file_is_refused(projector_file, tmp_path, how, message):
    with pytest.raises(UserError, match=message) as e:
        load_projector(damaged(projector_file, tmp_path, how, KIND_EDIT))
    assert "\n" not in str(e.value)


def test_a_projector_for_other_models_is_refused(projector_file, models):
    with pytest.raises(UserError, match="the projector maps from 2 layers x 2 KV heads") as e:
        load_projector(projector_file, models[1], models[0])
    assert "'tiny-random-wide' has 3 layers x 3 KV heads x 16 dims" in str(e.value)
    with pytest.raises(UserError, match="maps into 3 layers"):
        load_projector(projector_file, models[0], models[0])


def test_a_file_whose_tensors_disagree_with_its_header_is_refused(tmp_path):
    """Checksum intact: a projector saved with one shape, its header claiming another."""
    from positronic_brain.plain import save_signed

    p = Projector(KVShape(2, 2, 16), KVShape(3, 3, 16))
    header = {**p.header, "target": {"layers": 3, "kv_heads": 2, "head_dim": 16}}
    tensors = {k: t.contiguous() for k, t in p.state_dict().items()}
    bad = save_signed(tmp_path / "bad.safetensors", tensors, {
        "format": transfer.FORMAT, "projector": json.dumps(header)})
    with pytest.raises(UserError, match=r"tensor k\.weight: \(3, 48, 32\)"):
        load_projector(bad)


def test_a_session_file_is_not_a_projector(tmp_path, models):
    session = _session(models[0], SamplerParams(greedy=True), CacheParams())
    path = save_session(session, tmp_path / "a.pbs")
    with pytest.raises(UserError, match="not a projector file of format"):
        load_projector(path)


# --- tokenizers -----------------------------------------------------------------------------

def _with_tokenizer(model, extra: str | None = None, eos: str | None = None):
    tok = byte_tokenizer()
    if extra:
        tok.add_tokens([extra])
    if eos:
        tok.eos_token = eos
    return dataclasses.replace(model, tokenizer=tok)


@pytest.mark.parametrize("change, message", [
    (dict(extra="<extra>"), "259 and 260 tokens, '<extra>' is None and 259"),
    (dict(eos="<|endoftext|>"), "special tokens"),
])
def test_models_that_do_not_share_a_tokenizer_are_refused(models, ids, change, message):
    other = _with_tokenizer(models[1], **change)
    with pytest.raises(UserError, match="do not share a tokenizer") as e:
        train_projector(models[0], other, ids, QUICK)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="do not share a tokenizer"):
        apply_projector(Projector(KVShape.of(models[0]), KVShape.of(other)),
                        _session(models[0], SamplerParams(greedy=True), CacheParams()), other,
                        "a.pbs")


# --- sessions ---------------------------------------------------------------------------------

def _session(model, sampler, cache_params, steps: int = 30) -> Session:
    policy = TokenPolicy(model.tokenizer)
    s = Session(model, policy, sampler, cache_params)
    s.prime(policy.raw_prompt("bring back what the query attends to, " * 2))
    for _ in range(steps):
        s.step()
    return s


def _oracle_logits(model, k: torch.Tensor, v: torch.Tensor, token: int, position: int):
    """Hugging Face's logits for ``token`` at ``position`` over the cache ``k``/``v``."""
    cache = DynamicCache(ddp_cache_data=[(k[i][None], v[i][None]) for i in range(k.shape[0])])
    out = hf_forward(model.hf, torch.tensor([[token]]), cache,
                     position_ids=torch.tensor([[position]]), use_cache=True)
    return out.logits[0, -1].float().detach()


def test_a_projected_session_loads_into_the_target_and_continues(tmp_path, models, trained):
    """Culled, re-indexed, with a cold store: the target's session holds the source's
    ledger rows and the projected K/V, and its stage-1 logits equal Hugging Face's forward
    of the target over exactly those K/V."""
    source, target = models
    sampler = SamplerParams(temperature=1.0, top_k=20, seed=3)
    a = _session(source, sampler, RECALL)
    assert a.state.cold.n > 0  # culled into the cold store, and re-indexed:
    assert a.state.next_position < len(a.prompt_ids) + a.state.step
    b = load_session(target, save_session(apply_projector(trained[0], a, target, "a.pbs"),
                                          tmp_path / "b.pbs"))
    sa, sb = a.state, b.state
    assert sa.ledger.names == sb.ledger.names == sa.cold.ledger.names == sb.cold.ledger.names
    for column in sa.ledger.names:
        if column in ("origin", "origin_uid"):
            continue
        assert torch.equal(sa.ledger.live(column), sb.ledger.live(column)), column
        assert torch.equal(sa.cold.ledger.live(column), sb.cold.ledger.live(column)), column
    for ledger, source_ledger in ((sb.ledger, sa.ledger), (sb.cold.ledger, sa.cold.ledger)):
        assert bool((ledger.live("origin") == 1).all())  # from a.pbs, as the same uid
        assert torch.equal(ledger.live("origin_uid"), source_ledger.live("uid"))
    assert sb.ledger.origins == ("a.pbs",)
    assert (sb.pending_token, sb.next_position, sb.step, sb.ledger.next_uid) == \
        (sa.pending_token, sa.next_position, sa.step, sa.ledger.next_uid)
    assert (b.sampler, b.cache_params, b.prompt_ids, b.generated_ids) == \
        (a.sampler, a.cache_params, a.prompt_ids, a.generated_ids)
    assert torch.equal(b.generator.get_state(), a.generator.get_state())
    view = sa.view()
    k, v = project(trained[0], source, target, view.k, view.v, view.position)
    assert torch.equal(sb.view().k, k) and torch.equal(sb.view().v, v)
    cold = sa.cold.view()
    ck, cv = project(trained[0], source, target, cold.k, cold.v, cold.position)
    assert torch.equal(sb.cold.view().k, ck) and torch.equal(sb.cold.view().v, cv)
    gen = generate(target, sb.view(), b.sampler, torch.Generator().manual_seed(0))
    assert_close(gen.logits, _oracle_logits(target, k, v, sb.pending_token, sb.next_position),
                 ORACLE, "the target's stage-1 logits over the projected cache")
    assert len(list(b.stream(10, ignore_eos=True))) == 10  # it continues: culls, recalls
    sb.check_valid()


def test_a_session_with_folded_slots_is_refused(models, trained):
    folded = _session(models[0], SamplerParams(greedy=True),
                      options.params(budget=20, sinks=2, recent=4, repair="fold", fold_min_cos=-1.0))
    assert folded.state.arena.folded
    with pytest.raises(UserError, match="folded slots"):
        apply_projector(trained[0], folded, models[1], "folded.pbs")


# --- the command line -------------------------------------------------------------------------

def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, long_text) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(long_text[:4000])
    return path


def test_transfer_train_and_apply_on_the_command_line(capsys, tmp_path, text_file, models):
    p = tmp_path / "p.safetensors"
    code, out, err = _cli(capsys, "transfer", "train", "--source", SOURCE, "--target", TARGET,
                          "--text", text_file, "--out", p, "--steps", 8, "--prefix", 16,
                          "--continuation", 8, "--json", "--device", "cpu")
    assert code == 0, err
    report = json.loads(out)
    assert report["out"] == str(p) and report["steps"] == 8 and report["kl_after"] >= 0
    assert report["fit"] and report["kl_fit"] < report["kl_before"]
    load_projector(p, *models)
    code, out, err = _cli(capsys, "transfer", "train", "--source", SOURCE, "--target", TARGET,
                          "--text", text_file, "--out", tmp_path / "q.safetensors", "--steps", 2,
                          "--device", "cpu")
    assert code == 0 and "held-out KL" in out and "(fit)" in out and "[step 2/2" in err
    code, out, err = _cli(capsys, "transfer", "train", "--source", SOURCE, "--target", TARGET,
                          "--text", text_file, "--out", tmp_path / "r.safetensors", "--steps", 2,
                          "--no-fit", "--device", "cpu")
    assert code == 0 and "held-out KL" in out and "(fit)" not in out
    a = _session(models[0], SamplerParams(greedy=True), CacheParams(budget=24))
    code, out, err = _cli(capsys, "transfer", "apply", save_session(a, tmp_path / "a.pbs"),
                          "--projector", p, "--source", SOURCE, "--target", TARGET,
                          "--out", tmp_path / "b.pbs", "--device", "cpu")
    assert code == 0, err
    b = load_session(models[1], tmp_path / "b.pbs")
    assert b.state.arena.n == a.state.arena.n == 24 and b.generated_ids == a.generated_ids
    assert b.state.ledger.origins == ("a.pbs",)
    assert len(list(b.stream(3, ignore_eos=True))) == 3


@pytest.fixture(scope="module")
def other_tokenizer_folder(tmp_path_factory, models) -> Path:
    """A model of tiny-random-wide's config as a local folder, with one extra token in its
    tokenizer."""
    folder = tmp_path_factory.mktemp("other-tokenizer")
    AutoModelForCausalLM.from_config(models[1].hf.config).save_pretrained(folder)
    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case, message", [
    ("wrong shape", "the projector maps from 2 layers x 2 KV heads x 16 dims, but "
     "'tiny-random-wide' has"),
    ("corrupt", "corrupt (sha256 mismatch)"),
    ("tokenizer", "do not share a tokenizer"),
    ("not a session", "not a readable session file"),
    ("no projector", "no projector file"),
])
def test_bad_input_to_transfer_apply_is_one_line_and_exit_2(
        capsys, tmp_path, projector_file, other_tokenizer_folder, models, case, message):
    a = save_session(_session(models[0], SamplerParams(greedy=True), CacheParams(), steps=2),
                     tmp_path / "a.pbs")
    source, target, projector, session = SOURCE, TARGET, projector_file, a
    if case == "wrong shape":
        source, target = TARGET, SOURCE
        session = save_session(_session(models[1], SamplerParams(greedy=True), CacheParams(),
                                        steps=2), tmp_path / "wide.pbs")
    elif case == "corrupt":
        projector = damaged(projector_file, tmp_path, "flipped", KIND_EDIT)
    elif case == "tokenizer":
        target = other_tokenizer_folder
    elif case == "not a session":
        session = tmp_path / "text.pbs"
        session.write_text("hello")
    else:
        projector = tmp_path / "missing.safetensors"
    out = tmp_path / "b.pbs"
    code, _, err = _cli(capsys, "transfer", "apply", session, "--projector", projector,
                        "--source", source, "--target", target, "--out", out, "--device", "cpu")
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "steps must be >= 0"),
    (["--holdout", "0"], "holdout"),
    (["--text", "/no/such/text.txt"], "no such file"),
    (["--out", "/no/such/folder/p.safetensors"], "no folder"),
    (["--target", "OTHER"], "do not share a tokenizer"),
])
def test_bad_input_to_transfer_train_is_one_line_and_exit_2(capsys, tmp_path, text_file,
                                                           other_tokenizer_folder, argv, message):
    out = tmp_path / "p.safetensors"
    base = {"--source": SOURCE, "--target": TARGET, "--text": str(text_file), "--out": str(out),
            "--steps": "1", "--device": "cpu"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    if base["--target"] == "OTHER":
        base["--target"] = str(other_tokenizer_folder)
    code, _, err = _cli(capsys, "transfer", "train", *[x for kv in base.items() for x in kv])
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_the_benchmark_function_learns_a_model_onto_itself_back(models, ids):
    report = transfer.projector_bench(models[0], ids, steps=40, seed=1)
    assert report["init"] == "perturbed" and report["source"] == report["target"] == SOURCE
    assert report["kl_after"] < 0.5 * report["kl_before"], report
