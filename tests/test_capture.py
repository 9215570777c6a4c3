"""Capture files: plain data only, atomic, checksummed; bad files get one-line errors."""
import json
import os
import pickle

import pytest
import torch

from positronic_brain.capture import FORMAT, CaptureTape, load_file, read_manifest
from positronic_brain.plain import from_plain, to_plain
from positronic_brain.types import SamplerParams, SamplerReport, UserError


def _writer(tmp_path, **kw):
    return CaptureTape(tmp_path, {"model": "tiny-random", "fingerprint": {"name": "tiny-random"}},
                         run_id="r1", **kw)


def test_dataclasses_round_trip_through_plain_data(tmp_path):
    report = SamplerReport(token_id=3, top_ids=(3, 1), top_probs=(0.75, 0.25))
    obj = {"sampler": SamplerParams(top_k=5, seed=9), "report": report,
           "t": torch.arange(6).view(2, 3)[:, 1:], "none": None, "nested": [(1, "a"), {"x": 2.5}]}
    plain = to_plain(obj)
    assert plain["sampler"]["__type__"] == "SamplerParams"
    path = tmp_path / "x.pt"
    torch.save(plain, path)
    back = from_plain(torch.load(path, weights_only=True))
    assert back["sampler"] == SamplerParams(top_k=5, seed=9) and back["report"] == report
    assert torch.equal(back["t"], torch.tensor([[1, 2], [4, 5]])) and back["none"] is None
    assert back["nested"] == [(1, "a"), {"x": 2.5}]


def test_a_view_is_saved_without_its_whole_storage(tmp_path):
    big = torch.zeros(1000, 1000)
    w = _writer(tmp_path)
    path = w.save(1, "s1_generate", {"k": big[:2]}, {}, cache_len=2, arena_version=0)
    assert path.stat().st_size < 100_000  # 2 rows, not the 4 MB arena behind the view


def test_writer_manifest_lists_whole_files_with_checksums(tmp_path):
    w = _writer(tmp_path, level="full")
    w.save(0, "s0_prime", {"ids": [1, 2]}, {"logits": torch.ones(3)}, cache_len=1, arena_version=7)
    m = read_manifest(w.dir)
    assert m["complete"] is False and m["last_file"] == "000000_s0_prime.pt"
    assert set(m["versions"]) >= {"torch", "transformers", "positronic_brain"}
    w.close("eos")
    m = read_manifest(w.dir)
    assert m["complete"] is True and m["stop_reason"] == "eos"
    data = load_file(w.dir / "000000_s0_prime.pt", m["files"]["000000_s0_prime.pt"],
                     model={"name": "tiny-random"})
    assert data["stage"] == "s0_prime" and data["cache_len"] == 1 and data["arena_version"] == 7
    assert torch.equal(data["outputs"]["logits"], torch.ones(3))
    assert not [p for p in os.listdir(w.dir) if ".tmp" in p]  # no temp files left behind


def test_an_existing_run_folder_is_refused(tmp_path):
    _writer(tmp_path)
    with pytest.raises(UserError, match="exists already"):
        _writer(tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("kind", ["checksum", "truncated", "pickle", "not-a-capture", "model"])
def test_bad_files_get_one_line_errors(tmp_path, kind):
    w = _writer(tmp_path)
    path = w.save(0, "s0_prime", {}, {"x": torch.ones(100)}, cache_len=0, arena_version=0)
    sha = read_manifest(w.dir)["files"][path.name]
    model = {"name": "tiny-random"}
    if kind == "checksum":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        match = "sha256"
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:200])
        sha, match = None, "not a plain-data capture"
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"stage": _Evil()}, protocol=2))
        sha, match = None, "not a plain-data capture"
    elif kind == "not-a-capture":
        torch.save({"hello": 1}, path)
        sha, match = None, "not a capture file"
    else:
        model, match = {"name": "smollm2"}, "captured from model"
    with pytest.raises(UserError, match=match) as err:
        load_file(path, sha, model=model)
    assert "\n" not in str(err.value)


def test_a_broken_manifest_is_one_line(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(UserError, match="not a capture manifest"):
        read_manifest(tmp_path)
    with pytest.raises(UserError, match="no manifest"):
        read_manifest(tmp_path / "nowhere")


def test_a_capture_of_another_format_is_refused_in_one_line(tmp_path):
    w = _writer(tmp_path)
    path = w.save(0, "s0_prime", {}, {}, cache_len=0, arena_version=0)
    manifest = json.loads((w.dir / "manifest.json").read_text())
    (w.dir / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(UserError, match="capture format 1 is not read by this version, which "
                       f"reads format {FORMAT}") as err:
        read_manifest(w.dir)
    assert "\n" not in str(err.value)
    data = torch.load(path, weights_only=True)
    torch.save({**data, "format": 1}, path)
    with pytest.raises(UserError, match="capture format 1 is not read"):
        load_file(path)
