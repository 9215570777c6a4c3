"""A grid benchmark's rows a step when ``--batch`` is not given: measured once on the
machine (``bench.batch_size``), kept, and said in the report."""
import json
from types import SimpleNamespace

import pytest

from positronic_brain.bench import batch_size
from positronic_brain.bench.grid import Pool
from positronic_brain.bench.quality import QualityConfig
from positronic_brain.bench.result import KVCost
from positronic_brain.cli import main
from positronic_brain.stages.apply.recall import COLD_ROWS, cold_most


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSITRONIC_BRAIN_CACHE", str(tmp_path))
    return tmp_path / "batch.json"


@pytest.mark.usefixtures("one_thread")
def test_the_fewest_rows_near_the_most_tokens_a_second_are_chosen(tiny_model, monkeypatch):
    """Every B of 1, 2, 4, ... 32 is timed (a dip at 2 rows does not stop the search) and
    the fewest rows within ``GAIN`` of the best rate win."""
    rates = {1: 10.0, 2: 9.0, 4: 30.0, 8: 33.0, 16: 34.0, 32: 35.0}
    seen = []

    def timed(model, rows, states):
        seen.append(rows)
        assert len(states) >= rows and len({id(s) for s in states}) == len(states)
        return rates[rows]

    monkeypatch.setattr(batch_size, "_tokens_s", timed)
    choice = batch_size.measure(tiny_model, 1)
    assert seen == list(batch_size.BATCHES) == [1, 2, 4, 8, 16, 32]
    assert choice.batch == 8 and choice.tokens_s == rates  # 33 * 1.1 >= 35 > 30 * 1.1
    assert "8 rows a step, chosen by measurement" in choice.describe()
    rates.update({8: 31.0})
    assert batch_size.measure(tiny_model, 1).batch == 16


@pytest.mark.usefixtures("one_thread")
def test_a_real_measurement_gives_a_rate_for_every_batch(tiny_model):
    choice = batch_size.measure(tiny_model, 1)
    assert set(choice.tokens_s) == set(batch_size.BATCHES)
    assert all(t > 0 for t in choice.tokens_s.values())
    assert choice.batch in batch_size.BATCHES
    assert choice.tokens_s[choice.batch] * batch_size.GAIN >= max(choice.tokens_s.values())
    assert choice.context == min(batch_size.CONTEXT, tiny_model.spec.max_positions // 2)
    assert not tiny_model.rows  # the packed copy let go


def test_the_choice_is_measured_once_and_kept(tiny_model, cache, monkeypatch):
    calls = []

    def measure(model, threads):
        calls.append(threads)
        return batch_size.Choice(4 * threads, {1: 1.0, 4 * threads: 3.0})

    monkeypatch.setattr(batch_size, "measure", measure)
    first = batch_size.chosen(tiny_model, 1)
    assert (first.batch, first.kept, calls) == (4, False, [1])
    again = batch_size.chosen(tiny_model, 1)
    assert (again.batch, again.tokens_s, again.kept, calls) == (4, first.tokens_s, True, [1])
    assert batch_size.chosen(tiny_model, 2).batch == 8 and calls == [1, 2]  # its own key
    kept = json.loads(cache.read_text())
    assert sorted(kept) == sorted(batch_size.key(tiny_model, t) for t in (1, 2))
    assert "tiny-random" in batch_size.key(tiny_model, 1)
    k = batch_size.key(tiny_model, 1)
    damaged = ["not json", "[1, 2]", json.dumps({k: {"batch": "x"}}),
               json.dumps({k: {"batch": 4, "tokens_s": [1, 2]}}),
               json.dumps({k: {"batch": 0, "tokens_s": {"0": 1.0}}}),
               json.dumps({k: {"batch": 8, "tokens_s": {"1": 1.0}}})]
    for text in damaged:
        cache.write_text(text)
        assert batch_size.chosen(tiny_model, 1).batch == 4  # measured again, written over
        assert json.loads(cache.read_text())[k]["batch"] == 4
    assert calls == [1, 2] + [1] * len(damaged)


def test_a_cache_folder_that_takes_nothing_measures_each_time(tiny_model, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv("POSITRONIC_BRAIN_CACHE", str(tmp_path / "file"))
    (tmp_path / "file").write_text("a file where the folder would be")
    monkeypatch.setattr(batch_size, "measure",
                        lambda model, threads: batch_size.Choice(2, {1: 1.0, 2: 1.9}))
    assert batch_size.chosen(tiny_model, 1).batch == 2
    assert batch_size.chosen(tiny_model, 1).kept is False


def test_the_rows_fit_in_half_the_free_memory(tiny_model, monkeypatch):
    """The rows a batch may step together, the grid's largest first, fill at most half the
    free memory of each process."""
    monkeypatch.setattr(batch_size, "chosen",
                        lambda model, threads: batch_size.Choice(32, {1: 1.0, 32: 9.0}))
    cfg = QualityConfig(model="tiny-random", budgets=(24,))
    monkeypatch.setattr(batch_size, "available_bytes", lambda: 10 * 2**30)
    gib = [2**30] * 40
    assert batch_size.resolve(cfg, tiny_model, 1, gib, 1)[0].batch == 5
    got, line = batch_size.resolve(cfg, tiny_model, 1, gib, 2)
    assert got.batch == 2 and "2 rows, as many as 50% of the free memory" in line
    assert "(1,024 MiB at most)" in line
    # two large rows (3 GiB and 1 GiB) leave 1 GiB for small ones of 256 MiB: 4 of them
    mixed = [2**28] * 30 + [3 * 2**30, 2**30]
    assert batch_size.resolve(cfg, tiny_model, 1, mixed, 1)[0].batch == 6
    assert batch_size.resolve(cfg, tiny_model, 1, [2**20] * 40, 2)[0].batch == 32  # room for all
    few, line = batch_size.resolve(cfg, tiny_model, 1, [2**20] * 4, 2)  # fewer rows than B
    assert few.batch == 32 and "free memory" not in line
    assert batch_size.resolve(cfg, tiny_model, 1, [2**40], 2)[0].batch == 1  # one at least
    monkeypatch.setattr(batch_size, "available_bytes", lambda: None)
    assert batch_size.resolve(cfg, tiny_model, 1, [2**40], 2)[0].batch == 32
    monkeypatch.undo()  # the real one reads /proc/meminfo
    free = batch_size.available_bytes()
    assert free is None or free > 0


def test_a_grid_with_recall_counts_its_rows_cold_store(tiny_model, monkeypatch):
    """A row's bytes in the memory cap: its K/V at its longest, and where it recalls, the
    cold store its culled tokens go to at the most it grows to (``cold_most``: 1.5 x the
    row's tokens at most, its first allocation at least)."""
    seen = []
    monkeypatch.setattr(batch_size, "resolve",
                        lambda cfg, model, threads, row_bytes, processes: seen.append(row_bytes))
    pair = (kv := KVCost.of(tiny_model)).heads * kv.pair_bytes
    Pool(jobs=2).batch(None, tiny_model, 4, [(4000, False), (4000, True), (100, True)])
    assert seen == [[4000 * pair, (4000 + 5998) * pair, (100 + COLD_ROWS) * pair]]
    assert cold_most(4000) == 5998 and cold_most(100) == COLD_ROWS


def test_a_given_batch_is_kept_and_none_is_chosen(tiny_model, monkeypatch):
    monkeypatch.setattr(batch_size, "chosen",
                        lambda model, threads: batch_size.Choice(16, {1: 1.0, 16: 9.0}))
    given = SimpleNamespace(batch=3)
    assert batch_size.resolve(given, tiny_model, 1) == (given, "")
    cfg, line = batch_size.resolve(QualityConfig(model="tiny-random", budgets=(24,)),
                                   tiny_model, 1)
    assert cfg.batch == 16 and line.startswith("16 rows a step, chosen by measurement")


@pytest.mark.usefixtures("one_thread")
def test_a_grid_without_batch_runs_the_chosen_rows_and_says_so(tmp_path, cache, capsys,
                                                              monkeypatch):
    monkeypatch.setattr(batch_size, "measure",
                        lambda model, threads: batch_size.Choice(2, {1: 1.0, 2: 1.9}))
    out = tmp_path / "q"
    assert main(["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "24",
                 "--policies", "h2o", "--repairs", "none", "--windows", "1", "--tokens", "16",
                 "--jobs", "1", "--json", "--out", str(out)]) == 0
    capsys.readouterr()
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["batch"] == 2 and res["batch_choice"].startswith("2 rows a step")
    report = (out / "report.md").read_text()
    assert "2 rows a step, chosen by measurement" in report
    assert " --batch 2` (this run took" in report  # the rerun steps the same rows
    monkeypatch.setattr(batch_size, "measure", None)  # run again: the kept choice
    assert main(["bench", "quality", "--quick", "--model", "tiny-random", "--budgets", "24",
                 "--policies", "h2o", "--repairs", "none", "--windows", "1", "--tokens", "16",
                 "--jobs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["batch"] == 2


class _Stop(Exception):
    """Ends a run at its batch's choice."""


@pytest.mark.parametrize("argv, want", [
    (["passkey", "--quick", "--policies", "h2o", "--budgets", "24"],
     [False, False, True, False]),  # the full cache, then plain, with recall, flipped
    (["ruler", "--model", "smollm2", "--tasks", "niah_single_1", "--lengths", "1024",
      "--samples", "1", "--policies", "h2o", "--ratios", "0.5", "--protocols", "compress",
      "--recall", "h2o"],
     [False, False, True]),
    (["quality", "--quick", "--budgets", "24", "--policies", "h2o", "--recall", "h2o",
      "--repairs", "none", "--windows", "2", "--tokens", "16", "--long", "0"],
     [False] * 4 + [True] * 2 + [False] * 2),  # a row a window: the full cache, h2o, h2o
    # with recall, the oracle
])
def test_each_grid_says_which_of_its_rows_recall(monkeypatch, request, argv, want):
    """The rows each grid hands the memory cap (a batch's rows: a trial's or a sample's
    cells, the quality grid's windows of each cell), a cold store only where a cell
    recalls."""
    seen = []

    def batch(self, cfg, model, items, rows):
        seen.extend(rows)
        raise _Stop

    monkeypatch.setattr(Pool, "batch", batch)
    if "smollm2" in argv:  # RULER's tasks do not fit the tiny model's positions
        request.getfixturevalue("real_model")  # skipped where its weights are not
    with pytest.raises(_Stop):
        main(["bench", *argv, "--jobs", "1"] + ["--model", "tiny-random"] * ("--model" not in argv))
    assert [cold for _, cold in seen] == want and len({t for t, _ in seen}) == 1
