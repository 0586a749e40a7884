"""Train the harness's small diffusion models (see harness/trained_models.py) and write harness/weights/.

    .venv/bin/python -m harness.train [--kind sd15|flux|wan21|all] [--steps N] [--out DIR]

Deterministic for a seed on one thread (torch.set_num_threads(1); the same torch build gives the same weights);
each model takes roughly ten CPU minutes. Data: the webp pictures ComfyUI's `comfyui_workflow_templates_media_*`
packages ship (installed with ComfyUI's requirements), downscaled to short sides 40/56/80 and cropped at random
to 32x32 with horizontal flips, RGB scaled to [-1, 1].
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import re
import sys
import textwrap
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from harness import trained_models as tm  # noqa: E402

# per family: optimiser steps (the default), learning rate
RECIPES = {
    "sd15": {"steps": 493, "lr": 1e-3},
    "flux": {"steps": 437, "lr": 1e-3},
    "wan21": {"steps": 428, "lr": 1e-3},
}
BATCH = 16
EMA = 0.995
WARMUP = 50
WEIGHT_DECAY = 0.01
SCALES = (40, 56, 80)
LOSS_EVERY = 25


def template_images() -> list[Path]:
    """The webp pictures of every installed comfyui_workflow_templates_media_* package, sorted."""
    import site

    roots = [Path(p) for p in site.getsitepackages()]
    files = []
    for root in roots:
        for pkg in sorted(root.glob("comfyui_workflow_templates_media_*")):
            if pkg.is_dir() and not pkg.name.endswith(".dist-info"):
                files += pkg.rglob("*.webp")
    return sorted(set(files))


def load_dataset() -> list[torch.Tensor]:
    """Every template picture at each of SCALES (short side), as uint8 [3, H, W] tensors."""
    from PIL import Image

    out = []
    for path in template_images():
        with Image.open(path) as im:
            im = im.convert("RGB")
            for short in SCALES:
                w, h = im.size
                f = short / min(w, h)
                small = im.resize((max(short, round(w * f)), max(short, round(h * f))), Image.BICUBIC)
                out.append(torch.frombuffer(bytearray(small.tobytes()), dtype=torch.uint8)
                           .view(small.size[1], small.size[0], 3).permute(2, 0, 1).clone())
    if not out:
        raise RuntimeError("no comfyui_workflow_templates_media_* pictures found")
    return out


def batch_of(images: list[torch.Tensor], gen: torch.Generator, size: int = tm.IMAGE_SIZE) -> torch.Tensor:
    crops = []
    for _ in range(BATCH):
        img = images[int(torch.randint(len(images), (1,), generator=gen))]
        _, h, w = img.shape
        y = int(torch.randint(h - size + 1, (1,), generator=gen))
        x = int(torch.randint(w - size + 1, (1,), generator=gen))
        crop = img[:, y:y + size, x:x + size]
        if bool(torch.rand((), generator=gen) < 0.5):
            crop = crop.flip(-1)
        crops.append(crop)
    return torch.stack(crops).float() / 127.5 - 1


def out_of_place(cls) -> object:
    """`cls.forward` with every `name += expr` statement rewritten as `name = name + (expr)`: ComfyUI's Flux
    blocks add their residuals in place, which autograd refuses (the tensor is saved for the backward pass);
    inference keeps ComfyUI's own forward."""
    source = textwrap.dedent(inspect.getsource(cls.forward))
    source = re.sub(r"^(\s*)(\w+) \+= (.+)$", r"\1\2 = \2 + (\3)", source, flags=re.M)
    module = sys.modules[cls.__module__]
    namespace: dict = {}
    exec(compile(source, f"<out-of-place {cls.__name__}.forward>", "exec"), module.__dict__, namespace)
    return namespace["forward"]


@contextlib.contextmanager
def trainable_forwards(kind: str):
    if kind != "flux":
        yield
        return
    import comfy.ldm.flux.layers as layers

    classes = (layers.DoubleStreamBlock, layers.SingleStreamBlock)
    saved = [cls.forward for cls in classes]
    try:
        for cls in classes:
            cls.forward = out_of_place(cls)
        yield
    finally:
        for cls, forward in zip(classes, saved, strict=True):
            cls.forward = forward


ZERO_INIT = {  # output projections of residual branches, and the model's output: start as identity / zero
    "sd15": (r"out_layers\.3\.", r"proj_out\.", r"^out\.2\."),
    "flux": (r"_mod\.lin\.", r"modulation\.lin\.", r"final_layer\.linear\.", r"adaLN_modulation\.1\."),
    "wan21": (r"self_attn\.o\.", r"cross_attn\.o\.", r"ffn\.2\.", r"head\.head\."),
}


def init_weights(net: torch.nn.Module, kind: str, seed: int) -> None:
    """PyTorch's default initialisation (ComfyUI's ops skip it), norms 1 / biases 0, residual outputs 0."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in net.modules():
            for base in (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding):
                if isinstance(module, base):
                    base.reset_parameters(module)
                    break
        for name, param in net.named_parameters():
            if param.ndim == 1 or name.endswith(("norm.weight", "scale")):
                if param.ndim == 1:
                    param.fill_(1.0 if name.rsplit(".", 1)[-1] in ("weight", "scale") else 0.0)
            elif name.endswith("modulation") and kind == "wan21":
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
        for name, param in net.named_parameters():
            if any(re.search(p, name) for p in ZERO_INIT[kind]):
                param.zero_()


def train(kind: str, steps: int | None = None, seed: int = 0, out_dir: Path | None = None,
          log=print, max_minutes: float | None = None) -> Path:
    """Train `kind` for `steps` optimiser steps (default: its recipe) and write its weights file.

    `max_minutes` stops earlier, after the step that passes it: the file records the steps run, and training
    with that many `steps` gives the same weights (every step draws the same random numbers either way)."""
    from harness.comfy_host import import_comfy

    import_comfy()
    torch.set_num_threads(1)
    recipe = dict(RECIPES[kind])
    steps = steps or recipe["steps"]
    images = load_dataset()
    base = tm.build_base_model(kind)
    net = base.diffusion_model
    init_weights(net, kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    context = torch.nn.Parameter(torch.randn(1, tm.CONTEXT_TOKENS, tm.CONTEXT_DIM, generator=gen))
    pooled = torch.nn.Parameter(torch.randn(1, tm.POOLED_DIM[kind], generator=gen)) if kind in tm.POOLED_DIM \
        else None
    params = [*net.parameters(), context] + ([pooled] if pooled is not None else [])
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=recipe["lr"], weight_decay=WEIGHT_DECAY)
    sampling = base.model_sampling
    n_params = sum(p.numel() for p in net.parameters())
    log(f"[{kind}] {n_params / 1e6:.2f} M parameters, {len(images)} training pictures, {steps} steps", flush=True)

    curve, window = [], []
    start = time.perf_counter()
    net.train()
    with trainable_forwards(kind):
        for step in range(1, steps + 1):
            x0 = batch_of(images, gen)
            noise = torch.randn(x0.shape, generator=gen)
            ctx = context.expand(BATCH, -1, -1)
            if kind == "sd15":  # v-prediction on SD's discrete schedule
                t = torch.randint(0, 1000, (BATCH,), generator=gen)
                ac = 1 / (1 + sampling.sigmas[t].float().view(-1, 1, 1, 1) ** 2)  # alphas_cumprod
                x_in = ac.sqrt() * x0 + (1 - ac).sqrt() * noise
                pred = net(x_in, t.float(), context=ctx)
                target = ac.sqrt() * noise - (1 - ac).sqrt() * x0
            else:  # rectified flow, logit-normal sigma: x = (1 - s) x0 + s n, velocity n - x0
                sigma = torch.sigmoid(torch.randn(BATCH, generator=gen))
                s = sigma.view(-1, 1, 1, 1)
                x_in = (1 - s) * x0 + s * noise
                timestep = sampling.timestep(sigma)
                if kind == "flux":
                    pred = net(x_in, timestep, ctx, y=pooled.expand(BATCH, -1))
                else:
                    pred = net(x_in.unsqueeze(2), timestep, ctx)[:, :, 0]
                target = noise - x0
            loss = torch.nn.functional.mse_loss(pred, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in opt.param_groups:
                group["lr"] = recipe["lr"] * min(1.0, step / WARMUP)
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema, params, strict=True):
                    e.lerp_(p.detach(), 1 - EMA)
            window.append(loss.item())
            if step % LOSS_EVERY == 0 or step == steps:
                curve.append([step, round(sum(window) / len(window), 5)])
                window = []
                log(f"[{kind}] step {step}/{steps} loss {curve[-1][1]:.4f} "
                    f"({time.perf_counter() - start:.0f} s)", flush=True)
            if max_minutes is not None and time.perf_counter() - start > 60 * max_minutes:
                if curve[-1][0] != step:
                    curve.append([step, round(sum(window) / len(window), 5)])
                log(f"[{kind}] stopped after {step} steps ({max_minutes} minutes)", flush=True)
                steps = step
                break
    seconds = time.perf_counter() - start

    names = [f"{n}" for n, _ in net.named_parameters()]
    tensors = {n: e.half().contiguous() for n, e in zip(names, ema, strict=False)}
    tensors["conditioning.context"] = ema[len(names)].half().contiguous()
    if pooled is not None:
        tensors["conditioning.pooled"] = ema[len(names) + 1].half().contiguous()
    config = {
        "kind": kind, "comfy_config_class": tm.CONFIG_CLASSES[kind], "unet_config": tm.UNET_CONFIGS[kind],
        "shift": tm.SHIFTS.get(kind), "parameters": n_params, "image_size": tm.IMAGE_SIZE, "pixel_space": True,
        "objective": "v-prediction, SD discrete schedule" if kind == "sd15" else
        "rectified flow (velocity), logit-normal sigma",
        "steps": steps, "batch": BATCH, "optimizer": "AdamW", "lr": recipe["lr"], "warmup": WARMUP,
        "weight_decay": WEIGHT_DECAY, "grad_clip": 1.0, "ema": EMA, "seed": seed, "threads": 1,
        "data": f"{len(images) // len(SCALES)} webp pictures of comfyui_workflow_templates_media_* at short sides "
                f"{list(SCALES)}, random 32x32 crops, horizontal flips, RGB in [-1, 1]",
        "torch": torch.__version__, "train_seconds": round(seconds, 1), "weights": "EMA, stored fp16",
    }
    metadata = {"config": json.dumps(config), "loss_curve": json.dumps(curve), "final_loss": f"{curve[-1][1]}",
                "made_by": "python -m harness.train"}
    out_dir = out_dir or tm.WEIGHTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{kind}.safetensors"
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    log(f"[{kind}] wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {seconds:.0f} s, final loss {curve[-1][1]}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=(*tm.KINDS, "all"), default="all")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps (default: the family's recipe)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop after the step that passes this many minutes (the file records the steps run)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default harness/weights)")
    args = parser.parse_args()
    for kind in (tm.KINDS if args.kind == "all" else (args.kind,)):
        train(kind, args.steps, args.seed, args.out, max_minutes=args.max_minutes)


if __name__ == "__main__":
    main()
