"""ComfyUI 0.38's loading of quantized checkpoints, run inside the real ComfyUI 0.3.75 on comfy-kitchen 0.2.40.

ComfyUI 0.38 cannot be installed here, so the functions it uses to read `comfy_quant` layers are swapped in as 0.38
writes them (read from Comfy-Org/ComfyUI, 2026-11), and everything else stays 0.3.75's own:

- `detect_layer_quantization`: comfy/utils.py `detect_layer_quantization` (0.38 text). One `.comfy_quant` key
  under the model's prefix switches the whole model to the mixed-precision ops (comfy/model_detection.py
  `model_config_from_unet` sets `model_config.quant_config`; comfy/ops.py `pick_operations` then returns
  `mixed_precision_ops(...)`).
- `QUANT_ALGOS`: comfy/quant_ops.py `QUANT_ALGOS` (0.38), the formats whose layouts comfy-kitchen 0.2.40 has:
  float8_e4m3fn, float8_e5m2, nvfp4, int8_tensorwise. 0.38 registers its own fp8 subclasses of comfy-kitchen's
  `TensorCoreFP8Layout` under the names "TensorCoreFP8E4M3Layout"/"TensorCoreFP8E5M2Layout" (they differ only in
  how they quantize); dequantizing, all this module does with them, is comfy-kitchen's, so kitchen's class stands in.
- `load_quantized_module`: comfy/ops.py `_load_quantized_module` (0.38 text, the branches of the formats above).
- `mixed_precision_ops`: comfy/ops.py `mixed_precision_ops` (0.38): a `manual_cast` family whose `Linear` is a
  `torch.nn.Module` + `MixedPrecisionOp` (not `nn.Linear`) loading through `_load_quantized_module`; every other
  layer, `Conv2d` included, is `manual_cast`'s, i.e. torch's own `_load_from_state_dict` (0.38 gives
  `disable_weight_init.Conv2d` no loader of its own). Its forward here is the one 0.38 takes on a CPU, where
  `get_disabled_quant_formats` disables every quantized format (`_full_precision_mm`): the weight is dequantized,
  the layer's per-forward patches (dynamic VRAM's `weight_lowvram_function`, then `weight_function`) are applied
  to it as 0.38's `cast_bias_weight` does, and `F.linear` runs in the input's dtype. Its `state_dict` is 0.38's
  `_quantized_weight_state_dict` (what ComfyUI's memory accounting reads) and its `_apply` 0.38's
  `_quantized_apply`.
- Loading the model: comfy/model_base.py `BaseModel.load_model_weights` (0.38) is `load_state_dict(to_load,
  strict=False)`, as in 0.3.75: unexpected keys are logged, a shape mismatch raises.
"""

from __future__ import annotations

import json
import logging

import torch

CORE_038_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "int8_tensorwise")


def _is_quantized(weight) -> bool:
    from comfy_kitchen.tensor import QuantizedTensor

    return isinstance(weight, QuantizedTensor)


def detect_layer_quantization(state_dict, prefix):
    # comfy/utils.py (ComfyUI 0.38)
    for k in state_dict:
        if k.startswith(prefix) and k.endswith(".comfy_quant"):
            logging.info("Found quantization metadata version 1")
            return {"mixed_ops": True}
    return None


def quant_algos() -> dict:
    """comfy/quant_ops.py `QUANT_ALGOS` (0.38) for the formats comfy-kitchen 0.2.40 can hold (see the module doc)."""
    return {
        "float8_e4m3fn": {"storage_t": torch.float8_e4m3fn, "parameters": {"weight_scale", "input_scale"},
                          "comfy_tensor_layout": "TensorCoreFP8Layout"},
        "float8_e5m2": {"storage_t": torch.float8_e5m2, "parameters": {"weight_scale", "input_scale"},
                        "comfy_tensor_layout": "TensorCoreFP8Layout"},
        "nvfp4": {"storage_t": torch.uint8, "parameters": {"weight_scale", "weight_scale_2", "input_scale",
                                                           "pre_quant_scale"},
                  "comfy_tensor_layout": "TensorCoreNVFP4Layout", "group_size": 16},
        "int8_tensorwise": {"storage_t": torch.int8, "parameters": {"weight_scale"},
                            "comfy_tensor_layout": "TensorWiseINT8Layout", "quantize_input": False},
    }


def load_quantized_module(module, super_load, state_dict, prefix, local_metadata, strict,
                          missing_keys, unexpected_keys, error_msgs, load_extra_params=False):
    # comfy/ops.py `_load_quantized_module` (ComfyUI 0.38), the branches of CORE_038_FORMATS
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class

    QUANT_ALGOS = quant_algos()  # noqa: N806 - 0.38's module-level name
    device = module.factory_kwargs["device"]
    compute_dtype = module.factory_kwargs["dtype"]
    disabled_formats = module._disabled_formats
    layer_name = prefix.rstrip('.')

    weight = state_dict.pop(f"{prefix}weight", None)
    if weight is None:
        logging.warning(f"Missing weight for layer {layer_name}")
        module.weight = None
        return
    manually_loaded_keys = [f"{prefix}weight"]

    def pop_scale(name, dtype=None):
        key = f"{prefix}{name}"
        v = state_dict.pop(key, None)
        if v is not None:
            v = v.to(device=device)
            if dtype is not None:
                v = v.view(dtype=dtype)
            manually_loaded_keys.append(key)
        return v

    layer_conf = state_dict.pop(f"{prefix}comfy_quant", None)
    if layer_conf is not None:
        layer_conf = json.loads(layer_conf.numpy().tobytes())

    if layer_conf is None:
        module.weight = torch.nn.Parameter(weight.to(device=device, dtype=compute_dtype), requires_grad=False)
    else:
        module.quant_format = layer_conf.get("format", None)
        module._full_precision_mm_config = layer_conf.get("full_precision_matrix_mult", False)
        if not module._full_precision_mm:
            module._full_precision_mm = module._full_precision_mm_config
        if module.quant_format in disabled_formats:
            module._full_precision_mm = True
        if module.quant_format is None:
            raise ValueError(f"Unknown quantization format for layer {layer_name}")

        qconfig = QUANT_ALGOS[module.quant_format]
        module.layout_type = qconfig["comfy_tensor_layout"]
        layout_cls = get_layout_class(module.layout_type)

        if module.quant_format in ("float8_e4m3fn", "float8_e5m2"):
            scales = {"scale": pop_scale("weight_scale")}
        elif module.quant_format == "nvfp4":
            ts = pop_scale("weight_scale_2")
            bs = pop_scale("weight_scale", torch.float8_e4m3fn)
            if ts is None or bs is None:
                raise ValueError(f"Missing NVFP4 scales for layer {layer_name}")
            scales = {"scale": ts, "block_scale": bs}
        elif module.quant_format == "int8_tensorwise":
            scale = pop_scale("weight_scale")
            if scale is None:
                raise ValueError(f"Missing INT8 weight scale for layer {layer_name}")
            scales = {"scale": scale}
            params_conf = layer_conf.get("params", {})
            if not isinstance(params_conf, dict):
                params_conf = {}
            if layer_conf.get("convrot", params_conf.get("convrot", False)):
                scales["convrot"] = True
                scales["convrot_groupsize"] = int(
                    layer_conf.get("convrot_groupsize", params_conf.get("convrot_groupsize", 256))
                )
        else:
            raise ValueError(f"Unsupported quantization format: {module.quant_format}")

        params = layout_cls.Params(**scales, orig_dtype=compute_dtype, orig_shape=module._orig_shape)
        module.weight = torch.nn.Parameter(
            QuantizedTensor(weight.to(device=device, dtype=qconfig["storage_t"]), module.layout_type, params),
            requires_grad=False,
        )

        if load_extra_params:
            for param_name in qconfig["parameters"]:
                if param_name in {"weight_scale", "weight_scale_2"}:
                    continue
                param_key = f"{prefix}{param_name}"
                _v = state_dict.pop(param_key, None)
                if _v is None:
                    continue
                module.register_parameter(param_name, torch.nn.Parameter(_v.to(device=device), requires_grad=False))
                manually_loaded_keys.append(param_key)

    super_load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    for key in manually_loaded_keys:
        if key in missing_keys:
            missing_keys.remove(key)


def quantized_apply(module, fn, recurse=True):
    # comfy/ops.py `_quantized_apply` (ComfyUI 0.38): what the mixed-precision Linear's `_apply` runs
    if recurse:
        for child in module.children():
            child._apply(fn)
    for key, param in module._parameters.items():
        if param is None:
            continue
        p = fn(param)
        if p.device == param.device and p.dtype == param.dtype:
            # (not in 0.38's text) 0.3.75 moves the model inside inference mode, where comfy-kitchen 0.2.40's
            # QuantizedTensor cannot be wrapped in a new Parameter: a move to where the weight already is is skipped
            continue
        if (not torch.is_inference_mode_enabled()) and p.is_inference():
            p = p.clone()
        module.register_parameter(key, torch.nn.Parameter(p, requires_grad=False))
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


def mixed_precision_ops(compute_dtype: torch.dtype = torch.float32, disabled=CORE_038_FORMATS) -> type:
    """0.38's `mixed_precision_ops(quant_config, compute_dtype, disabled=...)` as described in the module doc."""
    import comfy.ops

    class MixedPrecisionOp(comfy.ops.CastWeightBiasOp):
        quant_format = None

    class MixedPrecisionOps(comfy.ops.manual_cast):
        _compute_dtype = compute_dtype
        _full_precision_mm = False

        class Linear(torch.nn.Module, MixedPrecisionOp):
            _disabled_formats = disabled

            def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
                super().__init__()
                self.factory_kwargs = {"device": device, "dtype": MixedPrecisionOps._compute_dtype}
                self.in_features = in_features
                self.out_features = out_features
                self._orig_shape = (out_features, in_features)
                if bias:
                    self.bias = torch.nn.Parameter(torch.empty(out_features, **self.factory_kwargs))
                else:
                    self.register_parameter("bias", None)
                self.tensor_class = None
                self._full_precision_mm = MixedPrecisionOps._full_precision_mm
                self._full_precision_mm_config = False

            def reset_parameters(self):
                return None

            def _load_from_state_dict(self, *args):
                load_quantized_module(self, super()._load_from_state_dict, *args, load_extra_params=True)

            def _apply(self, fn, recurse=True):
                return quantized_apply(self, fn, recurse)

            def state_dict(self, *args, destination=None, prefix="", **kwargs):
                # comfy/ops.py `_quantized_weight_state_dict` (0.38), without the extra parameters
                sd = destination if destination is not None else {}
                if self.bias is not None:
                    sd[f"{prefix}bias"] = self.bias
                if _is_quantized(self.weight):
                    sd.update(self.weight.state_dict(f"{prefix}weight"))
                    sd[f"{prefix}comfy_quant"] = torch.tensor(
                        list(json.dumps({"format": self.quant_format}).encode("utf-8")), dtype=torch.uint8)
                else:
                    sd[f"{prefix}weight"] = self.weight
                return sd

            def forward(self, input, *args, **kwargs):
                weight = self.weight
                if _is_quantized(weight):
                    weight = weight.dequantize()
                bias = None if self.bias is None else self.bias.to(input.dtype)
                weight = weight.to(input.dtype)
                # 0.38's cast (`cast_bias_weight`, its `post_cast`) applies a layer's per-forward patches to the
                # real-valued weight: dynamic VRAM's `<param>_lowvram_function` first, then `<param>_function`
                for name in ("weight", "bias"):
                    value = weight if name == "weight" else bias
                    if value is None:
                        continue
                    lowvram = getattr(self, f"{name}_lowvram_function", None)
                    if lowvram is not None:
                        value = lowvram(value.clone())
                    for patch in getattr(self, f"{name}_function", None) or ():
                        value = patch(value)
                    weight, bias = (value, bias) if name == "weight" else (weight, value)
                return torch.nn.functional.linear(input, weight, bias)

    return MixedPrecisionOps


def load_as_core_038(state_dict: dict[str, torch.Tensor], model_options: dict | None = None):
    """Load a diffusion-model state dict the way ComfyUI 0.38 does with respect to quantized layers: 0.3.75's
    `load_diffusion_model_state_dict`, with 0.38's mixed-precision ops when 0.38's `detect_layer_quantization` finds
    a `comfy_quant` key. Raises what 0.38 raises (a shape mismatch: RuntimeError from `load_state_dict`)."""
    import comfy.sd

    options = dict(model_options or {})
    if detect_layer_quantization(state_dict, ""):
        options["custom_operations"] = mixed_precision_ops()
    return comfy.sd.load_diffusion_model_state_dict(dict(state_dict), model_options=options)


def core_038_reading(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, str]:
    """{layer name: verdict} for every layer of `state_dict` that has an int8 `weight` and a `weight_scale`, by
    0.38's rules, layer by layer: the layer 0.38 builds for it (mixed-precision `Linear` for a Linear of `model`,
    `manual_cast.Conv2d` for a Conv2d, with `model`'s hyper-parameters) loads the entries with
    `load_state_dict(strict=False)`. Verdicts: "refused: <error>", "read with its scale" (the loaded weight is
    weight * weight_scale), or "misread (off by <factor>)"."""
    ops = mixed_precision_ops()
    verdicts = {}
    for key in state_dict:
        if not key.endswith(".weight_scale"):
            continue
        name = key[: -len(".weight_scale")]
        weight = state_dict.get(f"{name}.weight")
        if weight is None or weight.dtype != torch.int8:
            continue
        template = model.get_submodule(name)
        if isinstance(template, torch.nn.Conv2d):
            layer = ops.Conv2d(template.in_channels, template.out_channels, template.kernel_size, template.stride,
                               template.padding, template.dilation, template.groups, template.bias is not None)
            shape = tuple(layer.weight.shape)
        else:
            layer = ops.Linear(template.in_features, template.out_features, template.bias is not None)
            shape = (template.out_features, template.in_features)
        entries = {key[len(name) + 1:]: value for key, value in state_dict.items() if key.startswith(f"{name}.")
                   and "." not in key[len(name) + 1:]}
        try:
            layer.load_state_dict(entries, strict=False)
        except RuntimeError as exc:
            verdicts[name] = f"refused: {str(exc).splitlines()[-1].strip()}"
            continue
        loaded = layer.weight.dequantize() if _is_quantized(layer.weight) else layer.weight
        scale = state_dict[key].float().reshape(-1, *([1] * (loaded.ndim - 1)))
        real = weight.float().reshape(shape) * scale
        loaded = loaded.detach().float().reshape(shape)
        error = float((loaded - real).norm() / real.norm())
        if error < 1e-5:
            verdicts[name] = "read with its scale"
        else:
            verdicts[name] = f"misread (off by {float(loaded.norm() / real.norm()):.0f}x)"
    return verdicts
