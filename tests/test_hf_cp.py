"""Context parallelism inside a Hugging Face gpt-oss (``register(..., context_parallel=)``, ``shard_batch``),
launched as a user launches it: ``torchrun --nproc-per-node P`` (``python -m torch.distributed.run``), P = 2 and 3,
gloo on CPU, fp32. Every rank's loss, logits and every parameter gradient (sinks included), gathered and summed
over the group, against one process running the unpadded packed batch through ``attn_implementation="sinkattn"``.
The other sink families (``harness.families``) at P = 2, ring and Ulysses, in the P = 2 launch: the causal
decoders, and the bidirectional token classifier with unshifted labels (``shard_batch(shift_labels=False)``).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.4")

import sinkattn.hf  # noqa: E402
from sinkattn.hf import heads  # noqa: E402
from sinkattn.backends import cpu_small  # noqa: E402
from harness import gpt_oss, hf_cp  # noqa: E402
from harness.hf_cp import relative_error as rel  # noqa: E402

# pytest -n: one worker runs the whole module, whose module-scoped fixture launches processes
pytestmark = pytest.mark.xdist_group("test_hf_cp")

NAME = sinkattn.hf.register()
RTOL = 1e-5


# causal / sliding decoders, and a bidirectional sliding-window token classifier (unshifted labels)
CP_FAMILIES = ("mimo_v2_flash", "granite_swa", "granitemoe_swa", "flint", "openai_privacy_filter")


@pytest.fixture(scope="module", params=(2, 3), ids=lambda P: f"P{P}")
def launched(request, tmp_path_factory):
    """One torchrun launch per P; at P = 2 it also runs each of ``CP_FAMILIES`` and HY-V4 (``FAMILY_RUNS``)."""
    P = request.param
    return P, hf_cp.launch(P, tmp_path_factory.mktemp(f"hf-cp{P}"), args=(*CP_FAMILIES, "hy_v4") if P == 2 else ())


@pytest.fixture(scope="module")
def families_launched(launched):
    P, results = launched
    if P != 2:
        pytest.skip("the other families run in the P = 2 launch only")
    return results


@pytest.fixture(scope="module")
def one_process():
    """Loss, logits ``[T, V]`` and gradients of the unpadded packed batch in one process."""
    model = gpt_oss.model(hf_cp.config(), attn_implementation=NAME).train()
    out = model(**hf_cp.batch())
    out.loss.backward()
    return dict(loss=out.loss.detach(), logits=out.logits[0].detach(),
                grads={n: p.grad.clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("run", hf_cp.RUNS, ids=lambda r: "-".join(r))
def test_loss_logits_and_every_gradient_match_one_process(launched, one_process, run):
    P, results = launched
    method, layout = run
    want = one_process
    sinks = [n for n in want["grads"] if n.endswith("self_attn.sinks")]
    assert len(sinks) == 4 and all(want["grads"][n].abs().min() > 0 for n in sinks)
    padded = hf_cp.padded_lengths_for(P, layout)
    assert any(p != n for p, n in zip(padded, hf_cp.DOCUMENTS)), "the documents must need padding"
    first = results[0]["runs"][run]
    for r, res in enumerate(results):
        got = res["runs"][run]
        assert got["local_tokens"] == sum(padded) // P
        for name in ("loss", "logits"):          # summed / gathered: the same on every rank
            assert torch.equal(got[name], first[name]), (r, name)
        assert all(torch.equal(got["grads"][n], first["grads"][n]) for n in want["grads"]), r
    assert first["logits"].shape[0] == sum(padded)
    assert rel(first["loss"], want["loss"]) <= RTOL, f"{run} P={P}: loss {first['loss']} vs {want['loss']}"
    logits = first["logits"][hf_cp.real_rows(P, layout)]
    assert rel(logits, want["logits"]) <= RTOL, f"{run} P={P}: logits rel err {rel(logits, want['logits']):.2e}"
    assert first["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        assert g.abs().max() > 0, name
        err = rel(first["grads"][name], g)
        assert err <= RTOL, f"{run} P={P}: grad {name} rel err {err:.2e}"
    assert all(first["grads"][n].abs().min() > 0 for n in sinks)


def test_refusals_are_raised_on_every_rank(launched):
    """position_ids that are the rank's tokens' on rank 0 only, and a padding mask: the same ValueError on every
    rank (none waits in a collective), naming the rank that refused and what to do."""
    P, results = launched
    texts = {"positions not sharded": f"rank 1 of {P} rejected its inputs: sinkattn.hf context parallelism: "
                                      f"position_ids on rank 1 are not the positions of its tokens",
             "padding mask": "context parallelism takes no padding mask: pad whole documents instead"}
    for which, text in texts.items():
        raised = [res["refusals"][which] for res in results]
        assert all(e == raised[0] for e in raised), raised
        assert raised[0][0] == "ValueError" and text in raised[0][1], raised[0]


def test_head_group_cuts_the_sinks_to_the_ranks_heads(launched):
    """A call with rank r's query heads r*HQ/P .. and the whole sinks [HQ], under ``head_group=``: the output of
    those heads in the call on every head, and the sinks' gradient in those heads only."""
    P, results = launched
    HQ = hf_cp.config().num_attention_heads
    for r, res in enumerate(results):
        got = res["head_group"]
        lo, hi = got["heads"]
        assert (lo, hi) == (r * HQ // P, (r + 1) * HQ // P)
        assert rel(got["part"], got["full"]) <= RTOL
        assert torch.equal(got["dsinks_part"][:lo], torch.zeros(lo)) and not got["dsinks_part"][hi:].any()
        assert rel(got["dsinks_part"][lo:hi], got["dsinks_full"][lo:hi]) <= RTOL
        assert got["dsinks_part"][lo:hi].abs().min() > 0


def test_sinks_longer_than_the_heads_without_a_head_group_are_refused():
    module = gpt_oss.model(hf_cp.config(), attn_implementation=NAME).model.layers[0].self_attn
    q = torch.randn(1, 6, 8, 8)
    with pytest.raises(ValueError, match=r"sinks \(s_aux\) have 12 heads but the attention call got 6 query heads.*"
                                         r"head_group=group"):
        sinkattn.hf.attention_forward(module, q, q, q, None, s_aux=module.sinks)
    with pytest.raises(ValueError, match="12 is not a multiple of 5"):
        sinkattn.hf.attention_forward(module, q[:, :5], q, q, None, s_aux=module.sinks)
    assert heads.deepspeed_group() is None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        sinkattn.hf.ContextParallel(method="tree")
    with pytest.raises(ValueError, match="layout must be one of"):
        sinkattn.hf.ContextParallel(layout="diagonal")
    with pytest.raises(TypeError, match="context_parallel must be a sinkattn.hf.ContextParallel"):
        sinkattn.hf.register("sinkattn_cp_bad", context_parallel="ring")
    with pytest.raises(RuntimeError, match="init_process_group"):
        sinkattn.hf.shard_batch(hf_cp.batch())


@pytest.mark.parametrize("run", hf_cp.FAMILY_RUNS, ids=lambda r: "-".join(r))
@pytest.mark.parametrize("family", CP_FAMILIES)
def test_other_families_match_one_process(families_launched, family, run):
    """MiMo-V2-Flash (Dv != D, one KV head, sinks on the sliding layer only), Granite-SWA and
    GraniteMoE-SWA (attention_multiplier scale), Flint, and the OpenAI privacy filter (bidirectional
    window, token classifier: unshifted labels, loss from the logits over the global labelled count):
    loss, logits and every gradient within 1e-5 of one process, or, for a gradient that moves more than
    that with the summation order alone, within three times what the cpu backend's other path (the
    PyTorch-op tiles for every sequence: ``SINKATTN_CPU_KERNEL=python``, no short path) moves it in one
    process (the privacy filter's router bias: 6e-6 there). (DeepSeek-V4 matches too but for its
    hyper-connection head scalars, whose fp32 gradients move by up to 1e-3 with the summation order alone:
    docs/hf.md.)"""
    def one_process():
        model = hf_cp.model(NAME, family)
        batch = hf_cp.family_batch(family)
        out = model(**batch)
        loss = hf_cp.family_loss(family, out, batch["labels"], int((batch["labels"] != -100).sum()))
        loss.backward()
        return out, loss, batch, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    out, loss, batch, want = one_process()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SINKATTN_CPU_KERNEL", "python")
        patch.setattr(cpu_small, "SHORT_LENGTH", 0)          # short sequences too: every sequence on the tiles
        other = one_process()[3]
    noise = {n: rel(other[n], g) for n, g in want.items()}
    assert max(noise.values()) < 1e-5
    got = families_launched[0]["families"][(family, *run)]
    assert not isinstance(got, tuple), got
    assert all(torch.equal(res["families"][(family, *run)]["logits"], got["logits"]) for res in families_launched)
    assert rel(got["loss"], loss.detach()) <= RTOL, f"loss {got['loss']} vs {loss}"
    documents = hf_cp.CLASSIFIER_DOCUMENTS if family in hf_cp.CLASSIFIERS else hf_cp.DOCUMENTS
    logits = got["logits"][hf_cp.real_rows(2, run[1], documents)]
    assert rel(logits, out.logits[0].detach()) <= RTOL, f"logits rel err {rel(logits, out.logits[0].detach()):.2e}"
    sinks = [n for n in want if n.endswith("self_attn.sinks")]
    assert got["grads"].keys() == want.keys() and sinks and all(want[n].abs().min() > 0 for n in sinks)
    for name, g in want.items():
        err = rel(got["grads"][name], g)
        assert err <= max(RTOL, 3 * noise[name]), f"grad {name} rel err {err:.2e} (summation noise {noise[name]:.2e})"


def test_unshifted_labels_stay_with_their_tokens(families_launched):
    """shard_batch(shift_labels=False) at P = 2: each rank's labels are those of its own tokens (the
    classifier batch labels token t with input id % 5, -100 at a document's first token), no
    ``shift_labels`` key, ``num_items_in_batch`` the labelled tokens of the whole batch; documents that
    would need padding (which a bidirectional layer would attend to), a non-bool ``shift_labels`` and a
    batch without labels are refused on every rank."""
    full = hf_cp.classifier_batch()
    tokens = 0
    for res in families_launched:
        got = res["unshifted_labels"]
        assert "shift_labels" not in got["keys"] and "labels" in got["keys"]
        ids, positions, labels = got["input_ids"][0], got["position_ids"][0], got["labels"][0]
        assert torch.equal(labels, torch.where(positions == 0, -100, ids % 5))
        assert got["num_items"] == int((full["labels"] != -100).sum())
        tokens += ids.numel()
    assert tokens == sum(hf_cp.CLASSIFIER_DOCUMENTS)
    refusals = [res["unshifted_labels"]["refusals"] for res in families_launched]
    assert all(r == refusals[0] for r in refusals), refusals
    texts = {"padding": ("ValueError", "every document's length must be a multiple of 4 (layout='zigzag', P=2), "
                                       "got [13, 5, 9]"),
             "not a bool": ("TypeError", "shift_labels must be a bool"),
             "no labels": ("ValueError", "shard_batch(shift_labels=False) takes the batch's labels")}
    for which, (kind, text) in texts.items():
        assert refusals[0][which][0] == kind and text in refusals[0][which][1], refusals[0][which]


def test_an_indexed_attention_layer_is_refused_on_every_rank(families_launched):
    raised = [res["families"][("hy_v4", *run)] for res in families_launched for run in hf_cp.FAMILY_RUNS]
    assert all(e == raised[0] for e in raised), raised
    assert raised[0][0] == "ValueError" and "cannot run an indexed-attention layer" in raised[0][1], raised[0]


def test_padded_lengths():
    from sinkattn.hf.shard import padded_lengths
    assert padded_lengths([13, 5, 20, 9, 0], 4) == [16, 8, 20, 12, 0]
    assert padded_lengths([13, 5, 20, 9], 6) == [18, 6, 24, 12]
