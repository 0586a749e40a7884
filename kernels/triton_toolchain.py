"""Whether compiled Triton can build its launchers here.

Compiled Triton builds a small C extension per kernel signature (and one for its CUDA driver) with a C compiler
and `Python.h`; without either, every Triton launch raises. The `triton` backend then reports itself unavailable,
so CUDA tensors go to the `cuda` backend. The interpreter (TRITON_INTERPRET=1) builds nothing and needs neither.

The probe looks where Triton looks (`triton/runtime/build.py`): the compiler is $CC, else gcc, else clang on
PATH; the header is in sysconfig's include directory for the default install scheme. It only looks (no build),
once per process. On Windows it is skipped: Triton's Windows builds bring their own compiler and headers.
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig


@functools.cache
def missing_build_tools() -> str | None:
    """None when compiled Triton finds what it builds its launchers with, else what is missing, as a sentence.

    Cached for the process; `missing_build_tools.cache_clear()` probes again."""
    if os.name == "nt" or _custom_build():
        return None
    missing = [why for why in (_missing_compiler(), _missing_python_header()) if why]
    if not missing:
        return None
    return (f"compiled Triton cannot build its kernel launchers: {' and '.join(missing)}; install a C compiler and "
            f"the Python development headers (e.g. gcc and python3-dev)")


def _custom_build() -> bool:
    """Triton's `knobs.build.impl` (Triton 3.4 and newer) replaces its compiler call with the user's own."""
    try:
        import triton

        return getattr(triton.knobs.build, "impl", None) is not None
    except (ImportError, AttributeError):
        return False


def _missing_compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc is not None:
        return None if shutil.which(cc) else f"the C compiler CC={cc!r} was not found"
    if shutil.which("gcc") or shutil.which("clang"):
        return None
    return "no C compiler (CC is unset and neither gcc nor clang is on PATH)"


def python_include_dir() -> str:
    """The directory compiled Triton takes `Python.h` from."""
    scheme = sysconfig.get_default_scheme() if hasattr(sysconfig, "get_default_scheme") else sysconfig._get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; Triton reads posix_prefix's headers instead
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def _missing_python_header() -> str | None:
    include = python_include_dir()
    return None if os.path.isfile(os.path.join(include, "Python.h")) else f"no Python.h in {include}"
