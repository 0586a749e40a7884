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


def _gpu_models(monkeypatch):
    import importlib

    from harness.comfy_host import REPO_ROOT

    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))  # as bench_gpu.py imports it
    return importlib.import_module("gpu_models")


def _rows(path) -> dict[str, list[str]]:
    return {line.split(" | ")[0].lstrip("| "): [cell.rstrip(" |") for cell in line.split(" | ")[1:]]
            for line in path.read_text().splitlines() if line.startswith("| ") and " | " in line}


def test_the_whole_model_bench_runs_the_variants_asked_for_in_that_order(pack, tmp_path, capsys, monkeypatch):
    """GPU time is scarce: `--variants` names what a stage runs and in which order (a stage cut at its limit keeps
    the first rows), plain bf16 always first as the reference; a name the bench does not know stops the stage
    before any model is built. A kernel whose GPU tests failed earlier in the run (GPU_RUN_FAILED_KERNELS) stops the
    rows that use it, each saying so, and no other; an INT8 row reads its layer count from the decision, and one
    with 0 says its speed is float's. The dry run: tiny models on the CPU."""
    gpu_models = _gpu_models(monkeypatch)
    asked = ["Quantize Model (INT8), NCHW conv", "Quantize Model (INT8), persistent TMA GEMM", "DeepCache",
             "plain bf16", gpu_models.DRIFT, "DeepCache"]
    assert [v.name for v in gpu_models.chosen_variants(asked)] == [
        "plain bf16", "Quantize Model (INT8), NCHW conv", "Quantize Model (INT8), persistent TMA GEMM", "DeepCache",
        gpu_models.DRIFT]
    monkeypatch.setenv(gpu_models.KERNEL_FAILURES_ENV, "fused-tma")
    out = tmp_path / "sdxl.md"
    assert gpu_models.run_models(["sdxl"], out, dry=True, variant_names=asked[:5]) == 0
    rows = _rows(out)
    assert list(rows)[1:] == ["plain bf16", "Quantize Model (INT8), NCHW conv",
                              "Quantize Model (INT8), persistent TMA GEMM", "DeepCache", gpu_models.DRIFT]
    assert rows["Quantize Model (INT8), persistent TMA GEMM"][0] == (
        "not run: the GPU tests of its fused-tma kernel failed in this run")
    int8 = rows["Quantize Model (INT8), NCHW conv"]
    chosen, measured = map(int, int8[4].split("/"))
    assert measured > 0 and float(int8[0]) > 0, int8
    assert ("0 INT8 layers: float's speed, not INT8's" in int8[1]) == (chosen == 0), int8
    assert float(rows[gpu_models.DRIFT][0]) > 0 and rows[gpu_models.DRIFT][5] == "identical"
    typo = tmp_path / "typo.md"
    assert gpu_models.run_models(["sdxl"], typo, dry=True, variant_names=["DeepCache", "Deep Cache"]) == 2
    assert not typo.exists() and "no variant named 'Deep Cache'" in capsys.readouterr().out


def test_the_peers_run_isolated_beside_the_reference_in_the_dry_run_or_say_why_not(pack, tmp_path, monkeypatch):
    """torchao's int8 and fp8 rows and core's TorchCompileModel on plain bf16, each on a model of its own built
    like the reference, in the same run: a row with a speed, or one that says why it could not run (torchao's fp8
    needs compute capability 8.9; there is none on the CPU). torchao's int8 row is traced through AOT autograd
    (`aot_eager`, its tensor subclasses desugared as inductor receives them). torchao sets inductor options for the
    rest of the process: inductor's and dynamo's configuration after the peer rows equals the one before. The shared
    reference model is left as it was."""
    torchao_quantization = pytest.importorskip("torchao.quantization")
    gpu_models = _gpu_models(monkeypatch)
    from comfy_api import torch_helpers

    assert gpu_models.DRY_TORCHAO_COMPILE_BACKEND == "aot_eager"
    backends, inside = [], []
    real_wrapper, real_quantize = torch_helpers.set_torch_compile_wrapper, torchao_quantization.quantize_

    def recording_wrapper(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return real_wrapper(*args, **kwargs)

    def recording_quantize(*args, **kwargs):
        result = real_quantize(*args, **kwargs)
        inside.append(gpu_models.compiler_config_snapshot())
        return result

    monkeypatch.setattr(torch_helpers, "set_torch_compile_wrapper", recording_wrapper)
    monkeypatch.setattr(torchao_quantization, "quantize_", recording_quantize)
    peers = [v.name for v in gpu_models.VARIANTS if v.peer]
    assert peers == ["plain bf16 + core TorchCompileModel", "torchao int8 dynamic + core TorchCompileModel",
                     "torchao fp8 per-row + core TorchCompileModel"]
    before = gpu_models.compiler_config_snapshot()
    out = tmp_path / "flux.md"
    assert gpu_models.run_models(["flux"], out, dry=True, variant_names=peers) == 0
    assert gpu_models.compiler_config_snapshot() == before
    assert inside and inside[0] != before, "torchao changed no setting: the restore would go untested"
    assert backends == ["eager", "aot_eager"], backends  # core's row, torchao's int8 (fp8 fails before compiling)
    rows = _rows(out)
    core_row, int8_row, fp8_row = (rows[name] for name in peers)
    assert float(int8_row[0]) > 0 and float(core_row[0]) > 0, (int8_row, core_row)
    assert fp8_row[0].startswith("failed: AssertionError") and "8.9" in fp8_row[0], fp8_row
    assert core_row[5] == "identical", core_row  # the same weights, compiled: the reference's latent
    assert int8_row[5] not in ("identical", "reference") and float(int8_row[5]) > 20, int8_row
    quantized, linears = int8_row[4].split(" ")[0].split("/")
    assert int(quantized) == int(linears) > 0, int8_row  # every Linear of the diffusion model, none left float
    assert "compile " in int8_row[3] and "warm-up" in int8_row[3], int8_row
    assert float(rows["plain bf16"][0]) > 0


def test_each_family_runs_its_like_for_like_compiled_rows_first(pack, monkeypatch):
    """`--rows compiled`: per family, Compile Model on plain bf16 and with INT8 in the mode where INT8 can win
    (Flux: the default; SDXL: reduce-overhead, where the speed gate times device work, with the reason above the
    table), plain bf16 timed again right after that pair, then core's TorchCompileModel and torchao's int8.
    `--rows rest`: every other variant, none twice. Compile Model with the node's default shapes policy."""
    gpu_models = _gpu_models(monkeypatch)
    for family, mode in (("flux", "default"), ("sdxl", "reduce-overhead")):
        compiled = gpu_models.family_rows(family, "compiled")
        assert [v.name for v in compiled][0] == "plain bf16"
        plain, int8, drift, core, torchao = compiled[1:]
        assert plain.compile and not plain.int8 and int8.compile and int8.int8, family
        assert plain.compile_mode == int8.compile_mode == mode, family
        assert drift.retime and core.peer == gpu_models.CORE_COMPILE and torchao.peer == gpu_models.TORCHAO_INT8
        rest = gpu_models.family_rows(family, "rest")
        assert rest[0].name == "plain bf16"
        assert {v.name for v in rest[1:]}.isdisjoint(v.name for v in compiled)
        assert {v.name for v in rest} | {v.name for v in compiled} == {v.name for v in gpu_models.VARIANTS}
    assert "reduce-overhead" in gpu_models.PAIR_NOTES["sdxl"] and "0 of 794" in gpu_models.PAIR_NOTES["sdxl"]
    assert gpu_models.BENCH_COMPILE_DYNAMIC == "auto"


def test_peer_vram_counts_only_the_tensors_on_the_device(pack, monkeypatch):
    """A resident model's weights count against a row's peak VRAM only where they are on the computing device:
    after an INT8 row the shared model's INT8 layers' floats sit in system memory."""
    gpu_models = _gpu_models(monkeypatch)
    from harness.tiny_models import build_tiny_model

    with torch.inference_mode():
        model = build_tiny_model("sd15", seed=0)
    total = gpu_models._weight_bytes(model, torch.device("cpu"))
    assert total > 0
    assert gpu_models._weight_bytes(model, torch.device("meta")) == 0
    first = next(m for m in model.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear))
    moved = first.weight.numel() * first.weight.element_size()
    first.weight = torch.nn.Parameter(first.weight.detach().to("meta"), requires_grad=False)
    assert gpu_models._weight_bytes(model, torch.device("cpu")) == total - moved
