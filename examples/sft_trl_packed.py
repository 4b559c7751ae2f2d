"""Fine-tune a small gpt-oss with TRL's SFTTrainer through sinkattn: packed rows, no padding, bf16 autocast.

    pip install torch==2.13.0 -e ".[hf]" "trl>=1.16"     # on a GPU machine: your CUDA torch, then -e ".[hf,triton]"
    python examples/sft_trl_packed.py [--steps 40] [--max-length 512] [--device cpu|cuda] [--output-dir DIR]
                                      [--threads N]

Everything is made here, nothing is downloaded: documents of counting and arithmetic in words, a
word-level tokenizer trained on them (``tokenizers``), a small random gpt-oss (2 layers, sliding window
64 then full attention, 4 experts) from a GptOssConfig with ``attn_implementation="sinkattn"``.
SFTTrainer runs with its defaults: ``packing=True`` (best-fit decreasing, padding-free: each row holds
several documents, passed to the model as ``position_ids`` and ``cu_seq_lens_q/k``, which sinkattn keeps
apart), ``bf16=True`` (autocast: sinkattn casts q, k, v to bf16, the sinks stay fp32) and gradient
checkpointing. For a real checkpoint, load the model with
``AutoModelForCausalLM.from_pretrained(name, attn_implementation="sinkattn")`` and its tokenizer instead.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import sinkattn.hf

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents: a count from some number, or a few sums, in words (lengths 8-60 words)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        if rng.random() < 0.5:
            start = rng.randrange(0, 12)
            docs.append("count : " + " ".join(NUMBERS[start:start + rng.randint(6, 9)]))
        else:
            sums = [(a, b) for a, b in ((rng.randrange(11), rng.randrange(11)) for _ in range(rng.randint(2, 7)))]
            docs.append(" . ".join(f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}" for a, b in sums))
    return docs


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on ``texts``, with ``<pad>`` and ``<eos>``."""
    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=512, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=2, help="packed rows per step (flattened into one)")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-dir", default=None, help="checkpoints and logs (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: one per core; on a machine other jobs keep busy, 1 is often "
                             "several times faster)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    name = sinkattn.hf.register()                              # "sinkattn": backend cpu on CPU, triton on CUDA
    texts = documents(args.documents)
    tokenizer = word_tokenizer(texts)
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=64,
                          layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=args.max_length,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = GptOssForCausalLM._from_config(config, attn_implementation=name)
    print(f"model: gpt-oss, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"attention {model.config._attn_implementation}, device {args.device}")

    with tempfile.TemporaryDirectory() as scratch:
        sft = SFTConfig(output_dir=args.output_dir or scratch, packing=True, max_length=args.max_length,
                        per_device_train_batch_size=args.batch_size, max_steps=args.steps, learning_rate=3e-3,
                        warmup_steps=min(5, args.steps // 4), logging_steps=max(1, args.steps // 8),
                        use_cpu=torch.device(args.device).type == "cpu", report_to="none", save_strategy="no",
                        disable_tqdm=True, seed=0)
        print(f"SFTConfig: packing={sft.packing} ({sft.packing_strategy}), bf16={sft.bf16}, "
              f"gradient_checkpointing={sft.gradient_checkpointing}, {args.steps} steps")
        trainer = SFTTrainer(model=model, args=sft, train_dataset=Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer)
        rows = trainer.train_dataset
        batch = trainer.data_collator([rows[i] for i in range(args.batch_size)])
        shapes = ", ".join(f"{k} {list(v.shape)}" if torch.is_tensor(v) else f"{k}={v}" for k, v in batch.items())
        print(f"{len(texts)} documents packed into {len(rows)} rows of <= {args.max_length} tokens; "
              f"a step's batch: {shapes} ({batch['cu_seq_lens_q'].numel() - 1} documents)")
        trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("loss by logging step: " + " ".join(f"{x:.3f}" for x in losses))
    sinks = model.model.layers[0].self_attn.sinks
    print(f"layer 0 sinks ({sinks.dtype}): {[round(x, 3) for x in sinks.tolist()]}")

    prompt = tokenizer("count : three four five", return_tensors="pt").input_ids.to(model.device)
    out = model.eval().generate(prompt, max_new_tokens=6, do_sample=False)
    print(f"greedy continuation: {tokenizer.decode(out[0])!r}")
    fell = len(losses) >= 2 and losses[-1] < losses[0]
    print("loss fell" if fell else "loss did not fall")
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
