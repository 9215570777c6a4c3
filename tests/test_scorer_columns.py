"""A scorer's own ledger columns: declared by the scorer, kept per token hot and cold, merged,
recalled, saved, captured and replayed, with nothing in the package written for it (the
``Ema`` of tests/scorers/ema.py, the README's example)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from positronic_brain import options
from positronic_brain import Session
from positronic_brain.cli import main
from positronic_brain.scorers import columns_of
from positronic_brain.session_io import load_session, save_session
from positronic_brain.types import CacheParams, Column, SamplerParams, UserError
from tests import tolerance

EMA = f"{Path(__file__).parent / 'scorers' / 'ema.py'}:Ema"
PROMPT = "a scorer with a column of its own keeps an average of what each token was paid"


def _run(capsys, *argv) -> dict:
    rc = main(["run", "--model", "tiny-random", "--prompt", PROMPT, "--greedy", "--json",
               "--policy", EMA, "--max-new-tokens", "30", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("options", [("--budget", "24"), ("--budget", "24", "--recall"),
                                     ("--budget", "24", "--repair", "merge")],
                         ids=["budget", "recall", "merge"])
def test_its_column_runs_captures_and_replays(capsys, tmp_path, options):
    res = _run(capsys, *options, "--capture", str(tmp_path / "cap"))
    totals = res["totals"]
    assert totals["culled"] + totals["merged"] > 0
    assert "--recall" not in options or totals["recalled"] > 0
    assert "merge" not in options or totals["merged"] > 0
    rows = res["ledger"]
    assert len(rows) == 24 and all(isinstance(r["ema"], float) and r["ema"] >= 0 for r in rows)
    assert "brightness" not in rows[0] and "attn_sum" not in rows[0]  # only the scorer's own
    assert len({r["ema"] for r in rows}) > 1
    (run,) = (tmp_path / "cap").iterdir()
    assert main(["replay", str(run)]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    s2 = torch.load(run / "000005_s2_score.pt", weights_only=True)
    assert s2["outputs"]["out"]["columns"]["ema"].shape == (24,)


def _session(tiny_model, tiny_policy, **cache) -> Session:
    s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True),
                options.params(policy=EMA, **cache))
    s.prime(tiny_policy.raw_prompt(PROMPT))
    return s


def test_its_column_survives_recall_and_save_load(tiny_model, tiny_policy, tmp_path):
    s = _session(tiny_model, tiny_policy, budget=24, recall=True, recall_every=1,
                 recall_margin=0.0)
    assert list(s.state.ledger.columns) == ["ema"] == list(s.state.cold.ledger.columns)
    recalled = 0
    for _ in range(40):
        cold = s.state.cold.ledger
        went = dict(zip(cold.live("uid").tolist(), cold.live("ema").tolist()))
        rec = s.step()
        m = s.state.ledger
        now = dict(zip(m.live("uid").tolist(), m.live("ema").tolist()))
        for uid in rec.recalled:  # back with the value it went cold with (Column.recall keep)
            assert now[uid] == went[uid]
            recalled += 1
    assert recalled > 0
    path = save_session(s, tmp_path / "ema.pbs")
    loaded = load_session(tiny_model, path)
    for a, b in ((s.state.ledger, loaded.state.ledger),
                 (s.state.cold.ledger, loaded.state.cold.ledger)):
        assert a.specs == b.specs == {"ema": Column(birth=0.0)}
        assert torch.equal(a.live("ema"), b.live("ema"))
    assert [s.step().token_id for _ in range(6)] == [loaded.step().token_id for _ in range(6)]
    assert torch.equal(s.state.ledger.live("ema"), loaded.state.ledger.live("ema"))


def test_a_session_continued_by_another_scorer_gains_its_columns(tiny_model, tiny_policy,
                                                                  tmp_path):
    """A session made with the Ema scorer, continued with H2O: its rows get attn_sum at its
    birth value (0) and keep their ema (carried, no longer updated); saved and loaded alike."""
    s = _session(tiny_model, tiny_policy, budget=24)
    for _ in range(5):
        s.step()
    before = s.state.ledger.live("ema").clone()
    h2o = Session(tiny_model, tiny_policy, SamplerParams(greedy=True),
                  CacheParams(scorer="h2o", budget=24), state=s.state)
    m = h2o.state.ledger
    assert list(m.columns) == ["ema", "attn_sum"] and bool((m.live("attn_sum") == 0).all())
    h2o.step()
    assert bool((m.live("attn_sum") > 0).any())
    loaded = load_session(tiny_model, save_session(h2o, tmp_path / "two.pbs"))
    assert sorted(loaded.state.ledger.specs) == ["attn_sum", "ema"]
    assert bool((before >= 0).all())


@pytest.mark.parametrize("columns, message", [
    ({"uid": 0.0}, "is not an identifier or is the ledger's own"),
    ({"bad name": 0.0}, "is not an identifier"),
    ({"x": "high"}, "a number or a tuple"),
    ({"x": (1.0, 2.0)}, "one number or one per source"),
    ({"x": float("nan")}, "must be finite"),
    (["x"], "must be a dict"),
])
def test_bad_column_declarations_are_one_line(columns, message):
    scorer = type("S", (), {"columns": columns})()
    with pytest.raises(UserError, match=message) as e:
        columns_of(scorer)
    assert "\n" not in str(e.value)


def test_a_column_out_of_its_range_is_refused_before_anything_changes(tiny_model, tiny_policy,
                                                                      tmp_path):
    path = tmp_path / "neg.py"
    path.write_text(
        "from dataclasses import dataclass\n"
        "from typing import ClassVar\n"
        "from positronic_brain.types import Column, ScoreOut\n"
        "@dataclass(frozen=True)\n"
        "class Neg:\n"
        "    columns: ClassVar[dict] = {'seen': Column(birth=0.0, low=0.0)}\n"
        "    def score(self, view, attention):\n"
        "        s = view.columns['seen'] - 1.0\n"
        "        return ScoreOut(scores=s, columns={'seen': s})\n")
    s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True),
                CacheParams(scorer=f"{path}:Neg", budget=24))
    s.prime(tiny_policy.raw_prompt(PROMPT))
    before = s.state.ledger.live("seen").clone()
    with pytest.raises(UserError, match="its column seen .* must be float32 within") as e:
        s.step()
    assert "\n" not in str(e.value)
    assert torch.equal(s.state.ledger.live("seen"), before) and s.state.step == 0


@pytest.mark.parametrize("name", ["format5-brightness-recall", "format5-h2o-merge"])
def test_a_format_5_session_loads_with_both_old_columns_and_continues_bit_exact(
        tiny_model, name):
    """Files of format 5 (tests/data, saved by the version before scorer columns, with what
    it went on to give) held brightness and attn_sum in every ledger: they load with both,
    declared as the built-ins declare them, and continue as that version did."""
    if tiny_model.device.type != "cpu":
        pytest.skip("saved on the CPU: the generator's state carries over on the CPU only")
    data = Path(__file__).parent / "data"
    want = json.loads((data / f"{name}.json").read_text())
    assert want["format"] == "positronic-brain-session/5"
    s = load_session(tiny_model, data / f"{name}.pbs")
    assert sorted(s.state.ledger.specs) == ["attn_sum", "brightness"]
    assert s.state.ledger.specs["brightness"].high == 255.0
    assert [s.step().token_id for _ in range(10)] == want["next_ids"]
    for ledger, cols in ((s.state.ledger, want["ledger"]),
                         (s.state.cold and s.state.cold.ledger, want["cold"])):
        if cols is not None:  # the same tokens, each row matched by its uid (slot order
            # is free: that version filled a cull's hole with the last slot, this one
            # appends the new token there)
            uids = ledger.live("uid")
            assert sorted(uids.tolist()) == sorted(cols["uid"])
            mine, theirs = uids.argsort(), torch.tensor(cols["uid"]).argsort()
            for c in set(cols) - {"uid"}:  # saved on one CPU: another's kernels (AVX-512 or
                # AVX2, the thread count) add the attention in another order
                saved = torch.tensor(cols[c], dtype=torch.float32)[theirs]
                bound = tolerance.apart(tiny_model, float(saved.abs().max()), ledger.n)
                torch.testing.assert_close(ledger.live(c)[mine].float(), saved, rtol=0,
                                           atol=bound)
