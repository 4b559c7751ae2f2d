"""The CPU path's compiled kernel (``csrc/cpu_attention.cpp``), built on first use: ``torch.ops.sinkattn_cpu``.

It computes what ``cpu_tiles`` computes (same tiles, same rounding rules: see that module) for every
sequence of a packed batch in one call, with the element-wise work fused between the products
(oneDNN's batch-reduce GEMM through ``at::native::cpublas::brgemm``), so a call is one kernel rather
than a few hundred PyTorch ops. Inputs holding NaN or inf still take ``cpu_tiles`` (``nonfinite``).

Build: the C++ compiler (``$CXX``, else ``c++``) compiles the one source against the installed torch for the
instruction set PyTorch dispatches to (``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2 or the
portable default, so ``ATEN_CPU_CAPABILITY`` chooses it too), once per source, torch and instruction set,
into ``$SINKATTN_CACHE`` (default ``~/.cache/sinkattn``); later processes load it in milliseconds. A build
says so first, once, through the ``sinkattn`` logger (a warning: on stderr where the application set up no
logging; ``logging.getLogger("sinkattn").setLevel(logging.ERROR)`` silences it). A library ends with a
record of itself (``_RECORD``: a magic, its length, its sha256), appended before the one atomic
``os.replace`` that installs it, so record and library cannot disagree, whichever of several processes
building at once installs last; a library the record does not vouch for (cut short by an interrupted copy or
a full disk, bytes changed, or no record: an older sinkattn's) is never loaded (loading a library cut short
kills the process: SIGBUS): ``auto`` builds it again, ``compiled`` refuses it. ``SINKATTN_CPU_KERNEL`` picks
the path: ``auto`` (default: the compiled kernel, or ``cpu_tiles`` when it cannot be built: no compiler, a
failed build; either warns once, naming the fix), ``compiled`` (an error when it cannot be built) or ``python``
(``cpu_tiles`` always).

Products: the kernel multiplies in fp32, except for inputs that are bf16 (``q``, ``k``, ``v``, and ``dO`` in
the backward) when ``SINKATTN_CPU_PRODUCTS`` says so: ``bf16`` takes bf16 x bf16 -> fp32 products for them
(PyTorch's bf16 GEMM, oneMKL's: AMX or AVX512-BF16 units where the CPU has them, exact products of bf16
values, fp32 sums), ``P`` rounded to bf16 in ``P V`` and ``P``, ``dS`` split as ``hi + lo`` (each bf16) in
``dQ``, ``dK`` and ``dV``, the rounding that keeps the precision standard; ``fp32`` never does;
``auto`` (default) does on a CPU with AMX tiles while PyTorch dispatches to AVX512 there and oneMKL is
not held below AMX (``sinkattn.backends.isa``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["MODES", "PRODUCTS", "mode", "products", "check_settings", "bf16_products", "compiler", "load", "available",
           "describe", "library_path"]

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
MODES = ("auto", "compiled", "python")
_ENV = "SINKATTN_CPU_KERNEL"
PRODUCTS = ("auto", "fp32", "bf16")
_PRODUCTS_ENV = "SINKATTN_CPU_PRODUCTS"

# instruction set -> compiler flags, as PyTorch builds its own kernels for each
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT"],
}

_RECORD = struct.Struct("<16sQ32s")   # the end of a library: magic, the length of what precedes it, its sha256
_MAGIC = b"sinkattn-kernel\x01"        # the last byte: the record's version

_log = logging.getLogger("sinkattn")
_lock = threading.Lock()
_state: dict[str, object] = {}       # "ops" (the loaded namespace) or "error" (why there is none); "warnings"


def mode() -> str:
    """``SINKATTN_CPU_KERNEL``, checked: one of ``MODES``."""
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def products() -> str:
    """``SINKATTN_CPU_PRODUCTS``, checked: one of ``PRODUCTS``."""
    value = os.environ.get(_PRODUCTS_ENV, "auto").strip().lower() or "auto"
    if value not in PRODUCTS:
        raise ValueError(f"{_PRODUCTS_ENV}={value!r}: expected one of {', '.join(PRODUCTS)}")
    return value


def check_settings() -> str:
    """Refuse a wrong ``SINKATTN_CPU_KERNEL`` or ``SINKATTN_CPU_PRODUCTS`` (``ValueError``), whichever path
    a call takes: a typo is never silently ignored. Returns the mode (for ``load``)."""
    products()
    return mode()


def _matrix_units() -> bool:
    """Whether bf16 products run on AMX tiles here: the CPU has them, and neither PyTorch's dispatch nor
    oneMKL is held below them (``sinkattn.backends.isa``)."""
    from . import isa
    return (torch.cpu._is_amx_tile_supported() and torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
            and isa.matrix_units_allowed())


def _bf16_chosen() -> bool:
    """Whether the products setting takes bf16 products for bf16 inputs: ``bf16``, or ``auto`` where
    ``_matrix_units``."""
    chosen = products()
    return chosen == "bf16" or (chosen == "auto" and _matrix_units())


def bf16_products(*inputs: torch.Tensor) -> bool:
    """Whether the compiled kernel takes bf16 products for a call of these inputs (the operands of its
    products: ``q, k, v`` in the forward, and ``dO`` in the backward): all bf16, and ``_bf16_chosen``."""
    chosen = _bf16_chosen()       # first: a wrong setting is refused whatever the inputs
    return chosen and all(x.dtype == torch.bfloat16 for x in inputs)


def compiler() -> str | None:
    """The C++ compiler a build would run (``$CXX``, else ``c++``) as found on ``PATH``; None: none."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _isa() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _ISA_FLAGS else "DEFAULT"


def _cache_dir() -> Path:
    base = os.environ.get("SINKATTN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "sinkattn")
    return Path(base)


def _command(cxx: str, output: str) -> list[str]:
    root = Path(torch.__file__).parent
    include = [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    libs = [str(root / "lib")]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *_ISA_FLAGS[_isa()], *include, str(SOURCE), "-o", output,
            *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs], "-lc10", "-ltorch_cpu"]


def library_path() -> Path:
    """Where the build for this source, torch, Python and instruction set lives (it may not exist yet)."""
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {_ISA_FLAGS[_isa()]}".encode())
    key.update(_MAGIC)      # a library without the record (an older sinkattn's) goes by another name
    return _cache_dir() / f"cpu_attention-{_isa().lower()}-{key.hexdigest()[:16]}.so"


class _NoCompiler(RuntimeError):
    pass


def _build(target: Path) -> None:
    found = compiler()
    if found is None:
        named = os.environ.get("CXX")
        raise _NoCompiler(f"no C++ compiler (CXX={named!r}: not found)" if named else
                          "no C++ compiler ('c++' not found on PATH, and CXX is not set)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _log.warning("sinkattn: building the CPU backend's kernel for %s into %s (about 15-90 s, once per machine, "
                 "torch version and sinkattn version)", _isa(), target)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = _command(found, tmp)
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            log = target.with_suffix(".log")
            log.write_text(" ".join(command) + "\n\n" + done.stderr)
            raise RuntimeError(f"the build failed (exit {done.returncode}); the compiler's output is in {log}")
        _seal(tmp)
        os.replace(tmp, target)            # atomic: processes building at once each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _seal(path: str) -> None:
    """Append the record to a library just built (ELF loaders read what its headers point at: bytes after
    its end are ignored), on disk before it is installed."""
    with open(path, "r+b") as f:
        body = f.read()
        f.write(_RECORD.pack(_MAGIC, len(body), hashlib.sha256(body).digest()))
        f.flush()
        os.fsync(f.fileno())


def _damage(path: Path) -> str | None:
    """Why the library at ``path`` is not to be loaded (its record does not vouch for it), or None."""
    data = path.read_bytes()
    if len(data) < _RECORD.size or data[-_RECORD.size:][:len(_MAGIC)] != _MAGIC:
        return f"{len(data)} bytes, without the record a library ends with: cut short, or built by an older sinkattn"
    _, length, digest = _RECORD.unpack_from(data, len(data) - _RECORD.size)
    if length != len(data) - _RECORD.size:
        return f"{len(data) - _RECORD.size} bytes before its record, which says {length}"
    if hashlib.sha256(memoryview(data)[:length]).digest() != digest:
        return "its bytes differ from the sha256 its record holds"
    return None


def _open(chosen: str):
    """The kernel's ops in this process: its library verified and loaded, built first where there is none
    or (``auto``) where it is damaged."""
    if _registered():                      # a library defines its ops once per process
        return torch.ops.sinkattn_cpu
    path = library_path()
    try:
        damage = _damage(path)
    except FileNotFoundError:
        _build(path)
    else:
        if damage is not None:
            if chosen == "compiled":
                raise RuntimeError(f"the library {path} is damaged ({damage}): delete it, or run once with "
                                   f"{_ENV}=auto, which builds it again")
            _state.setdefault("warnings", []).append(
                f"sinkattn: the compiled CPU kernel's library {path} is damaged ({damage}); it is built again")
            _build(path)
    torch.ops.load_library(str(path))
    return torch.ops.sinkattn_cpu


def load(quiet: bool = False, chosen: str | None = None):
    """``torch.ops.sinkattn_cpu``, built first if needed; None where the mode is ``python`` or (``auto``) the
    kernel cannot be built. Raises ``RuntimeError`` in mode ``compiled`` when it cannot. What it has to say
    (a damaged library built again, the PyTorch-op tiles taken instead) is a ``RuntimeWarning``, once, on the
    first call that is not ``quiet``. ``chosen``: the mode, when the caller has just read it (``check_settings``)."""
    chosen = mode() if chosen is None else chosen
    if chosen == "python":
        return None
    ops = _state.get("ops")
    if ops is not None and "warnings" not in _state:      # loaded, nothing left to say: every call after the first
        return ops
    with _lock:
        if "ops" not in _state and "error" not in _state:
            try:
                _state["ops"] = _open(chosen)
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                _state["error"] = str(error)
                if chosen == "auto":
                    _state.setdefault("warnings", []).append(
                        f"sinkattn: {error}: the CPU backend runs its PyTorch-op tiles instead of its compiled "
                        f"kernel, up to about 2x slower; install a C++ compiler, set CXX to one, or set {_ENV}=python "
                        f"to choose the PyTorch-op tiles quietly" if isinstance(error, _NoCompiler) else
                        f"sinkattn: the compiled CPU kernel is not available ({error}); the CPU backend runs its "
                        f"PyTorch-op tiles instead (set {_ENV}=python to choose them quietly)")
        told = () if quiet else _state.pop("warnings", ())
    for message in told:                   # once a process, on a call (describe() leaves them to the first)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    if "error" in _state and chosen == "compiled":
        raise RuntimeError(f"{_ENV}=compiled, but the compiled CPU kernel is not available: {_state['error']}")
    return _state.get("ops")


def _registered() -> bool:
    """Whether this process holds the kernel's ops already (loading a second build would define them again)."""
    return "sinkattn_cpu::forward" in torch._C._dispatch_get_all_op_names()


def available() -> bool:
    """Whether CPU calls run the compiled kernel (building it if needed)."""
    return load() is not None


def describe() -> str:
    """One line for reports: which CPU path runs, and why."""
    chosen = mode()
    if chosen == "python":
        return f"PyTorch-op tiles ({_ENV}=python)"
    try:
        ops = _quiet_load()
    except RuntimeError:                   # mode compiled, and none: said below
        ops = None
    if ops is None:
        return f"PyTorch-op tiles (compiled kernel unavailable: {_state.get('error')})"
    low = "bf16" if _bf16_chosen() else "fp32"
    return f"compiled kernel ({_isa()}, {library_path().name}; bf16 inputs: {low} products)"


def _quiet_load():
    return load(quiet=True)
