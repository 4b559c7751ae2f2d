"""``register``: put sinkattn into transformers' attention and mask interfaces under a name."""

from __future__ import annotations

import functools
import inspect
import weakref

from .. import backends
from .attention import attention_forward
from .context import ContextParallel
from .masks import key_mask

__all__ = ["register", "missing_features", "MIN_TRANSFORMERS"]

MIN_TRANSFORMERS = "5.4"
_OURS: dict[str, tuple[tuple, object]] = {}   # name -> (its settings, the function registered under it)


def missing_features(transformers_module, masking_utils) -> list[str]:
    """What sinkattn.hf needs from transformers and this installation lacks (empty: all there)."""
    missing = [f"transformers.{n}" for n in ("AttentionInterface",) if not hasattr(transformers_module, n)]
    missing += [f"masking_utils.{n}" for n in ("AttentionMaskInterface", "causal_mask_function",
                                               "flash_attention_mask") if not hasattr(masking_utils, n)]
    if hasattr(masking_utils, "flash_attention_mask") and \
            "q_offset" not in inspect.signature(masking_utils.flash_attention_mask).parameters:
        missing.append("mask functions called with q_offset / kv_offset")
    return missing


def _transformers():
    try:
        import transformers
        from transformers import masking_utils
    except ImportError as exc:
        raise ImportError(f"sinkattn.hf needs transformers >= {MIN_TRANSFORMERS}: "
                          f"pip install \"transformers>={MIN_TRANSFORMERS}\" ({exc})") from exc
    missing = missing_features(transformers, masking_utils)
    if missing:
        raise ImportError(f"sinkattn.hf needs transformers >= {MIN_TRANSFORMERS}, found {transformers.__version__} "
                          f"which lacks {', '.join(missing)}; pip install -U 'transformers>={MIN_TRANSFORMERS}'")
    return transformers, masking_utils


def register(name: str = "sinkattn", backend: str = "auto", *, context_parallel: ContextParallel | None = None,
             head_group=None) -> str:
    """Register sinkattn under ``name`` in transformers' attention and mask interfaces; returns ``name``.

    Afterwards ``attn_implementation=name`` (``from_pretrained``, ``from_config``,
    ``model.set_attn_implementation``) runs every attention layer through ``sinkattn::forward``.
    ``backend`` forces a sinkattn backend for everything run under this name (``"auto"``: cpu for
    CPU tensors, triton for CUDA tensors; ``"cpu"``, ``"triton"``, ``"reference"``); register
    several names to have several. ``context_parallel``: a ``sinkattn.hf.ContextParallel`` (process
    group, method, layout) makes the name context-parallel: the model then runs on each rank's
    shard of the tokens (``sinkattn.hf.shard_batch``). ``head_group``: the process group (or a
    function returning it) over which a sequence-parallel wrapper splits the heads, for sinks
    longer than the heads a call sees; by default DeepSpeed's Ulysses group, when one was made.
    Calling it again with the same arguments changes nothing; with other settings it re-points
    ``name``. Raises ImportError naming the transformers version needed when the installed one
    lacks what the integration uses.
    """
    if not isinstance(name, str) or not name or "/" in name or "|" in name:
        raise ValueError(f"name must be a non-empty str without '/' or '|' (hub-kernel syntax), got {name!r}")
    if backend != "auto" and backend not in backends.NAMES:
        raise ValueError(f"backend must be one of {('auto',) + backends.NAMES}, got {backend!r}")
    if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
        raise TypeError(f"context_parallel must be a sinkattn.hf.ContextParallel(group, method, layout) or None, "
                        f"got {type(context_parallel).__name__}")
    transformers, masking_utils = _transformers()
    attn, masks = transformers.AttentionInterface, masking_utils.AttentionMaskInterface
    ours = _OURS.get(name)
    taken = name in attn._global_mapping or name in masks._global_mapping
    if taken and (ours is None or attn._global_mapping.get(name) is not ours[1]):
        raise ValueError(f"attention implementation {name!r} is already registered by transformers or another "
                         f"library; pick another name for sinkattn")
    if head_group is not None and not callable(head_group):
        head_group = weakref.ref(head_group)     # held weakly, as ContextParallel holds its group
    settings = (backend, context_parallel, head_group)
    if ours is None or ours[0] != settings:
        extra = {k: v for k, v in zip(("backend", "context_parallel", "head_group"), settings)
                 if v is not None and v != "auto"}
        _OURS[name] = (settings, functools.partial(attention_forward, **extra) if extra else attention_forward)
    attn.register(name, _OURS[name][1])
    masks.register(name, key_mask)
    return name
