"""KVzip: the prompt's reconstruction (read-only, chunked) gives the most attention any copy
query paid each prompt token, as Hugging Face's own attention weights do; the scorer seeds
its column from it, pooled, and keeps the most a later query pays; a run with it replays bit
for bit, and a capture made before it still does; a prompt that leaves too few positions
for the copy is refused in one line."""
import math
from types import SimpleNamespace

import pytest
import torch

from positronic_brain import options
from positronic_brain import forward as forward_module
from positronic_brain.bench.passkey import PasskeyConfig
from positronic_brain.bench.quality import QualityConfig
from positronic_brain.bench.ruler import RulerConfig
from positronic_brain.cli import main as cli
from positronic_brain.loop import COPY_INSTRUCTION, Session
from positronic_brain.replay import replay
from positronic_brain.scorers import CULLING, STREAMING, make_scorer, reads_copy
from positronic_brain.stages.apply import prefill as prefill_module
from positronic_brain.stages.apply import prime
from positronic_brain.types import CacheParams, PrefillStats, Segment, UserError
from tests.tolerance import sum_bound
from tests.test_prefill_scores import (_hf_attention, _prompt, _relative, _within,
                                       captured_run, rewrite)


@pytest.mark.parametrize("rows, built", [(128, False), (3, False), (128, True)])
def test_the_reconstruction_is_hf_attention_at_its_most(monkeypatch, tiny_model, tiny_policy,
                                                        rows, built):
    """Chunk by chunk (several here), the copy's queries after the pending token and the
    instruction, over the prompt's cached tokens: the largest of HF's eager attention weights
    over them, to rounding; through the log-sum-exp blocks (shorter than a chunk too) and
    through built scores, as off the CPU."""
    monkeypatch.setattr(forward_module, "LSE_ROWS", rows)
    monkeypatch.setattr(prefill_module, "COPY_CHUNK", 40)
    monkeypatch.setattr(prefill_module, "COPY_MIN", 40)
    if built:
        monkeypatch.setattr(forward_module, "builds_scores", lambda *args, **kw: True)
    segs = _prompt(tiny_policy)
    ids = [i for s in segs for i in s.ids]
    T, instruction = len(ids) - 1, tiny_policy.encode(COPY_INSTRUCTION)
    assert T > 3 * 40
    _, out = prime(tiny_model, segs, capacity=T + 1, chunk=7, prefill_window=4,
                   prefill_total=False, prefill_copy=tuple(instruction))
    want, lead = None, 1 + len(instruction)
    for lo in range(0, T, 40):
        att, _ = _hf_attention(tiny_model, ids[:T] + [ids[T]] + instruction + ids[lo:lo + 40])
        most = att[:, :, T + lead:, :T].amax(2)  # (L, H, T)
        want = most if want is None else torch.maximum(want, most)
    got = out.stats.copy
    assert got.shape == (2, 4, T) and got.device == tiny_model.device
    longest = T + lead + 40  # each weight as in a forward of that many tokens
    assert _within(got, want, _relative(tiny_model, ids[:T] + instruction + ids[:longest - T]))
    assert float(want.amax((0, 1)).min()) > 0  # every token read by some copy query


def test_no_reconstruction_unless_asked_and_a_scorer_that_reads_it_is_refused_without(
        tiny_model, tiny_policy):
    """A prime without the instruction runs none (its other statistics are the same bits),
    and seeding kvzip from statistics without one is refused in one line; a session with
    kvzip runs it, one without does not."""
    segs = _prompt(tiny_policy)
    instruction = tuple(tiny_policy.encode(COPY_INSTRUCTION))
    was, plain = prime(tiny_model, segs, capacity=200, prefill_window=6)
    now, both = prime(tiny_model, segs, capacity=200, prefill_window=6, prefill_copy=instruction)
    assert plain.stats.copy is None and both.stats.copy is not None
    n = was.arena.n  # read-only: the arena and the ledger as a prime without it leaves them
    assert n == now.arena.n and torch.equal(was.arena.k[:, :, :n], now.arena.k[:, :, :n])
    assert torch.equal(was.arena.v[:, :, :n], now.arena.v[:, :, :n])
    assert all(torch.equal(was.ledger.live(c), now.ledger.live(c)) for c in was.ledger.names)
    assert (now.next_position, now.pending_token) == (was.next_position, was.pending_token)
    assert torch.equal(plain.stats.window, both.stats.window)
    assert torch.equal(plain.stats.total, both.stats.total)
    assert torch.equal(plain.logits, both.logits)
    kvzip = make_scorer(CacheParams(scorer="kvzip"))
    assert reads_copy(kvzip) and not reads_copy(make_scorer(CacheParams()))
    with pytest.raises(UserError, match="reconstruction"):
        prime(tiny_model, segs, capacity=200, prefill_window=6, scorer=kvzip)
    s = Session(tiny_model, tiny_policy, cache_params=options.params(budget=24, policy="kvzip"))
    s.state, _ = prime(tiny_model, segs, 200)
    with pytest.raises(UserError, match="reconstruction"):
        s.seed(plain.stats)
    assert s.prime(segs).copy is not None  # a prompt longer than the budget: seeded
    s = Session(tiny_model, tiny_policy, cache_params=options.params(budget=24))
    assert s.prime(segs).copy is None


def _view(column: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(columns={"kvzip": column})  # all the scorer reads of a view


def test_the_seed_is_the_most_over_layers_and_heads_pooled_and_a_step_keeps_the_most():
    """Hand-worked: one token read hard in one head lights the ``pool`` around it; a step's
    query raises a token it pays more than its seed, and never lowers one."""
    n = 12
    copy = torch.zeros(2, 4, n)
    copy[1, 2, 5] = 0.9  # token 5, read hard by one head of the second layer
    copy[0, 0, 10] = 0.4
    copy[:, :, 0] = 0.1  # the first, a little by every head
    stats = PrefillStats(uid=torch.arange(n), window=torch.zeros(2, 4, n), window_queries=1,
                         total=None, queries=torch.zeros(n), copy=copy)
    seeded = make_scorer(options.params(policy="kvzip", pool=3)).prefill(
        _view(torch.zeros(n)), stats)
    want = torch.tensor([.1, .1, 0, 0, .9, .9, .9, 0, 0, .4, .4, .4])
    assert torch.equal(seeded.scores, want) and torch.equal(seeded.columns["kvzip"], want)
    alone = make_scorer(options.params(policy="kvzip", pool=1)).prefill(
        _view(torch.zeros(n)), stats)
    assert torch.equal(alone.scores, copy.amax((0, 1)))
    attention = torch.zeros(2, 9, n)
    attention[0, 3, 2] = 0.5  # more than token 2's seed (0)
    attention[1, 0, 5] = 0.2  # less than token 5's (0.9)
    out = make_scorer(options.params(policy="kvzip")).score(_view(want), attention)
    assert torch.equal(out.scores, torch.maximum(want, attention.amax((0, 1))))
    assert float(out.scores[2]) == 0.5 and float(out.scores[5]) == pytest.approx(0.9)


@pytest.mark.parametrize("pool", [0, 2, -1])
def test_a_bad_pool_is_one_line(pool):
    with pytest.raises(UserError, match="scorer kvzip: kvzip's pool must be an odd number"):
        make_scorer(options.params(policy="kvzip", pool=pool))


def test_a_captured_per_head_kvzip_run_replays_bit_for_bit(tiny_model, tiny_policy, tmp_path,
                                                            one_thread):
    """Per head too (whole tokens: test_prefill_scores' replay test): the seeded columns and
    every step are the same bits."""
    params = options.params(budget=32, policy="kvzip", allocation="head")
    folder = captured_run(tiny_model, tiny_policy, tmp_path, params, 6)
    data = torch.load(folder / "000000_s0_prime.pt", weights_only=True)
    assert list(data["inputs"]["prefill_copy"]) == tiny_policy.encode(COPY_INSTRUCTION)
    assert data["outputs"]["stats"]["copy"] is not None


def test_a_prompt_that_leaves_too_few_positions_for_the_copy_is_refused_before_any_work(
        tiny_model, tiny_policy, capsys):
    """The copy needs ``COPY_MIN`` positions after the prompt (or the prompt's own count): a
    prompt that leaves them is copied that many tokens a forward; one token more is refused in
    one line, by the prime, by a session (its parameters as they were) and by a benchmark
    before its first trial."""
    limit, least = tiny_model.spec.max_positions, prefill_module.COPY_MIN
    instruction = tuple(tiny_policy.encode(COPY_INSTRUCTION))
    n = limit - len(instruction) - 1 - least  # cached tokens that leave exactly the least
    _, out = prime(tiny_model, [Segment(tuple([65] * (n + 1)), "user")], capacity=limit,
                   prefill_window=4, prefill_copy=instruction)
    assert out.stats.copy.shape[-1] == n and float(out.stats.copy.amax((0, 1)).min()) > 0
    segs = [Segment(tuple([65] * (n + 2)), "user")]
    with pytest.raises(UserError, match=f"leave {least - 1} of the model's {limit} positions"):
        prime(tiny_model, segs, capacity=limit, prefill_window=4, prefill_copy=instruction)
    p = options.params(budget=24, policy="kvzip")
    s = Session(tiny_model, tiny_policy, cache_params=p)
    with pytest.raises(UserError, match="KVzip's reconstruction"):
        s.prime(segs)
    assert s.cache_params == p and s.state is None
    assert cli(["bench", "passkey", "--quick", "--model", "tiny-random", "--policies", "kvzip",
                "--out", "/nonexistent/never"]) == 2  # its prompts fill the positions
    err = capsys.readouterr().err
    assert "KVzip's reconstruction" in err and err.count("\n") == 1, err


def test_kvzip_is_a_ruler_default_and_out_of_the_streaming_grids():
    assert "kvzip" in CULLING and "kvzip" not in STREAMING
    assert set(STREAMING) == set(CULLING) - {"kvzip"}
    assert "kvzip" in RulerConfig().policies
    assert "kvzip" not in PasskeyConfig().policies and "kvzip" not in QualityConfig().policies


def test_a_capture_made_before_the_copy_replays(tiny_model, tiny_policy, tmp_path, one_thread):
    """Statistics captured without a ``copy`` field (before it was added) compare equal to a
    replay's, whose ``copy`` is None; one whose copy is there and differs does not."""
    params = options.params(budget=32, prefill_scores=True, prefill_window=6)
    folder = captured_run(tiny_model, tiny_policy, tmp_path, params, 3)
    name = "000000_s0_prime.pt"
    data = torch.load(folder / name, weights_only=True)
    assert data["outputs"]["stats"]["copy"] is None
    del data["outputs"]["stats"]["copy"], data["inputs"]["prefill_copy"]
    rewrite(folder, name, data)
    report = replay(folder, model=tiny_model)
    assert report.ok, [str(m) for m in report.mismatches[:5]]
    data["outputs"]["stats"]["copy"] = torch.zeros(1)
    rewrite(folder, name, data)
    bad = replay(folder, model=tiny_model, stage="s0_prime")
    assert [m.key for m in bad.mismatches] == ["stats.copy"]


@pytest.mark.parametrize("given_lse", [False, True])
def test_the_copy_peak_over_past_and_new_tokens_is_the_softmax_at_its_most(monkeypatch,
                                                                          given_lse):
    """``_received_lse``'s peak alone (KVzip's copy: the window's queries, no total), blocks
    shorter than the window: for every past slot and every new token, the most any window
    query's softmax paid it (a query's own token and later ones left out; a token no window
    query may read, 0), as float64 softmaxes give it, within float32's rounding of the
    scores the weights are exponentials of."""
    monkeypatch.setattr(forward_module, "LSE_ROWS", 4)
    KVH, g, D, T, n, start = 2, 2, 16, 11, 7, 3
    H = KVH * g
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(H, T, D, generator=gen), torch.randn(KVH, T, D, generator=gen)
    past = torch.randn(KVH, n, D, generator=gen)
    keys = torch.cat((past, k), 1).double().repeat_interleave(g, 0)  # (H, n + T, D)
    s = q.double() @ keys.transpose(1, 2)  # (H, T, n + T)
    s[:, :, n:] += torch.full((T, T), float("-inf")).triu(1).double()  # causal, own kept
    lse = s.logsumexp(-1)
    p = (s - lse[..., None]).exp()
    p[:, :, n:] = p[:, :, n:].tril(-1)  # a query's own token and later ones left out
    want = p[:, start:].amax(1)  # (H, n + T)
    got = torch.full((H, n + T), float("nan"))
    forward_module._received_lse(q, k, past.transpose(1, 2).contiguous(),
                                 lse.float() if given_lse else None, start, None, got,
                                 peak=True)
    # each score a float32 sum of D products, less its query's float32 log-sum-exp over
    # n + T of them: a weight's exponent off by a sum's bound over those terms, for the
    # score, the log-sum-exp and the rounding of their difference
    magnitude = float((q.abs().double() @ keys.abs().transpose(1, 2)).max())
    exponent = 3 * sum_bound(torch.float32, D + n + T, magnitude)
    assert torch.all((got.double() - want).abs() <= want * math.expm1(exponent))
    assert torch.equal(got[:, n + T - 1], torch.zeros(H))  # no later query reads the last
    assert bool((got[:, :n] > 0).all())
