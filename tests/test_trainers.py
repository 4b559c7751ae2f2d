"""sinkattn under the trainers people fine-tune gpt-oss with, end to end on CPU: TRL's SFTTrainer with
its defaults (packing, bf16 autocast, gradient checkpointing), HF Trainer with DataCollatorWithFlattening,
PEFT LoRA with trainable sinks, and DDP over gloo. Tiny gpt-oss models from a config, datasets built in
memory, a word-level tokenizer made here (harness.training): nothing from a hub.

Packed rows are compared with each of their sequences run alone through eager attention (eager
attends across a packed row). The trainers run under bf16 autocast, where eager itself is off the
fp32 result by bf16 rounding; sinkattn's error against the fp32 eager golden must be at most twice
eager bf16's (the flash-attn rule for low precision), and the same batch in fp32 within 2e-5 of the
logit scale, as in tests/test_hf.py.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.4")
trl = pytest.importorskip("trl", minversion="1.16")

import sinkattn.hf  # noqa: E402
from harness import gpt_oss, training  # noqa: E402

NAME = sinkattn.hf.register()
LOGIT_RTOL = 2e-5


def rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def sinks_of(model):
    return [p.detach().clone() for n, p in model.named_parameters() if n.endswith("self_attn.sinks")]


def eager_alone(ids, spans, autocast: bool):
    """Logits ``[T, V]`` of a packed row ``ids [1, T]``, each sequence run alone through eager (initial weights)."""
    model = gpt_oss.model()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        return torch.cat([model(input_ids=ids[:, a:b]).logits[0].float() for a, b in spans])


def assert_bf16_within_twice_eager(ours, golden, eager_bf16, label):
    err_ours = (ours - golden).abs().max().item()
    err_eager = (eager_bf16 - golden).abs().max().item()
    assert 0 < err_ours <= 2 * err_eager, f"{label}: sinkattn bf16 err {err_ours:.3g}, eager bf16 err {err_eager:.3g}"


def test_trl_sft_packed_with_its_defaults_equals_each_sequence_alone_and_trains(tmp_path):
    from trl import SFTConfig, SFTTrainer

    model = gpt_oss.model(attn_implementation=NAME).train()
    args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=96, per_device_train_batch_size=2,
                     max_steps=3, learning_rate=1e-3, use_cpu=True, report_to="none", logging_steps=1,
                     save_strategy="no", disable_tqdm=True, seed=0)
    assert args.bf16 and args.gradient_checkpointing and args.packing_strategy == "bfd"      # TRL's defaults
    dataset = training.text_dataset(torch.randint(5, 40, (16,), generator=torch.Generator().manual_seed(0)).tolist())
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=training.tokenizer())
    first, before = training.FirstCall(model), sinks_of(model)
    trainer.train()

    batch = first.kwargs                                   # what TRL handed the model: padding-free, packed
    assert {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= batch.keys()
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    spans = training.sequences(batch)
    assert len(spans) >= 3

    # the training forward itself (bf16 autocast, TRL's fused LM head): log-probs of the next tokens
    labels = batch["labels"][0, 1:]
    scored = labels != -100
    ours = first.output.log_probs[0][scored].float()

    def log_probs(logits):
        return logits[:-1].log_softmax(-1)[scored].gather(-1, labels[scored, None])[:, 0]

    golden, eager_bf16 = (log_probs(eager_alone(batch["input_ids"], spans, autocast)) for autocast in (False, True))
    assert_bf16_within_twice_eager(ours, golden, eager_bf16, "TRL packed step")

    # the same batch, TRL's keyword arguments included, in fp32 through the initial weights
    fp32 = {k: v for k, v in batch.items() if k not in ("fused_lm_head", "labels", "num_items_in_batch")}
    with torch.no_grad():
        logits = gpt_oss.model(attn_implementation=NAME)(**fp32).logits[0]
    golden_logits = eager_alone(batch["input_ids"], spans, False)
    assert rel(logits, golden_logits) <= LOGIT_RTOL

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    for b, a in zip(before, sinks_of(model)):
        assert a.dtype == torch.float32 and not torch.equal(a, b), "every layer's sinks must train"


def test_hf_trainer_with_data_collator_with_flattening_in_bf16(tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = gpt_oss.model(attn_implementation=NAME).train()
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, per_device_train_batch_size=4,
                             max_steps=3, learning_rate=1e-3, report_to="none", logging_steps=1, save_strategy="no",
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=training.token_dataset([23, 9, 31, 17, 12, 40, 5, 28]),
                      data_collator=DataCollatorWithFlattening())
    first, before = training.FirstCall(model), sinks_of(model)
    trainer.train()

    batch = first.kwargs                                   # one row, sequences marked by position_ids only
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch and "cu_seq_lens_q" not in batch
    spans = training.sequences(batch)
    assert len(spans) == 4
    golden, eager_bf16 = (eager_alone(batch["input_ids"], spans, autocast) for autocast in (False, True))
    assert_bf16_within_twice_eager(first.output.logits[0].float(), golden, eager_bf16, "Trainer packed step")

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(a, b) for a, b in zip(before, sinks_of(model)))


def lora_with_trainable_sinks(attn_implementation):
    """What a user writes: LoRA on the attention projections, the sinks (a plain parameter, not a module)
    set trainable by hand."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt_oss.model(attn_implementation=attn_implementation),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if name.endswith("self_attn.sinks"):
            p.requires_grad_(True)
    return model


def test_peft_lora_with_trainable_sinks_and_gradient_checkpointing(tmp_path):
    pytest.importorskip("peft", minversion="0.21")
    from trl import SFTConfig, SFTTrainer

    # the gradients first: a packed row under checkpointing (recomputed forward) against each sequence alone
    ours, eager = lora_with_trainable_sinks(NAME), lora_with_trainable_sinks("eager")
    batch = training.collate_packed(training.token_dataset([21, 8, 30])["input_ids"])
    alone = [dict(input_ids=batch["input_ids"][:, a:b], labels=batch["labels"][:, a:b])
             for a, b in training.sequences(batch)]
    grads = []
    for model, calls in ((ours, [batch]), (eager, alone)):    # loss summed over the scored tokens
        model.train()
        model.gradient_checkpointing_enable()
        sum(model(**c).loss * c["labels"][:, 1:].ne(-100).sum() for c in calls).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and sum(n.endswith("sinks") for n in grads[0]) == 4
    for name, g in grads[1].items():
        if "lora_A" in name:                                # B starts at zero: A gets none yet
            assert not grads[0][name].any() and not g.any()
            continue
        assert g.abs().max() > 0 and rel(grads[0][name], g) <= 1e-4, name

    # then training with TRL's defaults (bf16, gradient checkpointing, packing)
    model = lora_with_trainable_sinks(NAME)
    args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=96, per_device_train_batch_size=2,
                     max_steps=3, learning_rate=1e-2, use_cpu=True, report_to="none", logging_steps=1,
                     save_strategy="no", disable_tqdm=True, seed=0)
    dataset = training.text_dataset(torch.randint(5, 40, (16,), generator=torch.Generator().manual_seed(1)).tolist())
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=training.tokenizer())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    after = dict(model.named_parameters())
    trained = {n for n in before if not torch.equal(before[n], after[n])}
    assert {n for n in before if n.endswith("self_attn.sinks") or "lora_B" in n} <= trained
    assert all("lora_" in n or n.endswith("self_attn.sinks") for n in trained), trained   # the base stays frozen
    assert all(after[n].dtype == torch.float32 for n in trained)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_ddp_two_ranks_on_gloo_equal_one_process_on_the_global_batch(tmp_path):
    import ddp_trainer

    script = Path(__file__).with_name("ddp_trainer.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path / "ddp.pt")], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    ddp_trainer.main(str(tmp_path / "single.pt"))
    ddp, single = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "single.pt")
    assert ddp.keys() == single.keys()
    for name, step in single.items():
        assert rel(ddp[name], step) <= 1e-4 if step.any() else not ddp[name].any(), name
    assert all(single[n].any() for n in single if n.endswith("self_attn.sinks"))


def test_sft_trl_packed_example_runs_and_loss_falls():
    script = Path(__file__).resolve().parents[1] / "examples" / "sft_trl_packed.py"
    run = subprocess.run([sys.executable, str(script), "--steps", "5", "--max-length", "128", "--documents", "60"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "packing=True (bfd), bf16=True, gradient_checkpointing=True" in run.stdout
    assert "cu_seq_lens_q" in run.stdout and "loss fell" in run.stdout
