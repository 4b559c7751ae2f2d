"""Hugging Face transformers integration: ``attn_implementation="sinkattn"`` for gpt-oss.

    import sinkattn.hf
    sinkattn.hf.register()                    # once per process, returns "sinkattn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sinkattn")

Context parallelism (each rank runs the model on its shard of the tokens):

    sinkattn.hf.register("sinkattn_cp", context_parallel=sinkattn.hf.ContextParallel(group, method="ring"))
    loss = model(**sinkattn.hf.shard_batch(batch, group=group)).loss

transformers is imported by ``register`` only (``import sinkattn`` / ``import sinkattn.hf`` never
imports it). ``attention_forward`` is the function registered in ``transformers.AttentionInterface``,
``key_mask`` the one in ``transformers.masking_utils.AttentionMaskInterface``. What it supports
and refuses: docs/hf.md; context parallelism: docs/distributed.md.
"""

from .attention import attention_forward
from .context import ContextParallel
from .masks import key_mask
from .registry import MIN_TRANSFORMERS, register
from .shard import shard_batch

__all__ = ["register", "attention_forward", "key_mask", "MIN_TRANSFORMERS", "ContextParallel", "shard_batch"]
