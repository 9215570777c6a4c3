"""The HTML page of a captured run (``inspect --html``) and of two (``compare --html``): its
data equal the live ledger at every step, and a real browser draws it without an error."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch

from positronic_brain import options
from positronic_brain import page
from positronic_brain.capture import CaptureRun, CaptureTape
from positronic_brain.cli import main
from positronic_brain.loop import Session
from positronic_brain.types import SOURCES, CacheParams, SamplerParams, Segment

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
PROMPT = "a page shows which words the cache kept, which it let go and which came back"


class LedgerTape(CaptureTape):
    """A capture that also keeps the live ledger, every column, as each step begins."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ledgers: dict[int, dict] = {}

    def begin(self, state, generator) -> None:
        m = state.ledger
        order = torch.argsort(m.live("position"))
        self.ledgers[state.step + 1] = {c: m.live(c)[order].tolist() for c in m.COLUMNS}
        super().begin(state, generator)


def page_data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    blob = re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S)
    assert not re.search(r"[<>&]", blob.group(1)), "markup characters in the data"
    return json.loads(blob.group(1))


EDITS = {"recall": {"recall": True}, "fold": {"repair": "fold", "fold_min_cos": -1.0}}


@pytest.fixture(params=sorted(EDITS))
def edited_run(request, tiny_model, tiny_policy, tmp_path, one_thread):
    """A captured run that culls and recalls (or folds), with the ledger at each step."""
    tape = LedgerTape(tmp_path / "caps", {"model": tiny_model.name, "dtype": "float32",
                                          "device": str(tiny_model.device),
                                          "fingerprint": tiny_model.fingerprint}, run_id="run")
    params = options.params(budget=16, sinks=2, recent=3, **EDITS[request.param])
    session = Session(tiny_model, tiny_policy, SamplerParams(temperature=1.0, seed=4), params,
                      tape=tape)
    session.prime([Segment(tuple(range(5, 25)), "user")])
    records = list(session.stream(40, force=[(7 * i) % 50 + 3 for i in range(40)]))
    tape.close(session.stop_reason)
    assert sum(len(r.recalled) if request.param == "recall" else r.folded for r in records) > 0
    return tape, request.param


def test_the_page_data_are_the_ledger_at_every_step(edited_run, tiny_policy):
    tape, edit = edited_run
    run = CaptureRun(tape.dir)
    data = page.run_data(run, tiny_policy.token_text)
    assert [s["step"] for s in data["steps"]] == run.steps
    changed_by_recall = 0
    for s in data["steps"]:
        ledger = tape.ledgers[s["step"]]
        assert s["uid"] == ledger["uid"]
        assert s["token_id"] == ledger["token_id"]
        assert s["position"] == ledger["position"]
        assert s["source"] == [SOURCES[x] for x in ledger["source"]]
        assert s["born"] == ledger["born_step"]
        assert s["changed"] == ledger["changed_step"]  # derived from the recalls
        changed_by_recall += sum(c != b for c, b in zip(s["changed"], s["born"]))
        f = run.step(s["step"])
        by_uid = dict(zip(f.view["uid"].tolist(), f.scores.columns["brightness"].tolist()))
        assert s["brightness"] == [round(by_uid[u], 2) for u in s["uid"]]
        assert s["columns"]["brightness"] == [round(by_uid[u], 4) for u in s["uid"]]
        scores = dict(zip(f.view["uid"].tolist(), f.scores.scores.tolist()))
        assert s["score"] == [round(scores[u], 4) for u in s["uid"]]
        att = f.gen.attention.float().mean(dim=(0, 1))
        by_uid = dict(zip(f.view["uid"].tolist(), att.tolist()))
        # the page's rounding of the same mean of the same captured row (bit-exact)
        assert s["attention"] == [round(by_uid[u], 5) for u in s["uid"]]
        assert set(s["culled"]) | set(s["folded"]) == set(f.patch.culled_uids)
        assert s["recalled"] == [sw.cold_uid for sw in f.patch.swaps]
        logp = f.gen.logits.float().log_softmax(-1)[f.gen.token_id]
        assert s["nll"] == round(-float(logp), 4)  # the same log-softmax, rounded as the page
        assert s["cache_len"] == f.apply.data["cache_len"]
    if edit == "recall":
        assert changed_by_recall > 0, "some recalled row was shown with its recall step"
        assert any(s["recalled_before"] for s in data["steps"])
    assert any(s[{"recall": "recalled", "fold": "folded"}[edit]] for s in data["steps"])
    short = page.run_data(run, tiny_policy.token_text, last=5)
    assert short["steps"] == data["steps"][-5:] and short["steps_in_run"] == len(run.steps)


def test_inspect_and_compare_write_pages_and_refuse_bad_input(tmp_path, capsys, one_thread):
    caps = {}
    for policy in ("brightness", "h2o"):
        assert main(["run", "--model", "tiny-random", "--prompt", PROMPT, "--max-new-tokens",
                     "12", "--budget", "24", "--greedy", "--policy", policy, "--json",
                     "--capture", str(tmp_path / policy)]) == 0
        caps[policy] = json.loads(capsys.readouterr().out)["capture"]
    out = tmp_path / "run.html"
    assert main(["inspect", caps["brightness"], "--html", str(out)]) == 0
    data = page_data(out)
    assert len(data["runs"]) == 1 and data["compare"] is None
    assert len(data["runs"][0]["steps"]) == 12
    pair = tmp_path / "pair.html"
    assert main(["compare", caps["brightness"], caps["h2o"], "--html", str(pair)]) == 0
    data = page_data(pair)
    assert [r["params"]["policy"] for r in data["runs"]] == ["brightness", "h2o"]
    h2o = data["runs"][1]["steps"][-1]  # each scorer's own column by name, no brightness
    assert list(h2o["columns"]) == ["attn_sum"] and set(h2o["brightness"]) == {None}
    assert main(["compare", caps["brightness"], caps["h2o"], "--json"]) == 0
    assert data["compare"] == json.loads(capsys.readouterr().out)
    assert main(["run", "--model", "tiny-random", "--prompt", PROMPT, "--max-new-tokens", "30",
                 "--budget", "24", "--greedy", "--json", "--capture", str(tmp_path / "long")]) == 0
    longer = json.loads(capsys.readouterr().out)["capture"]
    assert main(["compare", caps["h2o"], longer, "--html", str(pair), "--last", "5"]) == 0
    data = page_data(pair)  # the last 5 of the 12 steps both runs have, in each run
    assert [[s["step"] for s in r["steps"]] for r in data["runs"]] == [list(range(8, 13))] * 2
    capsys.readouterr()
    for argv, message in (
            (["inspect", caps["brightness"], "--html", str(tmp_path / "page.txt")], "end in .html"),
            (["inspect", caps["brightness"], "--html", str(tmp_path / "no" / "p.html")],
             "no such folder"),
            (["inspect", caps["brightness"], "--html", str(out), "--step", "3"], "slider"),
            (["inspect", caps["brightness"], "--html", str(out), "--last", "0"], "--last"),
            (["compare", caps["brightness"], caps["h2o"], "--html", str(out), "--json"],
             "one at a time")):
        before = out.read_bytes()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert out.read_bytes() == before  # the page already there is left alone


def _chromium(url: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
                           "--enable-logging=stderr", "--v=0", "--window-size=1400,1000",
                           *flags, url], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(BROWSER is None, reason="no chromium (Debian's package; make test installs "
                    "it where it can)")
def test_a_browser_draws_the_page_and_its_slider_moves_the_text(edited_run, tiny_policy,
                                                                tmp_path):
    tape, _ = edited_run
    run = CaptureRun(tape.dir)
    data = page.run_data(run, tiny_policy.token_text)
    hostile = "<!-- <script>x = 1</script> & --> <b>"  # what a model writing HTML may say
    first = str(data["steps"][0]["token_id"][0])
    data["vocab"][first] = hostile
    out = page.write(tmp_path / "run.html", "a title with {{DATA}} & <b>", [data])
    assert page_data(out)["runs"][0] == data
    html_text = out.read_text()
    assert "<title>a title with {{DATA}} &amp; &lt;b&gt;</title>" in html_text
    shown = {}
    for t in (run.steps[4], run.steps[-1]):
        # #step=T sets the slider and fires its input event: the slider's own handler draws
        dom = _chromium(f"{out.as_uri()}#step={t}", "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert "CONSOLE" not in dom.stderr, dom.stderr  # no console message at all
        assert f'data-step="{t}"' in dom.stdout
        assert '<pre id="errors" hidden="">' in dom.stdout, "the page caught an error"
        pane = dom.stdout.split('id="text0"', 1)[1].split("</div>", 1)[0]
        assert "&lt;!-- &lt;script&gt;x = 1&lt;/script&gt; &amp; --&gt; &lt;b&gt;" in pane
        uids = [int(u) for u in re.findall(r'data-uid="(\d+)"', pane)]
        step = next(s for s in data["steps"] if s["step"] == t)
        assert uids == step["uid"] == tape.ledgers[t]["uid"]  # the ledger at that step
        shown[t] = re.sub(r"<[^>]+>", "", pane)
    assert len(set(shown.values())) == 2, "the slider changed the rendered text"
    shot = tmp_path / "page.png"
    res = _chromium(f"{out.as_uri()}#step={run.steps[10]}", f"--screenshot={shot}")
    assert res.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
