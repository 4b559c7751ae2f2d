"""The sinks of the query heads an attention call sees, when a sequence-parallel wrapper split the heads.

DeepSpeed's Ulysses for Hugging Face models (``UlyssesSPAttentionHF``, also what accelerate's
``ParallelismConfig(sp_backend="deepspeed")`` and the HF ``Trainer`` use) wraps the registered
attention function: an all-to-all turns each rank's sequence shard of every head into the full
sequence of ``HQ/P`` heads, rank ``r`` of the sequence-parallel group getting query heads
``r*HQ/P .. (r+1)*HQ/P - 1`` (and their KV heads), and the wrapped function is called with those
heads but with the layer's whole ``sinks`` parameter ``[HQ]`` as ``s_aux``. ``local_sinks`` takes
the rank's slice; autograd puts its gradient into that slice of the parameter, the other entries
getting zero, and the wrapper's gradient sum over the group completes it.

The group: ``head_group`` given to ``sinkattn.hf.register``, else DeepSpeed's sequence-parallel
group (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, made by
``UlyssesSPAttentionHF.register_with_transformers``), looked up without importing DeepSpeed.
Without either, or when the group's size does not match, a ValueError says what to do.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

__all__ = ["local_sinks", "deepspeed_group"]

_DEEPSPEED_SP = "deepspeed.runtime.sequence_parallel.parallel_state_sp"


def deepspeed_group():
    """DeepSpeed's sequence-parallel process group if this process made one, else None."""
    module = sys.modules.get(_DEEPSPEED_SP)
    return getattr(module, "_SEQUENCE_PARALLEL_GROUP", None) if module is not None else None


def local_sinks(sinks: torch.Tensor | None, heads: int, head_group=None) -> torch.Tensor | None:
    """``sinks [HQ]`` cut to the ``heads`` query heads of this rank when ``HQ = P * heads``.

    ``head_group``: the process group over which the heads were split (a process group, or a
    function returning one, called here), or None for DeepSpeed's. Sinks that already match
    ``heads`` (or are None) come back as they are.
    """
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] == heads:
        return sinks
    HQ = sinks.shape[0]
    what = (f"sinkattn.hf: the layer's sinks (s_aux) have {HQ} heads but the attention call got {heads} query "
            f"heads")
    if heads == 0 or HQ % heads:
        raise ValueError(f"{what}; a sequence-parallel wrapper gives each of P ranks HQ/P heads, and {HQ} is not a "
                         f"multiple of {heads}: pass s_aux of shape [{heads}]")
    group = head_group() if callable(head_group) else head_group
    if group is None:
        group = deepspeed_group()
    if group is None:
        raise ValueError(f"{what}, as a sequence-parallel wrapper (DeepSpeed Ulysses) hands them after splitting the "
                         f"heads over P = {HQ // heads} ranks, but no such group is known: register with "
                         f"sinkattn.hf.register(name, head_group=group), the group the wrapper splits the heads "
                         f"over (DeepSpeed's is found by itself once UlyssesSPAttentionHF.register_with_transformers "
                         f"made it)")
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what}; this process is not a member of the head group it was given: pass the "
                         f"sequence-parallel group this rank belongs to")
    if P * heads != HQ:
        raise ValueError(f"{what}, which is HQ/{HQ // heads}, but the head group has {P} ranks: the wrapper must "
                         f"split the heads over that group (rank r holding heads r*HQ/P .. (r+1)*HQ/P - 1); pass "
                         f"its group as sinkattn.hf.register(name, head_group=...)")
    return sinks[rank * heads:(rank + 1) * heads]
