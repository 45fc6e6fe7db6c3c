"""Every python block in README.md and docs/ runs, in order, per file, in a scratch directory."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if python_blocks(d)], ids=lambda p: p.name)
def test_python_blocks_run(document, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for index, block in enumerate(python_blocks(document)):
        try:
            exec(compile(block, f"{document.name}[block {index}]", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{document.name} block {index} failed: {error!r}") from error


def test_the_readme_names_the_two_commands_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
