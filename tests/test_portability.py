"""The suite passes on every machine a user has and on the transformers installed: Hugging
Face's forward is called through one function that passes the cache by the name the
installed release takes, a deprecation at any of our calls fails the suite, and no test
compares numbers with a bound tuned on one machine (tests/tolerance.py states them)."""
import ast
import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers.utils.deprecation import deprecate_kwarg

import positronic_brain
from positronic_brain.model import cache_kwarg, hf_forward

PACKAGE = Path(positronic_brain.__file__).parent
TESTS = Path(__file__).parent


class _Renamed(torch.nn.Module):
    """A forward as transformers 5.24 declares it: ``cache``, the old name deprecated."""

    @deprecate_kwarg("past_key_values", "99.0", new_name="cache")
    def forward(self, input_ids=None, cache=None, **kwargs):
        return input_ids, cache, kwargs


class _Before(torch.nn.Module):
    """A forward as transformers before 5.24 declares it."""

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return input_ids, past_key_values, kwargs


@pytest.mark.parametrize("module", [_Renamed(), _Before()])
def test_the_cache_reaches_the_forward_by_the_name_it_takes(module):
    cache = object()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, got, rest = hf_forward(module, torch.tensor([[1]]), cache, use_cache=True)
    assert got is cache and rest == {"use_cache": True} and ids.tolist() == [[1]]
    assert cache_kwarg(module) == ("cache" if isinstance(module, _Renamed) else "past_key_values")


def test_a_deprecated_keyword_fails_the_suite():
    """pyproject.toml makes deprecation and future warnings errors: the old name passed to a
    release that deprecates it fails the test that passes it."""
    with pytest.raises(FutureWarning, match="past_key_values"):
        _Renamed()(input_ids=torch.tensor([[1]]), **{"past_key_values": object()})
    with pytest.raises(DeprecationWarning):
        warnings.warn("old", DeprecationWarning)


def _names_the_old_keyword(tree: ast.AST) -> list[int]:
    """Lines that pass ``past_key_values=`` or read ``.past_key_values``."""
    return [node.lineno for node in ast.walk(tree)
            if (isinstance(node, ast.keyword) and node.arg == "past_key_values")
            or (isinstance(node, ast.Attribute) and node.attr == "past_key_values")]


def test_no_code_passes_the_cache_by_a_name_of_its_own():
    """Only ``model.cache_kwarg`` names the keyword (as a string, for the release that
    takes it); no call passes it and no code reads it from an output."""
    offenders = [f"{path}:{line}" for folder in (PACKAGE, TESTS)
                 for path in sorted(folder.rglob("*.py"))
                 for line in _names_the_old_keyword(ast.parse(path.read_text()))]
    assert not offenders, offenders
    assert _names_the_old_keyword(ast.parse("m(past_key_values=c)\nout.past_key_values"))


# A literal that is a bound: 1e-5, 2.5e-3, a bfloat16 step by hand (2 ** -7), atol=0.01
# (atol=0 and rtol=0 are no bound)
BOUND = re.compile(r"\d(\.\d+)?e-\d+\b|\b2 *\*\* *-\d"
                   r"|\b(atol|rtol|abs|rel)=(?!0*\.?0*[,)])\d*\.?\d+(e-?\d+)? *[,)]")
# lines where such a literal is a hyperparameter, not a bound: an RMSNorm's eps, a learning
# rate, a ridge
NOT_A_BOUND = re.compile(r"\beps=|rms_norm\(|\blr=|\bridge\b")


def test_no_test_compares_with_a_bound_of_its_own():
    """Every bound comes from tests/tolerance.py (its error model or its stated contract),
    or the comparison is bit-exact: no literal bound, tuned on one machine, in tests/."""
    offenders = [f"{path.name}:{i}: {line.strip()}" for path in sorted(TESTS.glob("*.py"))
                 if path.name not in ("tolerance.py", Path(__file__).name)
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if BOUND.search(line.split("#")[0]) and not NOT_A_BOUND.search(line)]
    assert not offenders, "\n".join(offenders)
    for bound in ("x <= 1e-5", "f(atol=1e-4)", "2 ** -7 * y", "approx(y, abs=0.01)",
                  "approx(y, rel=5e-3)", "f(atol=2)"):
        assert BOUND.search(bound), bound
    for fine in ("f(rtol=0, atol=0.0)", "f(atol=tol)", "f(rtol=4 * step(F32))", "D ** -0.5",
                 "10 ** -6 / 2", "F.rms_norm(x, (8,), eps=1e-5)", "f(lr=3e-3)"):
        assert not BOUND.search(fine) or NOT_A_BOUND.search(fine), fine
