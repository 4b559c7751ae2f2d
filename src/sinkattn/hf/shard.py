"""``shard_batch``: this rank's part of a packed Hugging Face batch, for a context-parallel model.

Context parallelism cuts every document into chunks (``2P`` for the zigzag layout, ``P`` for
contiguous), so each document's length must divide by that number. ``shard_batch`` pads each
document at its end to the next multiple, with ``pad_token_id`` at positions continuing the
document's; causal attention keeps those tokens out of every real token's view, and their labels
are -100, so logits and loss of the real tokens are those of the unpadded batch.

Labels come back shifted (``shift_labels``, the label of token t is the next token of its
document's labels; the last token of every document and every pad get -100), because a shard's
tokens are not consecutive and the model cannot shift them itself. ``labels`` holds the same
tensor (transformers computes a loss only when ``labels`` is given and then uses
``shift_labels``), and ``num_items_in_batch`` the GLOBAL number of labelled tokens, so that each
rank's loss is its tokens' share of the mean over the whole batch: their sum over the group is
the single-process loss, and summing the gradients over the group gives its gradients.

A token classifier (``shift_labels=False``, e.g. the OpenAI privacy filter) gets each token's own
label instead, and no ``shift_labels``. Its layers are bidirectional: a real token would attend to
padding after it, so then nothing is padded and every document's length must already divide by
2P (``zigzag``) or P (``contiguous``) (ValueError otherwise). Transformers' token-classification
head means its loss over the rank's own tokens and ignores ``num_items_in_batch``: take the loss
as the cross entropy of the logits summed over the labelled tokens, divided by
``num_items_in_batch``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import distributed
from ..distributed import group as groups
from ..distributed.layout import check_layout, chunks_per_sequence
from .layout import FLASH_KWARGS

__all__ = ["shard_batch", "padded_lengths"]

IGNORE = -100
_ACCEPTED = ("input_ids", "labels", "position_ids", "attention_mask", "seq_idx", *FLASH_KWARGS)


def padded_lengths(lengths: list[int], multiple: int) -> list[int]:
    """Each length rounded up to a multiple of ``multiple`` (0 stays 0)."""
    return [-(-n // multiple) * multiple for n in lengths]


def _tensor(batch: Mapping, key: str, shape) -> torch.Tensor | None:
    x = batch.get(key)
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"batch[{key!r}] must be a torch.Tensor (return_tensors='pt'), got {type(x).__name__}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"batch[{key!r}] must have the shape of input_ids {tuple(shape)}, got {tuple(x.shape)}")
    return x


def _document_lengths(batch: Mapping, ids: torch.Tensor) -> list[int]:
    """The documents of the flattened batch: ``cu_seq_lens_q`` if given (one row), else the rows
    split where ``position_ids`` restart at 0, else one document per row."""
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        offsets = torch.as_tensor(cu).reshape(-1).tolist()
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"batch['cu_seq_lens_q'] describes one flattened row, but input_ids has {ids.shape[0]} "
                             f"rows")
        if not offsets or offsets[0] != 0 or offsets[-1] != ids.numel() or any(
                b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"batch['cu_seq_lens_q'] must rise from 0 to the {ids.numel()} tokens of input_ids, got "
                             f"{offsets[:8]}{'...' if len(offsets) > 8 else ''}")
        return [b - a for a, b in zip(offsets, offsets[1:])]
    rows = ids.reshape(-1, ids.shape[-1])
    starts = torch.zeros(rows.shape, dtype=torch.bool, device=ids.device)
    starts[:, 0] = True
    positions = _tensor(batch, "position_ids", None)
    if positions is not None:
        if positions.numel() != ids.numel():
            raise ValueError(f"batch['position_ids'] must have one position per token of input_ids "
                             f"{tuple(ids.shape)}, got {tuple(positions.shape)}")
        starts |= positions.reshape(rows.shape) == 0
    at = torch.nonzero(starts.reshape(-1)).reshape(-1).tolist() + [ids.numel()]
    return [b - a for a, b in zip(at, at[1:])]


def _padded(ids: torch.Tensor, labels: torch.Tensor, lengths: list[int], multiple: int, pad_token_id: int,
            shift: bool = True):
    """Flat ``ids``/``labels [T]`` of documents ``lengths`` -> padded ``[T', 3]`` rows of (input id,
    position, label: the next token's if ``shift``, else the token's own) and the padded lengths."""
    padded = padded_lengths(lengths, multiple)
    n, p = (torch.tensor(x, dtype=torch.int64, device=ids.device) for x in (lengths, padded))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), p)
    offset = torch.arange(int(p.sum()), device=ids.device) - torch.repeat_interleave(torch.cumsum(p, 0) - p, p)
    source = (torch.cumsum(n, 0) - n)[doc] + offset
    last = max(ids.numel() - 1, 0)
    ids_out = torch.where(offset < n[doc], ids[source.clamp(max=last)], pad_token_id)
    step = int(shift)
    label = torch.where(offset + step < n[doc], labels[(source + step).clamp(max=last)], IGNORE)
    return torch.stack([ids_out, offset, label], 1), padded


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def shard_batch(batch: Mapping, group=None, layout: str = "zigzag", pad_token_id: int = 0,
                shift_labels: bool = True) -> dict:
    """This rank's part of ``batch`` for a model registered with ``context_parallel=``.

    Called by every rank of ``group`` (None: the default group) with the same full batch (checked:
    the packing and a checksum of the tokens are compared, in small collectives). ``batch``: a
    mapping with ``input_ids`` ``[B, S]`` (or ``[S]``) and optionally ``labels`` (same shape,
    unshifted as transformers takes them; default: the input ids), the documents as
    ``cu_seq_lens_q`` (one row, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    gives them), else as ``position_ids`` restarting at 0, else one per row; an ``attention_mask``
    only if it is all ones, and ``cu_seq_lens_k``, ``max_length_q/k``, ``seq_idx`` (redone here).

    Each document is padded at its end to a multiple of 2P (``zigzag``) or P (``contiguous``)
    with ``pad_token_id``. ``shift_labels`` (a bool): True for a causal LM; False for token
    classification: ``batch['labels']`` required, each token keeps its own label, and no document
    is padded (a bidirectional layer would see the padding; ValueError unless every length is a
    multiple already). Returns, with ``P`` ranks and ``T'`` padded tokens in all:

        input_ids, position_ids   int64 [1, T'/P]   this rank's tokens and their true positions
        labels, shift_labels      int64 [1, T'/P]   shifted labels (-100: last token of a document, padding);
                                                    shift_labels=False: each token's own label, no shift_labels
        cu_seq_lens_q/k           int32 [N+1]       the GLOBAL padded packing, same on every rank
        max_length_q/k            int               its longest document
        num_items_in_batch        int               labelled tokens over all ranks (the loss divisor)
    """
    g = groups.resolve(group)
    rows, padded, error, facts = None, None, None, None
    try:
        check_layout(layout)
        if not isinstance(shift_labels, bool):
            raise TypeError(f"shift_labels must be a bool (True: a causal LM, False: token classification), got "
                            f"{type(shift_labels).__name__}")
        if not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a mapping of model inputs (a dict), got {type(batch).__name__}")
        unknown = sorted(set(batch) - set(_ACCEPTED))
        if unknown:
            raise ValueError(f"shard_batch does not know how to cut {unknown}; it takes {list(_ACCEPTED)}")
        ids = _tensor(batch, "input_ids", None)
        if ids is None or ids.dim() not in (1, 2) or ids.dtype.is_floating_point:
            raise ValueError("batch['input_ids'] must be an integer tensor [B, S] or [S]")
        labels = _tensor(batch, "labels", ids.shape)
        mask = _tensor(batch, "attention_mask", ids.shape)
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("shard_batch takes batches without padding (attention_mask all ones): pack the documents "
                             "into one row, e.g. with DataCollatorWithFlattening(return_flash_attn_kwargs=True)")
        lengths = _document_lengths(batch, ids)
        multiple = chunks_per_sequence(g.size, layout)
        if not shift_labels and any(n % multiple for n in lengths):
            raise ValueError(
                f"shard_batch(shift_labels=False) does not pad: a token classifier's bidirectional layers (the OpenAI "
                f"privacy filter's) would attend to the padding, unlike causal ones; every document's length must be "
                f"a multiple of {multiple} (layout={layout!r}, P={g.size}), got "
                f"{[n for n in lengths if n % multiple][:8]}: pack documents of such lengths")
        if labels is None and not shift_labels:
            raise ValueError("shard_batch(shift_labels=False) takes the batch's labels (one per token, -100: "
                             "unlabelled); without labels pass shift_labels=True and drop the labels it returns")
        rows, padded = _padded(ids.reshape(-1), (labels if labels is not None else ids).reshape(-1), lengths,
                               multiple, pad_token_id, shift_labels)
        weights = 1 + torch.arange(ids.numel(), device=ids.device) % 1009
        facts = {"the tokens' checksum": float((ids.reshape(-1).long() * weights).sum())}
    except Exception as exc:       # noqa: BLE001 - every rank learns why this one cannot go on
        error = exc
    groups.agree(g, facts, error)
    cu = _cu(padded, rows.device)
    local = distributed.shard_varlen(rows, cu, group, layout)
    labels = local[:, 2][None]
    longest = max(padded, default=0)
    out = dict(input_ids=local[:, 0][None], position_ids=local[:, 1][None], labels=labels,
               cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
               num_items_in_batch=int((rows[:, 2] != IGNORE).sum()))
    if shift_labels:
        out["shift_labels"] = labels
    return out
