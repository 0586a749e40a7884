"""Function-preserving activation outliers: a variant of a model whose chosen activation channels are `factor`
times larger while its output stays the same (up to float rounding).

Real checkpoints' INT8 difficulty comes from a few activation channels far larger than the rest; small models
trained for minutes do not grow them. A channel can be scaled without changing the function wherever what
produces it is linear in it and what consumes it is linear: the producer's rows (weight and bias) are
multiplied by the factor and the consumer's input columns divided by it. The places used here:

* attention values: the value projection's output channel (attention mixes values linearly, per head; where
  text and image tokens share one attention, as in Flux's double blocks, both streams' values alike) and the
  attention output projection's matching input column (`to_v` -> `to_out.0` in the UNet, the `v` third of
  Flux's `qkv` / single blocks' `linear1` -> `proj` / `linear2`, Wan's `v` -> `o`);
* normalisation outputs (UNet only): a LayerNorm's / GroupNorm's per-channel scale and shift, and the
  consumers' input columns (`norm1` -> `attn1.to_q/k/v`, `norm2` -> `attn2.to_q`, `norm3` -> `ff.net.0.proj`,
  and the spatial transformer's GroupNorm -> its 1x1 `proj_in` convolution: outliers in a conv's input).

Never across a nonlinearity (GELU, SiLU): scaling there would change the function.
"""

from __future__ import annotations

import torch


def _channels(width: int, count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(width, generator=gen)[:count]


def _scale_rows(layer, rows: torch.Tensor, factor: float) -> None:
    layer.weight[rows] *= factor
    if getattr(layer, "bias", None) is not None:
        layer.bias[rows] *= factor


def _scale_norm(norm, channels: torch.Tensor, factor: float) -> None:
    norm.weight[channels] *= factor
    if norm.bias is not None:
        norm.bias[channels] *= factor


def _divide_columns(layer, columns: torch.Tensor, factor: float) -> None:
    layer.weight[:, columns] /= factor


def add_outliers(diffusion_model: torch.nn.Module, kind: str, factor: float, count: int = 2,
                 seed: int = 0) -> list[str]:
    """Scale `count` channels by `factor` at every place listed in the module docstring, in place; returns the
    consuming layers (their names in the diffusion model) whose inputs now carry the outliers."""
    gen = torch.Generator().manual_seed(seed)
    consumers: list[str] = []
    names = {module: name for name, module in diffusion_model.named_modules()}
    with torch.no_grad():
        if kind == "sd15":
            for module in diffusion_model.modules():
                if hasattr(module, "attn1") and hasattr(module, "norm1"):  # BasicTransformerBlock
                    for attn in (module.attn1, module.attn2):
                        ch = _channels(attn.to_v.weight.shape[0], count, gen)
                        _scale_rows(attn.to_v, ch, factor)
                        _divide_columns(attn.to_out[0], ch, factor)
                        consumers.append(names[attn.to_out[0]])
                    for norm, layers in ((module.norm1, (module.attn1.to_q, module.attn1.to_k, module.attn1.to_v)),
                                         (module.norm2, (module.attn2.to_q,)),
                                         (module.norm3, (module.ff.net[0].proj,))):
                        ch = _channels(norm.weight.shape[0], count, gen)
                        _scale_norm(norm, ch, factor)
                        for layer in layers:
                            _divide_columns(layer, ch, factor)
                            consumers.append(names[layer])
                if hasattr(module, "proj_in") and hasattr(module, "norm") and hasattr(module, "transformer_blocks"):
                    ch = _channels(module.norm.weight.shape[0], count, gen)
                    _scale_norm(module.norm, ch, factor)
                    _divide_columns(module.proj_in, ch, factor)
                    consumers.append(names[module.proj_in])
        elif kind == "flux":
            hidden = diffusion_model.hidden_size
            for block in diffusion_model.double_blocks:
                # one attention over the text and image tokens together: the same value channels in both streams
                ch = _channels(hidden, count, gen)
                for attn in (block.img_attn, block.txt_attn):
                    _scale_rows(attn.qkv, 2 * hidden + ch, factor)
                    _divide_columns(attn.proj, ch, factor)
                    consumers.append(names[attn.proj])
            for block in diffusion_model.single_blocks:
                ch = _channels(hidden, count, gen)
                _scale_rows(block.linear1, 2 * hidden + ch, factor)
                _divide_columns(block.linear2, ch, factor)
                consumers.append(names[block.linear2])
        elif kind == "wan21":
            for block in diffusion_model.blocks:
                for attn in (block.self_attn, block.cross_attn):
                    ch = _channels(attn.v.weight.shape[0], count, gen)
                    _scale_rows(attn.v, ch, factor)
                    _divide_columns(attn.o, ch, factor)
                    consumers.append(names[attn.o])
        else:
            raise ValueError(kind)
    return consumers


def input_outlier_ratios(model, layer_names: list[str], run) -> dict[str, tuple[float, float]]:
    """Per named layer, over one call of `run()` (e.g. a sampling run): (max|x| / rms(x) of its input, the largest
    channel's max|x| over the median channel's). Channels: the last dimension of a Linear's input, the second of
    a convolution's."""
    net = model.get_model_object("diffusion_model")
    modules = dict(net.named_modules())
    stats: dict[str, list] = {name: [0.0, 0.0, 0, None] for name in layer_names}

    def hook(name):
        def record(module, args):
            x = args[0].detach().float()
            s = stats[name]
            s[0] = max(s[0], float(x.abs().max()))
            s[1] += float(x.pow(2).mean())
            s[2] += 1
            channels = x.movedim(1, -1) if isinstance(module, torch.nn.Conv2d) else x
            peak = channels.abs().reshape(-1, channels.shape[-1]).amax(0)
            s[3] = peak if s[3] is None else torch.maximum(s[3], peak)
        return record

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in layer_names]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: (s[0] / (s[1] / s[2]) ** 0.5, float(s[3].max() / s[3].median().clamp_min(1e-12)))
            for name, s in stats.items() if s[2]}
