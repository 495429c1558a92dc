"""The flags that several ``ralmspec`` commands share, each defined once, and the help
formatter every command's ``--help`` uses.

A shared flag (``--out``, ``--questions``, ``-n``, ``--max-new-tokens``, ``--model``, ...) is
one row of :data:`SHARED`: its option strings, type, metavar and wording. A command adds the
ones it takes with :func:`add_shared`, giving only its own defaults::

    add_shared(p, questions=None, num_questions=20, out=Path("bench-out"))

The flags of a :class:`ralm.config.RalmConfig` (``--config``, ``--corpus``, ``--work-dir``,
``--model``, ``--encoder``, ``--pad-to``, ``--dense-scan``, ``-v``) are the parent parser of
:func:`config_parent` (``argparse`` ``parents=``), which the commands that build a pipeline
share. ``tests/cluster/test_cli.py`` checks that no option string is defined twice.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ralm.retrieval.scan_choice import SCAN_MODES


@dataclass(frozen=True)
class Flag:
    """One shared flag: how it is spelled, parsed, shown and explained."""

    names: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    action: str | None = None
    #: what leaving the flag out means when the command's default is None
    unset: str | None = None


@dataclass(frozen=True)
class Default:
    """A command's use of a shared flag when the bare default is not enough: its own wording
    of the flag's meaning (``help``), of its default (``unset``: shown instead of the value),
    ``required``, a list of values (``many``) or the values it accepts (``choices``)."""

    value: Any = None
    help: str | None = None
    unset: str | None = None
    required: bool = False
    #: a comma-separated list of the flag's values, one measurement each (kept as the string)
    many: bool = False
    #: the values this command accepts
    choices: tuple[str, ...] | None = None


COMMA_LIST = "LIST"

#: Every flag that more than one command takes, by its ``argparse`` dest.
SHARED: dict[str, Flag] = {
    # the RalmConfig group (config_parent)
    "config": Flag(("--config",), "YAML file with a RalmConfig (ralm/config.py)", Path, "FILE"),
    "corpus": Flag(("--corpus",), "corpus JSONL(.gz), pyserini JsonCollection format", Path, "FILE"),
    "work_dir": Flag(
        ("--work-dir",), "where indexes and outputs go", Path, "DIR", unset="the config's, ~/.cache/ralmspec"
    ),
    "model": Flag(
        ("--model",),
        "generator: a local path or a Hugging Face name",
        metavar="MODEL",
        unset="the config's",
    ),
    "encoder": Flag(
        ("--encoder",), "dense encoder: local:all-MiniLM-L6-v2, a path or a Hugging Face name", metavar="NAME"
    ),
    "pad_to": Flag(
        ("--pad-to",),
        "pad the flat index to N rows of vectors that are never returned: a large index's search cost, "
        "results unchanged (0: no padding)",
        int,
        "N",
        unset="no padding",
    ),
    "dense_scan": Flag(
        ("--dense-scan",),
        "EDR candidate scan: auto (timed here), faiss, bf16, int8 or gpu (bounded scans, exact after re-scoring)",
        choices=tuple(SCAN_MODES),
        unset="the config's",
    ),
    "verbose": Flag(("-v", "--verbose"), "log at INFO level", action="store_true"),
    # inputs
    "questions": Flag(
        ("--questions",), "questions: JSONL with a 'question' field", Path, "FILE", unset="the demo questions"
    ),
    "num_questions": Flag(("-n", "--num-questions"), "questions to run", int, "N", unset="all"),
    "retriever": Flag(("--retriever",), "retriever kind: edr, adr or sr", metavar="KIND"),
    "retrievers": Flag(("--retrievers",), "retriever kinds, comma-separated, of edr,adr,sr", metavar=COMMA_LIST),
    "index_dir": Flag(("--index-dir",), "index directory", Path, "DIR"),
    "seed": Flag(("--seed",), "random seed (the same seed, the same run)", int, "N"),
    "minutes": Flag(("--minutes",), "how long to run, in minutes", float, "X"),
    "threads": Flag(("--threads",), "torch threads", int, "N"),
    "dtypes": Flag(("--dtypes",), "dtypes, comma-separated", metavar=COMMA_LIST),
    # what runs
    "spec": Flag(
        ("--spec",),
        "RaLMSpec configuration (ralm.config.SpecConfig.parse): base, any of P, S, A, s=N; "
        "@G sets OS3's gamma cap (e.g. PSA@0.9)",
        metavar="CONFIG",
    ),
    "configs": Flag(
        ("--configs",),
        "RaLMSpec configurations, comma-separated (ralm.config.SpecConfig.parse): base, any of P/S/A, "
        "s=N for a fixed stride; @G sets OS3's gamma cap (e.g. PSA@0.9)",
        metavar=COMMA_LIST,
    ),
    "max_new_tokens": Flag(
        ("--max-new-tokens",),
        "tokens generated per request at most",
        int,
        "N",
        unset="the config's request.max_new_tokens",
    ),
    "new_tokens": Flag(("--new-tokens",), "tokens generated per request", int, "N"),
    "stride": Flag(("--stride",), "tokens per step (a retrieval every stride tokens)", int, "N"),
    "fast_draft": Flag(
        ("--fast-draft",),
        "also run the engine with generator.fast_draft=N (drafts on the plain kernels, verified; 0: no)",
        int,
        "N",
    ),
    "concurrency": Flag(("--concurrency",), "requests in flight at once", int, "N"),
    "warmup": Flag(("--warmup",), "untimed warm-up requests (0: none)", int, "N"),
    "reps": Flag(("--reps",), "timed repetitions per measurement (the median is reported)", int, "N"),
    "scan": Flag(("--scan",), "the flat index's candidate scan", metavar="SCAN"),
    # servers
    "serve_config": Flag(
        ("--serve-config",),
        "Serve config YAML",
        Path,
        "FILE",
        unset="the repository's serve_config.yaml",
    ),
    "url": Flag(("--url",), "base URL of a running ralmspec server", metavar="URL", unset="start one in-process"),
    "port": Flag(("--port",), "HTTP port", int, "N"),
    "window_ms": Flag(("--window-ms",), "verification batching window (ms)", float, "MS", unset="the server's"),
    "state_url": Flag(
        ("--state-url",),
        "state store: redis://host:6379/0 (password from $RALMSPEC_REDIS_PASSWORD / "
        "$RALMSPEC_REDIS_PASSWORD_FILE), sqlite:///path.db or memory://",
        metavar="URL",
    ),
    # outputs
    "out": Flag(("--out",), "output directory", Path, "DIR"),
    "check": Flag(("--check",), "check only: change nothing, print what is wrong and exit", action="store_true"),
}

#: ``--model`` where the command line resolves ``demo`` (cluster.serve.cli_model)
MODEL_OR_DEMO = (
    "generator: a local path, a Hugging Face name, a preset of ralm/models.py, or demo (the 4.5M-parameter demo model)"
)

#: The flags of a RalmConfig, in the order --help lists them.
CONFIG_FLAGS = ("config", "corpus", "work_dir", "model", "encoder", "pad_to", "dense_scan", "verbose")


def add_shared(p: argparse.ArgumentParser | argparse._ArgumentGroup, **defaults: Any) -> None:
    """Add the shared flags named by the keywords to ``p``, each with the command's default
    (a bare value, or a :class:`Default` for the command's own wording or ``required``)."""
    for dest, use in defaults.items():
        d = use if isinstance(use, Default) else Default(use)
        f = SHARED[dest]
        text = d.help or f.help
        if d.many:
            text += ", comma-separated: one measurement each"
        unset = d.unset or f.unset
        if f.action is None and not d.required:
            if d.value is not None and not d.unset:
                text += " (default: %(default)s)"
            elif unset:
                text += f" (default: {unset})"
        kw: dict[str, Any] = {"dest": dest, "help": text}
        if f.action is not None:
            kw["action"] = f.action
        else:
            kw.update(default=d.value, metavar=f.metavar, required=d.required)
            if d.many:
                kw["metavar"] = f"{f.metavar},..."
            elif f.type is not None:
                kw["type"] = f.type
            choices = d.choices or f.choices
            if choices is not None:
                kw["choices"] = choices
                kw.pop("metavar")
        p.add_argument(*f.names, **kw)


def config_parent(**defaults: Any) -> argparse.ArgumentParser:
    """The parent parser of the RalmConfig flags (``--config``, ``--corpus``, ``--work-dir``,
    ``--model``, ``--encoder``, ``--pad-to``, ``--dense-scan``, ``-v``); ``defaults`` changes the
    wording of some (a :class:`Default` per dest), as ``serve`` does for ``--model``."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("configuration (a RalmConfig: --config FILE, then these flags)")
    add_shared(g, **{dest: defaults.get(dest) for dest in CONFIG_FLAGS})
    return p


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The ``--help`` of every command: the description as written, every flag's default shown
    (unless its help already says it), and metavars by type (N, X, FILE, DIR, LIST, VALUE)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or isinstance(default, bool)
            or default == ""
            or default is argparse.SUPPRESS
            or "(default" in text
            or "default:" in text
        ):
            return text
        return text + " (default: %(default)s)"

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type is int:
            return "N"
        if action.type is float:
            return "X"
        if action.type is Path:
            return "DIR" if action.dest.endswith(("dir", "root")) else "FILE"
        if (isinstance(action.default, str) and "," in action.default) or "comma-separated" in (action.help or ""):
            return COMMA_LIST
        return action.dest.upper() if len(action.dest) <= 8 else "VALUE"
