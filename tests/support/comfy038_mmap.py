"""ComfyUI 0.38.1's file loading under dynamic VRAM and its conditioning-hook patching, to swap into the real
ComfyUI 0.3.75.

- `load_safetensors` is comfy/utils.py's (Comfy-Org/ComfyUI, stored copy of commit
  09708eae709a992a5684bed3595ce4d07e705b4e) as written there, less its `TensorFileSlice` (0.3.75 has no
  comfy.memory_management; a record of the same fields stands in). Its `load_torch_file` takes it for every
  .safetensors file while comfy-aimdo is enabled (the default on NVIDIA), also when conditioning hooks reload a
  model for the plain ModelPatcher (`get_non_dynamic_delegate`). Its tensors view comfy-aimdo's `ModelMMAP`, which
  maps the file `PROT_READ, MAP_PRIVATE` (src-posix/model-mmap.c, Comfy-Org/comfy-aimdo commit
  59db82589f058d7e0394566d43aacfbd3227f4df): a write into one kills the process (SIGSEGV). `ModelMMAP` below maps
  the same way, through libc.
- `patch_hook_weight_to_device` is comfy/model_patcher.py's `ModelPatcher.patch_hook_weight_to_device` (stored
  copy of commit 08d0e510f4e539a1db39072589817136ac6cfa7d) as written there: it writes the hooked weight into the
  model's own tensor (`copy_to_param`, or the layer's `set_weight(..., inplace_update=True)`).
- `no_writes_into_mappings` turns a write into a mapping made here into an exception the test sees, instead of
  the signal that would end the test run.

POSIX only (libc's mmap).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import math
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LIVE: dict[int, int] = {}  # address -> size of every mapping of this module not yet unmapped

TensorFileSlice = collections.namedtuple("TensorFileSlice", ["file", "lock", "offset", "size"])


class ModelMMAP:
    """comfy_aimdo.model_mmap.ModelMMAP: the file mapped read-only and private (`get`), and its handle."""

    def __init__(self, filepath) -> None:
        self.fd = os.open(os.fspath(filepath), os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.address = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_PRIVATE, self.fd, 0)
        if self.address in (None, _MAP_FAILED):
            os.close(self.fd)
            raise OSError(ctypes.get_errno(), f"mmap failed for {filepath}")
        _LIVE[self.address] = self.size

    def get(self) -> int:
        return self.address

    def get_file_handle(self) -> int:
        return self.fd

    def __del__(self) -> None:
        _LIVE.pop(self.address, None)
        _libc.munmap(self.address, self.size)
        os.close(self.fd)


_TYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_SAFETENSORS_MAX_HEADER_SIZE = 100_000_000


def load_safetensors(ckpt):
    """comfy/utils.py `load_safetensors` (0.38.1), as written there (its error messages shortened)."""
    file_size = os.path.getsize(ckpt)
    if file_size < 8:
        raise ValueError("The safetensors header is incomplete.")

    file_lock = threading.Lock()
    model_mmap = ModelMMAP(ckpt)
    f = model_mmap.get_file_handle()
    mv = memoryview((ctypes.c_uint8 * file_size).from_address(model_mmap.get()))

    header_size = struct.unpack("<Q", mv[:8])[0]
    if header_size > _SAFETENSORS_MAX_HEADER_SIZE:
        raise ValueError("The safetensors header is too large.")

    data_base_offset = 8 + header_size
    if data_base_offset > file_size:
        raise ValueError("The safetensors header is incomplete.")

    header = json.loads(mv[8:data_base_offset].tobytes().decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("The safetensors header is invalid.")

    mv = mv[data_base_offset:]
    data_size = len(mv)

    sd = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue

        start, end = info["data_offsets"]
        dtype = _TYPES[info["dtype"]]
        if start < 0 or end < start:
            raise ValueError("Tensor '{}' has invalid data offsets.".format(name))  # noqa: UP032
        if end > data_size:
            raise ValueError("Tensor '{}' extends past the end of the file.".format(name))  # noqa: UP032
        if math.prod(info["shape"]) * dtype.itemsize != end - start:
            raise ValueError("Tensor '{}' does not match its declared shape and dtype.".format(name))  # noqa: UP032

        if start == end:
            sd[name] = torch.empty(info["shape"], dtype=dtype)
        else:
            with warnings.catch_warnings():
                #We are working with read-only RAM by design
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                tensor = torch.frombuffer(mv[start:end], dtype=dtype).view(info["shape"])
                storage = tensor.untyped_storage()
                setattr(storage,  # noqa: B010
                        "_comfy_tensor_file_slice",
                        TensorFileSlice(f, file_lock, data_base_offset + start, end - start))
                setattr(storage, "_comfy_tensor_mmap_refs", (model_mmap, mv))  # noqa: B010
                sd[name] = tensor

    return sd, header.get("__metadata__", {}),


def load_torch_file(ckpt, safe_load=False, device=None, return_metadata=False):
    """comfy/utils.py `load_torch_file` (0.38.1) on a .safetensors file with comfy-aimdo enabled."""
    sd, metadata = load_safetensors(ckpt)
    if not return_metadata:
        metadata = None
    return (sd, metadata) if return_metadata else sd


def patch_hook_weight_to_device(self, hooks, combined_patches: dict, key: str, original_weights: dict,
                                memory_counter):
    """comfy/model_patcher.py `ModelPatcher.patch_hook_weight_to_device` (0.38.1), as written there
    (`string_to_seed` lives in comfy.utils there, in comfy.model_patcher in 0.3.75)."""
    import comfy.float
    import comfy.hooks
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils

    string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed
    if key not in combined_patches:
        return

    weight, set_func, convert_func = comfy.model_patcher.get_key_weight(self.model, key)
    weight: torch.Tensor
    if key not in self.hook_backup:
        target_device = self.offload_device
        if self.hook_mode == comfy.hooks.EnumHookMode.MaxSpeed:
            used = memory_counter.use(weight)
            if used:
                target_device = weight.device
        self.hook_backup[key] = (weight.to(device=target_device, copy=True), weight.device)
    # TODO: properly handle LowVramPatch, if it ends up an issue
    temp_weight = comfy.model_management.cast_to_device(weight, weight.device, torch.float32, copy=True)
    if convert_func is not None:
        temp_weight = convert_func(temp_weight, inplace=True)

    out_weight = comfy.lora.calculate_weight(combined_patches[key],
                                             temp_weight,
                                             key, original_weights=original_weights)
    del original_weights[key]
    if set_func is None:
        out_weight = comfy.float.stochastic_rounding(out_weight, weight.dtype, seed=string_to_seed(key))
        comfy.utils.copy_to_param(self.model, key, out_weight)
    else:
        set_func(out_weight, inplace_update=True, seed=string_to_seed(key))
    if self.hook_mode == comfy.hooks.EnumHookMode.MaxSpeed:
        # TODO: disable caching if not enough system RAM to do so
        target_device = self.offload_device
        used = memory_counter.use(weight)
        if used:
            target_device = weight.device
        self.cached_hook_patches.setdefault(hooks, {})
        self.cached_hook_patches[hooks][key] = (out_weight.to(device=target_device, copy=False), weight.device)
    del temp_weight
    del out_weight
    del weight


@contextlib.contextmanager
def aimdo_loading(monkeypatch) -> Iterator[None]:
    """0.38.1's `load_torch_file` (through `load_safetensors`) and `patch_hook_weight_to_device` for the block."""
    import comfy.model_patcher
    import comfy.utils

    with monkeypatch.context() as patch:
        patch.setattr(comfy.utils, "load_torch_file", load_torch_file)
        patch.setattr(comfy.model_patcher.ModelPatcher, "patch_hook_weight_to_device", patch_hook_weight_to_device)
        yield


def in_mapping(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory lies in a read-only file mapping made here."""
    pointer = tensor.untyped_storage().data_ptr()
    return any(start <= pointer < start + size for start, size in _LIVE.items())


class ReadOnlyWrite(RuntimeError):
    """A write into a read-only file mapping (where comfy-aimdo's mapping would end the process)."""


class no_writes_into_mappings(TorchDispatchMode):  # noqa: N801 (used as a context manager)
    """Raise `ReadOnlyWrite` before any operator writes into a tensor that lies in a mapping made here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor) and in_mapping(value):
                raise ReadOnlyWrite(f"{func} writes into a read-only mapped file")
        return func(*args, **kwargs)
