"""A tiny gpt-oss under DeepSpeed's Ulysses for Hugging Face models, as ``torchrun`` runs it, for
tests/test_hf_deepspeed.py (needs ``deepspeed``; gloo on CPU):

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node P -m harness.hf_deepspeed FOLDER

DeepSpeed's own route, as accelerate's ``ParallelismConfig(sp_backend="deepspeed")`` and the HF
``Trainer`` take it: ``UlyssesSPAttentionHF.register_with_transformers`` wraps the registered
``"sinkattn"`` attention (and makes the sequence-parallel group), ``UlyssesSPDataLoaderAdapter``
cuts a packed batch (``position_ids`` restarting at 0) into contiguous shards with shifted labels.
Each attention call then gets ``HQ/P`` heads of the whole sequence and the layer's whole sinks.
The loss is the token-weighted mean over the group (as transformers' ``deepspeed_sp_compute_loss``);
the gradients are summed over the group here, as DeepSpeed's engine does. Each rank saves
``FOLDER/rank{r}.pt``: the loss, the gathered logits ``[T, V]``, the summed gradients, and the
sinks shape and head count of every call of ``sinkattn.hf.heads.local_sinks`` (observed, run as is).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["DOCUMENTS", "main"]

DOCUMENTS = (13, 5, 20, 10)        # 48 tokens: DeepSpeed cuts the row into P equal shards (P = 2, 3)


def _step(P: int) -> dict:
    import deepspeed.comm as ds_dist
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import sinkattn.hf
    from sinkattn.hf import heads
    from . import gpt_oss, hf_cp

    seen, local_sinks = [], heads.local_sinks

    def observed(sinks, count, head_group=None):      # the real function, its arguments recorded
        seen.append((tuple(sinks.shape), count))
        return local_sinks(sinks, count, head_group)

    heads.local_sinks = observed
    name = sinkattn.hf.register()
    model = gpt_oss.model(hf_cp.config(), attn_implementation=name).train()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=name, sequence_parallel_size=P, micro_batch_size=1,
        seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    full = hf_cp.batch(documents=DOCUMENTS, flash_kwargs=False)
    loader = torch.utils.data.DataLoader([full], batch_size=None)
    local = next(iter(UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group,
                                                 sp_world_size=P, device=torch.device("cpu"))))
    local["labels"] = local["shift_labels"]          # transformers' deepspeed_sp_compute_loss does the same
    out = model(**local)
    labelled = (local["shift_labels"] != -100).sum()
    total = labelled.clone().float()
    ds_dist.all_reduce(total, group=group)
    share = out.loss * labelled / total               # this rank's share of the mean over every labelled token
    share.backward()
    loss = share.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {}
    for n, p in model.named_parameters():
        grads[n] = p.grad.clone()
        dist.all_reduce(grads[n], group=group)
    parts = [torch.empty_like(out.logits[0]) for _ in range(P)]
    dist.all_gather(parts, out.logits[0].detach().contiguous(), group=group)
    heads.local_sinks = local_sinks
    return dict(loss=loss, logits=torch.cat(parts), grads=grads, local_tokens=local["input_ids"].shape[1],
                calls=seen, wrapped=ALL_ATTENTION_FUNCTIONS[name].__qualname__)


def main(folder: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from .hf_cp import serve

    serve(folder, lambda: deepspeed.init_distributed(dist_backend="gloo"),
          [("step", lambda: _step(dist.get_world_size()))])


if __name__ == "__main__":
    main(sys.argv[1])
