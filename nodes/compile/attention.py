"""ComfyUI's sub-quadratic (or split, or basic) attention replaced by PyTorch's fused SDPA kernel on the CPU."""

from __future__ import annotations

from collections.abc import Callable

# Below this many query x key tokens ComfyUI's plain attention beats SDPA's setup cost on the CPU.
SDPA_MIN_SCORES = 128 * 128
_OWN_OVERRIDE = "_int8_accel_sdpa"


def _sdpa_attention_override(previous: Callable | None, min_scores: int) -> Callable:
    import comfy.ldm.modules.attention as attention

    # wrap_attn hands the override the undecorated function, so match both forms
    replaceable = set()
    for function in (attention.attention_sub_quad, attention.attention_basic, attention.attention_split):
        replaceable.add(function)
        replaceable.add(getattr(function, "__wrapped__", function))

    def override(func, q, k, v, heads, *args, **kwargs):
        if func in replaceable and q.device.type == "cpu" and q.shape[-2] * k.shape[-2] >= min_scores:
            return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)
        if previous is not None:
            return previous(func, q, k, v, heads, *args, **kwargs)
        return func(q, k, v, heads, *args, **kwargs)

    return override


def install_sdpa_override(model, min_scores: int = SDPA_MIN_SCORES) -> None:
    """Route `model`'s (a clone the caller owns) CPU attention with at least `min_scores` query x key tokens
    through SDPA, chaining any existing override. 0 routes all of it (SDPA traces without a graph break;
    ComfyUI's CPU attention asks the OS for free memory, which breaks a compiled graph)."""
    transformer_options = model.model_options.setdefault("transformer_options", {})
    previous = transformer_options.get("optimized_attention_override")
    if getattr(previous, _OWN_OVERRIDE, None) is not None:
        if getattr(previous, _OWN_OVERRIDE) == min_scores:
            return
        previous = previous.previous  # replace our own override, keep what it chained
    override = _sdpa_attention_override(previous, min_scores)
    setattr(override, _OWN_OVERRIDE, min_scores)
    override.previous = previous
    transformer_options["optimized_attention_override"] = override


def only_own_override(override: Callable | None) -> bool:
    """True when `override` is absent or ours alone (nothing else sees the attention calls' options)."""
    return override is None or (getattr(override, _OWN_OVERRIDE, None) is not None and override.previous is None)
