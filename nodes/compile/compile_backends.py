"""Which torch.compile backends work on this machine, and Inductor's cache between ComfyUI restarts."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch


def available_compile_backends() -> list[str]:
    """Backends offered by the node: inductor first, then the installed ones that make sense here."""
    import torch._dynamo

    registered = set(torch._dynamo.list_backends(exclude_tags=()))
    names = ["inductor"]
    for name in ("aot_eager", "eager"):
        if name in registered:
            names.append(name)
    if torch.cuda.is_available() and "cudagraphs" in registered:
        names.append("cudagraphs")
    return names


def compile_backend_problem(compile_backend: str, device: torch.device) -> str | None:
    """Why `compile_backend` cannot compile on `device` here, or None when it should work."""
    import torch._dynamo

    if compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        return f"torch.compile backend {compile_backend!r} is not available in this PyTorch"
    if compile_backend == "inductor":
        if device.type == "cpu":
            from torch._inductor import codecache, cpp_builder

            # PyTorch before 2.5 names Inductor's compiler lookup codecache.cpp_compiler
            find_compiler = getattr(cpp_builder, "get_cpp_compiler", None) or codecache.cpp_compiler
            try:
                compiler = find_compiler()
            except Exception as exc:  # noqa: BLE001 - any failure means no usable compiler
                return f"Inductor needs a C++ compiler for the CPU and none was found ({exc})"
            if shutil.which(compiler) is None and not os.path.isfile(compiler):
                return f"Inductor needs a C++ compiler for the CPU and {compiler!r} was not found"
        else:
            from torch.utils._triton import has_triton

            if not has_triton():
                return f"Inductor needs Triton on {device.type} and it is not installed"
    if compile_backend == "tvm":
        import importlib.util

        if importlib.util.find_spec("tvm") is None:
            return "the tvm backend needs Apache TVM, which is not installed"
    if compile_backend == "cudagraphs" and device.type != "cuda":
        return "the cudagraphs backend needs a CUDA device"
    return None


def _default_inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # PyTorch before 2.5: the same folder, computed inline in runtime_utils.cache_dir
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return default_cache_dir()


def ensure_persistent_cache() -> str:
    """Keep Inductor's compiled artifacts between ComfyUI restarts (FX graph cache in a kept folder)."""
    import torch._inductor.config as inductor_config

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(_default_inductor_cache_dir()):
        # the default lives in /tmp (wiped on reboot); ComfyUI's user folder is kept
        try:
            import folder_paths

            base = Path(folder_paths.get_user_directory())
        except Exception:  # noqa: BLE001 - outside ComfyUI: fall back to the user's cache folder
            base = Path.home() / ".cache"
        current = str(base / "int8_accel_inductor_cache")
        os.makedirs(current, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = current
    inductor_config.fx_graph_cache = True
    return current
