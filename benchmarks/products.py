"""Matrix products on this CPU: what a faster bf16 path of the cpu backend could be built on, one run.

    python benchmarks/products.py [--quick] [--repeats N] [--threads N] [--json FILE]

The cpu backend multiplies in fp32 for every input dtype. A bf16 path needs products of bf16
operands with fp32 results (scores rounded to bf16 would cost Gate A). Per product shape of the
backend's tiles (4 KV heads, ``G*R = 256`` stacked rows, ``C = 256`` keys, ``D = 64``) and one large
square, this times, against fp32 ``torch.matmul`` in the same repeats:

* ``bf16_out``: ``torch.matmul`` of bf16 tensors. Its result is bf16, so the backend cannot use it;
  it shows what the CPU's bf16 units give PyTorch;
* ``bf16_mode``: fp32 tensors under ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` (oneDNN
  multiplies bf16-rounded operands and accumulates in fp32 where the CPU allows it).
  ``rounds`` says whether it did here, on operands that are not bf16 values: the result is then the
  product of the rounded operands, not the fp32 product (where it is not, the mode ran in fp32);
* ``mkl_bf16``: MKL's ``cblas_gemm_bf16bf16f32`` (bf16 operands, fp32 result) from PyTorch's own
  library through ``ctypes``, one call per head, where that library exports it.

Operands are bf16 values (as the backend's would be for bf16 inputs), so every variant but
``bf16_out`` must give the fp32 product up to fp32 rounding; ``max_error`` is checked against it.
Prints GFLOP/s and the ratio to fp32 (above 1: faster); asserts nothing about speed.
"""

from __future__ import annotations

import ctypes
import os
import statistics

import torch

from sinkattn.testing import bench

SHAPES = {             # name: (batch, M, K, N) of [batch, M, K] @ [batch, K, N]
    "scores Q K^T": (4, 256, 64, 256),
    "P V / dS K": (4, 256, 256, 64),
    "dS^T Q / P^T dO": (4, 256, 256, 64),
    "square 512": (1, 512, 512, 512),
}
QUICK_SHAPES = {"scores Q K^T": (2, 64, 32, 64), "P V / dS K": (2, 64, 64, 32)}


def _mkl_gemm():
    """MKL's ``cblas_gemm_bf16bf16f32`` from libtorch_cpu, or None where it is not exported."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = ctypes.CDLL(path).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i64, f32, ptr = ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]
    fn.restype = None
    return fn


def _mkl_matmul(fn, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[batch, M, K] @ [batch, K, N]`` of contiguous bf16 tensors -> fp32, one row-major call per matrix."""
    batch, M, K = a.shape
    N = b.shape[-1]
    c = torch.empty(batch, M, N)
    for i in range(batch):
        fn(101, 111, 111, M, N, K, 1.0, a[i].data_ptr(), K, b[i].data_ptr(), N, 0.0, c[i].data_ptr(), N)
    return c


def _bf16_mode(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        return torch.matmul(a, b)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before


def _mode_rounds(batch: int, M: int, K: int, N: int, g: torch.Generator) -> bool:
    """Whether ``bf16_mode`` multiplies bf16-rounded operands for this shape: on operands that are not
    bf16 values its result is then nearer the product of the rounded operands than the fp32 product."""
    a, b = torch.randn(batch, M, K, generator=g), torch.randn(batch, K, N, generator=g)
    result = _bf16_mode(a, b).double()
    rounded = torch.matmul(a.bfloat16().double(), b.bfloat16().double())
    return bool((result - rounded).abs().max() < (result - torch.matmul(a.double(), b.double())).abs().max())


def _variants(a16: torch.Tensor, b16: torch.Tensor, mkl) -> dict:
    """The products of ``a16 @ b16`` (bf16 values) by variant, as callables."""
    a, b = a16.float(), b16.float()
    variants = {"fp32": lambda: torch.matmul(a, b), "bf16_out": lambda: torch.matmul(a16, b16),
                "bf16_mode": lambda: _bf16_mode(a, b)}
    if mkl is not None:
        variants["mkl_bf16"] = lambda: _mkl_matmul(mkl, a16, b16)
    return variants


def measure(shapes: dict, repeats: int, calls: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    mkl = _mkl_gemm()
    rows = []
    for name, (batch, M, K, N) in shapes.items():
        a16, b16 = torch.randn(batch, M, K, generator=g).bfloat16(), torch.randn(batch, K, N, generator=g).bfloat16()
        a, b = a16.float(), b16.float()
        exact = torch.matmul(a.double(), b.double())
        fp32_error = float((torch.matmul(a, b).double() - exact).abs().max())
        variants = _variants(a16, b16, mkl)
        steps = {key: (lambda f=f: [f() for _ in range(calls)]) for key, f in variants.items()}
        samples = bench.time_repeats(steps, repeats)
        flop = 2.0 * batch * M * K * N
        seconds = {key: statistics.median(s) / calls for key, s in samples.items()}
        errors = {key: float((f().double() - exact).abs().max()) for key, f in variants.items()}
        rows.append(dict(
            product=name, shape=dict(batch=batch, M=M, K=K, N=N), seconds=seconds,
            samples={key: [t / calls for t in s] for key, s in samples.items()},
            gflops={key: flop / t / 1e9 for key, t in seconds.items()},
            speed_vs_fp32={key: seconds["fp32"] / t for key, t in seconds.items()},
            max_error=errors, fp32_max_error=fp32_error, rounds=_mode_rounds(batch, M, K, N, g),
        ))
    return rows


def main(argv=None):
    ap = bench.script_parser(__doc__, repeats=7, quick="tiny shapes, 2 repeats")
    args = bench.parse_script_args(ap, argv)
    shapes, repeats, calls = (QUICK_SHAPES, 2, 2) if args.quick else (SHAPES, args.repeats, 20)
    rows = measure(shapes, repeats, calls)
    info = bench.header()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"mkldnn bf16 device support: {torch.backends.mkldnn.is_available()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    for r in rows:
        s = r["shape"]
        cells = " | ".join(f"{key} {r['gflops'][key]:6.1f} GFLOP/s ({r['speed_vs_fp32'][key]:.2f}x)"
                           for key in r["seconds"])
        print(f"[{r['product']:16s}] {s['batch']}x[{s['M']}x{s['K']}]@[{s['K']}x{s['N']}]  {cells}  "
              f"| bf16_mode rounds operands: {r['rounds']}")
    bench.write_json(args.json, dict(header=info, rows=rows))
    return rows


if __name__ == "__main__":
    main()
