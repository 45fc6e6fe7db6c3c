"""Imports point down: the import-linter contracts in pyproject.toml hold, they catch an upward
import, and no module imports itself through a chain of others."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(source_root: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(source_root), "NO_COLOR": "1", "HOME": str(source_root)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=source_root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_layers_contract_holds():
    result = lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Layers point down KEPT" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "src" / "dew", tmp_path / "dew", ignore=shutil.ignore_patterns("__pycache__"))
    rope = tmp_path / "dew" / "nn" / "rope.py"
    rope.write_text(rope.read_text() + "\n\ndef _upward():\n    from dew.training import trainer  # noqa\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "dew.nn is not allowed to import dew.training" in result.stdout
    assert "dew.nn.rope -> dew.training" in result.stdout


def cycles(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(module):
        index[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others(tmp_path):
    import grimp

    graph = grimp.build_graph("dew", cache_dir=None)
    # a package's __init__ re-exporting its own modules is not a chain back to itself
    for package in [m for m in graph.modules if graph.find_children(m)]:
        for imported in graph.find_modules_directly_imported_by(package):
            if imported.startswith(package + "."):
                graph.remove_import(importer=package, imported=imported)
    assert cycles(graph) == []

    # the check finds a cycle when there is one
    graph.add_import(importer="dew.nn.rope", imported="dew.nn.backbones.causal_transformer")
    assert any("dew.nn.rope" in group for group in cycles(graph))
