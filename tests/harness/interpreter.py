"""Triton's interpreter, its per-call overhead removed (tests only).

The interpreter re-patches ``triton.language`` (``inspect.getmembers`` over its modules) at every call of a
``@triton.jit`` helper inside a kernel, though the first call from the helper's module in a launch has
patched it for the whole grid: a third of an interpreted kernel's time here. ``patch_once_per_launch``
keeps the first patch per module per launch and skips the repeats; what runs is unchanged (each repeat
would patch the same attributes again).
"""

from __future__ import annotations

__all__ = ["patch_once_per_launch"]


def patch_once_per_launch() -> bool:
    """Install the skip; False (nothing changed) where this Triton's interpreter is not built as expected."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch, launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if patch is None or launch is None or not hasattr(interpreter, "_LangPatchScope") \
            or getattr(patch, "once_per_launch", False):
        return False
    call = launch.__call__
    patched: list[set | None] = [None]          # in a launch: the modules (their globals' ids) patched so far

    def launched(self, *args, **kwargs):
        patched[0] = set()
        try:
            return call(self, *args, **kwargs)
        finally:
            patched[0] = None

    def patch_lang(fn):
        seen = patched[0]
        if seen is not None:
            if id(fn.__globals__) in seen:
                return interpreter._LangPatchScope()
            seen.add(id(fn.__globals__))
        return patch(fn)

    patch_lang.once_per_launch = True
    launch.__call__ = launched
    interpreter._patch_lang = patch_lang
    return True
