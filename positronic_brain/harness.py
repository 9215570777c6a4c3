"""An lm-evaluation-harness model: lm-eval's tasks run through the staged loop, with the
cache policy applied (the optional extra ``harness``: ``pip install -e '.[harness]'``).

lm-eval 0.4.13 finds a model by name in its registry, which holds its own models and any a
module registers (it has no entry-point group for plugins): importing this module
registers ``positronic-brain``. Three ways in::

    positronic-brain-lm-eval --model positronic-brain \\
        --model_args model=smollm2,budget=512,policy=h2o,recall=true --tasks hellaswag
    python -m positronic_brain.harness ...        # the same: lm-eval's command line

    import lm_eval, positronic_brain.harness      # registers the model
    lm_eval.simple_evaluate(model="positronic-brain", model_args="model=smollm2,budget=512",
                            tasks=["hellaswag"])

Model args: ``model`` (a name or path ``load_model`` takes), ``dtype``, ``device``,
``max_length`` (the tokens a request may span, as Hugging Face's ``hf`` model's; default
the model's positions, less the room KVzip's copy of a prompt needs after it where the
scorer reads it: a larger one is refused at the start), ``seed`` (the n-th sampled
generation takes seed + n), ``threads`` (torch's: a count, or ``auto``: the cores free now,
as the command line takes by itself; default: as they are), and any cache option by its
flat name (docs/OPTIONS.md: budget, policy, param, repair, recall, sinks, recent, ...).

Every request is a ``Session`` of its own. A log-likelihood primes the context and forces
the continuation's tokens through the loop, summing each step's ``StepRecord.logprob``
(under a budget the cache is culled as the continuation streams); a rolling one scores the
text from its first token after the prefix token, in lm-eval's rolling windows of
``max_length``; a generation steps (greedy, or sampled per ``do_sample``/``temperature``)
until ``max_gen_toks``, the end of the turn or an ``until`` string. Tokens are what lm-eval's
``hf`` model makes of the same text (``TemplateLM._encode_pair``; a BOS only where the
tokenizer's config adds one), so with no budget the results equal the ``hf`` model's on the
same weights (tests/test_harness.py).
"""
from __future__ import annotations

import sys
from typing import Any

from . import options, threads
from .loop import Session, arena_capacity, check_copy, copy_ids
from .model import load_model
from .scorers import copies
from .stages.apply.prefill import COPY_MIN
from .special_tokens import TokenPolicy
from .types import CacheParams, SamplerParams, Segment, Totals, UserError, require

try:
    import lm_eval.models  # lm-eval's own models first: its registry loads them only if empty
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry, register_model
    from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                      postprocess_generated_text)
    from tqdm import tqdm
except ImportError as e:  # the optional extra is not installed
    raise ImportError(f"positronic_brain.harness needs lm-eval ({e.name} is missing): "
                      "pip install -e '.[harness]'") from None

NAME = "positronic-brain"
MODEL_ARGS = ("model", "dtype", "device", "max_length", "seed", "threads")
IGNORED = ("batch_size", "max_batch_size")  # lm-eval passes them; a request is one session
MAX_GEN_TOKS = 256  # lm-eval's default, as its hf model's


def cache_params(given: dict[str, Any]) -> CacheParams:
    """The cache options among the model args (flat name -> value as lm-eval parsed it, or
    its text) as ``CacheParams``; anything else is a one-line UserError."""
    unknown = sorted(set(given) - set(options.NAMES))
    require(not unknown, f"{NAME}: unknown model arg {unknown[:1]} (expected "
            f"{', '.join(MODEL_ARGS)} or a cache option: docs/OPTIONS.md)")
    text = {k: str(v) if isinstance(v, (bool, int, float)) else v for k, v in given.items()}
    return options.cache_params(text, text=True)


def _number(value, kind: type, name: str):
    return None if value is None else options.parse(str(value), kind, f"{NAME}: {name}")


def _threads(value) -> None:
    """torch's threads: ``auto`` (the cores free now, ``threads.use``) or a count."""
    auto = str(value).strip().lower() == "auto"
    threads.use(None if auto else _number(value, int, "threads"))


def sampler_of(kwargs: dict, seed: int) -> SamplerParams:
    """lm-eval's normalized generation kwargs as the loop's sampling rule: greedy unless
    ``do_sample``; ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
    ``repetition_penalty`` as Hugging Face's ``generate`` reads them. Others are ignored."""
    def get(name: str, kind: type, default):
        value = kwargs.get(name)
        return default if value is None else _number(value, kind, name)

    greedy = not kwargs.get("do_sample") or get("temperature", float, 1.0) == 0
    return SamplerParams(greedy=greedy,
                         temperature=1.0 if greedy else get("temperature", float, 1.0),
                         top_k=get("top_k", int, 0), top_p=get("top_p", float, 1.0),
                         min_p=get("min_p", float, 0.0),
                         repetition_penalty=get("repetition_penalty", float, 1.0), seed=seed)


def copy_length(lm, policy: TokenPolicy, cache: CacheParams) -> int:
    """The default ``max_length``: the model's positions, less what KVzip's reconstruction
    needs after a prompt (its repeat instruction and ``COPY_MIN`` tokens of the copy) where
    the cache's scorer copies the prompt at the prime (``scorers.copies``)."""
    if not copies(cache):
        return lm.spec.max_positions
    return lm.spec.max_positions - len(copy_ids(policy)) - COPY_MIN


class PositronicBrainLM(TemplateLM):
    """lm-eval's ``LM`` over the staged loop: one ``Session`` per request (see the module)."""

    def __init__(self, model: str = "smollm2", dtype: str = "float32", device: str | None = None,
                 max_length: int | None = None, seed: int = 0, threads: int | str | None = None,
                 **args) -> None:
        super().__init__()
        if threads is not None:
            _threads(threads)
        for name in IGNORED:
            args.pop(name, None)
        self.cache = cache_params(args)  # before the load: a bad option fails at once
        self.seed = _number(seed, int, "seed")
        self.lm = load_model(str(model), str(dtype), None if device is None else str(device))
        tok = self.lm.tokenizer  # attributes read; only the policy calls it
        # a BOS where the tokenizer's own encoding adds one, as lm-eval's hf model gets it
        self.policy = TokenPolicy(tok)
        self.policy.add_bos = self.policy.adds_bos_by_default()
        self._eot = tok.eos_token_id
        self._special = frozenset(getattr(tok, "all_special_ids", ()))  # skipped when decoding
        self._max_length = (_number(max_length, int, "max_length")
                            or copy_length(self.lm, self.policy, self.cache))
        require(2 <= self._max_length <= self.lm.spec.max_positions, f"{NAME}: max_length "
                f"must be in [2, the model's {self.lm.spec.max_positions} positions]")
        if copies(self.cache):  # every request's prompt leaves KVzip's copy its positions
            try:
                check_copy(self.lm, self.policy, self._max_length)
            except UserError as e:
                raise UserError(f"{NAME}: max_length {self._max_length}: {e}") from None
        self._sampled = 0  # generations sampled so far: each its own seed, as one stream
        self._prefix_text = self.policy.decode([self.prefix_token_id])
        self._device = self.lm.device
        self.totals = Totals()  # every step of every request: steps, culls, merges, recalls

    # --- what TemplateLM asks of a model ------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        """What a text with no context is scored after: the BOS token, else the EOS one."""
        return self.policy.bos_id if self.policy.bos_id is not None else self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return self.lm.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """The hf model's ``tok_encode``: the tokenizer's own special tokens (a BOS where its
        config adds one) unless ``add_special_tokens`` is False, or ``string`` (with None)
        starts with the prefix token's text; the last ``left_truncate_len`` ids."""
        bos = self.policy.add_bos and add_special_tokens is not False
        if add_special_tokens is None and string.startswith(self._prefix_text):
            bos = False
        ids = ([self.policy.bos_id] if bos else []) + self.policy.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def get_model_info(self) -> dict:
        return {"model": self.lm.name, "dtype": self.lm.precision,
                "max_length": self.max_length, "cache": options.flat(self.cache)}

    # --- the requests -----------------------------------------------------------------------

    def _session(self, prompt: list[int], new_tokens: int, sampler: SamplerParams) -> Session:
        session = Session(self.lm, self.policy, sampler, self.cache)
        session.prime([Segment(tuple(prompt), "user")],
                      arena_capacity(self.lm, self.cache, len(prompt), new_tokens))
        return session

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) through the loop, and whether every continuation
        token was the argmax. As the hf model, the last ``max_length + 1`` tokens of both."""
        require(bool(context), f"{NAME}: a request needs a context")
        if not continuation:  # nothing to score (lm-eval's empty-context case): as hf
            return 0.0, True
        require(len(continuation) <= self.max_length,
                f"{NAME}: a continuation of {len(continuation)} tokens is longer than "
                f"max_length {self.max_length}")
        ids = (context + continuation)[-(self.max_length + 1):]
        session = self._session(ids[:len(ids) - len(continuation)], len(continuation),
                                SamplerParams(greedy=True))
        total, greedy, steps = 0.0, True, 0
        for rec, token in zip(session.stream(len(continuation), ignore_eos=True,
                                             force=continuation), continuation):
            total += rec.logprob
            greedy = greedy and rec.top_ids[0] == token
            steps += 1
            self.totals.add(rec)
        require(steps == len(continuation), f"{NAME}: the loop stopped ({session.stop_reason}) "
                f"after {steps} of the continuation's {len(continuation)} tokens")
        return total, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context, continuation in tqdm(requests, disable=disable_tqdm,
                                               desc="Running loglikelihood requests"):
            answer = self.score(list(context), list(continuation))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood from its first token (after the prefix token), summed
        over lm-eval's disjoint rolling windows of ``max_length`` (one for a text the
        model's positions cover), as the hf model sums them."""
        out = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm,
                            desc="Running loglikelihood_rolling requests"):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)
            total = sum(self.score(*lm_utils.make_disjoint_window(w))[0] for w in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def _text(self, ids: list[int]) -> str:
        """Generated ids as the hf model decodes them (special tokens skipped)."""
        return self.policy.decode([i for i in ids if i not in self._special])

    def generate(self, prompt: list[int], until: list[str], max_gen: int,
                 sampler: SamplerParams) -> str:
        """Step from ``prompt`` until ``max_gen`` tokens, the end of the turn or an ``until``
        string in the text; the text, cut before the first ``until`` string."""
        session = self._session(prompt, max_gen, sampler)
        ids: list[int] = []
        for rec in session.stream(max_gen):
            self.totals.add(rec)
            if self.policy.is_eos(rec.token_id):
                break
            ids.append(rec.token_id)
            if any(u and u in self._text(ids) for u in until):
                break
        return postprocess_generated_text(self._text(ids), until, None)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.policy.decode([self.eot_token_id])
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm,
                                        desc="Running generate_until requests"):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            require(0 < max_gen < self.max_length, f"{NAME}: max_gen_toks {max_gen} must be "
                    f"in [1, max_length {self.max_length})")
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_gen)
            sampler = sampler_of(kwargs, self.seed + self._sampled)
            self._sampled += not sampler.greedy
            text = self.generate(prompt or [self.prefix_token_id], until, max_gen, sampler)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def register() -> None:
    """Register the model as ``positronic-brain`` in lm-eval's registry (once)."""
    if NAME not in model_registry:
        register_model(NAME)(PositronicBrainLM)


register()


def main() -> None:
    """``positronic-brain-lm-eval``: lm-eval's command line (its arguments, its output) with
    ``positronic-brain`` registered; a bad model arg is one line on stderr, exit 2."""
    from lm_eval.__main__ import cli_evaluate  # its command line only (argparse and more)

    threads.use()  # the cores free now, as positronic-brain's commands (model arg threads)
    try:
        cli_evaluate()
    except UserError as e:
        print(f"positronic-brain-lm-eval: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
