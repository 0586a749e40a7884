"""INT8 core: layers run in INT8 where calibration on the first call's real inputs finds that accurate and worth it.

OUTER_SAMPLE fingerprints the original weights and the run's LoRA patches and, before ComfyUI loads the model, looks up
the decision (memory, then disk) for fingerprint, settings and latent shape; with one, the chosen layers become object
patches the MODEL owns (owned.py). APPLY_MODEL, on a key's first call without a decision, runs one float forward in
which every candidate layer also computes and measures its INT8 output on the same input; the decision is cached in
memory and on disk. The rest of that run, and `why_not_owned` runs, swap INT8 copies of the live weights in per call."""

from __future__ import annotations

import logging
import threading
import time
import weakref

import comfy.model_management
import comfy.patcher_extension
import comfy.utils
import torch

from ...kernels import (
    compute_density,
    kernel_backend_fallback,
    kernel_backend_for,
    normalized_mse,
    record_calls,
    release_packed_weight,
    runs_in_float,
    weight_bits,
    weight_qmax,
)
from ...kernels.ops import traces_linear_quantizer
from ..comfy_contracts import bypass_hook, follow_bypass
from ..cuda_graph_replay import fuses_linear_quantizer, replays_cuda_graphs
from ..page import show_image_on_node, show_on_node
from ..wrapper_args import wrapper_arg
from .cache import load_last_result, load_result, save_result
from .calibration import (
    INT8,
    MODEL_ERROR_LIMIT,
    MODEL_GUARD_ROUNDS,
    CalibrationResult,
    LayerMeasurement,
    bypass_fingerprint,
    calibration_key,
    conv_layout_for,
    cuda_graph_timing_for,
    decide,
    guard_round,
    linear_gemm_for,
    model_fingerprint,
)
from .core_layers import core_layer_source, core_layers_left, core_linear_format
from .environment import speed_gate_enabled
from .layout import CandidateCache, module_at, swapped_modules
from .layout import canonical_name as canonical_name  # where the save node and tests import it from
from .layout import find_candidates as find_candidates  # where tests import it from
from .modules import Int8Conv2d, Int8Linear, int8_module_bytes, refresh_after_weight_writes
from .owned import (
    build_owned_layer,
    float_candidates,
    float_layer,
    float_parameters,
    quantizes_the_original,
    set_owned_layers,
    size_by_its_layers,
    tree_holds,
)
from .picture import decision_picture
from .report import LAUNCHING_KERNEL_BACKENDS, format_report, summary_line
from .settings import QuantizeSettings
from .shared_inputs import assign_shared_inputs
from .speed import (
    RemeasureBudget,
    Timing,
    call_signature,
    fused_quantizer_linear_call,
    time_float_and_int8,
    timing_plan,
)

log = logging.getLogger("int8_accel.int8")
WRAPPER_KEY = "int8_accel_quantize"


class ModelCopies:
    """Per-call INT8 copies of one model whose MODEL does not own its INT8 layers. Under ComfyUI 0.38's MultiGPU each
    device computes with its own deep clone from its own thread: each has its own set, touched by no other thread."""

    def __init__(self) -> None:
        self.modules: dict[str, torch.nn.Module] = {}
        self.state: tuple | None = None
        self.last_swap: tuple | None = None  # ((names, device, bypass), {path: copy}) of the last call

    def release(self, name: str) -> None:
        module = self.modules.pop(name, None)
        if module is not None:
            release_packed_weight(module.weight)

    def release_all(self) -> None:
        for module in self.modules.values():
            release_packed_weight(module.weight)
        self.modules, self.last_swap = {}, None


def _on(tensor: torch.Tensor, device: torch.device | str) -> bool:
    """Whether `tensor` is on `device`; a device without an index ("cuda") means any of its type."""
    device = torch.device(device)
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def in_multigpu_call(transformer_options: dict | None) -> bool:
    """Whether ComfyUI 0.38's `samplers._calc_cond_batch_multigpu` (it sets this key) runs the call on a pool thread."""
    return bool(transformer_options) and transformer_options.get("multigpu_thread_device") is not None


def why_not_owned(patcher, model_options: dict | None) -> str:
    """Why a run swaps copies in per call: device clones would share an object patch; bypass LoRA hooks float layers."""
    if model_options and "multigpu_clones" in model_options:
        return "MultiGPU device clones"
    if getattr(patcher, "injections", None):
        return "bypass-mode LoRA"
    return ""


class Int8Plan:
    """Per-node state of the clone and all its clones (MultiGPU's too: the wrappers are its bound methods): calibration
    results are shared, INT8 layers per model. Per-call copies sit uncounted by ComfyUI beside the float layers."""

    def __init__(self, settings: QuantizeSettings, node_id: str | None = None) -> None:
        self.settings = settings
        self.node_id = node_id
        self.results: dict[str, CalibrationResult] = {}
        self.calibration_runs = 0
        self.disk_hits = 0
        self.last_report = ""
        self.last_result: CalibrationResult | None = None
        self.shown_result: CalibrationResult | None = None  # the calibration the node's report output describes
        self.not_owned_because = ""  # why the last run swapped copies in per call ("" when it owned its layers)
        self._run_fingerprint: str | None = None
        self._fingerprints: dict[tuple, str] = {}
        self._bypass_fingerprint_of: tuple[str, list] | None = None  # (fingerprint, weakrefs to its owners)
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> ModelCopies
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> {name: INT8 layer}
        self._installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> (key, {path: layer})
        self._modules: dict[str, torch.nn.Module] = {}  # {layer name: INT8 layer} of the model call that ran last
        self._calibration_lock = threading.Lock()  # one calibration per key, whichever device's thread comes first
        self._candidates = CandidateCache()
        self._weight_bytes: dict[str, int] = {}  # {layer name: bytes of its float weight}

    def copies_of(self, base_model) -> ModelCopies:
        copies = self._copies.get(base_model)
        if copies is None:
            copies = self._copies[base_model] = ModelCopies()
        return copies

    def _drop_other_models(self, base_model) -> None:
        """A call outside MultiGPU: the copies of any other model are stale (another model was loaded)."""
        for model in list(self._copies.keys()):
            if model is not base_model:
                self._copies.pop(model).release_all()

    # --- wiring ----------------------------------------------------------------------------------
    def attach(self, patcher) -> None:
        patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, self.outer_sample)
        patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY, self.apply_model)
        patcher.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_DETACH, WRAPPER_KEY, self.on_detach)
        refresh_after_weight_writes(patcher, WRAPPER_KEY)
        self._weight_bytes = {name: (weight := float_layer(patcher, path).weight).numel() * weight.element_size()
                              for name, (path, _) in float_candidates(patcher).items()}
        size_by_its_layers(patcher, patcher.model_size())

    def on_detach(self, patcher, unpatch_all: bool = True) -> None:
        """ComfyUI unloaded the model: drop the per-call copies (owned INT8 layers left the device with the model).
        Detaching without unpatching is no unload: ComfyUI does it when a clone is garbage collected
        (`ModelPatcher.__del__`) or replaced by another clone of the same model."""
        if not unpatch_all:
            return
        self.copies_of(patcher.model).release_all()
        self._modules = {}
        self._candidates.forget()  # the unpatch restored ComfyUI's object patches, which may replace modules

    def fingerprint(self, patcher) -> str:
        state = (id(patcher.model), patcher.patches_uuid)
        if state not in self._fingerprints:
            self._fingerprints = {state: model_fingerprint(patcher, float_parameters(patcher))}
        return self._fingerprints[state]

    def _bypass_fingerprint(self, base_model) -> str:
        """The bypass-mode LoRA on the model's layers, which no weight patch carries ('' when none). It comes as an
        injection of the running `current_patcher`: layers are looked at once per injected patcher and injection set."""
        patcher = getattr(base_model, "current_patcher", None)
        injections = getattr(patcher, "injections", None)
        if not injections or not getattr(patcher, "is_injected", False):
            return ""
        owners = (patcher, *(injection for group in injections.values() for injection in group))
        cached = self._bypass_fingerprint_of
        if cached is None or [ref() for ref in cached[1]] != list(owners):
            root = base_model.diffusion_model
            hooks = {name: hook for name, (path, _) in self._candidates.get(root).items()
                     if (hook := bypass_hook(module_at(root, path))) is not None}
            cached = self._bypass_fingerprint_of = (f":bypass:{bypass_fingerprint(hooks)}" if hooks else "",
                                                    [weakref.ref(owner) for owner in owners])
        return cached[0]

    def node_report(self, patcher, candidates: dict[str, tuple[str, str]]) -> str:
        self.shown_result = load_last_result(self.fingerprint(patcher), self.settings)
        if self.shown_result is not None:
            return format_report(self.shown_result, self.settings, self._layer_weight_bytes(self.shown_result),
                                 from_cache=True, float_placement=self.float_placement(self.shown_result))
        kinds = {kind: sum(1 for _, k in candidates.values() if k == kind) for kind in ("linear", "conv")}
        return (f"INT8 calibration pending: it runs on the first sampling step with the real inputs "
                f"({kinds['linear']} Linear and {kinds['conv']} Conv2d candidates). Its summary shows on the "
                f"Quantize node then; queue the prompt again to see the full report and the decision picture.")

    def _layer_weight_bytes(self, result: CalibrationResult) -> dict[str, int]:
        return {layer.name: self._weight_bytes[layer.name] for layer in result.layers if layer.name in self._weight_bytes}

    def float_placement(self, result: CalibrationResult) -> str:
        """For the report: why the INT8 layers' float weights take memory where the model computes ("" when not)."""
        if self.not_owned_because:
            return f"float weights stay loaded beside per-call INT8 copies: {self.not_owned_because}"
        if result.kernel_backend not in LAUNCHING_KERNEL_BACKENDS:
            return "float weights in system memory, where the model computes"
        return ""

    # --- wrappers ----------------------------------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        """Runs before ComfyUI loads the model (CFGGuider.outer_sample runs prepare_sampling inside this wrapper)."""
        guider = executor.class_obj
        patcher = guider.model_patcher
        previous = self._run_fingerprint
        self._run_fingerprint = self.fingerprint(patcher)
        noise = wrapper_arg(args, kwargs, 0, "noise")
        self._own_layers(patcher, getattr(guider, "model_options", None), noise)
        try:
            return executor(*args, **kwargs)
        finally:
            self._run_fingerprint = previous

    def _own_layers(self, patcher, model_options: dict | None, noise: torch.Tensor) -> None:
        self.not_owned_because = why_not_owned(patcher, model_options)
        result, key = None, None
        if not self.not_owned_because and isinstance(noise, torch.Tensor):
            like = torch.empty((0, *noise.shape[1:]), dtype=noise.dtype, device=patcher.load_device)
            fingerprint = self.fingerprint(patcher)
            key = self._calibration_key(fingerprint, like, (model_options or {}).get("transformer_options"))[0]
            result = self._known_result(key, patcher.model, fingerprint)
        layers = {} if result is None else self._owned_layers(patcher, result.chosen)
        if set_owned_layers(patcher, layers):
            self._candidates.forget()
        self._installed[patcher.model] = (key, layers)

    def _owned_layers(self, patcher, names: list[str]) -> dict[str, torch.nn.Module]:
        """The MODEL's INT8 layers for `names`: a calibrating run's per-call copies of original weights become them
        as they are (not quantized again); the other copies go, so one INT8 set stays in memory."""
        built = self._owned.setdefault(patcher.model, {})
        candidates = float_candidates(patcher)
        qmax = weight_qmax(torch.device(patcher.load_device))
        copies = self._copies.pop(patcher.model, ModelCopies())
        same_patches = copies.state == (id(patcher.model.diffusion_model), patcher.patches_uuid)
        layers = {}
        for name in names:
            if name not in candidates:
                continue
            path, kind = candidates[name]
            layer = built.get(name)
            if layer is None or layer.qmax != qmax:
                copy = copies.modules.pop(name, None) if same_patches else None
                original = copy if quantizes_the_original(patcher, path, copy, qmax) else None
                layer = built[name] = build_owned_layer(patcher, path, kind, original)
            layers[path] = layer
        copies.release_all()
        return layers

    def apply_model(self, executor, *args, **kwargs):
        base_model = executor.class_obj
        x = wrapper_arg(args, kwargs, 0, "x")
        options = wrapper_arg(args, kwargs, 5, "transformer_options", None)
        if not in_multigpu_call(options):
            self._drop_other_models(base_model)
        fingerprint = self._run_fingerprint or f"uuid:{getattr(base_model, 'current_weight_patches_uuid', None)}"
        bypass = self._bypass_fingerprint(base_model)
        key, graph_timing, fused_quantizer = self._calibration_key(fingerprint + bypass, x, options)
        installed_key, owned = self._installed.get(base_model, (None, {}))
        if installed_key == key and tree_holds(base_model, owned):
            self._modules = self._ran(owned)
            return executor(*args, **kwargs)
        result = self._known_result(key, base_model, fingerprint)
        if result is None:
            with self._calibration_lock:  # MultiGPU: another device's thread may be calibrating this key now
                result = self._known_result(key, base_model, fingerprint)
                if result is None:
                    return self._calibrate(executor, base_model, args, kwargs, key, fingerprint, graph_timing,
                                           fused_quantizer)
        replacements = self._int8_modules(base_model, result.chosen, x.device, bypass)
        with swapped_modules(base_model.diffusion_model, replacements):
            return executor(*args, **kwargs)

    def _calibration_key(self, fingerprint: str, x: torch.Tensor, options: dict | None) -> tuple[str, bool, bool]:
        graph_timing = cuda_graph_timing_for(x.device, replays_cuda_graphs(options))
        fused_quantizer = graph_timing and fuses_linear_quantizer(options) and traces_linear_quantizer(x.device)
        return calibration_key(fingerprint, self.settings, x, graph_timing, fused_quantizer), graph_timing, fused_quantizer

    @staticmethod
    def _ran(layers: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
        return {canonical_name(path): layer for path, layer in layers.items()}

    def _known_result(self, key: str, base_model, fingerprint: str) -> CalibrationResult | None:
        result = self.results.get(key)
        if result is None:
            result = load_result(key)
            if result is not None and result.noisy_timings:  # timed on a busy machine: time it again now
                result = None
            if result is not None:
                self.disk_hits += 1
                self.results[key] = result
                self._publish(result, base_model, fingerprint, save=False)
        return result

    # --- per-call INT8 copies, rebuilt whenever the live weights change ----------------------------------
    def _int8_modules(self, base_model, names: list[str], device: torch.device,
                      bypass: str = "") -> dict[str, torch.nn.Module]:
        """{module path: INT8 copy} for `device` from the live weights, following the float layers' bypass LoRA."""
        root = self._fresh_module_cache(base_model)
        copies = self.copies_of(base_model)
        request = (tuple(names), device, bypass)
        last = copies.last_swap
        if last is not None and last[0] == request:
            self._modules = self._ran(last[1])
            return last[1]  # the same copies as the previous call
        candidates = self._candidates.get(root)
        out = {}
        for name in names:
            if name not in candidates:
                continue
            path, kind = candidates[name]
            try:
                float_module = module_at(root, path)
            except AttributeError:  # replaced since the walk, though no load or detach said so: walk again
                self._candidates.forget(root)
                return self._int8_modules(base_model, names, device, bypass)
            layer = copies.modules.get(name)
            if layer is None or not _on(layer.weight, device):
                layer = copies.modules[name] = self._copy_for_device(float_module, kind, device)
            follow_bypass(float_module, layer)
            out[path] = layer
        assign_shared_inputs(root, out)
        copies.last_swap = (request, out)
        self._modules = self._ran(out)
        return out

    def _copy_for_device(self, float_module: torch.nn.Module, kind: str, device: torch.device) -> torch.nn.Module:
        """Quantized on `device` at its backend's weight width (a system-memory float weight moves there per layer)."""
        layer = self._quantize_layer(float_module, kind, weight_qmax(device), device)
        if not _on(layer.weight, device):
            layer = layer.to(device, non_blocking=comfy.model_management.device_supports_non_blocking(device))
        return layer

    def _fresh_module_cache(self, base_model) -> torch.nn.Module:
        """Drop the copies when the live weights changed (another model, or other weight patches)."""
        root = base_model.diffusion_model
        copies = self.copies_of(base_model)
        state = (id(root), getattr(base_model, "current_weight_patches_uuid", None))
        if state != copies.state:
            copies.release_all()
            copies.state = state
        return root

    @staticmethod
    def _quantize_layer(module: torch.nn.Module, kind: str, qmax: int | None = None,
                        device: torch.device | None = None) -> torch.nn.Module:
        """`qmax`: the computing device's weight width (default: its weight's device); `device`: where a float weight is
        quantized (default: where it is; a layer core quantized converts where it is)."""
        with torch.inference_mode(False), torch.no_grad():
            if kind == "conv":
                return Int8Conv2d.from_float(module, qmax, device)
            if core_linear_format(module) is None:
                return Int8Linear.from_float(module, qmax, device)
            return Int8Linear.from_core(module, qmax)

    # --- calibration ---------------------------------------------------------------------------------
    @staticmethod
    def _measurement(name: str, kind: str, module: torch.nn.Module, x: torch.Tensor,
                     output: torch.Tensor) -> LayerMeasurement:
        """A layer call's GEMM sizes, density and whether `x`'s backend computes it in float (below its size floor)."""
        weight = module.weight
        if kind == "linear":
            k, n = weight.shape[1], weight.shape[0]
            m = x.numel() // max(1, k)
            below_floor = runs_in_float("linear", x.shape, weight.shape, x.device)
        else:
            k = weight.shape[1] * weight.shape[2] * weight.shape[3]
            n = weight.shape[0]
            m = output.shape[0] * output.shape[2] * output.shape[3]
            below_floor = runs_in_float("conv2d", x.shape, weight.shape, x.device, module.stride, module.padding,
                                        module.dilation)
        return LayerMeasurement(name=name, kind=kind, weight_shape=list(weight.shape), m=m, k=k, n=n,
                                density=compute_density(m, k, n), error=None, source=core_layer_source(module),
                                below_kernel_floor=below_floor)

    def _calibrate(self, executor, base_model, args, kwargs, key: str, fingerprint: str, graph_timing: bool = False,
                   fused_quantizer: bool = False):
        start = time.perf_counter()
        root = self._fresh_module_cache(base_model)
        copies = self.copies_of(base_model)
        candidates = self._candidates.get(root)  # the same walk the checking step's swap uses
        measurements: dict[str, LayerMeasurement] = {}
        memory = {"kept": 0, "peak": 0}  # INT8 copies kept, and their peak with the one being measured
        gate, timings, remeasure_budget = speed_gate_enabled(), {}, RemeasureBudget()
        progress = comfy.utils.ProgressBar(len(candidates))
        log.info("int8-accel: calibrating %d layers on the first step (latent %s)", len(candidates),
                 list(args[0].shape))

        def measure(name: str, kind: str):
            def hook(module, inputs, output):
                if name in measurements or not isinstance(output, torch.Tensor):
                    return
                x = inputs[0]
                row = self._measurement(name, kind, module, x, output)
                int8_copy = []  # the layer's INT8 copy, once the error gate asked for it

                def measure_error() -> float:
                    layer = copies.modules.pop(name, None) or self._copy_for_device(module, kind, x.device)
                    int8_copy.append(layer)
                    memory["peak"] = max(memory["peak"], memory["kept"] + int8_module_bytes(layer))
                    # A bypass LoRA adds one term to both outputs: compare the layers' own (the copy's forward skips it)
                    bypass = bypass_hook(module)
                    reference = output if bypass is None else bypass.original_forward(x)
                    if row.below_kernel_floor:  # this backend computes it in float: the INT8 arithmetic's error
                        return normalized_mse(int8_reference_forward(layer, x), reference)
                    return normalized_mse(type(layer).forward(layer, x), reference)

                def time_calls() -> Timing | None:
                    if not gate:
                        return None
                    signature = call_signature(kind, module, x)
                    if signature not in timings:  # module.forward: calling the module would re-enter this hook
                        int8_call = lambda: int8_copy[0](x)  # noqa: E731
                        if fused_quantizer and kind == "linear" and not int8_copy[0]._needs_float_path():
                            int8_call = fused_quantizer_linear_call(int8_copy[0], x)
                        timings[signature] = time_float_and_int8(lambda: module.forward(x), int8_call,
                                                                 x.device, budget=remeasure_budget,
                                                                 plan=timing_plan(x.device, graph_timing))
                    return timings[signature]

                # One layer at a time: quantized only at the error gate, its copy kept only when it runs in INT8.
                if decide(row, self.settings, measure_error, time_calls) == INT8:
                    copies.modules[name] = int8_copy[0]
                    memory["kept"] += int8_module_bytes(int8_copy[0])
                int8_copy.clear()
                measurements[name] = row
                progress.update(1)
            return hook

        handles = [root.get_submodule(path).register_forward_hook(measure(name, kind))
                   for name, (path, kind) in candidates.items()]
        try:
            output = executor(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

        layers = [measurements[name] for name in candidates if name in measurements]
        result = CalibrationResult(key=key, shape=list(args[0].shape), layers=layers,
                                   kernel_backend=kernel_backend_for(args[0].device),
                                   kernel_backend_fallback=kernel_backend_fallback(args[0].device),
                                   left_to_core=core_layers_left(root), weight_bits=weight_bits(args[0].device),
                                   linear_gemm=linear_gemm_for(args[0].device),
                                   conv_layout=conv_layout_for(args[0].device), cuda_graph_timing=graph_timing,
                                   fused_quantizer_timing=fused_quantizer)
        chosen = set(result.chosen)
        copies.modules = {name: module for name, module in copies.modules.items() if name in chosen}
        copies.last_swap = None
        if chosen:
            # Return the INT8 output, so that the calibrating run gives the same result as every later run.
            output = self._swapped_and_guarded(executor, base_model, args, kwargs, output, result)
        result.seconds = time.perf_counter() - start
        result.memory = {"model_float_bytes": sum(p.numel() * p.element_size() for p in root.parameters()),
                         "calibration_peak_int8_bytes": memory["peak"],
                         "int8_bytes": sum(int8_module_bytes(module) for module in copies.modules.values())}
        self.calibration_runs += 1
        self.results[key] = result
        self._publish(result, base_model, fingerprint, save=True)
        return output

    def _swapped_and_guarded(self, executor, base_model, args, kwargs, float_output: torch.Tensor,
                             result: CalibrationResult) -> torch.Tensor:
        """The calibrating call's output with the chosen layers in INT8, after the whole-model guard (calibration.py)
        returned layers to float while the model error exceeded its limit; `result` records error, FLOP share, guard."""
        output, result.model_error, result.int8_flop_fraction = self._measure_swapped(
            executor, base_model, args, kwargs, float_output, result)
        limit, before, returned = MODEL_ERROR_LIMIT, result.model_error, 0
        for round_number in range(1, MODEL_GUARD_ROUNDS + 1):
            if result.model_error <= limit:  # a NaN error does not pass
                break
            dropped = guard_round(result, self.settings, round_number)
            if not dropped:
                continue
            copies = self.copies_of(base_model)
            for name in dropped:
                copies.release(name)
            copies.last_swap = None
            returned += len(dropped)
            result.model_guard = {"limit": limit, "error_before": before, "rounds": round_number, "layers": returned}
            if not result.chosen:
                result.model_error, result.int8_flop_fraction = None, 0.0
                return float_output
            output, result.model_error, result.int8_flop_fraction = self._measure_swapped(
                executor, base_model, args, kwargs, float_output, result)
        return output

    def _measure_swapped(self, executor, base_model, args, kwargs, reference: torch.Tensor,
                         result: CalibrationResult) -> tuple[torch.Tensor, float, float]:
        """Model error and INT8 FLOP share of the chosen layers (FlopCounterMode counts float ops, not INT8 ones)."""
        from torch.utils.flop_counter import FlopCounterMode

        replacements = self._int8_modules(base_model, result.chosen, args[0].device,
                                          self._bypass_fingerprint(base_model))
        counter = FlopCounterMode(display=False)
        with swapped_modules(base_model.diffusion_model, replacements), counter, record_calls() as calls:
            swapped_output = executor(*args, **kwargs)
        result.kernel_calls = {path: sum(n for (_, _, p), n in calls.items() if p == path) for path in ("int8", "float")}
        int8_flops = 2 * sum(layer.macs for layer in result.layers if layer.quantized)
        total = counter.get_total_flops() + int8_flops
        return swapped_output, normalized_mse(swapped_output, reference), (int8_flops / total if total else 0.0)

    def _publish(self, result: CalibrationResult, base_model, fingerprint: str, save: bool) -> None:
        placement = self.float_placement(result)
        weight_bytes = self._layer_weight_bytes(result)
        report = format_report(result, self.settings, weight_bytes, from_cache=not save, float_placement=placement)
        self.last_report, self.last_result = report, result
        if save:
            save_result(result, fingerprint, self.settings)
            log.info("int8-accel:\n%s", report)
            summary = summary_line(result, False, placement, sum(weight_bytes.get(name, 0) for name in result.chosen))
            show_on_node(summary + "\n\nQueue the prompt again to see the per-layer table and the decision "
                         "picture.", self.node_id)
            if self.node_id is not None:
                show_image_on_node(decision_picture(result, self.settings, summary), self.node_id)
        else:
            log.info("int8-accel: calibration cache hit for latent %s: %d layers in INT8", result.shape,
                     len(result.chosen))


def int8_reference_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s output by the W8A8 arithmetic itself (reference kernels), also below the backend's float size floor."""
    from ...kernels import reference

    weight, scale, bias = layer.weight.to(x.device), layer.weight_scale.to(x.device), layer.bias
    bias = None if bias is None else bias.to(x.device)
    with torch.no_grad():
        if isinstance(layer, Int8Conv2d):
            return reference.conv2d(x, weight, scale, bias, list(layer.stride), list(layer.padding),
                                    list(layer.dilation), layer.groups)
        return reference.linear(x, weight, scale, bias)
