"""docs/results/ as data: the page is what the manifest renders, every file belongs to a topic,
the folder stays small, and the repository's links into it resolve."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from cluster.results_page import MANIFEST, PAGE, RESULTS_DIR, load_manifest, problems, render, report_main

ROOT = RESULTS_DIR.parent.parent


def test_the_results_page_is_generated_from_the_manifest():
    page = (RESULTS_DIR / PAGE).read_text()
    assert page == render(load_manifest()), "docs/results/README.md is out of date: run `ralmspec report`"


def test_every_result_file_belongs_to_a_topic_and_the_folder_is_small():
    assert problems(load_manifest()) == []


def test_every_result_json_parses():
    for entry in load_manifest().values():
        for rel in entry.paths:
            if rel.endswith(".json"):
                assert isinstance(json.loads((RESULTS_DIR / rel).read_text()), dict), rel


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_links_into_the_results_resolve():
    """Every markdown link of the repository's docs that points into docs/results/ names a file
    that exists, and an anchor into the page names a topic."""
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (RESULTS_DIR / PAGE).read_text()))
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for doc in docs:
        for link in _links(doc.read_text()):
            if link.startswith(("http://", "https://", "#")):
                continue
            target, _, anchor = link.partition("#")
            path = (doc.parent / target).resolve()
            if RESULTS_DIR not in (path, *path.parents):
                continue
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {link}")
            elif anchor and path == RESULTS_DIR / PAGE and anchor not in anchors:
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such topic)")
    assert not broken, broken


ENTRY = """
toy:
  section: S
  title: a toy
  headline: 1.5x
  identical: 2/2
  result: toy.json
  command: ralmspec bench
  machine: here
  date: 2026-11-27
  commit: abcdef0
"""


def _check(folder: Path) -> int:
    return report_main(argparse.Namespace(results_dir=folder, check=True))


def test_the_check_fails_on_a_stale_page_an_orphan_or_a_missing_file(tmp_path):
    (tmp_path / MANIFEST).write_text(ENTRY)
    (tmp_path / "toy.json").write_text("{}")
    assert _check(tmp_path) == 1  # no page yet
    assert report_main(argparse.Namespace(results_dir=tmp_path, check=False)) == 0
    assert _check(tmp_path) == 0
    (tmp_path / "old.json").write_text("{}")  # a superseded result left behind
    assert _check(tmp_path) == 1
    (tmp_path / "old.json").unlink()
    (tmp_path / MANIFEST).write_text(ENTRY.replace("1.5x", "1.6x"))  # edited, not regenerated
    assert _check(tmp_path) == 1
    (tmp_path / "toy.json").unlink()
    assert "toy: toy.json does not exist" in problems(load_manifest(tmp_path), tmp_path)


def test_a_bad_entry_is_refused(tmp_path):
    (tmp_path / MANIFEST).write_text(ENTRY.replace("2026-11-27", "yesterday"))
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        load_manifest(tmp_path)
