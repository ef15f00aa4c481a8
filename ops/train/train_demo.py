"""Train expertmesh's embedded default MoE language model.

expertmesh ships a tiny Mixtral-style model inside the repo (``experts/default_model``) so that the whole
serving stack -- router, one actor per expert, gRPC front end -- can be started, tested and demonstrated on any
machine without downloading weights. The model is trained offline by this script on text every machine already
has: the Python standard library's own source. Routing is left unregularised (no load-balancing loss) on purpose,
so the experts end up unevenly loaded, the way real MoE checkpoints are, which is what the placement and
autoscaling code needs to be exercised against.

    python ops/train/train_demo.py --out experts/default_model [--minutes 12] [--seed 0] [--steps N]

The corpus and its train / held-out split come from ops/train/corpus.py (so expertmesh must be installed, as for
everything else here); the drill scores perplexity on the same held-out files.

Training fits a wall-clock budget: the learning-rate cosine runs on the clock, because the machine may be shared
and its speed drifts. The seed fixes init and data order; for a repeatable schedule too, pass ``--steps N``
(the report records how many steps a timed run made).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

from expertmesh.ops.train.corpus import SPLIT, load_corpus

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2, in this order
SEQ_LEN = 256
BATCH = 16
PEAK_LR = 3e-3
WARMUP_STEPS = 100
EVAL_TOKENS = 200_000
MAX_CHECKPOINT_BYTES = 6_000_000  # the model lives in git; keep it small
REPORTED_CONFIG_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "max_position_embeddings",
    "tie_word_embeddings", "router_jitter_noise", "output_router_logits",
)  # fmt: skip


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any code (tabs, odd unicode) round-trips exactly."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, f"{name} should have id {i}"
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate documents with <|eos|> between them, so the model learns where a file ends."""
    eos = tok.token_to_id("<|eos|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_config(vocab_size: int) -> MixtralConfig:
    config = MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        output_router_logits=False,  # no auxiliary balancing loss: we want the natural, skewed routing
        router_jitter_noise=0.0,
        sliding_window=None,
        rope_theta=10000.0,
    )
    if checkpoint_bytes(MixtralForCausalLM(config)) > MAX_CHECKPOINT_BYTES:
        config.tie_word_embeddings = True  # the untied lm_head is the one big matrix we can drop
    return config


def checkpoint_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())  # fp32; tied weights are listed once


def lr_at(step: int, progress: float) -> float:
    """Linear warmup over the first steps, times a cosine from the peak down to 10% as progress goes 0 -> 1."""
    warmup = min(1.0, (step + 1) / WARMUP_STEPS)
    return PEAK_LR * warmup * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def batches(stream: torch.Tensor, seed: int) -> Iterator[torch.Tensor]:
    """Yield [BATCH, SEQ_LEN] windows: non-overlapping chunks, reshuffled every epoch by a seeded generator."""
    chunks = stream[: len(stream) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(chunks), generator=gen)
        for i in range(0, len(order) - BATCH + 1, BATCH):
            yield chunks[order[i : i + BATCH]]


def train(model: MixtralForCausalLM, stream: torch.Tensor, args: argparse.Namespace) -> dict:
    # Norm weights and the router are tiny; decaying them only fights the signal, so decay matrices only.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and ".gate." not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and ".gate." not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )
    budget = args.minutes * 60.0
    model.train()
    start = time.monotonic()
    window_start, window_tokens, recent = start, 0, []
    step = 0
    for batch in batches(stream, args.seed):
        # The machine is shared and its speed drifts, so the schedule runs on the clock: progress is the
        # fraction of the budget used, and the cosine ends exactly when time is up. --steps swaps the clock for
        # a step count, which makes a run repeatable bit for bit.
        progress = step / args.steps if args.steps else (time.monotonic() - start) / budget
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window_tokens += batch.numel()
        recent = (recent + [loss.item()])[-50:]
        if step % 50 == 0:
            now = time.monotonic()
            print(
                f"step {step:5d}  loss {sum(recent) / len(recent):.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{window_tokens / (now - window_start):,.0f} tok/s  {now - start:4.0f}s ({progress:.0%})",
                flush=True,
            )
            window_start, window_tokens = now, 0
    return {
        "steps": step,
        "tokens_seen": step * BATCH * SEQ_LEN,
        "train_seconds": round(time.monotonic() - start, 1),
        "final_train_loss": round(sum(recent) / len(recent), 4),
    }


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, stream: torch.Tensor) -> dict:
    """Held-out perplexity, plus the share of top-k routing slots each expert wins, per layer."""
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_local_experts, dtype=torch.long)

    def hook(layer: int) -> Callable[..., None]:  # the router returns (logits, top-k weights, top-k expert ids)
        def record(_module: torch.nn.Module, _inputs: tuple, output: tuple) -> None:
            counts[layer] += torch.bincount(output[2].flatten(), minlength=cfg.num_local_experts)

        return record

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    model.eval()
    chunks = stream[: min(len(stream), EVAL_TOKENS) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    nll, n = 0.0, 0
    for i in range(0, len(chunks), 32):
        x = chunks[i : i + 32]
        logits = model(input_ids=x).logits[:, :-1]
        nll += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    for h in handles:
        h.remove()
    frac = counts.double() / counts.sum(dim=1, keepdim=True)
    return {
        "held_out_tokens_scored": n,
        "held_out_loss": round(nll / n, 4),
        "held_out_perplexity": round(math.exp(nll / n), 3),
        "expert_load_fraction": [[round(v, 4) for v in row] for row in frac.tolist()],
        # 1.0 would be perfectly balanced; with 8 experts the ceiling is 4.0 (top-2 always hits the same pair).
        "expert_load_max_over_mean": [round(v, 3) for v in (frac.max(dim=1).values * cfg.num_local_experts).tolist()],
    }


DEMO_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}: "
                      "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def save(model: MixtralForCausalLM, tok: Tokenizer, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    # Lets transformers.AutoTokenizer load the same tokenizer.json; expertmesh itself reads it with `tokenizers`.
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,  # cleanup would rewrite " ," etc. and break code round-trips
        # The model saw plain text, not dialogues: this simple template lets /v1/chat/completions serve it anyway.
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    # expertmesh loads experts one by one by name, so insist on the classic per-expert tensor layout.
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    cfg = model.config
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.num_local_experts):
            for w in ("w1", "w2", "w3"):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                assert name in names, f"missing {name} in model.safetensors"


def sanity_check(out: Path, sample_text: str) -> dict:
    """Reload from disk the way a user would and greedy-decode a little Python."""
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok(sample_text)["input_ids"]) == sample_text, "tokenizer does not round-trip"
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    samples = {}
    # The first two are the agreed check. With GPT-2 style byte-level BPE a space belongs to the *next* word
    # ("Ġfoo"), so a prompt ending in a space leaves a lone "Ġ" token the model has rarely seen; the two
    # prompts without the space show what the model does in-distribution.
    for prompt in ("def ", "import ", "def", "import"):
        enc = tok(prompt, return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        samples[prompt] = tok.decode(ids[0], skip_special_tokens=False)
        print(f"--- greedy from {prompt!r}:\n{samples[prompt]}\n", flush=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock budget for the training loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="fixed step count instead of the time budget")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    wall_start = time.monotonic()

    train_texts, held_texts, root = load_corpus()
    tok = train_tokenizer(train_texts, vocab_size=2048)
    for text in held_texts[:20]:  # byte-level BPE must be lossless on code it has not seen
        assert tok.decode(tok.encode(text).ids) == text, "tokenizer round-trip failed"
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(
        f"corpus: {len(train_texts)} train files / {len(train_stream):,} tokens, "
        f"{len(held_texts)} held-out files / {len(held_stream):,} tokens",
        flush=True,
    )

    config = build_config(tok.get_vocab_size())
    torch.manual_seed(args.seed)  # init does not depend on how many RNG draws happened before
    model = MixtralForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} params, {checkpoint_bytes(model) / 1e6:.2f} MB fp32", flush=True)

    stats = train(model, train_stream, args)
    metrics = evaluate(model, held_stream)
    print(
        f"held-out loss {metrics['held_out_loss']}  ppl {metrics['held_out_perplexity']}  "
        f"expert load max/mean per layer {metrics['expert_load_max_over_mean']}",
        flush=True,
    )

    args.out.mkdir(parents=True, exist_ok=True)
    save(model, tok, args.out)
    samples = sanity_check(args.out, held_texts[0][:1000])

    report = {
        "purpose": "expertmesh embedded default model (demo/test MoE), trained offline on Python stdlib source",
        "corpus": {
            "source": "Python standard library *.py (no site-packages, test(s), idlelib, lib2to3; files <= 200 KB)",
            "python_version": sys.version.split()[0],
            "stdlib_path": str(root),
            "split": SPLIT,
            "train_files": len(train_texts),
            "held_out_files": len(held_texts),
            "train_tokens": len(train_stream),
            "held_out_tokens": len(held_stream),
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": tok.get_vocab_size(), "special_tokens": SPECIAL_TOKENS},
        "config": {k: getattr(config, k) for k in REPORTED_CONFIG_KEYS}
        | {"parameters": n_params, "checkpoint_bytes": (args.out / "model.safetensors").stat().st_size},
        "training": {
            "seq_len": SEQ_LEN,
            "batch": BATCH,
            "peak_lr": PEAK_LR,
            "warmup_steps": WARMUP_STEPS,
            "schedule": "linear warmup x cosine to 10% over the wall-clock budget (or --steps)",
            "optimizer": "AdamW(0.9, 0.95), wd 0.1 on matrices",
            "grad_clip": 1.0,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
        }
        | stats,
        "evaluation": metrics,
        "samples": samples,
        "seed": args.seed,
        "command": shlex.join(sys.orig_argv),
        "total_wall_seconds": round(time.monotonic() - wall_start, 1),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['total_wall_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
