"""The package's structure: no import cycle (function-level imports count), one module that knows both strategy
classes, the lower layers free of Lightning, and no library file past the size the house style allows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_par"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):  # module level and inside functions alike
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_import_graph_has_no_cycle():
    out = subprocess.run([sys.executable, "tools/import_graph.py"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("0 import cycles in ")


def test_only_the_registry_imports_both_strategy_classes():
    both = {"lightning_par.strategies.parallel", "lightning_par.strategies.deepspeed"}
    importers = []
    for path in PACKAGE.rglob("*.py"):
        mods = {m for m in _imports(path) if m in both or m.rsplit(".", 1)[0] in both}
        if {m if m in both else m.rsplit(".", 1)[0] for m in mods} == both:
            importers.append(path.relative_to(ROOT).as_posix())
    assert importers == ["lightning_par/strategies/registry.py"]


def test_lower_layers_import_no_lightning():
    for folder in ("config.py", "names.py", "mesh.py", "plans", "plan", "parallel", "nn"):
        target = PACKAGE / folder
        for path in [target] if target.is_file() else sorted(target.rglob("*.py")):
            imported = _imports(path)
            bad = sorted(m for m in imported if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: this layer must stay free of Lightning"


def test_no_library_file_past_the_size_limit():
    # The house style asks for files under ~400 lines; a little slack for a docstring, never a second technique.
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 420}
