"""On the CPU, ComfyUI's sub-quadratic attention replaced by PyTorch's fused SDPA kernel for large inputs."""

from __future__ import annotations

from collections.abc import Callable

# Below this many query x key tokens ComfyUI's plain attention beats SDPA's setup cost on the CPU.
SDPA_MIN_SCORES = 128 * 128


def _sdpa_attention_override(previous: Callable | None) -> Callable:
    import comfy.ldm.modules.attention as attention

    # wrap_attn hands the override the undecorated function, so match both forms
    replaceable = set()
    for function in (attention.attention_sub_quad, attention.attention_basic, attention.attention_split):
        replaceable.add(function)
        replaceable.add(getattr(function, "__wrapped__", function))

    def override(func, q, k, v, heads, *args, **kwargs):
        if func in replaceable and q.device.type == "cpu" and q.shape[-2] * k.shape[-2] >= SDPA_MIN_SCORES:
            return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)
        if previous is not None:
            return previous(func, q, k, v, heads, *args, **kwargs)
        return func(q, k, v, heads, *args, **kwargs)

    return override


def install_sdpa_override(model) -> None:
    """Route `model`'s (a clone the caller owns) CPU attention through SDPA, chaining any existing override."""
    transformer_options = model.model_options.setdefault("transformer_options", {})
    previous = transformer_options.get("optimized_attention_override")
    if getattr(previous, "_int8_accel_sdpa", False):
        return
    override = _sdpa_attention_override(previous)
    override._int8_accel_sdpa = True
    transformer_options["optimized_attention_override"] = override
