"""Newer-only APIs are feature-checked: on an older ComfyUI, PyTorch or Triton the pack falls back with a reason
instead of failing (kernels: another backend; nodes: not loaded, with a warning)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from comfyui_int8_accel.kernels import cpu, ops, triton_backend


def test_this_comfyui_has_every_api_the_nodes_use(pack):
    assert pack._missing_comfyui_apis() == []
    assert pack.NODE_CLASS_MAPPINGS  # so the nodes were loaded


def test_a_comfyui_without_an_api_is_named(pack, monkeypatch):
    import comfy.model_patcher

    monkeypatch.delattr(comfy.model_patcher, "create_model_options_clone")
    monkeypatch.setitem(__import__("sys").modules, "comfy_api.latest", None)  # an import that fails
    assert pack._missing_comfyui_apis() == ["comfy_api.latest.io", "comfy.model_patcher.create_model_options_clone"]


@pytest.mark.skipif(cpu.available() is not None, reason="no oneDNN INT8 ops in this PyTorch")
def test_onednn_conv_under_its_older_name(monkeypatch):
    onednn = torch.ops.onednn
    older = SimpleNamespace(qlinear_prepack=onednn.qlinear_prepack, qlinear_pointwise=onednn.qlinear_pointwise,
                            qconv_prepack=onednn.qconv_prepack, qconv2d_pointwise=onednn.qconv2d_pointwise)
    monkeypatch.setattr(torch.ops, "onednn", older)
    assert cpu._qconv_op() is older.qconv2d_pointwise and cpu.available() is None
    del older.qconv2d_pointwise
    assert "torch.ops.onednn.qconv_pointwise" in cpu.available()
    assert ops.kernel_backend_for("cpu") == "reference"  # and the node declines INT8 on the reference backend


def test_a_triton_without_div_rn_leaves_cuda_tensors_to_the_cuda_backend(monkeypatch):
    kernels = pytest.importorskip("comfyui_int8_accel.kernels.triton_kernels")
    if not kernels.AVAILABLE:
        pytest.skip("triton is not importable")
    monkeypatch.setattr(kernels, "TOO_OLD", "this Triton (2.3) has no tl.math.div_rn: Triton 3.0 or newer is needed")
    assert "Triton 3.0" in triton_backend.available()
    assert ops.kernel_backend_for("cuda") == "cuda"


def test_the_loader_calls_comfyui_with_only_the_arguments_it_takes(pack, monkeypatch):
    import comfy.sd

    loader = importlib.import_module("comfyui_int8_accel.nodes.int8_files.loader")
    seen = {}

    def older_signature(sd, model_options=None):  # ComfyUI releases before the metadata argument
        seen["options"] = model_options
        return None

    monkeypatch.setattr(comfy.sd, "load_diffusion_model_state_dict", older_signature)
    with pytest.raises(ValueError, match="could not detect the model type"):
        loader.load_int8_state_dict({}, {"a": "b"})
    assert "custom_operations" in seen["options"]
