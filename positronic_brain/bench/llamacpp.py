"""llama.cpp as a decode contender in ``bench speed``: the model's own Hugging Face folder
written as a GGUF at the run's precision by llama.cpp's converter, decoded through
``llama_cpp`` (PyPI ``llama-cpp-python``; the optional extra ``bench-llamacpp``,
``make bench-llamacpp``) with the same threads, at the same fixed contexts as stage 1.

Optional by design: without ``llama_cpp`` or its converter, ``contender`` returns the
reason, and the report says llama.cpp was not measured and why.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from ..model import Model, cache_dir

# the run's dtype -> (the converter's --outtype, the K/V cache type: f16 is llama.cpp's
# default, as its users run it next to BF16 and Q8_0 weights; f32 K/V next to F32 weights).
# Q8_0 (int8 in blocks of 32 weights with a float16 scale each) is llama.cpp's nearest
# counterpart of int8's per-row scales.
PRECISIONS = {"float32": ("f32", "f32"), "bfloat16": ("bf16", "f16"), "int8": ("q8_0", "f16")}
GGML_TYPES = {"f32": 0, "f16": 1}  # ggml_type values of the K/V cache types


def converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py``: in ``$LLAMA_CPP_DIR``, else in the folder
    ``make bench-llamacpp`` unpacks the llama-cpp-python source's ``vendor/llama.cpp`` into
    (``<venv>/llama.cpp``); None if neither has it."""
    for folder in (os.environ.get("LLAMA_CPP_DIR"), Path(sys.prefix) / "llama.cpp"):
        if folder and (Path(folder) / "convert_hf_to_gguf.py").is_file():
            return Path(folder) / "convert_hf_to_gguf.py"
    return None


def unavailable(model: Model, dtype: str) -> str | None:
    """Why llama.cpp cannot be measured for ``model`` in ``dtype``, or None if it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not installed (make bench-llamacpp)"
    if converter() is None:
        return ("llama.cpp's convert_hf_to_gguf.py was not found in $LLAMA_CPP_DIR or "
                f"{Path(sys.prefix) / 'llama.cpp'} (make bench-llamacpp)")
    if dtype not in PRECISIONS:
        return f"no llama.cpp counterpart of {dtype}"
    if model.device.type != "cpu":
        return "llama.cpp is measured on the CPU only"
    if not (folder(model) / "config.json").is_file():
        return f"{model.name} has no Hugging Face folder on disk for llama.cpp's converter"
    return None


def folder(model: Model) -> Path:
    """The Hugging Face folder the model was loaded from (a GGUF's converted cache folder)."""
    return Path(model.hf.config.name_or_path or "/nonexistent")


def gguf_file(model: Model, dtype: str) -> Path:
    """The model's folder written as a GGUF at ``dtype``'s precision, converted once into
    ``cache_dir()/llamacpp`` (named after the folder and a digest of its config and weight
    files' sizes and times)."""
    src = folder(model)
    h = hashlib.sha256(str(src.resolve()).encode())
    for f in sorted(src.iterdir()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    outtype = PRECISIONS[dtype][0]
    out = cache_dir() / "llamacpp" / f"{src.name}-{h.hexdigest()[:12]}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    done = subprocess.run([sys.executable, str(converter()), str(src), "--outtype", outtype,
                           "--outfile", str(tmp)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama.cpp's converter failed on {src}: {tail[0]}")
    os.replace(tmp, out)
    return out


class Contender:
    """llama.cpp decoding one token at a fixed context: ``prefill`` the first n tokens,
    then each ``decode`` evaluates the pending token at position n and drops it again (the
    context stays n, as stage 1's view does)."""

    def __init__(self, model: Model, dtype: str, n_ctx: int) -> None:
        from llama_cpp import Llama  # pylint: disable=import-outside-toplevel

        kv = GGML_TYPES[PRECISIONS[dtype][1]]
        threads = torch.get_num_threads()
        self.path = gguf_file(model, dtype)
        self.llm = Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                         n_threads=threads, n_threads_batch=threads, type_k=kv, type_v=kv,
                         logits_all=False, verbose=False)
        self.n = 0

    def prefill(self, ids: list[int]) -> None:
        """The context becomes ``ids`` (only what is past the current context is evaluated)."""
        if len(ids) < self.n:
            self.llm.n_tokens = self.n = 0
        self.llm.n_tokens = self.n
        self.llm.eval(ids[self.n:])
        self.n = len(ids)

    def decode(self, token: int) -> int:
        """The greedy next token after ``token`` at position n; the context stays n."""
        self.llm.n_tokens = self.n  # eval first drops every cached position from n on
        self.llm.eval([token])
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(),  # pylint: disable=protected-access
                                       shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def close(self) -> None:
        self.llm.close()
