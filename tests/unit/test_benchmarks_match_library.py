"""Benchmarks are code too: every call a benchmark script makes into fp8dist must fit the function it calls (the
audit's `measure()` once gained a required argument and benchmarks/memory.py kept calling it without; `python
benchmarks/run.py` then exited 2). Checked statically, in seconds: each call's positional count and keyword names
are bound against the real signature. Benchmarks never import from tests."""
import ast
import importlib
import inspect

import pytest

from tests.conftest import ROOT

SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def _imports(body) -> dict[str, str]:
    """local name -> dotted fp8dist path, for the imports directly in `body` (not in nested functions)."""
    names, stack = {}, list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp8dist"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fp8dist") and alias.asname:
                    names[alias.asname] = alias.name
        stack.extend(ast.iter_child_nodes(node))
    return names


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ImportError(dotted)


def _calls(node, names: dict[str, str]):
    """(dotted target, call) for every call of an imported fp8dist name, each function seeing its own imports over
    the enclosing ones."""
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
        names = {**names, **_imports(node.body)}
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Call):
            func = child.func
            if isinstance(func, ast.Name) and func.id in names:
                yield names[func.id], child
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names:
                yield f"{names[func.value.id]}.{func.attr}", child
        yield from _calls(child, names)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_calls_fit_the_library(script):
    tree = ast.parse(script.read_text(), str(script))
    assert not any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tests") for n in ast.walk(tree)), \
        f"{script.name} imports from tests"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            for dotted in _imports(node.body).values():
                _resolve(dotted)  # every fp8dist name a benchmark imports exists
    for dotted, call in _calls(tree, {}):
        target = _resolve(dotted)
        if not callable(target) or inspect.isclass(target) and not hasattr(target, "__init__"):
            continue
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue  # *args / **kwargs: not checkable statically
        signature = inspect.signature(target)
        try:
            signature.bind(*range(len(call.args)), **{k.arg: None for k in call.keywords})
        except TypeError as exc:
            pytest.fail(f"{script.name}:{call.lineno}: {dotted}{signature} does not take this call: {exc}")
