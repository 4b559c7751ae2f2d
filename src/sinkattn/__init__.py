"""sinkattn: grouped-query attention with learnable per-head sinks, packed and dense,
causal and sliding-window, forward and backward, deterministic."""

from .interface import sink_attn_func, sink_attn_varlen_func

__all__ = ["sink_attn_func", "sink_attn_varlen_func"]
__version__ = "0.1.0"
