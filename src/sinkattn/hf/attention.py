"""The attention function sinkattn registers in ``transformers.AttentionInterface``.

Hugging Face calls it from every attention layer with ``query [B, HQ, Sq, D]``,
``key [B, HKV, Sk, D]``, ``value [B, HKV, Sk, Dv]`` (``Sk >= Sq``: with a cache the keys hold the
past too; ``Dv`` may differ from ``D``) and the layer's mask (what ``sinkattn.hf.masks.key_mask``
returned). It returns ``(out [B, Sq, HQ, Dv], None)``. Per layer:

    causal = the layer's is_causal (a decoder: True; a bidirectional encoder: False)
    window_size = (W - 1, W - 1) if sliding_window=W else (-1, -1)   (causal: (W - 1, 0))
    sinks = s_aux (the layer's ``sinks`` parameter, its own dtype), softmax_scale = scaling

and one of three layouts, all bottom-right aligned (query i of a sequence with Lq queries and
Lk keys is key Lk - Lq + i):

    cu_seq_lens_q/k + max_length_q/k   packed rows as given (DataCollatorWithFlattening with
                              return_flash_attn_kwargs=True): varlen over all B*S tokens
    a padding mask [B, n] and/or position_ids restarting at 0
                              varlen over the real tokens, every row split where its positions
                              restart at 0 (``sinkattn.hf.layout``): padding and packing in one
                              batch are both honoured; padded query rows come back as zeros
    otherwise                 ``sink_attn_func`` on the dense batch (decoding: Sq < Sk)

A 4-D mask (what ``key_mask`` makes for models whose layers read or extend it, or a user's own) is
taken only where it is the layer's own pattern over the real keys (boolean, or additive float
0 / -inf read by the ``sinkattn::hf_visible`` op) and then read back as the real-key mask.

Eager mode reads the layout's lengths back once per forward pass (memoized per mask /
position_ids tensor). Under ``torch.compile`` / ``torch.export`` nothing is read back: the
layout has shapes fixed by ``B, Sq, Sk`` (``sinkattn.hf.layout.fixed``), so a dense or packed
model call traces without a graph break; there the refusal of padding inside a row with a
sliding window is made once per forward by ``key_mask``. A static cache's layer then gets the
int8 slot mask ``[B, Sk]`` (-1: a slot after the queries); its queries are the last ``Sq`` columns
before the first -1, located on the device.

Two kinds of layer add keys a window cannot describe, and run partly outside sinkattn's kernels
(``sinkattn.hf.listed``): DeepSeek-V4's compressed layers (``sinkattn.hf.compressed``: the window
keys through sinkattn, the compressed entries after them merged in by log-sum-exp) and a sparse
top-k handed as ``indices [B, Sq, topk]`` beside the mask (HY-V4's DSA: the listed keys the mask shows).

Two settings of ``sinkattn.hf.register`` change the call: ``context_parallel=`` runs the layer on
this rank's shard of the tokens through ``sinkattn.distributed`` (``sinkattn.hf.context``), and
sinks longer than the query heads, as a sequence-parallel wrapper that split the heads hands
them (DeepSpeed Ulysses), are cut to this rank's heads (``sinkattn.hf.heads``, ``head_group=``).
"""

from __future__ import annotations

import torch

from .. import sink
from ..interface import sink_attn_func, sink_attn_varlen_func
from ..masks import Window
from . import compressed, context, heads, layout, listed
from .context import ContextParallel
from .masks import OR_EAGER as _EAGER
from .masks import PACKED_ROWS_UNSEEN, PADDING_INSIDE_A_ROW, UNWRITTEN, pattern_keys, visible

__all__ = ["attention_forward"]



def _refuse(module, dropout, kwargs) -> None:
    """What sinkattn cannot honour: a clear error instead of a silently different result."""
    if dropout and dropout > 0 and getattr(module, "training", True):
        raise ValueError(f"sinkattn has no attention dropout, got dropout={dropout} in training; set "
                         f"config.attention_dropout = 0.0 (gpt-oss's default) {_EAGER}")
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise ValueError("sinkattn never materializes attention weights, so output_attentions=True cannot be "
                         f"served; drop output_attentions (also from the config) {_EAGER}")


def _pattern_mask(mask: torch.Tensor, Sq: int, Sk: int, options) -> torch.Tensor:
    """The real keys of a boolean ``[B, 1, Sq, Sk]`` mask (Hugging Face's for ``indexed_attention``
    layers, ``sinkattn.hf.masks.INDEXED``; a float one's ``visible`` columns), after checking that the
    mask is exactly this layer's pattern (causal / window, bottom-right) over them
    (``sinkattn.hf.masks.pattern_keys``, an op that checks when the program runs, traced or not):
    ``bool [B, Sk]`` without a cache; with one, the int8 slot mask ``[B, Sk]``, whose -1 columns (a
    static cache's slots after the queries, which no query sees) ``_real_keys`` drops."""
    if mask.dtype != torch.bool or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (Sq, Sk):
        raise ValueError(f"sinkattn.hf cannot express a 4-D mask of shape {tuple(mask.shape)} and dtype {mask.dtype} "
                         f"for {Sq} queries and {Sk} keys; pass a 2-D padding mask [B, S] (or none) instead, {_EAGER}")
    window = Window.of(options["causal"], options["window_size"])
    slots = pattern_keys(mask, window.left, window.right)      # an op: its schema takes ints
    return slots if Sq < Sk else slots > 0


def _varlen(q, k, v, lay: layout.Layout, options) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Sq, HQ, D]``, ``k [B, Sk, HKV, D]``, ``v [B, Sk, HKV, Dv]`` through the varlen API ->
    ``[B, Sq, HQ, Dv]``, and with ``return_lse`` in ``options`` also ``lse`` fp32 ``[B, Sq, HQ]``
    (a padded query row: out 0, lse the sink's logit alone, as a row with no keys has)."""
    B, Sq, HQ, D = q.shape
    Dv = v.shape[-1]
    qf, kf, vf = q.reshape(B * Sq, HQ, D), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    if lay.index_q is not None:
        qf = qf[lay.index_q]
    if lay.index_k is not None:
        kf, vf = kf[lay.index_k], vf[lay.index_k]
    out = sink_attn_varlen_func(qf, kf, vf, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, **options)
    out, lse = out if isinstance(out, tuple) else (out, None)
    lse = None if lse is None else lse.transpose(0, 1)                             # [Tq, HQ]
    if lay.index_q is not None:
        out = out.new_zeros(B * Sq, HQ, Dv).index_put((lay.index_q,), out)
        if lse is not None:
            lse = sink.lse_without_keys(options.get("sinks"), (B * Sq, HQ), lse.device).index_put((lay.index_q,), lse)
    out = out.view(B, Sq, HQ, Dv)
    return out if lse is None else (out, lse.view(B, Sq, HQ))


def _real_keys(mask, k, Sq: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The real-key mask ``bool [B, n]``, checked against the keys (``Sq <= n <= Sk``), and None; or,
    traced, for the int8 slot mask of a static cache: ``bool [B, Sk]`` and the column after each
    row's last query (int64 ``[B, 1]``, the slots before the first -1)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        got = f"a {mask.dim()}-D mask {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"sinkattn.hf cannot express {got} (a custom or prepared attention mask); pass a 2-D padding mask "
            f"[B, S], packed rows as position_ids restarting at 0 or cu_seq_lens_q/k + max_length_q/k, {_EAGER}")
    if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.dtype.is_complex):
        raise TypeError(f"sinkattn.hf: a 2-D attention_mask must be bool or integer (1 = real token), got {mask.dtype}")
    B, n = mask.shape
    if k.shape[1] < n or n < Sq or mask.shape[0] != k.shape[0]:
        raise ValueError(f"sinkattn.hf: attention mask {tuple(mask.shape)} does not fit {Sq} queries and "
                         f"{k.shape[1]} keys per row (batch {k.shape[0]}); it must be [B, n] with Sq <= n <= Sk")
    if mask.dtype != torch.int8:
        return mask.to(torch.bool), None
    q_end = (mask != UNWRITTEN).sum(-1, keepdim=True)
    if torch.compiler.is_compiling():
        return mask > 0, q_end
    return mask[:, :int(q_end.max())] > 0, None


def _sequences(mask, position_ids, B: int, Sq: int, Sk: int, device, q_end=None) -> layout.Layout | None:
    """The layout of the padding (``mask`` or None) and the packing (``position_ids`` restarting
    at 0), or None when there is neither: a dense call (a mask without padding included, as
    ``generate`` passes). Traced: the fixed-shape layout; eager: the exact one, one host read-back
    per forward pass."""
    if mask is None and (position_ids is None or Sq != Sk or Sq < 2):
        return None
    if torch.compiler.is_compiling():
        return layout.fixed(mask, position_ids, B, Sq, Sk, device, q_end)
    lay = layout.memoized(layout.exact, (mask, position_ids), B, Sq, Sk, device)
    return None if (mask is None or lay.all_real) and lay.sequences == B else lay


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      s_aux=None, *, backend: str = "auto", context_parallel: ContextParallel | None = None,
                      head_group=None, **kwargs):
    """Hugging Face attention-interface function: ``(out [B, Sq, HQ, Dv], None)`` (see the module doc).

    Args:
        module: the attention layer (reads ``training``, ``is_causal``, ``config.output_attentions``).
        query: ``[B, HQ, Sq, D]``; key: ``[B, HKV, Sk, D]``, value: ``[B, HKV, Sk, Dv]``, ``Sq <= Sk``.
        attention_mask: None, the real-key mask ``bool [B, n]`` of ``sinkattn.hf.masks.key_mask`` or
            its int8 slot mask ``[B, Sk]`` (a static cache, traced).
        scaling: softmax scale (default ``1/sqrt(D)``); sliding_window: ``W`` or None.
        s_aux: sinks ``[HQ]`` (any float dtype, gradient in its dtype) or None.
        backend: sinkattn backend, ``"auto"`` = cpu for CPU tensors, triton for CUDA tensors.
        context_parallel: run on this rank's shard of the tokens (``sinkattn.hf.context``), or None.
        head_group: the group a sequence-parallel wrapper split the heads over, when ``s_aux`` holds
            more heads than ``query`` (``sinkattn.hf.heads``); None: DeepSpeed's, if made.
        kwargs: ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``is_causal``,
            ``output_attentions``, ``indices``; the rest is ignored.
    """
    is_causal = kwargs.get("is_causal")
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    _refuse(module, dropout, kwargs)
    s_aux = heads.local_sinks(s_aux, query.shape[1], head_group)
    # flash-attn's reading of Hugging Face's sliding_window W: (W - 1, W - 1), causal making it (W - 1, 0)
    options = dict(sinks=s_aux, softmax_scale=scaling, causal=is_causal, backend=backend,
                   window_size=(sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)     # [B, S, H, D]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.is_floating_point():
        attention_mask = visible(attention_mask)
    compressor = getattr(module, "compressor", None)      # read once: a missing attribute of a Module costs a us
    if context_parallel is not None:
        if compressor is not None:
            raise ValueError(compressed.NO_CONTEXT_PARALLEL)
        return context.attention(q, k, v, attention_mask, kwargs, options, context_parallel), None
    if compressor is not None:
        return _compressed(module, q, k, v, attention_mask, kwargs, options), None
    indices = kwargs.get("indices")
    if isinstance(indices, torch.Tensor) and indices.shape[-1] < k.shape[1]:
        return _selected(q, k, v, attention_mask, indices, kwargs, options), None
    return _local(q, k, v, attention_mask, kwargs, options), None


def _compressed(module, q, k, v, mask, kwargs, options) -> torch.Tensor:
    """A DeepSeek-V4 compressed layer (``sinkattn.hf.compressed``): the window keys through ``_local``
    with their lse, the entries after them merged in; a single query over the keys its mask row marks."""
    seen, window = compressed.split(module, q, k, mask, kwargs)
    if window is None:
        return _varlen(q, k, v, compressed.one_query(seen), dict(options, causal=False, window_size=(-1, -1)))
    o_w, lse_w = _local(q, k[:, :window], v[:, :window], seen[..., :window], kwargs, dict(options, return_lse=True))
    if window == k.shape[1]:
        return o_w
    return listed.joined(q, k[:, window:], v[:, window:], seen[:, 0, :, window:], options, o_w, lse_w)


def _selected(q, k, v, mask, indices, kwargs, options) -> torch.Tensor:
    """A sparse-attention layer's top-k (HY-V4's DSA: ``indices [B, Sq, topk]`` handed beside the mask):
    each query attends to the keys its indices list and its boolean ``[B, 1, Sq, Sk]`` mask shows, and
    the sink (``sinkattn.hf.listed``)."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    if layout.flash(kwargs, B * Sq) is not None:
        raise ValueError(PACKED_ROWS_UNSEEN)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError("sinkattn.hf: a sparse top-k layer needs its boolean [B, 1, Sq, Sk] mask, which sinkattn's "
                         f"mask function makes for models with indexed_attention layers, {_EAGER}")
    chosen = torch.zeros(B, Sq, Sk, dtype=torch.bool, device=q.device).scatter_(-1, indices.long(), True)
    return listed.joined(q, k, v, chosen & mask.expand(B, -1, -1, -1)[:, 0], options)


def _local(q, k, v, attention_mask, kwargs, options):
    """One process's call on ``[B, S, H, D]`` tensors and the layer's mask -> ``out [B, Sq, HQ, Dv]``,
    or with ``return_lse`` in ``options`` ``(out, lse fp32 [B, Sq, HQ])``."""
    B, Sq = q.shape[0], q.shape[1]
    flash = layout.flash(kwargs, B * Sq)
    if flash is not None:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            raise ValueError(PACKED_ROWS_UNSEEN)
        if attention_mask is not None:
            raise ValueError("sinkattn.hf: got both a padding attention_mask and cu_seq_lens_q/k; packed rows carry "
                             "no padding, pass one or the other")
        return _varlen(q, k, v, flash, options)
    mask = q_end = None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        attention_mask = _pattern_mask(attention_mask.expand(B, -1, -1, -1), Sq, k.shape[1], options)
    if attention_mask is not None:
        mask, q_end = _real_keys(attention_mask, k, Sq)
        if mask.shape[1] != k.shape[1]:                     # a static cache's unwritten slots follow the n columns
            k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    lay = _sequences(mask, kwargs.get("position_ids"), B, Sq, k.shape[1], q.device, q_end)
    if lay is not None:
        if options["window_size"] != (-1, -1) and not lay.contiguous:
            raise ValueError(PADDING_INSIDE_A_ROW)
        return _varlen(q, k, v, lay, options)
    out = sink_attn_func(q, k, v, **options)
    if isinstance(out, tuple):
        return out[0], out[1].transpose(1, 2)
    return out
