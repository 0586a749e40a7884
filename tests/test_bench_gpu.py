"""The GPU bench's INT8 variants (harness/int8_layer.py) hold their weights as module parameters: under CUDA graphs
(reduce-overhead) the tensors a compiled closure captures are copied into the graph's input buffers on every
replay, which would time a weight copy with each call; parameters are read where they are. Checked on CPU
tensors, where the same module runs the pack's ops."""

from __future__ import annotations

import torch

from harness.int8_layer import Int8Layer


def test_int8_layers_hold_their_weights_as_parameters(pack):
    from comfyui_int8_accel import kernels

    w = torch.randn(48, 64)
    q, s = kernels.quantize_weight_per_channel(w, 127)
    b = torch.randn(48)
    layer = Int8Layer(kernels.int8_linear, q, s, b)
    params = dict(layer.named_parameters())
    assert set(params) == {"q_weight", "w_scale", "bias"}
    assert params["q_weight"].dtype == torch.int8 and not any(p.requires_grad for p in params.values())
    x = torch.randn(8, 64)
    assert torch.equal(layer(x), kernels.int8_linear(x, q, s, b))

    cq, cs = kernels.quantize_weight_per_channel(torch.randn(16, 8, 3, 3), 127)
    cb = torch.randn(16)
    conv = Int8Layer(kernels.int8_conv2d, cq, cs, cb, 1, 1)
    cx = torch.randn(2, 8, 10, 10)
    assert torch.equal(conv(cx), kernels.int8_conv2d(cx, cq, cs, cb, 1, 1))
