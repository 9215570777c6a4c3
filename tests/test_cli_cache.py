"""`run` with a cache budget: the JSON steps report culls, repairs and re-indexes; bad cache
flags are one-line errors with exit code 2."""
import json

import pytest

from positronic_brain import options
from positronic_brain.cli import main
from positronic_brain.types import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(capsys, *argv):
    code = main(["run", "--model", "tiny-random", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_budget_run_past_the_models_positions(capsys):
    """600 tokens on a model with 512 positions: culls keep the cache at the budget, repairs
    merge pairs, re-indexing keeps every position below 512."""
    code, out, err = _run(capsys, "--prompt", "a prompt of some length", "--max-new-tokens", "600",
                          "--ignore-eos", "--json", "--budget", "32", "--sinks", "2",
                          "--recent", "8", "--policy", "h2o", "--repair", "merge")
    assert code == 0, err
    d = json.loads(out)
    steps = d["steps"]
    assert len(steps) == 600 and d["stop_reason"] == "max_new_tokens"
    assert max(s["cache_len"] for s in steps) == 32 == steps[-1]["cache_len"]
    assert sum(s["reindexed"] for s in steps) >= 1
    assert all(len(s["culled"]) + len(s["merged"]) <= 1 for s in steps[1:])
    repairs = [r for s in steps for r in s["merged"]]
    assert repairs and all(len(r["uids"]) == 2 and r["uid"] > max(r["uids"]) for r in repairs)
    positions = [r["position"] for r in d["ledger"]]
    assert positions == sorted(positions) and max(positions) < 512 and len(positions) == 32


def test_keep_positions_stops_at_the_models_positions(capsys):
    code, out, err = _run(capsys, "--prompt", "abc", "--max-new-tokens", "600", "--ignore-eos",
                          "--json", "--budget", "32", "--positions", "keep", "--policy", "tova")
    assert code == 0, err
    d = json.loads(out)
    assert d["stop_reason"] == "max_positions" and not any(s["reindexed"] for s in d["steps"])
    assert max(r["position"] for r in d["ledger"]) == 511


@pytest.mark.parametrize("argv, message", [
    (["--budget", "20"], "budget 20 is smaller than sinks + recent + 1 = 21"),
    (["--budget", "8", "--sinks", "4", "--recent", "4"], "smaller than sinks + recent + 1 = 9"),
    (["--budget", "0", "--sinks", "0", "--recent", "0"], "budget 0 is smaller"),
    (["--decay", "-1"], "decay must be >= 0"),
    (["--gain", "-0.5"], "gain must be >= 0"),
    (["--policy", "lru"], "unknown policy 'lru'"),
    (["--repair", "splice"], "argument --repair: invalid choice: 'splice'"),
    (["--positions", "shift"], "argument --positions: invalid choice: 'shift'"),
    (["--aggregate", "first-mean"], "argument --aggregate: invalid choice: 'first-mean'"),
    (["--signal", "keys"], "argument --signal: invalid choice: 'keys'"),
    (["--skip-layers", "1"], "skip layers must be a fraction in [0, 1), got 1.0"),
    (["--repair", "fold", "--fold-min-cos", "1.5"],
     "fold min cos must be a cosine in [-1, 1], got 1.5"),
    (["--repair", "fold", "--fold-min-cos", "nan"], "'nan' is not a finite number"),
    (["--fold-min-cos", "0.5"], "--fold-min-cos is for --repair fold"),
    (["--recall-every", "2"], "--recall-every is for --recall"),
    (["--budget", "64", "--allocation-heads", "h.json"],
     "--allocation-heads is for --allocation duo, not token"),
    (["--budget", "64", "--allocation", "head", "--allocation-floor", "0.3"],
     "--allocation-floor is for --allocation adaptive, not head"),
    (["--budget", "64", "--allocation", "adaptive", "--allocation-beta", "3"],
     "--allocation-beta is for --allocation pyramid, not adaptive"),
    (["--policy", "h2o", "--decay", "0.3"], "scorer h2o has no field 'decay' (its fields: "
     "aggregate)"),
    (["--param", "gain"], "--param takes NAME=VALUE, got 'gain'"),
    (["--param", "gain=x"], "--param gain: 'x' is not a finite number"),
    (["--sinks", "-1"], "sinks must be >= 0"),
    (["--budget", "64", "--policy", "none"], "policy none never culls"),
    (["--budget", "64", "--reindex-at", "64"], "reindex-at must be > the budget"),
    (["--budget", "64", "--reindex-at", "4096"], "past the model's 512 positions"),
    (["--budget", "64", "--capacity", "40"], "smaller than the budget"),
    (["--budget", "x"], "--budget"),
])
def test_bad_cache_flags_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = _run(capsys, "--prompt", "x", *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("positronic-brain: error: "), err
    assert message in err and "Traceback" not in err


def test_a_benchmarks_shared_options_keep_an_allocations_own_for_its_cells():
    """Not strict (``bench --params``, shared by cells of several allocations): an
    allocation's option under another kind is kept, unused, where strict refuses it."""
    given = {"budget": 64, "allocation": "head", "allocation_beta": 3.0, "allocation_floor": 0.5}
    p = options.cache_params(given, strict=False)
    assert (p.allocation.kind, p.allocation.beta, p.allocation.floor) == ("head", 3.0, 0.5)
    with pytest.raises(UserError, match="--allocation-beta is for --allocation pyramid, not head"):
        options.cache_params(given)
