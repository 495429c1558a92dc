"""The results page: ``docs/results/README.md`` generated from the manifest of current results.

``docs/results/manifest.yaml`` names, per topic, the one result that is current (its JSON,
table and plot in ``docs/results/``), the command that produced it, the machine, the date
and the commit. ``ralmspec report`` renders the page from it; ``ralmspec report --check``
exits 1 when the page on disk differs from what the manifest renders (a test runs it).
A newer measurement of a topic replaces the older one's files and manifest entry: git keeps
the superseded files, and the entry's ``commit`` finds the full record
(``git show COMMIT:docs/results/FILE``).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.flags import Default, add_shared

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "results"
MANIFEST = "manifest.yaml"
PAGE = "README.md"
MAX_BYTES = 1_000_000  # every file of docs/results/ but the page itself


class ResultEntry(BaseModel):
    """One topic's current result: a mapping of ``manifest.yaml`` whose key is the topic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    title: str = Field(description="what was measured, in one line")
    section: str = Field(description="the page section the topic is listed under (sections keep their first order)")
    headline: str = Field(description="the figure a reader should quote, with its baseline (markdown)")
    identical: str = Field(
        description="outputs token-identical to their reference, as 'n/m' (or 'n/a' where nothing is compared)"
    )
    result: str = Field(description="the result's JSON, relative to docs/results/")
    files: list[str] = Field(
        default_factory=list,
        description="its other files (the .md table, a .png plot, more JSON), relative to docs/results/",
    )
    command: str = Field(description="the command that produced the result, as run (several lines if it took several)")
    machine: str = Field(description="the machine it ran on: CPU (ISA), cores, GPU, and whether it was shared")
    date: str = Field(description="the day it was measured, YYYY-MM-DD")
    commit: str = Field(
        description="the commit that recorded the result (its code is the code measured unless notes say otherwise)"
    )
    trimmed: list[str] = Field(
        default_factory=list,
        description="top-level keys of the recorded JSON left out here to keep the folder small (per-request records); "
        "`git show COMMIT:docs/results/RESULT` has them",
    )
    notes: str = Field(default="", description="what a reader needs to read the figure right (markdown), or empty")

    @field_validator("date", mode="before")
    @classmethod
    def _iso_day(cls, v: object) -> object:
        if isinstance(v, datetime.date):  # an unquoted YAML date
            return v.isoformat()
        if isinstance(v, str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", v):
            raise ValueError(f"date must be YYYY-MM-DD, got {v!r}")
        return v

    @field_validator("commit", mode="before")
    @classmethod
    def _hash(cls, v: object) -> object:
        if isinstance(v, str) and not re.fullmatch(r"[0-9a-f]{7,40}", v):
            raise ValueError(f"commit must be a hexadecimal hash, got {v!r}")
        return v

    @property
    def paths(self) -> list[str]:
        """Every file of the entry, the result first."""
        return [self.result, *self.files]


def load_manifest(results_dir: Path = RESULTS_DIR) -> dict[str, ResultEntry]:
    """topic -> its entry, in the manifest's order."""
    raw = yaml.safe_load((results_dir / MANIFEST).read_text()) or {}
    return {topic: ResultEntry.model_validate(body) for topic, body in raw.items()}


def problems(entries: dict[str, ResultEntry], results_dir: Path = RESULTS_DIR) -> list[str]:
    """What is wrong with the folder against its manifest: missing files, files no entry
    names (superseded results left behind), and a folder over :data:`MAX_BYTES`."""
    out = []
    named = {MANIFEST, PAGE}
    for topic, e in entries.items():
        for rel in e.paths:
            named.add(rel)
            if not (results_dir / rel).is_file():
                out.append(f"{topic}: {rel} does not exist")
    present = {p.relative_to(results_dir).as_posix() for p in results_dir.rglob("*") if p.is_file()}
    out += [f"{rel}: not named by any manifest entry (superseded? git keeps it)" for rel in sorted(present - named)]
    size = sum((results_dir / rel).stat().st_size for rel in present if rel != PAGE)
    if size > MAX_BYTES:
        out.append(f"docs/results/ holds {size:,} bytes besides the page (at most {MAX_BYTES:,})")
    return out


def _anchor(topic: str) -> str:
    return re.sub(r"[^a-z0-9-]", "", topic.lower())


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _field_rows() -> list[str]:
    rows = ["| field | meaning |", "| --- | --- |"]
    for name, f in ResultEntry.model_fields.items():
        req = "" if f.is_required() else " (optional)"
        rows.append(f"| `{name}`{req} | {f.description} |")
    return rows


def render(entries: dict[str, ResultEntry]) -> str:
    """The page's markdown: a header on the manifest's format, an index by section, then one
    block per topic with its figure, command, machine, date, commit and files."""
    sections: dict[str, list[str]] = {}
    for topic, e in entries.items():
        sections.setdefault(e.section, []).append(topic)
    out = [
        "# Benchmark results",
        "",
        "<!-- generated by `ralmspec report` from manifest.yaml; edit the manifest, not this page -->",
        "",
        "The current result of each topic: its figure, the command that produced it, the machine",
        "and the date. Every file in this folder belongs to one topic of",
        "[manifest.yaml](manifest.yaml); this page is generated from it by `ralmspec report`, and",
        "a test fails when the page is out of date (`ralmspec report --check`) or a file here is",
        "named by no topic. A newer measurement of a topic replaces the older one's files and",
        "entry: git keeps what it superseded (`git log -- docs/results/`), and an entry's commit",
        "finds its full record (`git show COMMIT:docs/results/FILE`). The folder stays under",
        f"{MAX_BYTES // 1_000_000} MB besides this page.",
        "",
        "**Exactness**: where a row says `n/m identical`, n of m outputs were token-identical to",
        "their reference (RaLMSpec to RaLMSeq, a batched request to the same request alone).",
        "",
        "**Adding a result**: write its JSON (and `.md` table, `.png` plot) here, add an entry to",
        "`manifest.yaml` keyed by its topic (or replace the topic's entry and delete its old",
        "files), then run `ralmspec report`. The fields of an entry:",
        "",
        *_field_rows(),
        "",
        "## Current figures",
        "",
        "| topic | figure | identical | date |",
        "| --- | --- | --- | --- |",
    ]
    for topics in sections.values():
        for t in topics:
            e = entries[t]
            out.append(f"| [{_cell(e.title)}](#{_anchor(t)}) | {_cell(e.headline)} | {_cell(e.identical)} | {e.date} |")
    for section, topics in sections.items():
        out += ["", f"## {section}"]
        for topic in topics:
            out += ["", *_block(topic, entries[topic])]
    return "\n".join(out) + "\n"


def _block(topic: str, e: ResultEntry) -> list[str]:
    lines = [
        f'<a id="{_anchor(topic)}"></a>',
        f"### {e.title}",
        "",
        f"{e.headline}",
        "",
        f"- identical: {e.identical}",
        f"- date: {e.date}, commit `{e.commit}`",
        f"- machine: {e.machine}",
        "- files: " + ", ".join(f"[{Path(rel).name}]({rel})" for rel in e.paths),
    ]
    if e.trimmed:
        keys = ", ".join(f"`{k}`" for k in e.trimmed)
        lines.append(f"- left out of the JSON here: {keys} (`git show {e.commit}:docs/results/{e.result}`)")
    lines += ["", "```", e.command.strip(), "```"]
    if e.notes.strip():
        lines += ["", e.notes.strip()]
    lines += [f"![{e.title}]({rel})" for rel in e.files if rel.endswith(".png")]
    return lines


def add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="the folder of the manifest and the page (default docs/results)",
    )
    add_shared(
        p,
        check=Default(help="check only: write nothing; exit 1 if the page is out of date or the folder breaks a rule"),
    )


def report_main(args: argparse.Namespace) -> int:
    """``ralmspec report``: render the results page from the manifest (or check it)."""
    entries = load_manifest(args.results_dir)
    page = render(entries)
    issues = problems(entries, args.results_dir)
    path = args.results_dir / PAGE
    if args.check:
        if not path.is_file() or path.read_text() != page:
            issues.append(f"{path} is out of date: run `ralmspec report`")
        for line in issues:
            print(line, file=sys.stderr)
        return 1 if issues else 0
    path.write_text(page)
    print(f"wrote {path} ({len(entries)} topics)")
    for line in issues:
        print(f"warning: {line}", file=sys.stderr)
    return 0
