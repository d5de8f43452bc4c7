"""No hub kernel is fetched because memsave_nb imported bitsandbytes.

Why: bitsandbytes 0.50, on CPUs with AVX512-BF16, calls ``kernels.get_kernel(
"kernels-community/quantization-bitsandbytes")`` while its CPU backend module is imported: a network
lookup and, where the publisher is trusted, native code from the hub. Importing peft (which imports
bitsandbytes) or our 8-bit optimizers is enough to trigger it; a sizing tool must not. While that one
module (``bitsandbytes.backends.cpu.ops``) executes, ``kernels.get_kernel`` refuses, and bitsandbytes
takes its own documented fallback (the plain CPU 4-bit path; its warning is silenced). Nothing else of
``kernels`` is touched, and only for that import.

``MEMSAVE_NB_HUB_KERNELS=1`` in the environment turns the guard off (bitsandbytes as it ships).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Any, Iterator

__all__ = ["GUARDED_MODULE", "install", "uninstall", "refused"]

GUARDED_MODULE = "bitsandbytes.backends.cpu.ops"
ENV_SWITCH = "MEMSAVE_NB_HUB_KERNELS"
refused: list[str] = []  # repositories a guarded import asked for, in order (tests read it)


def _refuse(repo_id: Any, *args: Any, **kwargs: Any) -> Any:
    name = str(repo_id)[:80]
    refused.append(name)
    raise RuntimeError(f"memsave_nb does not fetch hub kernels ({name}); set {ENV_SWITCH}=1 to allow")


@contextlib.contextmanager
def _kernels_refused() -> Iterator[None]:
    try:
        import kernels
    except Exception:  # not installed: bitsandbytes' own import fails and it falls back
        yield
        return
    log = logging.getLogger("bitsandbytes")
    original, level = kernels.get_kernel, log.level
    kernels.get_kernel = _refuse  # type: ignore[assignment]
    log.setLevel(logging.ERROR)  # its "failed to load" warning is about our refusal, not the user's setup
    try:
        yield
    finally:
        kernels.get_kernel = original  # type: ignore[assignment]
        log.setLevel(level)


class _GuardedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with _kernels_refused():
            self.inner.exec_module(module)  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the one guarded module it asks the other finders for the spec and
    wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != GUARDED_MODULE or os.environ.get(ENV_SWITCH) == "1":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _GuardedLoader(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def install() -> None:
    """Put the guard first on ``sys.meta_path`` (once). Harmless when bitsandbytes is already imported."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_FINDER)


install()  # on import: ``memsave_nb/__init__`` imports this module before anything can import peft
