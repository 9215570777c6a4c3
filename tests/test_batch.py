"""A batch of rows (``batch``): one stage-1 forward a step for every row, each row's cache
its own; each row gives what its prompt gives alone."""
from __future__ import annotations

import gc
import json
import textwrap
import weakref

import pytest
import torch

from positronic_brain.batch import run_programs, run_rows, step_rows
from positronic_brain.cli import main
from positronic_brain.forward import decode, decode_rows
from positronic_brain.loop import Session, run
from positronic_brain.model import PackedWeight, for_rows
from positronic_brain.stages.generate import generate_rows
from positronic_brain.types import CacheParams, Positions, Recall, SamplerParams, Segment
from tests.tolerance import apart, nll_bound

GREEDY = SamplerParams(greedy=True)
# Sampled text varies; the tiny model's greedy text repeats one token, whose keys at nearby
# positions are so alike that fold's most alike slot is a tie float rounding decides.
SAMPLED = SamplerParams(temperature=1.0, seed=3)
TEXTS = ("the cache of each row is its own",
         "a longer prompt, so that the rows of one batch hold different numbers of slots "
         "from the first step on",
         "short",
         "a fourth prompt takes the place of the first row that finishes")

SCORER = textwrap.dedent('''
    from dataclasses import dataclass, field

    import torch

    from positronic_brain.types import ScoreOut


    @dataclass
    class Counting:
        """Keeps the longest keys; counts its own calls (state of its own, per row)."""
        calls: list = field(default_factory=list)

        def score(self, view, attention):
            self.calls.append(view.n)
            return ScoreOut(scores=view.knorm.mean(dim=(0, 1)) + 0.01 * len(self.calls))
''')

POLICIES = {
    "brightness": dict(budget=12, sinks=2, recent=2),
    "h2o+merge": dict(budget=12, sinks=2, recent=2, scorer="h2o", repair="merge"),
    "h2o+fold": dict(budget=12, sinks=2, recent=2, scorer="h2o", repair="fold"),
    "tova@head": dict(budget=10, sinks=1, recent=2, scorer="tova", allocation="head"),
    "recall": dict(budget=12, sinks=2, recent=2, recall=Recall(every=2, span=2)),
    "reindex": dict(budget=12, sinks=2, recent=2, scorer="h2o",
                    positions=Positions(reindex_at=40)),
}


def _prompts(policy, texts=TEXTS):
    return [policy.raw_prompt(t) for t in texts]


def _ints(ledger: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not isinstance(v, float)} for row in ledger]


def _floats(ledger: list[dict]) -> list[float]:
    return [v for row in ledger for v in row.values() if isinstance(v, float)]


def assert_same_run(model, solo: dict, row: dict) -> None:
    """A batch row's result against its prompt's solo run: the same tokens, edits, stop and
    ledger, its log-probabilities and scorer columns to float rounding (the row's products
    of several rows add in another order)."""
    assert row["generated_ids"] == solo["generated_ids"]
    assert row["stop_reason"] == solo["stop_reason"]
    edits = ("culled", "merged", "folded", "reindexed", "recalled", "cache_len", "token_id")
    assert ([{k: s[k] for k in edits} for s in row["steps"]]
            == [{k: s[k] for k in edits} for s in solo["steps"]])
    context = max(s["cache_len"] for s in solo["steps"]) + 1 if solo["steps"] else 1
    for a, b in zip(row["steps"], solo["steps"]):
        assert abs(a["logprob"] - b["logprob"]) <= nll_bound(model, context)
    assert _ints(row["ledger"]) == _ints(solo["ledger"])
    # a column sums what each step's attention adds: each step's rounding, carried
    tol = (len(solo["steps"]) + 1) * apart(model, 1.0, context, model.spec.n_layers - 1, 4)
    for a, b in zip(_floats(row["ledger"]), _floats(solo["ledger"])):
        assert abs(a - b) <= tol * max(1.0, abs(b))
    assert row["kv"] == solo["kv"] and row["pending_token"] == solo["pending_token"]


def solo_and_rows(model, policy, prompts, sampler, batch: int, **kw) -> list[tuple[dict, dict]]:
    """Each prompt's solo ``run`` beside its row of ``run_rows``, every run with ``kw``;
    every pair checked by ``assert_same_run``."""
    solo = [run(model, policy, p, sampler, ignore_eos=True, **kw) for p in prompts]
    rows = run_rows(model, policy, prompts, sampler, batch, ignore_eos=True, **kw)
    for a, b in zip(solo, rows):
        assert_same_run(model, a, b)
    return list(zip(solo, rows))


def test_for_rows_packs_float32_matrices(tiny_model):
    model = for_rows(tiny_model, 4)
    if tiny_model.device.type != "cpu":
        assert model is tiny_model
        return
    assert isinstance(model.lm_head, PackedWeight) and model.lm_head.plain is tiny_model.lm_head
    assert all(isinstance(w.qkv_w, PackedWeight) for w in model.layers)
    assert not isinstance(tiny_model.layers[0].qkv_w, PackedWeight)  # the model is unchanged


def test_decode_rows_equal_each_rows_decode(tiny_model, tiny_policy):
    """Rows of different lengths, one with a folded slot's log-mass, one with recall's
    query: each output within float rounding of the row's own decode."""
    sessions = []
    for text, cache in zip(TEXTS[:3], (dict(budget=12, sinks=2, recent=2, repair="fold",
                                            scorer="h2o"),
                                       dict(budget=16, sinks=2, recent=2,
                                            recall=Recall(every=1, span=1)),
                                       {})):
        s = Session(tiny_model, tiny_policy, GREEDY, CacheParams(**cache))
        s.prime(tiny_policy.raw_prompt(text * 2))
        for _ in range(6):
            s.step()
        sessions.append(s)
    views = [s.state.view() for s in sessions]
    assert views[0].log_mass is not None and views[1].cold is not None
    assert len({v.n for v in views}) == 3
    ids = torch.tensor([v.pending_token for v in views], device=tiny_model.device)
    pos = torch.tensor([v.next_position for v in views], device=tiny_model.device)
    outs = decode_rows(for_rows(tiny_model, 3), [(v.k, v.v, v.log_mass) for v in views], ids,
                       pos, [v.cold is not None for v in views])
    last = tiny_model.spec.n_layers - 1
    for b, (view, out) in enumerate(zip(views, outs)):
        ref = decode(tiny_model, view.k, view.v, ids[b:b + 1], pos[b:b + 1], want_attention=True,
                     past_log_mass=view.log_mass, want_query=view.cold is not None)
        n = view.n
        for name, depth, more in (("logits", None, 2), ("k", last, 2), ("v", last, 2),
                                  ("attention", last, 4)):
            want, got = getattr(ref, name), getattr(out, name)
            assert got.shape == want.shape, name
            tol = apart(tiny_model, float(want.abs().max()), n + 1, depth, more)
            assert (got - want).abs().max() <= tol, name
        assert (out.query is None) == (ref.query is None)
        if ref.query is not None:
            assert (out.query - ref.query).abs().max() <= apart(
                tiny_model, float(ref.query.abs().max()), n + 1, last, 3)
            assert (out.lse - ref.lse).abs().max() <= apart(tiny_model, 1.0, n + 1, last, 4)


def test_stage1_of_a_batch_writes_nothing(tiny_model, tiny_policy):
    sessions = [Session(tiny_model, tiny_policy, GREEDY, CacheParams(budget=12, sinks=2, recent=2))
                for _ in TEXTS[:2]]
    for s, p in zip(sessions, _prompts(tiny_policy, TEXTS[:2])):
        s.prime(p)
    before = [(s.state.arena.k.clone(), s.state.arena.k._version, s.state.ledger.uid.clone(),
               s.state.step, s.state.pending_token) for s in sessions]
    views = [s.state.view() for s in sessions]
    generate_rows(for_rows(tiny_model, 2), views, [GREEDY] * 2, [s.generator for s in sessions],
                  [None, None])
    for s, (k, version, uid, step, pending) in zip(sessions, before):
        assert torch.equal(s.state.arena.k, k) and s.state.arena.k._version == version
        assert torch.equal(s.state.ledger.uid, uid)
        assert (s.state.step, s.state.pending_token) == (step, pending)


@pytest.mark.parametrize("name", POLICIES)
def test_each_row_runs_as_its_prompt_alone(tiny_model, tiny_policy, name):
    """Three rows at a time over four prompts of different lengths: culls, merges, folds,
    per-head culls, recalls and re-indexes in each row as in its solo run."""
    pairs = solo_and_rows(tiny_model, tiny_policy, _prompts(tiny_policy), SAMPLED, 3,
                          max_new_tokens=30, cache_params=CacheParams(**POLICIES[name]))
    totals = [solo["totals"] for solo, _ in pairs]
    kinds = {"brightness": "culled", "h2o+merge": "merged", "h2o+fold": "folded",
             "tova@head": "culled", "recall": "recalled", "reindex": "reindexed"}
    assert sum(t[kinds[name]] for t in totals) > 0  # the edit this policy makes happens


def test_a_user_scorer_keeps_state_of_its_own_per_row(tiny_model, tiny_policy, tmp_path):
    path = tmp_path / "counting.py"
    path.write_text(SCORER)
    cache = CacheParams(budget=12, sinks=2, recent=2, scorer=f"{path}:Counting")
    pairs = solo_and_rows(tiny_model, tiny_policy, _prompts(tiny_policy, TEXTS[:3]), GREEDY, 3,
                          max_new_tokens=20, cache_params=cache)
    assert sum(solo["totals"]["culled"] for solo, _ in pairs) > 0


def test_rows_finish_on_their_own_and_others_take_their_place(tiny_model, tiny_policy):
    """No budget, a fixed arena: each row stops when its arena is full, at a step its prompt's
    length sets; the next prompt takes its place, and results come in input order."""
    prompts = _prompts(tiny_policy)
    lengths = [sum(len(s.ids) for s in p) for p in prompts]
    capacity = max(lengths) + 5
    order = []
    rows = run_rows(tiny_model, tiny_policy, prompts, GREEDY, 2, max_new_tokens=200,
                    ignore_eos=True, capacity=capacity,
                    on_result=lambda i, r, s: order.append(i))
    for p, row in zip(prompts, rows):
        solo = run(tiny_model, tiny_policy, p, GREEDY, max_new_tokens=200, ignore_eos=True,
                   capacity=capacity)
        assert solo["stop_reason"] == "capacity"
        assert len(solo["generated_ids"]) == capacity - sum(len(s.ids) for s in p) + 1
        assert_same_run(tiny_model, solo, row)
    assert sorted(order) == [0, 1, 2, 3] and order != [0, 1, 2, 3]  # the short row first


def test_a_batch_of_one_is_run_itself(tiny_model, tiny_policy):
    cache = CacheParams(budget=12, sinks=2, recent=2, scorer="h2o")
    prompts = _prompts(tiny_policy, TEXTS[:2])
    solo = [run(tiny_model, tiny_policy, p, GREEDY, max_new_tokens=16, ignore_eos=True,
                cache_params=cache) for p in prompts]
    rows = run_rows(tiny_model, tiny_policy, prompts, GREEDY, 1, max_new_tokens=16,
                    ignore_eos=True, cache_params=cache)
    for a, b in zip(solo, rows):  # the same steps: the same bits
        assert [s["logprob"] for s in a["steps"]] == [s["logprob"] for s in b["steps"]]
        assert a["ledger"] == b["ledger"]


def test_sampled_rows_keep_their_own_generators(tiny_model, tiny_policy):
    """Each row samples with its own generator, seeded as its solo run's; forced tokens
    (teacher forcing) go to their own rows."""
    sampler = SamplerParams(temperature=1.0, seed=7)
    prompts = _prompts(tiny_policy, TEXTS[:2])
    solo = [run(tiny_model, tiny_policy, p, sampler, max_new_tokens=12, ignore_eos=True)
            for p in prompts]
    rows = run_rows(tiny_model, tiny_policy, prompts, sampler, 2, max_new_tokens=12,
                    ignore_eos=True)
    for a, b in zip(solo, rows):
        assert a["generated_ids"] == b["generated_ids"]
    sessions = [Session(tiny_model, tiny_policy, GREEDY) for _ in prompts]
    for s, p in zip(sessions, prompts):
        s.prime(p)
    records = step_rows(for_rows(tiny_model, 2), sessions, [5, 9])
    assert [r.token_id for r in records] == [5, 9]
    assert [s.state.pending_token for s in sessions] == [5, 9]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["run", "--model", "tiny-random", "--greedy", "--ignore-eos", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_prompts_prints_each_prompts_run_in_input_order(capsys, tmp_path, tiny_model):
    if tiny_model.device.type != "cpu":
        pytest.skip("the CLI runs on the CPU here")
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    common = ("--max-new-tokens", "12", "--budget", "12", "--sinks", "2", "--recent", "2",
              "--policy", "h2o", "--json")
    rc, out, _ = _cli(capsys, "--prompts", str(path), "--batch", "3", *common)
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == len(TEXTS)
    for text, row in zip(TEXTS, rows):
        rc, out, _ = _cli(capsys, "--prompt", text, *common)
        assert rc == 0
        assert_same_run(tiny_model, json.loads(out), row)


@pytest.mark.parametrize("lines, flags, message", [
    ("one\n\nthree\n", (), "line 2 is empty"),
    ("", (), "no prompt in it"),
    ("one\n" + "word " * 5000 + "\n", (), "line 2: the prompt is"),
    ("one\n" + "word " * 20 + "\n", ("--capacity", "12"), "line 2: the prompt is"),
    ("one\n", ("--batch", "2", "--device-map", "balanced"), "it takes no --device-map"),
    ("one\n", ("--batch", "0"), "--batch must be >= 1, got 0"),
    ("one\n\nthree\n", ("--save", "CAP"), "line 2 is empty"),  # no folder made
])
def test_run_prompts_refuses_bad_input_before_any_work(capsys, tmp_path, lines, flags, message):
    path = tmp_path / "prompts.txt"
    path.write_text(lines)
    flags = tuple(str(tmp_path / f) if f == "CAP" else f for f in flags)
    rc, out, err = _cli(capsys, "--prompts", str(path), *flags)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1
    assert not (tmp_path / "CAP").exists()


def test_batch_takes_prompts(capsys):
    rc, out, err = _cli(capsys, "--prompt", "one", "--batch", "2")
    assert rc == 2 and out == "" and "--batch takes --prompts FILE" in err


def test_a_finished_rows_state_goes_before_the_next_row_is_made(tiny_model, tiny_policy,
                                                                 one_thread):
    """A batch lets its finished rows go before it makes the rows that take their places:
    a grid's copies of a long prime are then never held twice over."""
    sessions, alive = [], []

    def program():
        s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True))
        s.prime([Segment(tuple(tiny_policy.encode("one two three four")), "user")])
        sessions.append(weakref.ref(s))
        yield from s.steps(2, ignore_eos=True)

    def programs():
        for i in range(4):
            gc.collect()
            alive.append(sum(r() is not None for r in sessions))
            yield i, program()

    run_programs(tiny_model, programs(), 2)
    assert alive == [0, 1, 0, 1]
