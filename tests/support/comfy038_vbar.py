# ruff: noqa: B009, B023 (comfy/ops.py's functions as 0.38 writes them)
"""ComfyUI 0.38's VBAR streaming of a dynamic-VRAM layer, on the CPU, to swap into the real ComfyUI 0.3.75.

Under dynamic VRAM (the default on an NVIDIA card) `ModelPatcherDynamic.load` gives every layer with
`comfy_cast_weights` over 16 KiB a VBAR slot (`_v`): its weights stay in system memory and are copied into the
slot when the layer is cast, unless the slot still holds them from an earlier step (the slot's signature
matches). Models that prefetch (Qwen-Image 2.1, LTX-2) fill the slots of a block before it runs
(`model_prefetch.pin_modules` -> `cast_modules_with_vbar`). The functions below are comfy/ops.py's
(Comfy-Org/ComfyUI 0271a469fe29524fafe5872b737123d65a63e5fc) as written: `cast_modules_with_vbar`,
`resolve_cast_module_with_vbar`, `uncast_bias_weight`, and `cast_bias_weight` from its VBAR branch (the one a
call on the GPU takes; on a CPU its first branch copies instead). What they call that 0.3.75 lacks is stood in
below, keeping its contract: comfy-aimdo's slot (`Slot`: a byte buffer whose signature changes, and whose bytes are
overwritten, when it is evicted) and the model's VBAR that gives the slots and frees them (`Vbar`),
comfy/memory_management.py's geometry helpers, comfy/model_management.py's `cast_to_gathered` (no file slices, no
offload stream on a CPU) and no pinned memory. `Slot.copies` counts the bytes copied into each slot.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from typing import NamedTuple

import torch

ALIGNMENT = 1024


# --- stand-ins -----------------------------------------------------------------------------------------------
OTHER_MODELS_BYTE = 0x5A  # what an evicted slot holds afterwards: an int8 weight read from it would be all 90s


class Slot:
    """A layer's VBAR slot: `buffer` is its VRAM, `copies` the bytes ever copied into it, `resident` whether it
    holds them now; `evict()` is another model taking its VRAM (a new signature, and other bytes in it)."""

    def __init__(self, size: int) -> None:
        self.buffer = torch.zeros(size, dtype=torch.uint8)
        self.signature = 1
        self.copies = 0
        self.resident = False

    def filled(self, size: int) -> None:
        self.copies += size
        self.resident = True

    def evict(self) -> None:
        self.signature += 1
        self.resident = False
        self.buffer.fill_(OTHER_MODELS_BYTE)


class Vbar:
    """comfy-aimdo's VBAR of one model as `ModelPatcherDynamic` uses it (comfy/model_patcher.py at 08d0e510):
    `alloc(size)` gives a streamed layer its slot, `loaded_size()` is the bytes of the slots holding their weights,
    and `free_memory(size)` (what `partially_unload` asks first) evicts resident slots, in the order they were
    given, until `size` bytes are freed, and returns the bytes it freed."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []

    def alloc(self, size: int) -> Slot:
        self.slots.append(Slot(size))
        return self.slots[-1]

    def loaded_size(self) -> int:
        return sum(slot.buffer.numel() for slot in self.slots if slot.resident)

    def free_memory(self, size: float) -> int:
        freed = 0
        for slot in self.slots:
            if freed >= size:
                break
            if slot.resident:
                freed += slot.buffer.numel()
                slot.evict()
        return freed


def _vbar_fault(slot: Slot):
    return slot.signature


def _vbar_signature_compare(signature, previous) -> bool:
    return signature is not None and signature == previous


comfy_aimdo = types.SimpleNamespace(
    model_vbar=types.SimpleNamespace(vbar_fault=_vbar_fault, vbar_signature_compare=_vbar_signature_compare,
                                     vbar_unpin=lambda slot: None),
    torch=types.SimpleNamespace(aimdo_to_tensor=lambda slot, device: slot.buffer),
)


class TensorGeometry(NamedTuple):
    shape: tuple
    dtype: torch.dtype

    def element_size(self):
        info = torch.finfo(self.dtype) if self.dtype.is_floating_point else torch.iinfo(self.dtype)
        return info.bits // 8

    def numel(self):
        return math.prod(self.shape)


def tensors_to_geometries(tensors, dtype=None):
    geometries = []
    for t in tensors:
        if t is None:
            geometries.append(t)
            continue
        tdtype = t.dtype
        if hasattr(t, "_model_dtype"):
            tdtype = t._model_dtype
        if dtype is not None:
            tdtype = dtype
        geometries.append(TensorGeometry(shape=t.shape, dtype=tdtype))
    return geometries


def vram_aligned_size(tensor):
    if isinstance(tensor, list):
        return sum([vram_aligned_size(t) for t in tensor])
    if tensor is None:
        return 0
    size = tensor.numel() * tensor.element_size()
    return (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def interpret_gathered_like(tensors, buffer):
    """Views of the byte `buffer` shaped as `tensors` (tensors or geometries), each at a 1 KiB boundary."""
    views, offset = [], 0
    for t in tensors:
        if t is None:
            views.append(None)
            continue
        size = t.numel() * t.element_size()
        views.append(buffer[offset:offset + size].view(t.dtype).view(t.shape))
        offset += vram_aligned_size(t)
    return views


memory_management = types.SimpleNamespace(TensorGeometry=TensorGeometry, tensors_to_geometries=tensors_to_geometries,
                                          vram_aligned_size=vram_aligned_size,
                                          interpret_gathered_like=interpret_gathered_like)


def cast_to_gathered(tensors, r, non_blocking=False, stream=None, r2=None):
    dest_views = interpret_gathered_like(tensors, r) if r is not None else [None] * len(tensors)
    dest2_views = interpret_gathered_like(tensors, r2) if r2 is not None else None
    for tensor in tensors:
        dest_view = dest_views.pop(0)
        dest2_view = dest2_views.pop(0) if dest2_views is not None else None
        if tensor is None:
            continue
        if dest_view is not None:
            dest_view.copy_(tensor, non_blocking=non_blocking)
        if dest2_view is not None:
            dest2_view.copy_(tensor if dest_view is None else dest_view, non_blocking=non_blocking)


model_management = types.SimpleNamespace(get_offload_stream=lambda device: None, LARGEST_AIMDO_CASTED_WEIGHT=(None, 0),
                                         cast_to_gathered=cast_to_gathered, sync_stream=lambda device, stream: None,
                                         get_aimdo_cast_buffer=None, device_supports_non_blocking=lambda device: True,
                                         current_stream=lambda device: None)
pinned_memory = types.SimpleNamespace(get_pin=lambda module, subset="weights": None,
                                      pin_memory=lambda module, subset="weights", size=None: None)
args = types.SimpleNamespace(high_ram=False)


class QuantizedTensor:  # comfy.quant_ops.QuantizedTensor: no INT8 layer's weight is one
    pass


def give_slot(layer: torch.nn.Module, vbar: Vbar | None = None) -> Slot:
    """What `ModelPatcherDynamic.load` gives a streamed layer (setup_param, set_dirty): a slot (from the model's
    `vbar` where given) sized from `weight_comfy_model_dtype or weight.dtype`, `weight._model_dtype`, no signature
    yet, its pin state."""
    geometries = []
    for name in ("weight", "bias"):
        param = getattr(layer, name, None)
        if param is None:
            continue
        param._model_dtype = getattr(layer, f"{name}_comfy_model_dtype", None) or param.dtype
        geometries.append(TensorGeometry(shape=param.shape, dtype=param._model_dtype))
    layer.comfy_cast_weights = True
    size = vram_aligned_size(geometries)
    layer._v = Slot(size) if vbar is None else vbar.alloc(size)
    layer._v_signature = None
    layer._pin_state = {"fast_disk": False}
    return layer._v


# --- comfy/ops.py (0.38) ---------------------------------------------------------------------------------------
def cast_modules_with_vbar(comfy_modules, dtype, device, bias_dtype, non_blocking, return_faulted=False):
    offload_stream = None
    if return_faulted:
        fully_faulted = all(not getattr(s, param_key + "_function", []) for s in comfy_modules for param_key in ("weight", "bias"))

    def ensure_offload_stream(module, required_size, check_largest):
        nonlocal offload_stream
        if offload_stream is None:
            offload_stream = model_management.get_offload_stream(device)

    def get_cast_buffer(buffer_size):
        if buffer_size == 0:
            return None
        return torch.empty((buffer_size,), dtype=torch.uint8, device=device)

    for s in comfy_modules:
        signature = comfy_aimdo.model_vbar.vbar_fault(s._v)
        resident = comfy_aimdo.model_vbar.vbar_signature_compare(signature, s._v_signature)
        if return_faulted and (signature is None or not resident):
            fully_faulted = False
        prefetch = {
            "signature": signature,
            "resident": resident,
        }

        if resident:
            s._prefetch = prefetch
            continue

        xfer_dest = comfy_aimdo.torch.aimdo_to_tensor(s._v, device) if signature is not None else None
        cast_geometry = memory_management.tensors_to_geometries([s.weight, s.bias])
        cast_dest = None
        needs_cast = False

        xfer_source = [s.weight, s.bias]
        fast_disk = s._pin_state["fast_disk"]
        subset = "weights-fast" if fast_disk else "weights"
        pin = pinned_memory.get_pin(s, subset=subset)
        if pin is not None:
            xfer_source = [pin]

        for data, geometry in zip([s.weight, s.bias], cast_geometry, strict=True):
            if data is None:
                continue
            if data.dtype != geometry.dtype:
                needs_cast = True
                cast_dest = xfer_dest
                xfer_dest = None
                break

        dest_size = memory_management.vram_aligned_size(xfer_source)
        ensure_offload_stream(s, dest_size if xfer_dest is None else 0, True)
        if xfer_dest is None:
            xfer_dest = get_cast_buffer(dest_size)

        def cast_maybe_lowvram_patch(xfer_source, xfer_dest, stream, xfer_dest2=None):
            if xfer_source is not None:
                model_management.cast_to_gathered(xfer_source, xfer_dest, non_blocking=non_blocking, stream=stream, r2=xfer_dest2)

        def handle_pin(m, pin, source, dest, subset="weights", size=None):
            if pin is not None:
                cast_maybe_lowvram_patch([pin], dest, offload_stream)
                return
            if signature is None or not fast_disk or args.high_ram:
                pinned_memory.pin_memory(m, subset=subset, size=size)
                pin = pinned_memory.get_pin(m, subset=subset)
            cast_maybe_lowvram_patch(source, pin, offload_stream, xfer_dest2=dest)

        handle_pin(s, pin, xfer_source, xfer_dest, subset=subset, size=dest_size)
        s._v.filled(dest_size)

        prefetch["xfer_dest"] = xfer_dest
        prefetch["cast_dest"] = cast_dest
        prefetch["cast_geometry"] = cast_geometry
        prefetch["needs_cast"] = needs_cast
        s._prefetch = prefetch

    if return_faulted:
        return offload_stream, fully_faulted
    return offload_stream


def resolve_cast_module_with_vbar(s, dtype, device, bias_dtype, compute_dtype, want_requant, return_weights=True):
    prefetch = getattr(s, "_prefetch", None)

    if prefetch["resident"]:
        weight = s._v_weight
        bias = s._v_bias
    else:
        xfer_dest = prefetch["xfer_dest"]
        if prefetch["needs_cast"]:
            cast_dest = prefetch["cast_dest"] if prefetch["cast_dest"] is not None else torch.empty((memory_management.vram_aligned_size(prefetch["cast_geometry"]),), dtype=torch.uint8, device=device)
            for pre_cast, post_cast in zip(memory_management.interpret_gathered_like([s.weight, s.bias], xfer_dest),
                                           memory_management.interpret_gathered_like(prefetch["cast_geometry"], cast_dest), strict=True):
                if post_cast is not None:
                    post_cast.copy_(pre_cast)
            xfer_dest = cast_dest

        params = memory_management.interpret_gathered_like(prefetch["cast_geometry"], xfer_dest)
        weight = params[0]
        bias = params[1]
        if prefetch["signature"] is not None:
            s._v_weight = weight
            s._v_bias = bias
        s._v_signature = prefetch["signature"]

    def post_cast(s, param_key, x, dtype, resident, update_weight):
        lowvram_fn = getattr(s, param_key + "_lowvram_function", None)
        fns = getattr(s, param_key + "_function", [])

        if x is None:
            return None

        orig = x

        def to_dequant(tensor, dtype):
            tensor = tensor.to(dtype=dtype)
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            return tensor

        if (return_weights and orig.dtype != dtype) or len(fns) > 0:
            x = to_dequant(x, dtype)
        if not resident and lowvram_fn is not None:
            raise AssertionError("a layer with a dynamic-VRAM LoRA reached the INT8 kernels' cast")
        for f in fns:
            x = f(x)
        return x

    update_weight = prefetch["signature"] is not None
    weight = post_cast(s, "weight", weight, dtype, prefetch["resident"], update_weight)
    if bias is not None:
        bias = post_cast(s, "bias", bias, bias_dtype, prefetch["resident"], update_weight)

    if prefetch["signature"] is not None:
        prefetch["resident"] = True

    return (weight, bias) if return_weights else None


def cast_bias_weight(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, compute_dtype=None,
                     want_requant=False):
    """From the branch a GPU call takes for a layer with a slot (`hasattr(s, "_v") and s.weight.device != device`)."""
    if input is not None:
        if dtype is None:
            dtype = input.dtype
        if bias_dtype is None:
            bias_dtype = dtype
        if device is None:
            device = input.device

    def format_return(result, offloadable):
        weight, bias, offload_stream = result
        return (weight, bias, offload_stream) if offloadable else (weight, bias)

    non_blocking = model_management.device_supports_non_blocking(device)
    prefetched = hasattr(s, "_prefetch")
    offload_stream = None
    offload_device = None
    if not prefetched:
        offload_stream = cast_modules_with_vbar([s], dtype, device, bias_dtype, non_blocking)
        model_management.sync_stream(device, offload_stream)

    weight, bias = resolve_cast_module_with_vbar(s, dtype, device, bias_dtype, compute_dtype, want_requant)

    if not prefetched:
        if getattr(s, "_prefetch")["signature"] is not None:
            offload_device = device
        delattr(s, "_prefetch")
    return format_return((weight, bias, (offload_stream, offload_device, None)), offloadable)


def uncast_bias_weight(s, weight, bias, offload_stream):
    if offload_stream is None:
        return
    os, weight_a, bias_a = offload_stream
    if weight_a is not None and not isinstance(weight_a, torch.Tensor):
        comfy_aimdo.model_vbar.vbar_unpin(s._v)
    if os is None:
        return


def prefetch_block(modules) -> None:
    """comfy/model_prefetch.py's `pin_modules` for a block's layers with a slot (then the block runs)."""
    cast_modules_with_vbar([m for m in modules if hasattr(m, "_v")], None, torch.device("cpu"), None, True,
                           return_faulted=True)


def end_of_block(modules) -> None:
    """`cleanup_prefetched_modules`: the next pop drops the block's prefetch state."""
    for s in modules:
        s.__dict__.pop("_prefetch", None)


@contextlib.contextmanager
def vbar_casts(monkeypatch) -> Iterator[None]:
    """0.38's `cast_bias_weight` (its VBAR branch for layers with a slot; 0.3.75's for the others) and
    `uncast_bias_weight` in comfy.ops for the block."""
    import comfy.ops

    original_cast, original_uncast = comfy.ops.cast_bias_weight, comfy.ops.uncast_bias_weight

    def cast(s, *args, **kwargs):
        return (cast_bias_weight if hasattr(s, "_v") else original_cast)(s, *args, **kwargs)

    def uncast(s, *args, **kwargs):
        return (uncast_bias_weight if hasattr(s, "_v") else original_uncast)(s, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(comfy.ops, "cast_bias_weight", cast)
        patch.setattr(comfy.ops, "uncast_bias_weight", uncast)
        yield
