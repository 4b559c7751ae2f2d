"""sinkattn.hf against Hugging Face's own eager attention for every model family in transformers with
attention sinks (gpt-oss has its own file, test_hf.py), each from a tiny random config
(``harness.families``: MiMo-V2-Flash with Dv != D, DeepSeek-V4 with D=512, HY-V4's MLA and
indexer, Granite-SWA, GraniteMoE-SWA, Flint, the bidirectional OpenAI privacy filter).

Each model runs twice with the same weights (eager, sinkattn) on a dense batch and on a left- or
right-padded one; logits (on real tokens) within 2e-5 of the logit scale, every parameter gradient
within 1e-4 of its own scale (or of the model run in float64 within 3x eager fp32's own error against it,
where that is larger: ``fp32_floor``), the sinks' gradients included. Routed MoE layers route every token to
every expert (top-k = all), so rounding cannot flip a routing decision between the two runs. DeepSeek-V4
runs a compressed sparse layer (the indexer's top 2 of 6 entries; first, so its indexer reads the same
embeddings in both runs), a heavily compressed and a sliding layer. HY-V4 also runs with its indexer's
top-k below the length. What sinkattn cannot express (DeepSeek-V4's compressed layers on several queries
after earlier tokens, packed or context parallel) raises a ValueError naming the fix. Every decoder
family also generates greedily with dynamic and static caches as eager does; ``torch.compile`` of a training step:
``test_hf.py``'s inductor run (``hf_compile_check.py``, MiMo-V2-Flash and the privacy filter), the
other families by hand.
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.4")

import sinkattn.hf  # noqa: E402
from harness import families, gpt_oss  # noqa: E402
from test_hf import OpCounter  # noqa: E402

NAME = sinkattn.hf.register()
LOGIT_RTOL, GRAD_RTOL = 2e-5, 1e-4
FAMILIES = families.FAMILIES


def models(name, **changes):
    """(eager model, sinkattn model) with identical weights (``harness.families.model``)."""
    eager = families.model(name, **changes)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    return eager, ours


def run(model, ids, mask, call=None):
    """Logits of the real tokens and every parameter gradient of ``sum(logits * w)``, w fixed; the
    forward through ``call`` (e.g. the compiled model) if given, else ``model``."""
    model.zero_grad(set_to_none=True)
    kwargs = dict(input_ids=ids) if mask is None else dict(input_ids=ids, attention_mask=mask)
    logits = (model if call is None else call)(**kwargs).logits
    logits = logits.reshape(-1, logits.shape[-1]) if mask is None else logits[mask.bool()]
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


BATCHES = {"dense": None, "left_padded": (slice(0, 5),), "right_padded": (slice(19, None),)}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_every_gradient_match_hf_eager(family, batch):
    eager, ours = models(family)
    names = against_eager(eager, ours, batch)
    layers = eager.config.num_hidden_layers
    assert names.count("sinkattn::forward") == layers and names.count("sinkattn::backward") == layers


def against_eager(eager, ours, batch) -> list[str]:
    """``assert_close`` of the two models on a batch of ``BATCHES``; the ops the sinkattn run called."""
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = None
    if BATCHES[batch] is not None:
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, BATCHES[batch][0]] = 0
    logits_e, grads_e = run(eager, ids, mask)
    with OpCounter() as counter:
        logits_o, grads_o = run(ours, ids, mask)
    assert_close(logits_o, grads_o, logits_e, grads_e, eager, ids, mask)
    return [n for n, _ in counter.calls]


def assert_close(logits, grads, logits_want, grads_want, eager, ids, mask) -> tuple[float, float]:
    """Logits within ``LOGIT_RTOL`` and every gradient within ``GRAD_RTOL`` of the wanted ones; the sinks'
    gradients non-zero. A gradient further from eager's than that (a scalar summed with heavy
    cancellation: DeepSeek-V4's hyper-connection head, whose fp32 gradient moves by 1e-4 under rounding
    alone) is held to the float64 model's instead: within ``GRAD_RTOL`` or 3x (Gate B's factor) eager
    fp32's own error E against it (``fp32_floor``), as test_hf.py allows for the MoE router bias.
    Returns the logits' and the worst gradient's relative errors (against eager)."""
    assert rel(logits, logits_want) <= LOGIT_RTOL, f"logits rel err {rel(logits, logits_want):.2e}"
    assert grads.keys() == grads_want.keys()
    assert any(n.endswith("self_attn.sinks") for n in grads_want)
    floor, worst = None, 0.0
    for name, g in grads_want.items():
        if name.endswith("self_attn.sinks"):
            assert g.abs().max() > 0, f"{name} got no gradient"
        err = rel(grads[name], g) if g.abs().max() > 0 else grads[name].abs().max().item()
        worst = max(worst, err)
        if err <= GRAD_RTOL:
            continue
        if floor is None:
            want64, floor = fp32_floor(eager, ids, mask)
        err64, limit = rel(grads[name], want64[name]), max(GRAD_RTOL, 3 * floor[name])
        assert err64 <= limit, f"grad {name} rel err {err:.2e} (against float64 {err64:.2e}, limit {limit:.2e})"
    return rel(logits, logits_want), worst


STATIC_CHANGES = {"deepseek_v4": dict(layer_types=["sliding_attention"] * 3)}
"""Hugging Face's StaticCache has no layer for DeepSeek-V4's compressed layers (eager fails as well):
its static-cache run keeps the sliding-window layers only."""


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", families.DECODERS)     # the privacy filter is an encoder
def test_greedy_generate_left_padded_past_the_window_matches_eager(family, cache):
    """Greedy ``generate`` with a cache on a left-padded batch, prompt 10 and 8 new tokens (past the
    sliding window of 8; DeepSeek-V4's compressed layers emit entries on the way): the same tokens as
    eager attention and every step's logits within 2e-5."""
    eager, ours = models(family, **(STATIC_CHANGES.get(family, {}) if cache == "static" else {}))
    names = generates_as_eager(eager, ours, cache)
    assert names.count("sinkattn::forward") == 8 * eager.config.num_hidden_layers


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hy_v4_with_sparse_top_k_generates_as_eager(cache):
    """The top 4 keys per query (of up to 18) at every step of ``generate``, as eager."""
    generates_as_eager(*models("hy_v4", index_topk=4), cache)


def generates_as_eager(eager, ours, cache) -> list[str]:
    """Greedy ``generate`` on a left-padded batch, prompt 10, 8 new tokens: the same tokens as ``eager``
    and every step's logits within 2e-5; the ops the sinkattn run called."""
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True, cache_implementation=cache)
    want = eager.generate(ids, **kw)
    with OpCounter() as counter:
        got = ours.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert rel(a, b) <= LOGIT_RTOL, f"step {step}: logits rel err {rel(a, b):.2e}"
    return [n for n, _ in counter.calls]


def fp32_floor(model, ids, mask, draws: int = 4) -> tuple[dict, dict]:
    """The gradients of ``model`` run in float64, and each one's fp32 error under rounding alone: the
    largest relative error against them of ``model`` run in fp32 as it is and with its embeddings moved
    by about an ulp (``draws`` random draws: other roundings of the same function)."""
    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")        # grouped_mm has no float64
    want = run(model64, ids, mask)[1]
    floor = {n: rel(g, want[n]) for n, g in run(model, ids, mask)[1].items()}
    for draw in range(draws):
        moved = copy.deepcopy(model)
        with torch.no_grad():
            table = moved.get_input_embeddings().weight
            table.mul_(1 + 2.0 ** -24 * torch.randn(table.shape, generator=torch.Generator().manual_seed(draw)))
        grads = run(moved, ids, mask)[1]
        floor = {n: max(e, rel(grads[n], want[n])) for n, e in floor.items()}
    return want, floor


def test_deepseek_v4_compressed_layers_refuse_what_they_cannot_tell_apart():
    """Several queries after earlier tokens (the window / entry split cannot be told from the shapes),
    packed documents (the compressor mixes them), context parallelism (each rank's compressor would see
    its shard only) and a float mask that adds a bias: a ValueError naming the way out."""
    _, ours = models("deepseek_v4")
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    cache = ours(input_ids=ids[:, :16], use_cache=True).cache
    with pytest.raises(ValueError, match="4 queries after earlier tokens.*one query at a time"):
        ours(input_ids=ids[:, 16:20], cache=cache, use_cache=True)
    module = ours.model.layers[1].self_attn
    q, kv = torch.randn(1, 4, 8, 512), torch.randn(1, 1, 9, 512)
    seen = torch.zeros(1, 1, 8, 9)
    flash = dict(cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32),
                 cu_seq_lens_k=torch.tensor([0, 9], dtype=torch.int32), max_length_q=8, max_length_k=9)
    with pytest.raises(ValueError, match="mix the documents of a packed row"):
        sinkattn.hf.attention_forward(module, q, kv, kv, seen, s_aux=module.sinks, **flash)
    with pytest.raises(ValueError, match="needs its \\[B, 1, Sq, Sk\\] mask"):
        sinkattn.hf.attention_forward(module, q, kv, kv, None, s_aux=module.sinks)
    with pytest.raises(ValueError, match="values other than 0 and -inf"):
        sinkattn.hf.attention_forward(module, q, kv, kv, seen + 0.5, s_aux=module.sinks)
    cp = sinkattn.hf.ContextParallel(group=None)
    with pytest.raises(ValueError, match="compressed layers cannot run context parallel"):
        sinkattn.hf.attention_forward(module, q, kv, kv, seen, s_aux=module.sinks, context_parallel=cp)


@pytest.mark.parametrize("scale", [None, 0.0], ids=["default-scale", "scale0"])
@pytest.mark.parametrize("sink_scale", [1.0, 300.0], ids=["sinks", "sinks-x300"])
@pytest.mark.parametrize("window_part", [True, False], ids=["window+entries", "entries+sink"])
@pytest.mark.parametrize("seed", range(2))
def test_two_key_sets_merged_by_lse_equal_one_softmax_over_both(seed, window_part, sink_scale, scale):
    """sinkattn.hf.listed: sinkattn on one key set (with the sink), fp32 ops on another (``entries``, a
    query may see none of them), merged by ``sinkattn.sink``'s rule, against the float64 softmax over the
    union; without the first set, the entries and the sink alone. Sinks far below the scores (x300: some
    under -87, where fp32's exp underflows), an explicit scale of 0; gradients too."""
    from sinkattn.hf import listed
    g = torch.Generator().manual_seed(seed)
    B, Sq, HQ, HKV, D, T = 2, 7, 4, 2, 16, 5
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((Sq, HQ), (Sq, HKV), (Sq, HKV)))
    kc, vc = torch.randn(B, T, HKV, D, generator=g), torch.randn(B, T, HKV, D, generator=g)
    sinks = torch.randn(HQ, generator=g) * sink_scale
    seen = torch.rand(B, Sq, T, generator=g) < 0.5
    seen[0, 0] = False
    leaves = [t.requires_grad_() for t in (q, k, v, kc, vc, sinks)]
    softmax_scale = D ** -0.5 if scale is None else scale

    def ours():
        if not window_part:
            return listed.joined(q, kc, vc, seen, dict(softmax_scale=scale, sinks=sinks))
        o_w, lse_w = sinkattn.sink_attn_func(q, k, v, sinks=sinks, causal=True, return_lse=True, backend="reference",
                                             softmax_scale=scale)
        return listed.joined(q, kc, vc, seen, dict(softmax_scale=scale), o_w, lse_w.transpose(1, 2))

    def union():                                                        # eager softmax, float64
        keys, values = torch.cat([k, kc], 1).double(), torch.cat([v, vc], 1).double()
        causal = torch.ones(Sq, Sq, dtype=torch.bool).tril() & window_part
        allowed = torch.cat([causal.expand(B, -1, -1), seen], -1)[:, None]             # [B, 1, Sq, Sq + T]
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), keys.repeat_interleave(HQ // HKV, 2)) * softmax_scale
        s = torch.cat([s.masked_fill(~allowed, -torch.inf),
                       sinks.double().view(1, HQ, 1, 1).expand(B, -1, Sq, 1)], -1)
        p = torch.softmax(s, -1)[..., :-1]
        return torch.einsum("bhqk,bkhd->bqhd", p, values.repeat_interleave(HQ // HKV, 2))

    got, want = ours(), union()
    assert got.dtype == torch.float32 and (got - want).abs().max() <= 4e-6 * want.abs().max()
    w = torch.randn(got.shape, generator=g)
    grads = torch.autograd.grad((got * w).sum(), leaves, allow_unused=True)
    wanted = torch.autograd.grad((want * w.double()).sum(), leaves, allow_unused=True)
    for name, a, b in zip(("q", "k", "v", "kc", "vc", "sinks"), grads, wanted):
        if b is None or not b.any():           # k, v unused without the window part; q's gradient at scale 0
            assert a is None or not a.any(), name
            continue
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-5 * b.abs().max(), name


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_hy_v4_sparse_top_k_below_the_length_matches_eager(batch, chunked, monkeypatch):
    """HY-V4's indexer keeps the top 8 of 24 keys per query: each query attends to those its mask shows
    (``sinkattn.hf.listed``, no sinkattn kernel), as eager does; ``chunked``: two queries at a time,
    each block recomputed in the backward."""
    if chunked:
        monkeypatch.setattr(sinkattn.hf.listed, "CHUNK_SCORES", 2 * 2 * 4 * 24)
    eager, ours = models("hy_v4", index_topk=8)
    assert "sinkattn::forward" not in against_eager(eager, ours, batch)


PACKED = dict(position_ids=torch.cat([torch.arange(10), torch.arange(14)])[None],
              cu_seq_lens_q=torch.tensor([0, 10, 24], dtype=torch.int32),
              cu_seq_lens_k=torch.tensor([0, 10, 24], dtype=torch.int32), max_length_q=14, max_length_k=14)


@pytest.mark.parametrize("family, changes", [("deepseek_v4", {}), ("hy_v4", {}), ("hy_v4", dict(index_topk=8))],
                         ids=["deepseek_v4", "hy_v4", "hy_v4-sparse"])
def test_models_whose_layers_read_the_whole_row_take_packing_as_eager_does(family, changes):
    """DeepSeek-V4's compressor and HY-V4's indexer read the whole row, and transformers gives them no
    packed-sequence mask: a row packed by ``position_ids`` alone is one sequence to eager and to sinkattn
    alike; the flash-attention kwargs, which sinkattn would honour and eager ignores, are refused."""
    eager, ours = models(family, **changes)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    by_positions = dict(input_ids=ids, position_ids=PACKED["position_ids"])
    assert rel(ours(**by_positions).logits, eager(**by_positions).logits) <= LOGIT_RTOL
    with pytest.raises(ValueError, match="knows no documents|mix the documents of a packed row"):
        ours(input_ids=ids, **PACKED)


EAGER_FINDS_DOCUMENTS = {"mimo_v2_flash", "granite_swa", "granitemoe_swa", "flint"}
"""Families whose eager attention (transformers 5.25) finds the documents of a row packed by ``position_ids``
when there is no cache, as in training: transformers' packed-sequence mask. gpt-oss's eager and the privacy
filter's bidirectional layers attend across the row (docs/hf.md, "Packed and padded batches")."""


@pytest.mark.parametrize("family", ["gpt_oss", *(f for f in FAMILIES if f not in ("deepseek_v4", "hy_v4"))])
def test_a_row_packed_by_position_ids_is_each_document_alone_and_eager_as_docs_say(family):
    """sinkattn on a row packed by ``position_ids`` alone (no cache) gives each document run alone; eager gives
    the same for ``EAGER_FINDS_DOCUMENTS`` and lets the documents see each other for the others."""
    if family == "gpt_oss":
        eager = gpt_oss.model()
        ours = copy.deepcopy(eager)
        ours.set_attn_implementation(NAME)
    else:
        eager, ours = models(family)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    packed = dict(input_ids=ids, position_ids=PACKED["position_ids"], use_cache=False)
    with torch.no_grad():
        alone = torch.cat([eager(input_ids=ids[:, :10]).logits, eager(input_ids=ids[:, 10:]).logits], dim=1)
        assert rel(ours(**packed).logits, alone) <= LOGIT_RTOL
        eager_packed = rel(eager(**packed).logits, alone)
    if family in EAGER_FINDS_DOCUMENTS:
        assert eager_packed <= LOGIT_RTOL, f"{family}: eager now attends across a packed row; update docs/hf.md"
    else:
        assert eager_packed > 1e-2, f"{family}: eager now isolates a packed row's documents; update docs/hf.md"


def test_listed_keys_multiply_in_fp32_under_autocast():
    """Under bf16 autocast (the HF Trainer's bf16=True) the listed keys' products stay fp32: the same bits
    as without autocast."""
    from sinkattn.hf import listed
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)
    v = torch.randn(2, 7, 2, 8, generator=g)
    seen = torch.rand(2, 5, 7, generator=g) < 0.6
    want = listed.entries(q, k, v, seen, 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = listed.entries(q, k, v, seen, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bidirectional_window_patterns_are_recognised_and_padding_inside_a_row_refused():
    from transformers import masking_utils as mu
    pattern = mu.sliding_window_bidirectional_mask_function(4)
    assert sinkattn.hf.masks.pattern_window(pattern) == 4
    assert sinkattn.hf.masks.pattern_window(mu.bidirectional_mask_function) is None
    one_side = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(sinkattn.hf.key_mask(2, 6, 6, 0, 0, pattern, one_side, local_size=4), one_side)
    gap = torch.tensor([[1, 1, 0, 1, 1, 1]] * 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="padding inside a row"):
        sinkattn.hf.key_mask(2, 6, 6, 0, 0, pattern, gap, local_size=4)


@pytest.mark.parametrize("window", [None, 3])
def test_non_causal_layer_matches_eager_directly(window):
    """The attention function alone on a bidirectional layer: keys |i - j| <= W - 1 for sliding_window=W
    (flash-attn's reading, which the privacy filter's layers are written for)."""
    from transformers.models.openai_privacy_filter import modeling_openai_privacy_filter as opf
    _, cfg, _, _ = families.spec("openai_privacy_filter")
    module = opf.OpenAIPrivacyFilterAttention(cfg).eval()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4) * 2)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None]
    visible = (i - j).abs() <= window - 1 if window else torch.ones(9, 9, dtype=torch.bool)
    additive = torch.zeros(9, 9).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected, _ = opf.eager_attention_forward(module, q, k, v, additive, scaling=0.4)
    got, _ = sinkattn.hf.attention_forward(module, q, k, v, None, scaling=0.4, sliding_window=window,
                                           s_aux=module.sinks)
    assert torch.allclose(got, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_4d_mask_other_than_the_layer_pattern_is_refused(traced):
    """A 4-D boolean mask (what indexed-attention layers get) is read back as real keys only when it is
    exactly the layer's pattern over them; with a cache, over the columns up to the last one a query sees
    (a static cache's later slots are unwritten). Traced with ``fullgraph=True``: no graph break, the
    check runs in the compiled program."""
    eager, ours = models("hy_v4")
    module = ours.model.layers[0].self_attn
    call = sinkattn.hf.attention_forward
    if traced:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="eager")
    q, k, v = torch.randn(1, 4, 6, 24), torch.randn(1, 4, 6, 24), torch.randn(1, 4, 6, 16)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    out, _ = call(module, q, k, v, causal, scaling=0.3, s_aux=module.sinks)
    assert out.shape == (1, 6, 4, 16)
    static = torch.zeros(1, 1, 2, 9, dtype=torch.bool)             # 2 queries at 4, 5 of a 9-slot cache
    static[..., :6] = causal[..., 4:, :]
    k9 = torch.cat([k, torch.full((1, 4, 3, 24), float("nan"))], 2)  # unwritten slots: never read
    v9 = torch.cat([v, torch.full((1, 4, 3, 16), float("nan"))], 2)
    got, _ = call(module, q[:, :, 4:], k9, v9, static, scaling=0.3, s_aux=module.sinks)
    assert torch.allclose(got, out[:, 4:], atol=1e-6, rtol=0)
    other = causal.clone()
    other[0, 0, 4, 1] = False
    with pytest.raises(ValueError, match="not its causal / sliding-window pattern"):
        call(module, q, k, v, other, scaling=0.3, s_aux=module.sinks)
    static[0, 0, 0, 5] = True                                      # a query sees a key after it
    with pytest.raises(ValueError, match="not its causal / sliding-window pattern"):
        call(module, q[:, :, 4:], k9, v9, static, scaling=0.3, s_aux=module.sinks)
