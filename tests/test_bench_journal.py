"""A grid benchmark's journal (``bench.result.Journal``): what ``--resume`` keeps of an
interrupted run, and what it refuses."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from positronic_brain.bench import grid
from positronic_brain.bench.grid import Pool
from positronic_brain.bench.result import Journal, Result
from positronic_brain.cli import main
from positronic_brain.types import UserError

HEAD = {"benchmark": "demo", "config": {"seed": 0, "lengths": [1024, 2048]}}


@dataclass(frozen=True)
class Row:
    index: int
    hits: list


def measure(journal, todo, seen):
    """``todo``'s rows through the grid's pool here, noting each item measured."""
    def here(item, tick):
        seen.append(item)
        tick()
        return Row(item, [item % 2 == 0])
    return Pool(1, journal).rows("demo", todo, 1, here, None, None, None)


def test_a_resumed_run_measures_only_what_the_journal_lacks(tmp_path):
    path, seen = tmp_path / "items.jsonl", []
    first = measure(Journal(path, HEAD, False, Row), [0, 1, 2], seen)
    assert seen == [0, 1, 2] and [r.index for r in first] == [0, 1, 2]
    # the run stopped while writing item 2: its line is cut short
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1] + [lines[-1][:10]]) + "\n")
    seen.clear()
    again = measure(Journal(path, HEAD, True, Row), [0, 1, 2], seen)
    assert seen == [2] and again == first
    seen.clear()
    assert measure(Journal(path, HEAD, True, Row), [0, 1, 2], seen) == first and seen == []


def test_a_resumed_run_s_time_counts_its_earlier_parts(tmp_path):
    """Each line holds the seconds the run had taken at its item's finish, its earlier parts
    included: a resumed run starts from the last kept item's, and its report says how much
    of its time came before the --resume. A journal whose kept lines do not say (written
    before they did) leaves the earlier parts unknown, and the report says so."""
    path = tmp_path / "items.jsonl"
    measure(Journal(path, HEAD, False, Row), [0, 1], [])
    lines = path.read_text().splitlines()
    first = [json.loads(line)["seconds"] for line in lines[1:]]
    assert 0 <= first[0] <= first[1]
    earlier = first[1] + 3600.0  # as if the first part had taken an hour
    path.write_text("\n".join(lines[:2] + [json.dumps({**json.loads(lines[2]),
                                                       "seconds": earlier})]) + "\n")
    journal = Journal(path, HEAD, True, Row)
    assert journal.earlier == earlier
    measure(journal, [0, 1, 2], [])
    assert json.loads(path.read_text().splitlines()[-1])["seconds"] >= earlier
    res = Result(benchmark="demo", command="positronic-brain bench demo", model="m",
                 quick=False, machine=None, elapsed_s=earlier + 60, earlier_s=earlier)
    assert "(this run took 61 min, 60 min of it before it was resumed with --resume)" \
        in res.regenerate(quick_version=False)
    old = [json.dumps({k: v for k, v in json.loads(line).items() if k != "seconds"})
           for line in path.read_text().splitlines()[1:]]
    path.write_text("\n".join([lines[0]] + old) + "\n")
    assert Journal(path, HEAD, True, Row).earlier is None
    res.earlier_s, res.elapsed_s = None, 90.0
    assert "(its last part took 90 s, resumed with --resume from a journal that does not " \
        "record the parts before)" in res.regenerate(quick_version=False)


def test_without_resume_a_run_starts_a_new_journal(tmp_path):
    path, seen = tmp_path / "items.jsonl", []
    measure(Journal(path, HEAD, False, Row), [0, 1], seen)
    measure(Journal(path, HEAD, False, Row), [0, 1], seen)
    assert seen == [0, 1, 0, 1] and len(path.read_text().splitlines()) == 3


def test_another_run_s_journal_is_refused_in_one_line(tmp_path):
    path = tmp_path / "items.jsonl"
    measure(Journal(path, HEAD, False, Row), [0], [])
    other = {**HEAD, "config": {**HEAD["config"], "seed": 1}}
    with pytest.raises(UserError, match="another run's") as e:
        Journal(path, other, True, Row)
    assert "\n" not in str(e.value)
    assert len(path.read_text().splitlines()) == 2  # nothing lost


def test_a_ruler_journal_from_before_its_rows_changed_is_refused(tmp_path, monkeypatch,
                                                                   capsys):
    """``bench ruler``'s journal names what its rows measure (``ruler.MEASURES``): one
    written before a recall cell stepped the question, the same config otherwise, is
    another run's, refused in one line with exit 2 and left as it was."""
    from positronic_brain.bench import flags, ruler
    heads = []

    class Seen(Journal):
        def __init__(self, path, head, resume, row):
            heads.append(head)
            super().__init__(path, head, resume, row)

    def stop(*_a, **_k):
        raise UserError("stopped")

    monkeypatch.setattr(ruler, "run", stop)
    argv = ["bench", "ruler", "--model", "tiny-random", "--quick", "--recall",
            "--out", str(tmp_path)]
    monkeypatch.setattr(flags, "Journal", Seen)
    assert main(argv) == 2 and heads[0]["measures"] == ruler.MEASURES
    monkeypatch.setattr(flags, "Journal", Journal)
    old = {k: v for k, v in heads[0].items() if k != "measures"}
    path = tmp_path / "items.jsonl"
    Journal(path, old, False, Row).add(0, Row(0, [True]))
    before = path.read_text()
    capsys.readouterr()
    assert main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is another run's" in err and "\n" not in err and path.read_text() == before


@pytest.mark.parametrize("kind", ["passkey", "ruler", "quality"])
def test_resume_without_out_is_one_line_and_exit_2(kind, capsys):
    assert main(["bench", kind, "--quick", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--resume needs --out (the folder of the run to go on with)")
    assert "\n" not in err


def test_a_run_that_measures_nothing_leaves_the_journal_it_found(tmp_path):
    """A journal is written anew from the first item a run finishes: a run that stops
    before (a bad option, an error in its first item) loses nothing."""
    path = tmp_path / "items.jsonl"
    measure(Journal(path, HEAD, False, Row), [0, 1], [])
    before = path.read_text()

    def fail(item, tick):
        raise RuntimeError("stopped")

    for resume in (False, True):  # resumed, items 0 and 1 are kept and item 2 fails
        with pytest.raises(RuntimeError):
            Pool(1, Journal(path, HEAD, resume, Row)).rows("demo", [0, 1, 2], 1, fail, None,
                                                            None, None)
        assert path.read_text() == before


def test_workers_take_the_largest_items_first_and_the_rows_keep_their_order(monkeypatch):
    """A grid of items of unequal work (pass-key trials, RULER samples of several lengths)
    is handed to the workers largest first, so that no long item starts last; the rows come
    back in the items' order all the same."""
    sent = []

    def processes(jobs, items, there, cfg, cells, finished):
        sent.extend(i for i, _ in items)
        for i, item in reversed(items):  # in any order
            finished(i, there(item))

    monkeypatch.setattr(grid, "_on_processes", processes)
    todo = [300, 100, 400, 200]
    rows = Pool(2).rows("demo", todo, 1, None, lambda x: -x, None, None, size=lambda x: x)
    assert sent == [2, 0, 3, 1] and rows == [-300, -100, -400, -200]
    sent.clear()
    assert Pool(2).rows("demo", todo, 1, None, lambda x: -x, None, None) == rows
    assert sent == [0, 1, 2, 3]  # without sizes: as they came


SLEEPER = """
import os, time
from types import SimpleNamespace
from positronic_brain.bench import grid

def there(item):
    # one write a line: with PYTHONUNBUFFERED, print's two writes (the pid, then the newline)
    # from the two workers may interleave on the shared pipe
    os.write(1, f"{os.getpid()}\\n".encode())
    time.sleep(600)

def cells(cfg):
    return None

if __name__ == "__main__":
    cfg = SimpleNamespace(model="tiny-random", dtype="float32", device="cpu")
    grid._on_processes(2, [(0, 0), (1, 1)], there, cfg, cells, lambda i, row: None)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_run_s_worker_processes_end_with_it(tmp_path):
    """A grid run killed by SIGTERM, which it cannot clean up after, leaves no worker
    measuring on for no one: each sees it was handed to another parent and ends itself
    (``grid.end_with_parent``); before, they went on until their items were done."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(run.stdout.readline()) for _ in range(2)]  # both measuring
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        run.kill()
