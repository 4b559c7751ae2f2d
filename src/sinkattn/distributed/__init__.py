"""Context parallelism over ``torch.distributed``: each rank of a group holds a shard of every
sequence and gets its shard of the single-process ``sinkattn`` result and gradients.

* ``shard`` / ``unshard`` (dense, along a dim), ``shard_varlen`` / ``unshard_varlen`` (packed):
  ``layout="contiguous"`` gives rank ``r`` chunk ``r`` of P; ``layout="zigzag"`` chunks ``r``
  and ``2P-1-r`` of 2P, which balances causal work.
* ``sink_attn_func`` / ``sink_attn_varlen_func``: the public functions of ``sinkattn`` on shards,
  self-attention only, with ``group=`` (default: the default group), ``method="ring"`` (K/V
  shards passed around the group, see ``ring``) or ``"ulysses"`` (all-to-all to head shards,
  see ``ulysses``), and ``layout=``.

Gradients: dq/dk/dv are this rank's shards of the full gradients; ``sinks.grad`` on each rank is
that rank's contribution, and their sum over the group is the full gradient (the data-parallel
all-reduce of the group sums it, as for every replicated parameter). Before any other
communication every rank's shapes, dtype, device type and options are compared exactly by one
``all_gather`` of a small descriptor, and the packing's lengths by a second one; a mismatch or
bad input raises the same error on every rank (``shard`` and its twins check the same way).
Under ``torch.autocast`` q, k and v are cast to its dtype (``sinkattn.autocast``). Results are
bitwise reproducible for a fixed group size and layout.
"""

from .api import METHODS, sink_attn_func, sink_attn_varlen_func
from .layout import LAYOUTS
from .shards import shard, shard_varlen, unshard, unshard_varlen

__all__ = ["sink_attn_func", "sink_attn_varlen_func", "shard", "unshard", "shard_varlen", "unshard_varlen",
           "METHODS", "LAYOUTS"]
