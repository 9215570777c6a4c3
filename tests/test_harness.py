"""lm-evaluation-harness over the loop (``positronic_brain.harness``): local tasks of each
request kind (multiple choice by log-likelihood, rolling log-likelihood, generate_until) run
through ``lm_eval.simple_evaluate`` as ``positronic-brain`` and as lm-eval's own ``hf`` model
on the same weights (the tiny random model, saved as a Hugging Face folder); with no budget
every request's numbers and every metric agree. Nothing is downloaded: the data are local
JSONL files."""
import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm-eval imports datasets
lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (the extra: pip install -e '.[harness]')")

# pylint: disable=wrong-import-position
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from positronic_brain import harness  # noqa: E402
from positronic_brain.loop import COPY_INSTRUCTION  # noqa: E402
from positronic_brain.model import byte_tokenizer, load_model  # noqa: E402
from positronic_brain.stages.apply.prefill import COPY_MIN  # noqa: E402
from positronic_brain.types import UserError  # noqa: E402
from tests.tolerance import ORACLE  # noqa: E402

MC = [{"question": "Which one is a colour?", "choices": ["red", "table", "seven"], "answer": 0},
      {"question": "Two plus two is", "choices": ["four", "five", "a fish"], "answer": 0},
      {"question": "The sun rises in the", "choices": ["west", "east"], "answer": 1},
      {"question": "Ice is", "choices": ["cold", "hot", "loud"], "answer": 0}]
TEXTS = [{"text": "The quick brown fox jumps over the lazy dog."},
         {"text": "A short line of text, read token by token."},
         {"text": "Rain fell all night; the river had risen."}]
PROMPTS = [{"prompt": "Q: Name a fruit.\nA:", "answer": " apple"},
           {"prompt": "Q: What is 1 + 1?\nA:", "answer": " 2"},
           {"prompt": "Once upon a time", "answer": " there"}]
BUDGET = 16  # fewer tokens than every text (40-odd bytes, a token each: no merges)


def _task(name: str, data: str, cache: str, **fields) -> dict:
    return {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": data}, "cache_dir": cache},
            "test_split": "test", **fields}


TASKS = {
    "pb_choice": (MC, dict(output_type="multiple_choice",
                           doc_to_text="Question: {{question}}\nAnswer:",
                           doc_to_choice="{{choices}}", doc_to_target="{{answer}}",
                           metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}])),
    "pb_rolling": (TEXTS, dict(output_type="loglikelihood_rolling", doc_to_text="",
                               doc_to_target="{{text}}",
                               metric_list=[{"metric": "word_perplexity"},
                                            {"metric": "byte_perplexity"},
                                            {"metric": "bits_per_byte"}])),
    "pb_generate": (PROMPTS, dict(output_type="generate_until", doc_to_text="{{prompt}}",
                                  doc_to_target="{{answer}}",
                                  generation_kwargs={"until": ["\n", "."], "max_gen_toks": 12,
                                                     "do_sample": False},
                                  metric_list=[{"metric": "exact_match"}])),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A model of the tiny random one's config as a Hugging Face folder: the weights both
    models load."""
    path = tmp_path_factory.mktemp("tiny-random-hf")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(load_model("tiny-random").hf.config)
    hf.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    """The three tasks (YAML: JSON is YAML) over local JSONL files, in an include path."""
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, (rows, fields) in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = _task(name, str(data), str(root / "datasets-cache"), **fields)
        (root / f"{name}.yaml").write_text(json.dumps(config, indent=1))
    return TaskManager(include_path=str(root), include_defaults=False)  # not lm-eval's 17 s


def _evaluate(model, task_manager, model_args=None) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                   task_manager=task_manager, batch_size=1, device="cpu",
                                   log_samples=True, bootstrap_iters=0)


def _responses(results: dict, task: str) -> list:
    """Each document's responses in document order: a list of (log-likelihood, greedy) per
    choice, a rolling log-likelihood, or a generated text."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["resps"] for s in samples]


def _flat(resps) -> list:
    """Nested responses as a flat list of their values (floats, bools, strings)."""
    if isinstance(resps, (list, tuple)):
        return [v for r in resps for v in _flat(r)]
    return [resps]


@pytest.fixture(scope="module")
def hf_results(folder, task_manager):
    return _evaluate("hf", task_manager, {"pretrained": folder, "dtype": "float32"})


@pytest.fixture(scope="module")
def our_results(folder, task_manager):
    return _evaluate(harness.NAME, task_manager, f"model={folder},dtype=float32")


def test_registered_beside_lm_evals_own_models():
    """Importing the module registers the model, and lm-eval's own stay reachable (its
    registry loads them only while it is empty)."""
    assert get_model(harness.NAME) is harness.PositronicBrainLM
    assert get_model("hf").__name__ == "HFLM"


@pytest.mark.parametrize("task", list(TASKS))
def test_no_budget_equals_lm_evals_hf_model(task, hf_results, our_results):
    """Request by request: log-likelihoods within the oracle contract (float32), the greedy
    flags and generated texts equal; then every metric."""
    ours, theirs = _flat(_responses(our_results, task)), _flat(_responses(hf_results, task))
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        if isinstance(b, float):
            assert a == pytest.approx(b, abs=ORACLE)  # the contract, per request (README)
        else:
            assert a == b
    mine, hf = our_results["results"][task], hf_results["results"][task]
    for name, value in hf.items():
        if name == "alias" or "stderr" in name:
            continue
        if name.startswith(("word_perplexity", "byte_perplexity")):
            # log perplexity = -(sum of log-likelihoods) / words (bytes): within the contract
            assert math.log(mine[name]) == pytest.approx(math.log(value), abs=ORACLE), name
        elif name.startswith("bits_per_byte"):
            assert mine[name] == pytest.approx(value, abs=ORACLE), name
        else:
            assert mine[name] == value, name


def test_a_budget_smaller_than_the_texts_culls(folder, task_manager, our_results):
    """A budget below the texts' length: the rolling log-likelihoods stream through a culled
    cache (H2O with recall), so they change, and the model's tally counts the culls."""
    lm = harness.PositronicBrainLM.create_from_arg_string(
        f"model={folder},budget={BUDGET},sinks=2,recent=4,policy=h2o,recall=true",
        {"device": "cpu"})
    assert lm.cache.budget == BUDGET and lm.cache.recall is not None
    results = _evaluate(lm, task_manager)
    assert lm.totals.culled > 0 and lm.totals.steps > 0
    full = _flat(_responses(our_results, "pb_rolling"))
    culled = _flat(_responses(results, "pb_rolling"))
    assert len(culled) == len(TEXTS) and culled != full
    assert all(math.isfinite(v) and v < 0 for v in culled)


@pytest.mark.parametrize("args, message", [
    ("model=tiny-random,colour=blue", "unknown model arg ['colour']"),
    ("model=tiny-random,budget=many", "budget: 'many' is not an integer"),
    ("model=tiny-random,policy=h2o,recall=true", "recall"),
    ("model=tiny-random,max_length=long", "max_length: 'long' is not an integer"),
    ("model=tiny-random,policy=kvzip,budget=64,max_length=512",
     "positronic-brain: max_length 512: the prompt's"),
    ("model=no-such-model", "model not found"),
])
def test_bad_model_args_are_one_line_errors(args, message):
    with pytest.raises(UserError) as e:
        harness.PositronicBrainLM.create_from_arg_string(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_kvzip_max_length_leaves_its_copy_room():
    """With a scorer that copies the prompt at the prime, the default max_length is the
    longest whose requests all leave the copy its room (one more is refused at the start),
    and a request that long is scored; without one, it is the model's positions."""
    lm = harness.PositronicBrainLM.create_from_arg_string(
        "model=tiny-random,policy=kvzip,budget=64")
    positions = lm.lm.spec.max_positions
    assert lm.max_length == positions - len(lm.policy.encode(COPY_INSTRUCTION)) - COPY_MIN
    with pytest.raises(UserError, match="KVzip's reconstruction"):
        harness.PositronicBrainLM.create_from_arg_string(
            f"model=tiny-random,policy=kvzip,budget=64,max_length={lm.max_length + 1}")
    ids = [i % 50 + 3 for i in range(lm.max_length + 1)]
    logprob, _ = lm.score(ids[:-1], ids[-1:])
    assert math.isfinite(logprob) and logprob < 0 and lm.totals.culled > 0
    assert harness.PositronicBrainLM.create_from_arg_string(
        "model=tiny-random,policy=h2o,budget=64").max_length == positions
