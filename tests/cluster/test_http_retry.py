"""The clients' retry of shed requests (cluster/http_retry.py), and its use by
``ralmspec bench served``'s client: a 503/429 with Retry-After is sent again after that
delay, a bounded number of times; anything else is the answer."""

from __future__ import annotations

import email.utils

import httpx
import pytest

from cluster.http_retry import (
    RetryLog,
    RetryPolicy,
    call_with_retry,
    parse_retry_after,
    retry_after,
    send_with_retry,
)


def _shed(status: int = 503, after: str | None = "2", msg: str = "the server is at capacity") -> httpx.Response:
    headers = {} if after is None else {"Retry-After": after}
    return httpx.Response(status, json={"error": {"message": msg, "code": "overloaded"}}, headers=headers)


def _ok(tokens=(1, 2, 3)) -> httpx.Response:
    return httpx.Response(200, json={"tokens": list(tokens)})


def _sender(responses: list[httpx.Response]):
    left = list(responses)
    sent: list[int] = []

    def send() -> httpx.Response:
        sent.append(1)
        return left.pop(0)

    return send, sent


def test_retry_after_values():
    assert parse_retry_after("8") == 8.0 and parse_retry_after(" 0 ") == 0.0 and parse_retry_after("1.5") == 1.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("nan") is None
    assert parse_retry_after("-3") == 0.0
    date = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert parse_retry_after(date, now=1_000_000.0) == pytest.approx(30.0)
    assert retry_after(_shed(503, "3")) == 3.0 and retry_after(_shed(429, "1")) == 1.0
    assert retry_after(_shed(503, None)) is None  # not a shed: the server did not say it may be retried
    assert retry_after(_shed(500, "3")) is None and retry_after(_ok()) is None


def test_a_shed_request_is_sent_again_after_the_delay_it_was_given():
    send, sent = _sender([_shed(503, "2"), _shed(429, "1", "slow down"), _ok()])
    waits: list[float] = []
    res = send_with_retry(send, sleep=waits.append)
    assert res.response.status_code == 200 and res.response.json()["tokens"] == [1, 2, 3]
    assert (res.retries, waits, len(sent), res.gave_up) == (2, [2.0, 1.0], 3, False)
    assert res.reasons == ["503 the server is at capacity", "429 slow down"] and len(res.attempt_s) == 3
    log = RetryLog()
    log.add(res)
    log.add(send_with_retry(_sender([_ok()])[0]))
    assert log.as_dict() == {
        "retries": 2,
        "gave_up": 0,
        "reasons": {"503 the server is at capacity": 1, "429 slow down": 1},
    }


def test_other_answers_are_never_retried():
    for r in (_shed(503, None), _shed(500, "1"), httpx.Response(400, json={}), _ok()):
        send, sent = _sender([r])
        res = send_with_retry(send, sleep=lambda s: pytest.fail("no wait expected"))
        assert res.response is r and res.retries == 0 and len(sent) == 1 and not res.gave_up


def test_retries_are_bounded_in_number_and_time():
    send, sent = _sender([_shed(503, "1")] * 10)
    waits: list[float] = []
    res = send_with_retry(send, RetryPolicy(max_retries=3, budget_s=100), sleep=waits.append)
    assert res.response.status_code == 503 and res.gave_up and res.retries == 3 and len(sent) == 4
    assert waits == [1.0, 1.0, 1.0]
    # the budget: no retry starts later than budget_s after the first send (a fake clock)
    now = [0.0]
    out = call_with_retry(
        lambda: _shed(503, "30"),
        retry_after,
        RetryPolicy(max_retries=10, budget_s=100, max_delay_s=40),
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        clock=lambda: now[0],
    )
    assert out.gave_up and out.retries == 3 and now[0] == 90.0  # a 4th wait would end at 120 s
    # a Retry-After longer than max_delay_s is cut to it
    waits.clear()
    send, _ = _sender([_shed(503, "3600"), _ok()])
    res = send_with_retry(send, RetryPolicy(max_delay_s=5), sleep=waits.append)
    assert waits == [5.0] and res.response.status_code == 200


def test_a_lost_request_raises():
    def send():
        raise httpx.ConnectError("refused")

    with pytest.raises(httpx.ConnectError):
        send_with_retry(send)


def test_the_served_bench_client_retries_shed_requests_and_counts_them():
    from cluster.native_client import Client

    answers = [_shed(503, "0"), _shed(429, "0"), _ok((4, 5)), _shed(503, None, "not retryable")]
    transport = httpx.MockTransport(lambda request: answers.pop(0))
    client = Client("http://bench.invalid", timeout=5)
    client._local.c = httpx.Client(base_url=client.url, transport=transport)
    out, _ = client.generate({"question": "q"})
    assert out["tokens"] == [4, 5] and client.retries.retries == 2
    with pytest.raises(RuntimeError, match="HTTP 503"):  # a 503 without Retry-After is a failure
        client.generate({"question": "q"})
