"""The frozen :class:`~ralm.results.RalmResult`: made once by the loop, never changed after."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from ralm.config import RequestConfig
from ralm.results import RalmResult, RequestStats
from ralm.seq import run_seq
from tests.factories import ScriptedGenerator, ScriptedKB

QUESTION = "alpha beta gamma delta"


def _result() -> RalmResult:
    gen = ScriptedGenerator()
    kb = ScriptedKB({}, n_q=len(gen.encode_question(QUESTION)), k=2)
    return run_seq(QUESTION, gen, kb, RequestConfig(max_new_tokens=6, generation_stride=2))


def test_a_result_cannot_be_changed_after_the_loop():
    res = _result()
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.tokens = []  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.queue_s = 1.0  # type: ignore[misc]


def test_a_served_result_is_a_new_one_with_its_queue_time():
    res = _result()
    served = res.queued(0.25)
    assert served is not res and res.queue_s is None and served.queue_s == 0.25
    assert served.tokens is res.tokens and served.stats is res.stats  # nothing recomputed
    assert "queue_s" not in res.as_dict()["stats"] and served.as_dict()["stats"]["queue_s"] == 0.25
    assert pickle.loads(pickle.dumps(served)) == served  # crosses the actor boundary as it is


def test_the_json_shape():
    res = _result()
    d = res.as_dict()
    assert list(d) == ["text", "tokens", "finish_reason", "exact", "stats"]
    assert (d["text"], d["tokens"], d["finish_reason"], d["exact"]) == (res.text, res.tokens, res.finish_reason, True)
    assert d["stats"] == res.stats.as_dict() == res.stats_dict()
    stats = RequestStats(inexact_options=["drafting"], exact=False)
    assert RalmResult("", [], stats).exact is False
