"""What every call settles once, before any work: the backend, the window, the scale, whether a
backward will follow, whether ``lse`` is returned, and the bounds of the lengths. The public functions
and context parallelism both start here."""

from __future__ import annotations

import functools
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
    return_lse: bool = False
    max_seqlen_q: int = 0       # bounds of the lengths, at most the token counts (ints or SymInts)
    max_seqlen_k: int = 0


_choose = functools.lru_cache(maxsize=64)(backends.choose)
"""``backends.choose`` of a name and a ``Request`` (both hashable): it reads only declarations."""


def _at_most(bound, count):
    """``min(bound, count)`` of ints or SymInts, without a guard on symbolic ones (``torch.sym_min``);
    plain ints take ``min``, since torch 2.11's Dynamo refuses ``torch.sym_min`` of two ints."""
    if isinstance(bound, torch.SymInt) or isinstance(count, torch.SymInt):
        return torch.sym_min(bound, count)
    return min(bound, count)


def settle(q, k, v, sinks, softmax_scale, causal, window_size, backend, return_lse=False, max_seqlen_q=None,
           max_seqlen_k=None) -> Call:
    """The ``Call`` of checked arguments (``validation.check_options``): refuses ``torch.func``
    transforms and forward-mode AD, picks the backend (NotImplementedError with the reason if it
    cannot take the call). ``max_seqlen_*``: a packed call's bounds (a bound past the token count bounds
    no more than it, and then fits the op's int64); None: a dense call's, its lengths. Reads shapes and
    Python values only, so it traces without a graph break."""
    autodiff.refuse_unsupported(q, k, v, sinks)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        sinks is not None and sinks.requires_grad))
    request = backends.Request(q.device.type, q.dtype, q.shape[-1], needs_grad, v.shape[-1])
    cached = type(backend) is str and not torch.compiler.is_compiling()    # dynamo traces the choice itself
    name = _choose(backend, request) if cached else backends.choose(backend, request)
    window = Window.of(validation.as_bool("causal", causal), window_size)
    if max_seqlen_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    else:
        max_seqlen_q, max_seqlen_k = _at_most(max_seqlen_q, q.shape[0]), _at_most(max_seqlen_k, k.shape[0])
    return Call(name, window, defaults.softmax_scale(q.shape[-1], softmax_scale), needs_grad,
                validation.as_bool("return_lse", return_lse), max_seqlen_q, max_seqlen_k)
