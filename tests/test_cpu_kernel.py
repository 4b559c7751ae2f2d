"""The CPU backend's two ways to its tiles: the compiled kernel (``cpu_native``, built on first use) and
the PyTorch-op tiles (``cpu_tiles``: no compiler, ``SINKATTN_CPU_KERNEL=python``, inputs holding NaN or
inf). Both meet the standard on the same cases (``harness.tables.KERNEL``; the compiled kernel's bf16
products on ``KERNEL_BF16``): Gate A in the matrix, test_varlen_gate_a.py. Here: their bits (split
backward, thread counts, packing), ``SINKATTN_CPU_KERNEL`` and ``SINKATTN_CPU_PRODUCTS`` choosing between
them, and a build that cannot happen reported, never silently wrong."""

import json
import os
import subprocess
import sys

import pytest
import torch

import sinkattn
from sinkattn.backends import cpu_native, cpu_small, cpu_tiles
from sinkattn.masks import Window
from sinkattn.testing import cases, verify
from harness import tables

COMPILER = cpu_native.compiler() is not None
KERNEL_CASES = tables.KERNEL
C = tables.C


@pytest.fixture
def kernel(monkeypatch):
    """Set ``SINKATTN_CPU_KERNEL`` (and other variables) for the test, with ``cpu_native`` loading afresh."""
    monkeypatch.setattr(cpu_native, "_state", {})

    def choose(value, **env):
        monkeypatch.setenv("SINKATTN_CPU_KERNEL", value)
        for name, setting in env.items():
            monkeypatch.setenv(name, setting)
    return choose


def _recorded(calls: list, real, name: str):
    def recorded(*a, **kw):
        calls.append(name)
        return real(*a, **kw)
    return recorded


def _tile_calls(monkeypatch) -> list:
    """The PyTorch-op paths' calls from now on, by name (``cpu_tiles.forward``, ...)."""
    calls = []
    for module in (cpu_tiles, cpu_small):
        for name in ("forward", "backward"):
            monkeypatch.setattr(module, name, _recorded(calls, getattr(module, name), f"{module.__name__}.{name}"))
    return calls


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler: the CPU backend runs its PyTorch-op tiles")
def test_the_kernel_is_built_and_takes_training_calls(kernel, monkeypatch):
    kernel("auto")
    assert cpu_native.available()
    assert cpu_native.describe().startswith(f"compiled kernel ({torch.backends.cpu.get_cpu_capability()}, ")
    assert cpu_native.library_path().exists()
    calls = _tile_calls(monkeypatch)
    verify.outputs(KERNEL_CASES[0], KERNEL_CASES[0].make(), "cpu")
    assert calls == []


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler")
def test_the_products_setting_chooses_the_products(kernel, monkeypatch):
    """bf16 products change the bits of bf16 calls (``P`` is rounded in ``P V``) and of nothing else; ``auto``
    takes them where bf16 products run on AMX tiles (the CPU has them, PyTorch and oneMKL not held below)."""
    kernel("compiled")
    bf16, fp32 = (cases.random_packed(4, max_len=150, dtype=dtype) for dtype in (torch.bfloat16, torch.float32))
    got = {}
    for products in ("fp32", "bf16", "auto"):
        monkeypatch.setenv("SINKATTN_CPU_PRODUCTS", products)
        got[products] = [verify.outputs(c, c.make(), "cpu") for c in (bf16, fp32)]
    same = {name: [all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(got["fp32"], results)]
            for name, results in got.items()}
    assert same["bf16"] == [False, True]
    assert same["auto"] == [not cpu_native._matrix_units(), True]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert cpu_native.bf16_products(bf16.make().q) and not cpu_native.bf16_products(fp32.make().q)
    assert cpu_native.describe().endswith("bf16 inputs: bf16 products)")
    for held, amx in (("AVX512_E4", True), ("AVX512_E3", False), ("AVX2", False)):   # oneMKL's ceiling
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", held)
        assert cpu_native.bf16_products(bf16.make().q) == amx, held
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")      # held below AVX512
    assert not cpu_native.bf16_products(bf16.make().q)


SPLIT_CASES = KERNEL_CASES + [cases.random_packed(seed, max_len=300) for seed in (13, 15)]


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in SPLIT_CASES])
def test_the_split_backward_gives_the_fused_backwards_bits(case, kept, kernel, monkeypatch):
    """The backward's two passes (dQ by row block, then dK/dV by chunk of keys: more tasks for more threads)
    against its one fused pass: the same bits, with each row block's P, dP kept or recomputed (where the
    dominant-key correction is folded into dS, or added after the products), in fp32 and bf16 products."""
    from sinkattn.backends import cpu
    kernel("compiled", SINKATTN_CPU_PRODUCTS="bf16")
    if not kept:
        monkeypatch.setattr(cpu_tiles, "KEPT_ELEMENTS", 1)
    x = case.make()
    got = []
    for split in (1, 2):
        monkeypatch.setattr(cpu, "BACKWARD_SPLIT", split)
        got.append(verify.outputs(case, x, "cpu"))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def _kernel_call(ops, L, HQ, D, seed, bf16):
    """The compiled forward and (fused) backward of one causal sequence with one KV head, fp32 results
    (the public API would round them to bf16, hiding a difference in their last bits)."""
    from sinkattn.backends import cpu
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(L, HQ, D, generator=g).bfloat16().float() for _ in range(2))
    k, v = (torch.randn(L, 1, D, generator=g).bfloat16().float() for _ in range(2))
    cu_q, cu_k, bounds, skip = cpu._native_of((0, L), (0, L), Window(-1, 0), HQ).sequences
    row, post = cpu._scales(D ** -0.5)
    o, m, log_l = torch.empty(L, HQ, D), torch.empty(HQ, L), torch.empty(HQ, L)
    ops.forward(q, k, v, cu_q, cu_k, bounds, skip, row, post, cpu.NATIVE_BM, cpu_tiles.BN, bf16, o, m, log_l)
    dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty(HQ, L)
    ops.backward(do, q, k, v, m, log_l, delta, torch.empty(0), torch.empty(0), cu_q, cu_k, bounds, skip, row, post,
                 D ** -0.5, True, cpu.NATIVE_BM, cpu_tiles.BN, cpu_tiles.KEPT_ELEMENTS, bf16, 1, dq, dk, dv)
    return [o, m, log_l, dq, dk, dv, delta]


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-products", "bf16-products"])
def test_a_call_of_one_task_gives_the_same_fp32_bits_for_any_thread_count(bf16, kernel):
    """One sequence, one KV head, one chunk of keys: the backward is one task, run outside a parallel region,
    whose products must still run on its one thread (oneMKL threads a GEMM called there otherwise, and its
    sums then differ in the last bits of a few elements)."""
    kernel("compiled")
    ops = cpu_native.load()
    before = torch.get_num_threads()
    try:
        for seed, (L, HQ) in enumerate([(60, 2), (120, 1), (200, 4), (40, 2), (250, 4), (100, 2)]):
            torch.set_num_threads(1)
            one = _kernel_call(ops, L, HQ, 16, seed, bf16)
            torch.set_num_threads(2)
            two = _kernel_call(ops, L, HQ, 16, seed, bf16)
            assert all(torch.equal(a, b) for a, b in zip(one, two)), (L, HQ, seed)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("products,case", [
    ("fp32", cases.random_packed(5, max_len=250, dtype=torch.float32)),
    ("bf16", cases.random_packed(5, max_len=250, dtype=torch.bfloat16)),
    ("fp32", C("L2", 2, 2, (300,), D=32, causal=True, dtype=torch.float32)),   # one task: split passes above 1
    ("bf16", C("L2", 2, 2, (300,), D=32, causal=True, dtype=torch.bfloat16)),
], ids=["fp32", "bf16", "one-kv-head", "one-kv-head-bf16"])
def test_the_kernel_gives_the_same_bits_for_any_thread_count(threads, products, case, kernel):
    """Each task (a sequence's key-value head, one row block of it, or a chunk of its keys) is one thread's,
    in a fixed order, its products too (oneMKL, which takes the bf16 ones, would thread a call made outside
    a parallel region: a call of one task)."""
    kernel("compiled", SINKATTN_CPU_PRODUCTS=products)
    x = case.make()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = verify.outputs(case, x, "cpu")
        torch.set_num_threads(threads)
        other = verify.outputs(case, x, "cpu")
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, other))


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("name,value,message", [
    ("SINKATTN_CPU_KERNEL", "fast", "SINKATTN_CPU_KERNEL='fast': expected one of auto, compiled, python"),
    ("SINKATTN_CPU_PRODUCTS", "amx", "SINKATTN_CPU_PRODUCTS='amx': expected one of auto, fp32, bf16")])
def test_a_wrong_setting_is_refused_on_every_path(name, value, message, grad, sinks, kernel):
    """Training and inference, with and without sinks, and the products setting on the PyTorch-op path too."""
    kernel("python" if name == "SINKATTN_CPU_PRODUCTS" and not grad else "auto", **{name: value})
    q = torch.randn(1, 40, 4, 16, requires_grad=grad)
    k, v = torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    with pytest.raises(ValueError, match=message):
        sinkattn.sink_attn_func(q, k, v, sinks=torch.zeros(4) if sinks else None, causal=True)


_CHILD = """
import json, warnings, torch, sinkattn
from sinkattn.backends import cpu_native
warnings.simplefilter("always")
def call():
    q = torch.randn(1, 40, 4, 16, requires_grad=True)
    k, v = torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    sinkattn.sink_attn_func(q, k, v, sinks=torch.zeros(4), causal=True).sum().backward()
    return bool(q.grad.isfinite().all())
with warnings.catch_warnings(record=True) as caught:
    try:
        finite = [call(), call()]
    except RuntimeError as error:
        finite = str(error)
print(json.dumps({"finite": finite, "path": cpu_native.describe(),
                  "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}))
"""


def _fresh_process(tmp_path, mode, compiler, **env):
    """A first call in a new process (the kernel is loaded once per process) with this mode and ``CXX``
    (and other variables: ``None`` removes one)."""
    env = {**os.environ, "SINKATTN_CPU_KERNEL": mode, "CXX": str(compiler),
           "SINKATTN_CACHE": str(tmp_path / "cache"), **env}
    env = {name: value for name, value in env.items() if value is not None}
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode >= 0, f"killed by signal {-run.returncode}: {run.stderr[-3000:]}"
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


RECORD = 56     # what a library ends with (cpu_native): magic (16 bytes), the body's length (8), its sha256 (32)


def _damaged(data: bytes, how: str) -> bytes:
    """A library's bytes as an interrupted copy, a full disk, a bad sector or an older sinkattn leaves them."""
    if how == "third":
        return data[:len(data) // 3]
    if how == "empty":
        return b""
    if how == "flipped":
        middle = len(data) // 2
        return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:]
    assert how == "unrecorded"          # sinkattn before the record: the library alone
    return data[:-RECORD]


@pytest.fixture(scope="module")
def built_library():
    """The bytes of this machine's library (built in this run's cache if it is not there yet)."""
    if not COMPILER:
        pytest.skip("no C++ compiler")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_native, "_state", {})
        patch.setenv("SINKATTN_CPU_KERNEL", "compiled")
        cpu_native.load()
    path = cpu_native.library_path()
    assert cpu_native._damage(path) is None, path          # a build's record vouches for it
    return path.read_bytes()


def _stand_in_compiler(tmp_path, built_library, together=1):
    """A compiler that "builds" by copying this machine's real build (without its record, as a compiler
    writes it), once ``together`` builds have started (or a minute has passed), and counts its builds in
    ``tmp_path/builds``: the tests do not compile."""
    (tmp_path / "body.so").write_bytes(built_library[:-RECORD])
    compiler = tmp_path / "stand-in-c++"
    compiler.write_text(f"#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = -o ] && out=$2; shift; done\n"
                        f"touch {tmp_path}/started.$$; i=0\n"
                        f"while [ $(ls {tmp_path} | grep -c ^started) -lt {together} ] && [ $i -lt 600 ]; do\n"
                        f"    sleep 0.1; i=$((i + 1)); done\n"
                        f"echo built >> {tmp_path / 'builds'}\ncp {tmp_path / 'body.so'} \"$out\"\n")
    compiler.chmod(0o755)
    return compiler


@pytest.mark.parametrize("mode", ["auto", "compiled"])
@pytest.mark.parametrize("how", ["third", "empty", "flipped", "unrecorded"])
def test_a_damaged_library_is_never_loaded(how, mode, built_library, tmp_path):
    """A library in the cache that its record does not vouch for (cut short, emptied, bytes changed, or
    without a record) is not loaded: in ``auto`` it is built again (a stand-in compiler copies this
    machine's real build, so the test does not compile) with one warning; in ``compiled`` the call
    raises, naming the file and the fix. The process is never killed (dlopen of a library cut short:
    SIGBUS)."""
    path = tmp_path / "cache" / cpu_native.library_path().name
    path.parent.mkdir()
    path.write_bytes(_damaged(built_library, how))
    got = _fresh_process(tmp_path, mode, _stand_in_compiler(tmp_path, built_library))
    if mode == "auto":
        assert got["finite"] == [True, True] and got["path"].startswith("compiled kernel ("), got
        assert len(got["warnings"]) == 1 and f"{path} is damaged" in got["warnings"][0], got
        assert (tmp_path / "builds").read_text() == "built\n"
        assert path.read_bytes() == built_library          # built again, with its record
    else:
        assert isinstance(got["finite"], str) and f"{path} is damaged" in got["finite"], got
        assert "delete it" in got["finite"] and "SINKATTN_CPU_KERNEL=auto" in got["finite"], got
        assert not (tmp_path / "builds").exists() and path.read_bytes() == _damaged(built_library, how)


def test_compiled_mode_without_a_compiler_raises(tmp_path):
    got = _fresh_process(tmp_path, "compiled", tmp_path / "no-such-compiler")
    assert got["finite"].startswith("SINKATTN_CPU_KERNEL=compiled, but the compiled CPU kernel is not available: "
                                    "no C++ compiler"), got


@pytest.mark.parametrize("missing", ["CXX", "PATH"])
def test_auto_mode_without_a_compiler_warns_once_and_runs_the_tiles(missing, tmp_path):
    """``CXX`` naming no compiler, or no ``c++`` on ``PATH``: the slower PyTorch-op tiles run, and the first
    call says so, naming the fixes; ``SINKATTN_CPU_KERNEL=python`` chooses them quietly."""
    env = {"CXX": "/nonexistent"} if missing == "CXX" else {"CXX": None, "PATH": str(tmp_path)}
    got = _fresh_process(tmp_path, "auto", None, **env)
    assert got["finite"] == [True, True] and len(got["warnings"]) == 1, got
    said = got["warnings"][0]
    assert said.startswith("sinkattn: no C++ compiler (" + ("CXX='/nonexistent'" if missing == "CXX" else
                                                           "'c++' not found on PATH")), said
    for fix in ("slower", "install a C++ compiler", "set CXX", "set SINKATTN_CPU_KERNEL=python"):
        assert fix in said, (fix, said)
    assert got["path"].startswith("PyTorch-op tiles (compiled kernel unavailable: no C++ compiler"), got
    quiet = _fresh_process(tmp_path, "python", None, **env)
    assert quiet["finite"] == [True, True] and quiet["warnings"] == [], quiet


def test_auto_mode_with_a_failing_build_warns_once_and_runs_the_tiles(tmp_path):
    failing = tmp_path / "broken-c++"
    failing.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    failing.chmod(0o755)
    got = _fresh_process(tmp_path, "auto", failing)
    assert got["finite"] == [True, True], got
    assert len(got["warnings"]) == 1 and "the build failed" in got["warnings"][0], got
    log = next((tmp_path / "cache").glob("*.log")).read_text()
    assert "this compiler is broken" in log and str(cpu_native.SOURCE) in log


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler")
def test_a_fresh_process_builds_into_its_cache_and_the_next_one_loads_it(tmp_path):
    """A user's first call, an inference call too, compiles (into ``SINKATTN_CACHE``) and says so once, on
    stderr (the ``sinkattn`` logger's warning, with no logging set up); a second process finds the library
    there and says nothing."""
    child = ("import sinkattn, torch\n"
             "from sinkattn.backends import cpu_native\n"
             "q = torch.randn(1, 8, 2, 8)\n"
             "sinkattn.sink_attn_func(q, q, q, causal=True)\n"
             "q.requires_grad_()\n"
             "sinkattn.sink_attn_func(q, q.detach(), q.detach(), causal=True).sum().backward()\n"
             "print(cpu_native.describe())\n")
    env = dict(os.environ, SINKATTN_CACHE=str(tmp_path / "cache"), SINKATTN_CPU_KERNEL="auto")
    built, said = [], []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.startswith("compiled kernel ("), run.stdout
        built.append({p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()})
        said.append([line for line in run.stderr.splitlines() if "sinkattn" in line])
    assert len(built[0]) == 1 and built[1] == built[0]      # one library, not built again
    isa = torch.backends.cpu.get_cpu_capability()
    assert said[0] == [f"sinkattn: building the CPU backend's kernel for {isa} into "
                       f"{tmp_path / 'cache' / next(iter(built[0]))} (about 15-90 s, once per machine, torch "
                       f"version and sinkattn version)"], said[0]
    assert said[1] == []


@pytest.mark.skipif(not COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("dtype,products", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                            (torch.bfloat16, "bf16")])
def test_a_sequence_gets_the_same_bits_whatever_it_is_packed_with(dtype, products, kernel):
    kernel("compiled", SINKATTN_CPU_PRODUCTS=products)
    g = torch.Generator().manual_seed(3)
    HQ, HKV, D = 6, 2, 40
    lens = [37, 300, 0, 129]

    def run(chosen):
        cu = torch.tensor([0, *torch.tensor([lens[i] for i in chosen]).cumsum(0).tolist()], dtype=torch.int32)
        rows = torch.cat([torch.arange(sum(lens[:i]), sum(lens[:i + 1])) for i in chosen])
        q, k, v = (full[rows].detach().requires_grad_() for full in (Q, K, V))
        out, lse = sinkattn.sink_attn_varlen_func(q, k, v, cu, cu, int(cu.diff().max()), int(cu.diff().max()),
                                                  sinks=sinks, causal=True, window_size=(100, 0), return_lse=True)
        torch.autograd.backward([out, lse], [dO[rows], dLSE[:, rows]])
        return rows, [out.detach(), lse.detach().T, q.grad, k.grad, v.grad]

    T = sum(lens)
    Q = torch.randn(T, HQ, D, generator=g).to(dtype)
    K, V = (torch.randn(T, HKV, D, generator=g).to(dtype) for _ in range(2))
    dO, dLSE = torch.randn(T, HQ, D, generator=g).to(dtype), torch.randn(HQ, T, generator=g)
    sinks = torch.randn(HQ, generator=g)
    rows_all, packed = run([0, 1, 2, 3])
    for alone in ([1], [3], [0, 3]):
        rows, got = run(alone)
        where = torch.searchsorted(rows_all, rows)
        assert all(torch.equal(a, b[where]) for a, b in zip(got, packed)), alone


def test_processes_building_at_once_each_install_and_load_a_whole_library(built_library, tmp_path):
    """Three first calls at once on an empty cache, each building (a stand-in compiler that finishes when all
    three have started): each installs its library with its record in one rename, so whichever lands last,
    each process loads a library its record vouches for, and no half-written file is left."""
    env = dict(os.environ, SINKATTN_CPU_KERNEL="compiled", SINKATTN_CACHE=str(tmp_path / "cache"),
               CXX=str(_stand_in_compiler(tmp_path, built_library, together=3)))
    runs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env) for _ in range(3)]
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["finite"] == [True, True] and got["path"].startswith("compiled kernel ("), got
    assert (tmp_path / "builds").read_text() == "built\n" * 3
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cpu_native.library_path().name]
    assert (tmp_path / "cache" / cpu_native.library_path().name).read_bytes() == built_library
