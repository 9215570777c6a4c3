"""Bring your own scorer: a dataclass in a file of the user's, named as path.py:ClassName."""
from __future__ import annotations

import hashlib
import json
import textwrap

import pytest
import torch

from positronic_brain import Session, options
from positronic_brain.bench import quality
from positronic_brain.capture import manifest_params
from positronic_brain.cli import main
from positronic_brain.scorers import make_scorer
from positronic_brain.types import CacheParams, SamplerParams, ScorerSpec, UserError

SCORER = textwrap.dedent('''
    """Keep the tokens whose keys are longest, with a bonus for recent ones."""
    from dataclasses import dataclass

    import torch

    from positronic_brain.types import ScoreOut


    @dataclass(frozen=True)
    class LongKeys:
        recency: float = 0.01  # its own field: --param recency=...
        skip_layers: float = 0.2  # a cache parameter's name: takes --skip-layers

        def score(self, view, attention: torch.Tensor) -> ScoreOut:
            first = round(self.skip_layers * view.knorm.shape[0])
            norm = view.knorm[first:].float().mean(dim=(0, 1))  # (n,)
            return ScoreOut(scores=norm + self.recency * view.position.float())
''')
PROMPT = "a scorer of my own decides what this cache forgets"


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(SCORER)
    return path


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["run", "--model", "tiny-random", "--prompt", PROMPT, "--greedy", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_scorer_from_a_file_runs_captures_and_replays(capsys, scorer_file, tmp_path):
    spec = f"{scorer_file}:LongKeys"
    rc, out, _ = _run(capsys, "--budget", "24", "--policy", spec, "--param", "recency=0.05",
                      "--max-new-tokens", "40", "--json", "--capture", str(tmp_path / "cap"))
    assert rc == 0
    res = json.loads(out)
    assert res["totals"]["culled"] > 0 and len(res["ledger"]) == 24
    (run,) = (tmp_path / "cap").iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    params = manifest_params(manifest)
    assert params.scorer == ScorerSpec(spec, {"recency": 0.05})
    assert manifest["scorer_sha256"] == hashlib.sha256(scorer_file.read_bytes()).hexdigest()
    assert main(["replay", str(run)]) == 0
    assert "all bit-exact" in capsys.readouterr().err
    # its own field changes what it keeps: another recency, other culls
    rc, other, _ = _run(capsys, "--budget", "24", "--policy", spec, "--param", "recency=-1",
                        "--max-new-tokens", "40", "--json")
    uids = [[r["uid"] for r in x["ledger"]] for x in (res, json.loads(other))]
    assert rc == 0 and uids[0] != uids[1]
    scorer_file.write_text(SCORER + "\n# edited\n")
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the file changed since the capture" in err and err.count("\n") == 1


def test_a_scorer_from_a_file_in_bench_quality(scorer_file, one_thread):
    spec = f"{scorer_file}:LongKeys"
    cfg = quality.QualityConfig.preset(True, model="tiny-random", policies=(spec, "h2o"),
                                       repairs=("none",), tokens=24)
    res = quality.run(cfg, "test")
    mine, h2o = ([r for r in res.runs if r.policy == p and not r.recall]
                 for p in (spec, "h2o"))
    assert len(mine) == len(h2o) == 1
    assert torch.isfinite(torch.tensor(mine[0].ppl)) and mine[0].ppl != h2o[0].ppl


BAD = {
    "raises": ("raise RuntimeError('boom')", "score raised RuntimeError: boom"),
    "shape": ("return ScoreOut(scores=view.position[:-1].float())", "scores has shape"),
    "nan": ("return ScoreOut(scores=view.position.float() * float('nan'))", "NaN or infinite"),
    "type": ("return view.position.float()", "not a ScoreOut"),
    "writes": ("view.position.add_(1); return ScoreOut(scores=view.position.float())",
               "it wrote to its input"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_scorer_is_one_line_and_the_session_is_intact(capsys, tmp_path, tiny_model,
                                                           tiny_policy, case):
    body, message = BAD[case]
    path = tmp_path / f"bad_{case}.py"
    path.write_text(textwrap.dedent(f'''
        from dataclasses import dataclass
        from positronic_brain.types import ScoreOut

        @dataclass(frozen=True)
        class Bad:
            def score(self, view, attention):
                {body}
    '''))
    spec = f"{path}:Bad"
    s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True),
                CacheParams(budget=24, scorer=spec))
    s.prime(tiny_policy.raw_prompt(PROMPT))
    before = {c: s.state.ledger.live(c).clone() for c in ("uid", "position")}
    k, n = s.state.arena.k.clone(), s.state.arena.n
    with pytest.raises(UserError, match=message) as e:
        s.step()
    assert spec in str(e.value) and "\n" not in str(e.value)
    s.state.check_valid()
    assert s.state.arena.n == n and torch.equal(s.state.arena.k, k) and s.state.step == 0
    assert all(torch.equal(s.state.ledger.live(c), t) for c, t in before.items())
    if case == "raises":  # and on the command line: one line, exit 2
        rc, _, err = _run(capsys, "--budget", "24", "--policy", spec)
        assert rc == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("spec, param, message", [
    ("{file}:Nope", None, "has no 'Nope'"),
    ("{dir}/missing.py:X", None, "no such file"),
    ("{file}:LongKeys", "bogus=1", "has no field 'bogus'"),
    ("{file}:LongKeys", "recency=abc", "--param recency: 'abc' is not a finite number"),
    ("{file}:LongKeys", "recency", "--param takes NAME=VALUE"),
    ("brightness", "recency=1", "scorer brightness has no field 'recency' (its fields: decay,"),
    ("json:dumps", None, "not a dataclass with a score"),
])
def test_bad_specs_are_one_line_and_exit_2(capsys, scorer_file, spec, param, message):
    spec = spec.format(file=scorer_file, dir=scorer_file.parent)
    rc, _, err = _run(capsys, "--budget", "24", "--policy", spec,
                      *(["--param", param] if param else []))
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_a_module_scorer_and_its_cache_fields(scorer_file, monkeypatch):
    """module:ClassName imports it; fields named as cache parameters take their values."""
    monkeypatch.syspath_prepend(str(scorer_file.parent))
    scorer = make_scorer(options.params(budget=24, policy="mine:LongKeys", skip_layers=0.5))
    assert (scorer.inner.recency, scorer.inner.skip_layers) == (0.01, 0.5)
