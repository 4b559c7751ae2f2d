"""Gate A over random packed batches with plain and with compensated low-precision products.

    python benchmarks/compensated.py [--backend triton|cpu|cpu-kernel] [--seeds 32] [--threads N]
                                      [--json FILE] [--quick]

The batches are those of the Triton random table of ``tests/test_varlen_gate_a.py`` (seeds 0..N-1,
``cases.random_packed`` at ``cases.INTERPRETER_RANDOM`` sizes), run through the interpreter
when there is no GPU. For fp16 and bf16, each with ``COMPENSATED = False`` and ``True``: how many
batches fail Gate A, which ones, and per tensor the worst ratio and largest error over all batches.
The wall time of the checks (golden included) is printed for CI's budget; an interpreter time says
nothing about GPU speed, and nothing else is timed (no ``--repeats``). Asserts nothing.

``--backend cpu`` asks what a bf16 path of the cpu backend built on bf16 x bf16 -> fp32 products (AMX,
AVX512-BF16) would give up, before one is built. The backend multiplies in fp32; here the tile
products of its PyTorch-op path (``SINKATTN_CPU_KERNEL=python`` for the duration) are handed bf16
operands instead, as such a product reads them: ``q``, ``k``, ``v``, ``dO``
are bf16 values already, ``P`` and ``dS`` are rounded to bf16 (plain), or ``P`` is rounded in ``P V``
and split ``hi + lo`` (each bf16) in ``P^T dO`` and ``dS`` in ``dS K`` and ``dS^T Q`` (compensated).
bf16 only (fp16 operands are not bf16 values); batches of 1-4 sequences of 0-160 tokens.

``--backend cpu-kernel`` runs the same batches through the compiled kernel (``cpu_native``) with its fp32
products and with the bf16 products that were built on that finding (``SINKATTN_CPU_PRODUCTS``: ``P``
rounded in ``P V``, ``P`` and ``dS`` as ``hi + lo`` in the backward's products).
"""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
from unittest import mock  # noqa: E402

from sinkattn.backends import cpu_small, cpu_tiles  # noqa: E402
from sinkattn.backends import triton as triton_backend  # noqa: E402
from sinkattn.testing import bench, cases, verify  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CPU_SIZES = dict(max_seqs=4, max_len=160)
"""``random_packed`` sizes of the ``--backend cpu`` batches."""


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def _hi_lo(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = _bf16(x)
    return hi, _bf16(x - hi)


def _triton_products(compensated: bool):
    return mock.patch.object(triton_backend, "COMPENSATED", compensated)


@contextlib.contextmanager
def _cpu_bf16_operands(compensated: bool):
    """The cpu backend's tile products with bf16 operands (see the module doc), for the duration."""
    products, pv = cpu_tiles.block_products, cpu_tiles._pv

    def bf16_products(p, ds, qs, kb, dos, mask, literal=False):
        if not compensated:
            return products(_bf16(p), _bf16(ds), qs, kb, dos, mask, literal)
        (p_hi, p_lo), (ds_hi, ds_lo) = _hi_lo(p), _hi_lo(ds)
        hi, lo = products(p_hi, ds_hi, qs, kb, dos, mask, literal), products(p_lo, ds_lo, qs, kb, dos, mask, literal)
        return tuple(a.add_(b) for a, b in zip(hi, lo))

    cpu_tiles.block_products = cpu_small.block_products = bf16_products
    cpu_tiles._pv = lambda p, vb, mask, literal: pv(_bf16(p), vb, mask, literal)
    try:
        # the PyTorch-op tiles, whose products these are
        with mock.patch.dict(os.environ, SINKATTN_CPU_KERNEL="python"):
            yield
    finally:
        cpu_tiles.block_products = cpu_small.block_products = products
        cpu_tiles._pv = pv


def _kernel_products(bf16: bool):
    """The compiled kernel with its bf16 products (or its fp32 ones), for the duration."""
    return mock.patch.dict(os.environ, SINKATTN_CPU_KERNEL="compiled", SINKATTN_CPU_PRODUCTS="bf16" if bf16 else "fp32")


SUBJECTS = {"triton": (_triton_products, DTYPES, cases.INTERPRETER_RANDOM, DEVICE),
            "cpu": (_cpu_bf16_operands, {"bf16": torch.bfloat16}, CPU_SIZES, "cpu"),
            "cpu-kernel": (_kernel_products, {"bf16": torch.bfloat16}, CPU_SIZES, "cpu")}
"""Per ``--backend``: how its products are switched, its dtypes, batch sizes and device."""
LABELS = {"cpu-kernel": ("fp32 products", "bf16 products")}
"""Per ``--backend``, the names of its two settings (default: plain and compensated products)."""


def measure(backend: str, dtype: torch.dtype, compensated: bool, seeds: int) -> dict:
    products, _, sizes, device = SUBJECTS[backend]
    worst: dict[str, dict] = {}
    failed = []
    start = time.perf_counter()
    for seed in range(seeds):
        case = cases.random_packed(seed, dtype=dtype, **sizes)
        with products(compensated):
            result = verify.run_case(case, backend.removesuffix("-kernel"), device=device)
        if result.error:
            raise RuntimeError(f"{case.name}: {result.error}")
        if not result.passed:
            failed.append({"case": case.name, "tensors": {r.name: round(r.ratio, 4) for r in result.reports
                                                          if not r.accepted}})
        for r in result.reports:
            w = worst.setdefault(r.name, {"min_ratio": 1.0, "max_abs_err": 0.0})
            w["min_ratio"] = min(w["min_ratio"], r.ratio)
            w["max_abs_err"] = max(w["max_abs_err"], r.max_abs_err)
    return {"dtype": str(dtype).removeprefix("torch."), "compensated": compensated, "seeds": seeds,
            "failed": len(failed), "wall_s": round(time.perf_counter() - start, 1), "worst": worst,
            "failures": failed}


def main(argv=None) -> dict:
    ap = bench.script_parser(__doc__, repeats=None, quick="smoke run: one seed (--seeds 1)")
    ap.add_argument("--seeds", type=int, default=32)
    ap.add_argument("--backend", choices=list(SUBJECTS), default="triton",
                    help="whose products: the Triton kernels' (default), the cpu backend's given bf16 operands, "
                         "or the compiled CPU kernel's fp32 and bf16 products")
    args = bench.parse_script_args(ap, argv)
    seeds = 1 if args.quick else args.seeds
    _, dtypes, _, device = SUBJECTS[args.backend]
    rows = []
    for name, dtype in dtypes.items():
        for compensated in (False, True):
            row = measure(args.backend, dtype, compensated, seeds)
            rows.append(row)
            worst = "  ".join(f"{t} {w['min_ratio']:.4f}" for t, w in row["worst"].items())
            label = LABELS.get(args.backend, ("plain", "compensated"))[compensated]
            print(f"{name} {label:13s}: {row['failed']:3d} of "
                  f"{seeds} fail Gate A  (worst ratio: {worst})  [{row['wall_s']} s, {device}]")
            for f in row["failures"]:
                print(f"    {f['case']}: {f['tensors']}")
    report = {"header": {**bench.header(device), "interpreter": args.backend == "triton" and device != "cuda"},
              "command": "python benchmarks/compensated.py" + (f" --backend {args.backend}"
                                                               if args.backend != "triton" else "")
                         + f" --seeds {seeds}" + (f" --threads {args.threads}" if args.threads else ""),
              "backend": args.backend, "rows": rows}
    bench.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
