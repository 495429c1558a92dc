"""The flags every ``ralmspec`` command that builds a pipeline shares, and the
:class:`ralm.config.RalmConfig` they give (``--config FILE.yaml``, then the flags).

Its own module so that the CLI imports the commands and no command imports the CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ralm.config import RalmConfig
from ralm.retrieval.scan_choice import SCAN_MODES


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML file with a RalmConfig (see ralm/config.py)")
    p.add_argument("--corpus", type=Path, help="corpus JSONL(.gz) in pyserini JsonCollection format")
    p.add_argument("--work-dir", type=Path, help="where indexes and outputs go (default ~/.cache/ralmspec)")
    p.add_argument("--model", help="generator: local path or Hugging Face name")
    p.add_argument("--encoder", help="dense encoder: local:all-MiniLM-L6-v2, a path or a HF name")
    p.add_argument("--pad-to", type=int, help="pad the EDR flat index to N rows (cost emulation; results unchanged)")
    p.add_argument(
        "--dense-scan",
        choices=list(SCAN_MODES),
        help="EDR candidate scan: auto (timed here), faiss, bf16, int8 or gpu (bounded scans, exact after re-scoring)",
    )
    p.add_argument("-v", "--verbose", action="store_true")


def load_config(args: argparse.Namespace) -> RalmConfig:
    """The YAML config of ``--config`` (else the defaults) with the flags that were given applied."""
    cfg = RalmConfig.from_yaml(args.config) if getattr(args, "config", None) else RalmConfig()
    data = cfg.model_dump()
    if getattr(args, "corpus", None):
        data["corpus"] = args.corpus
    if getattr(args, "work_dir", None):
        data["work_dir"] = args.work_dir
    if getattr(args, "model", None):
        data["generator"]["model"] = args.model
    if getattr(args, "encoder", None):
        data["retriever"]["encoder"] = args.encoder
    if getattr(args, "pad_to", None) is not None:
        data["retriever"]["pad_to"] = args.pad_to
    if getattr(args, "dense_scan", None) is not None:
        data["retriever"]["dense_scan"] = args.dense_scan
    if getattr(args, "max_new_tokens", None):
        data["request"]["max_new_tokens"] = args.max_new_tokens
    return RalmConfig.model_validate(data)
