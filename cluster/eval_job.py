"""``ralmspec eval``: resumable batch evaluation of RaLMSeq against RaLMSpec.

    ralmspec eval --questions FILE [--retrievers edr,adr,sr] [--configs base,P,S,A,PSA]
                  [--state-url redis://host:6379/0] [--job-id ID] [--out DIR] [-n N]

For every question and retriever it answers with RaLMSeq and with each RaLMSpec
configuration, and checks that every RaLMSpec output is token-for-token RaLMSeq's.

**Items and resumption.** One *item* is one (question, retriever, config) request, where
config ``seq`` is the RaLMSeq baseline. Each finished item is recorded in the state store
(:mod:`cache.state`) under the job id, atomically and first-write-wins. A job that is
killed and started again with the same job id skips every recorded item, so nothing
finished is recomputed or lost; the final outputs are always produced *from the store*,
so they are complete and identical whichever run computed which item.

**State store.** ``--state-url`` (or ``$RALMSPEC_STATE_URL``): Redis on a cluster, so
the driver pod may die and be replaced. Without either, a SQLite file in the output
directory (``sqlite://OUT/state.sqlite``): durable across kills on one machine, no
server needed. (The in-process memory store would lose everything with the process.)

**Backends** (:mod:`cluster.eval_backends`). Items are answered by an :class:`EvalBackend`:

* ``local`` - an in-process :class:`ralm.pipeline.Pipeline` (no Ray); with
  ``--concurrency N`` (N > 1) the items of each (retriever, config) run as one wave, N at
  a time through the shared engine (:mod:`cluster.concurrency`), each wave from a cold
  start, and the report adds this run's throughput per configuration;
* ``ray`` - a pool of Ray actors, each holding a Pipeline; used automatically when the
  command runs as a Ray job (``ray job submit --working-dir . -- ralmspec eval ...``);
* anything registered with :func:`register_backend`, e.g. the serving layer's coordinator
  pool via :class:`RequestFnBackend` (``fn(job: RalmJob) -> RalmResult.as_dict()``, the
  signature of ``actors.coordinator.Coordinator.run``).

**Outputs** (in ``--out``): ``results.jsonl`` (one line per item), ``summary.md`` (table
per retriever and config: mean latency split into generation and retrieval time, speed-up,
retrieval eliminated, gamma, KB calls, rollbacks, identical outputs), ``summary.json``
(the same rows, :class:`cluster.report.ConfigSummary`'s spelled-out fields),
``latency.png`` and ``runs/<run id>.json`` (what this invocation computed and skipped).
Exit status 1 if any output differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cache.state import STATE_URL_ENV, StateStoreError, StateStoreUnavailable, open_state_store
from cluster.concurrency import CONCURRENCY_HELP, check_concurrency
from cluster.config_args import load_config
from cluster.eval_backends import EvalBackend, make_backend
from cluster.eval_items import EvalItem, make_items
from cluster.eval_report import write_outputs
from cluster.flags import SHARED, Default, HelpFormatter, add_shared, config_parent
from cluster.report import bench_header, exactness_status
from ralm import constants as C
from ralm.config import SpecConfig
from ralm.corpus import CorpusError, load_questions
from ralm.errors import ConfigError, RalmInputError
from ralm.retrieval.index_build import check_kind

log = logging.getLogger(__name__)

DEFAULT_CONFIGS = "base,P,S,A,PSA"
DEFAULT_RETRIEVERS = "edr,adr,sr"


# ====================================================================== the job
def fingerprint(cfg) -> dict:
    """Everything that changes an item's result: a job may only resume with the same."""
    return {
        "corpus": str(cfg.corpus),
        "generator": cfg.generator.model_dump(mode="json", exclude={"device", "torch_threads", "doc_kv_cache_bytes"}),
        "retriever": cfg.retriever.model_dump(mode="json", exclude={"kind", "index_dir"}),
        "request": cfg.request.model_dump(mode="json"),
    }


def default_job_id(fp: dict, questions_path: str) -> str:
    blob = json.dumps({"fp": fp, "questions": questions_path}, sort_keys=True)
    return "eval-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


class JobMismatch(ValueError):
    pass


def check_resume(stored: dict, meta: dict, job_id: str) -> None:
    if stored.get("fingerprint") != meta["fingerprint"]:
        diff = sorted(
            k
            for k in set(stored.get("fingerprint", {})) | set(meta["fingerprint"])
            if stored.get("fingerprint", {}).get(k) != meta["fingerprint"].get(k)
        )
        raise JobMismatch(
            f"job {job_id!r} was started with a different setup ({', '.join(diff) or 'unknown'} "
            f"differ); results would not be comparable. Use a new --job-id, or the original settings."
        )


@dataclass
class RunReport:
    job_id: str
    run_id: str
    total: int
    skipped: int
    computed: int
    computed_keys: list[str]
    wall_s: float
    concurrency: int = 1
    # --concurrency N > 1: per (retriever, config) computed in this run, its waves' throughput
    throughput: list[dict] = dataclasses.field(default_factory=list)


def record_waiting(store, job_id: str, key: str, row: dict, wait_s: float, poll_s: float = 1.0) -> bool:
    """``store.record_item``, waiting out a state-store outage of up to ``wait_s`` seconds (the
    row is kept in memory meanwhile), so a job pauses while Redis is down and goes on when it
    is back, losing nothing. Past ``wait_s`` the :class:`StateStoreUnavailable` is raised (the
    job stops; rerunning it resumes from what was recorded)."""
    deadline = time.monotonic() + wait_s
    warned = False
    while True:
        try:
            ok = store.record_item(job_id, key, row)
            if warned:
                log.warning("state store is back: recorded %s, the job goes on", key)
            return ok
        except StateStoreUnavailable as e:
            if time.monotonic() >= deadline:
                raise
            if not warned:
                log.warning("state store unavailable; waiting up to %.0f s to record %s: %s", wait_s, key, e)
                warned = True
            time.sleep(poll_s)


def run_items(
    store,
    job_id: str,
    run_id: str,
    items: Sequence[EvalItem],
    backend: EvalBackend,
    progress: bool = True,
    state_wait_s: float = C.EVAL_STATE_WAIT_S,
) -> RunReport:
    """Answer every item not yet recorded under ``job_id`` and record it as it finishes
    (waiting out a state-store outage of up to ``state_wait_s``, see :func:`record_waiting`)."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    done = store.finished_items(job_id)
    todo = [it for it in items if it.key not in done]
    skipped = len(items) - len(todo)
    computed: list[str] = []
    bar = tqdm(
        total=len(items), initial=skipped, desc=f"eval {job_id}", unit="req", disable=not progress, dynamic_ncols=True
    )
    try:
        for item, result in backend.run(todo):
            row = {
                **item.as_dict(),
                "key": item.key,
                "method": item.method,
                **result,
                "run_id": run_id,
                "recorded_at": time.time(),
            }
            record_waiting(store, job_id, item.key, row, state_wait_s)
            computed.append(item.key)
            bar.update(1)
            if "error" in result:
                log.warning("item %s failed: %s", item.key, result["error"])
    finally:
        bar.close()
    return RunReport(job_id, run_id, len(items), skipped, len(computed), computed, time.perf_counter() - t0)


# ====================================================================== CLI
def add_eval_args(p: argparse.ArgumentParser) -> None:
    """Eval-specific flags (the RalmConfig ones come from :func:`cluster.flags.config_parent`)."""
    add_shared(
        p,
        questions=None,
        num_questions=Default(help="use the first N questions"),
        retrievers=DEFAULT_RETRIEVERS,
        configs=Default(DEFAULT_CONFIGS, help=SHARED["configs"].help + "; RaLMSeq always runs"),
        max_new_tokens=None,
        state_url=Default(
            help="state store for progress and results (memory:// is not resumable): "
            + SHARED["state_url"].help.removeprefix("state store: "),
            unset="$RALMSPEC_STATE_URL, else sqlite://OUT/state.sqlite",
        ),
    )
    p.add_argument(
        "--job-id",
        default=None,
        help="resume/identify the job; default: derived from the setup, so rerunning the same command resumes",
    )
    add_shared(p, out=Path("eval-out"))
    p.add_argument(
        "--backend", default="auto", help="auto (ray inside a Ray job, else local), local, ray, or a registered backend"
    )
    p.add_argument("--workers", type=int, default=1, help="ray backend: number of pipeline actors")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="ray backend: CPUs per actor")
    p.add_argument("--worker-gpus", type=float, default=0.0, help="ray backend: GPUs per actor")
    add_shared(
        p,
        warmup=Default(1, help="untimed warm-up requests per backend worker (0: none)"),
        concurrency=Default(1, help="local backend: " + CONCURRENCY_HELP),
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def eval_main(args: argparse.Namespace) -> int:
    """Entry point of ``ralmspec eval``: 0 when every RaLMSpec output equals RaLMSeq's, 1 if
    any differs, 2 for an unusable state store, 3 when requests are still unrecorded."""
    cfg = load_config(args)
    kinds = tuple(check_kind(k.strip()) for k in args.retrievers.split(",") if k.strip())
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not kinds or not configs:
        raise ConfigError("--retrievers and --configs must each name at least one entry")
    for c in configs:
        SpecConfig.parse(c)  # fail fast on a bad name
    check_concurrency(args.concurrency)
    qpath = Path(args.questions or C.DEMO_QUESTIONS)
    questions = load_questions(qpath, limit=args.num_questions)
    items = make_items(questions, kinds, configs)
    out: Path = args.out
    url = args.state_url or os.environ.get(STATE_URL_ENV) or f"sqlite://{out.resolve() / 'state.sqlite'}"
    fp = fingerprint(cfg)
    job_id = args.job_id or default_job_id(fp, str(qpath.resolve()))
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    progress = not args.no_progress
    try:
        store = open_state_store(url)
    except StateStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with store:
        if not store.durable:
            print("warning: the memory state store is not durable; a killed job cannot be resumed", file=sys.stderr)
        meta = {
            "fingerprint": fp,
            "questions": str(qpath),
            "created_at": time.time(),
            "created_by": f"{socket.gethostname()}:{os.getpid()}",
        }
        try:
            check_resume(store.init_job(job_id, meta), meta, job_id)
        except StateStoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        done = store.finished_items(job_id)
        todo = sum(1 for it in items if it.key not in done)
        print(
            f"job {job_id}: {len(items)} requests ({len(questions)} questions x {len(kinds)} retrievers x "
            f"(RaLMSeq + {len(configs)} configs)); {len(items) - todo} already recorded in "
            f"{store.describe()}; run {run_id}",
            file=sys.stderr,
        )
        report = RunReport(job_id, run_id, len(items), len(items), 0, [], 0.0)
        try:
            if todo:
                warm = questions[: max(0, args.warmup)]
                backend = make_backend(args.backend, cfg, kinds, args, warm)
                print(f"backend: {backend.describe()}", file=sys.stderr)
                try:
                    report = run_items(store, job_id, run_id, items, backend, progress=progress)
                finally:
                    backend.close()
                throughput = getattr(backend, "throughput", {})
                report.concurrency = args.concurrency
                report.throughput = [
                    {
                        "retriever": k,
                        "config": c,
                        **dataclasses.asdict(tp),
                        "requests_per_s": tp.requests_per_s,
                        "tokens_per_s": tp.tokens_per_s,
                    }
                    for (k, c), tp in throughput.items()
                ]
            else:
                throughput = {}
            notes = bench_header(
                "eval", len(questions), cfg, kinds, f"{cfg.corpus} (questions from {qpath})", args.concurrency
            )
            res = write_outputs(out, job_id, store, items, configs, kinds, notes, throughput=throughput)
        except StateStoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{run_id}.json").write_text(json.dumps(dataclasses.asdict(report), indent=1))
    counts = res["counts"]
    print(res["markdown"])
    print(
        f"run {run_id}: computed {report.computed}, skipped {report.skipped} already recorded; "
        f"wrote {out}/results.jsonl, summary.md, summary.json" + (", latency.png" if res["summary"] else "")
    )
    if exactness_status(counts["different"], "RaLMSpec outputs differ from RaLMSeq"):
        return 1
    if counts["missing"]:
        return 3
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m cluster.eval_job``: the common flags and :func:`add_eval_args`."""
    p = argparse.ArgumentParser(
        prog="ralmspec eval", description=__doc__, parents=[config_parent()], formatter_class=HelpFormatter
    )
    add_eval_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.eval_job ...``: the same as ``ralmspec eval ...``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return eval_main(args)
    except (RalmInputError, ConfigError, CorpusError, JobMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
