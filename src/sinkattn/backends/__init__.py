"""Backend registry. Each backend module exposes ``CAPABILITIES``, ``forward`` and ``backward``:

    forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, max_seqlen=None)
        -> (out [Tq, HQ, D] in CAPABILITIES.out_dtype, lse [HQ, Tq] fp32, extra: CAPABILITIES.saved)
    backward(do, dlse, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right, extra,
             max_seqlen=None)
        -> (dq, dk, dv, dsinks or None)

``max_seqlen`` is ``(max_seqlen_q, max_seqlen_k)``, bounds no shorter than the longest sequence
(checked by the caller), or None to read them from ``cu_seqlens``: a backend that sizes a launch
with them needs no copy of ``cu_seqlens`` to the host; one that reads the lengths anyway ignores it.

``choose`` reads only the declarations, so it runs inside ``torch.compile``'s tracing without
importing anything; the backends themselves run inside the custom ops (``sinkattn.ops``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import cpu, reference
from .capabilities import Call, Capabilities, Saved

__all__ = ["NAMES", "load", "describe", "choose", "Call", "Capabilities", "Saved"]

NAMES = ("cpu", "triton", "reference")
_AUTO = {"cpu": "cpu", "cuda": "triton"}
_LOADED: dict[str, ModuleType] = {"cpu": cpu, "reference": reference}


def load(name: str) -> ModuleType:
    """The backend module ``name``; the Triton one is imported on first use."""
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(f"{__name__}.{name}")
        except ImportError as exc:
            raise NotImplementedError(
                f"backend {name!r} needs the triton package ({exc}): pip install triton (in a source checkout: "
                f"pip install -e \".[triton]\"); on a CPU, run with TRITON_INTERPRET=1") from exc
    return _LOADED[name]


def describe(name: str) -> Capabilities:
    """What backend ``name`` declares."""
    return load(name).CAPABILITIES


def choose(backend: str, call: Call) -> str:
    """The name of the backend for ``call``; NotImplementedError with the reason if none can take it.

    Meta tensors (shapes only, no data) are taken by every backend as if on a device it runs on:
    no backend runs, the ops' fake implementations describe the results (``sinkattn.ops``)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {('auto',) + NAMES}, got {type(backend).__name__}")
    if backend == "auto":
        name = _AUTO.get(call.device_type, "cpu" if call.device_type == "meta" else None)
        if name is None:
            raise NotImplementedError(
                f"no backend runs on {call.device_type!r} tensors; move them to the CPU or a CUDA GPU")
    elif backend in NAMES:
        name = backend
    else:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {backend!r}")
    if call.device_type == "meta":
        call = call._replace(device_type=min(describe(name).device_types))
    reason = describe(name).why_not(call)
    if reason is not None:
        raise NotImplementedError(reason)
    return name
