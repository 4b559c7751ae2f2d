"""Compile every Triton kernel for real GPU targets (sm_80, sm_90) without a GPU.

Run as a script, outside the interpreter (``TRITON_INTERPRET`` unset): the
interpreter accepts code the GPU compiler rejects (globals that are not
constexpr, for one), so this is the check that the kernels build for hardware.
Prints one line per (dtype, arch, head dim) and exits non-zero on any failure.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sinkattn.backends.triton import kernels

SCALARS_FP32 = ("scale_log2", "softmax_scale")


def _signature(fn, pointers, constexprs):
    return {name: "constexpr" if name in constexprs else pointers.get(name) or
            ("fp32" if name in SCALARS_FP32 else "i32") for name in fn.arg_names}


def _compile(fn, pointers, constexprs, arch):
    src = ASTSource(fn=fn, signature=_signature(fn, pointers, constexprs), constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4, num_stages=2))


def main(configs):
    for dt, arch, D in configs:
        block_d = max(16, triton.next_power_of_2(D))
        BM, BN = (64, 32) if D <= 128 else (32, 16)
        ptrs = {n: f"*{dt}" for n in ("Q", "K", "V", "DO")}
        ptrs.update({n: "*fp32" for n in ("SINKS", "O", "LSE", "M2", "L2", "DELTA", "DK", "DV", "DQ", "DLSE")})
        ptrs.update(CU_Q="*i32", CU_K="*i32")
        common = dict(G=4, BLOCK_D=block_d, BM=BM, BN=BN, PRECISION="ieee" if dt == "fp32" else "tf32",
                      COMPENSATED=dt != "fp32", UPCAST=False)
        _compile(kernels.fwd_kernel, ptrs, common, arch)
        _compile(kernels.dkdv_kernel, ptrs, common, arch)
        for exact in (False, True):
            _compile(kernels.dq_kernel, ptrs, dict(common, EXACT_DELTA=exact, HAS_DLSE=exact), arch)
        _compile(kernels.delta_kernel, ptrs, dict(HAS_DLSE=True, BLOCK_T=64, BLOCK_D=block_d), arch)
        print(f"compiled {dt} sm_{arch} D={D}", flush=True)


if __name__ == "__main__":
    configs = [(dt, int(arch), int(D)) for dt, arch, D in (c.split(":") for c in sys.argv[1:])]
    main(configs or [("fp16", 90, 64), ("bf16", 80, 128), ("fp32", 90, 80), ("fp16", 80, 256)])
