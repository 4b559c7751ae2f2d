"""The mask function sinkattn registers in ``transformers.masking_utils.AttentionMaskInterface``.

Hugging Face builds one mask per layer type (full / sliding) before the layers run, by calling
the registered function with the mask *pattern* (``mask_function``: causal or bidirectional,
with or without a sliding window) and the 2-D padding mask. sinkattn computes the pattern itself
(from the layer's ``is_causal`` and ``sliding_window``), so all it needs from the mask is which
keys are real:

    returns None                  every key of the layer is real (dense call, bottom-right aligned)
    returns bool [B, n]           key column j of the layer is real iff mask[b, j]; the layer's key
                                  tensor has n real columns first (a static cache may hold more)

    returns int8 [B, kv_length]   traced with a StaticCache (``q_offset`` a 0-d tensor): column j is
                                  1 (real key), 0 (padding) or -1 (a slot after the last query,
                                  not written yet); the columns before the first -1 are the n above

Column ``j`` of the layer's keys is absolute position ``kv_offset + j``; the queries are the
absolute positions ``q_offset .. q_offset + q_length - 1``, the last ``q_length`` of the ``n``
columns. A pattern it does not recognise (custom ``or_mask_function`` / ``and_mask_function``,
block overlays, chunked attention) raises instead of being dropped silently.

With a sliding window, a row's real keys must be one run (padding on the left or the right):
sinkattn counts the window in real tokens, eager attention in columns. Full attention needs no
such run (a query sees every real key up to it, whatever lies between), so for a model whose
``config.layer_types`` has no ``sliding_attention`` layer the sliding mask, which gpt-oss makes
anyway, is not checked.

Under ``torch.compile`` / ``torch.export`` the function reads nothing at trace time, so a model
call stays one graph: the mask goes to the layers as it is (all real or not), and the one-run
check runs in the compiled program as the ``sinkattn::hf_padding_on_one_side`` op. The pattern is
then known from what tracing can read (see ``_traced_pattern_window``). A StaticCache hands
``q_offset`` as a 0-d tensor, which tracing cannot read without a graph break, and ``n`` depends
on it: such a layer gets the int8 mask, as wide as the cache, made with all the checks by the
``sinkattn::hf_static_cache_keys`` op when the compiled program runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..masks import Window
from . import layout

__all__ = ["key_mask", "pattern_window", "padding_on_one_side", "static_cache_keys", "pattern_keys", "visible",
           "UNWRITTEN", "INDEXED", "COMPRESSED"]

_FIX = "use attn_implementation='eager' (or 'sdpa') for this model or call"
OR_EAGER = "or load the model with attn_implementation='eager'"
PACKED_ROWS_UNSEEN = (
    "sinkattn.hf: this model's layers get a 4-D mask that knows no documents (their indexer or compressor reads "
    "the whole row), so packed rows given as cu_seq_lens_q/k cannot be honoured; pass one document per row "
    f"(padding is fine), {OR_EAGER}")
PADDING_INSIDE_A_ROW = (
    "sinkattn.hf: padding inside a row (real tokens on both sides of a pad) with a sliding window: sinkattn counts "
    "the window in real tokens, eager in positions; pad on the left or the right only, or use "
    "attn_implementation='eager'")
UNWRITTEN = -1          # the int8 mask's value for a static cache's slots after the last query


@torch.library.custom_op("sinkattn::hf_padding_on_one_side", mutates_args=())
def padding_on_one_side(keys: torch.Tensor) -> torch.Tensor:
    """A copy of the real-key mask ``bool [B, n]``; ``ValueError`` if a row has padding between real
    tokens. An op, so that a traced model reads the mask when it runs, in one graph, not by
    breaking the graph to read it at trace time."""
    if not bool(layout.one_run(keys)):
        raise ValueError(PADDING_INSIDE_A_ROW)
    return keys.clone()


@padding_on_one_side.register_fake
def _(keys):
    return torch.empty_like(keys)


def _cells(fn) -> dict:
    """The closure variables of ``fn`` by name (empty for a plain function)."""
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    return {n: c.cell_contents for n, c in zip(names, fn.__closure__ or ())}


def _parts(fn) -> list:
    """The mask functions that ``and_masks`` combined into ``fn``, flattened; ``[fn]`` otherwise."""
    if getattr(fn, "__qualname__", "") == "and_masks.<locals>.and_mask":
        return [p for inner in _cells(fn)["mask_functions"] for p in _parts(inner)]
    return [fn]


def _refuse_pattern(names) -> None:
    raise ValueError(
        f"sinkattn.hf: attention mask pattern {names} is not one sinkattn can express (it computes causal and "
        f"sliding-window attention with padding and packed rows only); {_FIX} without or_mask_function / "
        f"and_mask_function / block_sequence_ids")


def _traced_pattern_window(fn, local_size: int | None, custom: bool) -> int | None:
    """``pattern_window`` under ``torch.compile`` / ``torch.export`` tracing, where the closures of
    the mask functions cannot be read (dynamo does not model ``__closure__``): Hugging Face's causal
    function itself, or its ``and_masks`` combination of it with a sliding window (``W`` =
    ``local_size``) or packed sequences, when no custom function was passed (``use_vmap=False``:
    transformers sets it exactly when ``or_mask_function`` / ``and_mask_function`` is given)."""
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function or fn is getattr(mu, "bidirectional_mask_function", None):
        return None
    code = fn.__code__                           # dynamo reads a function's code, not its __qualname__
    if not custom and code.co_name == "and_mask" and code.co_filename == mu.__file__:
        return local_size
    _refuse_pattern([code.co_name])


def pattern_window(fn, local_size: int | None = None, custom: bool = False) -> int | None:
    """``None`` for Hugging Face's causal or bidirectional pattern, ``W`` for either with a sliding
    window (causal: the ``W`` keys up to the query; bidirectional: keys ``|i - j| <= W``).

    Recognised: ``causal_mask_function``, ``sliding_window_causal_mask_function(W)``,
    ``bidirectional_mask_function``, ``sliding_window_bidirectional_mask_function(W)`` and the
    packed-sequence wrappers of them (sinkattn packs from ``position_ids`` itself). Which of causal
    or bidirectional a layer runs, the attention function reads from the layer (``is_causal``), as
    eager attention's mask has it. Anything else raises ``ValueError``: sinkattn cannot honour a
    mask pattern it does not know.
    ``local_size`` and ``custom`` (transformers' ``use_vmap``) serve the traced check only.
    """
    from transformers import masking_utils as mu

    if torch.compiler.is_compiling():
        return _traced_pattern_window(fn, local_size, custom)
    causal, window, unknown = False, None, []
    for part in _parts(fn):
        name = getattr(part, "__qualname__", repr(part))
        if part is mu.causal_mask_function or part is getattr(mu, "bidirectional_mask_function", None):
            causal = True               # a known base pattern
        elif name in ("sliding_window_overlay.<locals>.inner_mask",
                      "sliding_window_bidirectional_overlay.<locals>.inner_mask"):
            window = _cells(part)["sliding_window"]
        elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            inner = pattern_window(_cells(part)["mask_function"])
            causal, window = True, inner if inner is not None else window
        elif name == "packed_sequence_mask_function.<locals>.inner_mask":
            continue
        else:
            unknown.append(name)
    if unknown or not causal:
        _refuse_pattern(unknown or [getattr(fn, "__qualname__", fn)])
    return window


def _keys(batch_size: int, q_length: int, kv_length: int, q_offset: int, kv_offset: int,
          attention_mask: torch.Tensor | None, sliding: bool, device) -> torch.Tensor | None:
    """``None`` or the real-key mask ``bool [B, n]`` for integer offsets, with the checks."""
    end = q_offset + q_length                                # one past the last query's absolute position
    n = end - kv_offset
    if not q_length <= n <= kv_length:
        raise ValueError(
            f"sinkattn.hf: cannot map this cache onto its keys: queries end at position {end}, the layer's keys "
            f"start at {kv_offset} and hold {kv_length} slots; use a DynamicCache / StaticCache from transformers "
            f"or attn_implementation='eager'")
    if attention_mask is None:
        if n == kv_length:
            return None
        return torch.ones(batch_size, n, dtype=torch.bool, device=device)
    if attention_mask.shape[-1] < end:
        raise ValueError(
            f"sinkattn.hf: the 2-D attention_mask covers {attention_mask.shape[-1]} positions but the queries reach "
            f"position {end - 1}; pass a mask over the past and the new tokens, shape [B, {end}] or longer")
    keys = attention_mask[:, kv_offset:end].to(torch.bool)
    if torch.compiler.is_compiling():       # the mask goes to the layers unread, but for the one refusal
        return padding_on_one_side(keys) if sliding else keys
    every_key_real, *one_run = torch.stack([keys.all()] + ([layout.one_run(keys)] if sliding else [])).tolist()
    if one_run and not one_run[0]:
        raise ValueError(PADDING_INSIDE_A_ROW)
    return None if n == kv_length and every_key_real else keys


@torch.library.custom_op("sinkattn::hf_static_cache_keys", mutates_args=())
def static_cache_keys(attention_mask: Optional[torch.Tensor], q_offset: torch.Tensor, batch_size: int,
                      q_length: int, kv_length: int, kv_offset: int, sliding: bool) -> torch.Tensor:
    """The int8 mask ``[B, kv_length]`` of a layer whose query offset is a tensor (module doc), with
    ``key_mask``'s checks and errors. An op, so that a traced model reads the offset when it runs."""
    keys = _keys(batch_size, q_length, kv_length, int(q_offset), kv_offset, attention_mask, sliding, q_offset.device)
    slots = torch.full((batch_size, kv_length), UNWRITTEN, dtype=torch.int8, device=q_offset.device)
    if keys is None:
        return slots.fill_(1)
    slots[:, :keys.shape[1]] = keys
    return slots


@static_cache_keys.register_fake
def _(attention_mask, q_offset, batch_size, q_length, kv_length, kv_offset, sliding):
    return q_offset.new_empty((batch_size, kv_length), dtype=torch.int8)


INDEXED = "indexed_attention"
"""The layer type of models whose sparse-attention indexer reads the layer's 4-D mask itself (HY-V4's
DSA layers): ``key_mask`` hands them Hugging Face's boolean ``[B, 1, Sq, Sk]`` mask, which the
attention function checks and reads back as real keys (``sinkattn.hf.attention``)."""


NOT_THE_PATTERN = (
    "sinkattn.hf: the layer's 4-D attention mask is not its causal / sliding-window pattern over the real keys (a "
    "custom or block mask), which sinkattn cannot express; pass a 2-D padding mask [B, S] (or none) instead, "
    f"{OR_EAGER}")


@torch.library.custom_op("sinkattn::hf_pattern_keys", mutates_args=())
def pattern_keys(mask: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """The int8 slot mask ``[B, Sk]`` (1: real key, 0: padding, -1: a slot after the last column any
    query sees, as ``static_cache_keys`` marks a static cache's unwritten slots) of Hugging Face's
    boolean ``[B, 1, Sq, Sk]`` mask of an ``INDEXED`` layer; ``ValueError`` (``NOT_THE_PATTERN``) unless
    the mask is exactly the window ``(left, right)`` (``sinkattn.masks.Window``), bottom-right aligned
    on the columns up to the last one seen (with a cache, ``Sq < Sk``; all ``Sk`` without one), over
    the real keys. An op, so that a traced model checks the mask when it runs, without a graph break."""
    B, _, Sq, Sk = mask.shape
    seen = mask[:, 0].any(1)                                                              # [B, Sk]
    n = Sk
    if Sq < Sk:
        cols = torch.nonzero(seen.any(0))
        n = max(int(cols.max()) + 1 if cols.numel() else 0, Sq)
    vis = Window(left, right).visible(torch.arange(Sq, device=mask.device), torch.arange(n, device=mask.device), Sq, n)
    if not torch.equal(mask[:, 0, :, :n], vis[None] & seen[:, None, :n]) or seen[:, n:].any():
        raise ValueError(NOT_THE_PATTERN)
    slots = seen.to(torch.int8)
    slots[:, n:] = UNWRITTEN
    return slots


@pattern_keys.register_fake
def _(mask, left, right):
    return mask.new_empty((mask.shape[0], mask.shape[-1]), dtype=torch.int8)


COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")
"""DeepSeek-V4's layer types that append compressed key/value entries to the sliding keys and write
their visibility into the layer's mask (``sinkattn.hf.compressed``): ``key_mask`` hands every layer
of such a model Hugging Face's additive float ``[B, 1, Sq, Sk]`` mask, the form the layer extends."""


def _indexed(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    return bool(layer_types) and INDEXED in layer_types


def _compressed(config) -> bool:
    layer_types = getattr(config, "layer_types", None) or ()
    return any(t in COMPRESSED for t in layer_types)


@torch.library.custom_op("sinkattn::hf_visible", mutates_args=())
def visible(mask: torch.Tensor) -> torch.Tensor:
    """The columns each query sees, ``bool [B, 1, Sq, Sk]``, of an additive float mask whose entries
    are 0 (seen) or at most the dtype's lowest value / -inf (hidden, as Hugging Face writes them);
    ``ValueError`` for any other entry: a bias added to the scores, which sinkattn cannot express. An
    op, so that a traced model checks the mask when it runs, without a graph break."""
    seen = mask == 0
    if not bool((seen | (mask <= torch.finfo(mask.dtype).min)).all()):
        raise ValueError("sinkattn.hf: the layer's float attention mask adds values other than 0 and -inf to the "
                         "scores (a score bias), which sinkattn cannot express; drop the bias (0 where a key is "
                         f"seen, -inf where not), {OR_EAGER}")
    return seen


@visible.register_fake
def _(mask):
    return torch.empty_like(mask, dtype=torch.bool)


def _has_sliding_layers(config) -> bool:
    """Whether a layer of the model reads the sliding-window mask (True when the config does not say)."""
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def key_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
                  device=None, **kwargs) -> torch.Tensor | None:
    """Hugging Face's mask-interface call -> ``None``, the real-key mask ``bool [B, n]`` or, traced
    with a StaticCache, the int8 slot mask ``[B, kv_length]`` (module doc); for a model with
    ``indexed_attention`` layers, whose indexer reads the mask, the boolean ``[B, 1, Sq, Sk]`` one
    (``INDEXED``); for a model with compressed layers, which extend the mask, the additive float one
    (``COMPRESSED``)."""
    config = kwargs.get("config")
    compressed = _compressed(config)
    if _indexed(config) or compressed:
        from transformers import masking_utils as mu

        use_vmap = bool(kwargs.get("use_vmap", False))
        pattern_window(mask_function, local_size, use_vmap)     # a pattern we know
        if compressed:
            return mu.eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                                 dtype=kwargs.get("dtype") or torch.float32, use_vmap=use_vmap, device=device)
        return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                            local_size=local_size, allow_is_causal_skip=False, device=device, use_vmap=use_vmap)
    window = local_size
    if mask_function is not None:
        window = pattern_window(mask_function, local_size, bool(kwargs.get("use_vmap", False)))
        if local_size is not None and window is not None and window != local_size:
            raise ValueError(f"sinkattn.hf: mask pattern has sliding window {window} but the layer asks for "
                             f"{local_size}; {_FIX} with one window")
    if window is not None and not _has_sliding_layers(kwargs.get("config")):
        window = None                      # gpt-oss makes the sliding mask even when no layer reads it
    if isinstance(q_offset, torch.Tensor) and torch.compiler.is_compiling():
        return static_cache_keys(attention_mask, q_offset, batch_size, q_length, kv_length, kv_offset,
                                 window is not None)
    return _keys(batch_size, q_length, kv_length, int(q_offset), int(kv_offset), attention_mask, window is not None,
                 device)
