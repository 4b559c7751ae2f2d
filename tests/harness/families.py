"""Tiny random models of every Hugging Face model family with attention sinks but gpt-oss (which has
``harness.gpt_oss``), for the tests (``tests/test_hf_models.py``, ``tests/test_hf_cp.py``,
``tests/hf_compile_check.py``): fp32, two layers (DeepSeek-V4: three), hidden 64, seeded; no downloads.

    MiMo-V2-Flash          D=24, Dv=16 (the real 192 / 128 scaled down), sinks on the sliding layer only
    DeepSeek-V4            D=512, one KV head passed as both k and v; three layers: compressed sparse
                           (an entry per 4 tokens, the indexer's top 2 of them), heavily compressed
                           (an entry per 8) and sliding window; the first layer's indexer reads the
                           embeddings (no rounding can flip its choice between two implementations)
                           and its padded rows feed the second's entries, so they must be right too
    HY-V4                  MLA layers: D=24 (nope 16 + rope 8), Dv=16; its indexer reads the 4-D mask;
                           index_topk >= the sequence length, so every key is selected
    Granite-SWA, GraniteMoE-SWA   sinks as post-attention LSE scaling in eager, attention_multiplier scale
    Flint                  fp32 sinks, q/k norms
    OpenAI privacy filter  bidirectional (not causal) sliding window, |i - j| <= W, a token classifier

Routed MoE layers route every token to every expert (top-k = all), so rounding cannot flip a
routing decision between two implementations.
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "DECODERS", "spec", "model"]

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
TWO = ["sliding_attention", "full_attention"]


def spec(name: str):
    """(model class, config, number of layers with sinks, output attribute) of a family's tiny model."""
    import transformers as T

    if name == "mimo_v2_flash":
        cfg = T.MiMoV2FlashConfig(**SMALL, intermediate_size=64, num_key_value_heads=1, head_dim=24, v_head_dim=16,
                                  sliding_window=8, layer_types=TWO, mlp_layer_types=["dense", "sparse"],
                                  moe_intermediate_size=32, n_routed_experts=2, num_experts_per_tok=2)
        return T.MiMoV2FlashForCausalLM, cfg, 1, "logits"
    if name == "deepseek_v4":
        layers = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
        cfg = T.DeepseekV4Config(**(SMALL | dict(num_hidden_layers=3)), moe_intermediate_size=32, num_key_value_heads=1,
                                 head_dim=512, q_lora_rank=32, n_routed_experts=2, num_experts_per_tok=2,
                                 sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=128,
                                 index_topk=2, layer_types=layers, mlp_layer_types=["moe"] * 3, hc_mult=2,
                                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                                 num_nextn_predict_layers=0)
        return T.DeepseekV4ForCausalLM, cfg, 3, "logits"
    if name == "hy_v4":
        cfg = T.HYV4Config(**SMALL, intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=4,
                           head_dim=24, n_routed_experts=2, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_topk=64, index_head_dim=16,
                           index_n_heads=2, hc_mult=2)
        return T.HYV4ForCausalLM, cfg, 2, "logits"
    if name == "granite_swa":
        cfg = T.GraniteSWAConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, sliding_window=8,
                                 layer_types=TWO, attention_multiplier=0.3, embedding_multiplier=2.0,
                                 residual_multiplier=0.5, logits_scaling=2.0)
        return T.GraniteSWAForCausalLM, cfg, 2, "logits"
    if name == "granitemoe_swa":
        cfg = T.GraniteMoeSWAConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, sliding_window=8,
                                    layer_types=TWO, attention_multiplier=0.3, num_local_experts=2,
                                    num_experts_per_tok=2)
        return T.GraniteMoeSWAForCausalLM, cfg, 2, "logits"
    if name == "flint":
        cfg = T.FlintConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, head_dim=16, sliding_window=8,
                            layer_types=TWO, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            num_experts=2, num_experts_per_tok=2)
        return T.FlintForCausalLM, cfg, 2, "logits"
    if name == "openai_privacy_filter":
        cfg = T.OpenAIPrivacyFilterConfig(**{**SMALL, "eos_token_id": 0}, intermediate_size=32, num_key_value_heads=2,
                                          head_dim=16, sliding_window=5, num_local_experts=2, num_experts_per_tok=2,
                                          num_labels=5)
        return T.OpenAIPrivacyFilterForTokenClassification, cfg, 2, "logits"
    raise AssertionError(name)


FAMILIES = ["mimo_v2_flash", "deepseek_v4", "hy_v4", "granite_swa", "granitemoe_swa", "flint",
            "openai_privacy_filter"]
DECODERS = [f for f in FAMILIES if f != "openai_privacy_filter"]     # causal LMs: generate, shifted labels


def model(name: str, seed: int = 0, attn_implementation: str = "eager", **changes):
    """The family's tiny model (``spec``; ``changes`` set on its config), fp32, eval mode, weights seeded by
    ``seed`` and sinks drawn as ``2 * randn`` (some heads dominated by the sink, some not)."""
    cls, cfg, sink_layers, _ = spec(name)
    for key, value in changes.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = cls(cfg).float().eval()
    with torch.no_grad():
        sinks = [p for n, p in m.named_parameters() if n.endswith("self_attn.sinks")]
        assert len(sinks) == sink_layers
        for p in sinks:
            p.copy_(torch.randn_like(p) * 2)
    if attn_implementation != "eager":
        m.set_attn_implementation(attn_implementation)
    return m
