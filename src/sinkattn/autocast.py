"""sinkattn under ``torch.autocast``: attention is on autocast's lower-precision list, as SDPA is.

Inside an autocast region of q's device type, q, k and v are cast to the region's dtype whatever
mix of fp16 / bf16 / fp32 they arrive in (differentiable casts: gradients reach the originals in
their own dtypes); ``out`` then comes back in that dtype and ``lse`` stays fp32. The sinks are
not cast: they keep their dtype, and so does their gradient. Outside autocast nothing changes
(a dtype mix stays an error).
"""

from __future__ import annotations

import torch

__all__ = ["autocast_inputs"]

_CAST = (torch.float16, torch.bfloat16, torch.float32)


def autocast_inputs(q, k, v):
    """``(q, k, v)`` cast to the autocast dtype of q's device type when autocast is enabled there,
    else unchanged; tensors of other dtypes (and non-tensors) are left for validation to refuse."""
    device_type = q.device.type if isinstance(q, torch.Tensor) else None
    if device_type is None or not torch.amp.is_autocast_available(device_type) or \
            not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _CAST else t for t in (q, k, v))
