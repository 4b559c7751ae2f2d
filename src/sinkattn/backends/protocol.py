"""What a backend implements: one protocol, and two optional parts its capabilities declare.

Every backend is a module with ``CAPABILITIES`` (``sinkattn.backends.capabilities``) and

    forward(q, k, v, batch, window, softmax_scale, for_backward) -> Partial
    backward(do, dlse, q, k, v, o, stats, sink_mass, batch, window, softmax_scale, partial) -> Gradients

**forward** computes, for each row, the softmax over its visible keys only, **without** the sink:
``Partial(o, stats)``, ``o [Tq, HQ, Dv]`` in ``CAPABILITIES.out_dtype`` and ``stats = Stats(m, log_l)
[HQ, Tq]`` in its base (``sinkattn.sink``, whose rule joins the sink once per call, for every backend).
A row that sees no key has ``o = 0`` and ``log_l = -inf`` (its ``m`` any value). The inputs are packed
(``q [Tq, HQ, D]``, ``k [Tk, HKV, D]``, ``v [Tk, HKV, Dv]``, contiguous; ``batch`` a ``Batch``); ``window`` a
folded ``sinkattn.masks.Window``. ``for_backward``: the statistics will serve a backward (the exact pair
``m``, ``log_l``; a backend may take a faster forward otherwise, and may refuse a backward it cannot run).

**backward** gets the final results of the rows: ``o`` and ``stats`` with the sink and every key of the
row included, ``sink_mass [HQ, Tq]`` (the sink's probability per row, ``sink.sink_mass``) or None without
sinks, ``do`` in q's dtype, ``dlse [HQ, Tq]`` or None. It returns fp32 (float64 for ``reference``) ``dq``,
``dk``, ``dv`` shaped like q, k, v, and the ``Delta [HQ, Tq] = <dO, o> - dlse`` it used (the sink's
gradient is formed from it once, in ``sinkattn.ops``). ``partial``: the call holds only some of its rows'
keys (a context-parallel tile), so ``Delta`` must come from ``o``.

Declared by ``CAPABILITIES`` (``tests/test_sink.py`` checks that what a backend declares and what it
implements agree):

* ``dense``: ``forward_dense(q, k, v, sinks, window, softmax_scale) -> Final | None``, a dense call
  without gradients whole, sink included, on ``q [B, Sq, HQ, D]`` and ``k``/``v [B, Sk, HKV, D]`` as they
  are (any strides): ``o [B, Sq, HQ, Dv]`` (any strides) and the final statistics and ``lse [HQ, B*Sq]``;
  None hands the call to ``forward`` packed.
* ``joins_sink``: ``join_sink(o, stats, sinks) -> Final | None``, the sink's rule on ``forward``'s own
  results computed the backend's own way (``o`` scaled in place); None leaves it to ``sinkattn.sink``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..masks import Window
from ..sink import Stats
from .capabilities import Batch, Capabilities

__all__ = ["Backend", "DenseForward", "SinkJoin", "Partial", "Final", "Gradients"]


class Partial(NamedTuple):
    """The softmax over a call's keys, without the sink."""

    o: torch.Tensor          # [Tq, HQ, Dv]
    stats: Stats             # [HQ, Tq]


class Final(NamedTuple):
    """A call's results, the sink joined."""

    o: torch.Tensor          # [Tq, HQ, Dv] (a dense call: [B, Sq, HQ, Dv])
    stats: Stats             # [HQ, Tq]
    lse: torch.Tensor        # fp32 [HQ, Tq], natural units


class Gradients(NamedTuple):
    dq: torch.Tensor         # like q
    dk: torch.Tensor         # like k
    dv: torch.Tensor         # like v
    delta: torch.Tensor      # [HQ, Tq]


@runtime_checkable
class Backend(Protocol):
    CAPABILITIES: Capabilities

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch, window: Window,
                softmax_scale: float, for_backward: bool) -> Partial: ...

    def backward(self, do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, o: torch.Tensor, stats: Stats, sink_mass: torch.Tensor | None, batch: Batch,
                 window: Window, softmax_scale: float, partial: bool) -> Gradients: ...


@runtime_checkable
class DenseForward(Protocol):
    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                      window: Window, softmax_scale: float) -> Final | None: ...


@runtime_checkable
class SinkJoin(Protocol):
    def join_sink(self, o: torch.Tensor, stats: Stats, sinks: torch.Tensor) -> Final | None: ...
