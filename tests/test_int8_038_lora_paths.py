"""Two ways ComfyUI 0.38 applies a LoRA without merging it at load, on INT8 models, in the real ComfyUI 0.3.75
with 0.38.1's functions swapped in and 0.3.75's own behaviour as the control: conditioning hooks on a loaded
INT8 file (`tests/support/comfy038_mmap.py`) and bypass-mode LoRA (`tests/support/comfy038_bypass.py`)."""

from __future__ import annotations

import os

import pytest
import torch

from comfyui_int8_accel.kernels import force_kernel_backend, record_calls
from comfyui_int8_accel.nodes.int8_files.checkpoint import int8_state_dict
from comfyui_int8_accel.nodes.int8_files.loader import int8_operations, int8_resident_layers, load_int8_diffusion_model
from harness.tiny_models import build_tiny_model, detect_tiny, latent_channels, make_conditioning
from tests.support.int8_checks import all_int8_layers, rel
from tests.support.lora import make_lora

pytestmark = pytest.mark.usefixtures("calibration_cache")


def _hooked_call(patcher, hooks) -> torch.Tensor:
    """What ComfyUI's sampler does for a conditioning that carries `hooks` (None: no hooks), once: load the model,
    register the hook patches (`prepare_model_patcher`), patch the weights for that conditioning (`apply_hooks` ->
    `patch_hooks`), call the model, and put the weights back (`unpatch_hooks`, as its cleanup does)."""
    import comfy.hooks

    gen = torch.Generator().manual_seed(3)
    positive, _ = make_conditioning("sd15")
    x, t = torch.randn(1, latent_channels("sd15"), 8, 8, generator=gen), torch.tensor([700.0])
    patcher.patch_model(device_to=torch.device("cpu"))
    try:
        with torch.inference_mode():
            if hooks is not None:
                target = comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model)
                patcher.register_all_hook_patches(hooks, target, patcher.model_options)
                patcher.patch_hooks(hooks)
            cond = patcher.model.extra_conds(noise=x, cross_attn=positive[0][0], **positive[0][1])
            cond = {key: value.cond if hasattr(value, "cond") else value for key, value in cond.items()}
            out = patcher.model.apply_model(x, t, transformer_options={"wrappers": patcher.wrappers}, **cond)
            patcher.unpatch_hooks()
        return out
    finally:
        patcher.unpatch_model(device_to=torch.device("cpu"))


@pytest.mark.skipif(os.name != "posix", reason="maps the file through libc, as comfy-aimdo does on POSIX")
def test_conditioning_hook_lora_on_a_loaded_int8_file_never_writes_into_the_read_only_mapped_file(
        comfy_root, monkeypatch, tmp_path):
    """ComfyUI 0.38.1 loads every .safetensors file through `load_safetensors` while comfy-aimdo is on (the
    default on NVIDIA), also the plain-ModelPatcher copy that conditioning hooks run on (`inner_set_conds` ->
    `get_non_dynamic_delegate` -> `cached_patcher_init(..., disable_dynamic=True)`); its tensors view the file
    mapped `PROT_READ` (comfy/utils.py at 09708eae709a992a5684bed3595ce4d07e705b4e, comfy-aimdo's
    src-posix/model-mmap.c at 59db82589f058d7e0394566d43aacfbd3227f4df). Core's own layers copy them in such a load
    (`load_model_weights(..., assign=model_patcher.is_dynamic())` in comfy/sd.py at
    033046cc4fac82d954c6daedccf1c8128433c4f1, `_lazy_load_from_state_dict` in comfy/ops.py at
    0271a469fe29524fafe5872b737123d65a63e5fc); Load Diffusion Model (INT8) took them as they were, and the hook LoRA
    (`patch_hook_weight_to_device` at 08d0e510f4e539a1db39072589817136ac6cfa7d: `set_weight(..., inplace_update=
    True)` and `copy_to_param`) then wrote into the mapped file: a crash (SIGSEGV), caught here as `ReadOnlyWrite`.
    On a CPU every layer stays in system memory, as offloaded layers do on a GPU. The INT8 layers keep 8-bit
    weights (the reference kernels), so their int8 values are the file's, as on a GPU. The LoRA reaches six INT8
    layers and two float ones (the file's other layers are float too)."""
    import comfy.hooks
    import comfy.model_patcher
    import comfy.utils

    from tests.support import comfy038_mmap

    # 8-bit weights, as the reference kernels hold them on every CPU: INT8_ACCEL_WEIGHT_BITS=7 (which forces 7 bits
    # even there) would give the file 7-bit values, whose coarser steps the requantized LoRA layers do not match
    # to the float32 step the bound below allows
    monkeypatch.delenv("INT8_ACCEL_WEIGHT_BITS", raising=False)
    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    dm = base.model.diffusion_model
    lora = make_lora(base, layers=8, scale=2.0)
    lora_layers = sorted({key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for key in lora})
    int8_layers = all_int8_layers(dm, lora_layers[2:])
    path = str(tmp_path / "tiny_int8.safetensors")
    comfy.utils.save_torch_file(int8_state_dict(dm.state_dict().items(), int8_layers), path)
    hooks = comfy.hooks.create_hook_lora(lora, strength_model=1.0, strength_clip=0.0)

    with force_kernel_backend("reference"):
        with monkeypatch.context() as patch:  # the control: 0.3.75's own file loading, hooks as 0.38.1 patches
            patch.setattr(comfy.model_patcher.ModelPatcher, "patch_hook_weight_to_device",
                          comfy038_mmap.patch_hook_weight_to_device)
            control_model = load_int8_diffusion_model(path)[0]
            plain = _hooked_call(control_model, None)
            control = _hooked_call(control_model, hooks)
        assert rel(control, plain) > 0.01  # the hook LoRA took effect

        with comfy038_mmap.aimdo_loading(monkeypatch):
            loaded = load_int8_diffusion_model(path)[0]
            factory, args = loaded.cached_patcher_init
            delegate = factory(*args, disable_dynamic=True)
            resident = int8_resident_layers(delegate.model.diffusion_model)
            assert set(resident) == set(int8_layers)
            assert all(layer.weight.dtype == torch.int8 for layer in resident.values())
            with comfy038_mmap.no_writes_into_mappings():
                hooked = _hooked_call(delegate, hooks)
    # The same arithmetic on weights held elsewhere (mapped from the file, or loaded into memory): bit-equal on the
    # 2-core Intel Xeon, a few values one float32 step apart on a 2-core AMD EPYC (also on the code before the
    # session that found it); a LoRA missing or applied twice would be off by the LoRA's whole share (over 0.01)
    assert rel(hooked, control) < 1e-6


def test_a_load_that_assigns_keeps_the_file_mapped(comfy_root, tmp_path):
    """The boundary of the copy above: ComfyUI 0.38's dynamic VRAM loads with `assign=True` and streams the weights
    from the mapped file; an INT8 layer of Load Diffusion Model (INT8) then keeps the file's tensors (no copy), and
    takes a copy when the load does not assign."""
    import comfy.utils

    from tests.support import comfy038_mmap

    if os.name != "posix":
        pytest.skip("maps the file through libc, as comfy-aimdo does on POSIX")
    linear = torch.nn.Linear(64, 32)
    layer = all_int8_layers(torch.nn.Sequential(linear))["0"]
    path = str(tmp_path / "one_layer.safetensors")
    comfy.utils.save_torch_file(int8_state_dict([("0.weight", linear.weight), ("0.bias", linear.bias)],
                                                {"0": layer}), path)
    with force_kernel_backend("reference"):  # 8-bit weights: the file's int8 values are used as they are
        held = {}
        for assign in (True, False):
            sd = comfy038_mmap.load_safetensors(path)[0]
            model = torch.nn.Sequential(int8_operations().Linear(64, 32))
            model.load_state_dict({key: sd[key] for key in sd}, strict=False, assign=assign)
            held[assign] = model[0]
    assert comfy038_mmap.in_mapping(held[True].weight) and comfy038_mmap.in_mapping(held[True].bias)
    assert not comfy038_mmap.in_mapping(held[False].weight) and not comfy038_mmap.in_mapping(held[False].bias)
    assert torch.equal(held[True].weight, held[False].weight)


def _model_call(patcher, calls: int = 1) -> torch.Tensor:
    """The model's output on one fixed input, on the `calls`-th call, loaded as ComfyUI loads it for sampling
    (`patch_model`, which injects the bypass hooks; `pre_run`)."""
    gen = torch.Generator().manual_seed(3)
    positive, _ = make_conditioning("sd15")
    x, t = torch.randn(1, latent_channels("sd15"), 8, 8, generator=gen), torch.tensor([700.0])
    patcher.patch_model(device_to=torch.device("cpu"))
    patcher.pre_run()
    try:
        with torch.inference_mode():
            cond = patcher.model.extra_conds(noise=x, cross_attn=positive[0][0], **positive[0][1])
            cond = {key: value.cond if hasattr(value, "cond") else value for key, value in cond.items()}
            for _ in range(calls):
                with record_calls() as counted:
                    out = patcher.model.apply_model(x, t, transformer_options={"wrappers": patcher.wrappers}, **cond)
        assert sum(n for (_, _, path), n in counted.items() if path == "int8") > 0 or calls == 1
        return out
    finally:
        patcher.unpatch_model(device_to=torch.device("cpu"))


def test_bypass_mode_lora_reaches_the_int8_layers(comfy_root, monkeypatch):
    """ComfyUI 0.38.1's bypass-mode LoRA (`load_bypass_lora_for_models`, comfy/sd.py at
    033046cc4fac82d954c6daedccf1c8128433c4f1) leaves the weights alone: `BypassForwardHook.inject`
    (comfy/weight_adapter/bypass.py at 511d2e5fabe4db672dc1f9555edd00cc993cb283) replaces the float layer's `forward`
    with `g(forward(x) + h(x))` (`LoRAAdapter.h`, comfy/weight_adapter/lora.py at
    6f98b150e065f1ffc788558574a887835068bd40). Quantize Model (INT8) puts its INT8 copy in the float layer's place
    for each call, so the hooked forward never ran: the LoRA was lost on every INT8 layer, and its calibration
    measured the LoRA as INT8 error under the same fingerprint as the model without it. The copy now follows the
    hook, calibration compares the layers' own outputs, and the bypass LoRA is part of the calibration key.
    Control: the same LoRA merged at load (0.3.75's own path) through the same INT8 layers. Load Diffusion Model
    (INT8) layers take the hook on their own forward, as core's quantized layers do."""
    from comfyui_int8_accel.nodes.int8 import apply_int8, int8_plan, settings_from_widgets
    from comfyui_int8_accel.nodes.int8_files.loader import load_int8_state_dict
    from tests.support import comfy038_bypass
    from tests.support.int8_checks import ALL_INT8
    from tests.support.lora import apply_lora

    detect_tiny(monkeypatch, "sd15")
    base = build_tiny_model("sd15")
    lora = make_lora(base, layers=6, scale=2.0, kinds=(torch.nn.Linear,))
    lora_layers = sorted({key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] for key in lora})
    settings = settings_from_widgets(**{**ALL_INT8, "quantize_conv": "disable"})
    with comfy038_bypass.bypass_lora_038(monkeypatch):
        plain = _model_call(base)
        merged = _model_call(apply_lora(base, lora))
        bypassed = comfy038_bypass.load_bypass_lora_for_models(base, None, lora, 1.0, 0.0)[0]
        assert rel(_model_call(bypassed), merged) < 1e-5  # 0.38.1's bypass computes what a merged LoRA does
        lora_effect = rel(merged, plain)
        assert lora_effect > 0.05

        int8_bypass_model = apply_int8(bypassed, settings)[0]
        int8_bypassed = _model_call(int8_bypass_model, calls=2)
        plan = int8_plan(int8_bypass_model)
        assert set(lora_layers) <= set(plan.last_result.chosen)  # the LoRA's layers run in INT8
        assert rel(int8_bypassed, merged) < 0.25 * lora_effect, (rel(int8_bypassed, merged), lora_effect)
        assert plan._bypass_fingerprint_of[0].startswith(":bypass:")  # part of the calibration key
        # the copies follow the hooks from one call to the next, also where nothing reloads in between
        model, chosen, cpu = int8_bypass_model.model, plan.last_result.chosen, torch.device("cpu")
        int8_bypass_model.patch_model(device_to=cpu)
        int8_bypass_model.pre_run()
        following = []
        try:
            for _ in range(2):
                layers = plan._int8_modules(model, chosen, cpu, plan._bypass_fingerprint(model)).values()
                following.append(sum("forward" in layer.__dict__ for layer in layers))
                int8_bypass_model.eject_model()
        finally:
            int8_bypass_model.unpatch_model(device_to=cpu)
        assert following == [len(lora_layers), 0]

        dm = base.model.diffusion_model
        loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm, lora_layers)))
        loaded_plain = _model_call(loaded)
        loaded_bypassed = _model_call(comfy038_bypass.load_bypass_lora_for_models(loaded, None, lora, 1.0, 0.0)[0])
        assert rel(loaded_bypassed, merged) < 0.25 * lora_effect and rel(loaded_bypassed, loaded_plain) > 0.05
