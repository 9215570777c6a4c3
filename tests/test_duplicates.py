"""No block of six or more code lines is repeated in two modules of the package: the same
lines, stripped, after dropping blank lines, comments, docstrings, imports and the lines of
a definition's signature (what pylint's ``duplicate-code`` compared with this project's
settings, without pylint)."""
import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

import positronic_brain

PACKAGE = Path(positronic_brain.__file__).parent
LINES = 6


def code_lines(source: str) -> list[tuple[int, str]]:
    """(line number, stripped text) of each line of ``source`` that is code: not blank, not
    a comment, a docstring, an import or part of a signature (decorators to the body)."""
    skip = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            continue
        first = node.body[0] if node.body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            skip.update(range(first.lineno, first.end_lineno + 1))
        if not isinstance(node, ast.Module):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            skip.update(range(start, node.body[0].lineno))
    text = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text[row - 1] = text[row - 1][:col]
    return [(i, t.strip()) for i, t in enumerate(text, 1) if i not in skip and t.strip()]


def repeated(files: dict[str, str]) -> list[list[tuple[str, int]]]:
    """Each block of ``LINES`` code lines found in two or more of ``files`` (name ->
    source), as the places it starts."""
    seen = defaultdict(list)
    for name, source in files.items():
        lines = code_lines(source)
        for k in range(len(lines) - LINES + 1):
            seen["\n".join(t for _, t in lines[k:k + LINES])].append((name, lines[k][0]))
    return [places for places in seen.values() if len({n for n, _ in places}) > 1]


def test_no_block_of_six_lines_is_repeated_in_the_package():
    files = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert not repeated(files), repeated(files)[:5]


def test_the_check_finds_a_block_under_other_comments_and_docstrings():
    block = "\n".join(f"    x{i} = f({i}, y)" for i in range(LINES))
    a = f'def a(y):\n    """One."""\n{block}\n    return x0\n'
    b = f'import os\n\n\n@deco\ndef b(y,\n      z):\n    # its own\n{block.replace(")", ")  # note")}\n'
    assert [sorted(p) for p in repeated({"a.py": a, "b.py": b})] == [[("a.py", 3), ("b.py", 8)]]
    shorter = "\n".join(block.splitlines()[:LINES - 1])
    assert not repeated({"a.py": a, "c.py": f"def c(y):\n{shorter}\n"})
