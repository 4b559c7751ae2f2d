"""Backend registry. Each backend module exposes ``CAPABILITIES``, ``forward`` and ``backward``:

    forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)
        -> (out [Tq, HQ, D], lse [HQ, Tq] fp32, extra: tuple of tensors kept for the backward)
    backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, extra)
        -> (dq, dk, dv, dsinks or None)
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .capabilities import Call, Capabilities

__all__ = ["NAMES", "load", "choose", "Call", "Capabilities"]

NAMES = ("cpu", "triton", "reference")
_AUTO = {"cpu": "cpu", "cuda": "triton"}


_LOADED: dict[str, ModuleType] = {}


def load(name: str) -> ModuleType:
    if name in _LOADED:
        return _LOADED[name]
    try:
        _LOADED[name] = importlib.import_module(f"{__name__}.{name}")
        return _LOADED[name]
    except ImportError as exc:
        if name == "triton":
            raise NotImplementedError(
                f"backend 'triton' needs the triton package ({exc}); pip install 'sinkattn[triton]'") from exc
        raise


def choose(backend: str, call: Call) -> ModuleType:
    """The backend module for ``call``; NotImplementedError with the reason if none can take it."""
    if backend == "auto":
        name = _AUTO.get(call.device_type)
        if name is None:
            raise NotImplementedError(
                f"no fast backend for {call.device_type!r} tensors; pass backend='reference' "
                f"(float64, materialized) or move the tensors to the CPU or a CUDA GPU")
    elif backend in NAMES:
        name = backend
    else:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {backend!r}")
    module = load(name)
    reason = module.CAPABILITIES.why_not(call)
    if reason is not None:
        raise NotImplementedError(reason)
    return module
