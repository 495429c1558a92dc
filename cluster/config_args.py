"""The :class:`ralm.config.RalmConfig` that a command's flags give: ``--config FILE.yaml``,
then the flags of :func:`cluster.flags.config_parent` (and ``--max-new-tokens``) applied.

Its own module so that the CLI imports the commands and no command imports the CLI.
"""

from __future__ import annotations

import argparse

from ralm.config import RalmConfig


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
