"""Print which lightning_par module imports which, and every import cycle among them.

    python tools/import_graph.py            # edges grouped by layer, then the cycles; exit 1 if there is one
    python tools/import_graph.py --mermaid  # a mermaid `graph TD` of the edges between layers instead

Only the standard library's `ast` reads the sources; nothing is imported. An import counts wherever it is written:
at module level and inside functions or methods alike, since a deferred import still ties the two modules together
(such edges are marked "(deferred)", and drawn dotted in mermaid). `import a.b.c` is an edge to `a.b.c` alone, not
to the package `__init__`s Python also runs on the way. `from lightning_par.parallel.tensor import X` is followed
through
the package's re-export to the module that defines X when the `__init__` names it; otherwise (X defined in the
`__init__` itself, or not found) the edge goes to the package.

A cycle is a strongly connected component of more than one module. Edges from a module to a package `__init__`
that contains it are left out of that search: a package's `__init__` imports its own modules by design.

The exit status is 1 when there is a cycle, else 0, in both modes.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lightning_par"
# The layers (subpackages and top modules) in the order they are printed; the root package comes last.
LAYERS = ("axes config mesh names blocks parallel streams planner nn precision checkpoint strategies callbacks cli "
          "models data utils analysis tuning")
TOP = "lightning_par"
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def find_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under lightning_par/."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def is_package(name: str, modules: dict[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def absolute(node: ast.ImportFrom, importer: str, modules: dict[str, Path]) -> str:
    """The module a `from ... import` reads from, with relative imports resolved against the importer."""
    if not node.level:
        return node.module or ""
    package = importer if is_package(importer, modules) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def reexports(package: str, modules: dict[str, Path]) -> dict[str, str]:
    """Names a package `__init__` imports from elsewhere -> the module they come from."""
    names = {}
    for node in ast.parse(modules[package].read_text()).body:
        if isinstance(node, ast.ImportFrom):
            source = absolute(node, package, modules)
            for alias in node.names:
                names[alias.asname or alias.name] = source
    return names


def target(source: str, name: str, modules: dict[str, Path], seen: frozenset[str] = frozenset()) -> str:
    """The module `from source import name` really depends on (see the module docstring)."""
    if f"{source}.{name}" in modules:
        return f"{source}.{name}"
    if is_package(source, modules) and source not in seen:
        origin = reexports(source, modules).get(name)
        if origin in modules and origin != source:
            return target(origin, name, modules, seen | {source})
    return source


def collect_edges(modules: dict[str, Path]) -> dict[tuple[str, str], bool]:
    """(importer, imported) -> True when some import of it runs at module level, False when all are deferred."""
    edges: dict[tuple[str, str], bool] = {}

    def add(src: str, dst: str, top_level: bool) -> None:
        while dst not in modules and "." in dst:
            dst = dst.rpartition(".")[0]  # `import lightning_par.x.Y` where Y is not a module
        if dst in modules and dst != src:
            edges[src, dst] = edges.get((src, dst), False) or top_level

    for name, path in modules.items():
        for node, top_level in imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == TOP:
                        add(name, alias.name, top_level)
            else:
                source = absolute(node, name, modules)
                if source.split(".")[0] == TOP:
                    for alias in node.names:
                        add(name, target(source, alias.name, modules), top_level)
    return edges


def imports(node: ast.AST, top_level: bool = True) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under `node`, with False once it sits inside a function, method or lambda."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, top_level
        yield from imports(child, top_level and not isinstance(child, _FUNCTIONS))


def layer(module: str) -> str:
    """`lightning_par.parallel.tensor.plan` -> `parallel`; the root package is its own layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else TOP


def enclosing(package: str, module: str, modules: dict[str, Path]) -> bool:
    """Whether `package` is a package that contains `module` (such edges are left out of the cycle search)."""
    return is_package(package, modules) and module.startswith(package + ".")


def cycles(nodes: list[str], edges: dict[tuple[str, str], bool], modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), ignoring imports of an enclosing package."""
    succ = defaultdict(list)
    for src, dst in edges:
        if not enclosing(dst, src, modules):
            succ[src].append(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return sorted(found)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--mermaid"]):
        print(__doc__, file=sys.stderr)
        return 2
    modules = find_modules()
    edges = collect_edges(modules)
    found = cycles(sorted(modules), edges, modules)
    order = {name: i for i, name in enumerate((*LAYERS.split(), TOP))}
    if "--mermaid" in argv:
        between: dict[tuple[str, str], bool] = {}
        for (src, dst), top_level in edges.items():
            a, b = layer(src), layer(dst)
            if a != b:
                between[a, b] = between.get((a, b), False) or top_level
        print("graph TD")
        for name in sorted({layer(m) for m in modules}, key=lambda n: order.get(n, 99)):
            print(f"    {name}")
        for (a, b), top_level in sorted(between.items(), key=lambda e: (order.get(e[0][0], 99), e[0][1])):
            print(f"    {a} {'-->' if top_level else '-.->'} {b}")
        return 1 if found else 0
    by_layer = defaultdict(list)
    for (src, dst), top_level in sorted(edges.items()):
        by_layer[layer(src)].append(f"  {src} -> {dst}" + ("" if top_level else "  (deferred)"))
    for name in sorted({layer(m) for m in modules}, key=lambda n: order.get(n, 99)):
        print(f"{name}:")
        print("\n".join(by_layer[name]) or "  (imports no other lightning_par module)")
    for i, component in enumerate(found, 1):
        print(f"cycle {i}: {', '.join(component)}")
        for (src, dst), top_level in sorted(edges.items()):
            if src in component and dst in component and not enclosing(dst, src, modules):
                print(f"  {src} -> {dst}" + ("" if top_level else "  (deferred)"))
    print(f"{len(found)} import cycles in {len(modules)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
