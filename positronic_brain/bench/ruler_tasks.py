"""RULER's tasks (Hsieh et al., 2024), generated here: offline, seeded, in the model's tokens.

The 13 tasks of RULER's ``scripts/synthetic.yaml``: eight needle-in-a-haystack variants
(``niah_*``), variable tracking (``vt``), common- and frequent-word extraction (``cwe``,
``fwe``), and question answering over distractor documents (``qa_1`` SQuAD, ``qa_2``
HotpotQA; only from a JSON file a user gives, never downloaded). Templates, answer prefixes,
tokens to generate, needle kinds, depths, distractors and metrics follow RULER's generators
(``scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction,qa}.py``, ``.../constants.py``) and its evaluation
(``scripts/eval/synthetic/constants.py``). What differs, and why:

- haystacks: RULER's noise sentences; for its "essay" haystack (Paul Graham's essays,
  downloaded there) Python's own help topics (``pydoc_data.topics``) or a user's text file,
  cut into sentences after ``. ! ?`` and a space (RULER uses nltk's punkt); its "needle"
  haystack (repeated distractor needles) as RULER makes it;
- words: the ``wonderwords`` package's lists, as RULER reads them (keys: adjective-noun;
  cwe: nouns + adjectives + verbs); cwe at a length needing more words than these is refused
  (RULER falls back to a word list of its own);
- randomness: each sample has its own ``random.Random`` seeded from (task, seed, index), so a
  sample does not depend on the others (RULER draws from one global stream); distractor
  needles' keys and values differ from the real ones (RULER leaves it to chance);
- length: RULER takes the largest haystack whose input fits ``length - tokens_to_generate``;
  here the input (context + question + answer prefix, one text through ``policy.encode``) is
  made exactly that long: the largest haystack that fits, then a continuation of the
  haystack cut at token granularity (part of one more noise line, distractor needle, essay
  word, list item, document, or RULER's ``...`` noise words in fwe), re-counted until equal;
  a sample that cannot be made exact is an error, never silently short. No BOS is
  counted (a runner adds it where the model family wants one).

A sample's ``context`` is the template up to and including the haystack (for vt and cwe
after RULER's worked example, which opens the input), its ``question`` the template after
the haystack, its ``answer_prefix`` RULER's answer prefix: a compressor may take the
context alone.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from ..types import UserError, inconsistent, require

# --- RULER's templates (scripts/data/synthetic/constants.py): (template, answer prefix) ----

TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat "
        "are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text."
        "\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in "
        "the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: "),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the "
        "10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:"),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently "
        "appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words "
        "are:"),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not "
        "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer "
        "the question based on the given documents. Only give me the answer and do not output "
        "any other words.\n\nQuestion: {query}",
        " Answer:"),
}
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}
# scripts/eval/synthetic/constants.py: string_match_part for qa, string_match_all otherwise
METRICS = {"niah": "all", "variable_tracking": "all", "common_words_extraction": "all",
           "freq_words_extraction": "all", "qa": "part"}

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = tuple(round(100 * i / 39) for i in range(40))  # np.linspace(0, 100, 40), rounded
DOCUMENT = "Document {i}:\n{document}"
VT_ICL_TOKENS = 500  # the few-shot example's size (RULER's max_seq_length for it)
CWE_FULL_FROM = 4096  # below this length cwe uses 6/1 repeats and a 20-word example


@dataclass(frozen=True)
class Task:  # pylint: disable=too-many-instance-attributes
    """One of RULER's tasks, with its ``scripts/synthetic.yaml`` arguments."""

    name: str
    tokens_to_generate: int
    metric: str  # "all" (string_match_all) or "part" (string_match_part)
    kind: str  # RULER's task family: niah, variable_tracking, ..., qa (its generator)
    haystack: str = ""  # niah and vt: noise, essay or needle
    key: str = "words"  # niah needle key / value kinds: numbers, words or uuids
    value: str = "numbers"
    keys: int = 1  # niah: num_needle_k, num_needle_v, num_needle_q
    values: int = 1
    queries: int = 1
    chains: int = 1  # vt
    hops: int = 4
    freq_cw: int = 30  # cwe
    freq_ucw: int = 3
    num_cw: int = 10
    alpha: float = 2.0  # fwe
    dataset: str = ""  # qa: squad or hotpotqa


def _task(name: str, kind: str, **args) -> Task:
    return Task(name, TOKENS_TO_GENERATE[kind], METRICS[kind], kind, **args)


TASKS: dict[str, Task] = {t.name: t for t in (
    _task("niah_single_1", "niah", haystack="noise"),
    _task("niah_single_2", "niah", haystack="essay"),
    _task("niah_single_3", "niah", haystack="essay", value="uuids"),
    _task("niah_multikey_1", "niah", haystack="essay", keys=4),
    _task("niah_multikey_2", "niah", haystack="needle"),
    _task("niah_multikey_3", "niah", haystack="needle", key="uuids", value="uuids"),
    _task("niah_multivalue", "niah", haystack="essay", values=4),
    _task("niah_multiquery", "niah", haystack="essay", queries=4),
    _task("vt", "variable_tracking", haystack="noise"),
    _task("cwe", "common_words_extraction"),
    _task("fwe", "freq_words_extraction"),
    _task("qa_1", "qa", dataset="squad"),
    _task("qa_2", "qa", dataset="hotpotqa"),
)}
SYNTHETIC: tuple[str, ...] = tuple(n for n, t in TASKS.items() if t.kind != "qa")


@dataclass(frozen=True)
class Sample:  # pylint: disable=too-many-instance-attributes
    """One input: ``context`` (what a compressor may compress), then ``question`` and
    ``answer_prefix`` (the model continues after it); ``n_tokens`` of them together."""

    task: str
    length: int
    seed: int
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    n_tokens: int
    depth: tuple[float, ...] = ()  # niah: the needles' depths in the haystack, 0..1, in order

    def input(self) -> str:
        return self.context + self.question + self.answer_prefix


@dataclass(frozen=True)
class _Parts:
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    depth: tuple[float, ...] = ()

    @property
    def text(self) -> str:
        return self.context + self.question + self.answer_prefix


@dataclass
class _Job:
    """What one sample's builder reads: the task, the length, the sample's seed, the
    haystack or documents, and anything computed once per sample (vt's example)."""

    task: Task
    length: int
    seed: int
    index: int
    words: tuple[str, ...] = ()  # essay haystack, split on whitespace
    qa: tuple = ()  # (questions, documents)
    extra: dict = field(default_factory=dict)


# --- scoring (scripts/eval/synthetic/constants.py, per sample and 0..1) --------------------

def score(task: str, prediction: str, answers) -> float:
    """RULER's metric for one sample: ``all`` (string_match_all) the fraction of the answers
    found in the prediction, ``part`` (string_match_part) 1 if any is; case-insensitive."""
    require(task in TASKS, f"unknown RULER task {task!r}; expected one of {', '.join(TASKS)}")
    answers = [answers] if isinstance(answers, str) else list(answers)
    require(len(answers) > 0, "no answers to score against")
    found = [1.0 if a.lower() in prediction.lower() else 0.0 for a in answers]
    return max(found) if TASKS[task].metric == "part" else sum(found) / len(found)


# --- words, haystacks and documents --------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _wordlist(name: str) -> tuple[str, ...]:
    try:
        text = resources.files("wonderwords").joinpath("assets", f"{name}.txt").read_text()
    except ModuleNotFoundError:
        raise UserError("RULER's word lists need the package wonderwords: "
                        "pip install 'positronic-brain[bench]'") from None
    return tuple(sorted({w.rstrip() for w in text.splitlines() if w.strip()}))


def _cwe_words() -> tuple[str, ...]:
    """cwe's vocabulary: wonderwords' nouns + adjectives + verbs, distinct (as RULER)."""
    return tuple(sorted(set(_wordlist("nounlist") + _wordlist("adjectivelist")
                            + _wordlist("verblist"))))


def _fresh(rng: random.Random, kind: str, seen: set) -> str:
    """A random needle key or value of ``kind`` (RULER's: a 7-digit number, an
    adjective-noun word, a UUID) not in ``seen``, which it joins."""
    while True:
        if kind == "numbers":
            value = str(rng.randint(10 ** 6, 10 ** 7 - 1))
        elif kind == "words":
            value = f"{rng.choice(_wordlist('adjectivelist'))}-{rng.choice(_wordlist('nounlist'))}"
        else:
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if value not in seen:
            seen.add(value)
            return value


def default_essay() -> str:
    """The essay haystack when no file is given: Python's help topics, all of them."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _essay_words(path: str | None) -> tuple[str, ...]:
    if path is None:
        text = default_essay()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the essay {path}: {e}") from None
        if path.endswith(".json"):  # RULER's PaulGrahamEssays.json: {"text": ...}
            with inconsistent(path, "essay file (a JSON object with a text field)"):
                text = json.loads(text)["text"]
                require(isinstance(text, str), "text is not a string")
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    require(words != ("",), f"the essay {path} is empty")
    return words


def _cycle(items, start: int, count: int) -> list:
    """``count`` items from ``start`` on, the sequence repeated as often as needed."""
    return [items[i % len(items)] for i in range(start, start + count)]


def _sentences(text: str) -> list[str]:
    """Sentences (split after . ! or ? and a space; RULER uses nltk's punkt)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def _read_qa(path: str | None, task: Task) -> tuple:
    """RULER's qa.py readers: (questions, documents) from a SQuAD (``{"data": [...]}``) or
    HotpotQA (``[{"question", "answer", "context"}]``) JSON file."""
    require(path is not None, f"{task.name} needs a {task.dataset} JSON file (--qa-file); "
            "it is never downloaded")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read {path} as JSON: {str(e).splitlines()[0]}") from None
    with inconsistent(path, f"{task.dataset} file"):
        qas, docs = (_read_squad if task.dataset == "squad" else _read_hotpot)(data)
        require(len(qas) > 0, "no answerable questions")
    return qas, docs


def _read_squad(data) -> tuple:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    at = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [at[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    gold = at[p["context"]]
                    answers = tuple(str(a["text"]) for a in qa["answers"])
                    require(len(answers) > 0, f"question {qa['question']!r} has no answers")
                    qas.append((str(qa["question"]), answers, (gold,),
                                tuple(i for i in article if i != gold)))
    return qas, docs


def _read_hotpot(data) -> tuple:
    require(isinstance(data, list), "not a list of questions")
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    at = {c: i for i, c in enumerate(docs)}
    qas = [(str(d["question"]), (str(d["answer"]),),
            tuple(at[f"{t}\n{''.join(p)}"] for t, p in d["context"]), ()) for d in data]
    return qas, docs


# --- the builders: (job, rng, haystack size n, pad) -> (parts, the pad's source) ----------
# A builder is called with a fresh rng seeded alike for every n, so its draws for one n are
# the same whatever the pad; the pad (a cut of the source it returns, or of one of the
# sources, tried in turn) ends the haystack.

def _template(task: Task, **fields) -> tuple[str, str, str]:
    """RULER's template for ``task``, cut at its context: (head, question, answer prefix);
    niah with one answer made singular as niah.py does."""
    template, prefix = TEMPLATES[task.kind]
    if task.kind == "niah" and task.queries * task.values == 1:
        def singular(s: str) -> str:
            for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                s = s.replace(a, b)
            return s
        template, prefix = singular(template), singular(prefix)
        fields["type_needle_v"] = fields["type_needle_v"][:-1]
    head, question = template.split("{context}")
    return head.format(**fields), question.format(**fields), prefix.format(**fields)


def _niah(job: _Job, rng: random.Random, n: int, pad: str) -> tuple[_Parts, str]:
    """niah.py: needles "One of the special magic {values} for {key} is: {value}." in a
    noise, essay or needle haystack; the question asks for ``queries`` of the keys."""
    t = job.task
    seen: set = set()
    keys, values, needles = [], [], []
    for _ in range(max(t.keys, t.queries)):
        keys.append(_fresh(rng, t.key, seen))
        values.append([_fresh(rng, t.value, seen) for _ in range(t.values)])
        needles += [NEEDLE.format(type_needle_v=t.value, key=keys[-1], value=v)
                    for v in values[-1]]
    rng.shuffle(needles)
    if t.haystack == "essay":
        haystack, depth = _essay_haystack(job, rng, n, pad, needles)
        # the next words; or, where a cut of them cannot give the count (a character of
        # several tokens), those after one, two or three more
        source = tuple(" " + " ".join(_cycle(job.words, n + i, 24)) for i in range(4))
    else:
        lines, depth = _lines_haystack(t, rng, n, needles, seen)
        haystack, source = "\n".join(lines[:-1]) + pad, "\n" + lines[-1]
    picked = rng.sample(range(len(keys)), t.queries)
    queries = [keys[i] for i in picked]
    answers = tuple(v for i in picked for v in values[i])
    query = (", ".join(queries[:-1]) + ", and " + queries[-1]) if len(queries) > 1 else queries[0]
    head, question, prefix = _template(t, type_needle_v=t.value, query=query)
    return _Parts(head + haystack, question, prefix, answers, depth), source


def _essay_haystack(job: _Job, rng: random.Random, n: int, pad: str,
                    needles: list[str]) -> tuple[str, tuple[float, ...]]:
    """The essay's first ``n`` words (and the pad), split into sentences, each needle
    after the sentences that put it at one of RULER's 40 depths (distinct, drawn)."""
    sentences = _sentences(" ".join(_cycle(job.words, 0, n)).strip() + pad)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    cuts = [0] + [int(len(sentences) * d / 100) for d in depths]
    pieces = []
    for i, needle in enumerate(needles):
        pieces += [" ".join(sentences[cuts[i]:cuts[i + 1]]), needle]
    pieces.append(" ".join(sentences[cuts[-1]:]))
    return " ".join(p for p in pieces if p), tuple(d / 100 for d in depths)


def _lines_haystack(t: Task, rng: random.Random, n: int, needles: list[str],
                    seen: set) -> tuple[list[str], tuple[float, ...]]:
    """``n`` lines of noise, or of distractor needles, with each needle before one of them
    (drawn; a needle before line i sits at depth i / n), then one more line (the pad's
    source: a cut of it, never whole, may end the haystack)."""
    if t.haystack == "noise":
        lines = [NOISE] * (n + 1)
    else:
        lines = [NEEDLE.format(type_needle_v=t.value, key=_fresh(rng, t.key, seen),
                               value=_fresh(rng, t.value, seen)) for _ in range(n + 1)]
    at = sorted(rng.sample(range(n), len(needles)), reverse=True)
    for i, needle in zip(at, needles):
        lines.insert(i, needle)
    return lines, tuple(sorted(i / n for i in at))


def _chains(rng: random.Random, chains: int, hops: int, letters: int,
            value: str | None = None) -> tuple[list[list[str]], list[list[str]]]:
    """variable_tracking.py: ``chains`` chains "VAR A = 12345", "VAR B = VAR A ", ... of
    distinct ``letters``-letter names; (names, lines) per chain."""
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    per = [names[i:i + hops + 1] for i in range(0, len(names), hops + 1)]
    lines = [[f"VAR {c[0]} = {value or rng.randrange(10000, 99999)}"]
             + [f"VAR {c[j + 1]} = VAR {c[j]} " for j in range(hops)] for c in per]
    return per, lines


def _vt_text(rng: random.Random, n: int, chains: list[list[str]], pad: str = "") -> str:
    """The noise haystack of ``n`` lines with each chain's lines in order at drawn places."""
    lines = [NOISE] * n
    for chain in chains:
        at = sorted(rng.sample(range(len(lines)), len(chain)))
        for j, (i, line) in enumerate(zip(at, chain)):
            lines.insert(i + j, line)
    return ("\n".join(lines) + pad).replace(". \n", ".\n")


def _vt(job: _Job, rng: random.Random, n: int, pad: str) -> tuple[_Parts, str]:
    """variable_tracking.py: a few-shot example (``job.extra["icl"]``, made once per sample)
    then the task over a noise haystack; the answers are the first chain's names."""
    t = job.task
    names, chains = _chains(rng, t.chains, t.hops, 5)
    value = chains[0][0].split("=")[-1].strip()
    head, question, prefix = _template(t, query=value, num_v=t.hops + 1)
    context = job.extra["icl"] + "\n" + head + _vt_text(rng, n, chains, pad)
    return _Parts(context, question, prefix, tuple(names[0])), "\n" + NOISE


def _vt_example(t: Task, rng: random.Random, n: int) -> str:
    """RULER's few-shot example for vt: 3-letter names, the full template, its answer."""
    names, chains = _chains(rng, t.chains, t.hops, 3, str(rng.randrange(10000, 99999)))
    value = chains[0][0].split("=")[-1].strip()
    head, question, prefix = _template(t, query=value, num_v=t.hops + 1)
    return head + _vt_text(rng, n, chains) + question + prefix + " " + " ".join(names[0]) + "\n"


def _cwe_list(rng: random.Random, pool: tuple[str, ...], n: int, repeats: tuple[int, int],
              num_cw: int) -> tuple[str, list[str], list[str]]:
    """common_words_extraction.py's get_example: ``n`` distinct words, the first ``num_cw``
    repeated ``repeats[0]`` times, the others ``repeats[1]``, shuffled, numbered."""
    chosen = rng.sample(pool, n)
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    items = common * repeats[0] + uncommon * repeats[1]
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common, uncommon


def _cwe(job: _Job, rng: random.Random, n: int, pad: str) -> tuple[_Parts, str]:
    """common_words_extraction.py: one worked example, then a list of ``n`` distinct words
    (``num_cw`` common ones); the answers are the common words."""
    t, pool = job.task, _cwe_words()
    full = job.length >= CWE_FULL_FROM
    head, question, prefix = _template(t)
    example, shown, _ = _cwe_list(rng, pool, 40 if full else 20, (10, 3) if full else (3, 1),
                                  t.num_cw)
    shot = head + example + question + prefix + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(shown))
    listed, common, uncommon = _cwe_list(rng, pool, n, (t.freq_cw, t.freq_ucw) if full
                                         else (6, 1), t.num_cw)
    size = len(common) * (t.freq_cw if full else 6) + len(uncommon) * (t.freq_ucw if full else 1)
    more = [rng.choice(uncommon or common) for _ in range(4)]
    source = "".join(f" {size + i + 1}. {w}" for i, w in enumerate(more))
    return _Parts(shot + "\n" + head + listed + pad, question, prefix, tuple(common)), source


@functools.lru_cache(maxsize=None)
def _zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann's zeta(alpha), alpha > 1 (Euler-Maclaurin; RULER calls scipy's)."""
    head = math.fsum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + terms ** -alpha / 2 \
        + alpha * terms ** (-alpha - 1) / 12


def _fwe_counts(t: Task, vocab: int, n: int) -> list[int]:
    """freq_words_extraction.py: word k of the vocabulary n * k^-alpha / zeta(alpha) times."""
    return [int(n * k ** -t.alpha / _zeta(t.alpha)) for k in range(1, vocab + 1)]


def _fwe(job: _Job, rng: random.Random, n: int, pad: str) -> tuple[_Parts, str]:
    """freq_words_extraction.py: random 6-letter coded words with Zipf counts, the most
    frequent replaced by "..." (noise); the answers are the next three."""
    t = job.task
    size = (job.length - t.tokens_to_generate) // 50
    vocab: list[str] = []
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)
    vocab.sort()
    rng.shuffle(vocab)
    vocab[0] = "..."
    words = [w for w, c in zip(vocab, _fwe_counts(t, size, n)) for _ in range(c)]
    rng.shuffle(words)
    head, question, prefix = _template(t)
    return (_Parts(head + " ".join(words) + pad, question, prefix, tuple(vocab[1:4])),
            " ..." * 64)


def _qa(job: _Job, rng: random.Random, n: int, pad: str) -> tuple[_Parts, str]:
    """qa.py: the question's own documents (and, for SQuAD, its article's others) among
    drawn distractors, ``n`` in all, shuffled and numbered."""
    qas, docs = job.qa
    query, answers, gold, article = qas[job.index]
    gold, article = list(gold), list(article)
    if n < len(docs):
        if n - len(gold) > len(article):
            taken = set(gold + article)
            others = [i for i in range(len(docs)) if i not in taken]
            picked = gold + article + rng.sample(others, n - len(gold) - len(article))
        else:
            picked = gold + rng.sample(article, n - len(gold))
    else:
        picked = _cycle(range(len(docs)), 0, n)
    texts = [docs[i] for i in picked]
    rng.shuffle(texts)
    head, question, prefix = _template(job.task, query=query)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(texts))
    source = tuple("\n\n" + DOCUMENT.format(i=n + 1, document=docs[rng.randrange(len(docs))])
                   for _ in range(2))
    return _Parts(head + context + pad, question, prefix, answers), source


BUILDERS: dict[str, Callable] = {"niah": _niah, "variable_tracking": _vt,
                                 "common_words_extraction": _cwe, "freq_words_extraction": _fwe,
                                 "qa": _qa}


# --- exact lengths --------------------------------------------------------------------------

class _Fitter:
    """Counts a sample's tokens for a haystack size and a pad, memoized; finds the size and
    pad that make the input exactly ``target`` tokens."""

    def __init__(self, policy, build: Callable[[int, str], tuple[_Parts, str | tuple]],
                 target: int):
        self.policy, self.build, self.target = policy, build, target
        self.memo: dict[tuple[int, str], tuple[int, _Parts, str | tuple]] = {}

    def count(self, n: int, pad: str = "") -> int:
        if (n, pad) not in self.memo:
            parts, source = self.build(n, pad)
            self.memo[n, pad] = (len(self.policy.encode(parts.text)), parts, source)
        return self.memo[n, pad][0]

    def size(self, lo: int, most: int | None, hint: int | None) -> int:
        """The largest n >= lo with count(n) <= target where count(n + 1) > target (or n is
        ``most``): interpolation between the bounds, bisection after a few tries; count is
        about linear in n."""
        target, count = self.target, self.count
        a, b = lo, None
        f_lo = count(lo)
        guess, tries = (hint if hint is not None else lo + 8), 0
        while (b is None or b - a > 1) and a != most:
            top = b - 1 if b is not None else (most if most is not None else None)
            guess = max(a + 1, guess if top is None else min(guess, top))
            if count(guess) <= target:
                a = guess
            else:
                b = guess
            tries += 1
            if b is not None and tries > 6:
                guess = (a + b) // 2
                continue
            fa = count(a)
            if b is None:
                rate = (fa - f_lo) / (a - lo) if a > lo else 1.0
            else:
                rate = (count(b) - fa) / (b - a)
            guess = a + max(1, int((target - fa) / max(rate, 1e-9)))
            if b is None:
                guess = min(guess, 4 * a + 64)  # a wild rate never asks for a huge text
        return a

    def pad(self, n: int) -> _Parts | None:
        """The sample of size n padded with a proper prefix (in tokens) of its pad source
        (of one of them, in turn) to exactly ``target`` tokens, or None where none does."""
        self.count(n)
        sources = self.memo[n, ""][2]
        for source in (sources,) if isinstance(sources, str) else sources:
            parts = self._cut(n, self.policy.encode(source))
            if parts is not None:
                return parts
        return None

    def _cut(self, n: int, ids: list[int]) -> _Parts | None:
        base = self.count(n)
        tried: set[int] = set()
        k = self.target - base
        for _ in range(8):  # Newton steps: a token of pad is about a token
            k = min(max(k, 0), len(ids) - 1)
            if k in tried:
                break
            tried.add(k)
            pad = self.policy.decode(ids[:k])
            got = self.count(n, pad)
            if got == self.target and not pad.endswith("\ufffd"):
                return self.memo[n, pad][1]
            k += self.target - got
        near = sorted(range(len(ids)), key=lambda j: abs(j - (self.target - base)))
        for j in [j for j in near if j not in tried][:12]:
            pad = self.policy.decode(ids[:j])
            if self.count(n, pad) == self.target and not pad.endswith("\ufffd"):
                return self.memo[n, pad][1]
        return None


def _minimum(t: Task, job: _Job) -> tuple[int, int | None]:
    """The smallest and largest haystack sizes the task's builder takes."""
    if t.kind == "niah":
        return (1 if t.haystack == "essay" else max(t.keys, t.queries) * t.values), None
    if t.kind == "variable_tracking":
        return t.chains * (t.hops + 1), None
    if t.kind == "common_words_extraction":
        return t.num_cw + 1, len(_cwe_words())
    if t.kind == "freq_words_extraction":  # the three answers' counts distinct, above the 5th
        size = (job.length - t.tokens_to_generate) // 50
        require(size >= 5, f"fwe needs at least {5 * 50 + t.tokens_to_generate} tokens, "
                f"got {job.length}")
        n = 1
        while not all(a > b for a, b in zip(_fwe_counts(t, 5, n)[1:], _fwe_counts(t, 5, n)[2:])):
            n += 1
        return n, None
    return len(job.qa[0][job.index][2]), None


def _seed(task: str, seed: int, index: int, what: str = "") -> int:
    """A sample's own seed: the same (task, seed, index) give the same at every length, so
    a sample's keys and values are the same at every length."""
    text = f"ruler/{task}/{seed}/{index}/{what}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def _sample(policy, job: _Job, hint: int | None) -> tuple[Sample, int]:
    t = job.task
    target = job.length - t.tokens_to_generate
    build = BUILDERS[t.kind]
    if t.kind == "variable_tracking":
        job.extra["icl"] = _vt_icl(policy, job)

    def make(n: int, pad: str) -> tuple[_Parts, str]:
        return build(job, random.Random(_seed(t.name, job.seed, job.index)), n, pad)

    fit = _Fitter(policy, make, target)
    lo, most = _minimum(t, job)
    if fit.count(lo) > target:
        raise UserError(f"{t.name} needs more than {job.length} tokens: its shortest input is "
                        f"{fit.count(lo)} tokens, and {t.tokens_to_generate} are generated")
    n = fit.size(lo, most, hint)
    for size in range(n, max(lo, n - 4) - 1, -1):
        parts = fit.pad(size)
        if parts is not None:
            break
    else:
        if most is not None and n == most:
            raise UserError(f"{t.name} at {job.length} tokens needs more distinct words "
                            f"than its word list has ({most})")
        raise RuntimeError(f"cannot make {t.name} sample {job.index} exactly {target} "
                           f"tokens long (haystack {n}: {fit.count(n)} tokens)")
    sample = Sample(t.name, job.length, job.seed, job.index, parts.context, parts.question,
                    parts.answer_prefix, parts.answers, len(policy.encode(parts.text)),
                    parts.depth)
    assert sample.n_tokens == target, (sample.n_tokens, target)
    return sample, n


def _vt_icl(policy, job: _Job) -> str:
    """vt's few-shot example: the most noise lines that keep it within VT_ICL_TOKENS."""
    t = job.task

    def make(n: int, pad: str) -> tuple[_Parts, str]:
        del pad
        text = _vt_example(t, random.Random(_seed(t.name, job.seed, job.index, "icl")), n)
        return _Parts(text, "", "", ()), ""

    fit = _Fitter(policy, make, VT_ICL_TOKENS)
    lo = t.chains * (t.hops + 1)
    n = lo if fit.count(lo) > VT_ICL_TOKENS else fit.size(lo, None, None)
    return fit.memo[n, ""][1].context


# --- the public API -----------------------------------------------------------------------

def generate(policy, task: str, length: int, count: int, seed: int = 0,
             essay: str | None = None, qa_file: str | None = None) -> list[Sample]:
    """``count`` samples of ``task`` whose inputs are each exactly ``length`` minus the
    task's tokens to generate long in ``policy``'s tokens. ``essay``: a text file (or
    RULER's JSON with a ``text`` field) for the essay haystack, Python's help topics by
    default; ``qa_file``: the SQuAD (qa_1) or HotpotQA (qa_2) JSON file qa needs."""
    t = TASKS.get(task)
    require(t is not None, f"unknown RULER task {task!r}; expected one of {', '.join(TASKS)}")
    require(isinstance(count, int) and count >= 1, f"count must be >= 1, got {count}")
    require(isinstance(length, int) and length > t.tokens_to_generate,
            f"{task} needs a length above its {t.tokens_to_generate} tokens to generate, "
            f"got {length}")
    words = _essay_words(essay) if t.haystack == "essay" else ()
    qa = _read_qa(qa_file, t) if t.kind == "qa" else ()
    if qa:
        require(count <= len(qa[0]), f"{qa_file} has {len(qa[0])} questions, "
                f"fewer than the {count} samples asked for")
    samples, hint = [], None
    for index in range(count):
        sample, hint = _sample(policy, _Job(t, length, seed, index, words, qa), hint)
        samples.append(sample)
    return samples


def to_json(sample: Sample) -> dict:
    return {"task": sample.task, "length": sample.length, "seed": sample.seed,
            "index": sample.index, "context": sample.context, "question": sample.question,
            "answer_prefix": sample.answer_prefix, "answers": list(sample.answers),
            "n_tokens": sample.n_tokens, "depth": list(sample.depth)}


def write_jsonl(samples, path) -> None:
    """One JSON object a line (``to_json``), UTF-8."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for s in samples:
            f.write(json.dumps(to_json(s), ensure_ascii=False) + "\n")
