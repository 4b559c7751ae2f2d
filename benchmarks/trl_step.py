"""TRL benchmark: one SFTTrainer optimizer step of a small gpt-oss, sinkattn on packed rows against
eager attention on the same sequences right-padded.

    python benchmarks/trl_step.py [--json FILE] [--repeats N] [--threads N] [--device cpu|cuda] [--quick]

Model: the one of benchmarks/hf.py (GptOssForCausalLM from a config, random weights: hidden 256,
16 query heads, 4 KV heads, head dim 64, two layers, sliding window 128 then full attention, 4
experts of which 2 routed, vocab 1024). Data: 7 token-id documents of 1000, 830, 700, 610, 420, 300
and 236 tokens (4096 in all). Both run TRL's SFTTrainer with its defaults (bf16 autocast, gradient
checkpointing, AdamW), one step over all 7 documents:

    sinkattn   packing=True (best-fit decreasing into rows of <= 1024 tokens), padding-free: one
               flattened row with position_ids and cu_seq_lens_q/k
    eager      packing=False: the 7 documents right-padded to [7, 1000] with an attention mask
               (eager cannot run packed rows: it attends across them)

Each figure comes from a fresh process that first runs one warm-up step: time = median over
``--repeats`` optimizer steps (forward, loss, backward, clipping, AdamW: on_step_begin to
on_step_end), peak memory growth = RSS high-water mark over one ``training_step`` (forward, loss,
backward) minus RSS before it (CUDA: the allocator's peak), in a process with
MALLOC_MMAP_THRESHOLD_=65536 as in benchmarks/hf.py. The first step's loss of each is printed:
the same tokens are scored, so they agree to bf16 rounding. ``--threads`` applies to every fresh
process (each row records its own thread count). Prints figures and ratios; asserts nothing.

The model and the data come from the test harness (``tests/harness/gpt_oss.py``, ``training.py``), which
is not installed with sinkattn: the script puts the repository's ``tests`` folder on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf import MODEL  # benchmarks/hf.py: the same model

from sinkattn.testing import bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the test harness: tests/harness

LENGTHS = [1000, 830, 700, 610, 420, 300, 236]
QUICK_LENGTHS = [120, 90, 64, 40, 30]
SETUPS = {"sinkattn": "packed rows, padding-free", "eager": "right-padded batch"}


def _trainer(impl: str, lengths: list[int], steps: int, device: str, folder: str):
    """An SFTTrainer (TRL defaults) whose every step covers all ``lengths`` documents."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    from trl import SFTConfig, SFTTrainer
    from trl.data_utils import pack_dataset

    import sinkattn.hf
    from harness import gpt_oss, training

    datasets.disable_progress_bars()
    packed = impl == "sinkattn"
    max_length = 1024 if max(lengths) > 128 else 128
    cfg = gpt_oss.config(**MODEL, max_position_embeddings=4096, eos_token_id=training.EOS)
    name = sinkattn.hf.register() if packed else impl
    model = gpt_oss.model(cfg, attn_implementation=name, qk_gain=1.0, sink_scale=1.0).train()
    dataset = training.token_dataset(lengths, vocab_size=MODEL["vocab_size"])
    rows = len(pack_dataset(dataset, max_length, "bfd")) if packed else len(lengths)   # all of them in one step
    args = SFTConfig(output_dir=folder, packing=packed, max_length=max_length, max_steps=steps,
                     per_device_train_batch_size=rows, use_cpu=device == "cpu", report_to="none",
                     logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    return SFTTrainer(model=model, args=args, train_dataset=dataset,
                      processing_class=training.tokenizer(MODEL["vocab_size"]))


class StepTimes:
    """A TrainerCallback recording the wall time of each optimizer step."""

    def __init__(self, device: str):
        import torch
        from transformers import TrainerCallback

        def sync():
            if device != "cpu":
                torch.cuda.synchronize()

        times = self.seconds = []

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                sync()
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                times.append(time.perf_counter() - self.t0)
        self.callback = Callback()


def _measure_second_training_step(trainer, device: str) -> list:
    """Make ``trainer`` record the peak memory growth of its second ``training_step`` (the first
    is a warm-up) into the returned list."""
    step, growth = trainer.training_step, []

    def measured(*args, **kwargs):
        if trainer.state.global_step != 1:
            return step(*args, **kwargs)
        out = []
        growth.append(bench.step_peak_growth_mib(lambda: out.append(step(*args, **kwargs)), device))
        return out[0]
    trainer.training_step = measured
    return growth


def child(what: str, impl: str, lengths: list[int], repeats: int, device: str) -> dict:
    """``what="time"``: median of ``repeats`` steps after a warm-up; ``"memory"``: the peak growth of
    the second step's ``training_step``; ``"both"`` (smoke runs): both from the same steps. Each
    records the torch threads it ran with."""
    import torch

    with tempfile.TemporaryDirectory() as folder:
        trainer = _trainer(impl, lengths, 2 if what == "memory" else 1 + repeats, device, folder)
        timer = StepTimes(device)
        trainer.add_callback(timer.callback)
        growth = _measure_second_training_step(trainer, device) if what != "time" else None
        batch = next(iter(trainer.get_train_dataloader()))
        load_before = os.getloadavg()[0]
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    shape = list(batch["input_ids"].shape)
    row = dict(first_loss=losses[0], batch=shape, tokens_in_batch=shape[0] * shape[1],
               threads=torch.get_num_threads())
    if what != "memory":
        row.update(seconds=statistics.median(timer.seconds[1:]), samples=timer.seconds[1:],
                   loadavg=[load_before, os.getloadavg()[0]])
    if what != "time":
        row.update(peak_growth_mib=growth[0])
    return row


def _fresh(what: str, impl: str, lengths: list[int], repeats: int, device: str, threads: int | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if what == "memory":       # every block >= 64 KiB is mmap'd and returned on free: no heap reuse hides a peak
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    args = [sys.executable, __file__, "--child", what, impl, json.dumps(lengths), str(repeats), device,
            *(["--threads", str(threads)] if threads else [])]
    out = subprocess.run(args, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(impl: str, lengths: list[int], repeats: int, device: str, fresh: bool = True,
            threads: int | None = None) -> dict:
    """Time and peak growth of one step, each in its own fresh process with ``threads`` torch threads
    (``fresh=False``: both from the same steps, in this process)."""
    row = dict(impl=impl, setup=SETUPS[impl])
    if not fresh:
        return row | child("both", impl, lengths, repeats, device)
    for what in ("time", "memory"):
        row.update(_fresh(what, impl, lengths, repeats, device, threads))
    return row


def main(argv=None) -> dict:
    ap = bench.script_parser(__doc__, repeats=5, quick=f"smoke run: documents of {QUICK_LENGTHS} tokens, 1 timed "
                                                         "step, all in this process")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = bench.parse_script_args(ap, argv)
    if args.child:
        what, impl, lengths, repeats, device = args.child
        print(json.dumps(child(what, impl, json.loads(lengths), int(repeats), device)))
        return {}

    import transformers
    import trl

    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    repeats = 1 if args.quick else args.repeats
    ours, eager = (measure(impl, lengths, repeats, args.device, fresh=not args.quick, threads=args.threads)
                   for impl in SETUPS)
    ratios = dict(time_vs_eager=ours["seconds"] / eager["seconds"],
                  peak_growth_vs_eager=(ours["peak_growth_mib"] / eager["peak_growth_mib"]
                                        if eager["peak_growth_mib"] else None))
    info = bench.header(args.device) | {"transformers": transformers.__version__, "trl": trl.__version__}
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"model: {MODEL}; TRL SFTTrainer defaults (bf16 autocast, gradient checkpointing, AdamW); "
          f"documents of {lengths} tokens ({sum(lengths)}), all in each step; medians of {repeats} steps")
    for r in (ours, eager):
        print(f"  {r['impl']:8s} {r['setup']:26s} input_ids {str(r['batch']):12s}: {r['seconds'] * 1e3:9.1f} ms/step, "
              f"peak growth {r['peak_growth_mib']:8.1f} MiB, first loss {r['first_loss']:.4f}   "
              f"(load average {r['loadavg'][0]:.1f} -> {r['loadavg'][1]:.1f})")
    growth = f"{ratios['peak_growth_vs_eager']:.3f}x" if ratios["peak_growth_vs_eager"] is not None else "n/a"
    print(f"sinkattn packed / eager padded: time {ratios['time_vs_eager']:.3f}x, peak growth {growth}")
    if args.quick:
        print("smoke run: tiny documents in one process; the figures mean little")
    report = dict(header=info, model=MODEL, lengths=lengths, rows=[ours, eager], ratios=ratios)
    bench.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
