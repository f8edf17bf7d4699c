"""The import graph of ``rm/``, read from the source (every ``import`` statement, function-level ones included):
no module reaches itself again through its imports, and no package imports from a package above it in the order
``rm.LAYERS`` declares, so each can be read from the packages below it up."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set) -> set:
    """The ``rm`` modules ``path`` imports, at any depth of its code (``from rm.x import y`` counts ``rm.x.y``
    when that is a module, else ``rm.x``)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package the module is in
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {name for name in found if name in modules} - {module_name(path)}


def import_graph() -> dict:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def cycles(graph: dict) -> list:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """The package of ``rm`` a module belongs to: ``rm.memory.terms`` -> ``memory``; a module at the root (an entry
    point, or ``rm`` itself) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def rank(module: str) -> int:
    """The place of ``module``'s package in ``rm.LAYERS`` (the bottom one 0); the root's entry points stand above
    every package."""
    from rm import LAYERS

    package = package_of(module)
    return LAYERS.index(package) if package else len(LAYERS)


def upward_imports(graph: dict) -> list:
    """Every import from a package into one after it in ``rm.LAYERS``, as ``(importer, imported)``."""
    return sorted((a, b) for a, imported in graph.items() for b in imported if rank(b) > rank(a))


def test_cycles_are_found_by_hand():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "rm.modelling.model" in graph and "rm.memory.terms" in graph and graph["rm.training.trainer"]  # read
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that import one another): " + "; ".join(
        " <-> ".join(group) for group in found)


def test_rank_is_read_from_the_declared_order():
    from rm import LAYERS

    assert rank("rm.foundations.config") == 0 and rank("rm.training.trainer") == len(LAYERS) - 1
    assert rank("rm.train") == rank("rm") == len(LAYERS)  # the entry points stand above every package
    assert upward_imports({"rm.foundations.config": {"rm.data.load"}, "rm.data.load": {"rm.foundations.config"}}) == [
        ("rm.foundations.config", "rm.data.load")]


def test_every_package_has_its_place_in_the_order():
    """A new package must be placed in ``rm.LAYERS``, and every name there is a package of rm/."""
    from rm import LAYERS

    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert sorted(LAYERS) == packages


def test_no_package_imports_from_a_package_above_it():
    graph = import_graph()
    assert "rm.settings.validate" in graph["rm.memory.suggest"]  # the graph was read
    found = upward_imports(graph)
    assert not found, "imports from a lower package up to a higher one (rm.LAYERS, bottom first): " + "; ".join(
        f"{a} -> {b}" for a, b in found)


def test_the_root_holds_only_entry_points():
    """Every module at the root of rm/ runs as ``python -m rm.<name>``; what they share lives in the packages."""
    for path in PACKAGE.glob("*.py"):
        if path.name != "__init__.py":
            assert 'if __name__ == "__main__":' in path.read_text(), f"{path} is not an entry point: move it to a package"


def test_no_two_modules_share_a_name():
    """A module's name says one thing: ``rm.estimate`` is the command line, so the estimate is ``rm.memory.terms``."""
    from collections import Counter

    names = Counter(path.stem for path in PACKAGE.rglob("*.py") if path.stem != "__init__")
    assert names["estimate"] == 1 and names["tokenizer"] == 1  # the names were read
    assert [name for name, count in names.items() if count > 1] == []


def test_the_tokenizer_imports_nothing_else_of_the_data():
    """``rm.data.tokenizer`` is below the rest of ``rm.data``: the data calls it, and the train split reaches it as an
    argument."""
    graph = import_graph()
    assert "rm.foundations.errors" in graph["rm.data.tokenizer"]  # the graph was read
    assert not {m for m in graph["rm.data.tokenizer"] if m.startswith("rm.data.")}


def test_collecting_the_suite_leaves_bitsandbytes_importable():
    """The doctests import every rm module as the suite is collected; none of them may mark bitsandbytes as not
    importable in this process (as the estimate-only commands do in theirs), or every bitsandbytes test after would
    skip itself as 'not installed'."""
    assert "bitsandbytes" not in sys.modules or sys.modules["bitsandbytes"] is not None
