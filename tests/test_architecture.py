"""Architecture rule: only stage 0/4 (``stages/apply.py``) writes to an arena, a ledger, a
view of them, or a state's scalars. A static check over the package's source; the
property tests check the same rule at run time with tensor version counters."""
import ast
from pathlib import Path

import positronic_brain

PACKAGE = Path(positronic_brain.__file__).parent
WRITER = PACKAGE / "stages" / "apply.py"
OWNERS = ("arena", "ledger", "view", "state")  # receivers whose contents only stage 0/4 may change


def _owned(expr: ast.AST) -> bool:
    """Does ``expr`` reach into an arena, ledger, view or state? (``state.arena.k[...]``,
    ``view.k``, ``self.state.ledger.brightness``, ``arena.n``, ...)"""
    text = ast.unparse(expr).lower()
    parts = [p.split("[")[0] for p in text.split(".")]
    return any(p.endswith(OWNERS) for p in parts)


def _writes(tree: ast.AST):
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Subscript) and _owned(el.value):
                    yield node.lineno, ast.unparse(el)
                elif isinstance(el, ast.Attribute) and _owned(el.value):
                    yield node.lineno, ast.unparse(el)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr.endswith("_") and not node.func.attr.startswith("_") \
                and _owned(node.func.value):  # in-place tensor ops: copy_, zero_, index_put_, ...
            yield node.lineno, ast.unparse(node.func)


def test_only_stage_0_4_writes_arena_mirror_or_state():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == WRITER:
            continue
        for line, what in _writes(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(PACKAGE)}:{line}: {what}")
    assert not offenders, "writes outside stages/apply.py:\n" + "\n".join(offenders)


def test_the_rule_catches_writes():
    """The checker itself: each of these must be flagged, and the reads must not."""
    bad = ["state.arena.k[:, :, 0] = 0", "view.brightness[3] += 1", "a = state.ledger.uid.zero_()",
           "self.state.pending_token = 5", "state.ledger.n = 0", "arena.v.copy_(x)"]
    for src in bad:
        assert list(_writes(ast.parse(src))), src
    ok = ["x = state.arena.k[:, :, 0]", "new_k[i] = k", "self.state = prime()", "y = view.k.sum()",
          "attention[i] = p", "scores = view.brightness.clone()"]
    for src in ok:
        assert not list(_writes(ast.parse(src))), src


LONGEST = 80  # lines a function of the package may take, outside the benchmarks


def test_no_function_outside_the_benchmarks_is_longer_than_a_screen():
    """A function longer than ``LONGEST`` lines (its docstring included) is several jobs
    in one: ``forward`` grew to 221 with every feature's flags before it was split."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "bench" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} {lines}")
    assert not long, f"functions over {LONGEST} lines: {long}"
