"""The GPU bench's INT8 variants (harness/int8_layer.py) hold their weights as module parameters: under CUDA graphs
(reduce-overhead) the tensors a compiled closure captures are copied into the graph's input buffers on every
replay, which would time a weight copy with each call; parameters are read where they are. Checked on CPU
tensors, where the same module runs the pack's ops."""

from __future__ import annotations

import pytest
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


def test_layer_variants_are_prepared_before_timing_and_compared_like_with_like(pack, monkeypatch):
    """bench_gpu's INT8 layer variants build their derived weights (the pack's weight cache) before they are
    compiled or timed, never inside a compiled warm-up; a compiled INT8 layer is compared with a compiled fp16
    one, an eager one with eager fp16. Checked on CPU tensors through the `cuda` kernel backend (torch._int_mm is
    exact there), whose prepared weights are what a GPU run builds."""
    import importlib.util

    from comfyui_int8_accel import kernels
    from comfyui_int8_accel.kernels.weight_cache import CACHE
    from harness.comfy_host import REPO_ROOT

    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", REPO_ROOT / "bench" / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    builds_when_compiled = []

    def compile_stand_in(fn):  # records what was built by the time the layer would be compiled
        builds_when_compiled.append(CACHE.builds.copy())
        return fn

    monkeypatch.setattr(bench_gpu, "_compiled", compile_stand_in)
    assert bench_gpu.baseline_of("int8+compile") == "fp16+compile"
    assert bench_gpu.baseline_of("int8") == "fp16" and bench_gpu.baseline_of("kitchen int8") == "fp16"
    with kernels.force_kernel_backend("cuda"):
        for kind, shape in (("linear", (24, 100, 36)), ("conv", (1, 4, 8, 8, 36, 3, 1))):
            calls = bench_gpu._layer_calls(kind, shape, kernels, None, device=torch.device("cpu"),
                                           dtype=torch.float32)
            assert {"fp16", "fp16+compile", "int8", "int8+compile"} <= set(calls)
            for variant in ("int8", "int8+compile"):
                before = CACHE.builds.copy()
                call = calls[variant]()
                assert CACHE.builds - before, f"{kind} {variant}: derived weights not built before timing"
                if variant == "int8+compile":
                    assert builds_when_compiled[-1] - before, f"{kind}: built inside the compiled warm-up"
                prepared = CACHE.builds.copy()
                call()
                assert CACHE.builds == prepared, f"{kind} {variant}: weights built while timed"


def test_the_whole_model_bench_runs_the_variants_asked_for_in_that_order(pack, tmp_path, capsys, monkeypatch):
    """GPU time is scarce: `--variants` names what a stage runs and in which order (a stage cut at its limit keeps
    the first rows), plain bf16 always first as the reference; a name the bench does not know stops the stage
    before any model is built. The dry run: tiny models on the CPU."""
    import importlib

    from harness.comfy_host import REPO_ROOT

    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))  # as bench_gpu.py imports it
    gpu_models = importlib.import_module("gpu_models")
    asked = ["Quantize Model (INT8), NCHW conv", "DeepCache", "plain bf16", "DeepCache"]
    assert [v.name for v in gpu_models.chosen_variants(asked)] == [
        "plain bf16", "Quantize Model (INT8), NCHW conv", "DeepCache"]
    out = tmp_path / "sdxl.md"
    assert gpu_models.run_models(["sdxl"], out, dry=True, variant_names=asked[:2]) == 0
    rows = [line.split(" | ")[0].lstrip("| ") for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert rows == ["plain bf16", "Quantize Model (INT8), NCHW conv", "DeepCache"]
    typo = tmp_path / "typo.md"
    assert gpu_models.run_models(["sdxl"], typo, dry=True, variant_names=["DeepCache", "Deep Cache"]) == 2
    assert not typo.exists() and "no variant named 'Deep Cache'" in capsys.readouterr().out


def test_the_peers_run_beside_the_reference_in_the_dry_run_or_say_why_not(pack, tmp_path, monkeypatch):
    """torchao's int8 and fp8 rows and core's TorchCompileModel on plain bf16, each on a model of its own built
    like the reference, in the same run: a row with a speed, or one that says why it could not run (torchao's fp8
    needs compute capability 8.9; there is none on the CPU). The shared reference model is left as it was. Dry run
    on the CPU, where the peers compile with dynamo's eager backend to keep it short (inductor on the GPU)."""
    import importlib

    from harness.comfy_host import REPO_ROOT

    pytest.importorskip("torchao")
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    gpu_models = importlib.import_module("gpu_models")
    peers = [v.name for v in gpu_models.VARIANTS if v.peer]
    assert len(peers) == 3
    out = tmp_path / "flux.md"
    assert gpu_models.run_models(["flux"], out, dry=True, variant_names=peers) == 0
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in out.read_text().splitlines()
            if line.startswith("| ") and " | " in line}
    int8_row, fp8_row, core_row = (rows[name] for name in peers)
    assert float(int8_row[0]) > 0 and float(core_row[0]) > 0, (int8_row, core_row)
    assert fp8_row[0].startswith("failed: AssertionError") and "8.9" in fp8_row[0], fp8_row
    assert core_row[5] == "identical", core_row  # the same weights, compiled: the reference's latent
    assert int8_row[5] not in ("identical", "reference") and float(int8_row[5]) > 20, int8_row
    quantized, linears = int8_row[6].removeprefix("torchao: ").split(" ")[0].split("/")
    assert int(quantized) == int(linears) > 0, int8_row  # every Linear of the diffusion model, none left float
    assert core_row[6].rstrip(" |") == "-", core_row
    assert float(rows["plain bf16"][0]) > 0


def test_the_compiled_comparisons_and_the_peers_come_before_the_stack_and_the_eager_rows(pack, monkeypatch):
    """A stage cut at its time limit keeps its first rows: after the reference, Compile Model on plain bf16 and with
    INT8 (static shapes at the bench's one resolution), then eager INT8 with its float weights in system memory and
    kept on the GPU (the peak VRAM A/B), then the peers, then the stack, then every other eager row."""
    import importlib

    from harness.comfy_host import REPO_ROOT

    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    gpu_models = importlib.import_module("gpu_models")
    names = [v.name for v in gpu_models.VARIANTS]
    assert names[:8] == ["plain bf16", "plain bf16 + Compile Model", "INT8 + Compile Model", "Quantize Model (INT8)",
                         "Quantize Model (INT8), float weights kept on the GPU",
                         "torchao int8 dynamic + core TorchCompileModel", "torchao fp8 per-row + core TorchCompileModel",
                         "plain bf16 + core TorchCompileModel"]
    assert dict(gpu_models.VARIANTS[4].env) == {"INT8_ACCEL_KEEP_FLOAT_WEIGHTS": "1"}
    kinds = ["compiled" if v.compile or v.peer else "eager" for v in gpu_models.VARIANTS[5:]]
    stack = next(i for i, v in enumerate(gpu_models.VARIANTS[5:]) if v.deepcache and v.compile)
    assert "eager" not in kinds[:stack], kinds
    assert gpu_models.BENCH_COMPILE_DYNAMIC == "false"
