"""The grid benchmarks on a Ray cluster (``--ray``): a cluster started here, on the loopback
interface only, measures small grids (passkey's trials, quality's runs with the oracle's
after the full cache's) and gives the rows of one process; a sweep stopped part-way goes
on from its journal."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from positronic_brain.bench import quality
from positronic_brain.bench.grid import Pool
from positronic_brain.cli import main
from tests.tolerance import nll_bound

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="the ray extra is not installed")
RAY = str(Path(sys.executable).parent / "ray")
# Ray puts a machine's own address for 127.0.0.1 unless told the cluster is this machine
# alone (read when ray is imported: before any test here imports it)
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled"}  # a cluster of this test alone, on loopback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster on 127.0.0.1 with two CPUs; stopped after the module."""
    port = _free_port()
    before = {k: os.environ.get(k) for k in LOOPBACK}
    os.environ.update(LOOPBACK)
    env = dict(os.environ)
    started = subprocess.run(
        [RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    if started.returncode != 0:
        pytest.fail(f"ray start failed: {started.stderr[-2000:]}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120,
                       check=False)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_quality_s_runs_on_the_cluster_give_the_inline_ones(cluster, tiny_model, tiny_policy):
    """The oracle's run on the cluster, after the full cache that records its oracle."""
    cfg = quality.QualityConfig(model="tiny-random", budgets=(24,), tokens=40)
    ids = tiny_policy.encode(quality.default_text())
    jobs = [quality.Job("reference", "full cache", cfg.cache(None, "none"), 40, 40,
                        record=True),
            quality.Job("grid", "h2o", cfg.cache(24, "h2o"), 40, 40),
            quality.Job("oracle", "oracle", cfg.cache(24, quality.ORACLE), 40, 40)]
    inline = [s for (s,) in quality.execute(cfg, jobs, ids, Pool(jobs=1))]
    there = [s for (s,) in quality.execute(cfg, jobs, ids, Pool(jobs=2, ray=cluster))]
    for a, b in zip(inline, there):
        assert a.totals.culled == b.totals.culled and len(a.nll) == len(b.nll) == 40
        # the session's threads inline, one in an actor
        assert max(abs(x - y) for x, y in zip(a.nll, b.nll)) <= nll_bound(tiny_model, 40)


def _answers(res: dict) -> list:
    return [(t["key"], t["answers"], t["hits"]) for t in res["trials"]]


def test_a_sweep_on_the_cluster_answers_as_one_process_and_resumes(cluster, capsys, tmp_path,
                                                                    one_thread):
    """The trials on two actors answer as in this process alone; stopped after one trial,
    the sweep goes on from its journal and measures the two left."""
    out = tmp_path / "pk"
    grid = ["bench", "passkey", "--model", "tiny-random", "--trials", "3", "--lengths",
            "300,400", "--budgets", "64", "--policies", "h2o", "--json"]
    assert main([*grid, "--jobs", "1"]) == 0
    here = json.loads(capsys.readouterr().out)
    argv = [*grid, "--out", str(out), "--ray", cluster]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert _answers(whole) == _answers(here) and whole["runs"] == here["runs"]
    journal = out / "items.jsonl"
    head, *items = journal.read_text().splitlines()
    journal.write_text("\n".join([head, items[0]]) + "\n")  # stopped after one trial
    assert main([*argv, "--resume"]) == 0
    again = json.loads(capsys.readouterr().out)
    kept = json.loads(items[0])["index"]  # the first to finish, on either actor
    assert again["trials"][kept] == whole["trials"][kept]  # its seconds too
    assert _answers(again) == _answers(whole) and again["runs"] == whole["runs"]
    assert len(journal.read_text().splitlines()) == 4


def test_no_cluster_at_the_address_is_one_line_and_exit_2(capsys):
    port = _free_port()
    assert main(["bench", "passkey", "--model", "tiny-random", "--trials", "1", "--lengths",
                 "300", "--budgets", "64", "--policies", "h2o", "--ray",
                 f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"--ray 127.0.0.1:{port}" in err and err.count("\n") == 1, err
