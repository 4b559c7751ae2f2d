"""Backend registry: each backend is a module of the protocol ``sinkattn.backends.protocol`` with its
declared ``CAPABILITIES`` (``sinkattn.backends.capabilities``).

``choose`` reads only the declarations, so it runs inside ``torch.compile``'s tracing without importing
anything; the backends themselves run inside the custom ops (``sinkattn.ops``), the only code that calls
them.
"""

from __future__ import annotations

import importlib

from . import cpu, reference
from .capabilities import Batch, Capabilities, Request
from .protocol import Backend

__all__ = ["NAMES", "load", "describe", "choose", "Request", "Capabilities", "Batch"]

NAMES = ("cpu", "triton", "reference")
_AUTO = {"cpu": "cpu", "cuda": "triton"}
_LOADED: dict[str, Backend] = {"cpu": cpu, "reference": reference}


def load(name: str) -> Backend:
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


def choose(backend: str, request: Request) -> str:
    """The name of the backend for ``request``; NotImplementedError with the reason if none can take it.

    Meta tensors (shapes only, no data) are taken by every backend as if on a device it runs on:
    no backend runs, the ops' fake implementations describe the results (``sinkattn.ops``)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {('auto',) + NAMES}, got {type(backend).__name__}")
    if backend == "auto":
        name = _AUTO.get(request.device_type, "cpu" if request.device_type == "meta" else None)
        if name is None:
            raise NotImplementedError(
                f"no backend runs on {request.device_type!r} tensors; move them to the CPU or a CUDA GPU")
    elif backend in NAMES:
        name = backend
    else:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {backend!r}")
    if request.device_type == "meta":
        request = request._replace(device_type=min(describe(name).device_types))
    reason = describe(name).why_not(request)
    if reason is not None:
        raise NotImplementedError(reason)
    return name
