"""Prefill scores: stage 0's statistics of the prompt's own attention (what its last W
queries paid each token, what every later query did) equal Hugging Face's own attention
weights; each scorer seeds its ledger columns from them as its file says; with them off
every run is what it was; a captured run with them replays bit for bit."""
import dataclasses
import json
import math
import shutil

import pytest
import torch
from transformers import DynamicCache

from positronic_brain import options
from positronic_brain import forward as forward_module
from positronic_brain.bench import passkey
from positronic_brain.capture import CaptureTape, sha256
from positronic_brain.cli import main as cli
from positronic_brain.loop import Session, run
from positronic_brain.model import hf_forward, load_model
from positronic_brain.replay import replay
from positronic_brain.scorers import (SCORERS, columns_of, make_scorer, prefill_scorer,
                                      takes_prefill_scores)
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.apply import prime
from positronic_brain.types import CacheParams, SamplerParams, Segment, UserError
from tests.oracle import assert_close
from tests.tolerance import depth, forward_bound, products, step, sum_bound, unit

PROMPT = ("The quiet harbour town woke slowly; gulls argued over the fishing boats while "
          "the baker opened her shutters and the first ferry sounded its horn twice.")


def _prompt(policy) -> list[Segment]:
    return policy.raw_prompt(PROMPT)


@torch.no_grad()
def _score_sums(model, ids: list[int]) -> float:
    """A bound on every attention score's sum of |q_i k_i| over ``ids``, from HF's own layers:
    |q| |k| (RoPE keeps their norms), scaled."""
    hf, D = model.hf, model.spec.head_dim
    out = hf_forward(hf, torch.tensor([ids], device=model.device), output_hidden_states=True)
    top = 0.0
    for layer, h in zip(hf.model.layers, out.hidden_states):
        x = layer.input_layernorm(h[0])
        q, k = (f(x).view(len(ids), -1, D).norm(dim=-1).max()
                for f in (layer.self_attn.q_proj, layer.self_attn.k_proj))
        top = max(top, float(q * k) * D ** -0.5)
    return top


def _relative(model, ids: list[int], half: bool = False) -> float:
    """How far our prompt statistics over ``ids`` may lie from another computation of them
    (HF's attention weights summed), relative: their terms are positive. A weight
    exp(s - lse) is off by its score's error twice (in s and through lse); a score is
    reached through ``depth`` sums for q and again for k, then its own, and is at most
    ``_score_sums``; lse's normalising sum has T + 1 terms and rounds at its size (below
    2 + the score + log T), exp a step; then each statistic sums at most T weights.
    ``half`` (a bfloat16 model against the float32 one): each sum's result is rounded to
    bfloat16 and its weights were (a step and a half), and so are the probabilities."""
    T, scores = len(ids), _score_sums(model, ids)
    terms = max(model.spec.hidden, model.hf.config.intermediate_size, T + 1)
    chain = 2 * depth(model, model.spec.n_layers - 1) + 1
    score = products(torch.float32, terms, chain, scores)
    if half:
        score += chain * 1.5 * step(torch.bfloat16) * scores
    relative = (2 * score + sum_bound(torch.float32, T + 1) + sum_bound(torch.float32, T)
                + step(torch.float32) * (2 + scores + math.log(T)))
    return relative + unit(torch.bfloat16) if half else relative


def _within(got: torch.Tensor, want: torch.Tensor, relative: float) -> bool:
    """``got`` within ``relative`` of ``want``, entry by entry (0 exactly where it is 0)."""
    return bool(((got - want).abs() <= relative * want.abs()).all())


@torch.no_grad()
def _hf_attention(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own attention weights over ``ids`` (L, H, T, T) float32, from its eager
    attention, and its value norms (L, kv_heads, T)."""
    hf = model.hf
    hf.set_attn_implementation("eager")
    try:
        cache = DynamicCache()
        out = hf_forward(hf, torch.tensor([ids], device=model.device), cache,
                         output_attentions=True, use_cache=True)
    finally:
        hf.set_attn_implementation("sdpa")
    att = torch.stack(out.attentions)[:, 0].float()  # (L, H, T, T)
    vnorm = torch.stack([layer.values[0] for layer in cache.layers]).float().norm(dim=-1)
    return att, vnorm


@pytest.mark.parametrize("rows, built", [(128, False), (3, False), (128, True)])
def test_the_statistics_equal_hf_attention(monkeypatch, tiny_model, tiny_policy, rows, built):
    """The window mean and the totals, each query's own token left out, gathered over chunks
    that split the window, equal sums of HF's eager attention weights to rounding; so they do
    where a block of the queries' weights (``forward.LSE_ROWS``) is shorter than a chunk,
    and where the prefill builds its scores (as off the CPU) and sums their softmax."""
    monkeypatch.setattr(forward_module, "LSE_ROWS", rows)
    if built:
        monkeypatch.setattr(forward_module, "builds_scores", lambda *args, **kw: True)
    segs = _prompt(tiny_policy)
    ids = [i for s in segs for i in s.ids]
    T, W = len(ids) - 1, 12
    assert T > 3 * 7
    state, out = prime(tiny_model, segs, capacity=T + 1, chunk=7, prefill_window=W)
    stats = out.stats
    att, _ = _hf_attention(tiny_model, ids[:T])
    earlier = att.tril(-1)  # a query's weights on the tokens before it
    window = earlier[:, :, T - W:].sum(2) / W  # (L, H, T)
    total = earlier.sum(2)
    assert stats.window.device == stats.total.device == tiny_model.device
    assert stats.window_queries == W and stats.window.shape == (2, 4, T)
    assert torch.equal(stats.uid, state.view().uid)
    assert torch.equal(stats.queries, torch.arange(T - 1, -1, -1, device=tiny_model.device).float())
    relative = _relative(tiny_model, ids[:T])  # our forward's weights and HF's, summed
    assert _within(stats.window, window, relative + step(torch.float32))  # and / W
    assert _within(stats.total, total, relative)
    assert float(window[:, :, :T - W].sum(-1).min()) > 0.5  # the window looks back, not only at itself
    # a window longer than the prompt takes every query
    _, whole = prime(tiny_model, segs, capacity=T + 1, prefill_window=10 * T)
    assert whole.stats.window_queries == T
    assert _within(whole.stats.window, total / T, relative + 2 * step(torch.float32))


def test_a_prime_for_a_scorer_that_reads_only_the_window_gathers_no_total(tiny_model,
                                                                          tiny_policy):
    """Brightness reads only the window, so its prime gathers no total (a product over every
    prompt query and key less) and the window it gathers is the one gathered beside the
    total; H2O reads the total, so its prime gathers it, and seeding H2O from statistics
    without one is refused."""
    segs = _prompt(tiny_policy)
    _, both = prime(tiny_model, segs, capacity=200, chunk=7, prefill_window=9)
    _, alone = prime(tiny_model, segs, capacity=200, chunk=7, prefill_window=9,
                     prefill_total=False)
    with pytest.raises(UserError, match="total attention"):  # refused before the prefill
        prime(tiny_model, segs, capacity=200, prefill_window=9, prefill_total=False,
              scorer=make_scorer(CacheParams(scorer="h2o")))
    assert alone.stats.total is None and both.stats.total is not None
    # the window's weights made in other blocks of queries (off the CPU, by another forward)
    ids = [i for s in segs for i in s.ids][:-1]
    assert _within(alone.stats.window, both.stats.window, _relative(tiny_model, ids))
    if tiny_model.device.type == "cpu":  # both attend through ``cpu_attention``
        assert torch.equal(alone.logits, both.logits)
    else:  # chunks before the window attend fused, the others through built scores
        bound = forward_bound(tiny_model, len(ids), float(both.logits.abs().max()), True)
        assert_close(alone.logits, both.logits, bound, "logits")
    p = options.params(budget=24, prefill_scores=True, prefill_window=9)
    for scorer, total in (("brightness", False), ("h2o", True)):
        s = Session(tiny_model, tiny_policy, cache_params=dataclasses.replace(p, scorer=scorer))
        assert (s.prime(segs).total is not None) is total
    s = Session(tiny_model, tiny_policy, cache_params=dataclasses.replace(p, scorer="h2o"))
    s.state, _ = prime(tiny_model, segs, 200)
    with pytest.raises(UserError, match="total attention"):
        s.seed(alone.stats)


@pytest.mark.parametrize("widen", [True, False])
def test_bfloat16_statistics_are_the_float32_ones_to_its_rounding(monkeypatch, tiny_model,
                                                                  tiny_policy, widen):
    """bfloat16 statistics, from the fused kernel's log-sum-exps over widened products
    (``WIDEN``) or from built bfloat16 scores, window alone or with the total, are the
    float32 model's to bfloat16's rounding."""
    monkeypatch.setattr(forward_module, "WIDEN", widen)
    monkeypatch.setattr(forward_module, "WIDE_ROWS", 8)
    model = load_model("tiny-random", "bfloat16", str(tiny_model.device))
    segs = _prompt(tiny_policy)
    _, want = prime(tiny_model, segs, capacity=200, chunk=16, prefill_window=9)
    # every sum and weight rounded to bfloat16, whose statistics sum its rounded weights
    relative = _relative(tiny_model, [i for s in segs for i in s.ids][:-1], half=True)
    for total in (True, False):
        _, got = prime(model, segs, capacity=200, chunk=16, prefill_window=9,
                       prefill_total=total)
        assert _within(got.stats.window, want.stats.window, relative)
        if total:
            assert _within(got.stats.total, want.stats.total, relative)


def test_each_scorer_seeds_its_columns_as_its_file_says(tiny_model, tiny_policy):
    """Brightness: the window's W queries as W steps of its rule (value-weighted share) from
    0, at most the seed; H2O: attn_sum is the mean attention per later query; the others
    seed nothing. Hand-computed from HF's attention and value norms."""
    segs = _prompt(tiny_policy)
    ids = [i for s in segs for i in s.ids]
    T, W = len(ids) - 1, 8
    att, vnorm = _hf_attention(tiny_model, ids[:T])
    window = att.tril(-1)[:, :, T - W:].sum(2) / W  # (L, H, T)
    w = vnorm / vnorm.mean(-1, keepdim=True)  # (L, KVH, T): value norm / the mean live one
    share = T * (window.view(2, 2, 2, T) * w[:, :, None]).view(2, 4, T).mean((0, 1))
    p = options.params(budget=24, prefill_scores=True, prefill_window=W)
    s = Session(tiny_model, tiny_policy, cache_params=p)
    s.prime(segs)
    gain, decay = s.scorer.gain, s.scorer.decay
    b = (W * (gain * share - decay)).clamp(0, 255)  # from 0, at most the seed (255)
    assert float(b.min()) < float(b.max()) < 255  # told apart, none at the clamp
    # the window's weights, each value norm (V through the forward, then head_dim terms)
    # over their mean, the mean over layers and heads; then W (gain x share - decay)
    heads = tiny_model.spec.n_layers * tiny_model.spec.n_heads
    relative = _relative(tiny_model, ids[:T])
    norms = forward_bound(tiny_model, T, float(vnorm.max()), more=1) / float(vnorm.min())
    relative += 2 * norms + sum_bound(torch.float32, heads)
    top = W * gain * float(share.max())
    bound = relative * top + sum_bound(torch.float32, 2, top + W * decay)
    assert float((s.state.ledger.live("brightness") - b).abs().max()) <= bound
    assert list(s.state.ledger.columns) == ["brightness"]  # its own column only

    s = Session(tiny_model, tiny_policy, cache_params=dataclasses.replace(p, scorer="h2o"))
    s.prime(segs)
    mean = att.tril(-1).sum(2).mean((0, 1)) / torch.arange(T - 1, -1, -1, device=att.device
                                                           ).clamp(min=1)
    # the totals, their mean over layers and heads, and / queries
    relative = _relative(tiny_model, ids[:T]) + sum_bound(torch.float32, heads) + step(
        torch.float32)
    assert _within(s.state.ledger.live("attn_sum"), mean, relative)
    assert list(s.state.ledger.columns) == ["attn_sum"]
    for name in ("streaming", "tova", "knorm", "random"):
        s = Session(tiny_model, tiny_policy, cache_params=dataclasses.replace(p, scorer=name))
        assert s.prime(segs) is None  # takes none, so none are gathered
        assert not s.state.ledger.columns  # and keeps no column


def test_off_is_the_run_as_before(tiny_model, tiny_policy, one_thread):
    """Gathering the statistics leaves the prime's K/V and logits as they were: bit for bit
    on the CPU, where the fused kernel attends either way and they come from its
    log-sum-exps; elsewhere up to float rounding (with them the scores are built). With
    prefill scores off (or for a scorer that takes none) a run is bit for bit the run
    without the statistics."""
    segs = _prompt(tiny_policy)
    for all_logits in (True, False):
        a, out_a = prime(tiny_model, segs, capacity=200, chunk=5, all_logits=all_logits)
        b, out_b = prime(tiny_model, segs, capacity=200, chunk=5, all_logits=all_logits,
                         prefill_window=9)
        assert out_a.stats is None and out_b.stats is not None
        n = a.arena.n
        # elsewhere than the CPU the scores are built with the statistics: other orders
        bound = forward_bound(tiny_model, n, float(out_b.logits.abs().max()), True)
        assert_close(out_a.logits, out_b.logits, bound, "logits with and without the statistics")
        for x in ("k", "v", "knorm", "vnorm"):  # a norm: one more sum
            want = getattr(b.arena, x)[:, :, :n]
            more = int(x.endswith("norm"))
            bound = forward_bound(tiny_model, n, float(want.abs().max()), more=more)
            assert_close(getattr(a.arena, x)[:, :, :n], want, bound, x)
        if tiny_model.device.type in forward_module.APART:
            assert torch.equal(out_a.logits, out_b.logits)
            assert torch.equal(a.arena.k[:, :, :n], b.arena.k[:, :, :n])
    assert a.ledger.names == b.ledger.names
    for c in a.ledger.names:
        assert torch.equal(a.ledger.live(c), b.ledger.live(c))
    sampler = SamplerParams(temperature=0.9, seed=3)
    n_prompt = sum(len(s.ids) for s in segs)
    for scorer in ("brightness", "h2o", "tova"):
        params = CacheParams(budget=32, scorer=scorer)
        runs = {on: run(tiny_model, tiny_policy, segs, sampler, 12, True,
                        cache_params=options.cache_params({"prefill_scores": on}, params))
                for on in (False, True)}
        plain = Session(tiny_model, tiny_policy, sampler, params)
        plain.state, _ = prime(tiny_model, segs, n_prompt,  # stage 0 as before: no statistics
                               columns=columns_of(plain.scorer))
        records = [r.as_json() for r in plain.stream(12, ignore_eos=True)]
        culls = [r["culled"] for r in records]
        assert [s["culled"] for s in runs[False]["steps"]] == culls and culls[0]
        assert runs[False]["generated_ids"] == plain.generated_ids
        assert runs[False]["ledger"] == plain.state.ledger.rows()
        changed = [s["culled"] for s in runs[True]["steps"]] != culls
        assert changed == (scorer != "tova")  # TOVA takes no prefill scores


def test_a_token_the_window_attends_survives_the_first_cull(tiny_model, tiny_policy,
                                                            one_thread):
    """A constructed case: the prompt's window pays all its attention to a token that the
    first step's query alone culls. Seeded from that window, brightness keeps it through
    the cull down to the budget; unseeded, it goes."""
    segs = _prompt(tiny_policy)
    greedy = SamplerParams(greedy=True)
    params = options.params(budget=16, sinks=2, recent=4, prefill_scores=False)
    off = Session(tiny_model, tiny_policy, greedy, params)
    stats = off.prime(segs, stats=True)  # gathered, not seeded: prefill scores are off
    assert bool((off.state.ledger.live("brightness") == 255).all())
    on = Session(tiny_model, tiny_policy, greedy,
                 options.cache_params({"prefill_scores": True}, params),
                 state=prime(tiny_model, segs, off.state.arena.capacity)[0])
    culled = off.step().culled
    assert len(culled) > 5
    uid = culled[len(culled) // 2]  # a prompt token: at the prime, its slot is its uid
    window = torch.zeros_like(stats.window)
    window[:, :, uid] = 1.0
    on.seed(dataclasses.replace(stats, window=window))
    b = on.state.ledger.live("brightness")
    assert float(b[uid]) == 255.0 and not torch.cat((b[:uid], b[uid + 1:])).any()
    rec = on.step()
    assert len(rec.culled) == len(culled) and uid not in rec.culled
    assert uid in on.state.ledger.live("uid").tolist() and on.state.arena.n == params.budget


def test_smollm2_keeps_the_pass_key_its_question_attends(real_model, real_policy, one_thread):
    """Trial 1 of the quick pass-key run (key 45208 at depth 78% of ~1k tokens): at budget
    128 the first cull on one query's brightness loses the key; seeded with the prompt's
    window it is kept and the answer is right."""
    cfg = passkey.PasskeyConfig(lengths=(1024,), budgets=(128,), policies=("brightness",),
                                variants=({"prefill_scores": False}, {"prefill_scores": True}))
    trial = passkey.trials(0, 2, cfg.lengths)[1]
    assert trial.key == 45208
    row = passkey.run_trial(real_model, real_policy, cfg, trial, passkey.cells(cfg))
    assert row.hits == [True, False, True], row.answers


def captured_run(model, policy, folder, params, steps: int):
    """A run of ``steps`` steps under ``params`` captured into ``folder``, replayed: the
    capture's folder, once its replay is checked bit for bit."""
    tape = CaptureTape(folder, {"model": model.name, "dtype": "float32",
                                "device": str(model.device),
                                "fingerprint": model.fingerprint}, run_id="run")
    res = run(model, policy, _prompt(policy), SamplerParams(seed=5), steps, True,
              cache_params=params, tape=tape)
    assert res["steps"][0]["culled"]
    report = replay(tape.dir, model=model)
    assert report.ok and report.tolerance is None, [str(m) for m in report.mismatches[:5]]
    assert report.compared["s0_prime"] == 1 and report.steps == steps
    return tape.dir


def rewrite(folder, name: str, data: dict) -> None:
    """A capture's file ``name`` replaced by ``data``, its manifest's digest made to match."""
    torch.save(data, folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = sha256((folder / name).read_bytes())
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("scorer", ["brightness", "h2o", "kvzip"])
def test_a_captured_run_with_prefill_scores_replays_bit_for_bit(tiny_model, tiny_policy,
                                                                tmp_path, scorer, one_thread):
    """kvzip's capture also records its repeat instruction's ids, and replay copies again."""
    params = options.params(budget=32, policy=scorer, prefill_scores=True, prefill_window=6)
    folder = captured_run(tiny_model, tiny_policy, tmp_path, params, 6)
    # the seeded columns are part of what replay compares: a changed one is reported
    copy = shutil.copytree(folder, tmp_path / "copy")
    name = "000000_s0_prime.pt"
    data = torch.load(copy / name, weights_only=True)
    column = {"brightness": "brightness", "h2o": "attn_sum", "kvzip": "kvzip"}[scorer]
    assert data["outputs"]["patch"]["columns"][column] is not None
    assert data["inputs"]["prefill"]["prefill"]["window"] == 6
    assert (data["inputs"]["prefill_copy"] is None) is (scorer != "kvzip")
    data["outputs"]["patch"]["columns"][column][3] += 0.25
    rewrite(copy, name, data)
    bad = replay(copy, model=tiny_model, stage="s0_prime")
    assert [m.key for m in bad.mismatches] == [f"patch.columns.{column}"]


def test_a_copy_seeded_from_the_statistics_equals_its_own_prime(tiny_model, tiny_policy,
                                                                 tmp_path):
    """bench passkey's cells: a saved prime (gathered without a scorer) seeded per cell gives
    the columns a prime with the cell's parameters gives: bit for bit on the CPU; on CUDA the
    two primes' arenas differ in size, so their attention reductions may round differently
    (to rounding)."""
    segs = _prompt(tiny_policy)
    ref = Session(tiny_model, tiny_policy, cache_params=CacheParams(scorer="none"))
    stats = ref.prime(segs, stats=True)
    assert stats is not None and not ref.state.ledger.columns  # policy none keeps none
    save_session(ref, tmp_path / "p.pbs")
    for scorer in ("brightness", "h2o"):
        params = options.params(budget=32, policy=scorer, prefill_scores=True)
        own = Session(tiny_model, tiny_policy, cache_params=params)
        own.prime(segs)
        copy = Session(tiny_model, tiny_policy, cache_params=params,
                       state=load_session(tiny_model, tmp_path / "p.pbs").state)
        copy.seed(stats)
        # the statistics in other orders, their mean over layers and heads; brightness is
        # W (gain x share - decay) clamped, W gain x share at most the largest + W decay
        relative = _relative(tiny_model, [i for s in segs for i in s.ids][:-1]) + sum_bound(
            torch.float32, tiny_model.spec.n_layers * tiny_model.spec.n_heads)
        decay = params.prefill.window * getattr(own.scorer, "decay", 0.0)
        lit = float(own.state.ledger.live(next(iter(own.state.ledger.columns))).max()) + decay
        assert copy.state.ledger.names == own.state.ledger.names
        for c in own.state.ledger.columns:
            got, want = copy.state.ledger.live(c), own.state.ledger.live(c)
            if got.device.type == "cpu":
                assert torch.equal(got, want)
            elif c == "attn_sum":
                assert _within(got, want, relative + step(torch.float32))  # and / queries
            else:
                bound = relative * lit + sum_bound(torch.float32, 2, lit + decay)
                assert_close(got, want, bound, c)


def test_the_scorers_that_take_prefill_scores():
    assert {n for n, c in SCORERS.items() if hasattr(c, "prefill")} == {"brightness", "h2o",
                                                                        "kvzip"}


@pytest.mark.parametrize("scorer, default", [("brightness", True), ("h2o", False),
                                             ("kvzip", True), ("tova", False),
                                             ("streaming", False)])
def test_each_scorer_has_its_own_default_and_the_option_overrides_it(scorer, default):
    for given, want in ((None, default), (True, scorer in ("brightness", "h2o", "kvzip")),
                        (False, False)):
        params = options.params(budget=32, policy=scorer, prefill_scores=given)
        assert takes_prefill_scores(make_scorer(params), params) is want, (scorer, given)
        assert (prefill_scorer(make_scorer(params), params) is not None) is want


@pytest.mark.parametrize("argv, message", [
    (["--prefill-window", "-3"], "prefill window must be >= 1"),
    (["--prefill-window", "0"], "prefill window must be >= 1"),
    (["--prefill-window", "x"], "'x' is not an integer"),
])
def test_bad_prefill_options_are_one_line_and_exit_2(capsys, argv, message):
    assert cli(["run", "--prompt", "hi", "--model", "tiny-random", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    with pytest.raises(UserError, match="prefill window"):
        options.params(prefill_window=-1)
