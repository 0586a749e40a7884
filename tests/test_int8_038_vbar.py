"""Loaded INT8 layers under ComfyUI 0.38's dynamic VRAM: their int8 bytes travel once, through their VBAR slot.

`ModelPatcherDynamic.load` gives every layer with `comfy_cast_weights` over 16 KiB a VBAR slot, INT8 layers
included; ComfyUI copies a layer's weights into its slot when the layer is cast, ahead of the block on models
that prefetch (Qwen-Image 2.1, LTX-2), and keeps them there across steps while the slot stays resident. An INT8
layer that copied its int8 bytes from system memory itself moved them a second time on every call. 0.38's casts
(`tests/support/comfy038_vbar.py`, comfy/ops.py as 0.38 writes it) are swapped into the real 0.3.75; a layer
without a slot (0.3.75, or a layer dynamic VRAM force-loads) is the control.
"""

from __future__ import annotations

import pytest
import torch

from comfyui_int8_accel.nodes.int8 import modules
from comfyui_int8_accel.nodes.int8_files.checkpoint import int8_state_dict
from comfyui_int8_accel.nodes.int8_files.loader import load_int8_state_dict
from harness.tiny_models import build_tiny_model, detect_tiny
from tests.support import comfy038_vbar as vbar
from tests.support.int8_checks import all_int8_layers


def _layers():
    """An INT8 Linear and Conv2d over the 16 KiB under which dynamic VRAM force-loads a layer instead, with an input."""
    torch.manual_seed(0)
    linear = modules.Int8Linear.from_float(torch.nn.Linear(256, 128))
    conv = modules.Int8Conv2d.from_float(torch.nn.Conv2d(32, 64, 3, padding=1))
    return [(linear, torch.randn(2, 7, 256)), (conv, torch.randn(1, 32, 8, 8))]


@pytest.fixture
def kernel_weights(monkeypatch):
    """The int8 weight each INT8 kernel call reads."""
    seen: list[torch.Tensor] = []
    for name in ("int8_linear", "int8_conv2d"):
        kernel = getattr(modules, name)
        monkeypatch.setattr(modules, name, lambda x, weight, *rest, kernel=kernel: (
            seen.append(weight), kernel(x, weight, *rest))[1])
    return seen


def _in_slot(weight: torch.Tensor, slot: vbar.Slot) -> bool:
    return weight.untyped_storage().data_ptr() == slot.buffer.untyped_storage().data_ptr()


def _streamed_layers():
    """Each layer with its input, its output before it got a slot, its slot and the bytes one copy moves."""
    for layer, x in _layers():
        expected = layer(x)
        yield layer, x, expected, vbar.give_slot(layer), vbar.vram_aligned_size([layer.weight, layer.bias])


def test_a_streamed_int8_layer_reads_its_weight_from_its_vbar_slot(pack, monkeypatch, kernel_weights):
    for layer, x, expected, slot, size in _streamed_layers():
        with torch.inference_mode(), vbar.vbar_casts(monkeypatch):
            assert torch.equal(layer(x), expected)
            assert _in_slot(kernel_weights[-1], slot) and slot.copies == size  # one copy, into the slot
            assert torch.equal(layer(x), expected)
            assert _in_slot(kernel_weights[-1], slot) and slot.copies == size  # still resident: no copy
            slot.evict()
            assert torch.equal(layer(x), expected)
            assert slot.copies == 2 * size  # evicted: copied into the slot again, once


def test_a_prefetched_int8_layer_is_not_copied_again_by_its_own_call(pack, monkeypatch, kernel_weights):
    """A prefetching model fills the block's slots before the block runs: the layer's call reads that copy."""
    for layer, x, expected, slot, size in _streamed_layers():
        with torch.inference_mode(), vbar.vbar_casts(monkeypatch):
            for step in range(3):
                if step == 2:
                    slot.evict()
                vbar.prefetch_block([layer])
                assert torch.equal(layer(x), expected)
                assert _in_slot(kernel_weights[-1], slot)
                vbar.end_of_block([layer])
            assert slot.copies == 2 * size  # the first prefetch and the one after the eviction, nothing else


def test_a_layer_without_a_slot_keeps_its_own_weight(pack, monkeypatch, kernel_weights):
    """The control: 0.3.75 (or a layer dynamic VRAM force-loads) never goes through ComfyUI's cast."""

    def no_cast(*args, **kwargs):
        raise AssertionError("cast_bias_weight called for a layer without a VBAR slot")

    monkeypatch.setattr("comfy.ops.cast_bias_weight", no_cast)
    for layer, x in _layers():
        layer(x)
        assert kernel_weights[-1] is layer.weight


def test_a_loaded_int8_layers_slot_is_sized_in_int8(pack, comfy_root, monkeypatch):
    """0.38 sizes a layer's slot from `weight_comfy_model_dtype` (written by `archive_model_dtypes` when the model
    is built) or else the weight's dtype. Load Diffusion Model (INT8) puts new layer objects in place of the float
    ones, so no INT8 layer carries the float dtype: its slot holds int8 bytes, and nothing is cast to float."""
    import comfy.model_base

    def archive_model_dtypes(model):
        """comfy/model_management.py (Comfy-Org/ComfyUI 02b2b3886164b1fa412d393a3ed0674b9d1cf010)."""
        for name, module in model.named_modules():  # noqa: B007 (as 0.38 writes it)
            for param_name, param in module.named_parameters(recurse=False):
                setattr(module, f"{param_name}_comfy_model_dtype", param.dtype)
            for buf_name, buf in module.named_buffers(recurse=False):
                setattr(module, f"{buf_name}_comfy_model_dtype", buf.dtype)

    built = comfy.model_base.BaseModel.__init__

    def init_038(self, *args, **kwargs):  # 0.38's BaseModel.__init__ archives the dtypes of the built model
        built(self, *args, **kwargs)
        archive_model_dtypes(self.diffusion_model)

    detect_tiny(monkeypatch, "sd15")
    dm = build_tiny_model("sd15").model.diffusion_model
    sd = int8_state_dict(dm.state_dict().items(), all_int8_layers(dm))
    monkeypatch.setattr(comfy.model_base.BaseModel, "__init__", init_038)
    loaded = load_int8_state_dict(sd).model.diffusion_model
    assert any(getattr(m, "weight_comfy_model_dtype", None) == torch.float32 for m in loaded.modules())  # archived
    layers = [m for m in loaded.modules() if isinstance(m, modules._Int8Layer)]
    assert layers
    for layer in layers:
        assert getattr(layer, "weight_comfy_model_dtype", torch.int8) == torch.int8, layer.weight_comfy_model_dtype
        vbar.give_slot(layer)
        assert layer.weight._model_dtype == torch.int8
        assert layer._v.buffer.numel() == vbar.vram_aligned_size([layer.weight, layer.bias])


@pytest.mark.parametrize("request_bytes", ["part of the VBAR", "more than the VBAR holds"])
def test_a_partial_unload_frees_the_int8_layers_slots_first_and_they_compute_the_same_after(
        pack, comfy_root, monkeypatch, request_bytes):
    """0.38.1's `ModelPatcherDynamic.partially_unload` (comfy/model_patcher.py at 08d0e510) asks the model's VBAR
    to free memory before it restores any backup: the slots of streamed INT8 layers are what it evicts, and another
    model's bytes take their place. The next call copies each evicted layer's int8 bytes in again, once, leaves
    the slots still resident alone, and computes the same model bit for bit (a layer reading its evicted slot would
    compute on 0x5A bytes). Asking for more than the VBAR holds evicts every slot, then restores the backups."""
    from tests.support import comfy038

    detect_tiny(monkeypatch, "sd15")
    dm = build_tiny_model("sd15").model.diffusion_model
    loaded = load_int8_state_dict(int8_state_dict(dm.state_dict().items(), all_int8_layers(dm)))
    the_vbar = vbar.Vbar()
    layers = [m for m in loaded.model.diffusion_model.modules() if isinstance(m, modules._Int8Layer)]
    sizes = {id(vbar.give_slot(layer, the_vbar)): vbar.vram_aligned_size([layer.weight, layer.bias])
             for layer in layers}  # the tiny model's layers stand for streamed ones (over 16 KiB)
    comfy038.make_dynamic(loaded, monkeypatch)
    with vbar.vbar_casts(monkeypatch):
        before, int8_calls = comfy038.model_call(loaded, monkeypatch, dynamic=False)
        assert int8_calls >= len(layers)
        total = the_vbar.loaded_size()
        assert total == sum(sizes.values()) and all(slot.copies == sizes[id(slot)] for slot in the_vbar.slots)

        request = total // 2 if request_bytes == "part of the VBAR" else total + 1
        backups = loaded.model.model_loaded_weight_memory
        freed = comfy038.partially_unload(loaded, memory_to_free=request, vbar=the_vbar)
        evicted = [slot for slot in the_vbar.slots if not slot.resident]
        assert all(bool((slot.buffer == vbar.OTHER_MODELS_BYTE).all()) for slot in evicted)
        if request_bytes == "part of the VBAR":
            assert request <= freed < total and 0 < len(evicted) < len(layers)
        else:
            assert freed == total + backups and len(evicted) == len(layers)

        after, int8_calls_after = comfy038.model_call(loaded, monkeypatch, dynamic=False)
    assert torch.equal(after, before) and int8_calls_after == int8_calls
    assert the_vbar.loaded_size() == total
    assert all(slot.copies == (2 if slot in evicted else 1) * sizes[id(slot)] for slot in the_vbar.slots)
