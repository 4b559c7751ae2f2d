"""Backend registry. Each backend module exposes ``CAPABILITIES``, ``forward`` and ``backward``, one protocol:

    forward(q, k, v, batch, window, softmax_scale, needs_grad)
        -> (o, Stats) or None
    backward(do, dlse, q, k, v, o, stats, sink_mass, batch, window, softmax_scale, partial)
        -> (dq, dk, dv, delta)

The forward computes the softmax over each row's visible keys only, **without** the sink:
``o [Tq, HQ, D]`` in ``CAPABILITIES.out_dtype`` and ``Stats(m, log_l) [HQ, Tq]`` in its base
(``sinkattn.sink``, where the sink joins once for every backend); a row that sees no key has ``o = 0``
and ``log_l = -inf``, its ``m`` any value. ``batch`` is a ``Batch`` (packed:
``q [Tq, HQ, D]``, ``k``/``v [Tk, HKV, D]``, contiguous), or None for a dense call without gradient
handed over as it is (``q [B, Sq, HQ, D]``, any strides; only to a backend that declares ``dense``,
which returns ``o [B, Sq, HQ, D]`` and ``Stats [HQ, B*Sq]``, or None to have it packed).
``needs_grad``: the backward will follow (a backend may take a faster forward otherwise).
A backend may also expose ``join_sink(o, stats, sinks) -> (Stats, lse) or None``: the sink's join
(``sinkattn.sink.with_sink`` and ``lse_of``, the same formula) on its forward's own results, computed
its own way (the cpu backend: one compiled call); None leaves the join to ``sinkattn.sink``.

The backward gets the final results of the rows: ``o`` and ``stats`` with the sink and every key of
the row included, ``sink_mass [HQ, Tq]`` (the sink's probability per row, ``sink.sink_mass``) or None
without sinks, ``do`` in q's dtype, ``dlse [HQ, Tq]`` or None. It returns fp32 (float64 for
``reference``) ``dq``, ``dk``, ``dv`` shaped like q, k, v, and the ``Delta [HQ, Tq] = <dO, o> - dlse``
it used (the sink's gradient is formed from it once, in ``sinkattn.ops``). ``partial``: the call
holds only some of its rows' keys (a context-parallel tile), so ``Delta`` must come from ``o``.

``window`` is a folded ``sinkattn.masks.Window``. ``choose`` reads only the declarations, so it runs
inside ``torch.compile``'s tracing without importing anything; the backends themselves run inside
the custom ops (``sinkattn.ops``), the only code that calls them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import cpu, reference
from .capabilities import Batch, Capabilities, Request

__all__ = ["NAMES", "load", "describe", "choose", "Request", "Capabilities", "Batch"]

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
