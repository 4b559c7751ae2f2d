"""What every call settles once, before any work: the backend, the window, the scale, whether a
backward will follow. The public functions and context parallelism both start here."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import autodiff, backends, defaults, validation
from .masks import Window

__all__ = ["Call", "settle"]


class Call(NamedTuple):
    """A settled call (a tuple: one is made per call, decoding included)."""

    backend: str                # a backend name, never "auto"
    window: Window              # causal folded in; folded on the lengths inside the ops
    softmax_scale: float
    needs_grad: bool            # a backward will follow: autograd records the call


def settle(q, k, v, sinks, softmax_scale, causal, window_size, backend) -> Call:
    """The ``Call`` of checked arguments (``validation.check_options``): refuses ``torch.func``
    transforms and forward-mode AD, picks the backend (NotImplementedError with the reason if it
    cannot take the call). Reads shapes and Python values only, so it traces without a graph break."""
    autodiff.refuse_unsupported(q, k, v, sinks)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    request = backends.Request(q.device.type, q.dtype, q.shape[-1], needs_grad, v.shape[-1])
    name = backends.choose(backend, request)
    window = Window.of(validation.as_bool("causal", causal), window_size)
    return Call(name, window, defaults.softmax_scale(q.shape[-1], softmax_scale), needs_grad)
