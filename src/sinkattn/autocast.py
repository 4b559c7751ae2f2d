"""``torch.autocast`` at sinkattn's public functions: the rule of SDPA, which autocast lists as
lower precision.

Inside ``torch.autocast(device_type, dtype)``, each of q, k and v on that device type whose dtype
autocast takes (fp16, bf16, fp32; not fp64) is cast to ``dtype`` by a differentiable ``.to``, so
``out`` comes back in ``dtype``, ``lse`` stays fp32, and gradients reach the original tensors in
their own dtypes. The sinks are left as they are (fp32 master sinks stay fp32; ``dsinks`` in their
dtype). Outside autocast nothing changes: a dtype mix among q, k, v stays a TypeError.

The backends compute in fp32 on purpose (scores, softmax statistics, accumulations), so their own
operations run with autocast off (``disabled``): an autocast region around the call must not
round their fp32 matrix products to ``dtype``.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_inputs", "disabled", "ELIGIBLE_DTYPES"]

ELIGIBLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes autocast casts (its ``is_eligible``: floating point, not float64)."""


def _available(device_type: str) -> bool:
    """Whether autocast exists for ``device_type``: fixed for the process, so a traced call takes it as a
    constant (torch 2.11's Dynamo cannot trace ``torch.amp.is_autocast_available`` itself)."""
    return torch.amp.is_autocast_available(device_type)


# torch.compiler.assume_constant_result's whole effect, without its import of Dynamo (a second or more
# of every `import sinkattn`, a CLI's `--help` included); tests/test_autocast.py traces it
_available._dynamo_marked_constant = True


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts eligible tensors on ``device_type`` to, or None when it is off there."""
    if not (_available(device_type) and torch.is_autocast_enabled(device_type)):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_inputs(q, k, v):
    """``(q, k, v)`` as autocast's lower-precision rule casts them (see the module doc); each one
    unchanged outside autocast or when not eligible (anything else is left for validation to refuse).
    Autocast's state is read once per device type, or once in all outside traced code (a decoding step's
    attention costs a few tens of microseconds)."""
    if not torch.compiler.is_compiling() and not torch._C._is_any_autocast_enabled():
        return q, k, v
    cast, dtypes = [], {}
    for x in (q, k, v):
        if isinstance(x, torch.Tensor) and x.dtype in ELIGIBLE_DTYPES:
            device_type = x.device.type
            if device_type not in dtypes:
                dtypes[device_type] = _autocast_dtype(device_type)
            dtype = dtypes[device_type]
            if dtype is not None:
                x = x.to(dtype)
        cast.append(x)
    return tuple(cast)


_NOTHING = contextlib.nullcontext()


def disabled(device: torch.device):
    """A context with autocast off on ``device``'s type, for the backends' own fp32 computations."""
    if not torch._C._is_any_autocast_enabled() or not torch.amp.is_autocast_available(device.type) \
            or not torch.is_autocast_enabled(device.type):
        return _NOTHING                          # nothing to turn off (a call without autocast pays nothing)
    return torch.autocast(device.type, enabled=False)
