"""A multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``: a head and three
worker raylets, each its own node with its own custom resources), the app placed on it by
its config, and chaos under 16 concurrent requests:

- a whole worker node holding a shard is removed (its raylet and every worker on it die):
  the shard is re-created from the index files on the surviving shard node;
- the generator replica is killed: Serve replaces it on its node;
- the verifier is killed: Ray restarts it;
- the Serve controller is killed: it restarts, and the replicas serve meanwhile;
- the node holding every coordinator is removed (a replacement node joins 2 s later): the
  pool notices the coordinators that no longer answer, starts new ones on the new node, and
  their requests resume from their checkpoints (a SQLite store shared by the nodes).

Each fault counts requests sent, answered correctly (token-identical to in-process
RaLMSeq) on the first try, failed cleanly (shed with 503/429 + Retry-After, then answered
correctly on a retry, as a real client retries: :mod:`cluster.http_retry`) and lost
(anything else: an error, a wrong answer, a timeout, still shed after the bounded retries).
Lost must be 0; the retries are printed with the counts."""

from __future__ import annotations

import gc
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.http_retry import RetryLog, send_with_retry
from ralm.config import RequestConfig
from ralm.seq import run_seq
from tests.actors.support import REPO
from tests.deployments.serving import free_port

REQ = RequestConfig(max_new_tokens=24, generation_stride=2)
KINDS = ("edr", "sr")
N_REQUESTS = 16
HEAD = {"ralmspec_head": 100}
COORD = {"ralmspec_coordinator": 100}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, index_dirs, fixture_corpus, gen_model_dir):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from actors.signals import preserve_fatal_signal_handlers
    from deployments.app import build_app
    from tests.deployments.serving import app_args

    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ray.is_initialized():
        from tests.actors.support import stop_ray

        stop_ray()
    with preserve_fatal_signal_handlers():
        c = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "resources": HEAD, "include_dashboard": False},
        )
        shard_a = c.add_node(num_cpus=1, resources={"ralmspec_shard": 4})
        shard_b = c.add_node(num_cpus=1, resources={"ralmspec_shard": 4})
        gen_node = c.add_node(num_cpus=1, resources={"ralmspec_generator": 1})
        coord_node = c.add_node(num_cpus=1, resources=COORD)
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    place = {"ralmspec_head": 0.01}
    args = app_args(
        tmp_path_factory.mktemp("multinode-work"),
        index_dirs,
        fixture_corpus,
        gen_model_dir,
        KINDS,
        REQ,
        sharding={"n_shards": 2, "num_cpus": 0.05, "resources": {"ralmspec_shard": 1}, "spread": True},
        generator_deployment={"num_cpus": 0.2, "resources": {"ralmspec_generator": 1}},
        verifier={"window_ms": 10.0, "resources": place},
        pool={"size": 4, "max_size": 16, "resources": {"ralmspec_coordinator": 0.01}},
        ingress={"resources": place},
        state={"store": {"url": f"sqlite://{tmp_path_factory.mktemp('multinode-state') / 'state.db'}"}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app(args), name="ralmspec", route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        nodes = {"shard_a": shard_a, "shard_b": shard_b, "gen": gen_node, "coord": coord_node}
        yield {"cluster": c, "client": client, "nodes": nodes}
    gc.collect()  # no ObjectRef of this cluster may be freed after its shutdown (see stop_ray)
    with preserve_fatal_signal_handlers():
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def want(retrievers, local_generator, fixture_questions):
    qs = fixture_questions[:4]
    return {(kind, q): run_seq(q, local_generator, retrievers[kind], REQ).tokens for kind in KINDS for q in qs}


def _actors_by_class() -> dict[str, list[dict]]:
    """Live actors per class, with their node ids (from the GCS; no dashboard needed)."""
    import ray

    out: dict[str, list[dict]] = {}
    for a in ray._private.state.actors().values():  # GCS actor table
        if a.get("State") != "ALIVE":
            continue
        cls = a.get("ActorClassName") or ""
        out.setdefault(cls, []).append({"id": a["ActorID"], "node": a["Address"]["NodeID"], "name": a.get("Name")})
    return out


def _load(client, want, fault) -> dict:
    """16 requests (RaLMSeq and PSA over both retrievers) in flight; ``fault()`` runs once the
    first few have started. Each is sent as a real client sends it: a shed answer (503/429
    with Retry-After) is retried after that delay, a bounded number of times
    (:mod:`cluster.http_retry`). Returns the counts."""
    jobs = [(kind, q, m) for (kind, q) in want for m in ("seq", "spec")][:N_REQUESTS]
    counts = {
        "sent": len(jobs),
        "correct": 0,
        "failed_cleanly": 0,
        "lost": 0,
        "lost_detail": [],
        "after_fault": 0,
        "retries": 0,
    }
    log = RetryLog()  # shed reasons (503 + message) -> count, printed with the counts
    fault_at: list[float] = []
    lock = threading.Lock()
    started = threading.Event()

    def one(job):
        kind, q, method = job
        body = {"question": q, "retriever": kind, "method": method, **({"spec": "PSA"} if method == "spec" else {})}
        started.set()
        try:
            res = send_with_retry(lambda: client.post("/v1/ralm/generate", json=body))
        except Exception as e:
            with lock:
                counts["lost"] += 1
                counts["lost_detail"].append(f"{job}: {type(e).__name__}")
            return
        log.add(res)
        r = res.response
        with lock:
            counts["retries"] += res.retries
            counts["after_fault"] += bool(fault_at and time.monotonic() > fault_at[0])
            if r.status_code == 200 and r.json()["tokens"] == want[(kind, q)]:
                counts["correct" if res.retries == 0 else "failed_cleanly"] += 1
            else:
                counts["lost"] += 1
                counts["lost_detail"].append(f"{job}: HTTP {r.status_code} after {res.retries} retries {r.text[:200]}")

    with ThreadPoolExecutor(N_REQUESTS) as ex:
        futs = [ex.submit(one, j) for j in jobs]
        started.wait(30)
        time.sleep(1.0)  # requests are in flight
        fault_at.append(time.monotonic())
        fault()
        for f in futs:
            f.result(timeout=900)
    print(f"fault counts: {counts}; retries of shed requests: {log.as_dict()}")
    return counts


def _check(counts):
    assert counts["lost"] == 0, counts["lost_detail"]
    assert counts["correct"] + counts["failed_cleanly"] == counts["sent"]
    assert counts["after_fault"] >= counts["sent"] // 2, counts  # the fault hit requests in flight


def test_the_config_places_the_app_on_its_nodes(cluster):
    nodes = cluster["nodes"]
    by_cls = _actors_by_class()
    shard_nodes = {a["node"] for a in by_cls.get("RetrievalShard", [])}
    assert shard_nodes <= {nodes["shard_a"].node_id, nodes["shard_b"].node_id} and len(shard_nodes) == 2, by_cls
    gen = [a for cls, acts in by_cls.items() if "Generator" in cls for a in acts]
    assert gen and all(a["node"] == nodes["gen"].node_id for a in gen), gen
    head = cluster["cluster"].head_node.node_id
    assert by_cls.get("Verifier") and all(a["node"] == head for a in by_cls["Verifier"]), by_cls.get("Verifier")
    coords = by_cls.get("CoordinatorHost")
    assert coords and all(a["node"] == nodes["coord"].node_id for a in coords), coords


def test_a_worker_node_with_a_shard_is_removed_under_load(cluster, want):
    c, nodes = cluster["cluster"], cluster["nodes"]
    counts = _load(cluster["client"], want, lambda: c.remove_node(nodes["shard_a"], allow_graceful=False))
    _check(counts)
    shard_nodes = {a["node"] for a in _actors_by_class().get("RetrievalShard", [])}
    assert shard_nodes == {nodes["shard_b"].node_id}  # both shards now live on the surviving node


def test_the_generator_replica_is_killed_under_load(cluster, want):
    import ray

    def kill():
        (rep,) = [a for cls, acts in _actors_by_class().items() if "Generator" in cls for a in acts]
        ray.kill(ray.get_actor(rep["name"], namespace="serve"), no_restart=True)

    _check(_load(cluster["client"], want, kill))


def test_the_verifier_is_killed_under_load(cluster, want):
    import ray

    def kill():  # restarted by Ray (max_restarts); its calls in flight are retried
        for v in _actors_by_class()["Verifier"]:
            ray.kill(ray.get_actor(v["name"], namespace="ralmspec"), no_restart=False)

    _check(_load(cluster["client"], want, kill))


def test_the_serve_controller_is_killed_under_load(cluster, want):
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    def kill():
        ray.kill(ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE), no_restart=False)

    _check(_load(cluster["client"], want, kill))
    r = cluster["client"].get("/healthz")
    assert r.status_code == 200


def test_the_node_holding_every_coordinator_is_removed_under_load(cluster, want):
    """Runs last (it replaces a node). The coordinators' calls in flight may never return (their
    node is gone): the pool's pings find them lost, replacements start on the node that joins,
    and each request resumes from its checkpoint or gets a 503 that succeeds on retry."""
    c, nodes = cluster["cluster"], cluster["nodes"]

    def fault():
        c.remove_node(nodes["coord"], allow_graceful=False)
        time.sleep(2.0)
        nodes["coord"] = c.add_node(num_cpus=1, resources=COORD)

    _check(_load(cluster["client"], want, fault))
    coords = _actors_by_class().get("CoordinatorHost", [])
    assert coords and all(a["node"] == nodes["coord"].node_id for a in coords), coords
    pool = cluster["client"].get("/v1/ralm/stats").json()["pool"]
    print(f"pool after the coordinator node was lost: {pool}")
    assert pool["replaced"] >= 1 and pool["waiting"] == 0
