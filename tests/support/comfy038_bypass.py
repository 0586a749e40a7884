"""ComfyUI 0.38.1's bypass-mode LoRA, to swap into the real ComfyUI 0.3.75 (which has none).

- `load_bypass_lora_for_models`: comfy/sd.py (Comfy-Org/ComfyUI, stored copy of commit
  033046cc4fac82d954c6daedccf1c8128433c4f1), less its CLIP half and its logging.
- `BypassForwardHook`, `BypassInjectionManager`, `get_module_type_info`: comfy/weight_adapter/bypass.py (stored copy
  of commit 511d2e5fabe4db672dc1f9555edd00cc993cb283), less their logging and the training-adapter branches.
- `lora_h`, `lora_bypass_forward`: `LoRAAdapter.h` / `.bypass_forward` of comfy/weight_adapter/lora.py (stored copy
  of commit 6f98b150e065f1ffc788558574a887835068bd40); `base_h`, `base_g`, `base_bypass_forward`:
  `WeightAdapterBase`'s defaults (no additive part, identity output, `g(f(x) + h(x, f(x)))`, the formula of
  bypass.py's default path), put on 0.3.75's adapter classes by `bypass_lora_038`.

The hook replaces `forward` of the layer it finds at the LoRA key's module path with its `_bypass_forward`
(`inject`, run by the patcher's `inject_model` when it loads the model) and puts it back on `eject`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


def get_module_type_info(module: nn.Module) -> dict:
    """comfy/weight_adapter/bypass.py `get_module_type_info` (0.38.1), as written there."""
    info = {
        "is_conv": False,
        "conv_dim": 0,
        "stride": (1,),
        "padding": (0,),
        "dilation": (1,),
        "groups": 1,
        "kernel_size": (1,),
        "in_channels": None,
        "out_channels": None,
    }

    # Determine conv type
    if isinstance(module, nn.Conv1d):
        info["is_conv"] = True
        info["conv_dim"] = 1
    elif isinstance(module, nn.Conv2d):
        info["is_conv"] = True
        info["conv_dim"] = 2
    elif isinstance(module, nn.Conv3d):
        info["is_conv"] = True
        info["conv_dim"] = 3
    elif isinstance(module, nn.Linear):
        info["is_conv"] = False
        info["conv_dim"] = 0
    else:
        # Try to infer from class name for custom/quantized layers
        class_name = type(module).__name__.lower()
        if "conv3d" in class_name:
            info["is_conv"] = True
            info["conv_dim"] = 3
        elif "conv2d" in class_name:
            info["is_conv"] = True
            info["conv_dim"] = 2
        elif "conv1d" in class_name:
            info["is_conv"] = True
            info["conv_dim"] = 1
        elif "conv" in class_name:
            info["is_conv"] = True
            info["conv_dim"] = 2

    # Extract conv parameters if it's a conv layer
    if info["is_conv"]:
        # Try to get stride, padding, dilation, groups, kernel_size from module
        info["stride"] = getattr(module, "stride", (1,) * info["conv_dim"])
        info["padding"] = getattr(module, "padding", (0,) * info["conv_dim"])
        info["dilation"] = getattr(module, "dilation", (1,) * info["conv_dim"])
        info["groups"] = getattr(module, "groups", 1)
        info["kernel_size"] = getattr(module, "kernel_size", (1,) * info["conv_dim"])
        info["in_channels"] = getattr(module, "in_channels", None)
        info["out_channels"] = getattr(module, "out_channels", None)

        # Ensure they're tuples
        if isinstance(info["stride"], int):
            info["stride"] = (info["stride"],) * info["conv_dim"]
        if isinstance(info["padding"], int):
            info["padding"] = (info["padding"],) * info["conv_dim"]
        if isinstance(info["dilation"], int):
            info["dilation"] = (info["dilation"],) * info["conv_dim"]
        if isinstance(info["kernel_size"], int):
            info["kernel_size"] = (info["kernel_size"],) * info["conv_dim"]

    return info


class BypassForwardHook:
    """comfy/weight_adapter/bypass.py `BypassForwardHook` (0.38.1), for inference adapters."""

    def __init__(self, module: nn.Module, adapter, multiplier: float = 1.0):
        self.module = module
        self.adapter = adapter
        self.multiplier = multiplier
        self.original_forward = None

        # Determine layer type and conv params from module class (works for quantized layers)
        module_info = get_module_type_info(module)

        # Set multiplier and layer type info on adapter for use in h()
        adapter.multiplier = multiplier
        adapter.is_conv = module_info["is_conv"]
        adapter.conv_dim = module_info["conv_dim"]
        adapter.kernel_size = module_info["kernel_size"]
        adapter.in_channels = module_info["in_channels"]
        adapter.out_channels = module_info["out_channels"]
        # Store kw_dict for conv operations (like LyCORIS extra_args)
        if module_info["is_conv"]:
            adapter.kw_dict = {
                "stride": module_info["stride"],
                "padding": module_info["padding"],
                "dilation": module_info["dilation"],
                "groups": module_info["groups"],
            }
        else:
            adapter.kw_dict = {}

    def _bypass_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        import comfy.weight_adapter

        # Check if adapter has custom bypass_forward (e.g., GLoRA)
        adapter_bypass = getattr(self.adapter, "bypass_forward", None)
        if adapter_bypass is not None:
            # Check if it's overridden (not the base class default)
            adapter_type = type(self.adapter)
            is_default_bypass = (
                adapter_type.bypass_forward is comfy.weight_adapter.WeightAdapterBase.bypass_forward
            )
            if not is_default_bypass:
                return adapter_bypass(self.original_forward, x, *args, **kwargs)

        # Default bypass: g(f(x) + h(x, f(x)))
        base_out = self.original_forward(x, *args, **kwargs)
        h_out = self.adapter.h(x, base_out)
        return self.adapter.g(base_out + h_out)

    def inject(self):
        """Replace module forward with bypass version."""
        import comfy.model_management

        if self.original_forward is not None:
            return  # Already injected

        device = comfy.model_management.get_torch_device()

        # Get dtype from module weight if available
        dtype = None
        if hasattr(self.module, "weight") and self.module.weight is not None:
            dtype = self.module.weight.dtype

        # Only use dtype if it's a standard float type, not quantized
        if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            dtype = None

        self._move_adapter_weights_to_device(device, dtype)

        self.original_forward = self.module.forward
        self.module.forward = self._bypass_forward

    def _move_adapter_weights_to_device(self, device, dtype=None):
        adapter = self.adapter

        # WeightAdapterBase: handle self.weights tuple
        if not hasattr(adapter, "weights") or adapter.weights is None:
            return

        weights = adapter.weights
        if isinstance(weights, (list, tuple)):
            new_weights = []
            for w in weights:
                if isinstance(w, torch.Tensor):
                    if dtype is not None:
                        new_weights.append(w.to(device=device, dtype=dtype))
                    else:
                        new_weights.append(w.to(device=device))
                else:
                    new_weights.append(w)
            adapter.weights = (
                tuple(new_weights) if isinstance(weights, tuple) else new_weights
            )

    def eject(self):
        """Restore original module forward."""
        if self.original_forward is None:
            return  # Not injected

        self.module.forward = self.original_forward
        self.original_forward = None


class BypassInjectionManager:
    """comfy/weight_adapter/bypass.py `BypassInjectionManager` (0.38.1)."""

    def __init__(self):
        self.adapters: dict = {}
        self.hooks: list[BypassForwardHook] = []

    def add_adapter(self, key: str, adapter, strength: float = 1.0):
        # Remove .weight suffix if present for module lookup
        module_key = key
        if module_key.endswith(".weight"):
            module_key = module_key[:-7]

        self.adapters[module_key] = (adapter, strength)

    def _get_module_by_key(self, model: nn.Module, key: str):
        parts = key.split(".")
        module = model
        try:
            for i, part in enumerate(parts):  # noqa: B007 (its error log used i)
                if part.isdigit():
                    module = module[int(part)]
                else:
                    module = getattr(module, part)
            return module
        except (AttributeError, IndexError, KeyError):
            return None

    def create_injections(self, model: nn.Module) -> list:
        from comfy.patcher_extension import PatcherInjection

        self.hooks.clear()

        for key, (adapter, strength) in self.adapters.items():
            module = self._get_module_by_key(model, key)

            if module is None:
                continue

            if not hasattr(module, "weight"):
                continue

            hook = BypassForwardHook(module, adapter, multiplier=strength)
            self.hooks.append(hook)

        # Create single injection that manages all hooks
        def inject_all(model_patcher):
            for hook in self.hooks:
                hook.inject()

        def eject_all(model_patcher):
            for hook in self.hooks:
                hook.eject()

        return [PatcherInjection(inject=inject_all, eject=eject_all)]

    def get_hook_count(self) -> int:
        return len(self.hooks)


def lora_h(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
    """comfy/weight_adapter/lora.py `LoRAAdapter.h` (0.38.1), as written there."""
    # FUNC_LIST: [None, None, F.linear, F.conv1d, F.conv2d, F.conv3d]
    FUNC_LIST = [None, None, F.linear, F.conv1d, F.conv2d, F.conv3d]  # noqa: N806

    v = self.weights
    # v[0]=up, v[1]=down, v[2]=alpha, v[3]=mid, v[4]=dora_scale, v[5]=reshape
    up = v[0]
    down = v[1]
    alpha = v[2]
    mid = v[3]

    # Compute scale = alpha / rank
    rank = down.shape[0]
    if alpha is not None:
        scale = alpha / rank
    else:
        scale = 1.0
    scale = scale * getattr(self, "multiplier", 1.0)

    # Cast dtype
    up = up.to(dtype=x.dtype)
    down = down.to(dtype=x.dtype)

    # Use module info from bypass injection, not weight dimension
    is_conv = getattr(self, "is_conv", False)
    conv_dim = getattr(self, "conv_dim", 0)
    kw_dict = getattr(self, "kw_dict", {})

    if is_conv:
        op = FUNC_LIST[
            conv_dim + 2
        ]  # conv_dim 1->conv1d(3), 2->conv2d(4), 3->conv3d(5)
        kernel_size = getattr(self, "kernel_size", (1,) * conv_dim)
        in_channels = getattr(self, "in_channels", None)

        if down.dim() == 2:
            # down.shape[1] = in_channels * prod(kernel_size)
            if in_channels is not None:
                down = down.view(down.shape[0], in_channels, *kernel_size)
            else:
                # Fallback: assume 1x1 kernel if in_channels unknown
                down = down.view(*down.shape, *([1] * conv_dim))
        if up.dim() == 2:
            # up always uses 1x1 kernel
            up = up.view(*up.shape, *([1] * conv_dim))
        if mid is not None:
            mid = mid.to(dtype=x.dtype)
            if mid.dim() == 2:
                mid = mid.view(*mid.shape, *([1] * conv_dim))
    else:
        op = F.linear
        kw_dict = {}  # linear doesn't take stride/padding

    # Simple chain: down -> mid (if tucker) -> up
    if mid is not None:
        if not is_conv:
            mid = mid.to(dtype=x.dtype)
        hidden = op(x, down)
        hidden = op(hidden, mid, **kw_dict)
        out = op(hidden, up)
    else:
        hidden = op(x, down, **kw_dict)
        out = op(hidden, up)

    if (not torch.is_grad_enabled() and type(out) is torch.Tensor
            and (not torch.is_tensor(scale) or scale.ndim == 0)
            and torch.result_type(out, scale) == out.dtype):
        return out.mul_(scale)
    return out * scale


def lora_bypass_forward(self, org_forward, x, *args, **kwargs):
    """comfy/weight_adapter/lora.py `LoRAAdapter.bypass_forward` (0.38.1), as written there."""
    import comfy.weight_adapter

    # The native h() owns its projection output; base output may alias caller state.
    if torch.is_grad_enabled() or getattr(self.h, "__func__", None) is not comfy.weight_adapter.LoRAAdapter.h:
        return base_bypass_forward(self, org_forward, x, *args, **kwargs)

    base_out = org_forward(x, *args, **kwargs)
    h_out = self.h(x, base_out)
    if (type(base_out) is torch.Tensor and type(h_out) is torch.Tensor
            and h_out.shape == base_out.shape and h_out.dtype == base_out.dtype
            and h_out.stride() == base_out.stride()):
        torch.add(base_out, h_out, out=h_out)
        del base_out
        return self.g(h_out)
    return self.g(base_out + h_out)


def base_h(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(base_out)


def base_g(self, y: torch.Tensor) -> torch.Tensor:
    return y


def base_bypass_forward(self, org_forward, x, *args, **kwargs):
    base_out = org_forward(x, *args, **kwargs)
    return self.g(base_out + self.h(x, base_out))


def load_bypass_lora_for_models(model, clip, lora, strength_model, strength_clip):
    """comfy/sd.py `load_bypass_lora_for_models` (0.38.1), its model half."""
    import comfy.lora
    import comfy.lora_convert
    import comfy.weight_adapter

    key_map = {}
    if model is not None:
        key_map = comfy.lora.model_lora_keys_unet(model.model, key_map)

    lora = comfy.lora_convert.convert_lora(lora)
    loaded = comfy.lora.load_lora(lora, key_map)

    # Separate adapters (for bypass) from other patches (for regular patching)
    bypass_patches = {}  # WeightAdapterBase instances -> bypass mode
    regular_patches = {}  # diff, set, bias patches -> regular weight patching

    for key, patch_data in loaded.items():
        if isinstance(patch_data, comfy.weight_adapter.WeightAdapterBase):
            bypass_patches[key] = patch_data
        else:
            regular_patches[key] = patch_data

    k = set()

    new_modelpatcher = model.clone()

    # Apply regular patches (bias diff, weight diff, etc.) via normal patching
    if regular_patches:
        patched_keys = new_modelpatcher.add_patches(regular_patches, strength_model)
        k.update(patched_keys)

    # Apply adapter patches via bypass injection
    manager = BypassInjectionManager()
    model_sd_keys = set(new_modelpatcher.model.state_dict().keys())

    for key, adapter in bypass_patches.items():
        if key in model_sd_keys:
            manager.add_adapter(key, adapter, strength=strength_model)
            k.add(key)

    injections = manager.create_injections(new_modelpatcher.model)

    if manager.get_hook_count() > 0:
        new_modelpatcher.set_injections("bypass_lora", injections)

    return (new_modelpatcher, None)


@contextlib.contextmanager
def bypass_lora_038(monkeypatch) -> Iterator[None]:
    """0.38.1's adapter methods for bypass mode on 0.3.75's adapter classes, for the block."""
    import comfy.weight_adapter

    with monkeypatch.context() as patch:
        base = comfy.weight_adapter.WeightAdapterBase
        for name, value in (("h", base_h), ("g", base_g), ("bypass_forward", base_bypass_forward)):
            patch.setattr(base, name, value, raising=False)
        patch.setattr(comfy.weight_adapter.LoRAAdapter, "h", lora_h, raising=False)
        patch.setattr(comfy.weight_adapter.LoRAAdapter, "bypass_forward", lora_bypass_forward, raising=False)
        yield
