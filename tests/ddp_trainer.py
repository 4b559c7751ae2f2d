"""One HF Trainer step (SGD) of a tiny gpt-oss through sinkattn on a global batch of packed sequences
(DataCollatorWithFlattening), fp32; saves each parameter's update to the file named by argv[1].

    python tests/ddp_trainer.py OUT                                             # one process, the global batch
    torchrun --standalone --nproc-per-node 2 tests/ddp_trainer.py OUT          # DDP on gloo, half on each rank

tests/test_trainers.py compares the two: DDP averages the ranks' gradients and the Trainer averages
the loss over the tokens of every rank, so the step is the single-process step on the global batch.
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments  # noqa: E402

import sinkattn.hf  # noqa: E402
from harness import gpt_oss, training  # noqa: E402

LENGTHS = [23, 9, 31, 17]     # the global batch: rank r takes two of them


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = gpt_oss.model(attn_implementation=sinkattn.hf.register()).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=len(LENGTHS) // world, max_steps=1,
                                 optim="sgd", learning_rate=0.5, max_grad_norm=0.0, use_cpu=True, report_to="none",
                                 save_strategy="no", disable_tqdm=True, seed=0,
                                 ddp_backend="gloo" if world > 1 else None, ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=args, train_dataset=training.token_dataset(LENGTHS),
                          data_collator=DataCollatorWithFlattening())
        trainer.train()
    if trainer.args.process_index == 0:
        assert trainer.args.world_size == world and trainer.state.global_step == 1
        torch.save({n: p.detach() - before[n] for n, p in model.named_parameters()}, out)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
