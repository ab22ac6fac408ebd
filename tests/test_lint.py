"""The code's escapes from the linter and the formatter silence something.

``ruff check`` (the rules of ``ruff.toml``) passes with ``RUF100`` added: no ``# noqa`` names a
rule that is not enabled or does not fire on its line. No formatter runs on this code, so a
``# fmt: skip`` guards only a layout someone might reformat by hand: a table whose columns are
aligned (two or more spaces between two tokens of one line). Anywhere else it goes.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = "# fmt: skip"
_LAYOUT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENDMARKER)


def python_files() -> list[Path]:
    """The repository's tracked Python files."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [ROOT / name for name in out.split()]


def needless_fmt_skips(source: str) -> list[int]:
    """The lines of ``source`` whose ``# fmt: skip`` ends a statement with no aligned columns.

    >>> call = "x = f(1,\\n      2)  # fmt: skip\\n"
    >>> table = "T = {'a':  1,\\n     'bb': 2}  # fmt: skip\\n"
    >>> needless_fmt_skips(call + table)
    [2]
    """
    found, statement = [], []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        statement.append(token)
        if token.type not in (tokenize.NEWLINE, tokenize.ENDMARKER):
            continue
        skips = [t for t in statement if t.type == tokenize.COMMENT and t.string.endswith(SKIP)]
        code = [t for t in statement if t.type not in _LAYOUT]
        aligned = any(a.end[0] == b.start[0] and b.start[1] - a.end[1] >= 2
                      for a, b in zip(code, code[1:]))
        if skips and not aligned:
            found += [t.start[0] for t in skips]
        statement = []
    return found


def test_ruff_check_with_unused_noqa_passes():
    pytest.importorskip("ruff", reason="ruff is in the dev extra: pip install -e '.[dev]'")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--extend-select", "RUF100",
                           "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, (
        "ruff check --extend-select RUF100 finds problems; a # noqa of a rule ruff.toml does not "
        "enable silences nothing (ruff check --extend-select RUF100 --fix removes it):\n"
        + done.stdout + done.stderr)


def test_fmt_skip_only_on_aligned_tables():
    needless = [f"{path.relative_to(ROOT)}:{line}" for path in python_files()
                for line in needless_fmt_skips(path.read_text())]
    assert not needless, (
        f"{len(needless)} '# fmt: skip' on statements that are not aligned tables (no formatter "
        "runs here, so they silence nothing): remove them:\n" + "\n".join(needless))
