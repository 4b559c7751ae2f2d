"""A tiny gpt-oss trained one step context-parallel, as ``torchrun`` runs it, for tests/test_hf_cp.py.

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node P -m harness.hf_cp FOLDER

Every rank builds the same seeded model (``config()``: layers alternating sliding window 8 / full,
HQ=12, HKV=6, so that Ulysses splits the heads over P = 2 and 3) and the same packed batch of
``DOCUMENTS`` (lengths that 2P does not divide, longer than the window), then for each of ``RUNS``
(method, layout): ``shard_batch``, forward, loss, backward, and gathers the full result: the
logits of the padded packing (``unshard_varlen``), the loss and every gradient summed over the
group. Then the refusals (every rank raises the same error), and a call on this rank's heads
with the whole sinks under ``head_group=`` (``_head_group``). Given family names, their runs too:
a token classifier (``CLASSIFIERS``, the bidirectional OpenAI privacy filter) on
``classifier_batch()`` with unshifted labels (``shard_batch(shift_labels=False)``), whose
documents need no padding, and that call's shards and refusals (``_unshifted_labels``). Each
rank saves ``FOLDER/rank{r}.pt``; the test compares them with one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

import torch

__all__ = ["config", "DOCUMENTS", "RUNS", "CLASSIFIERS", "batch", "classifier_batch", "family_batch", "family_loss",
           "real_rows", "padded_lengths_for", "serve", "launch", "relative_error"]

DOCUMENTS = (13, 5, 20, 9)
CLASSIFIERS = ("openai_privacy_filter",)     # token classifiers: unshifted labels, documents that need no padding
CLASSIFIER_DOCUMENTS = (12, 4, 20, 8)       # multiples of 2P = 4: shard_batch(shift_labels=False) does not pad
RUNS = (("ring", "zigzag"), ("ulysses", "zigzag"), ("ring", "contiguous"), ("ulysses", "contiguous"))
FAMILY_RUNS = (("ring", "zigzag"), ("ulysses", "zigzag"))


def config():
    from . import gpt_oss
    return gpt_oss.config(num_attention_heads=12, num_key_value_heads=6, head_dim=8)


def batch(seed: int = 0, documents=DOCUMENTS, flash_kwargs: bool = True) -> dict:
    """The packed batch of ``documents`` (lengths) as ``DataCollatorWithFlattening`` makes it: input_ids,
    labels (-100 at each document's first token), position_ids, and the flash kwargs if ``flash_kwargs``."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(1, 128, (n,), generator=g).tolist()} for n in documents]
    return dict(DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(docs))


def classifier_batch(num_labels: int = 5) -> dict:
    """``batch`` of ``CLASSIFIER_DOCUMENTS`` for a token classifier: each token's label its input id modulo
    ``num_labels`` (-100, unlabelled, at each document's first token, as the collator leaves it)."""
    out = batch(documents=CLASSIFIER_DOCUMENTS)
    out["labels"] = torch.where(out["labels"] == -100, -100, out["input_ids"] % num_labels)
    return out


def family_batch(family: str | None) -> dict:
    """The packed batch a family's model runs: ``classifier_batch()`` for ``CLASSIFIERS``, else ``batch()``."""
    return classifier_batch() if family in CLASSIFIERS else batch()


def family_loss(family: str | None, out, labels: torch.Tensor, num_items: int) -> torch.Tensor:
    """The loss of ``out`` as a share of the whole batch's mean: a causal LM's ``out.loss`` (it takes
    ``num_items_in_batch``); for ``CLASSIFIERS`` the cross entropy of the logits summed over ``labels``
    and divided by ``num_items``, since transformers' token-classification head ignores ``num_items_in_batch``
    and means over the tokens it is given."""
    if family not in CLASSIFIERS:
        return out.loss
    logits = out.logits.float().reshape(-1, out.logits.shape[-1])
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum") / num_items


def padded_lengths_for(P: int, layout: str, documents=DOCUMENTS) -> list[int]:
    multiple = 2 * P if layout == "zigzag" else P
    return [-(-n // multiple) * multiple for n in documents]


def real_rows(P: int, layout: str, documents=DOCUMENTS) -> torch.Tensor:
    """int64: the rows of the padded packing that hold the documents' own tokens, in order."""
    rows, start = [], 0
    for n, padded in zip(documents, padded_lengths_for(P, layout, documents)):
        rows.append(torch.arange(start, start + n))
        start += padded
    return torch.cat(rows)


def model(attn_implementation: str, family: str | None = None):
    """The seeded model every rank and the one-process reference build, in training mode: the gpt-oss of
    ``config()``, or ``family``'s tiny model (``harness.families``)."""
    from . import families, gpt_oss

    if family is None:
        return gpt_oss.model(config(), attn_implementation=attn_implementation).train()
    return families.model(family, attn_implementation=attn_implementation).train()


def _run(method: str, layout: str, family: str | None = None) -> dict:
    import torch.distributed as dist

    import sinkattn.distributed as cp
    import sinkattn.hf

    name = sinkattn.hf.register(f"sinkattn_cp_{method}_{layout}",
                                context_parallel=sinkattn.hf.ContextParallel(None, method, layout))
    model_ = model(name, family)
    local = sinkattn.hf.shard_batch(family_batch(family), layout=layout, shift_labels=family not in CLASSIFIERS)
    out = model_(**local)
    loss = family_loss(family, out, local["labels"], local["num_items_in_batch"])
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    for n, p in model_.named_parameters():
        if p.grad is None:
            continue
        grads[n] = p.grad.clone()
        dist.all_reduce(grads[n])
    logits = cp.unshard_varlen(out.logits[0].detach().contiguous(), local["cu_seq_lens_q"], layout=layout)
    return dict(loss=loss, logits=logits, grads=grads, local_tokens=local["input_ids"].shape[1])


def _raised_or(fn, *args):
    """``fn(*args)``, or ``(type name, message)`` of what it raised."""
    try:
        return fn(*args)
    except Exception as exc:      # noqa: BLE001 - recorded for the test
        return type(exc).__name__, str(exc)


def _raised(fn) -> tuple[str, str] | None:
    """``(type name, message)`` of what ``fn()`` raised, or None when it returned."""
    return _raised_or(_called, fn)


def _called(fn) -> None:
    fn()


def _refusals() -> dict:
    """The errors each rank raised: position_ids of the rank's tokens on rank 0 only (the others
    pass ``arange``), and a padding mask."""
    import torch.distributed as dist

    import sinkattn.hf
    from . import gpt_oss

    name = sinkattn.hf.register("sinkattn_cp_refusals", context_parallel=sinkattn.hf.ContextParallel())
    model = gpt_oss.model(config(), attn_implementation=name)
    local = sinkattn.hf.shard_batch(batch())
    wrong = local["position_ids"] if dist.get_rank() == 0 else torch.arange(local["input_ids"].shape[1])[None]
    padding = torch.ones_like(local["input_ids"]).index_fill_(1, torch.tensor([0]), 0)
    return {"positions not sharded": _raised(lambda: model(**dict(local, position_ids=wrong))),
            "padding mask": _raised(lambda: model(**local, attention_mask=padding))}


def _head_group() -> dict:
    """Rank r calls the attention function with query heads r*HQ/P .. (r+1)*HQ/P - 1 (and their KV
    heads) of a full sequence and the whole sinks ``[HQ]``, as a head-splitting wrapper does, under
    a name registered with ``head_group=``: its output and the sinks' gradient, and those of one
    call on every head."""
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import sinkattn.hf
    from . import gpt_oss

    P, rank = dist.get_world_size(), dist.get_rank()
    name = sinkattn.hf.register("sinkattn_head_group", head_group=dist.group.WORLD)
    module = gpt_oss.model(config(), attn_implementation=name).model.layers[0].self_attn
    HQ, HKV = module.config.num_attention_heads, module.config.num_key_value_heads
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 24, 8, generator=g) for h in (HQ, HKV, HKV))
    dout = torch.randn(1, 24, HQ, 8, generator=g)
    options = dict(scaling=module.scaling, sliding_window=module.sliding_window)
    every = torch.nn.Parameter(module.sinks.detach().clone())
    full, _ = sinkattn.hf.attention_forward(module, q, k, v, None, s_aux=every, **options)
    (full * dout).sum().backward()
    mine = torch.nn.Parameter(module.sinks.detach().clone())
    heads, kv = (slice(rank * h // P, (rank + 1) * h // P) for h in (HQ, HKV))
    part, _ = ALL_ATTENTION_FUNCTIONS[name](module, q[:, heads], k[:, kv], v[:, kv], None, s_aux=mine, **options)
    (part * dout[:, :, heads]).sum().backward()
    return dict(full=full.detach()[:, :, heads], part=part.detach(), dsinks_full=every.grad, dsinks_part=mine.grad,
                heads=(heads.start, heads.stop))


def _unshifted_labels() -> dict:
    """``shard_batch(shift_labels=False)`` of ``classifier_batch()``: this rank's input ids, positions,
    labels, the keys returned and ``num_items_in_batch``; then what it raises for documents that would
    need padding, a ``shift_labels`` that is not a bool, and a batch without labels."""
    import sinkattn.hf

    local = sinkattn.hf.shard_batch(classifier_batch(), shift_labels=False)
    unlabelled = {k: v for k, v in classifier_batch().items() if k != "labels"}
    return dict(keys=sorted(local), input_ids=local["input_ids"], position_ids=local["position_ids"],
                labels=local["labels"], num_items=local["num_items_in_batch"],
                refusals={"padding": _raised(lambda: sinkattn.hf.shard_batch(batch(), shift_labels=False)),
                          "not a bool": _raised(lambda: sinkattn.hf.shard_batch(batch(), shift_labels=0)),
                          "no labels": _raised(lambda: sinkattn.hf.shard_batch(unlabelled, shift_labels=False))})


def serve(folder: str, init, steps) -> None:
    """A rank's whole run: ``init()`` joins the group, then ``steps`` (``(key, fn)`` pairs) fill
    ``results[key] = fn()`` until one raises (its traceback kept as ``results["failure"]``); the results go
    to ``folder/rank{r}.pt`` and the group is destroyed."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    init()
    results: dict = {"failure": None, "world_size": dist.get_world_size()}
    try:
        for key, step in steps:
            results[key] = step()
    except Exception:             # noqa: BLE001 - reported to the test process
        results["failure"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


def launch(P: int, folder, module: str = "harness.hf_cp", timeout: float = 600.0, args=()) -> list[dict]:
    """``python -m torch.distributed.run --standalone --nproc-per-node P -m module folder *args`` (what
    ``torchrun`` runs); every rank's results. RuntimeError with the output's tail if it fails or a rank
    reports a failure. The ranks find ``harness`` through ``PYTHONPATH`` (``harness.environment``)."""
    from . import environment

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(P),
               "-m", module, str(folder), *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment())
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {run.returncode}:\n{run.stdout[-2000:]}{run.stderr[-4000:]}")
    results = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(P)]
    for r, res in enumerate(results):
        if res["failure"] is not None or res["world_size"] != P:
            raise RuntimeError(f"rank {r} of {P} ({res['world_size']}) failed:\n{res['failure']}")
    return results


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def main(folder: str, families: list[str]) -> None:
    """gpt-oss's ``RUNS``, refusals and head-group call; then, given ``families``, each family's ``FAMILY_RUNS``
    (each run's result, or the error it raised on every rank, under ``results["families"]``) and
    ``_unshifted_labels``."""
    import torch.distributed as dist

    steps = [("runs", lambda: {run: _run(*run) for run in RUNS}), ("refusals", _refusals), ("head_group", _head_group)]
    if families:
        steps.append(("families", lambda: {(f, *run): _raised_or(_run, *run, f) for f in families
                                           for run in FAMILY_RUNS}))
        steps.append(("unshifted_labels", _unshifted_labels))
    serve(folder, lambda: dist.init_process_group("gloo"), steps)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
