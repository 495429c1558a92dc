"""Paths in RalmConfig mean the same thing from Python, the CLI and serve_config.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml

from ralm.config import RalmConfig


def test_home_directory_is_expanded_everywhere(tmp_path):
    cfg = RalmConfig(work_dir="~/ralm-work", retriever={"index_dir": "~/ralm-index"})
    assert cfg.work_dir == Path.home() / "ralm-work"
    assert cfg.retriever.index_dir == Path.home() / "ralm-index"
    assert cfg.index_dir("edr") == Path.home() / "ralm-index"
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"work_dir": "~/.cache/ralmspec"}))
    from_yaml = RalmConfig.from_yaml(f)
    assert from_yaml.work_dir == Path.home() / ".cache" / "ralmspec"
    assert "~" not in str(from_yaml.index_dir("sr"))
    # a dump and reload is stable (no "~" comes back)
    assert RalmConfig.model_validate(from_yaml.model_dump(mode="json")).work_dir == from_yaml.work_dir
