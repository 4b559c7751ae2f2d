"""Train a small gpt-oss on packed rows through sinkattn: DataCollatorWithFlattening, no padding.

    pip install torch==2.13.0 -e ".[hf]"        # on a GPU machine: your CUDA torch, then -e ".[hf,triton]"
    python examples/finetune_gpt_oss_packed.py [--steps 100] [--tokens-per-row 1024] [--documents 4000]
                                               [--device cpu|cuda] [--no-progress] [--threads N]

Everything is made here, nothing is downloaded: a small random gpt-oss (2 layers, sliding window
64 then full attention, 4 experts) from a GptOssConfig, a text set generated from a few sentence
templates, byte-level token ids (no tokenizer). Each optimizer step packs several documents into one
row with ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``; sinkattn keeps them apart
(``cu_seq_lens_q/k``), eager would not. On the 2-core CPU the default 100 steps took 7-8.5 s of training
(14 s with start-up) on a quiet machine, and 87 s while other jobs loaded it; on CUDA the triton backend
runs. The final loss differs a little from run to run (0.56-0.62): transformers' gpt-oss expert-bias
gradients are not bitwise repeatable on CPU (with eager attention too); the attention's are.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from tqdm import tqdm
from transformers import DataCollatorWithFlattening, GptOssConfig, GptOssForCausalLM

import sinkattn.hf

SUBJECTS = ["the small robot", "a tired sailor", "my neighbour", "the old library", "every student", "the river"]
VERBS = ["carries", "remembers", "paints", "follows", "forgets", "builds"]
OBJECTS = ["a red lantern", "the northern road", "seven letters", "the quiet garden", "a broken clock", "the stars"]
ENDINGS = ["before dawn.", "without a word.", "again and again.", "for the last time.", "in the rain."]


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` short documents of 2-6 templated sentences."""
    rng = random.Random(seed)
    return [" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
                     for _ in range(rng.randint(2, 6))).capitalize() for _ in range(n)]


def encode(text: str) -> list[int]:
    """Byte-level ids: byte ``b`` -> ``b + 1`` (0 is kept for padding, which packing never needs)."""
    return [b + 1 for b in text.encode()]


def decode(ids) -> str:
    return bytes(max(0, i - 1) for i in ids).decode(errors="replace")


def packed_rows(docs: list[list[int]], tokens_per_row: int, collator) -> list[dict]:
    """Greedy packing: documents in order, a new row when the next one would pass ``tokens_per_row``."""
    rows, row, used = [], [], 0
    for ids in docs:
        if row and used + len(ids) > tokens_per_row:
            rows.append(collator([{"input_ids": x} for x in row]))
            row, used = [], 0
        row.append(ids)
        used += len(ids)
    if row:
        rows.append(collator([{"input_ids": x} for x in row]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tokens-per-row", type=int, default=1024)
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: one per core; on a machine other jobs keep busy, 1 is often "
                             "several times faster)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    name = sinkattn.hf.register()                   # "sinkattn"; backend auto: cpu on CPU, triton on CUDA
    config = GptOssConfig(vocab_size=257, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=64,
                          layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=2048,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = GptOssForCausalLM._from_config(config, attn_implementation=name).to(args.device)
    backend = {"cpu": "cpu", "cuda": "triton"}.get(torch.device(args.device).type, "auto")
    print(f"attention: {model.config._attn_implementation} (backend {backend}), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, device {args.device}")

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    docs = [encode(d) for d in documents(args.documents)]
    rows = packed_rows(docs, args.tokens_per_row, collator)
    print(f"{len(docs)} documents packed into {len(rows)} rows of <= {args.tokens_per_row} tokens")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    losses, t0 = [], time.perf_counter()
    bar = tqdm(range(args.steps), desc="train", disable=args.no_progress)
    for step in bar:
        batch = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in rows[step % len(rows)].items()}
        loss = model(**batch).loss                  # labels: next byte, -100 across document boundaries
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0

    k = max(1, min(5, len(losses) // 3))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"{args.steps} steps in {seconds:.1f} s; loss {first:.3f} (first {k}) -> {last:.3f} (last {k})")

    model.eval()
    prompt = torch.tensor([encode("The small robot")], device=args.device)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=48, do_sample=False)
    print(f"sample: {decode(out[0].tolist())!r}")
    if last < first:
        print("loss fell")
        return 0
    print("loss did not fall", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
