"""The client side of the server's load shedding: a request answered 503 or 429 with a
``Retry-After`` header is sent again after that delay, a bounded number of times.

The server sheds what it cannot take now - its bounded queues are full, or no coordinator
could be started because a node was lost (:class:`ralm.errors.Overloaded`, answered 503),
or Serve's proxy queue is full (503 or 429) - and says when to come back in
``Retry-After``; nothing of a shed request was started, so sending it again is safe and
gives the same answer. A real client does exactly that, and so do ``ralmspec bench soak``,
``ralmspec bench served`` and the fault and load tests: they check that no request is lost
or wrong, not that every request succeeds on its first try.

Bounded: at most ``max_retries`` retries (:data:`~ralm.constants.CLIENT_SHED_RETRIES`), none
started later than ``budget_s`` after the first try, and no single wait longer than
``max_delay_s``; after that the last answer is returned as it is and the caller counts it
failed. A 503 without ``Retry-After`` (not a shed: the server did not say it may be retried)
is never retried.

    res = send_with_retry(lambda: client.post("/v1/ralm/generate", json=body))
    res.response.status_code, res.retries, res.reasons
"""

from __future__ import annotations

import email.utils
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ralm import constants as C

RETRYABLE_STATUS = frozenset({429, 503})

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a client keeps retrying a shed request."""

    max_retries: int = C.CLIENT_SHED_RETRIES
    budget_s: float = C.CLIENT_SHED_BUDGET_S  # no retry starts later than this after the first try
    max_delay_s: float = C.CLIENT_MAX_RETRY_AFTER_S  # a longer Retry-After is waited this long


DEFAULT_POLICY = RetryPolicy()


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delay-seconds (``"8"``) or an HTTP-date;
    None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        delay = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        delay = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, delay) if math.isfinite(delay) else None


def retry_after(response: Any) -> float | None:
    """The delay before sending ``response``'s request again, when it was shed (503 or 429
    with ``Retry-After``); None when it is an answer to keep."""
    if getattr(response, "status_code", None) not in RETRYABLE_STATUS:
        return None
    return parse_retry_after(response.headers.get("retry-after"))


def shed_reason(response: Any) -> str:
    """``"503 <the error message>"`` of a shed answer (for the retry log)."""
    msg = ""
    try:
        body = json.loads(response.content or b"{}")
        err = body.get("error") if isinstance(body, dict) else None
        msg = str(err.get("message", "")) if isinstance(err, dict) else str(body)[:120]
    except Exception:  # not JSON, or a streamed body not read
        msg = ""
    return f"{response.status_code} {msg[:120]}".strip()


@dataclass
class Retried(Generic[T]):
    """The final answer of a request and how it got there."""

    response: T
    retries: int = 0  # sends after the first
    reasons: list[str] = field(default_factory=list)  # why each retry was made
    attempt_s: list[float] = field(default_factory=list)  # duration of each send, waits excluded
    total_s: float = 0.0  # first send to final answer, waits included
    gave_up: bool = False  # the last answer was still a shed one (retries or budget exhausted)


def call_with_retry(
    attempt: Callable[[], T],
    delay_of: Callable[[T], float | None],
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    reason_of: Callable[[T], str] = str,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Retried[T]:
    """``attempt()`` until ``delay_of(result)`` is None (an answer to keep), retrying after
    that delay within ``policy``. Exceptions of ``attempt`` propagate (a lost request)."""
    t0 = clock()
    out: Retried[T] | None = None
    while True:
        a0 = clock()
        res = attempt()
        now = clock()
        if out is None:
            out = Retried(res)
        out.response = res
        out.attempt_s.append(now - a0)
        out.total_s = now - t0
        delay = delay_of(res)
        if delay is None:
            return out
        delay = min(delay, policy.max_delay_s)
        if out.retries >= policy.max_retries or now + delay - t0 > policy.budget_s:
            out.gave_up = True
            return out
        out.retries += 1
        out.reasons.append(reason_of(res))
        sleep(delay)


def send_with_retry(
    send: Callable[[], Any],
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> Retried[Any]:
    """``send()`` (an HTTP call returning an httpx-like response) with shed answers retried."""
    return call_with_retry(send, retry_after, policy, reason_of=shed_reason, sleep=sleep)


class RetryLog:
    """Retries of many requests (thread-safe): the total, and how many per reason."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.retries = 0
        self.gave_up = 0
        self.reasons: dict[str, int] = {}

    def add(self, res: Retried[Any]) -> None:
        with self.lock:
            self.retries += res.retries
            self.gave_up += res.gave_up
            for r in res.reasons:
                self.reasons[r] = self.reasons.get(r, 0) + 1

    def as_dict(self) -> dict:
        with self.lock:
            return {"retries": self.retries, "gave_up": self.gave_up, "reasons": dict(self.reasons)}


__all__ = [
    "DEFAULT_POLICY",
    "RETRYABLE_STATUS",
    "RetryLog",
    "RetryPolicy",
    "Retried",
    "call_with_retry",
    "parse_retry_after",
    "retry_after",
    "send_with_retry",
    "shed_reason",
]
