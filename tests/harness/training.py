"""What the trainer tests and the TRL benchmark feed Hugging Face's trainers: a word-level tokenizer
built in memory, in-memory datasets of random documents, the first batch a trainer hands its model,
and the packed rows split back into their sequences. Nothing is downloaded.
"""

from __future__ import annotations

import torch

__all__ = ["tokenizer", "text_dataset", "token_dataset", "collate_packed", "FirstCall", "sequences"]

PAD, EOS = 0, 1
"""Token ids of ``<pad>`` and ``<eos>``; words ``w2 .. w{vocab-1}`` are the other ids."""


def tokenizer(vocab_size: int = 128):
    """A ``PreTrainedTokenizerFast`` over the words ``w2 .. w{vocab_size - 1}`` (whitespace split),
    ``<pad>`` = 0, ``<eos>`` = 1: what ``SFTTrainer`` needs as ``processing_class``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def _documents(lengths, vocab_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lengths]


def text_dataset(lengths, vocab_size: int = 128, seed: int = 0):
    """``datasets.Dataset`` with a ``text`` column: one document of ``n`` random words per length."""
    from datasets import Dataset

    docs = _documents(lengths, vocab_size, seed)
    return Dataset.from_dict({"text": [" ".join(f"w{i}" for i in ids) for ids in docs]})


def token_dataset(lengths, vocab_size: int = 128, seed: int = 0):
    """``datasets.Dataset`` with an ``input_ids`` column (already tokenized documents)."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": _documents(lengths, vocab_size, seed)})


def collate_packed(documents) -> dict:
    """Token id lists packed into one row by ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``:
    ``input_ids``, ``labels`` (-100 at each sequence start), ``position_ids``, ``cu_seq_lens_q/k``,
    ``max_length_q/k``."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": ids} for ids in documents])


class FirstCall:
    """Records the keyword arguments and the output of a module's first call (forward hooks)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.kwargs: dict | None = None
        self.output = None
        self._hooks = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                       module.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        if self.kwargs is None:
            self.kwargs = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}

    def _post(self, module, args, kwargs, output):
        if self.output is None:
            self.output = output
        for hook in self._hooks:
            hook.remove()


def sequences(batch: dict) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the sequences of a packed row ``[1, T]``: from ``cu_seq_lens_q`` when given,
    else from ``position_ids`` restarting at 0."""
    if batch.get("cu_seq_lens_q") is not None:
        cu = batch["cu_seq_lens_q"].reshape(-1).tolist()
    else:
        pos = batch["position_ids"].reshape(-1)
        cu = [*torch.nonzero(pos == 0).flatten().tolist(), pos.numel()]
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]
