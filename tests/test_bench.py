"""`bench speed --quick` on the tiny model: well-formed JSON, a report and real PNG plots."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from positronic_brain import native, options
from positronic_brain.bench import speed, throughput
from positronic_brain.bench.result import Machine, Result
from positronic_brain.cli import main
from positronic_brain.model import hf_forward, packable
from tests.tolerance import products

PNG = b"\x89PNG\r\n\x1a\n"


def _speed(device="cpu", bandwidth_gb_s=1.0, **rows):
    """A speed result of ``rows`` alone (every other measurement empty)."""
    return speed.SpeedResult(benchmark="speed", command="", model="tiny-random", quick=True,
                             machine=Machine.now(),
                             config=speed.SpeedConfig(device=device,
                                                      parts=speed.device_parts(device)),
                             bandwidth_gb_s=bandwidth_gb_s, peak_rss_mb=0.0, **rows)


@pytest.fixture
def one_thread():
    """The tiny model's ops are too small to split across cores; one thread keeps the
    test fast on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bench_speed_measures_only_the_parts_asked(capsys, one_thread):
    code = main(["bench", "speed", "--quick", "--model", "tiny-random", "--json", "--parts",
                 "batch", "--batches", "1,2"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(stdout)
    assert res["config"]["parts"] == ["batch"] and res["config"]["batches"] == [1, 2]
    assert not any(res[k] for k in ("decode", "prefill", "alloc", "loop", "edits", "ops",
                                    "busy"))
    assert {(r["dtype"], r["batch"]) for r in res["batch"]} == \
        {(d, b) for d in ("float32", "bfloat16", "int8") for b in (1, 2)}
    assert main(["bench", "speed", "--parts", "batch,fast"]) == 2
    err = capsys.readouterr().err
    assert "--parts: unknown 'fast'" in err and err.count("\n") == 1


def test_bench_speed_quick_json_report_and_plots(capsys, tmp_path, one_thread):
    out = tmp_path / "bench"
    code = main(["bench", "speed", "--quick", "--model", "tiny-random", "--json", "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    res = json.loads(stdout)  # exactly one JSON object on stdout
    assert res == json.loads((out / "results.json").read_text())
    assert res["model"] == "tiny-random" and res["quick"] is True
    assert res["bandwidth_gb_s"] > 0 and res["peak_rss_mb"] > 0
    assert res["machine"]["torch_threads"] == 1

    contexts, dtypes = res["config"]["contexts"], res["config"]["dtypes"]
    assert contexts == [128, 256]  # the quick contexts that fit the tiny model's 512 positions
    assert dtypes == ["float32", "bfloat16", "int8"]
    for key in ("decode", "alloc"):
        assert [(r["dtype"], r["context"]) for r in res[key]] == \
            [(d, c) for d in dtypes for c in contexts]
    for r in res["decode"]:
        assert r["ours_ms"] > 0 and r["hf_ms"] > 0 and r["ratio"] > 0 and r["floor_ms"] > 0
        # stage 1 of copies loaded with compile (inductor, native), in the same rounds
        for key in ("compiled", "native"):
            assert r[f"{key}_ms"] > 0 and r[f"{key}_ratio"] > 0 and r[f"{key}_hf_ratio"] > 0
            assert r[f"{key}_agrees"] or r["dtype"] != "float32"  # float32 rounds alike
    assert [(c["dtype"], c["mode"]) for c in res["compile"]] == \
        [(d, m) for d in dtypes for m in ("inductor", "native")]
    assert all(c["compile_s"] > 0 and c["why_not"] is None for c in res["compile"])
    assert [r["tokens"] for r in res["prefill"]] == [256] * 3
    # a batch's throughput: stage 1 at the longest context that fits, the loop at the budget
    assert res["config"]["batches"] == [1, 4, 8] and res["config"]["batch_contexts"] == [256]
    whats = ["stage 1", "loop none", "loop fold", "loop none + recall", "loop none, sampled"]
    # the plain path's rows, then the native kernels' where they pay on this CPU
    stage1s = {d: ["plain"] + (["native"] if native.slower(["cpu"], d) is None
                               and native.unavailable() is None else []) for d in dtypes}
    assert [(r["dtype"], r["stage1"], r["batch"], r["what"]) for r in res["batch"]] == \
        [(d, s, b, w) for d in dtypes for s in stage1s[d] for b in (1, 4, 8) for w in whats]
    for r in res["batch"]:
        assert r["ms"] > 0 and r["tokens_s"] == pytest.approx(r["batch"] / r["ms"] * 1e3)
        assert r["speedup"] > 0 and (r["batch"] > 1 or r["speedup"] == 1.0)
        assert (r["overhead"] is None) == (r["what"] == "stage 1")
        assert r["ceiling"] >= 1 and (r["batch"] > 1 or r["ceiling"] == 1)
    # run beside one other busy process, on the threads run chooses and on torch's default,
    # stage 1 on the path --compile auto takes
    assert [(r["dtype"], r["threads"]) for r in res["busy"]] == \
        [(d, t) for d in dtypes for t in ("chosen", "default")]
    for r in res["busy"]:
        assert r["stage1"] == ("native" if native.auto(["cpu"], r["dtype"])[0] else "plain")
        assert r["idle_ms"] > 0 and r["ratio"] == r["busy_ms"] / r["idle_ms"]
        assert r["idle_threads"] >= 1 and r["busy_threads"] >= 1
    # hand-worked: 2 rows of 10 slots, weights 100 B, 5 B of K/V a token: 2 x 150 / 200
    assert throughput.ceiling(2, 10, 100, 5) == 1.5
    # 8 rows in 40 ms a step beside one row's 20 ms: 8 tokens / 40 ms over 1 / 20 ms
    assert throughput.paired(8, 40.0, 20.0) == 4.0 and throughput.paired(1, 5.0, None) == 1.0
    assert all(r[f"{k}_tok_s"] > 0 for r in res["prefill"] for k in ("ours", "hf", "window", "total"))

    # HF's DynamicCache concatenates the past every step; stage 1 only reads it (in
    # bfloat16, where oneDNN runs bfloat16 products (``model.packable``: avx512bw/vl/dq or
    # avx_ne_convert, as on the Intel Xeon and the AMD EPYC with avx512_bf16 seen here),
    # its product copies the strided past inside each layer: the count, taken from the
    # allocator's own events, shows that too; elsewhere (an AVX2-only AMD EPYC) torch's own
    # kernel reads it in place)
    kv = {m["dtype"]: m["kv_bytes_per_token"] for m in res["memory"]}
    for f in res["alloc_fit"]:
        if f["who"] == "hf":
            assert f["bytes_per_token"] >= kv[f["dtype"]]
        elif f["dtype"] == "float32" or not packable():
            assert f["bytes_per_token"] < kv[f["dtype"]]
        else:
            assert f["bytes_per_token"] >= kv[f["dtype"]]
    for r in res["alloc"]:
        assert r["ours_bytes"] > 0 and (r["hf_bytes"] > r["ours_bytes"] or r["dtype"] != "float32")

    # the loop runs at its budget (half the tiny model's positions); edits at every context
    # ... with the plain stage 1, then with the native copy's
    # (and with the plain one, h2o with whole tokens and per head, without and with recall)
    bright = [("brightness", m) for m in ("none", "merge", "fold", "none + recall")]
    h2o = [(p, m) for m in ("none", "none + recall") for p in ("h2o", "h2o@head")]
    assert [(r["dtype"], r["stage1"], r["policy"], r["repair"], r["context"])
            for r in res["loop"]] == \
        [(d, s, p, m, 256) for d in dtypes for s in ("plain", "native")
         for p, m in bright + h2o * (s == "plain")]
    recall = [r["repair"] == "none + recall" for r in res["loop"]]
    # with recall, over the prompt's culled tokens
    assert [r["cold"] > res["config"]["recall_cold"] // 2 for r in res["loop"]] == recall
    assert all(r["stage1_ms"] > 0 and r["step_ms"] > 0 and r["overhead"] > 0 for r in res["loop"])
    # stages 2-4's operators: each setting's own, the repairs' and recall's above no repair's
    ops = {(r["dtype"], r["stage1"], r["policy"], r["repair"]): r["settle_ops"]
           for r in res["loop"]}
    assert all(v > 0 for v in ops.values())
    assert all(ops[d, s, "brightness", m] > ops[d, s, "brightness", "none"]
               for d in dtypes for s in ("plain", "native") for m in ("merge", "fold"))
    assert [(r["dtype"], r["context"]) for r in res["edits"]] == \
        [(d, c) for d in dtypes for c in contexts]
    assert all(v > 0 for r in res["edits"] for k, v in r.items() if k.endswith("_ms"))
    assert {t["what"].split(" at ")[0].split(" (")[0] for t in res["targets"]} >= {
        "loop step / stage 1", "stage 1 bytes allocated per context token per step: flat",
        "loop step, h2o@head / h2o",
        "one cull, stage 4: ms", "one merge repair, stage 4: ms", "one fold, stage 4: ms"}
    edits = {(t["dtype"], t["what"]): t for t in res["targets"] if "stage 4" in t["what"]}
    assert len(edits) == 9
    lo, hi = res["edits"][0], res["edits"][len(contexts) - 1]  # float32's first and last
    fold = edits[("float32", "one fold, stage 4: ms at context 256 / at 128 (O(1))")]
    assert fold["value"] == hi["fold_apply_ms"] / lo["fold_apply_ms"]  # the same division

    # the cold store's memory per token: at least the K/V and a ledger row
    for m in res["memory"]:
        assert m["cold_bytes_per_token"] > m["kv_bytes_per_token"]
    assert [r["cold_bytes_per_token"] is not None for r in res["loop"]] == recall

    # the operators one stage-1 call launches, counted by the profiler (one per layer at least)
    assert [(r["dtype"], r["context"]) for r in res["ops"]] == [(d, 256) for d in dtypes]
    for r in res["ops"]:
        assert r["ops"] >= 2 * 10 and sum(k for _, k in r["top"]) <= r["ops"]
        assert any(name.endswith(("matmul", "bmm")) for name, _ in r["top"]), r["top"]
    assert "Operators launched per token (stage 1)" in (out / "report.md").read_text()
    assert "Stage 1 compiled (`--compile`" in (out / "report.md").read_text()
    assert "Stage 1 native (`--compile native`" in (out / "report.md").read_text()

    for name in ("decode_ms.png", "alloc_bytes.png", "edits_ms.png"):
        assert (out / name).read_bytes().startswith(PNG)
    report = (out / "report.md").read_text()
    assert report.startswith("# Speed benchmark")
    assert "bench speed --quick --model tiny-random --out" in report
    assert "![decode_ms.png](./decode_ms.png)" in report
    # llama.cpp is not measured on a model built in memory, and the report says why
    assert [(x["dtype"], x["measured"]) for x in res["llamacpp"]] == \
        [(d, False) for d in dtypes]
    assert all(x["why_not"] and x["why_not"] in report for x in res["llamacpp"])
    assert "llama.cpp in bfloat16 was not measured: " in report


def test_report_sections_share_one_document(tmp_path):
    from positronic_brain.bench.common import write_section

    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nhand-written intro\n")
    write_section(doc, "speed", "## Speed\nv1")
    write_section(doc, "quality", "## Quality\nq1")
    write_section(doc, "speed", "## Speed\nv2")  # replaced in place; the rest is kept
    assert doc.read_text() == ("# Benchmarks\n\nhand-written intro\n\n"
                               "<!-- bench speed: begin -->\n## Speed\nv2\n<!-- bench speed: end -->\n"
                               "<!-- bench quality: begin -->\n## Quality\nq1\n"
                               "<!-- bench quality: end -->\n")


def test_a_report_naming_the_out_folders_own_is_written_once(tmp_path):
    """``--report OUT/report.md`` names the report ``--out`` writes anyway: it is not also
    appended to itself as a section."""
    from types import SimpleNamespace
    from positronic_brain.bench.common import emit

    args = SimpleNamespace(report=str(tmp_path / "report.md"), json=True)
    res = Result(benchmark="speed", command="", model="tiny-random", quick=True,
                 machine=Machine.now())
    emit(res, args, tmp_path, "speed", lambda *_: [],
         lambda _res, _images, _dir, level: "#" * level + " Speed\n", lambda _: [])
    assert (tmp_path / "report.md").read_text() == "# Speed\n"


def test_bench_report_needs_out(capsys):
    code = main(["bench", "speed", "--model", "tiny-random", "--report", "x.md"])
    _, err = capsys.readouterr()
    assert code == 2 and "--report needs --out" in err


def test_the_hf_contender_is_row_major_and_computes_the_same(tiny_model):
    """bench speed times HF as its own loader leaves it: a row-major copy, ties kept."""
    from positronic_brain.bench.speed import stock_hf

    if tiny_model.device.type != "cpu":
        pytest.skip("input-major float32 weights are the CPU's layout only")
    assert not tiny_model.layers[0].qkv_w.is_contiguous()  # ours: float32 input-major
    hf = stock_hf(tiny_model)
    assert hf is not tiny_model.hf and all(p.is_contiguous() for p in hf.parameters())
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        got, want = (hf_forward(m, ids).logits for m in (hf, tiny_model.hf))
    # one forward over other weight layouts, whose products add in other orders: 9 sums in
    # series a layer, the final norm's and the head's, each of at most the widest size's terms
    c = hf.config
    tol = products(torch.float32, max(c.hidden_size, c.intermediate_size),
                   9 * c.num_hidden_layers + 2, float(want.abs().max()))
    assert float((got - want).abs().max()) <= tol


@pytest.mark.parametrize("where", ["load", "first call"])
def test_a_compile_that_fails_is_reported_not_fatal(monkeypatch, where):
    """One optional contender failing (no triton kernel for an operator, say), as it loads or
    as its first call compiles, must not lose a long run's other numbers: the compiled copy
    is None and the reason is kept."""
    from positronic_brain.bench import speed  # pylint: disable=import-outside-toplevel

    def fail(*_, **__):
        raise RuntimeError("no kernel for this\nsecond line")
    loaded = SimpleNamespace(device=torch.device("cpu"))  # the first call's model
    monkeypatch.setattr(speed, "load_model", fail if where == "load" else lambda *_, **__: loaded)
    monkeypatch.setattr(speed, "prefix_view", lambda *_: None)
    monkeypatch.setattr(speed, "generate", fail)
    cfg = speed.SpeedConfig(model="tiny-random", device="cpu", quick=True)
    model, info = speed.compile_model(cfg, "bfloat16", None, [0] * 300, lambda *_: lambda: None)
    assert model is None
    assert info.dtype == "bfloat16" and info.why_not == "RuntimeError: no kernel for this"


@pytest.mark.parametrize("error, expected", [
    (RuntimeError("no kernel\nsecond line"), "RuntimeError: no kernel"),
    (AssertionError(), "AssertionError"),  # a bare assert: no message at all
    (RuntimeError("\n  \n  first words later\n"), "RuntimeError: first words later")])
def test_a_failure_reason_is_one_line_whatever_the_message(error, expected):
    from positronic_brain.bench.speed import reason  # pylint: disable=import-outside-toplevel
    assert reason(error) == expected


def test_a_wrapped_compiler_error_is_reported_as_its_own(monkeypatch):
    """torch wraps the compiler's error (BackendCompilerFailed), whose first line only says
    which backend raised: the report gives the error inside."""
    from positronic_brain.bench.speed import reason  # pylint: disable=import-outside-toplevel
    wrapped = RuntimeError("backend='inductor' raised:\nTypeError: bad")
    wrapped.inner_exception = TypeError("bad operand")
    assert reason(wrapped) == "TypeError: bad operand"


def test_a_note_with_brackets_prints(capsys):
    from positronic_brain.bench.common import Table, print_tables  # pylint: disable=import-outside-toplevel
    print_tables([Table("t", ("a",), (("1",),), "failed (see [/tmp/x] and [bold])")])
    out = "".join(capsys.readouterr().out.split())  # the caption wraps at the table's width
    assert "failed(see[/tmp/x]and[bold])" in out  # as written, not read as markup


def test_missed_decode_targets_are_explained_without_llama_cpp():
    """A CPU run without llama.cpp judges bfloat16 by the HF yardstick; when that and the
    plain decode target are missed, each gets its note (the report once failed there)."""
    decode = [speed.DecodeRow(dtype="bfloat16", context=n, ours_ms=30.0, hf_ms=40.0,
                              ratio=0.75, floor_ms=10.0) for n in (1024, 4096)]
    res = _speed(decode=decode,
                 decode_fit=[speed.DecodeFit("bfloat16", who, 25.0, 1.0) for who in ("ours", "hf")],
                 memory=[speed.MemoryRow("bfloat16", 2 ** 28, 1000, 10.0)])
    res.targets = speed.targets(res)
    missed = [t.what for t in res.targets if not t.met]
    assert any("yardstick" in w for w in missed)
    notes = speed.missed_notes(res)
    # 4096 misses its plain target (0.6); both miss the yardstick's (0.25, 0.20)
    assert [n.split(":")[0] for n in notes if n.startswith("- **bfloat16, context")] == \
        ["- **bfloat16, context 4096", "- **bfloat16, context 1024", "- **bfloat16, context 4096"]


def test_a_missed_recall_step_says_how_far_reading_the_cold_keys_alone_would_take_it():
    """The recall row's note gives the scan's bytes per step at the measured bandwidth and
    the least step they allow on top of the same loop without recall."""
    loop = [speed.LoopRow(dtype="bfloat16", stage1="native", repair=what, context=512,
                          cold=cold, recall_every=every, scan_bytes=scanned, stage1_ms=20.0,
                          score_ms=1.0, decide_ms=0.5, step_ms=step, overhead=step / 20.0)
            for what, cold, every, scanned, step in (("none", 0, 1, None, 21.0),
                                                     ("none + recall", 8000, 4, 80e6, 26.0))]
    res = _speed(loop=loop, bandwidth_gb_s=20.0)
    (note,) = speed.missed_notes(res)  # only the recall row misses (1.30x; none: 1.05x)
    assert note.startswith("- **bfloat16, loop step (")
    # 80 MB over 4 steps: 20 MB a step at 20 GB/s is 1.00 ms, 0.05 of stage 1's 20 ms
    assert "76.3 MiB of cold keys, 19.1 MiB a step over 4 steps: 1.00 ms a step" in note
    assert "could not go below 1.10x here" in note  # 1.05 + 0.05


def test_a_gpu_run_holds_the_graph_to_the_floor_and_says_why_it_missed():
    """On a GPU, stage 1 as a graph is held to 3x the floor at every context; a miss is
    explained from the fit over the contexts: a fixed part far over the weights' reads
    (the operators the graph still launches) and an attention that grows faster than the
    K/V it reads."""
    decode = [speed.DecodeRow(dtype="float32", context=n, ours_ms=8.0, hf_ms=9.0, ratio=0.9,
                              floor_ms=1.0 + n / 1e6, graph_ms=2.5 + n / 1000)
              for n in (1000, 4000)]
    res = _speed("cuda:0", 1000.0, decode=decode, ops=[speed.OpsRow("float32", 1000, 600, [])],
                 decode_fit=[speed.DecodeFit("float32", who, 8.0, 0.0) for who in ("ours", "hf")],
                 memory=[speed.MemoryRow("float32", 2 ** 20, 1000, 1.0)])
    res.targets = speed.targets(res)
    graph = [t for t in res.targets if t.what.startswith("stage 1 graph")]
    # 3.5 ms over 1.001 ms at 1000, 6.5 over 1.004 at 4000
    assert [t.met for t in graph] == [False, False] and graph[1].value > 6.4
    (note,) = [n for n in speed.missed_notes(res) if "stage 1 graph" in n]
    # the fit is 2.5 ms + 1 ms per 1k tokens; 1000 B a token at 1000 GB/s: 0.001 ms per 1k
    assert "costs 2.50 ms + 1.000 ms per 1k context tokens" in note
    assert "2.5x the weights' reads" in note and "600 operators" in note
    assert "grows 1000x faster than the K/V it reads" in note


def test_the_scan_reads_every_recall_layer_s_cold_keys():
    params = options.params(budget=64, recall=True, recall_layers=3)
    k = torch.zeros(6, 2, 100, 4, dtype=torch.bfloat16)
    assert speed.scan_bytes(params, k, 10) == 3 * 2 * 10 * 4 * 2


@pytest.mark.parametrize("argv", [
    ["quality", "--quick"],
    ["quality", "--budgets", "64,128", "--policies", "brightness,tova", "--repairs",
     "none,fold", "--params", "decay=0.5", "--param", "gain=100", "--windows", "1",
     "--tokens", "16", "--dtype", "bfloat16", "--jobs", "2", "--model", "tiny-random"],
    ["passkey", "--quick", "--trials", "2", "--lengths", "512,600", "--policies", "none"],
    ["speed", "--quick", "--out", "x", "--report", "x/r.md"],
    ["transfer", "--model", "tiny-random", "--device", "cpu"],
    ["ruler", "--recall", "--new-tokens", "8", "--tasks", "niah_single_1,vt", "--ratios",
     "0.5", "--protocols", "compress"],
])
def test_a_report_s_command_line_rebuilds_its_config(argv):
    """A benchmark's config is made from its flags (``bench.flags``; ``--quick`` values
    from the fields), and the command its report prints parses back to the same config."""
    from positronic_brain.bench import flags
    from positronic_brain.cli.args import BENCHES, build_parser

    module = BENCHES[argv[0]]
    args = build_parser().parse_args(["bench", *argv])
    line = flags.command_line(argv[0], args, module.FLAGS)
    again = build_parser().parse_args(line.split()[1:])
    assert flags.command_line(argv[0], again, module.FLAGS) == line
    assert flags.config(module.FLAGS[0], again) == flags.config(module.FLAGS[0], args)
    quick = flags.config(module.FLAGS[0], build_parser().parse_args(["bench", argv[0], "--quick"]))
    assert quick.quick and all(getattr(quick, f.name) == f.metadata["quick"]
                               for f in dataclasses.fields(quick) if "quick" in f.metadata)
