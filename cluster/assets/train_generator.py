"""Train ralmspec's demo generator, a small GPT-2, on the pydocs corpus, on CPU.

Tokenizer
    Byte-level BPE trained with the ``tokenizers`` library on the training passages
    (``<|endoftext|>`` is the only special token and serves as bos, eos and pad),
    wrapped as a ``transformers`` fast tokenizer and saved with ``save_pretrained``.

Data
    About 2% of the passages (chosen by a hash of their id) are held out. Each training
    passage becomes one example, in a seeded order:

    - plain: ``"<title>\\n<contents><|endoftext|>"``;
    - RaLM-style (a fraction ``--ralm-frac``): the passage as the retrieved document
      (``"<title>\\n<contents>"``, cut to 256 tokens), directly followed by a question
      about its title, as ralmspec's engine lays a request out
      (``[doc][question][generated]``), then ``"\\n"`` and the passage text again as the
      answer (cut to 128 tokens), then ``<|endoftext|>``.

    Examples are packed into ``--block-size`` token blocks (512 by default). A fraction
    ``--shift-frac`` of the batches get position ids shifted by a random offset, so that
    positions up to ``n_positions`` (1024) are trained as well.

Model
    ``GPT2Config`` with ``n_positions=1024`` and tied embeddings; AdamW, linear warm-up
    then cosine decay. The number of steps is ``--steps``, or, with ``--minutes``, what
    fits in that budget at the speed measured on the first steps (training.json records
    the steps taken, so ``--steps`` reproduces a run exactly). Weights are saved in
    float16 with safetensors; the held-out perplexity is measured on the saved weights,
    reloaded in float32.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from cluster.assets.build_questions import load_records
from cluster.flags import Default, HelpFormatter, add_shared

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO_ROOT / "assets" / "corpus" / "pydocs.jsonl.gz"
DEFAULT_OUT = REPO_ROOT / "assets" / "model" / "pydocs-gpt"
EOS = "<|endoftext|>"
DOC_TOKENS = 256
ANSWER_TOKENS = 128

QUESTION_TEMPLATES = (
    "What does {t} do?",
    "How do I use {t}?",
    "What is {t}?",
    "What is {t} used for?",
    "Explain {t}.",
    "What does {t} return?",
    "When should I use {t}?",
    "What are the parameters of {t}?",
    "Tell me about {t}.",
    "How does {t} work?",
)


def _h(*parts: object) -> int:
    return int(hashlib.sha1("\x1f".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def split_records(records: list[dict], heldout_per_mille: int = 20) -> tuple[list[dict], list[dict]]:
    train: list[dict] = []
    held: list[dict] = []
    for r in records:
        (held if _h("heldout", r["id"]) % 1000 < heldout_per_mille else train).append(r)
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def doc_text(r: dict) -> str:
    return f"{r['title']}\n{r['contents']}" if r.get("title") else r["contents"]


def build_stream(records: list[dict], tok, seed: int, ralm_frac: float) -> tuple[list[int], dict]:
    """Token stream of all examples (seeded order), and counts."""
    eos = tok.eos_token_id
    rng = random.Random(seed)
    order = list(range(len(records)))
    rng.shuffle(order)
    texts = [doc_text(records[i]) for i in order]
    enc = tok(texts, add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    n_ralm = 0
    q_cache: dict[str, list[int]] = {}
    for i, ids in zip(order, enc):
        r = records[i]
        if rng.random() < ralm_frac:
            t = QUESTION_TEMPLATES[rng.randrange(len(QUESTION_TEMPLATES))].format(t=r["title"])
            q = q_cache.get(t) or tok(t, add_special_tokens=False)["input_ids"]
            q_cache[t] = q
            ans = tok("\n" + r["contents"], add_special_tokens=False)["input_ids"][:ANSWER_TOKENS]
            stream.extend(ids[:DOC_TOKENS] + q + ans + [eos])
            n_ralm += 1
        else:
            stream.extend(ids + [eos])
    return stream, {"examples": len(records), "ralm_examples": n_ralm}


def blocks(stream: list[int], block: int):
    import torch

    n = len(stream) // block
    return torch.tensor(stream[: n * block], dtype=torch.long).view(n, block)


def lr_at(step: int, total: int, warmup: int, peak: float, floor_frac: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def evaluate(model, data, batch: int) -> float:
    """Mean token cross-entropy of ``data`` blocks (every token but each block's first)."""
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            x = data[i : i + batch]
            logits = model(input_ids=x).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            )
            tot += loss.item()
            n += x[:, 1:].numel()
    model.train()
    return tot / max(1, n)


def _native_bf16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001
        return False


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _command(ap: argparse.ArgumentParser, args: argparse.Namespace, steps: int) -> str:
    """The command that reproduces this run exactly (``--steps`` instead of ``--minutes``)."""
    parts = ["python -m cluster.assets.train_generator", f"--steps {steps}"]
    for key, val in vars(args).items():
        if key in ("steps", "minutes", "probe_steps") or val == ap.get_default(key):
            continue
        parts.append(f"--{key.replace('_', '-')} {val}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ralmspec assets train", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    add_shared(
        ap,
        corpus=DEFAULT_CORPUS,
        out=DEFAULT_OUT,
        minutes=Default(6.0, help="training time budget in minutes, used when --steps is not given"),
    )
    ap.add_argument("--steps", type=int, default=None, help="exact number of optimizer steps")
    add_shared(ap, threads=1, seed=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-positions", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--ralm-frac", type=float, default=0.3)
    ap.add_argument(
        "--shift-frac",
        type=float,
        default=0.2,
        help="fraction of batches whose position ids are shifted by a random "
        "offset, so that positions past --block-size are trained too",
    )
    ap.add_argument("--heldout-per-mille", type=int, default=20)
    ap.add_argument(
        "--bf16",
        choices=("auto", "on", "off"),
        default="auto",
        help="bfloat16 autocast for training matmuls (auto: when the CPU has "
        "native bf16, e.g. AMX/AVX512-BF16); weights and optimizer stay fp32",
    )
    ap.add_argument("--probe-steps", type=int, default=3, help="steps timed to size a --minutes run")
    ap.add_argument("--max-passages", type=int, default=None, help="use the first N passages (tests)")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.set_seed(args.seed)

    records = load_records(args.corpus)
    if args.max_passages:
        records = records[: args.max_passages]
    train_recs, held_recs = split_records(records, args.heldout_per_mille)

    t0 = time.time()
    tok = train_tokenizer([doc_text(r) for r in train_recs], args.vocab_size)
    tok_s = time.time() - t0
    stream, counts = build_stream(train_recs, tok, args.seed, args.ralm_frac)
    held_stream = []
    for ids in tok([doc_text(r) for r in held_recs], add_special_tokens=False)["input_ids"]:
        held_stream.extend(ids + [tok.eos_token_id])
    train_data = blocks(stream, args.block_size)
    held_data = blocks(held_stream, args.block_size)
    print(
        f"tokenizer: {len(tok)} tokens in {tok_s:.1f}s; train {len(train_recs)} passages, "
        f"{len(stream):,} tokens, {len(train_data)} blocks; held-out {len(held_recs)} "
        f"passages, {len(held_data)} blocks",
        flush=True,
    )

    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    shift_rng = random.Random(args.seed + 1)
    perm = torch.randperm(len(train_data), generator=gen)

    def batch_at(step: int):
        nb = len(train_data)
        idx = [perm[(step * args.batch_size + j) % nb].item() for j in range(args.batch_size)]
        return train_data[idx]

    use_bf16 = args.bf16 == "on" or (args.bf16 == "auto" and _native_bf16())
    total = args.steps
    probe = max(1, min(args.probe_steps, args.warmup_steps - 2))
    budget_s = args.minutes * 60
    model.train()
    losses: list[float] = []
    t_train = time.time()
    step = 0
    while True:
        if step == 1:
            t_first = time.time()
        if total is None and step == probe + 1:
            # Time steps 1..probe (step 0 carries one-off costs). Only warm-up steps run
            # before the total is known, and their learning rate does not depend on it,
            # so ``--steps <total>`` reproduces this run exactly.
            per_step = (time.time() - t_first) / probe
            left = budget_s - (time.time() - t_train)
            total = max(step + 1, step + int(left / per_step))
            print(f"{per_step:.2f}s/step -> {total} steps for {args.minutes} min", flush=True)
        if total is not None and step >= total:
            break
        sched_total = total if total is not None else args.warmup_steps + 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step, sched_total, args.warmup_steps, args.lr)
        x = batch_at(step)
        pos = None
        if args.n_positions > args.block_size and shift_rng.random() < args.shift_frac:
            off = shift_rng.randrange(args.n_positions - args.block_size + 1)
            pos = (torch.arange(args.block_size) + off).unsqueeze(0).expand_as(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=x, position_ids=pos, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0 or step == total:
            print(
                f"step {step}/{total} loss {sum(losses[-25:]) / len(losses[-25:]):.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {time.time() - t_train:.0f}s",
                flush=True,
            )
    train_s = time.time() - t_train

    # Save in float16, then measure on the saved weights (reloaded in float32).
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.safetensors", "*.json", "*.bin", "merges.txt", "vocab.*"):
        for f in out.glob(pattern):  # files of a previous model only
            f.unlink()
    model.eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.generation_config.do_sample = False
    # transformers wraps ``to`` and ``generate`` in decorators whose types differ between its
    # releases; the models are held as Any so one source type-checks against all of them
    untyped: Any = model
    untyped.to(torch.float16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)

    loaded: Any = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok2 = AutoTokenizer.from_pretrained(out)
    eval_batch = 4
    held_loss = evaluate(loaded, held_data, eval_batch) if len(held_data) else float("nan")
    train_eval = train_data[perm[: max(1, min(len(train_data), len(held_data) or 8))]]
    train_loss_eval = evaluate(loaded, train_eval, eval_batch)
    prompt = "json.dumps\nSerialize obj"
    ids = tok2(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        generated = loaded.generate(**ids, max_new_tokens=40, do_sample=False, pad_token_id=tok2.eos_token_id)
    sample = tok2.decode(generated[0], skip_special_tokens=True)

    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    tail = losses[-max(1, min(50, len(losses))) :]
    report = {
        "model": "GPT-2 (transformers.GPT2LMHeadModel)",
        "corpus": _rel(args.corpus),
        "corpus_sha256": hashlib.sha256(args.corpus.read_bytes()).hexdigest(),
        "command": _command(ap, args, step),
        "hyperparameters": {k: (_rel(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "config": {
            "vocab_size": config.vocab_size,
            "n_positions": config.n_positions,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "tie_word_embeddings": True,
            "saved_dtype": "float16",
        },
        "optimizer": {
            "name": "AdamW",
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "schedule": "linear warm-up then cosine decay to 10% of peak",
        },
        "seed": args.seed,
        "parameters": n_params,
        "steps": step,
        "tokens_per_step": args.batch_size * args.block_size,
        "tokens_seen": step * args.batch_size * args.block_size,
        "train_tokens": len(stream),
        "epochs": round(step * args.batch_size / max(1, len(train_data)), 3),
        "train_passages": len(train_recs),
        "heldout_passages": len(held_recs),
        "heldout_tokens": int(held_data.numel()),
        "examples": counts,
        "train_loss_last50": round(sum(tail) / len(tail), 4) if losses else None,
        "train_loss_eval": round(train_loss_eval, 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_perplexity": round(math.exp(held_loss), 3) if held_loss == held_loss else None,
        "heldout_perplexity_note": "per token of this tokenizer, on the saved float16 weights "
        "loaded in float32; held-out passages packed like training",
        "tokenizer_train_s": round(tok_s, 1),
        "train_wall_s": round(train_s, 1),
        "total_wall_s": round(time.time() - t_start, 1),
        "threads": args.threads,
        "bf16_autocast": use_bf16,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "size_bytes": size,
        "sample_prompt": prompt,
        "sample_greedy": sample,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(
        json.dumps(
            {
                k: report[k]
                for k in (
                    "steps",
                    "tokens_seen",
                    "train_loss_last50",
                    "heldout_perplexity",
                    "train_wall_s",
                    "size_bytes",
                )
            }
        )
    )
    print("sample:", repr(sample))
    return 0


if __name__ == "__main__":
    sys.exit(main())
