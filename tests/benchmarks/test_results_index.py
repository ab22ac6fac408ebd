"""The result files of ``benchmarks/results/`` against the pages that quote them.

A result file no doc page cites is an orphan (nobody can tell what it shows); a citation that
matches no file, or names a file at its old place ``benchmarks/NAME``, sends a reader nowhere;
and ``benchmarks/README.md``'s index must be the one ``benchmarks/results_index.py --write``
builds from the files and pages. Each failure names the file and what to do.
"""

from __future__ import annotations

import doctest
import shutil

import pytest

from benchmarks import results_index as index

ROOT = index.ROOT


def test_the_checker_reads_citations():
    """Its own examples pass, so the checks below read citations as intended."""
    assert doctest.testmod(index).failed == 0


def test_every_result_file_is_cited_by_a_doc_page():
    orphans = index.orphans()
    assert not orphans, (
        "result files cited by no doc page (README.md, docs/**/*.md): cite each as "
        "benchmarks/results/NAME from the page that discusses it, or delete it: "
        + ", ".join(orphans))


def test_every_citation_names_a_result_file():
    missing = [f"{c.source}:{c.line}: benchmarks/results/{c.name}" for c in index.missing()
               if not c.old_place]
    assert not missing, "citations that match no file of benchmarks/results/:\n" + "\n".join(
        missing)


def test_no_citation_of_the_old_place():
    old = [f"{c.source}:{c.line}: benchmarks/{c.name}" for c in index.old_places()]
    assert not old, (
        "result files live in benchmarks/results/; these cite the old place (fix with "
        "sed -i -E 's#benchmarks/([A-Za-z0-9_*.-]+\\.(jsonl|json|txt))#benchmarks/results/\\1#g' "
        "on the page):\n" + "\n".join(old))


def test_the_readme_index_is_up_to_date():
    assert index.written_index() == index.index_table(), (
        "benchmarks/README.md's result index is out of date: run "
        "python benchmarks/results_index.py --write")


def test_the_readme_names_every_script():
    assert not index.unlisted_scripts(), (
        "benchmark scripts without a line in benchmarks/README.md: "
        + ", ".join(index.unlisted_scripts()))


@pytest.fixture
def tree(tmp_path):
    """A small copy of the layout: two result files, a page, a script and the README."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "evidence").mkdir(parents=True)
    for name in ("run_a.json", "run_b.jsonl"):
        (tmp_path / "benchmarks" / "results" / name).write_text("{}\n")
    (tmp_path / "docs" / "evidence" / "page.md").write_text(
        "Measured: `benchmarks/results/run_*.json` and benchmarks/results/run_b.jsonl.\n")
    (tmp_path / "README.md").write_text("# Project\n")
    (tmp_path / "benchmarks" / "run.py").write_text('"""Writes benchmarks/results/run_a.json"""\n')
    shutil.copy(ROOT / "benchmarks" / "results_index.py", tmp_path / "benchmarks")
    (tmp_path / "benchmarks" / "README.md").write_text(
        f"`run.py`, `results_index.py`\n\n{index.START}\n{index.END}\n")
    return tmp_path


def test_a_consistent_tree_has_no_problems(tree):
    index.write_index(tree)
    assert index.problems(tree) == []
    assert index.cited_by(tree) == {"run_a.json": ["docs/evidence/page.md"],
                                    "run_b.jsonl": ["docs/evidence/page.md"]}


def test_each_problem_is_found(tree):
    index.write_index(tree)
    (tree / "benchmarks" / "results" / "orphan.txt").write_text("x\n")
    (tree / "README.md").write_text("See benchmarks/results/gone.json and benchmarks/run_a.json.\n")
    (tree / "benchmarks" / "new.py").write_text("")
    found = index.problems(tree)
    assert any(p.startswith("benchmarks/results/orphan.txt: cited by no doc page") for p in found)
    assert any(p.startswith("README.md:1: cites benchmarks/results/gone.json") for p in found)
    assert any(p.startswith("README.md:1: cites benchmarks/run_a.json") for p in found)
    assert any("the result index is not" in p for p in found)  # orphan.txt is not in it
    assert any(p.startswith("benchmarks/new.py: not named") for p in found)
    assert len(found) == 5, found
