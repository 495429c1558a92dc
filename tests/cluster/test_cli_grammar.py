"""The ``ralmspec`` grammar: every flag defined once, every command's ``--help`` one tool,
the former command names still accepted."""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import cli
from cluster.flags import SHARED, HelpFormatter

CLUSTER = Path(cli.__file__).parent


def _walk(
    p: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield words, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _walk(sp, (*words, name))


COMMANDS = [words for words, _ in _walk(cli.build_parser()) if words]


def test_every_option_string_has_one_definition_in_the_source():
    """No option string is spelled in two ``add_argument`` calls of the package's commands
    (the asset builders behind ``ralmspec assets`` included), and the shared table spells
    each once."""
    calls: dict[str, list[str]] = defaultdict(list)
    for f in sorted(CLUSTER.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                        calls[arg.value].append(f"{f.name}:{node.lineno}")
    shared = [s for flag in SHARED.values() for s in flag.names]
    twice = {s: where for s, where in calls.items() if len(where) > 1}
    assert not twice, twice
    assert len(shared) == len(set(shared))
    assert not set(shared) & set(calls), "a shared flag is also spelled in an add_argument call"


def test_every_option_string_comes_from_one_call_site(monkeypatch):
    """Building the whole parser tree, each option string is added by one line of source:
    the shared ones by :func:`cluster.flags.add_shared`, the others by their command."""
    sites: dict[str, set[tuple[str, int]]] = defaultdict(set)
    original = argparse._ActionsContainer.add_argument

    def recording(self, *args, **kwargs):
        frame = sys._getframe(1)
        for s in args:
            if isinstance(s, str) and s.startswith("-") and s not in ("-h", "--help"):
                sites[s].add((frame.f_code.co_filename, frame.f_lineno))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", recording)
    cli.build_parser()
    assert sites["--out"] and sites["--max-new-tokens"] and sites["--corpus"]
    many = {s: sorted(w) for s, w in sites.items() if len(w) > 1}
    assert not many, many


def test_shared_flags_read_the_same_in_every_command():
    """Every command that takes --out, --questions, -n, --max-new-tokens, ... shows the same
    metavar for it, and every flag of every command has a help line."""
    metavars: dict[str, set[str]] = defaultdict(set)
    for words, p in _walk(cli.build_parser()):
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"ralmspec {' '.join(words)} {a.option_strings[0]} has no help"
            if a.dest in SHARED and a.nargs != 0:
                metavars[a.option_strings[-1]].add(str(a.metavar or a.choices))
    assert {"--out", "--questions", "--num-questions", "--max-new-tokens", "--model", "--corpus"} <= set(metavars)
    assert all(len(m) == 1 for flag, m in metavars.items() if flag not in ("--concurrency", "--retriever", "--scan")), (
        metavars
    )


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(w) for w in COMMANDS])
def test_every_command_has_a_help(words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*words, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ralmspec {' '.join(words)}")
    assert "--help" in out


@pytest.mark.parametrize("what", sorted(cli.ASSETS))
def test_every_asset_builder_has_a_help(what, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["assets", what, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ralmspec assets {what}")


def test_the_top_level_help_lists_the_grammar(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("index", "generate", "serve", "eval", "gpu-check", "bench", "k8s", "assets"):
        assert f"\n    {name}" in out
    for old in cli.LEGACY_NAMES:  # accepted, not advertised
        assert f"\n    {old} " not in out


@pytest.mark.parametrize("old,new", sorted(cli.LEGACY_NAMES.items()))
def test_former_names_run_their_benchmark(old, new, capsys):
    assert cli.canonical_argv([old, "--out", "x"]) == [*new, "--out", "x"]
    with pytest.raises(SystemExit) as e:
        cli.main([old, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ralmspec {' '.join(new)}")


def test_bench_with_flags_is_the_former_bench_spec():
    args = cli.build_parser().parse_args(cli.canonical_argv(["bench", "-n", "3", "--configs", "PSA"]))
    assert (args.bench, args.num_questions, args.configs) == ("spec", 3, "PSA")
    assert cli.canonical_argv(["bench", "--help"]) == ["bench", "--help"]
    with pytest.raises(SystemExit):  # a name is needed
        cli.build_parser().parse_args(["bench"])


def test_a_command_keeps_its_own_defaults_for_a_shared_flag():
    p = cli.build_parser()
    assert p.parse_args(["bench", "served"]).out == Path("bench-out/served")
    assert p.parse_args(["bench", "knn"]).out == Path("knn-bench-out")
    assert p.parse_args(["eval"]).out == Path("eval-out")
    assert p.parse_args(["bench", "knn"]).max_new_tokens == 32
    assert p.parse_args(["bench", "spec"]).max_new_tokens is None  # the config's
    with pytest.raises(SystemExit):
        p.parse_args(["pad-corpus", "--to", "5"])  # --out is required there


def test_help_formatter_shows_defaults_once():
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    p.add_argument("--a", type=int, default=3, help="a count")
    p.add_argument("--b", default="1,2", help="b values (default: one and two)")
    p.add_argument("--c", type=Path, help="a file")
    text = p.format_help()
    assert "--a N" in text and "a count (default: 3)" in text
    assert "--b LIST" in text and text.count("default") == 2
    assert "--c FILE" in text
