"""Architecture rule: only stage 0/4 (the package ``stages/apply/``) writes to an arena,
a ledger, a view of them, or a state's scalars. A static check over the package's source; the
property tests check the same rule at run time with tensor version counters."""
import argparse
import ast
import dataclasses
from pathlib import Path

import positronic_brain
from positronic_brain import options
from positronic_brain.types import CacheParams

PACKAGE = Path(positronic_brain.__file__).parent
WRITER = PACKAGE / "stages" / "apply"  # the writers' package
OWNERS = ("arena", "ledger", "view", "state")  # receivers whose contents only stage 0/4 may change


def _owned(expr: ast.AST) -> bool:
    """Does ``expr`` reach into an arena, ledger, view or state? (``state.arena.k[...]``,
    ``view.k``, ``self.state.ledger.uid``, ``arena.n``, ...)"""
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
        if path.parent == WRITER:
            continue
        for line, what in _writes(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(PACKAGE)}:{line}: {what}")
    assert not offenders, "writes outside stages/apply/:\n" + "\n".join(offenders)


def test_the_rule_catches_writes():
    """The checker itself: each of these must be flagged, and the reads must not."""
    bad = ["state.arena.k[:, :, 0] = 0", "view.position[3] += 1", "a = state.ledger.uid.zero_()",
           "self.state.pending_token = 5", "state.ledger.n = 0", "arena.v.copy_(x)"]
    for src in bad:
        assert list(_writes(ast.parse(src))), src
    ok = ["x = state.arena.k[:, :, 0]", "new_k[i] = k", "self.state = prime()", "y = view.k.sum()",
          "attention[i] = p", "scores = view.position.clone()"]
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


def test_cache_params_holds_what_every_run_shares_and_a_field_per_piece():
    """At most 10 fields: budget, sinks, recent, pinned, and one per piece
    (positions, scorer, prefill, allocation, repair, recall); each piece's own options live in it."""
    fields = [f.name for f in dataclasses.fields(CacheParams)]
    assert len(fields) <= 10, fields
    assert set(fields) == {"budget", "sinks", "recent", "pinned", "allocation", "positions", "scorer",
                           "prefill", "repair", "recall"}


def test_the_options_page_is_made_from_the_code():
    """docs/OPTIONS.md is ``options.reference()``: regenerate it with
    ``python -m positronic_brain.options > docs/OPTIONS.md``."""
    assert (PACKAGE.parent / "docs" / "OPTIONS.md").read_text() == options.reference()


def test_every_cache_flag_comes_from_a_field():
    """The cache flags of run, chat and fork are the options (``options.NAMES``): no flag is
    added by hand beside them, so each is stated once."""
    from positronic_brain.cli.args import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("run", "chat", "fork"):
        group = next(g for g in sub.choices[command]._action_groups
                     if g.title.startswith("cache"))
        dests = {a.dest for a in group._group_actions}
        assert dests == set(options.NAMES), command


def test_the_loop_names_no_scorer_column():
    """A scorer's per-token state is its own: the ledger, the stages, the loop and the file
    formats handle scorer columns by the names scorers declare, never by a built-in's
    (brightness's ``brightness``, H2O's ``attn_sum``) in code."""
    core = [PACKAGE / name for name in ("state.py", "types.py", "loop.py", "capture.py",
                                        "replay.py", "session_io.py", "compose.py",
                                        "transfer.py", "graph.py", "forward.py")]
    core += sorted((PACKAGE / "stages").rglob("*.py"))
    offenders = []
    for path in core:
        tree = ast.parse(path.read_text())
        default = {id(n.value) for n in ast.walk(tree)  # ``name = "brightness"``: a scorer's
                   if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "name"}
        for node in ast.walk(tree):
            if id(node) in default:
                continue
            named = (node.value if isinstance(node, ast.Constant) else
                     node.attr if isinstance(node, ast.Attribute) else None)
            if named in ("attn_sum", "brightness"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {named}")
    assert not offenders, "scorer columns named outside their scorers:\n" + "\n".join(offenders)


def test_every_bench_flag_comes_from_a_field():
    """``bench KIND``'s flags are the shared ones and one per field of its config (and of
    ``flags.Workers``) that carries a help string, made by ``bench.flags``: no flag is
    added by hand, no list allows or refuses another benchmark's (argparse does)."""
    from positronic_brain.bench import flags, passkey
    from positronic_brain.cli import args, commands
    from positronic_brain.cli.args import BENCHES, build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    kinds = next(a for a in sub.choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    assert set(kinds.choices) == set(BENCHES) == {"speed", "quality", "passkey", "ruler",
                                                  "transfer"}
    for name, module in BENCHES.items():
        dests = [a.dest for a in kinds.choices[name]._actions if a.option_strings
                 and a.dest != "help"]
        assert dests[:len(flags.SHARED)] == list(flags.SHARED), name
        assert dests[len(flags.SHARED):] == flags.names(module.FLAGS), name
        assert module.FLAGS[0].__name__.endswith("Config") and set(module.FLAGS[1:]) <= {
            flags.Workers}, name
        for f in flags.flags_of(module.FLAGS):
            assert f.field in {d.name for d in dataclasses.fields(f.owner)}, (name, f.name)
            assert f.quick in (None, f.default) or "--quick" in f.help + flags._defaults(f)
    gone = [(args, "QUALITY_ONLY"), (commands, "QUALITY_ONLY"), (passkey, "OWN_OPTIONS"),
            (passkey, "QUALITY_OPTIONS"), (passkey, "refuse_own"), (passkey, "add_args")]
    assert not [n for m, n in gone if hasattr(m, n)]
