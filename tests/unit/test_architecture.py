"""The layers of docs/architecture.md, kept true: imports only go down (config -> translate -> formats -> backends
-> engines -> runtime -> audit -> estimate -> commands), there are no import circles, and both count imports inside
functions too. Modules outside the layers (the facts at the root: the facts package, dtypes, errors, machine; the
rank helpers, distributed; the package's facade and composition root __init__; cli; the integrations facade) are
checked for circles only; the facts package also imports nothing else of fp8dist."""
import ast

from tests.conftest import ROOT

LAYERS = ("config", "translate", "formats", "backends", "engines", "runtime", "audit", "estimate", "commands")
PACKAGE = ROOT / "fp8dist"


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return out


def edges(found: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the fp8dist modules it imports (a package import counts as its __init__)."""
    def resolve(name: str) -> str | None:
        return name if name in found else name + ".__init__" if name + ".__init__" in found else None

    out = {}
    for name, tree in found.items():
        package = name.split(".")[:-1]
        targets = set()
        for node in ast.walk(tree):
            imported = []
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                imported = [base] + [f"{base}.{alias.name}" for alias in node.names]
            targets.update(t for t in map(resolve, imported) if t and t != name)
        out[name] = targets
    return out


def layer(module: str) -> int | None:
    for part in module.split(".")[1:]:
        if part in LAYERS:
            return LAYERS.index(part)
    return None


def test_imports_only_go_down():
    graph = edges(modules())
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = edges(modules())
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_every_package_module_is_in_a_layer_or_a_known_root_module():
    outside = {name for name in modules() if layer(name) is None and not name.startswith("fp8dist.facts.")}
    known = {"fp8dist.__init__", "fp8dist.__main__", "fp8dist.cli", "fp8dist.distributed",
             "fp8dist.dtypes", "fp8dist.errors", "fp8dist.library_noise", "fp8dist.machine", "fp8dist.speed",
             "fp8dist.integrations.__init__"}
    assert outside == known, f"modules outside the layers: {sorted(outside - known)}; gone: {sorted(known - outside)}"


def test_facts_import_nothing_of_fp8dist_but_facts():
    """fp8dist.facts is read by every layer (and by the light commands at start), so it imports no other module of
    fp8dist: a fact that needed a layer would make that layer a dependency of all of them."""
    graph = edges(modules())
    facts = [name for name in graph if name.startswith("fp8dist.facts.")]
    reaching = sorted(f"{a} -> {b}" for a in facts for b in graph[a] if not b.startswith("fp8dist.facts."))
    assert len(facts) > 1 and not reaching, "\n".join(reaching)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check can fail: an engine importing the audit is an upward import."""
    tree = ast.parse("from fp8dist.audit.watching import watch\n")
    found = {**modules(), "fp8dist.engines.fake": tree}
    graph = edges(found)
    assert "fp8dist.audit.watching" in graph["fp8dist.engines.fake"]
    assert layer("fp8dist.audit.watching") > layer("fp8dist.engines.fake")


def _answers_every_fact(facts) -> bool:
    from fp8dist.engines.profile import EngineProfile

    wanted = set(EngineProfile.__annotations__) | {n for n in vars(EngineProfile) if not n.startswith("_")}
    missing = {n for n in wanted if not hasattr(facts, n)}
    assert not missing, f"{type(facts).__name__} lacks {sorted(missing)}"
    return True


def test_the_engine_registry_is_the_schemas_engine_enum():
    """A value of `engine` the schema offers has its package in the registry, with what every engine provides."""
    from fp8dist.config.schema import schema
    from fp8dist.engines.registry import ENGINES

    assert list(ENGINES) == schema()["properties"]["engine"]["enum"]
    for name, package in ENGINES.items():
        assert callable(package.setup) and package.profile.PROFILE.name == name
        assert _answers_every_fact(package.profile.PROFILE), name
        assert package.Checkpointing.engine == name
