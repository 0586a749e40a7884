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


# --- dynamic VRAM's load / unload across prompts: comfy/model_patcher.py and comfy/utils.py, stored copies of ------
# --- commit 08d0e510f4e539a1db39072589817136ac6cfa7d (0.38-era) --------------------------------------------------

def set_attr_param(obj, attr, value):
    """comfy/utils.py `set_attr_param` (0.38.1): a frozen Parameter (an inference tensor is cloned outside
    inference mode), set with `setattr`."""
    import comfy.utils

    if (not torch.is_inference_mode_enabled()) and value.is_inference():
        value = value.clone()
    return comfy.utils.set_attr(obj, attr, torch.nn.Parameter(value, requires_grad=False))


def set_attr_buffer(obj, attr, value):
    """comfy/utils.py `set_attr_buffer` (0.38.1; 0.3.75 has none): `register_buffer` on the owning module."""
    *path, name = attr.split(".")
    for part in path:
        obj = getattr(obj, part)
    prev = getattr(obj, name, None)
    persistent = name not in getattr(obj, "_non_persistent_buffers_set", set())
    obj.register_buffer(name, value, persistent=persistent)
    return prev


def backup_buffers(patcher) -> dict:
    """`ModelPatcher.backup_buffers` (0.38.1; 0.3.75's patcher has none): shared by a patcher's clones there, kept
    on the model here so every clone of one model sees the same dict."""
    return patcher.model.__dict__.setdefault("backup_buffers_038", {})


def restore_loaded_backups(patcher) -> int:
    """comfy/model_patcher.py `ModelPatcherDynamic.restore_loaded_backups` (0.38.1), as written there: every
    backed-up weight goes back with `set_attr_param`, then every backed-up buffer with `set_attr_buffer`;
    `model_loaded_weight_memory` is reported freed and zeroed."""
    restored = patcher.model.model_loaded_weight_memory
    for key in list(patcher.backup.keys()):
        bk = patcher.backup.pop(key)
        set_attr_param(patcher.model, key, bk.weight)
    buffers = backup_buffers(patcher)
    for key in list(buffers.keys()):
        set_attr_buffer(patcher.model, key, buffers.pop(key))
    patcher.model.model_loaded_weight_memory = 0
    return restored


CPU = torch.device("cpu")


def dynamic_load(patcher, device_to=CPU) -> None:
    """comfy/model_patcher.py `ModelPatcherDynamic.load` (0.38.1), its order kept, less the VBAR and pinned-host
    parts a CPU cannot run: `restore_loaded_backups()` first; per layer with `comfy_cast_weights`, a layer of
    more than 16 KiB gets a VBAR slot (`_v`, a placeholder) and `setup_param` (a `LowVramPatch` in
    `<param>_lowvram_function` where the key has patches, `<param>_function` empty), a smaller one
    `force_load_param` (the backed-up weight put back if there is one, then `patch_weight_to_device(key,
    force_cast=True)`, its bytes counted in `model_loaded_weight_memory`); then the loop over
    `model.named_buffers()` that records each buffer in `backup_buffers` (if not there yet), sets it again cast to
    `device_to` and counts it; `current_weight_patches_uuid` is set; last, the ON_LOAD callbacks (with
    `lowvram_model_memory` 0 and `full_load` False, as `partially_load` calls it). Run it inside
    `dynamic_vram_casts`."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils
    from comfy.patcher_extension import CallbacksMP

    restore_loaded_backups(patcher)
    model = patcher.model

    def force_load_param(name, param_key):
        key = f"{name}.{param_key}"
        weight, _, _ = comfy.model_patcher.get_key_weight(model, key)
        if weight is None:
            return
        if key in patcher.backup:
            set_attr_param(model, key, patcher.backup[key].weight)
        patch_weight_to_device(patcher, key, device_to=device_to, force_cast=True)
        weight, _, _ = comfy.model_patcher.get_key_weight(model, key)
        if weight is not None:
            model.model_loaded_weight_memory += weight.numel() * weight.element_size()

    for name, module in list(_comfy_cast_layers(model)):
        module.comfy_cast_weights = True
        module.seed_key = name
        if comfy.model_management.module_size(module) > SMALL_LAYER_BYTES:
            for param in ("weight", "bias"):
                key = f"{name}.{param}"
                patch = comfy.model_patcher.LowVramPatch(key, patcher.patches) if key in patcher.patches else None
                setattr(module, f"{param}_lowvram_function", patch)
                setattr(module, f"{param}_function", [])
            if not hasattr(module, "_v"):
                module._v = object()
        else:
            module.__dict__.pop("_v", None)
            force_load_param(name, "weight")
            force_load_param(name, "bias")
    buffers = backup_buffers(patcher)
    for key, buf in model.named_buffers(recurse=True):
        if key not in buffers:
            buffers[key] = buf
        *path, buf_name = key.split(".")
        module = comfy.utils.get_attr(model, ".".join(path)) if path else model
        model_dtype = getattr(module, buf_name + "_comfy_model_dtype", None)
        casted_buf = buf.to(dtype=model_dtype, device=device_to)
        set_attr_buffer(model, key, casted_buf)
        model.model_loaded_weight_memory += casted_buf.numel() * casted_buf.element_size()
    model.device = device_to
    model.current_weight_patches_uuid = patcher.patches_uuid
    for callback in patcher.get_all_callbacks(CallbacksMP.ON_LOAD):
        callback(patcher, device_to, 0, False, False)


def partially_load(patcher, device_to=CPU) -> None:
    """comfy/model_patcher.py `ModelPatcherDynamic.partially_load` (0.38.1), how `load_models_gpu`
    loads a dynamic model: `unpatch_model(unpatch_weights=False)` (object patches taken off,
    weights left), `patch_model(load_weights=False)` (object patches put on), then `load`."""
    patcher.unpatch_model(patcher.offload_device, unpatch_weights=False)
    patcher.patch_model(load_weights=False)
    dynamic_load(patcher, device_to)


def partially_unload(patcher, memory_to_free: float = 0, vbar=None) -> int:
    """comfy/model_patcher.py `ModelPatcherDynamic.partially_unload` (0.38.1, at 08d0e510): the model's VBAR frees
    what it can first (`vbar.free_memory(memory_to_free)`, comfy-aimdo's; None: no VBAR, as on the CPU), and only
    where that freed less than asked are the loaded backups restored, `restore_loaded_backups()`'s count added to
    what is reported freed."""
    freed = 0 if vbar is None else vbar.free_memory(memory_to_free)
    if freed < memory_to_free:
        freed += restore_loaded_backups(patcher)
    return freed


def make_dynamic(patcher, monkeypatch) -> None:
    """Give 0.3.75's `patcher` what tells 0.38.1's `ModelPatcherDynamic` apart where the pack looks: its
    `restore_loaded_backups` (above) as a method, and `is_dynamic()` True, for the test."""
    import types

    monkeypatch.setattr(patcher, "restore_loaded_backups", types.MethodType(restore_loaded_backups, patcher),
                        raising=False)
    monkeypatch.setattr(patcher, "is_dynamic", lambda: True, raising=False)


def dynamic_unpatch_model(patcher) -> None:
    """comfy/model_patcher.py `ModelPatcherDynamic.unpatch_model` (0.38.1, `unpatch_weights=True`: an unload):
    the base class with `unpatch_weights=False`, then `partially_unload(None, 1e32)`; the per-layer state
    `load` left is cleared here too, so the model is 0.3.75's again."""
    patcher.unpatch_model(device_to=None, unpatch_weights=False)
    partially_unload(patcher, 1e32)
    for _, module in _comfy_cast_layers(patcher.model):
        for attr in ("weight_lowvram_function", "bias_lowvram_function", "weight_function", "bias_function", "_v",
                     "seed_key"):
            module.__dict__.pop(attr, None)
        module.__dict__.pop("comfy_cast_weights", None)
    patcher.model.current_weight_patches_uuid = None


@contextlib.contextmanager
def dynamic_vram_casts(monkeypatch) -> Iterator[None]:
    """0.38.1's `LowVramPatch.__call__` and streamed-layer cast (see `dynamic_vram_load`) for the block."""
    import comfy.ops

    with lowvram_patch_without_convert(monkeypatch), monkeypatch.context() as patch:
        patch.setattr(comfy.ops, "cast_bias_weight", _streamed_cast(comfy.ops.cast_bias_weight))
        yield


def model_call(patcher, monkeypatch, kind: str = "sd15", size: int = 16, dynamic: bool | None = None,
               lowvram: bool = False, calls: int = 1) -> tuple[torch.Tensor, int]:
    """`calls` direct model calls of `patcher` (batch 2, a fixed latent and timestep) loaded the way its patcher
    loads it, or as `dynamic` says: 0.38.1's dynamic-VRAM load (`dynamic_vram_load`) for a dynamic one
    (`make_dynamic`), else 0.3.75's load, full or with every layer offloaded (`lowvram`). Returns the last call's
    output and how many INT8 kernel calls ran the W8A8 arithmetic in it."""
    from comfyui_int8_accel.kernels import record_calls
    from comfyui_int8_accel.nodes.comfy_contracts import is_dynamic
    from harness.tiny_models import latent_channels, make_conditioning

    gen = torch.Generator().manual_seed(3)
    positive, _ = make_conditioning(kind, batch=2)
    x, t = torch.randn(2, latent_channels(kind), size, size, generator=gen), torch.tensor([700.0, 700.0])
    if is_dynamic(patcher) if dynamic is None else dynamic:
        loading = dynamic_vram_load(patcher, monkeypatch)
    else:
        patcher.patch_model(device_to=CPU, lowvram_model_memory=1 if lowvram else 0)
        loading = contextlib.ExitStack()
        loading.callback(patcher.unpatch_model, device_to=CPU)
    with loading, torch.inference_mode():
        cond = patcher.model.extra_conds(noise=x, cross_attn=positive[0][0], **positive[0][1])
        cond = {key: value.cond if hasattr(value, "cond") else value for key, value in cond.items()}
        for _ in range(calls):
            with record_calls() as counted:
                out = patcher.model.apply_model(x, t, transformer_options={"wrappers": patcher.wrappers}, **cond)
    return out, sum(n for (op, backend, path), n in counted.items() if path == "int8")


def emulated_dynamic_load(out, gpu: torch.device) -> None:
    """What dynamic VRAM's load leaves on the model for the INT8 plan: every cast layer streamed
    (`comfy_cast_weights`, no per-layer patches), the model on `gpu` with nothing counted yet, then ON_LOAD."""
    from comfy.patcher_extension import CallbacksMP

    for module in out.model.modules():
        if hasattr(module, "comfy_cast_weights"):
            module.comfy_cast_weights = True
            module.weight_function, module.bias_function = [], []
    out.model.device, out.model.model_loaded_weight_memory = gpu, 0
    out.model.current_weight_patches_uuid = out.patches_uuid
    for callback in out.get_all_callbacks(CallbacksMP.ON_LOAD):
        callback(out, gpu, 0, False, False)


# --- the plain (non-dynamic) ModelPatcher's load: comfy/model_patcher.py, stored copy of commit
# 08d0e510f4e539a1db39072589817136ac6cfa7d (0.38-era) ---------------------------------------------------------------

def _classic_load_list(patcher) -> list:
    """`ModelPatcher._load_list()` (0.38.1, `for_dynamic=False`, no `default_device`): per module with weights,
    (offload cost, size, name, module, {param name: param}), the offload cost counting a LoRA's estimate."""
    import comfy.model_management
    import comfy.model_patcher

    loading = []
    for n, m in patcher.model.named_modules():
        params = dict(m.named_parameters(recurse=False))
        if any(name not in params for name, _ in m.named_parameters(recurse=True)):
            continue  # random weights in non-leaf modules
        if hasattr(m, "comfy_cast_weights") or params:
            module_mem = comfy.model_management.module_size(m)
            offload_mem = module_mem
            if hasattr(m, "comfy_cast_weights"):
                for key in (f"{n}.weight", f"{n}.bias"):
                    if key in patcher.patches:
                        offload_mem += comfy.model_patcher.low_vram_patch_estimate_vram(patcher.model, key)
            loading.append((offload_mem, module_mem, n, m, params))
    return loading


def classic_load(patcher, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
    """`ModelPatcher.load` (0.38.1) in its order: the offload buffer looks `NUM_STREAMS` modules ahead; a LoRA whose
    result changes the tensor's shape (`comfy.lora.calculate_shape`) is merged even into an offloaded layer; every
    layer gets `comfy_force_cast_weights`; a loaded layer's parameters are patched one by one; the rest as 0.3.75's.
    The pinned-memory and CUDA synchronisation steps are left out (no GPU here)."""
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    from comfy.patcher_extension import CallbacksMP

    calculate_shape = getattr(comfy.lora, "calculate_shape", lambda patches, weight, key: weight.shape)
    with patcher.use_ejected():
        patcher.unpatch_hooks()
        mem_counter = patch_counter = lowvram_counter = 0
        loading = _classic_load_list(patcher)
        load_completely, offload_buffer = [], 0
        loading.sort(key=lambda entry: entry[:3], reverse=True)
        for i, (module_offload_mem, module_mem, n, m, params) in enumerate(loading):
            lowvram_weight = False
            ahead = sum(entry[1] for entry in loading[i + 1:i + 1 + comfy.model_management.NUM_STREAMS])
            potential_offload = max(offload_buffer, module_offload_mem + ahead)
            lowvram_fits = mem_counter + module_mem + potential_offload < lowvram_model_memory
            weight_key, bias_key = f"{n}.weight", f"{n}.bias"
            if not full_load and hasattr(m, "comfy_cast_weights") and not lowvram_fits:
                offload_buffer = potential_offload
                lowvram_weight = True
                lowvram_counter += 1
                if hasattr(m, "prev_comfy_cast_weights"):
                    continue
            cast_weight = patcher.force_cast_weights
            m.comfy_force_cast_weights = patcher.force_cast_weights
            if lowvram_weight:
                if hasattr(m, "comfy_cast_weights"):
                    m.weight_function, m.bias_function = [], []
                for key, name in ((weight_key, "weight"), (bias_key, "bias")):
                    if key in patcher.patches:
                        tensor = getattr(m, name)
                        if force_patch_weights or calculate_shape(patcher.patches[key], tensor, key) != tensor.shape:
                            patcher.patch_weight_to_device(key)
                        else:
                            _, set_func, convert_func = comfy.model_patcher.get_key_weight(patcher.model, key)
                            setattr(m, f"{name}_function",
                                    [comfy.model_patcher.LowVramPatch(key, patcher.patches, convert_func, set_func)])
                            patch_counter += 1
                cast_weight = True
            else:
                if hasattr(m, "comfy_cast_weights"):
                    comfy.model_patcher.wipe_lowvram_weight(m)
                if full_load or lowvram_fits:
                    mem_counter += module_mem
                    load_completely.append((module_mem, n, m, params))
                else:
                    offload_buffer = potential_offload
            if cast_weight and hasattr(m, "comfy_cast_weights"):
                m.prev_comfy_cast_weights = m.comfy_cast_weights
                m.comfy_cast_weights = True
            if weight_key in patcher.weight_wrapper_patches:
                m.weight_function.extend(patcher.weight_wrapper_patches[weight_key])
            if bias_key in patcher.weight_wrapper_patches:
                m.bias_function.extend(patcher.weight_wrapper_patches[bias_key])
            mem_counter += comfy.model_patcher.move_weight_functions(m, device_to)

        load_completely.sort(key=lambda entry: entry[:2], reverse=True)
        for _, n, m, params in load_completely:
            if getattr(m, "comfy_patched_weights", False) is True:
                continue
            for param in params:
                key = f"{n}.{param}"
                patcher.unpin_weight(key)
                patcher.patch_weight_to_device(key, device_to=device_to)
            m.comfy_patched_weights = True
        for _, _, m, _ in load_completely:
            m.to(device_to)

        if lowvram_counter > 0:
            patcher.model.model_lowvram = True
        else:
            patcher.model.model_lowvram = False
            if full_load:
                patcher.model.to(device_to)
                mem_counter = patcher.model_size()
        patcher.model.lowvram_patch_counter += patch_counter
        patcher.model.device = device_to
        patcher.model.model_loaded_weight_memory = mem_counter
        patcher.model.model_offload_buffer_memory = offload_buffer
        patcher.model.current_weight_patches_uuid = patcher.patches_uuid
        for callback in patcher.get_all_callbacks(CallbacksMP.ON_LOAD):
            callback(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load)
        patcher.apply_hooks(patcher.forced_hooks, force_apply=True)
