"""Recall in a per-head cache (``stages.apply.cold_heads``): each (layer, KV head) sends what
it culls to a cold store of its own and swaps it back by its own signals. Stage 1 equals the
per-head oracle after swaps and re-indexes; every entry keeps its token's key wherever it
goes; every (layer, head, slot), hot and cold, is accounted for; the choice per head is the
whole-token rule's over that head's tokens; a failure part-way changes nothing; captures
replay and sessions go on bit for bit."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from positronic_brain.cli import main
from positronic_brain.forward import apply_rope, rerotation
from positronic_brain.loop import Session
from positronic_brain.options import params
from positronic_brain.sampler import make_generator
from positronic_brain.session_io import load_session, save_session
from positronic_brain.stages.decide import recall as decide_recall
from positronic_brain.stages.decide import recalled
from positronic_brain.stages.generate import generate
from positronic_brain.scorers import make_scorer
from positronic_brain.stages.score import recall_layers, recall_query, score
from positronic_brain.types import SamplerParams, Segment
from tests.oracle import assert_close, per_head_state_logits
from tests.test_heads import fail_at_append
from tests.tolerance import ORACLE, rotation_bound

TEXT = "the quick brown fox jumps over the lazy dog and runs far away " * 4


def _session(model, tokens, **cache) -> Session:
    cache = {"budget": 24, "sinks": 2, "recent": 4, "policy": "tova", "allocation": "head",
             "recall": True, "recall_every": 2, "cold_capacity": 30} | cache
    s = Session(model, tokens, SamplerParams(greedy=True), params(**cache))
    s.prime([Segment(tuple(tokens.encode(TEXT))[:40], "user")])
    return s


def _entries(state) -> dict:
    """(layer, KV head, uid) -> the key that (layer, head) holds of it, hot or cold, with
    its position."""
    out = {}
    for side in ("hot", "cold"):
        if side == "hot":
            a, h, m = state.arena, state.heads, state.ledger
        else:
            a, h, m = state.cold.arena, state.cold.heads, state.cold.ledger
        for layer, head, slot in h.live(a.n).nonzero().tolist():
            row = int(h.row[layer, head, slot])
            key = (layer, head, int(m.uid[row]))
            assert key not in out, f"{key} held twice"
            out[key] = (a.k[layer, head, slot].clone(), int(m.position[row]))
    return out


@pytest.mark.parametrize("kind,policy", [("head", "tova"), ("head", "h2o"),
                                         ("adaptive", "brightness"), ("pyramid", "h2o")])
def test_stage1_equals_the_per_head_oracle_after_swaps_and_reindexes(tiny_model, tiny_policy,
                                                                   one_thread, kind, policy):
    """... with every head at its budget, no head holding more cold entries than the
    capacity, and each entry keeping its token's key wherever it goes (moved bit for bit;
    re-rotated by a re-index)."""
    s = _session(tiny_model, tiny_policy, allocation=kind, policy=policy, reindex_at=60)
    recalls = reindexed = 0
    seen = {}
    for _ in range(50):
        gen = generate(tiny_model, s.state.view(), s.sampler, make_generator(0, "cpu"))
        assert_close(gen.logits, per_head_state_logits(tiny_model, s.state), ORACLE,
                     f"{kind} step {s.state.step}")
        rec = s.step()
        s.state.check_valid()
        recalls += len(rec.recalled)
        reindexed += rec.reindexed
        assert int(s.state.cold.heads.n.max()) <= 30
        now = _entries(s.state)
        for key, (k, pos) in now.items():
            if key not in seen:
                continue
            k0, pos0 = seen[key]
            if pos == pos0:
                assert torch.equal(k, k0), f"{key} changed its key"
            else:  # re-indexed: the same key rotated by the move
                cos, sin = rerotation(tiny_model, torch.tensor([pos0]), torch.tensor([pos]))
                moved = apply_rope(k0.float().view(1, -1), cos, sin).view(-1)
                assert_close(k, moved, rotation_bound(k0, 3, 1), f"{key} re-rotated")
        seen = {**seen, **now}
    assert recalls > 0 and reindexed > 0
    if kind == "head":
        assert bool((s.state.heads.n == 24).all())


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["head", "pyramid", "adaptive"]),
       policy=st.sampled_from(["random", "tova", "h2o", "brightness"]),
       budget=st.integers(8, 20), capacity=st.integers(1, 12), most=st.integers(1, 4),
       every=st.integers(1, 3), steps=st.integers(1, 25), reindex=st.booleans())
@example(kind="pyramid", policy="random", budget=14, capacity=4, most=1, every=2, steps=9,
         reindex=True)  # a re-index keeps a token another head holds hot, earlier or not
def test_per_head_recall_never_loses_an_entry_a_head_still_holds(
        tiny_model, tiny_policy, kind, policy, budget, capacity, most, every, steps, reindex):
    """After every step ``check_valid`` holds (every (layer, head, slot), hot and cold, is a
    live row of its ledger, no head holds a token both ways, every uid held or dropped once),
    and an entry a head held before the step, hot or cold, is still that head's, hot or
    cold, unless its cold store let it go: full (the head's earliest in the text go), or at
    a re-index, which keeps the latest of the tokens held cold alone, as many as the
    positions leave room for. A token another head holds hot costs no position there, so
    it stays, earlier or not."""
    torch.set_num_threads(1)
    s = _session(tiny_model, tiny_policy, allocation=kind, policy=policy, budget=budget,
                 sinks=1, recent=2, cold_capacity=capacity, recall_max=most,
                 recall_every=every, reindex_at=max(budget, 40) + 8 if reindex else None)
    for _ in range(steps):
        before = _entries(s.state)
        rec = s.step()
        s.state.check_valid()
        after, ch = _entries(s.state), s.state.cold.heads
        hot = set(s.state.ledger.live("uid").tolist())
        for (layer, head, uid) in before.keys() - after.keys():
            assert rec.reindexed or int(ch.n[layer, head]) == capacity, \
                (layer, head, uid, "let go, neither full nor at a re-index")
            kept = [before[k][1] for k in after.keys() & before.keys() if k[:2] == (layer, head)
                    and _is_cold(s.state, *k) and not (rec.reindexed and k[2] in hot)]
            assert all(before[(layer, head, uid)][1] < p for p in kept), \
                (layer, head, uid, "let go before a later one")


def _is_cold(state, layer: int, head: int, uid: int) -> bool:
    h, m = state.cold.heads, state.cold.ledger
    rows = h.row[layer, head, :int(h.n[layer, head])]
    return bool((m.uid[rows] == uid).any())


def test_each_head_recalls_what_the_whole_token_rule_would_from_its_own_tokens(
        tiny_model, tiny_policy, one_thread):
    """Stage 3's per-head picks, all heads at once, against ``decide.recalled`` run on each
    head alone (its hot and cold slots as a whole-token view's), on scan and other steps."""
    s = _session(tiny_model, tiny_policy, policy="h2o")
    checked = 0
    p = s.cache_params
    for _ in range(30):
        view = s.state.view()
        gen = generate(tiny_model, view, s.sampler, make_generator(0, "cpu"))
        scores = score(view, gen.attention, make_scorer(p), recall_query(view, gen, p))
        if scores.hot_signal is None:  # an empty cold store
            s.step()
            continue
        layers = torch.tensor(recall_layers(p, view.heads.n.shape[0]))
        room = p.recall.swaps
        picks, _ = decide_recall._head_picks(view, scores, p, layers, room)
        h, ch = view.heads, view.cold.heads
        for i, layer in enumerate(layers.tolist()):
            for head in range(h.n.shape[1]):
                n, c = int(h.n[layer, head]), int(ch.n[layer, head])
                if not c:
                    continue
                one = SimpleNamespace(
                    position=view.position[h.row[layer, head, :n]], next_position=view.next_position,
                    cold=SimpleNamespace(n=c, position=view.cold.position[ch.row[layer, head, :c]]))
                sig = SimpleNamespace(
                    hot_signal=scores.hot_signal[i, head, :n],
                    cold_signal=None if scores.cold_signal is None
                    else scores.cold_signal[i, head, :c])
                want = [r for r, _ in recalled(one, sig, p, room)]
                got = [x for x in picks[i, head].tolist() if x >= 0]
                assert got == want, (layer, head, s.state.step)
                checked += 1
        s.step()
    assert checked > 30


def test_a_failure_part_way_changes_nothing(tiny_model, tiny_policy, one_thread, monkeypatch):
    """A step that fails after its swaps and cold writes puts the hot and cold ledgers and
    maps back; the K/V are re-prefilled; the run goes on."""
    s = _session(tiny_model, tiny_policy)
    while not s.state.cold.n:
        s.step()
    for _ in range(3):
        s.step()
    state = s.state
    cold = state.cold
    before = ({c: state.ledger.live(c).clone() for c in state.ledger.names},
              {c: cold.ledger.live(c).clone() for c in cold.ledger.names},
              state.heads.row.clone(), cold.heads.row[:, :, :cold.arena.n].clone(),
              cold.heads.n.clone(), state.step, state.ledger.dropped)
    fail_at_append(monkeypatch, s)
    hot, cold_cols, row, cold_row, cold_n, step, dropped = before
    assert all(torch.equal(state.ledger.live(c), x) for c, x in hot.items())
    assert all(torch.equal(state.cold.ledger.live(c), x) for c, x in cold_cols.items())
    assert torch.equal(state.heads.row, row) and torch.equal(state.cold.heads.n, cold_n)
    assert torch.equal(state.cold.heads.row[:, :, :state.cold.arena.n], cold_row)
    assert state.step == step and state.ledger.dropped == dropped
    state.check_valid()
    s.step()
    state.check_valid()


def test_a_session_saves_loads_and_goes_on(tiny_model, tiny_policy, one_thread, tmp_path):
    s = _session(tiny_model, tiny_policy, policy="h2o", reindex_at=60)
    records = [s.step() for _ in range(25)]
    assert any(r.recalled for r in records) and any(r.reindexed for r in records)
    loaded = load_session(tiny_model, save_session(s, tmp_path / "h.pbs"))
    assert loaded.state.cold.heads is not None
    ours = [loaded.step() for _ in range(15)]
    theirs = [s.step() for _ in range(15)]
    assert [(r.token_id, r.logprob, r.recalled) for r in ours] == \
        [(r.token_id, r.logprob, r.recalled) for r in theirs]
    a, b = loaded.state, s.state
    assert a.ledger.rows() == b.ledger.rows() and a.cold.ledger.rows() == b.cold.ledger.rows()
    assert torch.equal(a.cold.heads.n, b.cold.heads.n)
    assert torch.equal(a.cold.view().k, b.cold.view().k)


def test_a_per_head_recall_run_captures_replays_and_forks(tmp_path, capsys, one_thread):
    """``run --allocation head --recall`` captured at level full replays bit for bit; a fork
    of it goes on per head with recall and replays too; a whole-token recall run forked to a
    per-head allocation gives every head its cold store."""
    run = ["run", "--model", "tiny-random", "--prompt", TEXT, "--max-new-tokens", "30",
           "--ignore-eos", "--budget", "16", "--sinks", "1", "--recent", "2",
           "--recall", "--recall-every", "2", "--reindex-at", "60", "--json",
           "--compile", "none"]
    assert main([*run, "--allocation", "head", "--policy", "h2o",
                 "--capture", str(tmp_path / "c"), "--capture-level", "full"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert sum(len(s["recalled"]) for s in res["steps"]) and any(s["reindexed"] for s in res["steps"])
    assert main(["replay", res["capture"]]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    assert main(["fork", res["capture"], "--step", "12", "--policy", "tova", "--json",
                 "--capture", str(tmp_path / "f")]) == 0
    fk = json.loads(capsys.readouterr().out)
    assert main(["replay", fk["capture"]]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    assert main([*run, "--capture", str(tmp_path / "w")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["fork", whole["capture"], "--step", "12", "--allocation", "head", "--json",
                 "--capture", str(tmp_path / "g")]) == 0
    fk = json.loads(capsys.readouterr().out)
    assert sum(len(s["recalled"]) for s in fk["steps"])
    assert main(["replay", fk["capture"]]) == 0
    assert "all bit-exact" in capsys.readouterr().err


def test_turns_take_no_recall(capsys):
    assert main(["run", "--model", "tiny-random", "--prompt", "hi", "--budget", "64",
                 "--allocation", "turns", "--recall"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allocation turns" in err[0], err


def _taken_over(model, tokens, state, **cache) -> Session:
    cache = {"budget": 24, "sinks": 2, "recent": 4, "policy": "tova", "allocation": "head",
             "recall": True, "recall_every": 2} | cache
    return Session(model, tokens, SamplerParams(greedy=True), params(**cache), state=state)


@pytest.mark.parametrize("case", ["loaded full", "whole-token full", "new column"])
def test_a_cold_store_goes_on_from_what_a_state_brings(tiny_model, tiny_policy, one_thread,
                                                      tmp_path, case):
    """A per-head cold store whose ledger is exactly full (a loaded session's; a whole-token
    store at its capacity taken on per head), or that gains a scorer column (tova's run
    taken on by h2o), goes on: its entry order grows with its ledger, the new column holds a
    value a head. A head's cold slots grow past the capacity by one step's culls at most."""
    if case == "loaded full":
        s = _session(tiny_model, tiny_policy, cold_capacity=29)
        s.step()
        s = load_session(tiny_model, save_session(s, tmp_path / "s.pbs"))
        assert s.state.cold.n == s.state.cold.ledger.uid.shape[0] == 29
    elif case == "whole-token full":
        w = _session(tiny_model, tiny_policy, allocation="token", cold_capacity=8)
        for _ in range(12):
            w.step()
        assert w.state.cold.n == 8
        s = _taken_over(tiny_model, tiny_policy, w.state, cold_capacity=8)
    else:
        t = _session(tiny_model, tiny_policy)
        for _ in range(10):
            t.step()
        s = _taken_over(tiny_model, tiny_policy, t.state, policy="h2o", cold_capacity=30)
        assert s.state.cold.ledger.columns["attn_sum"].dim() == 3
    records = [s.step() for _ in range(30)]
    s.state.check_valid()
    assert any(r.recalled for r in records)
    cold = s.state.cold
    assert cold.arena.capacity <= cold.capacity + int(s.state.heads.n.max())


def test_each_heads_best_are_a_stable_sorts_first():
    """``_best_rows`` (the anchors of every head at once, without sorting whole rows) is
    ``argsort(descending, stable)[..., :k]``: ties in index order, -inf last."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        m = int(torch.randint(5, 300, (1,), generator=g))
        k = int(torch.randint(1, m, (1,), generator=g))
        x = torch.randint(0, 6, (3, 4, m), generator=g).float()  # many ties
        x[torch.rand(x.shape, generator=g) < 0.3] = -math.inf
        want = torch.argsort(x, dim=-1, descending=True, stable=True)[..., :k]
        assert torch.equal(decide_recall._best_rows(x, k), want), (m, k)
