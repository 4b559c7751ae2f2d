"""Hugging Face transformers integration: ``attn_implementation="sinkattn"`` for gpt-oss.

    import sinkattn.hf
    sinkattn.hf.register()                    # once per process, returns "sinkattn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sinkattn")

transformers is imported by ``register`` only (``import sinkattn`` / ``import sinkattn.hf`` never
imports it). ``attention_forward`` is the function registered in ``transformers.AttentionInterface``,
``key_mask`` the one in ``transformers.masking_utils.AttentionMaskInterface``. What it supports
and refuses: docs/hf.md.
"""

from .attention import attention_forward
from .masks import key_mask
from .registry import MIN_TRANSFORMERS, register

__all__ = ["register", "attention_forward", "key_mask", "MIN_TRANSFORMERS"]
