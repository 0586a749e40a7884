"""ComfyUI 0.38.1's weight-management behaviour, to swap into the real ComfyUI 0.3.75 one piece at a time.

Each function is written as 0.38.1 writes it (Comfy-Org/ComfyUI, the file and function named in its docstring),
reduced to the part a CPU can run; 0.3.75's own behaviour stays the control. ComfyUI 0.38 cannot be installed
here, and its dynamic VRAM hands a CPU load device back to the plain ModelPatcher, so these code paths are only
reachable this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def lowvram_patch_call(self, weight: torch.Tensor) -> torch.Tensor:
    """comfy/model_patcher.py, `LowVramPatch.__call__` (0.38.1): `calculate_weight` on the weight it is handed,
    in that weight's dtype; `convert_func` / `set_func` are stored but never called."""
    import comfy.lora

    patches = getattr(self, "prepared_patches", None) or self.patches[self.key]
    return comfy.lora.calculate_weight(patches, weight, self.key, intermediate_dtype=weight.dtype)


@contextlib.contextmanager
def lowvram_patch_without_convert(monkeypatch) -> Iterator[None]:
    """0.38.1's `LowVramPatch.__call__` swapped into 0.3.75's LowVramPatch for the duration of the block."""
    import comfy.model_patcher

    with monkeypatch.context() as patch:
        patch.setattr(comfy.model_patcher.LowVramPatch, "__call__", lowvram_patch_call)
        yield


def _comfy_cast_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    return ((name, m) for name, m in model.named_modules() if hasattr(m, "comfy_cast_weights"))


def _streamed_cast(original):
    """comfy/ops.py, `cast_bias_weight` (0.38.1) for a layer dynamic VRAM streams (one with a VBAR slot, `_v`):
    a cast to the CPU takes its first branch, `s.weight.to(dtype, copy=True)` with no patch applied; a cast to the
    computing device takes the VBAR path, whose `post_cast` (in `resolve_cast_module_with_vbar`) applies
    `<param>_lowvram_function` to the weight in the compute dtype, then `<param>_function`. Here the computing
    device is the CPU as well, so a layer's forward (a cast that names its input) stands for the GPU cast, and a
    cast given only the storage device for the CPU one. Layers without a slot keep 0.3.75's cast."""

    def cast(s, input=None, dtype=None, device=None, bias_dtype=None, offloadable=False, **kwargs):
        if not hasattr(s, "_v"):
            return original(s, input, dtype, device, bias_dtype, offloadable)
        if input is None:
            weight = s.weight.to(dtype=dtype, copy=True)
            bias = None if s.bias is None else s.bias.to(dtype=bias_dtype or dtype, copy=True)
            return (weight, bias, None) if offloadable else (weight, bias)
        weight, bias, *rest = original(s, input, dtype, device, bias_dtype, offloadable)
        patched = []
        for name, value in (("weight", weight), ("bias", bias)):
            lowvram = getattr(s, f"{name}_lowvram_function", None)
            if value is not None and lowvram is not None:
                value = lowvram(value.clone())
            patched.append(value)
        return (*patched, *rest)

    return cast


SMALL_LAYER_BYTES = 16 * 1024  # ModelPatcherDynamic.load force-loads layers of this size or less


@contextlib.contextmanager
def dynamic_vram_load(patcher, monkeypatch) -> Iterator[None]:
    """What comfy/model_patcher.py `ModelPatcherDynamic.load` (0.38.1) does to every layer with
    `comfy_cast_weights`, on the CPU: `comfy_cast_weights = True`; a layer of more than 16 KiB gets a VBAR slot
    (`_v`, here a placeholder: streaming needs a GPU) and, per parameter with weight patches,
    `<param>_lowvram_function = LowVramPatch(key, patches)` (no convert_func, no set_func), its weight left
    unpatched; a smaller layer is force-loaded through `patch_weight_to_device(key, force_cast=True)` (below).
    `<param>_function` holds only weight wrappers (none here); `current_weight_patches_uuid` is set. 0.38.1's
    `LowVramPatch.__call__` and its streamed-layer cast (`_streamed_cast`) are swapped in for the block."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops

    patcher.patch_model(device_to=torch.device("cpu"), load_weights=False)
    model = patcher.model
    saved = []
    for name, module in list(_comfy_cast_layers(model)):
        saved.append((module, dict(module.__dict__)))
        module.comfy_cast_weights = True
        streamed = comfy.model_management.module_size(module) > SMALL_LAYER_BYTES
        if streamed:
            module._v = object()
        for param in ("weight", "bias"):
            key = f"{name}.{param}"
            patch = None
            if streamed and key in patcher.patches:
                patch = comfy.model_patcher.LowVramPatch(key, patcher.patches)
            elif not streamed and getattr(module, param, None) is not None:
                patch_weight_to_device(patcher, key, device_to=torch.device("cpu"), force_cast=True)
            setattr(module, f"{param}_lowvram_function", patch)
            setattr(module, f"{param}_function", [])
    model.current_weight_patches_uuid = patcher.patches_uuid
    try:
        with lowvram_patch_without_convert(monkeypatch), monkeypatch.context() as patch:
            patch.setattr(comfy.ops, "cast_bias_weight", _streamed_cast(comfy.ops.cast_bias_weight))
            yield
    finally:
        for module, state in saved:
            for attr in ("comfy_cast_weights", "weight_lowvram_function", "bias_lowvram_function",
                         "weight_function", "bias_function", "_v"):
                if attr in state:
                    module.__dict__[attr] = state[attr]
                else:
                    module.__dict__.pop(attr, None)
        model.current_weight_patches_uuid = None
        patcher.unpatch_model(device_to=torch.device("cpu"))


def patch_weight_to_device(patcher, key: str, device_to=None, inplace_update: bool = False,
                           return_weight: bool = False, force_cast: bool = False):
    """comfy/model_patcher.py, `ModelPatcher.patch_weight_to_device` (0.38.1): with `force_cast` (how
    `ModelPatcherDynamic.load` force-loads layers of 16 KiB or less) an unpatched weight is cast to the device in
    its stored dtype and handed to `convert_func(weight, inplace=True)`; LoRA math runs in `lora_compute_dtype`
    (0.3.75 has no such function: float32, what 0.38.1 picks on a CPU)."""
    import collections

    import comfy.float
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils

    weight, set_func, convert_func = comfy.model_patcher.get_key_weight(patcher.model, key)
    if key not in patcher.patches and not force_cast:
        return weight
    inplace_update = patcher.weight_inplace_update or inplace_update
    if key not in patcher.backup and not return_weight:
        patcher.backup[key] = collections.namedtuple("Dimension", ["weight", "inplace_update"])(
            weight.to(device=patcher.offload_device, copy=inplace_update), inplace_update)
    temp_dtype = torch.float32 if key in patcher.patches else None
    if device_to is not None:
        temp_weight = comfy.model_management.cast_to_device(weight, device_to, temp_dtype, copy=True)
    else:
        temp_weight = weight.to(temp_dtype, copy=True)
    if convert_func is not None:
        temp_weight = convert_func(temp_weight, inplace=True)
    out_weight = comfy.lora.calculate_weight(patcher.patches[key], temp_weight, key) if key in patcher.patches \
        else temp_weight
    if set_func is None:
        if key in patcher.patches:
            out_weight = comfy.float.stochastic_rounding(out_weight, weight.dtype,
                                                         seed=comfy.model_patcher.string_to_seed(key))
        if return_weight:
            return out_weight
        comfy.utils.set_attr_param(patcher.model, key, out_weight)
        return None
    return set_func(out_weight, inplace_update=inplace_update, seed=comfy.model_patcher.string_to_seed(key),
                    return_weight=return_weight)


def dynamic_load_asserts(patcher, *args, force_patch_weights: bool = False, **kwargs):
    """comfy/model_patcher.py, `ModelPatcherDynamic.load` (0.38.1) starts with `assert not force_patch_weights`
    (and `partially_load` likewise); everything after it needs a GPU."""
    assert not force_patch_weights


def linear_input_act(linear, x: torch.Tensor, input_act: str | None, *, fp16_accumulation: bool) -> torch.Tensor:
    """comfy/ops.py, `linear_input_act` (0.38.1; Qwen-Image 2.1's feed-forward calls it), its branch for a weight
    that is not a TensorWiseINT8 `QuantizedTensor` (an `Int8Linear`'s weight is a plain int8 tensor): when
    `_fp16_linear_wanted(x)` (the user's fp16-accumulation opt-in and an fp16 CUDA activation, here
    `fp16_accumulation`) and the layer does not ask for full-precision matmul (`_full_precision_mm`), the weight
    comes from `cast_bias_weight(linear, x, offloadable=True)` and goes to comfy-kitchen's fp16 GEMM (here
    `F.linear`, the same arithmetic on the CPU); otherwise the layer itself is called on the activated input."""
    import comfy.ops

    activations = {None: lambda t: t, "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
                   "swiglu": lambda t: torch.nn.functional.silu(t.chunk(2, dim=-1)[0]) * t.chunk(2, dim=-1)[1]}
    activated = activations[input_act](x)
    if not getattr(linear, "_full_precision_mm", False) and fp16_accumulation:
        weight, bias, offload_stream = comfy.ops.cast_bias_weight(linear, x, offloadable=True)
        try:
            return torch.nn.functional.linear(activated, weight, bias)
        finally:
            comfy.ops.uncast_bias_weight(linear, weight, bias, offload_stream)
    return linear(activated)


# --- saving: comfy/model_patcher.py, stored copy of commit 08d0e510f4e539a1db39072589817136ac6cfa7d -------------

def _lazy_casting_param_class():
    import collections

    custom_torch_device = collections.namedtuple("FakeDevice", ["type", "index"])("comfy-lazy-caster", 0)

    class LazyCastingParam(torch.nn.Parameter):
        """comfy/model_patcher.py `LazyCastingParam` (0.38.1), as written there."""

        def __new__(cls, model, key, tensor):
            return super().__new__(cls, tensor)

        def __init__(self, model, key, tensor):
            self.model = model
            self.key = key

        @property
        def device(self):
            return custom_torch_device

        def to(self, *args, **kwargs):
            return self.model.patch_weight_to_device(self.key, device_to=self.model.load_device,
                                                     return_weight=True).to("cpu")

    return LazyCastingParam


LazyCastingParam = _lazy_casting_param_class()


def model_state_dict_for_saving(self, model=None, prefix=""):
    """comfy/model_patcher.py `ModelPatcher.model_state_dict_for_saving` (0.38.1), less its branch for comfy-kitchen
    QuantizedTensor weights (`LazyCastingQuantizedParam`), which no layer of these tests holds: every `weight` /
    `bias` of a layer with `comfy_cast_weights` that the load did not patch (`comfy_patched_weights`; never set
    under dynamic VRAM) becomes a LazyCastingParam, cast (LoRA merged) when safetensors moves it to the CPU."""
    import comfy.utils

    if model is None:
        model = self.model
    original_state_dict = model.state_dict()
    output_state_dict = {}
    keys = list(original_state_dict)
    while len(keys) > 0:
        k = keys.pop(0)
        v = original_state_dict[k]
        op_keys = k.rsplit('.', 1)
        if (len(op_keys) < 2) or op_keys[1] not in ["weight", "bias"]:
            output_state_dict[k] = v
            continue
        try:
            op = comfy.utils.get_attr(model, op_keys[0])
        except Exception:
            output_state_dict[k] = v
            continue
        if not op or not hasattr(op, "comfy_cast_weights") or \
                (hasattr(op, "comfy_patched_weights") and op.comfy_patched_weights == True):  # noqa: E712
            output_state_dict[k] = v
            continue
        key = prefix + k
        weight = comfy.utils.get_attr(self.model, key)
        output_state_dict[k] = LazyCastingParam(self, key, weight)
    return output_state_dict


@contextlib.contextmanager
def core_save_038(monkeypatch) -> Iterator[None]:
    """0.38.1's `model_state_dict_for_saving`, `LazyCastingParam` and `patch_weight_to_device` (which the lazy
    cast calls with `return_weight=True`, unknown to 0.3.75's) swapped into 0.3.75's ModelPatcher for the block."""
    import comfy.model_patcher

    with monkeypatch.context() as patch:
        patch.setattr(comfy.model_patcher, "LazyCastingParam", LazyCastingParam, raising=False)
        patch.setattr(comfy.model_patcher.ModelPatcher, "model_state_dict_for_saving", model_state_dict_for_saving,
                      raising=False)
        patch.setattr(comfy.model_patcher.ModelPatcher, "patch_weight_to_device", patch_weight_to_device)
        yield
