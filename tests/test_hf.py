"""sinkattn.hf against Hugging Face's own eager gpt-oss attention, on small random models.

Every model is built from a GptOssConfig (harness.gpt_oss; no downloads, HF_HUB_OFFLINE=1):
4 layers alternating sliding (window 8) / full attention, sequences longer than the window,
sharp attention and sinks ``2 * randn``. Each comparison runs the same weights twice, eager and
sinkattn; packed rows are compared with each sequence run alone (eager does not isolate the
sequences of a packed row). Tolerances: fp32 logits within 2e-5 of the logit scale, every
parameter gradient within 1e-4 of that gradient's scale.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.4")

import sinkattn.hf  # noqa: E402
from harness import gpt_oss  # noqa: E402
from conftest import cold_cache_env  # noqa: E402
from transformers import DataCollatorWithFlattening, StaticCache  # noqa: E402
from transformers import masking_utils  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAME = sinkattn.hf.register()
LOGIT_RTOL, GRAD_RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def pair():
    """(eager model, sinkattn model) with identical weights."""
    return gpt_oss.model(), gpt_oss.model(attn_implementation=NAME)


def rel(actual, expected) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def run(model, weights, *calls):
    """Run ``calls`` (each ``(kwargs, keep)``: model inputs and a bool mask of the logits to keep)
    and back-propagate ``sum(logits[keep] * weights[i])``; returns (kept logits concatenated, grads)."""
    model.zero_grad(set_to_none=True)
    kept = torch.cat([model(**kwargs).logits[keep] for kwargs, keep in calls])
    (kept * weights[: kept.shape[0]]).sum().backward()
    return kept.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(eager, ours, label, floor=None):
    """``floor``: per gradient, the error of a second sound fp32 computation of the same sequences (sinkattn's
    dense path against eager); a gradient may err up to 3x that (Gate B's factor), and GRAD_RTOL in any case.
    Needed where rounding alone moves a gradient that cancels (the MoE router bias: 9e-5 between the two)."""
    (logits_e, grads_e), (logits_o, grads_o) = eager, ours
    assert rel(logits_o, logits_e) <= LOGIT_RTOL, f"{label}: logits rel err {rel(logits_o, logits_e):.2e}"
    assert grads_o.keys() == grads_e.keys()
    sinks = [n for n in grads_e if n.endswith("self_attn.sinks")]
    assert len(sinks) == 4
    for name, g in grads_e.items():
        assert g.abs().max() > 0, f"{label}: {name} got no gradient"
        err = rel(grads_o[name], g)
        limit = GRAD_RTOL if floor is None else max(GRAD_RTOL, 3 * rel(floor[1][name], g))
        assert err <= limit, f"{label}: grad {name} rel err {err:.2e}"


def weights_for(n_rows, vocab=128, seed=1):
    return torch.randn(n_rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_dense_batch_logits_and_every_gradient(pair):
    ids = torch.randint(1, 128, (2, 24))
    keep = torch.ones(2, 24, dtype=torch.bool)
    w = weights_for(48)
    assert_close(run(pair[0], w, (dict(input_ids=ids), keep)), run(pair[1], w, (dict(input_ids=ids), keep)), "dense")


def test_right_padded_batch_on_real_tokens(pair):
    ids = torch.randint(1, 128, (3, 22))
    mask = torch.ones(3, 22, dtype=torch.long)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = 0
    call = (dict(input_ids=ids, attention_mask=mask), mask.bool())
    w = weights_for(int(mask.sum()))
    assert_close(run(pair[0], w, call), run(pair[1], w, call), "right-padded")


def alone_calls(seqs):
    return [(dict(input_ids=s[None]), torch.ones(1, len(s), dtype=torch.bool)) for s in seqs]


@pytest.mark.parametrize("rows", [1, 2], ids=["B=1", "B=2"])
def test_packed_by_position_ids_equals_each_sequence_alone(pair, rows):
    lengths = [[9, 13, 6], [11, 17]][:rows]
    width = max(sum(r) for r in lengths)
    ids = torch.randint(1, 128, (rows, width))
    pos = torch.zeros(rows, width, dtype=torch.long)
    seqs = []
    for b, row in enumerate(lengths):
        start = 0
        for n in row + [width - sum(row)]:         # pad each row to the width with one more sequence
            if n:
                pos[b, start:start + n] = torch.arange(n)
                seqs.append(ids[b, start:start + n])
            start += n
    w = weights_for(rows * width)
    packed = run(pair[1], w, (dict(input_ids=ids, position_ids=pos), torch.ones(rows, width, dtype=torch.bool)))
    alone = run(pair[0], w, *alone_calls(seqs))
    assert_close(alone, packed, f"packed by position_ids, {rows} row(s)", floor=run(pair[1], w, *alone_calls(seqs)))


def test_packed_by_data_collator_with_flattening(pair):
    seqs = [torch.randint(1, 128, (n,)) for n in (10, 15, 4, 12)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in seqs])
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"} <= batch.keys()
    labels = batch.pop("labels")
    total = sum(len(s) for s in seqs)
    w = weights_for(total)
    packed = run(pair[1], w, (dict(batch), torch.ones(1, total, dtype=torch.bool)))
    assert_close(run(pair[0], w, *alone_calls(seqs)), packed, "DataCollatorWithFlattening")
    with torch.no_grad():          # the model's own loss over the packed labels = that of the sequences alone
        loss = pair[1](**batch, labels=labels).loss
        alone = torch.cat([pair[0](input_ids=s[None]).logits[0] for s in seqs])
    expected = torch.nn.functional.cross_entropy(alone[:-1], labels[0, 1:], ignore_index=-100)
    assert torch.allclose(loss, expected, rtol=1e-5, atol=0)


def test_padding_and_packing_in_one_batch_each_document_equals_itself_alone(pair):
    """Row 0 packs A, B (positions restart at 0); row 1 is C, right-padded; row 2 is left padding (at
    position 0, as TRL pads position_ids) then D, E packed. Every document longer than the window."""
    ids, mask, pos = torch.randint(1, 128, (3, 20)), torch.ones(3, 20, dtype=torch.long), torch.zeros(3, 20, dtype=int)
    documents = [(0, 0, 9), (0, 9, 20), (1, 0, 13), (2, 4, 11), (2, 11, 20)]
    for b, start, end in documents:
        pos[b, start:end] = torch.arange(end - start)
    mask[1, 13:], mask[2, :4] = 0, 0
    ids[mask == 0] = 0
    w = weights_for(int(mask.sum()))
    batch = run(pair[1], w, (dict(input_ids=ids, attention_mask=mask, position_ids=pos), mask.bool()))
    alone = run(pair[0], w, *alone_calls([ids[b, start:end] for b, start, end in documents]))
    assert_close(alone, batch, "padding and packing in one batch")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_left_padded_past_the_window(pair, cache):
    ids = torch.randint(1, 128, (3, 13))
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[0, :9] = 0
    mask[1, :2] = 0
    ids[mask == 0] = 0
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
              return_dict_in_generate=True, cache_implementation=cache)
    eager, ours = pair[0].generate(ids, **kw), pair[1].generate(ids, **kw)
    assert torch.equal(ours.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, eager.logits)):
        assert rel(a, b) <= LOGIT_RTOL, f"step {step}: rel err {rel(a, b):.2e}"


# other sink families in the loop run, under dynamo with the eager backend (harness.families; through
# inductor by hand: `python tests/hf_compile_check.py families NAME...`, docs/hf.md): the value head dim
# Dv != D with a sliding layer, and the bidirectional window, dense batches. Inductor's lowering of what
# sinkattn adds to a model (the padded layout's sort, search and scatter) is gpt-oss's padded+packed check.
COMPILED_FAMILIES = ["mimo_v2_flash:dense", "openai_privacy_filter:dense"]


@pytest.mark.parametrize("mode", ["inductor", "loop", "static"])
def test_compiled_model_in_a_fresh_process(mode, tmp_path):
    """tests/hf_compile_check.py: inductor on padding + packing with gradients; a 15-call loop mixing every
    layout and length without a graph break or reaching the recompile limit, then COMPILED_FAMILIES' training
    steps without a graph break in sinkattn's code; decoding with a StaticCache, with and without a mask,
    compiling nothing after the second token (the last two under dynamo's eager backend: breaks and recompiles
    are dynamo's, and inductor's kernels would add a minute)."""
    script = Path(__file__).with_name("hf_compile_check.py")
    args = {"static": [mode, "eager"], "loop": [mode, *COMPILED_FAMILIES]}.get(mode, [mode])
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900,
                         env={**cold_cache_env(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("graph breaks 0") == {"inductor": 1, "loop": 15, "static": 2}[mode], run.stdout
    if mode == "loop":
        assert run.stdout.count(", 0 in sinkattn's code") == len(COMPILED_FAMILIES), run.stdout


def test_bf16_model_error_at_most_twice_eager_bf16(pair):
    ids = torch.randint(1, 128, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0
    real = mask.bool()
    bf16 = [gpt_oss.model(attn_implementation=a).to(torch.bfloat16) for a in ("eager", NAME)]
    golden = gpt_oss.model().to(torch.bfloat16).float()             # the same rounded weights, run in fp32
    with torch.no_grad():
        ref = golden(input_ids=ids, attention_mask=mask).logits[real]
        err_eager, err_ours = ((m(input_ids=ids, attention_mask=mask).logits[real].float() - ref).abs().max()
                               for m in bf16)
    assert 0 < err_ours <= 2 * err_eager, f"sinkattn bf16 err {err_ours:.3g}, eager bf16 err {err_eager:.3g}"


class OpCounter(TorchDispatchMode):
    """Counts the sinkattn custom ops actually dispatched (not replaced: each call still runs)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sinkattn":       # (op name, backend: the op's one str argument; None: a mask op)
            self.calls.append((func.name(), next((a for a in args if isinstance(a, str)), None)))
        return func(*args, **(kwargs or {}))


def test_every_layer_runs_through_the_sinkattn_op(pair):
    ids = torch.randint(1, 128, (2, 12))
    for model, expected in ((pair[1], 4), (pair[0], 0)):
        with OpCounter() as counter:
            model(input_ids=ids).logits.sum().backward()
        model.zero_grad(set_to_none=True)
        names = [name for name, _ in counter.calls]
        assert names.count("sinkattn::forward") == expected and names.count("sinkattn::backward") == expected
        assert all(backend == "cpu" for _, backend in counter.calls)


def test_register_is_idempotent_and_forces_a_backend(pair):
    fn = transformers.AttentionInterface._global_mapping[NAME]
    assert sinkattn.hf.register() == NAME and transformers.AttentionInterface._global_mapping[NAME] is fn
    assert masking_utils.AttentionMaskInterface._global_mapping[NAME] is sinkattn.hf.key_mask
    forced = sinkattn.hf.register("sinkattn-reference", backend="reference")
    model = gpt_oss.model(attn_implementation=forced)
    ids = torch.randint(1, 128, (1, 12))
    with torch.no_grad(), OpCounter() as counter:
        logits = model(input_ids=ids).logits
        expected = pair[0](input_ids=ids).logits
    assert [b for _, b in counter.calls] == ["reference"] * 4
    assert rel(logits, expected) <= LOGIT_RTOL


def test_from_pretrained_and_from_config_select_sinkattn(pair, tmp_path):
    pair[0].save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME).eval()
    built = transformers.AutoModelForCausalLM.from_config(gpt_oss.config(), attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME and built.config._attn_implementation == NAME
    ids = torch.randint(1, 128, (1, 20))
    with torch.no_grad(), OpCounter() as counter:
        got = loaded(input_ids=ids).logits
    assert len(counter.calls) == 4
    with torch.no_grad():
        assert rel(got, pair[0](input_ids=ids).logits) <= LOGIT_RTOL


def module_with(sinks, training=False):
    cfg = gpt_oss.config()
    attn = transformers.models.gpt_oss.modeling_gpt_oss.GptOssAttention(cfg, 0).train(training)
    attn.sinks = torch.nn.Parameter(sinks)
    return attn


@pytest.mark.parametrize("Sq,Sk,window", [(9, 9, None), (9, 9, 4), (3, 11, None), (3, 11, 4), (1, 11, 4)])
def test_attention_forward_matches_hf_eager_bottom_right(Sq, Sk, window):
    """Direct call: decoding shapes (Sq < Sk), windows, a non-default scaling and fp32 sinks."""
    module = module_with(torch.randn(4) * 2)
    q, k, v = torch.randn(2, 4, Sq, 16), torch.randn(2, 2, Sk, 16), torch.randn(2, 2, Sk, 16)
    i, j = torch.arange(Sq)[:, None] + (Sk - Sq), torch.arange(Sk)[None]
    visible = (j <= i) & ((j > i - window) if window else True)
    additive = torch.zeros(Sq, Sk).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    got, weights = sinkattn.hf.attention_forward(module, q, k, v, None, scaling=0.3, sliding_window=window,
                                                 s_aux=module.sinks)
    assert weights is None and got.shape == (2, Sq, 4, 16)
    assert torch.allclose(got, expected, atol=2e-6, rtol=0)


def _documents(mask, pos):
    """The documents of a batch, written out: per row, the real columns split where the position is 0."""
    docs = []
    for b in range(mask.shape[0]):
        real = [j for j in range(mask.shape[1]) if mask[b, j]]
        for j in real:
            if j == real[0] or (pos is not None and pos[b, j] == 0):
                docs.append((b, []))
            docs[-1][1].append(j)
    return docs


def _layout_case(name):
    """(mask [B, S] or None, position_ids [B, S] or None) of one padding / packing layout."""
    B, S = 3, 11
    mask, pos = torch.ones(B, S, dtype=torch.bool), torch.arange(S).repeat(B, 1)
    if name in ("right+packed", "left+packed", "empty row+packed", "packed"):
        pos[0, 4:], pos[1, 2:], pos[2, 6:] = torch.arange(S - 4), torch.arange(S - 2), torch.arange(S - 6)
        pos[1, 5:] = torch.arange(S - 5)                    # row 1: three documents, of 2, 3 and 6 tokens
    if name == "right+packed":
        mask[0, 9:], mask[2, 8:] = False, False
    if name in ("left+packed", "left"):
        mask[0, :3], mask[1, :1] = False, False
        pos[mask == 0] = 0                                  # pads at position 0 (TRL's padding value)
    if name == "empty row+packed":
        mask[1] = False
    if name == "one token each":
        pos = torch.zeros(B, S, dtype=torch.long)
    return (None if name in ("packed", "one token each") else mask), (None if name == "left" else pos)


@pytest.mark.parametrize("case,backend", [(c, "cpu") for c in ("right+packed", "left+packed", "empty row+packed",
                                                                "packed", "left", "one token each")]
                         + [("left+packed", "triton")])
def test_layouts_eager_and_traced_equal_each_document_alone(case, backend):
    """attention_forward on padding / packing layouts, in eager mode (exact layout, read back) and traced
    with fullgraph=True (the fixed-shape layout, nothing read back: no graph break), against every
    document run alone through sink_attn_func; padded query rows are zeros."""
    torch._dynamo.reset()
    mask, pos = _layout_case(case)
    module = module_with(torch.randn(4) * 2)
    q, k, v = (torch.randn(3, h, 11, 16) for h in (4, 2, 2))
    kwargs = dict(s_aux=module.sinks, sliding_window=3, position_ids=pos, backend=backend)
    eager = sinkattn.hf.attention_forward(module, q, k, v, mask, **kwargs)[0]
    traced = torch.compile(sinkattn.hf.attention_forward, fullgraph=True, backend="eager")(module, q, k, v, mask,
                                                                                             **kwargs)[0]
    expected = torch.zeros_like(eager)
    for b, cols in _documents(mask if mask is not None else torch.ones(3, 11, dtype=torch.bool), pos):
        alone = sinkattn.sink_attn_func(*(x[b:b + 1, :, cols].transpose(1, 2) for x in (q, k, v)), sinks=module.sinks,
                                        causal=True, window_size=(2, 0))
        expected[b, cols] = alone[0]
    for label, got in (("eager", eager), ("traced", traced)):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6, msg=lambda m, label=label: f"{case} {label}: {m}")


def test_padded_query_rows_are_zero_and_fp32_sinks_keep_their_dtype():
    module = module_with(torch.randn(4) * 2)
    q, k, v = (torch.randn(2, h, 10, 16, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :4] = False                                  # left padding
    out, _ = sinkattn.hf.attention_forward(module, q, k, v, mask, s_aux=module.sinks, sliding_window=4)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.equal(out[0, :4], torch.zeros_like(out[0, :4])) and out[0, 4:].abs().max() > 0
    out.float().sum().backward()
    assert module.sinks.grad.dtype == torch.float32 and module.sinks.grad.abs().min() > 0


def test_refuses_dropout_in_training():
    model = gpt_oss.model(gpt_oss.config(attention_dropout=0.1), attn_implementation=NAME).train()
    with pytest.raises(ValueError, match="attention_dropout = 0.0"):
        model(input_ids=torch.randint(1, 128, (1, 8)))
    model.eval()(input_ids=torch.randint(1, 128, (1, 8)))         # dropout is off in eval: runs


def test_refuses_a_4d_mask_other_than_the_causal_pattern(pair):
    """A 4-D mask of the user's reaches the layers as it is: taken only where it is the layer's own pattern
    (additive float 0 / -inf or boolean), refused as a custom mask, a score bias or an integer mask."""
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(1, 1, 8, 8).masked_fill(~causal, -torch.inf)
    assert torch.equal(pair[1](input_ids=ids, attention_mask=additive).logits, pair[1](input_ids=ids).logits)
    with pytest.raises(ValueError, match="not its causal / sliding-window pattern"):
        pair[1](input_ids=ids, attention_mask=torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="values other than 0 and -inf"):
        pair[1](input_ids=ids, attention_mask=additive + 0.5 * causal)
    with pytest.raises(ValueError, match="cannot express a 4-D mask"):
        pair[1](input_ids=ids, attention_mask=causal.long())


def test_refuses_custom_mask_patterns(pair):
    embeds = torch.zeros(1, 8, 64)
    with pytest.raises(ValueError, match="and_mask_function"):
        masking_utils.create_causal_mask(pair[1].config, embeds, None, None,
                                         and_mask_function=lambda b, h, q, kv: kv >= 0)
    with pytest.raises(ValueError, match="block_sequence_ids"):
        masking_utils.create_sliding_window_causal_mask(pair[1].config, embeds, None, None,
                                                        block_sequence_ids=torch.zeros(1, 8, dtype=torch.long))


def test_refuses_a_static_cache_mask_it_cannot_map(pair):
    cache = StaticCache(config=pair[1].config, max_cache_len=32)
    ids = torch.randint(1, 128, (2, 10))
    with torch.no_grad():
        pair[1](input_ids=ids, attention_mask=torch.ones(2, 10, dtype=torch.long), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="covers 1 positions"):
            pair[1](input_ids=ids[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache,
                    use_cache=True)


def test_key_mask_refuses_padding_inside_a_row_with_a_window_eager_and_traced():
    """Eager, key_mask reads the mask once (None when every key is real); traced, it passes the
    mask on unread (fullgraph: no graph break) and the refusal runs in the compiled program."""
    traced = torch.compile(sinkattn.hf.key_mask, fullgraph=True, backend="eager")
    pattern = masking_utils.sliding_window_causal_mask_function(4)
    right = torch.ones(2, 8, dtype=torch.bool)
    assert sinkattn.hf.key_mask(2, 8, 8, 0, 0, pattern, right, local_size=4) is None
    right[1, 5:] = False
    gap = right.clone()
    gap[0, 3] = False
    for key_mask in (sinkattn.hf.key_mask, traced):
        assert torch.equal(key_mask(2, 8, 8, 0, 0, pattern, right, local_size=4), right)
        with pytest.raises(ValueError, match="padding inside a row"):
            key_mask(2, 8, 8, 0, 0, pattern, gap, local_size=4)
        assert torch.equal(key_mask(2, 8, 8, 0, 0, masking_utils.causal_mask_function, gap), gap)  # full attention
    torch.library.opcheck(torch.ops.sinkattn.hf_padding_on_one_side.default, (right,))


def test_full_attention_model_with_padding_inside_a_row_equals_eager(pair):
    """Every layer full attention: only which keys are real matters, so padding between real tokens is
    computed exactly (logits and every gradient, eager and traced); the alternating model, whose
    sliding layers count the window in real tokens, still refuses it."""
    cfg = gpt_oss.config(layer_types=["full_attention"] * 4)          # config.sliding_window stays 8
    eager, ours = gpt_oss.model(cfg), gpt_oss.model(cfg, attn_implementation=NAME)
    ids = torch.randint(1, 128, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[0, 4:9], mask[1, 12:], mask[2, :3], mask[2, 10:12] = 0, 0, 0, 0
    ids[mask == 0] = 0
    call = (dict(input_ids=ids, attention_mask=mask), mask.bool())
    w = weights_for(int(mask.sum()))
    expected = run(eager, w, call)
    assert_close(expected, run(ours, w, call), "full attention, padding inside rows")
    torch._dynamo.reset()
    with torch.no_grad():
        traced = torch.compile(ours, backend="eager", fullgraph=True)(input_ids=ids, attention_mask=mask).logits
    assert rel(traced[mask.bool()], expected[0]) <= LOGIT_RTOL
    with pytest.raises(ValueError, match="padding inside a row"):
        pair[1](input_ids=ids, attention_mask=mask)


def test_key_mask_with_a_static_cache_offset_tensor_eager_and_traced():
    """A StaticCache hands q_offset as a 0-d tensor. Eager, key_mask reads it: the bool mask of the n
    columns. Traced (fullgraph: no graph break at the read), it returns the int8 slot mask made by the
    sinkattn::hf_static_cache_keys op, which raises eager's errors when the compiled program runs."""
    traced = torch.compile(sinkattn.hf.key_mask, fullgraph=True, backend="eager")
    causal, sliding = masking_utils.causal_mask_function, masking_utils.sliding_window_causal_mask_function(4)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :2] = False                                  # left padding; queries: position 6, keys 0..6 of 12 slots
    slots = torch.full((2, 12), -1, dtype=torch.int8)
    slots[:, :7] = mask
    assert torch.equal(sinkattn.hf.key_mask(2, 1, 12, torch.tensor(6), 0, causal, mask), mask)
    assert torch.equal(traced(2, 1, 12, torch.tensor(6), 0, causal, mask), slots)
    assert torch.equal(traced(2, 1, 12, torch.tensor(6), 0, sliding, mask, local_size=4), slots)
    assert torch.equal(traced(1, 1, 12, torch.tensor(6), 0, causal, None), slots[1:])
    gap = mask.clone()
    gap[1, 3] = False
    for key_mask in (sinkattn.hf.key_mask, traced):
        with pytest.raises(ValueError, match="covers 7 positions"):
            key_mask(2, 1, 12, torch.tensor(7), 0, causal, mask)
        with pytest.raises(ValueError, match="cannot map this cache"):
            key_mask(2, 1, 12, torch.tensor(12), 0, causal, None)
        with pytest.raises(ValueError, match="padding inside a row"):
            key_mask(2, 1, 12, torch.tensor(6), 0, sliding, gap, local_size=4)
    torch.library.opcheck(torch.ops.sinkattn.hf_static_cache_keys.default, (mask, torch.tensor(6), 2, 1, 12, 0, False))


@pytest.mark.parametrize("window", [None, 4])
def test_attention_forward_on_a_static_cache_slot_mask_eager_and_traced(window):
    """The int8 slot mask (12 slots, 9 written, the queries the last 3 written) gives what the bool
    mask of the 9 written columns gives, eager and traced with fullgraph=True."""
    module = module_with(torch.randn(4) * 2)
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    real = torch.ones(2, 9, dtype=torch.bool)
    real[0, :4] = False
    slots = torch.full((2, 12), -1, dtype=torch.int8)
    slots[:, :9] = real
    kwargs = dict(s_aux=module.sinks, sliding_window=window)
    expected = sinkattn.hf.attention_forward(module, q, k[:, :, :9], v[:, :, :9], real, **kwargs)[0]
    traced = torch.compile(sinkattn.hf.attention_forward, fullgraph=True, backend="eager")
    for label, fn in (("eager", sinkattn.hf.attention_forward), ("traced", traced)):
        got = fn(module, q, k, v, slots, **kwargs)[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6, msg=lambda m, label=label: f"{label}: {m}")


def test_refuses_attention_weights(pair):
    with pytest.raises(ValueError, match="output_attentions"):
        pair[1](input_ids=torch.randint(1, 128, (1, 8)), output_attentions=True)


def test_refuses_incomplete_flash_kwargs_and_padding_inside_a_row():
    module = module_with(torch.zeros(4))
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="missing"):
        sinkattn.hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    gap = torch.tensor([[True, True, False, True, True, True, True, True]])
    with pytest.raises(ValueError, match="padding inside a row"):
        sinkattn.hf.attention_forward(module, q, k, v, gap, sliding_window=4)
    sinkattn.hf.attention_forward(module, q, k, v, gap)              # full attention: a gap changes nothing


def test_register_refuses_bad_names_and_backends():
    with pytest.raises(ValueError, match="already registered"):
        sinkattn.hf.register("sdpa")
    with pytest.raises(ValueError, match="backend must be one of"):
        sinkattn.hf.register("sinkattn-x", backend="gpu")
    with pytest.raises(ValueError, match="non-empty str"):
        sinkattn.hf.register("")


def test_version_check_names_what_is_missing():
    from sinkattn.hf.registry import missing_features
    assert missing_features(transformers, masking_utils) == []
    old = types.SimpleNamespace(flash_attention_mask=lambda batch_size, cache_position, kv_length: None)
    missing = missing_features(types.SimpleNamespace(), old)
    assert "transformers.AttentionInterface" in missing and "masking_utils.AttentionMaskInterface" in missing
    assert "mask functions called with q_offset / kv_offset" in missing


def test_import_sinkattn_does_not_import_transformers():
    code = "import sys, sinkattn, sinkattn.hf; assert 'transformers' not in sys.modules, 'imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_finetune_example_runs_and_loss_falls():
    script = ROOT / "examples" / "finetune_gpt_oss_packed.py"
    args = ["--steps", "8", "--tokens-per-row", "256", "--documents", "120", "--no-progress"]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "loss fell" in run.stdout and "attention: sinkattn (backend cpu)" in run.stdout
