"""The option values of the ``sinkattn`` command, each checked before any work.

Every function here is an argparse ``type=``: it turns one option's text into its value or raises
``argparse.ArgumentTypeError`` with the reason, and argparse reports ``argument --NAME: reason``
with exit code 2. ``backend_for`` asks the backend registry whether a run can go ahead at all, so
the command can refuse it with the library's own reason before it starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile

import torch

from .. import backends

__all__ = ["DTYPES", "DTYPE_CHOICES", "dtype", "shape", "window", "names", "at_least", "device", "default_device",
           "json_file", "plot_file", "has_matplotlib", "out_dir", "backend_for", "CLI_EXTRAS"]

DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "float32": torch.float32}
DTYPE_CHOICES = "fp16|bf16|fp32 (or float16|bfloat16|float32)"
CLI_EXTRAS = 'pip install rich matplotlib (the "cli" extra: pip install "sinkattn[cli]")'
"""How to install the command's display extras: the same words for a wheel and for a source checkout."""

_Bad = argparse.ArgumentTypeError


def dtype(text: str) -> torch.dtype:
    """``fp16`` / ``float16``, ``bf16`` / ``bfloat16``, ``fp32`` / ``float32`` -> the torch dtype."""
    try:
        return DTYPES[text.strip().lower()]
    except KeyError:
        raise _Bad(f"expected one of {DTYPE_CHOICES}, got {text!r}") from None


def _ints(text: str, count: int, form: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != count:
        raise _Bad(f"expected {form} ({count} comma-separated integers), got {text!r}")
    return values


def shape(text: str) -> tuple[int, int, int, int, int]:
    """``B,S,HQ,HKV,D``: five positive integers with ``HQ`` a multiple of ``HKV``."""
    values = _ints(text, 5, "B,S,HQ,HKV,D")
    bad = [f"{n}={v}" for n, v in zip(("B", "S", "HQ", "HKV", "D"), values) if v < 1]
    if bad:
        raise _Bad(f"B,S,HQ,HKV,D must all be >= 1, got {', '.join(bad)}")
    HQ, HKV = values[2], values[3]
    if HQ % HKV:
        raise _Bad(f"HQ={HQ} must be a multiple of HKV={HKV} (G = HQ / HKV query heads per KV head)")
    return tuple(values)


def window(text: str) -> tuple[int, int]:
    """``left,right``: two integers >= -1 (-1: unbounded on that side), as ``window_size``."""
    values = _ints(text, 2, "left,right")
    if min(values) < -1:
        raise _Bad(f"left and right must be >= -1 (-1: unbounded), got {text!r}")
    return tuple(values)


def names(known) -> callable:
    """A ``type=`` for a comma list of names from ``known``: the names in order, once each."""
    known = tuple(known)

    def parse(text: str) -> tuple[str, ...]:
        items = [x.strip() for x in text.split(",")]
        unknown = [x for x in items if x not in known]
        if unknown:
            raise _Bad(f"unknown {', '.join(map(repr, unknown))}; choose a comma list of {', '.join(known)}")
        return tuple(dict.fromkeys(items))
    return parse


def at_least(low: int) -> callable:
    """A ``type=`` for an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _Bad(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise _Bad(f"must be >= {low}, got {value}")
        return value
    return parse


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device(text: str) -> str:
    """``cpu`` or ``cuda``; ``cuda`` only where torch sees a GPU."""
    if text not in ("cpu", "cuda"):
        raise _Bad(f"expected cpu or cuda, got {text!r}")
    if text == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise _Bad(f"CUDA is not available here ({why}); use --device cpu")
    return text


def json_file(text: str) -> str:
    """A file name (not a folder) whose folder exists and is writable."""
    if os.path.isdir(text):
        raise _Bad(f"{text!r} is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise _Bad(f"folder {folder!r} does not exist; create it first")
    _can_write_in(folder, text)
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise _Bad(f"{text!r} exists and is not writable")
    return text


def _can_write_in(folder: str, text: str) -> None:
    """Refuse ``text`` unless a file can really be made in ``folder`` (``os.access`` says yes to root in
    ``/proc``, read-only mounts and full disks)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise _Bad(f"cannot write {text!r}: no file can be made in {folder!r} ({exc.strerror or exc})") from None


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_file(text: str) -> str:
    """A file name as ``json_file``, in a format matplotlib writes (by its extension), matplotlib installed."""
    json_file(text)
    if not has_matplotlib():
        raise _Bad(f"plots need matplotlib, which is not installed: {CLI_EXTRAS}")
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(text)[1].lstrip(".").lower()
    if ext not in formats:
        raise _Bad(f"file name must end in one of {', '.join('.' + f for f in sorted(formats))}, got {text!r}")
    return text


def out_dir(text: str) -> str:
    """A folder that exists or can be made (its nearest existing parent is a writable folder)."""
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise _Bad(f"{text!r} is a file, not a folder")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _Bad(f"cannot create {text!r}: {parent!r} is not a folder")
    _can_write_in(parent, text)
    return text


def backend_for(backend: str, device_type: str, dtypes_and_dims, needs_grad: bool) -> str:
    """The backend that runs ``(dtype, head_dim)`` calls on ``device_type`` tensors (``auto`` resolved).

    The registry's own answer (``sinkattn.backends.choose``), so a refusal carries the library's
    reason: a backend not installed, a device it does not take (with what to do, e.g.
    ``TRITON_INTERPRET=1``), a dtype or head dim. Raises NotImplementedError or ValueError.
    """
    chosen = {backends.choose(backend, backends.Request(device_type, dt, head_dim, needs_grad))
              for dt, head_dim in set(dtypes_and_dims)}
    return "/".join(sorted(chosen))
