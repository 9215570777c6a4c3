"""The special-token policy: nothing is added implicitly, and it is the only tokenizer caller."""
import ast
from pathlib import Path

import positronic_brain
from positronic_brain.special_tokens import TextStream, TokenPolicy
from positronic_brain.types import Segment

PACKAGE = Path(positronic_brain.__file__).parent


def test_raw_prompt_adds_nothing_for_smollm2(real_policy):
    segs = real_policy.raw_prompt("Hello world")
    assert real_policy.add_bos is False
    assert list(segs[0].ids) == real_policy.encode("Hello world")
    assert real_policy.bos_id not in segs[0].ids and not (real_policy.eos_ids & set(segs[0].ids))


def test_chat_has_no_default_system_prompt(real_policy):
    segs = real_policy.chat([("user", "Hi")])
    ids = [i for s in segs for i in s.ids]
    enc = real_policy.encode
    expected = enc("<|im_start|>user\n") + enc("Hi") + enc("<|im_end|>\n") \
        + enc("<|im_start|>assistant\n")
    assert ids == expected
    assert "system" not in real_policy.decode(ids)
    assert [s.source for s in segs] == ["user", "assistant"]


def test_chat_system_prompt_is_exactly_the_given_one(real_policy):
    segs = real_policy.chat([("system", "Be terse."), ("user", "Hi")], add_generation_prompt=False)
    assert real_policy.decode(list(segs[0].ids)) == "<|im_start|>system\nBe terse.<|im_end|>\n"
    assert segs[0].source == "system"
    assert real_policy.decode([i for s in segs for i in s.ids]).count("<|im_start|>") == 2


def test_bos_is_explicit_when_asked(tiny_model):
    policy = TokenPolicy(tiny_model.tokenizer, bos="yes")
    assert policy.raw_prompt("a")[0].ids == (policy.bos_id, *policy.encode("a"))
    assert TokenPolicy(tiny_model.tokenizer, bos="no").raw_prompt("a")[0].ids == tuple(policy.encode("a"))
    assert TokenPolicy(tiny_model.tokenizer).add_bos is False  # auto: ChatML family, no BOS


def test_eos_ids_include_end_of_turn(real_policy):
    assert 2 in real_policy.eos_ids  # <|im_end|>


def test_text_stream_waits_for_whole_characters(tiny_policy):
    ids = tiny_policy.encode("héllo ☃")
    stream = TextStream(tiny_policy)
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) == "héllo ☃"
    assert all("\ufffd" not in d for d in deltas)


def test_segment_sources_are_checked():
    import pytest

    from positronic_brain.types import UserError
    with pytest.raises(UserError):
        Segment((1,), "narrator")


TOKENIZER_CALLS = {"encode", "decode", "batch_decode", "apply_chat_template", "convert_ids_to_tokens",
                   "convert_tokens_to_ids", "get_vocab", "tokenize"}


def test_only_the_policy_module_calls_the_tokenizer():
    """Architecture rule: no module but special_tokens.py touches a tokenizer's methods."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "special_tokens.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Attribute):  # tokenizer.encode(...), self._tok.decode(...)
                    policy = isinstance(f.value, ast.Call) \
                        and ast.unparse(f.value.func).endswith("TokenPolicy")  # the policy's own
                    hit = f.attr in TOKENIZER_CALLS and "tok" in ast.unparse(f.value).lower() \
                        and not policy
                else:  # tokenizer(...) called directly
                    hit = ast.unparse(f).lower().endswith(("tokenizer", "tok"))
                if hit:
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:60]}")
    # model.py loads/saves tokenizers (from_pretrained/save_pretrained/constructors), never calls them
    offenders = [o for o in offenders if not o.startswith("model.py")]
    assert not offenders, offenders


def test_text_stream_equals_a_full_decode_on_the_real_tokenizer(real_policy, long_text):
    ids = real_policy.encode(long_text[:2000] + " naïve café ☃ 日本語 🙂 end")
    stream = TextStream(real_policy)
    assert "".join(stream.push(i) for i in ids) == real_policy.decode(ids) == stream.text
