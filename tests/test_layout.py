"""The code's shape: jaxchat's modules import no circle and only point down its layers (deferred imports
inside functions count too), scripts are leaves (nothing imports one, none imports another), every module imports."""

import ast
import importlib
import os

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(package: str) -> list[str]:
    """Every module of package, its subpackages' included (not the __init__ files: docstrings only)."""
    found = []
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, package)):
        prefix = os.path.relpath(folder, REPO_ROOT).replace(os.sep, ".")
        found += [f"{prefix}.{name[:-3]}" for name in files if name.endswith(".py") and name != "__init__.py"]
    return sorted(found)


# jaxchat's layers, lowest first (README's Layout): a module imports only from its own layer or those below, so
# that the model and the optimizer know nothing of training, and checkpointing nothing of the model's maths
# beyond its config. Top-level modules: storage (every file of the base dir, local or gs://; imports nothing of
# jaxchat), common (everything's), and the two commands nanochat's users know, `python -m jaxchat.dataset` (over data) and
# `python -m jaxchat.report` (a run's report: beside evaluation).
LAYERS = ["storage", "common", "distributed", "model", "optim", "data", "dataset", "checkpoint", "eval", "report", "train",
          "export", "compiled"]


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def imported(module: str) -> set[str]:
    """Every module name `module` imports anywhere in its source (top level or inside a function)."""
    with open(os.path.join(REPO_ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from jaxchat import x`
    return names


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_jaxchat_imports_no_circle():
    names = modules("jaxchat")
    graph = {m: {n for n in imported(m) if n in names and n != m} for m in names}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_jaxchat_imports_only_point_down():
    names = modules("jaxchat")
    assert {m.split(".")[1] for m in names} == set(LAYERS), "a new package or top-level module: give it a layer"
    upward = [(m, n) for m in names for n in imported(m) if n in names and layer(n) > layer(m)]
    assert not upward, upward


def test_scripts_are_leaves():
    for module in modules("jaxchat") + modules("scripts"):
        assert not {n for n in imported(module) if n == "scripts" or n.startswith("scripts.")}, module


# jaxchat.export.hf_modeling is the exported model's code: it imports torch and transformers (the hf extra, ~5 s),
# and tests/test_hf_export.py imports and runs it, where the extra is installed
IMPORTABLE = [m for m in modules("jaxchat") + modules("scripts") if m != "jaxchat.export.hf_modeling"]
RUN_AT_IMPORT = ("scripts.tok_train", "scripts.tok_eval")  # their work runs at import (no main)


@pytest.mark.parametrize("module", IMPORTABLE)
def test_every_module_imports(module):
    if module in RUN_AT_IMPORT:
        pytest.skip("runs its work at import (no main)")
    importlib.import_module(module)


def test_every_command_prints_its_help(capsys):
    """`python -m <module> --help` of each module with a main(argv): its usage, status 0. (argparse %-formats
    help texts: a bare % in one made scripts.train's and scripts.gpu_check's --help raise TypeError.)"""
    commands = 0
    for module in IMPORTABLE:
        if module in RUN_AT_IMPORT:
            continue
        main = getattr(importlib.import_module(module), "main", None)
        if main is None:
            continue
        with pytest.raises(SystemExit) as stopped:
            main(["--help"])
        assert stopped.value.code == 0, module
        assert capsys.readouterr().out.startswith("usage: "), module
        commands += 1
    assert commands >= 9  # the scripts' and python -m jaxchat.dataset / jaxchat.report


MAX_FUNCTION_LINES = 80  # a function longer than a screen or so is several functions


def test_no_function_is_longer_than_a_screen():
    long = []
    for module in modules("jaxchat") + modules("scripts"):
        with open(os.path.join(REPO_ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
            tree = ast.parse(f.read())
        long += [(module, node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long
