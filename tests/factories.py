"""Factories for small pipelines used across the tests.

``ScriptedGenerator`` and ``ScriptedKB`` are *test doubles for the loop logic only*:
they let a test decide at which step of a window the speculation goes wrong, which a
real corpus cannot. Every exactness claim is also tested with the real retrievers and
real language models (tests/ralm/test_exactness_matrix.py).

Token encoding of the scripted generator: the token at position ``i`` of X generated
with document ``d`` is ``1000 * i + (d + 1)`` (``d = -1`` when there is no document), so
tokens depend on both position and document, and the KB can read a query's position.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ralm.batching.kv_pool import KVPool
from ralm.batching.packed import packed_forward
from ralm.batching.paged_kv import PagedKV
from ralm.engine import StepOutput
from ralm.retrieval.base import rank_hits


class VirtualClock:
    """Time that only the scripted parts move: a step or a search "sleeps" by advancing it.

    OS3 decides strides from measured costs, so a test that asserts a decision (direct steps
    when retrieval is cheap, windows when it is dear) would depend on the machine's load if it
    measured wall time: a 100 ms stall inside a 0.1 ms search makes retrieval look dear.
    :meth:`install` replaces the ``time`` module of the speculation loop and of these doubles,
    so every cost OS3 sees is exactly the scripted one. Single-threaded runs only (an async
    verification would add its time to the step it overlaps instead of hiding under it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def install(self, monkeypatch) -> VirtualClock:
        import sys
        import types

        import ralm.spec
        import ralm.speculation_cycle

        fake = types.SimpleNamespace(perf_counter=self.perf_counter, sleep=self.sleep, time=self.perf_counter)
        for module in (ralm.spec, ralm.speculation_cycle, sys.modules[__name__]):
            monkeypatch.setattr(module, "time", fake)
        return self


class ScriptedGenerator:
    def __init__(self, eos_at: int | None = None, step_sleep: float = 0.0):
        self.eos_token_id = -1
        self.eos_at = eos_at  # generated-token index that is EOS
        self.step_sleep = step_sleep
        self.n_q = 0
        self.calls: list[tuple[int | None, int, int]] = []
        self.intervals: list[tuple[float, float]] = []

    def encode_question(self, question: str) -> list[int]:
        words = question.split()
        if not words:
            raise ValueError("question is empty")
        self.n_q = len(words)
        return [1000 * i + 999 for i in range(len(words))]

    def decode(self, tokens: Sequence[int]) -> str:
        return " ".join(str(t) for t in tokens)

    def step(self, doc_id, context, k, ignore_eos=False, options=None) -> StepOutput:
        # options: the Generator protocol's generation options; the script ignores them
        # (tests that need drafting or FLARE run the real engine)
        t0 = time.perf_counter()
        if self.step_sleep:
            time.sleep(self.step_sleep)
        self.calls.append((doc_id, len(context), k))
        out, eos = [], False
        for j in range(k):
            pos = len(context) + j
            if self.eos_at is not None and pos - self.n_q == self.eos_at and not ignore_eos:
                eos = True
                break
            first = doc_id[0] if isinstance(doc_id, tuple) else doc_id  # num_docs > 1: the top document
            out.append(1000 * pos + ((first if first is not None else -1) + 1))
        self.intervals.append((t0, time.perf_counter()))
        return StepOutput(out, eos, 0.0, 0.0, False)


class _ScriptedScorer:
    """score(q, d) = 1.0 if d is the KB's choice for q, else 0.5 - 0.001 d."""

    def __init__(self, kb: ScriptedKB):
        self.kb = kb

    def encode(self, queries):
        return list(queries)

    def doc_keys(self, doc_ids):
        return [int(d) for d in doc_ids]

    def score(self, query_rep, keys):
        choice = self.kb.choice(query_rep)
        return np.array([1.0 if k == choice else 0.5 - 0.001 * k for k in keys], dtype=np.float64)


@dataclass
class ScriptedKB:
    """The KB's top-1 for the query of step ``i`` is ``schedule[i]`` (default ``default``)."""

    schedule: dict[int, int]
    n_q: int
    k: int
    n_docs: int = 50
    default: int = 0
    search_sleep: float = 0.0
    name: str = "scripted"
    calls: list[int] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self):
        self.scorer = _ScriptedScorer(self)
        self._lock = threading.Lock()

    def step_index(self, query: str) -> int:
        last = int(query.split()[-1])
        length = last // 1000 + 1  # len(X) when the query was made
        return (length - self.n_q) // self.k

    def choice(self, query: str) -> int:
        return self.schedule.get(self.step_index(query), self.default)

    def search(self, query, k):
        return self.batch_search([query], k)[0]

    def batch_search(self, queries, k):
        t0 = time.perf_counter()
        if self.search_sleep:
            time.sleep(self.search_sleep)
        ids = np.arange(self.n_docs)
        out = [rank_hits(ids, self.scorer.score(q, ids), k) for q in queries]
        with self._lock:
            self.calls.append(len(queries))
            self.intervals.append((t0, time.perf_counter()))
        return out


# ---------------------------------------------------------------- tiny real LMs
def tiny_tokenizer(texts: list[str] | None = None, vocab_size: int = 400):
    """A byte-level BPE tokenizer trained in-memory on a few sentences (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = (
        texts
        or [
            "Return a new list containing all items from the iterable in ascending order.",
            "Serialize obj to a JSON formatted str using this conversion table.",
            "Recursively copy an entire directory tree rooted at src to a directory named dst.",
            "what does the json module do? how do I copy a tree of files?",
        ]
        * 4
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def tiny_causal_lm(family: str, vocab_size: int, eos_token_id: int, seed: int = 0):
    """A 2-layer random causal LM of the given family, built from a config."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id
    )
    if family == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=1024, **common)
        model = GPT2LMHeadModel(cfg)
    elif family == "opt":
        cfg = OPTConfig(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=1024,
            word_embed_proj_dim=64,
            **common,
        )
        model = OPTForCausalLM(cfg)
    elif family == "llama":
        cfg = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            **common,
        )
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(family)
    return model.eval()


def tiny_engine(family: str = "gpt2", seed: int = 0, **gen_overrides):
    from ralm.config import GeneratorConfig
    from ralm.engine import LMEngine

    tok = tiny_tokenizer()
    model = tiny_causal_lm(family, len(tok), tok.eos_token_id, seed=seed)
    return LMEngine(model, tok, GeneratorConfig(model=f"tiny-{family}", **gen_overrides))


def padding_hits_with_exact_speculation(kb, padded_corpus, n_real: int, engine, questions) -> int:
    """For each question: RaLMSpec (PSA and a fixed stride 3) returns RaLMSeq's tokens and
    documents on ``kb`` over ``padded_corpus``; returns how many of the questions' top-10
    documents are padding passages (rows >= ``n_real``)."""
    from ralm.config import RequestConfig, SpecConfig
    from ralm.generator import LocalGenerator
    from ralm.seq import run_seq
    from ralm.spec import run_spec

    gen = LocalGenerator(engine, padded_corpus)
    req = RequestConfig(max_new_tokens=24, generation_stride=4, ignore_eos=True)
    hits = 0
    for q in questions:
        hits += sum(doc >= n_real for doc, _ in kb.search(q, 10))
        base = run_seq(q, gen, kb, req)
        for spec in (SpecConfig.named("PSA"), SpecConfig(stride=3)):
            out = run_spec(q, gen, kb, req, spec)
            assert out.tokens == base.tokens and out.stats.doc_ids == base.stats.doc_ids, (q, spec)
    return hits


def restore_hf_attention(model) -> None:
    """Put transformers' own attention forward back on every module of an invariant model whose
    forward was replaced by a packed-batch one (``_ralm_hf_forward``): the reference the packed
    forwards are compared with."""
    for m in model.modules():
        hf = getattr(m, "_ralm_hf_forward", None)
        if hf is not None:
            m.forward = hf


def two_sequence_forwards(model, paged: bool, with_hidden: bool = False) -> list:
    """Two sequences through ``model``'s packed forward, in one shared pool (``paged``) or each
    in a pool of its own: a prefill of one next to a decode of the other, then a decode of
    both (the 70-token one crossing into a second key block). The three forwards' logits (the
    last also with its final hidden states when ``with_hidden``)."""
    layers = model.config.num_hidden_layers
    pool = KVPool(layers)
    kvs = [PagedKV(pool) if paged else PagedKV.standalone(layers) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(1, 300, (n,), generator=g).tolist() for n in (70, 9))
    out = [packed_forward(model, [(kvs[1], b[:8])])]
    out.append(packed_forward(model, [(kvs[0], a[:69]), (kvs[1], b[8:9])]))
    last = packed_forward(model, [(kvs[0], a[69:]), (kvs[1], [5])], with_hidden=with_hidden)
    out.append(last[0] if with_hidden else last)
    return out
