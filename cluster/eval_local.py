"""The in-process backend of ``ralmspec eval`` (:mod:`cluster.eval_job`): a
:class:`ralm.pipeline.Pipeline` answering items one at a time, or with ``--concurrency N``
each (retriever, config)'s items as one concurrent wave (:mod:`cluster.concurrency`).
Also the item-answering helpers the Ray backend's actors use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from cluster.concurrency import Throughput, check_concurrency, run_wave, verify_pool
from cluster.eval_items import EvalItem
from ralm.errors import RalmInputError


def _cold(pipe) -> None:
    """Empty doc-KV cache and KV sessions, as at the start of every benchmark request."""
    pipe.engine.clear_kv_caches()


def answer_item(pipe, item: EvalItem, executor=None, cold: bool = True) -> dict:
    """One item's ``RalmResult.as_dict()`` (``{"error": ...}`` for invalid input); ``cold``:
    clear the caches first; ``executor``: RaLMSpec's asynchronous-verification pool."""
    if cold:
        _cold(pipe)  # every request starts cold, like the benchmark
    try:
        res = pipe.run(item.job(pipe.cfg.request), executor=executor)
    except RalmInputError as e:  # deterministic: record it, don't retry forever
        return {"error": str(e)}
    return res.as_dict()


def warm_pipeline(pipe, questions: Sequence[str], kinds: Sequence[str]) -> None:
    """Untimed warm-up (FAISS, Lucene, torch lazy initialisation)."""
    for q in questions:
        for kind in kinds:
            try:
                pipe.answer(q, kind=kind, method="seq")
                pipe.answer(q, kind=kind, method="spec")
            except RalmInputError:
                pass


class LocalBackend:
    """In-process :class:`ralm.pipeline.Pipeline`: one item at a time, or with
    ``concurrency`` > 1 each (retriever, config)'s items as one concurrent wave;
    :attr:`throughput` then holds each (retriever, config)'s waves of this run."""

    name = "local"

    def __init__(self, cfg, kinds: Sequence[str], warmup: Sequence[str] = (), pipeline=None, concurrency: int = 1):
        self.cfg, self.kinds, self.warmup = cfg, tuple(kinds), list(warmup)
        self._pipe = pipeline
        self.concurrency = concurrency
        self.throughput: dict[tuple[str, str], Throughput] = {}

    @property
    def pipe(self):
        if self._pipe is None:
            from ralm.pipeline import Pipeline  # lazy: torch loads only when a backend answers items

            pipe = Pipeline.from_config(self.cfg, kinds=self.kinds)
            check_concurrency(self.concurrency, pipe.engine)
            warm_pipeline(pipe, self.warmup, self.kinds)
            self._pipe = pipe
        return self._pipe

    def describe(self) -> str:
        extra = f", {self.concurrency} requests at once per configuration" if self.concurrency > 1 else ""
        return f"local (in-process pipeline, pid {os.getpid()}{extra})"

    def run(self, items: Sequence[EvalItem]) -> Iterator[tuple[EvalItem, dict]]:
        if self.concurrency <= 1:
            for item in items:
                yield item, answer_item(self.pipe, item)
            return
        pipe = self.pipe
        waves: dict[tuple[str, str], list[EvalItem]] = {}
        for item in items:  # first-appearance order of (retriever, config), items in order
            waves.setdefault((item.retriever, item.config), []).append(item)
        for key, wave in waves.items():
            _cold(pipe)  # each configuration's wave starts cold
            with verify_pool(self.concurrency) as pool:
                results, tp = run_wave(
                    lambda it: answer_item(pipe, it, pool, cold=False),
                    wave,
                    self.concurrency,
                    lambda r: len(r.get("tokens", ())),
                )
            self.throughput[key] = self.throughput[key].add(tp) if key in self.throughput else tp
            yield from zip(wave, results)

    def close(self) -> None:
        pass
