"""Every example in densefit's docstrings runs and prints what it says it prints.

A docstring's ``>>>`` lines are a claim about the code, read by whoever calls it; run here,
a wrong one fails like any other test. A module whose optional extra is not installed is
skipped, naming the missing package.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import densefit

MODULES = sorted(  # __main__ runs the CLI when imported: it has no examples
    info.name
    for info in pkgutil.walk_packages(densefit.__path__, prefix="densefit.")
    if not info.name.endswith(".__main__")
)


def run_doctests(module) -> tuple[int, str]:
    """(examples found, skipped ones included; the failures' report) of every docstring
    example in ``module``."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    found = 0
    for test in finder.find(module, module.__name__):
        found += len(test.examples)
        runner.run(test, out=report.append)
    return found, "".join(report)


def has_examples(name: str) -> bool:
    """Whether module ``name``'s source holds ``>>>`` lines (read without importing it)."""
    return ">>>" in (importlib.util.find_spec(name).loader.get_source(name) or "")


def test_the_package_has_modules_with_examples():
    with_examples = [name for name in MODULES if has_examples(name)]
    assert "densefit.retrieval.encode" in with_examples and len(with_examples) > 20


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("densefit"):
            pytest.skip(f"{name} needs {exc.name} (an optional extra)")
        raise
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    found, report = run_doctests(module)
    assert not report, f"{name}: a docstring example failed:\n{report}"
    if has_examples(name):
        assert found > 0, f"{name} has >>> lines that doctest did not find"


def test_a_wrong_example_fails():
    """The check above sees a failing example (it is not satisfied by finding none)."""
    import types

    module = types.ModuleType("densefit_fake")
    module.__doc__ = ">>> 1 + 1\n3\n"
    found, report = run_doctests(module)
    assert found == 1 and "Expected:\n    3\nGot:\n    2" in report
