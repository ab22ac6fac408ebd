"""Which doc page cites which result file of ``benchmarks/results/``, and what is out of place.

A result file is cited when a doc page (``README.md`` or ``docs/**/*.md``) names it by its path
from the repository root, ``benchmarks/results/NAME``; a name with ``*``, ``?`` or ``[...]``
cites every result file it matches (as ``--report benchmarks/results/transfer_depth*.json``
reads them all). This script checks, and ``tests/benchmarks/test_results_index.py`` asserts:

* every result file is cited by at least one doc page (no orphans);
* every citation, in a doc page or a benchmark script, matches a result file;
* no doc page or benchmark script names a result file at its old place (``benchmarks/NAME``);
* the index in ``benchmarks/README.md`` (between its ``results-index`` markers) is the one this
  script writes from the files and the pages;
* ``benchmarks/README.md`` names every benchmark script.

    python benchmarks/results_index.py            # the problems, exit status 1 if any
    python benchmarks/results_index.py --write    # rewrite the index in benchmarks/README.md

Only the standard library: it runs without torch.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
README = BENCHMARKS / "README.md"
START = "<!-- results-index: start (written by python benchmarks/results_index.py --write) -->"
END = "<!-- results-index: end -->"
SUFFIXES = ("jsonl", "json", "txt")
# a path from the root into benchmarks/ that ends in a result file's suffix; the glob characters
# are allowed so that one citation can name several files
_CITATION = re.compile(
    r"benchmarks/((?:[\w\-.*?\[\]]+/)*[\w\-.*?\[\]]+?\.(?:" + "|".join(SUFFIXES) + r"))(?!\w)"
)


@dataclass(frozen=True)
class Citation:
    """One mention of a result file: where, and the name as written.

    ``name`` is relative to ``benchmarks/results/``; ``old_place`` is true when the text named
    ``benchmarks/NAME`` (where result files lived before ``results/``) instead.
    """

    source: str  # the citing file, relative to the root
    line: int
    name: str
    old_place: bool

    def matches(self, files: list[str]) -> list[str]:
        """The result files this citation names (a glob may name several).

        >>> Citation("README.md", 1, "a_*.json", False).matches(["a_1.json", "b.json"])
        ['a_1.json']
        """
        return [f for f in files if fnmatch.fnmatchcase(f, self.name)]


def citations(text: str, source: str) -> list[Citation]:
    """Every result file citation in ``text`` (the contents of ``source``).

    >>> [(c.name, c.old_place) for c in citations(
    ...     "see benchmarks/results/x.jsonl and `benchmarks/y*.json`; benchmarks/z.py", "p.md")]
    [('x.jsonl', False), ('y*.json', True)]
    """
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in _CITATION.finditer(line):
            path = match.group(1)
            old = not path.startswith("results/")
            found.append(Citation(source, number, path if old else path[len("results/"):], old))
    return found


def result_files(root: Path = ROOT) -> list[str]:
    """The result files, relative to ``benchmarks/results/``, sorted."""
    results = root / "benchmarks" / "results"
    return sorted(
        p.relative_to(results).as_posix() for p in results.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(results).parts)
    )


def doc_pages(root: Path = ROOT) -> list[Path]:
    """The pages that cite result files: README.md and every Markdown page under docs/."""
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").rglob("*.md"))


def scripts(root: Path = ROOT) -> list[Path]:
    """The benchmark scripts: ``benchmarks/*.py``."""
    return sorted((root / "benchmarks").glob("*.py"))


def citing_scripts(root: Path = ROOT) -> list[Path]:
    """The scripts whose citations are checked: all but this one (its examples cite nothing)."""
    return [p for p in scripts(root) if p.name != Path(__file__).name]


def _read(paths: list[Path], root: Path) -> list[Citation]:
    return [c for p in paths for c in citations(p.read_text(), p.relative_to(root).as_posix())]


def cited_by(root: Path = ROOT) -> dict[str, list[str]]:
    """Each result file and the doc pages that cite it (old-place citations count too)."""
    files = result_files(root)
    pages: dict[str, set[str]] = {f: set() for f in files}
    for c in _read(doc_pages(root), root):
        for f in c.matches(files):
            pages[f].add(c.source)
    return {f: sorted(p) for f, p in pages.items()}


def index_table(root: Path = ROOT) -> str:
    """The index of ``benchmarks/README.md``: one row per result file, with its citing pages."""
    rows = ["| result file | cited by |", "|---|---|"]
    for name, pages in cited_by(root).items():
        rows.append(f"| `{name}` | {', '.join(pages) if pages else '(nothing: an orphan)'} |")
    return "\n".join(rows)


def written_index(root: Path = ROOT) -> str | None:
    """The index as ``benchmarks/README.md`` holds it now (None without the markers)."""
    text = (root / "benchmarks" / "README.md").read_text()
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def write_index(root: Path = ROOT) -> None:
    """Rewrite the index between the markers of ``benchmarks/README.md``."""
    readme = root / "benchmarks" / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: the markers are missing; put these two lines where the "
                         f"index goes:\n{START}\n{END}")
    head, rest = text.split(START, 1)
    readme.write_text(f"{head}{START}\n{index_table(root)}\n{END}{rest.split(END, 1)[1]}")


def orphans(root: Path = ROOT) -> list[str]:
    """Result files that no doc page cites."""
    return [f for f, pages in cited_by(root).items() if not pages]


def missing(root: Path = ROOT) -> list[Citation]:
    """Citations, in doc pages and benchmark scripts, that match no result file."""
    files = result_files(root)
    return [c for c in _read(doc_pages(root) + citing_scripts(root), root) if not c.matches(files)]


def old_places(root: Path = ROOT) -> list[Citation]:
    """Citations of ``benchmarks/NAME`` (the old place) in doc pages and benchmark scripts."""
    return [c for c in _read(doc_pages(root) + citing_scripts(root), root) if c.old_place]


def unlisted_scripts(root: Path = ROOT) -> list[str]:
    """Benchmark scripts that ``benchmarks/README.md`` does not name."""
    text = (root / "benchmarks" / "README.md").read_text()
    return [p.name for p in scripts(root) if f"`{p.name}`" not in text]


def problems(root: Path = ROOT) -> list[str]:
    """Everything out of place, one line each, saying what to do."""
    out = [f"benchmarks/results/{f}: cited by no doc page; cite it from the page that discusses "
           "it, or delete it" for f in orphans(root)]
    out += [f"{c.source}:{c.line}: cites benchmarks/results/{c.name}, which matches no file there"
            for c in missing(root) if not c.old_place]
    out += [f"{c.source}:{c.line}: cites benchmarks/{c.name}; result files live in "
            f"benchmarks/results/ (write benchmarks/results/{c.name})" for c in old_places(root)]
    if written_index(root) != index_table(root):
        out.append("benchmarks/README.md: the result index is not the files' and pages' own; "
                   "run python benchmarks/results_index.py --write")
    out += [f"benchmarks/{s}: not named in benchmarks/README.md; add its line"
            for s in unlisted_scripts(root)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the index of the README first")
    args = p.parse_args()
    if args.write:
        write_index()
    found = problems()
    print("\n".join(found) if found else "benchmarks/results: every file cited and indexed")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
