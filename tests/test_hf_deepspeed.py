"""DeepSpeed's Ulysses for Hugging Face models (``UlyssesSPAttentionHF``, the route of accelerate's
``sp_backend="deepspeed"`` and the HF Trainer) wrapping ``attn_implementation="sinkattn"``: each call gets HQ/P
heads and the whole sinks [HQ], and sinkattn cuts the sinks to the rank's heads. Real DeepSpeed, launched with
``torchrun --nproc-per-node P`` (P = 2 and 3), gloo on CPU, fp32: loss, logits and every gradient (sinks
included) against one process on the whole packed batch.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.4")
pytest.importorskip("deepspeed")

import sinkattn.hf  # noqa: E402
from harness import gpt_oss, hf_cp, hf_deepspeed  # noqa: E402
from harness.hf_cp import relative_error as rel  # noqa: E402

RTOL = 1e-5

NAME = sinkattn.hf.register()


@pytest.mark.parametrize("P", (2, 3))
def test_deepspeed_ulysses_matches_one_process(P, tmp_path):
    results = hf_cp.launch(P, tmp_path, "harness.hf_deepspeed")
    model = gpt_oss.model(hf_cp.config(), attn_implementation=NAME).train()
    out = model(**hf_cp.batch(documents=hf_deepspeed.DOCUMENTS, flash_kwargs=False))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    HQ, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    for r, res in enumerate(results):
        got = res["step"]
        assert got["wrapped"].startswith("UlyssesSPAttentionHF.register_with_transformers"), got["wrapped"]
        assert got["calls"] == [((HQ,), HQ // P)] * layers, got["calls"]     # whole sinks, the rank's heads
        assert got["local_tokens"] == sum(hf_deepspeed.DOCUMENTS) // P
        assert rel(got["loss"], out.loss.detach()) <= RTOL, (r, got["loss"], out.loss)
        assert rel(got["logits"], out.logits[0].detach()) <= RTOL, r
        assert got["grads"].keys() == grads.keys()
        for name, g in grads.items():
            assert g.abs().max() > 0, name
            err = rel(got["grads"][name], g)
            assert err <= RTOL, f"rank {r}: grad {name} rel err {err:.2e}"
            if name.endswith("self_attn.sinks"):
                assert got["grads"][name].abs().min() > 0, name
