"""Errors raised for bad input; their messages are shown to users verbatim."""
from __future__ import annotations


class RalmInputError(ValueError):
    """A request is invalid (empty or over-long question, bad parameter)."""


class ConfigError(ValueError):
    """A configuration names something that does not exist (unknown retriever, bad path)."""
