"""Compile a ComfyUI MODEL for faster sampling, in the pieces that actually win on the device.

Wrapping the whole UNet in ``torch.compile`` made SD1.5 slower than eager on a 2-core CPU: the time
goes into convolutions and GEMMs that Inductor hands to the same oneDNN/MKL kernels anyway (without
freezing it cannot prepack their weights), while ComfyUI's Python-side attention selection breaks
the graph. So the model is optimised per piece, each swapped in only while the model runs (an
``APPLY_MODEL`` wrapper), so ModelPatcher keeps patching the real modules and LoRA keeps working:

* compiled regions: the pointwise chains that Inductor fuses better than eager runs them (the GEGLU
  gate of every transformer feed-forward), with the chosen backend, mode and dynamic-shape policy.
  They take weights as inputs, so a LoRA or a strength change never recompiles; dynamic shapes cover
  new resolutions. GroupNorm+SiLU was measured too and lost to ATen's GroupNorm here (dynamic
  shapes), so it stays eager unless asked for (`group_norm_silu=True`).
* on the CPU, the job Inductor's freezing pass would do without baking the weights in: fp32 Conv2d
  and Linear weights are prepacked once into oneDNN's blocked layout and reused while the weight
  is unchanged (a new LoRA repacks only what it changed).
* on the CPU, ComfyUI's sub-quadratic attention is replaced by PyTorch's fused SDPA kernel (what
  Inductor's attention pattern matcher would produce) for inputs large enough to gain from it.

Modules another node swapped in (INT8 layers), offloaded/low-VRAM layers and non-fp32 weights are
left alone. A missing backend or compiler degrades to eager with a warning, never a failed prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

WRAPPER_KEY = "int8_accel_compile"
MODE_CHOICES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
DYNAMIC_CHOICES = ["auto", "true", "false"]
# With static shapes every (channels, size) pair is a new graph: allow enough for a few resolutions.
STATIC_RECOMPILE_LIMIT = 64
# Below this many query x key tokens ComfyUI's plain attention beats SDPA's setup cost on the CPU.
SDPA_MIN_SCORES = 128 * 128


def available_backends() -> list[str]:
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


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    mode: str = "default"
    dynamic: str = "auto"
    fullgraph: bool = False

    def torch_dynamic(self) -> bool:
        # the regions see every channel count and size of the UNet within one forward, so "auto"
        # means dynamic from the start: static-first would recompile inside the very first step
        return self.dynamic != "false"


def backend_problem(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot compile on `device` here, or None when it should work."""
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        return f"torch.compile backend {backend!r} is not available in this PyTorch"
    if backend == "inductor":
        if device.type == "cpu":
            from torch._inductor import cpp_builder

            try:
                compiler = cpp_builder.get_cpp_compiler()
            except Exception as exc:  # noqa: BLE001 - any failure means no usable compiler
                return f"Inductor needs a C++ compiler for the CPU and none was found ({exc})"
            if shutil.which(compiler) is None and not os.path.isfile(compiler):
                return f"Inductor needs a C++ compiler for the CPU and {compiler!r} was not found"
        else:
            from torch.utils._triton import has_triton

            if not has_triton():
                return f"Inductor needs Triton on {device.type} and it is not installed"
    if backend == "tvm":
        import importlib.util

        if importlib.util.find_spec("tvm") is None:
            return "the tvm backend needs Apache TVM, which is not installed"
    if backend == "cudagraphs" and device.type != "cuda":
        return "the cudagraphs backend needs a CUDA device"
    return None


def ensure_persistent_cache() -> str:
    """Keep Inductor's compiled artifacts between ComfyUI restarts (FX graph cache in a kept folder)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
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


# ---------------------------------------------------------------- compile progress in the log

_region_state = threading.local()
_compile_started: dict[str, float] = {}
COMPILE_EVENTS: list[tuple[str, float]] = []  # (region, seconds) of every compile a region triggered


def _on_compile_start(args) -> None:
    region = getattr(_region_state, "name", None)
    if region is not None:
        _compile_started[args.compile_id] = time.perf_counter()
        log.info("int8-accel compile: compiling %s (%s) ...", region, args.compile_id)


def _on_compile_end(args) -> None:
    started = _compile_started.pop(args.compile_id, None)
    region = getattr(_region_state, "name", None)
    if started is not None:
        seconds = time.perf_counter() - started
        COMPILE_EVENTS.append((region or "?", seconds))
        log.info("int8-accel compile: compiled %s in %.1f s", region, seconds)


_callbacks_registered = False


def _register_compile_callbacks() -> None:
    global _callbacks_registered
    if _callbacks_registered:
        return
    from torch._dynamo import callback

    callback.on_compile_start(_on_compile_start)
    callback.on_compile_end(_on_compile_end)
    _callbacks_registered = True


# ---------------------------------------------------------------- the compiled regions

def group_norm_silu(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    groups: int, eps: float) -> torch.Tensor:
    return F.silu(F.group_norm(x, groups, weight, bias, eps))


def geglu_gate(h: torch.Tensor) -> torch.Tensor:
    x, gate = h.chunk(2, dim=-1)
    return x * F.gelu(gate)


class CompiledRegion:
    """One function compiled with the node's settings; falls back to eager for good if compiling fails."""

    def __init__(self, name: str, fn: Callable, settings: CompileSettings, disabled_reason: str | None = None):
        self.name = name
        self.eager = fn
        self.disabled_reason = disabled_reason
        self.compiled = None
        if disabled_reason is None:
            kwargs: dict[str, Any] = {
                "backend": settings.backend,
                "dynamic": settings.torch_dynamic(),
                "fullgraph": settings.fullgraph,
                "isolate_recompiles": True,
            }
            if settings.backend == "inductor" and settings.mode != "default":
                kwargs["mode"] = settings.mode
            if settings.dynamic == "false":
                kwargs["recompile_limit"] = STATIC_RECOMPILE_LIMIT
            self.compiled = torch.compile(fn, **kwargs)

    def __call__(self, *args):
        if self.compiled is None:
            return self.eager(*args)
        _region_state.name = self.name
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not fail the prompt
            out = self.eager(*args)  # a genuine runtime error re-raises from here
            self.compiled = None
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
            log.warning("int8-accel compile: compiling %s failed, running it eagerly from now on (%s)",
                        self.name, self.disabled_reason.splitlines()[0][:300])
            return out
        finally:
            _region_state.name = None


_regions_by_settings: dict[tuple[CompileSettings, str | None], dict[str, CompiledRegion]] = {}


def compiled_regions(settings: CompileSettings, disabled_reason: str | None) -> dict[str, CompiledRegion]:
    """The regions for these settings, shared by every MODEL compiled with them (one compile, many clones)."""
    key = (settings, disabled_reason)
    if key not in _regions_by_settings:
        _regions_by_settings[key] = {
            "group_norm_silu": CompiledRegion("group_norm_silu", group_norm_silu, settings, disabled_reason),
            "geglu_gate": CompiledRegion("geglu_gate", geglu_gate, settings, disabled_reason),
        }
    return _regions_by_settings[key]


# ---------------------------------------------------------------- prepacked CPU weights

_plain_conv_forwards: set = set()
_plain_linear_forwards: set = set()


def _plain_forwards() -> tuple[set, set]:
    if not _plain_conv_forwards:
        import comfy.ops

        _plain_conv_forwards.add(torch.nn.Conv2d.forward)
        _plain_linear_forwards.add(torch.nn.Linear.forward)
        for ops in (comfy.ops.disable_weight_init, comfy.ops.manual_cast):
            _plain_conv_forwards.add(ops.Conv2d.forward)
            _plain_linear_forwards.add(ops.Linear.forward)
    return _plain_conv_forwards, _plain_linear_forwards


def _prepackable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and not getattr(module, "comfy_cast_weights", False)
        and not getattr(module, "weight_function", None)
        and not getattr(module, "bias_function", None)
        and (module.bias is None or module.bias.dtype == torch.float32)
    )


@dataclasses.dataclass
class _Packed:
    weight_ref: weakref.ref
    stamp: Any
    packed: torch.Tensor


# module -> packed weight; shared by every clone of a model, dropped with the module
_packed_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fingerprint(weight: torch.Tensor) -> tuple:
    """Cheap change detector for a weight. ComfyUI restores and hook-patches weights in place with
    `param.data.copy_()`, which bumps no version counter (and inference tensors have none), so a
    strided sample of the raw words is summed too: such writes rewrite the whole tensor."""
    version = -1 if weight.is_inference() else weight._version
    flat = weight.detach().reshape(-1).view(torch.int32)
    step = max(1, flat.numel() // 2048)
    return version, weight.data_ptr(), int(flat[::step].sum())


def _packed_weight(module: torch.nn.Module, stamp: Any, pack: Callable[[], torch.Tensor]) -> torch.Tensor:
    entry = _packed_weights.get(module)
    weight = module.weight
    fingerprint = (stamp, _fingerprint(weight))
    if entry is None or entry.weight_ref() is not weight or entry.stamp != fingerprint:
        with torch.no_grad():
            entry = _Packed(weakref.ref(weight), fingerprint, pack())
        _packed_weights[module] = entry
    return entry.packed


def _conv_prepacked(module: torch.nn.Conv2d, stamp: Any) -> Callable:
    plain = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _prepackable(module) or x.dtype != torch.float32 or x.dim() != 4 or torch.is_grad_enabled():
            return plain(x)
        padding, stride, dilation = list(module.padding), list(module.stride), list(module.dilation)
        packed = _packed_weight(module, stamp, lambda: torch.ops.mkldnn._reorder_convolution_weight(
            module.weight, padding, stride, dilation, module.groups, list(x.shape)))
        return torch.ops.mkldnn._convolution_pointwise(
            x, packed, module.bias, padding, stride, dilation, module.groups, "none", [], "")

    return forward


def _linear_prepacked(module: torch.nn.Linear, stamp: Any) -> Callable:
    plain = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _prepackable(module) or x.dtype != torch.float32 or torch.is_grad_enabled():
            return plain(x)
        packed = _packed_weight(module, stamp, lambda: torch.ops.mkldnn._reorder_linear_weight(
            module.weight, max(1, x.numel() // max(1, x.shape[-1]))))
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")

    return forward


def prepacking_supported() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_convolution_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# ---------------------------------------------------------------- the run-time swap

def _as_region_input(tensor: torch.Tensor | None) -> torch.Tensor | None:
    # Dynamo guards a tensor's kind: Parameter or not, requires_grad, inference or not. Original
    # weights are Parameters, LoRA-patched ones plain (inference) tensors, restored ones new
    # Parameters: a small copy made here is always the same kind, so none of that recompiles.
    return None if tensor is None else tensor.detach().clone()


def _norm_silu_sequential(seq: torch.nn.Sequential, regions: dict[str, CompiledRegion]) -> Callable:
    """Sequential(GroupNorm, SiLU, *rest) -> rest(compiled GroupNorm+SiLU); children resolved per call."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        norm = seq[0]
        h = regions["group_norm_silu"](x, _as_region_input(norm.weight), _as_region_input(norm.bias),
                                       norm.num_groups, norm.eps)
        for index in range(2, len(seq)):
            h = seq[index](h)
        return h

    return forward


def _geglu(module: torch.nn.Module, regions: dict[str, CompiledRegion]) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return regions["geglu_gate"](module.proj(x))

    return forward


def _is_plain_group_norm(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, torch.nn.GroupNorm)
        and type(module).forward in _group_norm_forwards()
        and not getattr(module, "comfy_cast_weights", False)
        and not getattr(module, "weight_function", None)
        and not getattr(module, "bias_function", None)
    )


def _group_norm_forwards() -> set:
    import comfy.ops

    return {torch.nn.GroupNorm.forward, comfy.ops.disable_weight_init.GroupNorm.forward,
            comfy.ops.manual_cast.GroupNorm.forward}


def plan_forwards(diffusion_model: torch.nn.Module, regions: dict[str, CompiledRegion], *,
                  prepack: bool, stamp: Any, group_norm_silu: bool = False) -> list[tuple[torch.nn.Module, Callable]]:
    """The (module, forward) replacements for this call, chosen from the modules present right now."""
    import comfy.ldm.modules.attention as attention

    conv_forwards, linear_forwards = _plain_forwards()
    plan = []
    for module in diffusion_model.modules():
        if "forward" in module.__dict__:
            continue  # someone already swapped this one's forward for the call: leave it
        cls = type(module)
        if isinstance(module, torch.nn.Sequential) and len(module) >= 3:
            if group_norm_silu and _is_plain_group_norm(module[0]) and type(module[1]) is torch.nn.SiLU:
                plan.append((module, _norm_silu_sequential(module, regions)))
        elif cls is attention.GEGLU:
            plan.append((module, _geglu(module, regions)))
        elif prepack and cls.forward in conv_forwards and module.padding_mode == "zeros" and _prepackable(module):
            plan.append((module, _conv_prepacked(module, stamp)))
        elif prepack and cls.forward in linear_forwards and _prepackable(module):
            plan.append((module, _linear_prepacked(module, stamp)))
    return plan


def _sdpa_attention_override(previous: Callable | None) -> Callable:
    import comfy.ldm.modules.attention as attention

    # wrap_attn hands the override the undecorated function, so match both forms
    replaceable = set()
    for function in (attention.attention_sub_quad, attention.attention_basic, attention.attention_split):
        replaceable.add(function)
        replaceable.add(getattr(function, "__wrapped__", function))

    def override(func, q, k, v, heads, *args, **kwargs):
        if func in replaceable and q.device.type == "cpu" and q.shape[-2] * k.shape[-2] >= SDPA_MIN_SCORES:
            return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)
        if previous is not None:
            return previous(func, q, k, v, heads, *args, **kwargs)
        return func(q, k, v, heads, *args, **kwargs)

    return override


def make_apply_model_wrapper(regions: dict[str, CompiledRegion], *, prepack: bool,
                             group_norm_silu: bool = False) -> Callable:
    def apply_model_wrapper(executor, *args, **kwargs):
        base_model = executor.class_obj
        diffusion_model = base_model.diffusion_model
        device = getattr(base_model, "device", None) or torch.device("cpu")
        stamp = getattr(base_model, "current_weight_patches_uuid", None)
        plan = plan_forwards(diffusion_model, regions, prepack=prepack and torch.device(device).type == "cpu",
                             stamp=stamp, group_norm_silu=group_norm_silu)
        for module, forward in plan:
            module.forward = forward
        try:
            return executor(*args, **kwargs)
        finally:
            for module, _ in plan:
                module.__dict__.pop("forward", None)

    return apply_model_wrapper


def compile_model(model, settings: CompileSettings, *, regions: bool = True, prepack: bool = True,
                  sdpa: bool = True, group_norm_silu: bool = False):
    """A clone of `model` (a ModelPatcher) whose diffusion model runs through the compiled pieces.

    `regions`, `prepack` and `sdpa` switch the three parts off one by one, `group_norm_silu` adds the
    GroupNorm+SiLU region that lost here (for benchmarks and other devices)."""
    import comfy.model_management
    import comfy.patcher_extension

    _register_compile_callbacks()
    device = torch.device(getattr(model, "load_device", None) or comfy.model_management.get_torch_device())
    problem = backend_problem(settings.backend, device)
    if problem is not None:
        log.warning("int8-accel compile: %s; running eagerly instead (the prompt still runs).", problem)
    elif settings.backend == "inductor":
        ensure_persistent_cache()
    compiled_pieces = compiled_regions(settings, problem if regions else "regions off")
    on_cpu = device.type == "cpu"

    compiled = model.clone()
    compiled.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    compiled.add_wrapper_with_key(
        comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
        make_apply_model_wrapper(compiled_pieces, prepack=prepack and on_cpu and prepacking_supported(),
                                 group_norm_silu=group_norm_silu),
    )
    if on_cpu and sdpa:
        transformer_options = compiled.model_options.setdefault("transformer_options", {})
        previous = transformer_options.get("optimized_attention_override")
        if not getattr(previous, "_int8_accel_sdpa", False):
            override = _sdpa_attention_override(previous)
            override._int8_accel_sdpa = True
            transformer_options["optimized_attention_override"] = override
    log.info("int8-accel compile: backend=%s mode=%s dynamic=%s fullgraph=%s%s (compiles on first run)",
             settings.backend, settings.mode, settings.dynamic, settings.fullgraph,
             " [eager fallback]" if problem else "")
    return compiled
