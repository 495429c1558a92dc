"""Session fixtures shared by all tests: the fixture corpus, its questions, and the
three KB indexes (EDR, ADR, SR) built once from it into a temporary directory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is unreachable: never try it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# without a GPU the Triton kernels run in triton's interpreter on CPU tensors; triton reads the
# variable when a function is decorated, so it is set before anything can import triton
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# passage embeddings built by tests go to a per-session directory, never the user's cache
# (Ray workers started by the tests inherit it). Under pytest-xdist each worker process gets
# its own: a worker removes its directory when it exits, while the others may still use theirs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RALMSPEC_EMBEDDING_CACHE"] = tempfile.mkdtemp(
        prefix=f"ralmspec-test-embeddings-{os.environ['PYTEST_XDIST_WORKER']}-"
    )
else:
    os.environ.setdefault("RALMSPEC_EMBEDDING_CACHE", tempfile.mkdtemp(prefix="ralmspec-test-embeddings-"))
atexit.register(shutil.rmtree, os.environ["RALMSPEC_EMBEDDING_CACHE"], True)
# no invariance proof is taken from disk in-process: tests swap kernels to see the proof refuse
# them, which no cache key can see (a local Ray's workers get a shared folder: start_ray)
os.environ.setdefault("RALMSPEC_PROOF_CACHE", "off")
# the folder Ray's processes share: made by the controller, so pytest-xdist workers inherit it
# (`make test` gives both of its pytest runs one folder, and removes it)
if "RALMSPEC_TEST_PROOF_CACHE" not in os.environ:
    os.environ["RALMSPEC_TEST_PROOF_CACHE"] = tempfile.mkdtemp(prefix="ralmspec-test-proofs-")
    atexit.register(shutil.rmtree, os.environ["RALMSPEC_TEST_PROOF_CACHE"], True)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ralm.config import RetrieverConfig  # noqa: E402
from ralm.corpus import Corpus, load_questions  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent / "data"
FIXTURE_CORPUS = DATA_DIR / "fixture_corpus.jsonl"
FIXTURE_QUESTIONS = DATA_DIR / "fixture_questions.jsonl"
KINDS = ("edr", "adr", "sr")

# small, fast index parameters for tests
TEST_HNSW = dict(hnsw_m=16, hnsw_ef_construction=64, hnsw_ef_search=64)


# ---------------------------------------------------------------- unit / integration markers
# A test is `integration` when it needs a live external process: a local Ray cluster (actors,
# Serve), a redis-server, or an eval job. Three ways to be one, checked in this order: an
# explicit @pytest.mark.integration (or pytest.param(..., marks=...)); a file below that is
# integration throughout; a fixture that starts Ray or redis-server. Everything else is `unit`
# (in-process; the session's fixture indexes and tiny models are allowed).
INTEGRATION_PATHS = (
    "tests/actors/",
    "tests/cache/test_redis_store.py",
    "tests/cluster/test_eval_job.py",
    "tests/deployments/test_http.py",
    "tests/deployments/test_metrics.py",
    "tests/deployments/test_request_modes.py",
    "tests/deployments/test_state.py",
)
INTEGRATION_FIXTURES = frozenset(
    {
        "ray_local",
        "redis_server",
        "fresh_redis",
        "redis_with_password",
        "server",
        "served",  # tests/deployments' module fixtures: a Serve app on a local Ray (serve_app)
    }
)
# tests that start Ray in their own body, in files that are otherwise unit
INTEGRATION_TESTS = frozenset(
    {
        "tests/deployments/test_generator.py::test_replica_in_a_strict_pack_placement_group",
    }
)
_ROOT = Path(__file__).resolve().parent.parent


def _is_integration(item: pytest.Item) -> bool:
    if item.get_closest_marker("integration") is not None:
        return True
    rel = Path(str(item.path)).resolve().relative_to(_ROOT).as_posix()
    if rel.startswith(INTEGRATION_PATHS):
        return True
    if f"{rel}::{item.originalname if isinstance(item, pytest.Function) else item.name}" in INTEGRATION_TESTS:
        return True
    return not INTEGRATION_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


# The modules that take longest, longest first (module setup plus tests, from `--durations` of
# `make test` on the 2-core machine, 2026-11-29). `make test` runs them first (with
# --no-loadscope-reorder: pytest-xdist would order modules by their number of tests, and send the
# one-test SmolLM2 server last), so neither worker is left running a long module alone at the
# end; the fast unit modules fill the gaps. Only the order changes, never what runs.
SLOW_MODULES_FIRST = (
    "tests/ralm/batching/test_iteration_graphs.py",
    "tests/ralm/test_models.py",
    "tests/ralm/test_exactness_matrix.py",
    "tests/ralm/batching/test_triton_kernels.py",
    "tests/ralm/retrieval/test_int8_scan.py",
    "tests/ralm/retrieval/test_passage_vectors.py",
    "tests/deployments/test_request_modes.py",
    "tests/deployments/test_http.py",
    "tests/deployments/test_multinode.py",
    "tests/deployments/test_http_smollm2.py",
    "tests/cluster/test_serve_stop.py",
    "tests/actors/test_coordinator.py",
    "tests/deployments/test_state.py",
)


def _module_ranks(items: list[pytest.Item]) -> dict[Path, tuple[int, int]]:
    """Each module's place: a slow one by its rank in the list, then those with an integration
    test, then the rest."""
    ranks: dict[Path, tuple[int, int]] = {}
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(_ROOT).as_posix()
        if rel in SLOW_MODULES_FIRST:
            rank = (0, SLOW_MODULES_FIRST.index(rel))
        else:
            rank = (1 if item.get_closest_marker("integration") is not None else 2, 0)
        ranks[item.path] = min(rank, ranks.get(item.path, rank))
    return ranks


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every collected test `integration` or `unit` (select with `-m unit`, `-m integration`),
    then order the modules: the slowest first, then the other integration ones, then the unit
    ones. The sort is stable and by module, so each module's tests stay together, in order."""
    for item in items:
        item.add_marker(pytest.mark.integration if _is_integration(item) else pytest.mark.unit)
    ranks = _module_ranks(items)
    items.sort(key=lambda item: ranks[item.path])


@pytest.fixture(scope="session")
def fixture_corpus() -> Corpus:
    return Corpus.load(FIXTURE_CORPUS)


@pytest.fixture(scope="session")
def fixture_questions() -> list[str]:
    return load_questions(FIXTURE_QUESTIONS)


@pytest.fixture(scope="session")
def dense_encoder():
    """The offline all-MiniLM-L6-v2 encoder, shared by every dense retriever in the session."""
    from ralm.retrieval.factory import get_encoder

    return get_encoder("local:all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def retriever_configs() -> dict[str, RetrieverConfig]:
    return {kind: RetrieverConfig(kind=kind, **(TEST_HNSW if kind == "adr" else {})) for kind in KINDS}


@pytest.fixture(scope="session")
def index_dirs(tmp_path_factory, fixture_corpus, dense_encoder, retriever_configs) -> dict[str, Path]:
    """kind -> directory of a freshly built index of the fixture corpus."""
    from ralm.retrieval.index_build import build_index

    root = tmp_path_factory.mktemp("indexes")
    dirs = {kind: root / kind for kind in KINDS}
    build_index("edr", fixture_corpus, dirs["edr"], retriever_configs["edr"], progress=False, encoder=dense_encoder)
    vectors = np.load(dirs["edr"] / "vectors.npy")
    build_index(
        "adr",
        fixture_corpus,
        dirs["adr"],
        retriever_configs["adr"],
        progress=False,
        encoder=dense_encoder,
        vectors=vectors,
    )
    build_index("sr", fixture_corpus, dirs["sr"], retriever_configs["sr"], progress=False)
    return dirs


@pytest.fixture(scope="session")
def retrievers(index_dirs, fixture_corpus, dense_encoder, retriever_configs) -> dict:
    """kind -> loaded KB retriever (validated through its manifest)."""
    from ralm.retrieval.factory import load_retriever

    return {
        kind: load_retriever(retriever_configs[kind], fixture_corpus, index_dirs[kind], encoder=dense_encoder)
        for kind in KINDS
    }


@pytest.fixture(scope="session")
def sample_queries(fixture_corpus, fixture_questions) -> list[str]:
    """200 random word windows (4-32 words) of fixture passages, then the fixture questions."""
    rng = np.random.default_rng(1234)
    out = []
    while len(out) < 200:
        words = fixture_corpus.text(int(rng.integers(len(fixture_corpus)))).split()
        if not words:
            continue
        n = int(rng.integers(4, 33))
        s = int(rng.integers(0, max(1, len(words) - n)))
        out.append(" ".join(words[s : s + n]))
    return out + list(fixture_questions)


# ---------------------------------------------------------------- Ray tests (actors/, deployments/)
@pytest.fixture(scope="module")
def ray_local():
    """One local Ray (2 CPUs) per test module."""
    from tests.actors.support import start_ray, stop_ray

    start_ray()
    yield
    stop_ray()


@pytest.fixture(scope="session")
def gen_model_dir(tmp_path_factory) -> str:
    from tests.actors.support import model_dir

    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def local_generator(gen_model_dir, fixture_corpus):
    """In-process generator over the fixture corpus: the reference the Ray paths must match."""
    from ralm.config import GeneratorConfig
    from ralm.engine import LMEngine
    from ralm.generator import LocalGenerator

    return LocalGenerator(LMEngine.from_config(GeneratorConfig(model=gen_model_dir)), fixture_corpus)


@pytest.fixture(autouse=True)
def _no_gamma_prior_between_tests():
    """Each test starts with an empty process-wide gamma prior (ralm/stride/gamma_prior.py), so
    strides never depend on which tests ran before; tests of the prior set it up themselves."""
    from ralm.stride.gamma_prior import PROCESS_PRIOR
    from ralm.stride.shadow_budget import LAST_PROBE_COST

    PROCESS_PRIOR.clear()
    LAST_PROBE_COST.clear()  # nor which probe costs earlier tests measured (ralm/stride/shadow_budget.py)
    yield
