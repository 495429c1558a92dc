"""Request checkpoints of a coordinator: the verified prefix of a request, kept in the state store.

While a request with a ``request_id`` runs (and the coordinator's store is durable), every
verified prefix is saved (:func:`checkpointer`); a request sent again with the same id and
the same job (:meth:`RalmJob.digest <ralm.job.RalmJob.digest>`) resumes from it (:func:`resume_point`); the checkpoint is
deleted once the request is done or cancelled (:func:`forget_checkpoint`). A checkpoint is
an optimisation: a store that fails is logged, never a failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cache.state import RequestCheckpoint
from ralm.results import VerifiedPrefix

log = logging.getLogger(__name__)


def resume_point(store: Any, rid: str, digest: str, q_tokens: list[int]) -> VerifiedPrefix | None:
    """The verified prefix checkpointed for request ``rid`` (same job), or None."""
    try:
        cp = store.load_checkpoint(rid)
    except Exception as e:
        log.warning("cannot load the checkpoint of request %s: %s", rid, e)
        return None
    if (
        cp is None
        or cp.meta.get("job") != digest
        or cp.prompt_len != len(q_tokens)
        or cp.tokens[: cp.prompt_len] != q_tokens
        or not cp.steps
    ):
        return None
    return VerifiedPrefix(cp.tokens[cp.prompt_len :], list(cp.doc_ids), bool(cp.meta.get("eos")))


def checkpointer(store: Any, rid: str, digest: str, q_tokens: list[int]) -> Callable[[list[int], list, bool], None]:
    """``save(generated, doc_ids, eos)``: checkpoint request ``rid``'s verified prefix in ``store``
    (the loops' ``on_verified``), tagged with the job and the coordinator actor's name."""
    try:
        import ray

        me = ray.get_runtime_context().get_actor_name() or ""
    except Exception:
        me = ""

    def save(generated: list[int], doc_ids: list, eos: bool) -> None:
        cp = RequestCheckpoint(
            request_id=rid,
            tokens=list(q_tokens) + list(generated),
            doc_ids=list(doc_ids),
            steps=len(doc_ids),
            prompt_len=len(q_tokens),
            meta={"job": digest, "eos": bool(eos), "coordinator": me},
        )
        try:
            store.save_checkpoint(cp)
        except Exception as e:  # a checkpoint is an optimisation: never fail the request
            log.warning("cannot save the checkpoint of request %s: %s", rid, e)

    return save


def forget_checkpoint(store: Any, rid: str | None) -> None:
    """Delete request ``rid``'s checkpoint (done, or cancelled: nobody waits for it any more)."""
    if not rid:
        return
    try:
        store.delete_checkpoint(rid)
    except Exception as e:
        log.warning("cannot delete the checkpoint of request %s: %s", rid, e)
