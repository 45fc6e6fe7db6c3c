"""Every python block in README.md and docs/ runs, in order, per file, in a scratch directory, and
every outcome the text states is checked.

A document states what a line prints in the line's own comment, so the reader and the test read the
same claim:

    print(np.asarray(drawn.tokens))  # prints [[3 4 1 2 3 4]]
    print(model(x))  # prints close to 1 and 3 (within 0.05)

"prints X" means the printed text is X (whitespace aside); "prints close to X (within T)" means the
printed numbers are X's numbers, each within T. Every `print` at the top of a block states one, and
the stated line runs on its own with its output captured.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
STATED = re.compile(r"^(?P<code>\S.*?)\s+# prints (?P<claim>.+)$")
CLOSE = re.compile(r"^close to (?P<values>.+) \(within (?P<tolerance>[0-9.eE+-]+)\)$")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def check_outcome(claim: str, printed: str) -> None:
    """Raise AssertionError unless `printed` is what `claim` (the text after "# prints") says."""
    close = CLOSE.match(claim)
    if close is None:
        assert " ".join(printed.split()) == " ".join(claim.split()), f"printed {printed!r}, the text says {claim!r}"
        return
    expected = [float(n) for n in NUMBER.findall(close["values"])]
    got = [float(n) for n in NUMBER.findall(printed)]
    tolerance = float(close["tolerance"])
    assert len(got) == len(expected) and all(abs(g - e) <= tolerance for g, e in zip(got, expected)), (
        f"printed {printed.strip()!r}, the text says close to {expected} within {tolerance}"
    )


def run_block(block: str, name: str, namespace: dict) -> None:
    """Run `block`, each line that states its output on its own with stdout captured and checked."""
    pending: list[str] = []

    def flush():
        if pending:
            exec(compile("\n".join(pending) + "\n", name, "exec"), namespace)
            pending.clear()

    for line in block.splitlines():
        stated = STATED.match(line)
        if stated is None:
            pending.append(line)
            continue
        flush()
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            exec(compile(stated["code"] + "\n", name, "exec"), namespace)
        check_outcome(stated["claim"], captured.getvalue())
    flush()


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if python_blocks(d)], ids=lambda p: p.name)
def test_python_blocks_run_and_print_what_the_text_says(document, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for index, block in enumerate(python_blocks(document)):
        name = f"{document.name}[block {index}]"
        try:
            run_block(block, name, namespace)
        except Exception as error:
            raise AssertionError(f"{name} failed: {error!r}") from error


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if python_blocks(d)], ids=lambda p: p.name)
def test_every_print_in_the_docs_states_its_outcome(document):
    for index, block in enumerate(python_blocks(document)):
        for line in block.splitlines():
            if line.startswith("print("):
                assert STATED.match(line), f"{document.name} block {index}: {line!r} does not say what it prints"


def test_outcome_checks_can_fail():
    check_outcome("[[3 4 1 2 3 4]]", "[[3 4 1 2 3 4]]\n")
    check_outcome("60 [40, 60]", "60  [40, 60]\n")
    check_outcome("close to 1 and 3 (within 0.05)", "[[0.98]\n [3.04]]\n")
    for claim, printed in [
        ("[[3 4 1 2 3 4]]", "[[3 4 1 2 3 3]]"),
        ("close to 1 and 3 (within 0.05)", "[[0.9]\n [3.0]]"),
        ("close to 1 and 3 (within 0.05)", "[[1.0]]"),
        ("close to 0 (within 0.01)", "nan"),
    ]:
        with pytest.raises(AssertionError):
            check_outcome(claim, printed)
    namespace = {}
    run_block("x = 2\nprint(x + 1)  # prints 3\n", "ok", namespace)
    with pytest.raises(AssertionError, match="printed '4\\\\n', the text says '3'"):
        run_block("x = 3\nprint(x + 1)  # prints 3\n", "wrong", namespace)


def test_the_readme_names_the_two_commands_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
