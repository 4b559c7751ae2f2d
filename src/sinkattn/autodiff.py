"""Which automatic differentiation sinkattn supports: reverse mode, once.

Its ops (and the context-parallel functions) have a backward that is not itself differentiable,
and no forward-mode rule. Each unsupported use is refused where it starts, with what to use
instead, rather than failing deep inside PyTorch or handing back zero or missing derivatives.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad

__all__ = ["refuse_unsupported", "refuse_transforms", "refuse_forward_ad", "refuse_double_backward"]


def refuse_unsupported(*tensors) -> None:
    """Refuse the ``torch.func`` transforms and forward-mode AD (a dual tensor among ``tensors``)."""
    refuse_transforms()
    refuse_forward_ad(*tensors)


def refuse_transforms() -> None:
    """Refuse a call inside a ``torch.func`` transform (grad, vjp, jacrev, vmap, jvp, ...)."""
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        transform = torch._C._functorch.peek_interpreter_stack().key().name
        raise NotImplementedError(f"sinkattn does not support torch.func transforms (grad, vjp, jacrev, vmap, "
                                  f"jvp, ...; here: {transform}): use reverse-mode autograd outside them, "
                                  f"loss.backward() or torch.autograd.grad")


def refuse_forward_ad(*tensors) -> None:
    """Refuse forward-mode AD: a tensor among ``tensors`` carrying a tangent."""
    if forward_ad._current_level >= 0 and any(
            t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError("sinkattn does not support forward-mode AD (torch.autograd.forward_ad, "
                                  "torch.func.jvp): use reverse mode, loss.backward() or torch.autograd.grad")


def refuse_double_backward() -> None:
    """Called first in a backward: grad mode on there means ``create_graph=True`` (a double backward)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError("sinkattn: double backward is not supported (its backward is not differentiable): "
                           "call backward / torch.autograd.grad without create_graph=True")
