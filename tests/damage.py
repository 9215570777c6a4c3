"""Damaged copies of a signed safetensors file (sessions, projectors) for refusal tests."""
from __future__ import annotations

from pathlib import Path


def damaged(path: Path, tmp_path: Path, how: str, edit: tuple[bytes, bytes]) -> Path:
    """A copy of ``path`` in ``tmp_path``: ``truncated`` (its last 100 bytes cut),
    ``flipped`` (a byte inside the tensor data inverted) or ``header`` (``edit``'s old
    bytes of the JSON metadata replaced by its new ones, of the same length)."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[:-100]
    elif how == "flipped":
        data[-50] ^= 0xFF
    elif how == "header":
        assert edit[0] in data and len(edit[0]) == len(edit[1])
        data = data.replace(*edit)
    bad = tmp_path / f"{how}{path.suffix}"
    bad.write_bytes(bytes(data))
    return bad
