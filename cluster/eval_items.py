"""The requests of ``ralmspec eval``: one :class:`EvalItem` per (question, retriever, config).

Shared by the job runner (:mod:`cluster.eval_job`, which re-exports these names) and
its report (:mod:`cluster.eval_report`), so neither needs the other's module.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from ralm.config import RequestConfig, SpecConfig
from ralm.job import RalmJob

SEQ = "seq"  # the config name of the RaLMSeq baseline


@dataclass(frozen=True)
class EvalItem:
    """One request of the job: a question, a retriever, and ``seq`` or a RaLMSpec config."""

    qid: int
    question: str
    retriever: str
    config: str

    @property
    def method(self) -> str:
        return "seq" if self.config == SEQ else "spec"

    @property
    def key(self) -> str:
        """Stable store key; includes a hash of the question so an edited file cannot alias."""
        qh = hashlib.sha256(self.question.encode("utf-8")).hexdigest()[:12]
        return f"{self.retriever}|{self.config}|q{self.qid:06d}-{qh}"

    def spec(self) -> SpecConfig | None:
        """The RaLMSpec configuration of the item; ``None`` for the RaLMSeq baseline."""
        return None if self.config == SEQ else SpecConfig.parse(self.config)

    def job(self, request: RequestConfig) -> RalmJob:
        """The item as a :class:`~ralm.job.RalmJob` under the job's generation options ``request``."""
        return RalmJob(
            question=self.question,
            method=self.method,
            retriever=self.retriever,
            spec=self.spec() or SpecConfig(),
            request=request,
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EvalItem:
        return cls(int(d["qid"]), d["question"], d["retriever"], d["config"])


def make_items(questions: Sequence[str], kinds: Sequence[str], configs: Sequence[str]) -> list[EvalItem]:
    """Question-major order, baseline first: partial progress covers every config alike."""
    return [EvalItem(qi, q, kind, c) for qi, q in enumerate(questions) for kind in kinds for c in (SEQ, *configs)]
