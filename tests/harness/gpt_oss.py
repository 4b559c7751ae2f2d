"""Small random gpt-oss models for the tests and the Hugging Face benchmark (never downloaded weights).

``config()`` is a tiny GptOssConfig: layers alternating sliding / full attention, a window shorter
than the test sequences, two experts both routed (so the MoE is continuous in its inputs: no
top-k flip between two implementations that differ by rounding). ``model()`` builds it and makes
attention matter: query/key projections scaled up (sharp, not near-uniform, softmax) and sinks
drawn as ``2 * randn`` (some heads dominated by the sink, some not), instead of gpt-oss's 0.02 init.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["config", "model"]


def config(**overrides):
    """A GptOssConfig: vocab 128, hidden 64, 4 layers (sliding 8, full, sliding 8, full), HQ=4, HKV=2, D=16."""
    from transformers import GptOssConfig

    layers = overrides.pop("num_hidden_layers", 4)
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                num_local_experts=2, num_experts_per_tok=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                pad_token_id=0, bos_token_id=None, eos_token_id=None)
    base.update(overrides)
    return GptOssConfig(**base)


def model(cfg=None, seed: int = 0, attn_implementation: str = "eager", qk_gain: float = 8.0, sink_scale: float = 2.0):
    """``GptOssForCausalLM`` from ``cfg`` (default ``config()``), fp32, eval mode, seeded weights."""
    from transformers import GptOssForCausalLM

    cfg = copy.deepcopy(cfg) if cfg is not None else config()      # a model owns its config (attn choice)
    torch.manual_seed(seed)
    m = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in m.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(qk_gain)
            attn.k_proj.weight.mul_(qk_gain)
            attn.sinks.copy_(torch.randn_like(attn.sinks) * sink_scale)
    m.set_attn_implementation(attn_implementation)
    return m.eval()
