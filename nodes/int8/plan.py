"""The shared INT8 core: turns a ModelPatcher into one whose Linear/Conv2d layers run in INT8 where that
is accurate and worth it, decided by calibration on the first sampling call's real inputs.

How the layers get in: the clone carries two wrappers. OUTER_SAMPLE fingerprints the weights and LoRA
patches the run will use. APPLY_MODEL, on the first call for a (fingerprint, settings, latent shape),
runs one float forward in which every candidate layer also computes its INT8 output on the same input
and measures its error; the decision is cached in memory and on disk. On every later call the chosen
INT8 modules are swapped into the diffusion model for the duration of that call only, and the float
modules are put back in `finally`. ModelPatcher never sees the INT8 modules, so its weight patching and
backups keep acting on the real float layers: the shared base model cannot be corrupted, and
LoRA before or after the node is honoured because INT8 weights are built from the live patched weights,
again whenever the weight patches change.
"""

from __future__ import annotations

import contextlib
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
from ..comfy_contracts import bypass_hook, follow_bypass, restorable_backup
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
from .float_offload import (
    can_hold_off,
    float_placement,
    hold_off,
    holds_floats_off,
    install_load,
    is_held_off,
    is_loaded,
)
from .layout import CandidateCache, find_candidates, module_at, swapped_modules
from .layout import canonical_name as canonical_name  # where the save node and tests import it from
from .modules import Int8Conv2d, Int8Linear
from .picture import decision_picture
from .report import format_report, summary_line
from .residency import (
    Int8CopyMarker,
    drop_orphaned_markers,
    float_model_size,
    int8_copy_bytes,
    is_on,
    marker_of,
)
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


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "_orig_mod", module)


def int8_module_bytes(module: torch.nn.Module) -> int:
    """Bytes an INT8 layer holds: its int8 weight, scales and bias copy."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def parameter_bytes(root: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in root.parameters())


def layer_weight_bytes(root: torch.nn.Module, result: CalibrationResult) -> dict[str, int]:
    """{layer name: bytes of its float weight} for the layers of `result` that `root` has."""
    candidates = find_candidates(root)
    out = {}
    for layer in result.layers:
        if layer.name in candidates:
            weight = module_at(root, candidates[layer.name][0]).weight
            out[layer.name] = weight.numel() * weight.element_size()
    return out


class ModelCopies:
    """The INT8 copies built from one model's float layers. One model has one set; under ComfyUI 0.38's MultiGPU
    every device computes with its own deep clone of the model (`deepclone_multigpu`), from its own thread, so
    each of those models has its own set, built once on its device and never touched by another thread."""

    def __init__(self) -> None:
        self.modules: dict[str, torch.nn.Module] = {}
        self.state: tuple | None = None
        self.markers: dict[str, Int8CopyMarker] = {}
        self.float_size: int | None = None
        # ((layer names, floats held off), their INT8 copies' bytes, their float layers' bytes held in system memory)
        self.int8_size: tuple | None = None
        self.last_swap: tuple | None = None  # ((names, device, bypass), {path: copy}, [(name, copy)]) of the last call
        # The model's ModelPatcher.backup (shared by its clones) where its patcher frees memory by restoring it
        # (dynamic VRAM), else None.
        self.backup: dict | None = None
        self.holding_floats = False  # some chosen float layer was put in system memory (float_offload.py)

    def release(self, name: str) -> int:
        """Drop the INT8 copy of layer `name` (ComfyUI moved its float layer); rebuilt on its next call."""
        module = self.modules.pop(name, None)
        if module is None:
            return 0
        release_packed_weight(module.weight)
        return int8_module_bytes(module)

    def release_all(self) -> None:
        for name in list(self.modules):
            self.release(name)


def in_multigpu_call(transformer_options: dict | None) -> bool:
    """Whether this model call is one of several that ComfyUI 0.38's `samplers._calc_cond_batch_multigpu` runs at
    once, one per device, from the threads of its `MultiGPUThreadPool` (it sets `multigpu_thread_device`)."""
    return bool(transformer_options) and transformer_options.get("multigpu_thread_device") is not None


class Int8Plan:
    """Per-node state shared by the clone and everything cloned from it (MultiGPU's device clones included: their
    wrappers are this plan's bound methods). Calibration results are shared; INT8 copies are per model."""

    def __init__(self, settings: QuantizeSettings, node_id: str | None = None) -> None:
        self.settings = settings
        self.node_id = node_id
        self.results: dict[str, CalibrationResult] = {}
        self.calibration_runs = 0
        self.disk_hits = 0
        self.last_report = ""
        self.last_result: CalibrationResult | None = None
        self.shown_result: CalibrationResult | None = None  # the calibration the node's report output describes
        self._run_fingerprint: str | None = None
        self._fingerprints: dict[tuple, str] = {}
        self._bypass_fingerprint_of: tuple[str, list] | None = None  # (fingerprint, weakrefs to its owners)
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> ModelCopies
        self._last_copies = ModelCopies()  # those of the model that ran last (what `_modules` shows)
        self._calibration_lock = threading.Lock()  # one calibration per key, whichever device's thread comes first
        self._candidates = CandidateCache()
        self._deferred_loads: set[int] = set()  # models whose load runs with held-off layers taken out

    @property
    def _modules(self) -> dict[str, torch.nn.Module]:
        """The INT8 copies of the model that ran last."""
        return self._last_copies.modules

    def copies_of(self, base_model) -> ModelCopies:
        copies = self._copies.get(base_model)
        if copies is None:
            copies = self._copies[base_model] = ModelCopies()
        self._last_copies = copies
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
        patcher.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_LOAD, WRAPPER_KEY, self.on_load)
        patcher.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_CLONE, WRAPPER_KEY, self.on_clone)
        install_load(patcher)

    @staticmethod
    def on_clone(patcher, clone) -> None:
        install_load(clone)  # a clone (LoRA, another node) loads as this MODEL does

    def layers_to_hold_off(self, patcher, device_to) -> dict[str, tuple[str, torch.nn.Module]]:
        """{name: (path, float layer)} of the layers a load of `patcher` onto `device_to` leaves in system memory:
        those the plan's last calibration put in INT8 (none before the first), where ComfyUI can cast them."""
        result = self.last_result or self.shown_result
        if result is None or device_to is None or not holds_floats_off(patcher, device_to):
            return {}
        root = patcher.model.diffusion_model
        candidates = self._candidates.get(root)
        held = {}
        for name in result.chosen:
            if name in candidates:
                module = module_at(root, candidates[name][0])
                if can_hold_off(module):
                    held[name] = (candidates[name][0], module)
        return held

    @contextlib.contextmanager
    def deferring_on_load(self, patcher):
        """ComfyUI's load runs with the held-off layers taken out: the plan's ON_LOAD waits until they are back."""
        self._deferred_loads.add(id(patcher.model))
        try:
            yield
        finally:
            self._deferred_loads.discard(id(patcher.model))

    def on_detach(self, patcher, unpatch_all: bool = True) -> None:
        """ComfyUI unloaded the model: drop its INT8 modules too (rebuilt from the live weights when it runs).

        Detaching without unpatching is not an unload: ComfyUI does it whenever a clone of this MODEL is garbage
        collected (`ModelPatcher.__del__`) or replaced by another clone of the same model, which happens on every
        prompt; the weights stay as they are, so the INT8 modules built from them stay valid."""
        if not unpatch_all:
            return
        copies = self.copies_of(patcher.model)
        for module in copies.modules.values():
            release_packed_weight(module.weight)
        for marker in copies.markers.values():  # unpatch_model zeroed the model's loaded memory
            marker.forget()
        copies.modules, copies.state, copies.int8_size, copies.last_swap = {}, None, None, None
        self._candidates.forget()  # the unpatch restored ComfyUI's object patches, which may replace modules

    def fingerprint(self, patcher) -> str:
        state = (id(patcher.model), patcher.patches_uuid)
        if state not in self._fingerprints:
            dm = unwrap_compiled(patcher.model.diffusion_model)
            keys = [f"diffusion_model.{name}" for name, _ in dm.named_parameters()]
            self._fingerprints = {state: model_fingerprint(patcher, keys)}
        return self._fingerprints[state]

    def _bypass_fingerprint(self, base_model) -> str:
        """The bypass-mode LoRA on the model's layers now, which no weight patch carries ('' when none). It comes as
        one of the injections of the patcher that runs (`current_patcher`), so the layers are looked at once per
        injected patcher and set of injections."""
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
            root = patcher.model.diffusion_model
            return format_report(self.shown_result, self.settings, layer_weight_bytes(root, self.shown_result),
                                 from_cache=True, float_placement=float_placement(patcher))
        kinds = {kind: sum(1 for _, k in candidates.values() if k == kind) for kind in ("linear", "conv")}
        return (f"INT8 calibration pending: it runs on the first sampling step with the real inputs "
                f"({kinds['linear']} Linear and {kinds['conv']} Conv2d candidates). Its summary shows on the "
                f"Quantize node then; queue the prompt again to see the full report and the decision picture.")

    # --- wrappers ----------------------------------------------------------------------------------
    def outer_sample(self, executor, *args, **kwargs):
        guider = executor.class_obj
        if self.last_result is not None:  # before ComfyUI loads the model: plan the load with the INT8 copies
            self._report_size(guider.model_patcher, self.last_result.chosen)
        # Dynamic VRAM's load starts by restoring every backup entry, which would release the copies this run is
        # about to use: until the load (on_load) or their next call counts them again, they are not counted.
        for model, copies in list(self._copies.items()):
            if copies.backup is not None:
                self._uncount(model, copies.markers.values())
                copies.last_swap = None
        previous = self._run_fingerprint
        self._run_fingerprint = self.fingerprint(guider.model_patcher)
        try:
            return executor(*args, **kwargs)
        finally:
            self._run_fingerprint = previous

    def apply_model(self, executor, *args, **kwargs):
        base_model = executor.class_obj
        x = wrapper_arg(args, kwargs, 0, "x")
        if not in_multigpu_call(wrapper_arg(args, kwargs, 5, "transformer_options", None)):
            self._drop_other_models(base_model)
        patcher = getattr(base_model, "current_patcher", None)
        if patcher is not None:
            self.copies_of(base_model).backup = restorable_backup(patcher)
        fingerprint = self._run_fingerprint or f"uuid:{getattr(base_model, 'current_weight_patches_uuid', None)}"
        bypass = self._bypass_fingerprint(base_model)
        options = wrapper_arg(args, kwargs, 5, "transformer_options", None)
        graph_timing = cuda_graph_timing_for(x.device, replays_cuda_graphs(options))
        fused_quantizer = graph_timing and fuses_linear_quantizer(options) and traces_linear_quantizer(x.device)
        key = calibration_key(fingerprint + bypass, self.settings, x, graph_timing, fused_quantizer)
        result = self._known_result(key, base_model, fingerprint)
        if result is None:
            with self._calibration_lock:  # MultiGPU: another device's thread may be calibrating this key now
                result = self._known_result(key, base_model, fingerprint)
                if result is None:
                    return self._calibrate(executor, base_model, args, kwargs, key, fingerprint, graph_timing,
                                           fused_quantizer)
        self._report_size(getattr(base_model, "current_patcher", None), result.chosen)
        replacements = self._int8_modules(base_model, result.chosen, x.device, bypass)
        with swapped_modules(base_model.diffusion_model, replacements):
            return executor(*args, **kwargs)

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

    # --- INT8 modules, rebuilt whenever the live weights change ----------------------------------------
    def _int8_modules(self, base_model, names: list[str], device: torch.device,
                      bypass: str = "") -> dict[str, torch.nn.Module]:
        """{module path: INT8 copy} of the chosen layers, built where missing for computing on `device`, each
        tied to its float layer so that ComfyUI counts it and frees it with that layer (see residency.py) and
        following the bypass-mode LoRA it has (`bypass`: its fingerprint)."""
        root = self._fresh_module_cache(base_model)
        copies = self.copies_of(base_model)
        request = (tuple(names), device, bypass)
        patcher = getattr(base_model, "current_patcher", None)
        hold = holds_floats_off(patcher, device)
        last = copies.last_swap
        # a load by a MODEL without INT8 (model_lowvram off) may have put held float layers back on the device
        floats_reloaded = copies.holding_floats and not base_model.model_lowvram
        if last is not None and last[0] == request and not floats_reloaded \
                and all(copies.modules.get(name) is layer for name, layer in last[2]):
            return last[1]  # the same copies as the previous call, already placed and tracked
        candidates = self._candidates.get(root)
        out, placed = {}, []
        for name in names:
            if name not in candidates:
                continue
            path, kind = candidates[name]
            try:
                float_module = module_at(root, path)
            except AttributeError:  # replaced since the walk, though no load or detach said so: walk again
                self._candidates.forget(root)
                return self._int8_modules(base_model, names, device, bypass)
            layer = self._placed_copy(copies, name, device)
            if layer is None:
                layer = copies.modules[name] = self._copy_for_device(float_module, kind, device)
            if hold:
                self._hold_off(patcher, copies, name, float_module)
            self._track(base_model, copies, name, float_module, layer)
            follow_bypass(float_module, layer)
            out[path] = layer
            placed.append((name, layer))
        assign_shared_inputs(root, out)
        copies.last_swap = (request, out, placed)
        return out

    @staticmethod
    def _hold_off(patcher, copies: ModelCopies, name: str, float_module: torch.nn.Module) -> None:
        """Float layer `name`, whose INT8 copy runs, leaves the computing device if ComfyUI loaded it there."""
        if can_hold_off(float_module) and (is_loaded(float_module) or not is_held_off(float_module)):
            patcher.model.model_loaded_weight_memory -= hold_off(patcher, name, float_module)
            copies.holding_floats = True

    @staticmethod
    def _placed_copy(copies: ModelCopies, name: str, device: torch.device | None):
        """The INT8 copy of `name` if it is on the computing `device` (else None: it is built there)."""
        layer = copies.modules.get(name)
        if layer is not None and device is not None and not is_on(layer.weight, device):
            copies.release(name)
            return None
        return layer

    def _copy_for_device(self, float_module: torch.nn.Module, kind: str, device: torch.device) -> torch.nn.Module:
        """The INT8 copy of a float layer, with the weight width of the kernel backend that computes on `device`, kept
        on `device` even when ComfyUI keeps the float layer offloaded: derived forms (padded rows, column sums) are
        then built once, for a copy that stays, instead of per call from a temporary transfer. Quantized on `device`
        (a float weight in system memory moves there first, one layer at a time)."""
        layer = self._quantize_layer(float_module, kind, weight_qmax(device), device)
        if not is_on(layer.weight, device):
            layer = layer.to(device, non_blocking=comfy.model_management.device_supports_non_blocking(device))
        return layer

    def on_load(self, patcher, device_to, lowvram_model_memory, force_patch_weights, full_load,
                whole_size_counted: bool | None = None) -> None:
        """ComfyUI (re)loaded the model: its count holds the float weights only, and the load rewrote every layer's
        function lists; count the INT8 copies that stay, where they stay, and tie them to their layers again.
        `whole_size_counted`: ComfyUI counted `model_size()` as loaded (a full load; default: read off the model)."""
        base_model = patcher.model
        if id(base_model) in self._deferred_loads:
            return
        copies = self.copies_of(base_model)
        copies.backup = restorable_backup(patcher)
        if whole_size_counted is None:
            whole_size_counted = full_load and not base_model.model_lowvram
        root = self._fresh_module_cache(base_model)
        self._candidates.forget()  # the load applied ComfyUI's object patches, which may replace modules
        candidates = self._candidates.get(root)
        held = [module_at(root, path) for path, _ in candidates.values()]
        held = [module for module in held if is_held_off(module)]
        copies.holding_floats = bool(held)
        if whole_size_counted:  # ComfyUI counted model_size(), INT8 copies and held-off layers included
            base_model.model_loaded_weight_memory = (copies.float_size or float_model_size(patcher)) - sum(
                comfy.model_management.module_size(module) for module in held)
        for marker in copies.markers.values():  # the load reset the model's loaded memory
            marker.forget()
        copies.int8_size = copies.last_swap = None
        for name in list(copies.modules):
            if name not in candidates:
                continue
            layer = self._placed_copy(copies, name, device_to if device_to is not None else base_model.device)
            if layer is not None:
                self._track(base_model, copies, name, module_at(root, candidates[name][0]), layer)

    @staticmethod
    def _track(base_model, copies: ModelCopies, name: str, float_module: torch.nn.Module,
               layer: torch.nn.Module) -> None:
        """Put the layer's marker into its float layer's `bias_function` and count a copy on the device ComfyUI
        loads the model to in the model's loaded memory, offloaded float layer or not (see residency.py)."""
        if not hasattr(float_module, "bias_function"):
            return  # not one of ComfyUI's op classes: ModelPatcher neither counts nor offloads it
        marker = marker_of(float_module, name, copies)
        if marker is None:  # a load rewrote the list: the layer's marker goes back in
            base_model.model_loaded_weight_memory = getattr(base_model, "model_loaded_weight_memory", 0) - \
                drop_orphaned_markers(float_module)
            marker = copies.markers.get(name) or Int8CopyMarker(name, copies.release)
            float_module.bias_function = [*float_module.bias_function, marker]  # a new list: never the class's
        copies.markers[name] = marker
        loaded_to = getattr(base_model, "device", None)
        if marker.counted_bytes == 0 and loaded_to is not None and is_on(layer.weight, loaded_to):
            marker.count(int8_module_bytes(layer), base_model, copies.backup)
            base_model.model_loaded_weight_memory = getattr(base_model, "model_loaded_weight_memory", 0) + \
                marker.counted_bytes

    @staticmethod
    def _uncount(base_model, markers) -> None:
        """Take these markers' copies out of the model's loaded memory (and out of its backup)."""
        for marker in markers:
            freed = marker.forget()
            if freed:
                base_model.model_loaded_weight_memory -= freed

    def _uncount_dropped(self, base_model) -> None:
        """Take the copies calibration dropped out of the model's loaded memory."""
        copies = self.copies_of(base_model)
        self._uncount(base_model, [marker for name, marker in copies.markers.items() if name not in copies.modules])

    def _report_size(self, patcher, names: list[str]) -> None:
        """Make `patcher.model_size()` (what ComfyUI plans loads and frees memory with) the model as it sits on the
        computing device: the INT8 copies of `names` in, their float layers out where they stay in system memory
        (float_offload.py), beside them where they stay loaded."""
        if patcher is None:
            return
        copies = self.copies_of(patcher.model)
        names = tuple(names)
        hold = holds_floats_off(patcher)
        if copies.int8_size is None or copies.int8_size[0] != (names, hold):
            root = unwrap_compiled(patcher.model.diffusion_model)
            candidates = self._candidates.get(root)
            layers = [module_at(root, candidates[name][0]) for name in names if name in candidates]
            held = sum(comfy.model_management.module_size(layer) for layer in layers if hold and can_hold_off(layer))
            copies.int8_size = ((names, hold), sum(int8_copy_bytes(layer) for layer in layers), held)
        if copies.float_size is None:
            copies.float_size = float_model_size(patcher)
        patcher.size = copies.float_size - copies.int8_size[2] + copies.int8_size[1]

    def _fresh_module_cache(self, base_model) -> torch.nn.Module:
        """Drop the INT8 modules when the live weights changed (another model, or other weight patches)."""
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
        """The INT8 copy of float layer `module`; `qmax` is the weight width of the device that computes with it
        (default: the one its weight is on), `device` where a float layer's weight is quantized (default: where it
        is; a layer core quantized converts where it is)."""
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
        """What calibration knows of a layer's call before deciding: its GEMM sizes, density and whether the kernel
        backend serving `x`'s device would compute it in float (below its size floor)."""
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
        memory = {"kept": 0, "peak": 0, "held": 0}  # INT8 copies kept, float layers held off, the peak of the two
        patcher = getattr(base_model, "current_patcher", None)
        hold = holds_floats_off(patcher, args[0].device)
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
                    memory["peak"] = max(memory["peak"], memory["kept"] - memory["held"] + int8_module_bytes(layer))
                    # A bypass-mode LoRA adds the same term to the float and the INT8 output: compare the layers'
                    # own outputs (the copy's class forward leaves out the LoRA it follows).
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

                # One layer at a time: a layer is quantized only when it reaches the error gate, and its INT8
                # copy is kept only when it runs in INT8.
                if decide(row, self.settings, measure_error, time_calls) == INT8:
                    copies.modules[name] = int8_copy[0]
                    memory["kept"] += int8_module_bytes(int8_copy[0])
                    if hold and can_hold_off(module):  # its float weight is not needed on the device from now on
                        memory["held"] += comfy.model_management.module_size(module)
                        self._hold_off(patcher, copies, name, module)
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
        self._uncount_dropped(base_model)
        self._report_size(getattr(base_model, "current_patcher", None), result.chosen)
        if chosen:
            # Return the INT8 output, so that the calibrating run gives the same result as every later run.
            output = self._swapped_and_guarded(executor, base_model, args, kwargs, output, result)
        result.seconds = time.perf_counter() - start
        result.memory = {"model_float_bytes": parameter_bytes(root), "calibration_peak_int8_bytes": memory["peak"],
                         "int8_bytes": sum(int8_module_bytes(module) for module in copies.modules.values())}
        self.calibration_runs += 1
        self.results[key] = result
        self._publish(result, base_model, fingerprint, save=True)
        return output

    def _swapped_and_guarded(self, executor, base_model, args, kwargs, float_output: torch.Tensor,
                             result: CalibrationResult) -> torch.Tensor:
        """The calibrating call's output with the chosen layers in INT8, after the whole-model guard (calibration.py)
        returned layers to float while the whole-model error exceeded its limit; `result` records the error, the
        FLOP share and what the guard did."""
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
            self._uncount_dropped(base_model)
            self._report_size(getattr(base_model, "current_patcher", None), result.chosen)
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
        """Whole-model output error with the chosen layers in INT8, and their share of the model's FLOPs
        (FlopCounterMode sees the float matmuls/convs/attention; the INT8 ops are opaque to it)."""
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
        patcher = getattr(base_model, "current_patcher", None)
        placement = None if patcher is None else float_placement(patcher)
        weight_bytes = layer_weight_bytes(base_model.diffusion_model, result)
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
    """What INT8 layer `layer` computes for `x` with the INT8 arithmetic itself (W8A8, the reference kernels), also
    where the backend serving `x`'s device would compute the call in float (below its size floor)."""
    from ...kernels import reference

    weight, scale, bias = layer.weight.to(x.device), layer.weight_scale.to(x.device), layer.bias
    bias = None if bias is None else bias.to(x.device)
    with torch.no_grad():
        if isinstance(layer, Int8Conv2d):
            return reference.conv2d(x, weight, scale, bias, list(layer.stride), list(layer.padding),
                                    list(layer.dilation), layer.groups)
        return reference.linear(x, weight, scale, bias)
