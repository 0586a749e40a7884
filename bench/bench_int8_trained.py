"""INT8 judged on the models trained here (harness/trained_models.py), with and without function-preserving
activation outliers (harness/outliers.py): the per-layer error gate's measurements, the whole-model error, and
the PSNR of the sampled pictures of INT8, INT8 + DeepCache and DeepCache alone against the float model.

    .venv/bin/python bench/bench_int8_trained.py [--kinds sd15,flux,wan21] [--factor 100] [--batch 4]
                                                 [--steps 20] [--out PATH]

The layers are far below the CPU kernels' size floors and the speed gate would keep them all in float on this
CPU, so the floors are set to 0 and the speed gate off: what is measured is accuracy, which does not depend on
the layer sizes the way speed does. Writes bench/results/int8_trained.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
for _floor in ("INT8_ACCEL_LINEAR_MIN_MACS", "INT8_ACCEL_CONV_MIN_MACS", "INT8_ACCEL_MIN_REDUCTION"):
    os.environ.setdefault(_floor, "0")
os.environ.setdefault("INT8_ACCEL_SPEED_GATE", "0")
os.environ.setdefault("INT8_ACCEL_CACHE_DIR", tempfile.mkdtemp(prefix="int8-trained-"))

from bench.common import cpu_line, psnr  # noqa: E402


def pictures(latent: torch.Tensor) -> torch.Tensor:
    return ((latent.float() + 1) / 2).clamp(0, 1)


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    q = torch.tensor(values, dtype=torch.float64).quantile(torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64))
    return " / ".join(f"{v:.3g}" for v in q.tolist())


def judge(kind: str, factor: float | None, args, int8, deepcache, tm, outliers) -> list[str]:
    model = tm.build_trained_model(kind)
    ratios = ""
    if factor is not None:
        consumers_before = outliers.add_outliers(
            tm.build_trained_model(kind).get_model_object("diffusion_model"), kind, 1.0)
        before = outliers.input_outlier_ratios(
            model, consumers_before, lambda: tm.sample(model, kind, steps=4, batch=1))
        consumers = outliers.add_outliers(model.get_model_object("diffusion_model"), kind, factor)
        after = outliers.input_outlier_ratios(model, consumers, lambda: tm.sample(model, kind, steps=4, batch=1))
        ratios = (f"inputs of the {len(consumers)} layers given outliers: largest channel's max|x| over the median "
                  f"channel's, median over the layers {statistics.median(b[1] for b in before.values()):.1f} -> "
                  f"{statistics.median(a[1] for a in after.values()):.0f} (largest "
                  f"{max(b[1] for b in before.values()):.1f} -> {max(a[1] for a in after.values()):.0f}); max/rms "
                  f"of the whole input {statistics.median(b[0] for b in before.values()):.1f} -> "
                  f"{statistics.median(a[0] for a in after.values()):.1f}")

    def run(patcher):
        return tm.sample(patcher, kind, steps=args.steps, batch=args.batch, seed=7)

    plain = run(model)
    rows = []
    plans = {"INT8 node defaults (error gate 0.1)": int8.QuantizeSettings(compute_density_threshold=0),
             "INT8 error gate 0.01": int8.QuantizeSettings(conv_mse_threshold=0.01, linear_mse_threshold=0.01,
                                                           compute_density_threshold=0),
             "INT8 error gate 1.0 (any layer error)": int8.QuantizeSettings(conv_mse_threshold=1.0,
                                                                        linear_mse_threshold=1.0,
                                                                        compute_density_threshold=0)}
    for name, settings in plans.items():
        quantized = int8.apply_int8(model, settings)[0]
        out = run(quantized)
        result = int8.int8_plan(quantized).last_result
        errors = {kind_: [layer.error for layer in result.layers if layer.kind == kind_ and layer.error is not None]
                  for kind_ in ("linear", "conv")}
        chosen = len(result.chosen)
        failed = [layer.name for layer in result.layers if layer.decision.startswith("float: error")]
        cached = run(deepcache.apply_deepcache(quantized, 3, 1, mode=args.mode))
        rows.append(
            f"| {name} | {chosen} of {len(result.layers)} ({result.int8_flop_fraction:.0%} of MACs) | "
            f"{quantiles(errors['linear'])} | {quantiles(errors['conv'])} | {len(failed)} / "
            f"{result.model_guard.get('layers', 0)} | "
            f"{result.model_error if result.model_error is None else f'{result.model_error:.4f}'} | "
            f"{psnr(pictures(out), pictures(plain), peak=1.0):.2f} dB | "
            f"{psnr(pictures(cached), pictures(plain), peak=1.0):.2f} dB |")
    alone = run(deepcache.apply_deepcache(model, 3, 1, mode=args.mode))
    label = "as trained" if factor is None else f"with outliers x{factor:g}"
    header = [f"### {tm.FAMILY_NAMES[kind]} ({kind}), {label}", ""]
    if ratios:
        header += [ratios + ".", ""]
    header += [f"DeepCache alone ({args.mode}, interval 3): {psnr(pictures(alone), pictures(plain), peak=1.0):.2f} "
               "dB.", "",
               "| plan | layers in INT8 | linear layer error (median / p90 / max) | conv layer error (median / p90 "
               "/ max) | layers kept float by the error gate / the whole-model guard | whole-model error | PSNR INT8 | "
               "PSNR INT8 + "
               f"DeepCache {args.mode} 3 |",
               "|---|---|---|---|---|---|---|---|", *rows, ""]
    print("\n".join(header), flush=True)
    return header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="sd15,flux,wan21")
    parser.add_argument("--factor", type=float, default=100.0, help="outlier channel scale")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default="forecast", help="DeepCache mode of the INT8 + DeepCache column")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "int8_trained.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from harness.comfy_host import import_comfy, load_pack

    import_comfy()
    load_pack()
    from harness import outliers
    from harness import trained_models as tm

    int8 = importlib.import_module("comfyui_int8_accel.nodes.int8")
    deepcache = importlib.import_module("comfyui_int8_accel.nodes.deepcache")
    lines = ["# INT8 on the trained models, with and without function-preserving outliers", "",
             f"CPU: {cpu_line()}.", "",
             "Trained weights (harness/weights/, `python -m harness.train`), pixel space 32x32, "
             f"{args.steps} euler steps, cfg 1, batch {args.batch}; PSNR of the pictures against the float model's "
             "(peak 1). Kernel size floors 0 and speed gate off (the layers are tiny: accuracy is what is judged). "
             "Layer error: the calibration's relative error of each layer's output in INT8 (the error gate keeps a "
             f"layer float above 0.1). Outliers: harness/outliers.py, {2} channels per place scaled by the factor "
             "(function-preserving: attention values and, in the UNet, normalisation outputs).", "",
             f"Command: `.venv/bin/python bench/bench_int8_trained.py {' '.join(sys.argv[1:])}`", ""]
    for kind in args.kinds.split(","):
        for factor in (None, args.factor):
            lines += judge(kind, factor, args, int8, deepcache, tm, outliers)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
