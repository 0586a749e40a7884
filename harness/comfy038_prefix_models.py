# ruff: noqa: B006, B023, B905 (the forwards are ComfyUI 0.38's as it writes them)
"""Tiny Qwen-Image 2.1 and HiDream-O1 models as ComfyUI 0.38 runs them, built on the real ComfyUI 0.3.75.

ComfyUI 0.3.75 has neither family. Both keep the prompt's keys and values across the steps of a sampling run
and switch that cache off while a block-replace patch is installed; what matters for DeepCache is how their
forwards decide that and call their blocks, so each model's `_forward` here is 0.38's as written (below), with
the blocks computing what 0.38's blocks compute through plain torch ops (0.38 fuses a few of them through
comfy-kitchen kernels, which 0.3.75 lacks) at tiny sizes:

* Qwen-Image 2.1: comfy/ldm/qwen_image21/model.py (Comfy-Org/ComfyUI 08f68f0919d24164469557ca198b8e725c4fd237),
  `QwenImage21Transformer2DModel._forward`, `build_sequence`, `select_prefix_cache`, `reset_prefix_cache` and the
  attention closures; comfy/model_base.py (094c74c1b7f9cd5cdd9015741e8eb26acff1142a) `QwenImage21`'s
  `current_patcher` setter, which turns the cache on for a sampling run without hook patches.
* HiDream-O1: comfy/ldm/hidream_o1/model.py (Comfy-Org/ComfyUI 69460731742a457cb100fff6240fd863f92c57c9)
  `HiDreamO1Transformer._forward` (reference images left out), its decoder layers as
  comfy/text_encoders/llama.py (00a76caca6d379c402a02791695d57c444987644) `TransformerBlock` / `Attention` with
  tuple `past_key_value`, and comfy/ldm/hidream_o1/attention.py's `make_two_pass_attention`.

Stand-ins, each keeping the contract its caller relies on: `comfy.model_prefetch` as 0.38 behaves on a CPU
(no prefetch queue, no allocation graph), `PoseBranchCache` for one store device in the default dtype,
`ensure_pin_budget` always granting and `ModelPatcher.get_free_memory` without comfy-aimdo. `register()` makes the classes importable under their 0.38 module paths
(DeepCache finds a family by its class); `build_qwen_image21()` / `build_hidream_o1()` give ModelPatchers whose
ComfyUI model is 0.3.75's Flux / SD3 model (for the sampling schedule) around the tiny network.
"""

from __future__ import annotations

import contextlib
import sys
import types

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F

QWEN21_MODULE = "comfy.ldm.qwen_image21.model"
HIDREAM_O1_MODULE = "comfy.ldm.hidream_o1.model"
TMS_TOKEN_ID = 151673  # HiDream-O1 <|tms_token|>
VOCAB = TMS_TOKEN_ID + 1


# --- stand-ins for 0.38 helpers 0.3.75 lacks ------------------------------------------------------------
class _ModelPrefetchOnCpu:
    """comfy/model_prefetch.py on a CPU: `make_prefetch_queue` gives no queue there, and with no queue and no
    allocation graph every other call does nothing."""

    @staticmethod
    def make_prefetch_queue(queue, device, transformer_options):
        return None

    @staticmethod
    def prefetch_queue_pop(queue, device, module, dtype=None, core=None, **kwargs):
        if core is not None:
            core()

    @staticmethod
    def malloc_graph_begin(device):
        pass

    @staticmethod
    def malloc_graph_end():
        pass

    @staticmethod
    def pause_malloc_graph():
        return contextlib.nullcontext()


model_prefetch = _ModelPrefetchOnCpu()


def ensure_pin_budget(size, evict_active=True) -> bool:
    return True


def patcher_free_memory(patcher, device) -> int:
    """0.38's `ModelPatcher.get_free_memory` without comfy-aimdo: the device's free memory."""
    import comfy.model_management

    return comfy.model_management.get_free_memory(device)


class PoseBranchCache:
    """comfy/ldm/wan/model_animate2.py's PoseBranchCache as Qwen-Image 2.1 uses it (dtype "default", one store
    device): least recently used slots keyed by the prompt, one stacked K/V tensor per block."""

    def __init__(self, store_device=None, dtype="default"):
        self.store_device = torch.device(store_device) if store_device is not None else torch.device("cpu")
        self.dtype = dtype
        self.slots = []
        self.slot = None

    def select(self, k, create=True):
        for i, s in enumerate(self.slots):
            if s["key"].shape == k.shape and torch.equal(s["key"], k.to(s["key"].device)):
                del self.slots[i]
                self.slots.append(s)
                self.slot = s
                return True
        self.slot = None
        if not create:
            return False
        self.slot = {"key": k.clone().to(self.store_device), "blocks": {}}
        self.slots.append(self.slot)

    def free(self):
        self.slots = []
        self.slot = None

    def filled(self, num_blocks):
        return self.slot is not None and len(self.slot["blocks"]) == num_blocks

    def put(self, i, t):
        self.slot["blocks"][i] = t.to(self.store_device, copy=True)

    def prefetch(self, i, device, dtype):
        pass

    def take(self, i, device, dtype, batch_size):
        import comfy.utils

        return comfy.utils.repeat_to_batch_size(self.slot["blocks"][i].to(device, dtype), batch_size)

    def memory_bytes(self):
        return sum(t.numel() * t.element_size() for s in self.slots for t in s["blocks"].values())


# --- Qwen-Image 2.1 -----------------------------------------------------------------------------------------
class _ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x):
        import comfy.model_management
        import comfy.rmsnorm

        w = comfy.model_management.cast_to(self.weight, dtype=torch.float32, device=x.device) + 1.0
        return comfy.rmsnorm.rms_norm(x.float(), w, self.eps).to(x.dtype)


class _TextProjection(nn.Module):
    def __init__(self, in_dim, hidden_size, eps=1e-6, dtype=None, device=None, operations=None):
        super().__init__()
        self.text_norm = _ZeroCenteredRMSNorm(in_dim, eps=eps, dtype=dtype, device=device)
        self.in_layer = operations.Linear(in_dim, hidden_size, bias=False, dtype=dtype, device=device)
        self.out_layer = operations.Linear(hidden_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class _TimestepProjEmbeddings(nn.Module):
    def __init__(self, embedding_dim, dtype=None, device=None, operations=None):
        from comfy.ldm.lightricks.model import TimestepEmbedding

        super().__init__()
        self.timestep_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=embedding_dim,
                                                   sample_proj_bias=False, dtype=dtype, device=device,
                                                   operations=operations)

    def forward(self, timestep, dtype):
        from comfy.ldm.flux.layers import timestep_embedding

        return self.timestep_embedder(timestep_embedding(timestep.float(), 256).to(dtype))


class _SwiGLUFeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dtype=None, device=None, operations=None):
        super().__init__()
        self.proj = operations.Linear(dim, hidden_dim, bias=False, dtype=dtype, device=device)
        self.gate_layer = operations.Linear(dim, hidden_dim, bias=False, dtype=dtype, device=device)
        self.out = operations.Linear(hidden_dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.out(F.silu(self.gate_layer(x)) * self.proj(x))


class _QwenImage21Attention(nn.Module):
    def __init__(self, dim, heads, dim_head, eps=1e-6, dtype=None, device=None, operations=None):
        super().__init__()
        self.heads = heads
        inner_dim = heads * dim_head
        self.to_q = operations.Linear(dim, inner_dim, bias=False, dtype=dtype, device=device)
        self.to_k = operations.Linear(dim, inner_dim, bias=False, dtype=dtype, device=device)
        self.to_v = operations.Linear(dim, inner_dim, bias=False, dtype=dtype, device=device)
        self.to_out = nn.ModuleList([operations.Linear(inner_dim, dim, bias=False, dtype=dtype, device=device)])
        self.norm_q = operations.RMSNorm(dim_head, eps=eps, dtype=dtype, device=device)
        self.norm_k = operations.RMSNorm(dim_head, eps=eps, dtype=dtype, device=device)

    def forward(self, x, pe, attn_fn, prefix_len, transformer_options={}):
        from comfy.ldm.flux.math import apply_rope1

        B, N, _ = x.shape
        q = self.to_q(x).view(B, N, self.heads, -1)
        k = self.to_k(x).view(B, N, self.heads, -1)
        v = self.to_v(x).view(B, N, self.heads, -1)
        q, k = self.norm_q(q), self.norm_k(k)
        q = apply_rope1(q, pe)
        k = apply_rope1(k, pe)
        return self.to_out[0](attn_fn(q, k, v, self.heads))


def _split_rows(p):
    return p[-1:].unsqueeze(1), p[:-1].unsqueeze(1)


def _modulated_norm(norm, x, scale, prefix_len, zero):
    s_prefix, s_target = scale
    out = norm(x)
    return torch.cat([out[:, :prefix_len] * (1 + s_prefix), out[:, prefix_len:] * (1 + s_target)], dim=1)


def _gated_residual(x, y, gate, prefix_len):
    g_prefix, g_target = gate
    x[:, prefix_len:].addcmul_(y[:, prefix_len:], g_target)
    if prefix_len:
        x[:, :prefix_len].addcmul_(y[:, :prefix_len], g_prefix)
    return x


class QwenImage21TransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, mlp_ratio=3, eps=1e-6, dtype=None,
                 device=None, operations=None):
        super().__init__()
        self.img_norm1 = operations.LayerNorm(dim, elementwise_affine=False, eps=eps, dtype=dtype, device=device)
        self.attn = _QwenImage21Attention(dim, num_attention_heads, attention_head_dim, eps=eps, dtype=dtype,
                                          device=device, operations=operations)
        self.img_norm2 = operations.LayerNorm(dim, elementwise_affine=False, eps=eps, dtype=dtype, device=device)
        self.img_mlp = _SwiGLUFeedForward(dim, dim * mlp_ratio, dtype=dtype, device=device, operations=operations)

    def forward(self, x, mod, pe, attn_fn, prefix_len, transformer_options={}):
        scale1, gate1, scale2, gate2, zero = mod
        x = _gated_residual(x, self.attn(_modulated_norm(self.img_norm1, x, scale1, prefix_len, zero), pe, attn_fn,
                                         prefix_len, transformer_options), gate1, prefix_len)
        x = _gated_residual(x, self.img_mlp(_modulated_norm(self.img_norm2, x, scale2, prefix_len, zero)), gate2,
                            prefix_len)
        return x


class _LastLayer(nn.Module):
    def __init__(self, dim, eps=1e-6, dtype=None, device=None, operations=None):
        super().__init__()
        self.linear = operations.Linear(dim, dim, bias=False, dtype=dtype, device=device)
        self.norm = operations.LayerNorm(dim, eps, elementwise_affine=False, dtype=dtype, device=device)

    def forward(self, x, temb):
        scale = self.linear(F.silu(temb)).unsqueeze(1)
        return self.norm(x) * (1 + scale)


def block_causal_attention(segments, transformer_options={}, cache=None, block_index=0, prefix_len=0):
    from comfy.ldm.modules.attention import optimized_attention

    def attn(q, k, v, heads, preferred_attention=None):
        if cache is not None:
            cache.put(block_index, torch.stack([k[:, :prefix_len], v[:, :prefix_len]], dim=1))
        outs = [optimized_attention(q[:, start:end].flatten(2), k[:, :end].flatten(2), v[:, :end].flatten(2), heads,
                                    mask=mask, transformer_options=transformer_options)
                for start, end, mask in segments]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return attn


def prefix_cached_attention(prefix_k, prefix_v, transformer_options={}):
    from comfy.ldm.modules.attention import optimized_attention

    def attn(q, k, v, heads, preferred_attention=None):
        return optimized_attention(q.flatten(2), torch.cat([prefix_k, k], dim=1).flatten(2),
                                   torch.cat([prefix_v, v], dim=1).flatten(2), heads,
                                   transformer_options=transformer_options)
    return attn


def prefix_cache_key(x, context, refs, slots):
    header = [context.shape[1], len(refs)] + list(x.shape[-2:]) + list(slots) + [s for r in refs for s in r.shape[-2:]]
    header = torch.tensor(header, dtype=torch.float32, device=context.device).expand(context.shape[0], -1)
    return torch.cat([header, context.float().flatten(1)] + [r.float().flatten(1) for r in refs], dim=1)


class QwenImage21Transformer2DModel(nn.Module):
    def __init__(self, in_channels=16, out_channels=16, num_layers=6, attention_head_dim=16, num_attention_heads=2,
                 context_in_dim=64, mlp_ratio=3, axes_dims_rope=(4, 6, 6), eps=1e-6, dtype=None, device=None,
                 operations=None):
        from comfy.ldm.flux.layers import EmbedND

        super().__init__()
        self.dtype = dtype
        self.out_channels = out_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        self.pe_embedder = EmbedND(dim=attention_head_dim, theta=10000, axes_dim=list(axes_dims_rope))
        self.time_text_embed = _TimestepProjEmbeddings(self.inner_dim, dtype=dtype, device=device,
                                                       operations=operations)
        self.txt_in = _TextProjection(context_in_dim, self.inner_dim, eps=eps, dtype=dtype, device=device,
                                      operations=operations)
        self.img_in = operations.Linear(in_channels, self.inner_dim, bias=False, dtype=dtype, device=device)
        self.modulation = nn.Sequential(nn.SiLU(), operations.Linear(self.inner_dim, 4 * self.inner_dim, bias=False,
                                                                     dtype=dtype, device=device))
        self.transformer_blocks = nn.ModuleList([
            QwenImage21TransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim, mlp_ratio=mlp_ratio,
                                        eps=eps, dtype=dtype, device=device, operations=operations)
            for _ in range(num_layers)
        ])
        self.norm_out = _LastLayer(self.inner_dim, eps=eps, dtype=dtype, device=device, operations=operations)
        self.proj_out = operations.Linear(self.inner_dim, out_channels, bias=False, dtype=dtype, device=device)
        self.prefix_cache = None
        self.prefix_cache_enabled = False

    def reset_prefix_cache(self, enabled):
        if self.prefix_cache is not None:
            self.prefix_cache.free()
        self.prefix_cache = None
        self.prefix_cache_enabled = enabled

    def select_prefix_cache(self, key, cache_bytes, device, options):
        if options.get("device") == "off":
            return None, False
        cache = self.prefix_cache
        if cache is not None and cache.select(key, create=False):
            return cache, cache.filled(len(self.transformer_blocks))
        dtype = options.get("dtype", "default")
        cache_bytes //= {"int8": 2, "int4": 4}.get(dtype, 1)
        if cache is None:
            store = options.get("device", "auto")
            if store == "auto":
                if patcher_free_memory(self.current_patcher, device) > 4 * cache_bytes:
                    store = device
                elif ensure_pin_budget(cache_bytes, evict_active=False):
                    store = torch.device("cpu")
                else:
                    return None, False
            else:
                store = device if store == "gpu" else torch.device("cpu")
            cache = self.prefix_cache = PoseBranchCache(store_device=store, dtype=dtype)
        if not (patcher_free_memory(self.current_patcher, device) > 2 * cache_bytes if cache.store_device == device
                else ensure_pin_budget(cache_bytes, evict_active=False)):
            return None, False
        cache.select(key)
        return cache, False

    def build_sequence(self, x, context, ref_latents, image_slots):
        txt = self.txt_in(context)
        slots = (image_slots + [txt.shape[1]] * len(ref_latents))[:len(ref_latents)]
        bounds = [0] + slots + [txt.shape[1]]

        parts, ids, segments = [], [], []
        pos, length = 0, 0
        for (start, end), img in zip(zip(bounds[:-1], bounds[1:]), ref_latents + [x]):
            n = end - start
            if n > 0:
                parts.append(txt[:, start:end])
                ids.append(torch.arange(pos, pos + n, device=x.device, dtype=torch.float32).unsqueeze(1).expand(n, 3))
                segments.append((length, length + n, torch.ones((n, length + n), dtype=torch.bool,
                                                                device=x.device).tril(length)))
                pos += n
                length += n
            h, w = img.shape[-2:]
            parts.append(self.img_in(img.flatten(2).transpose(1, 2)))
            hh = torch.arange(h, device=x.device, dtype=torch.float32) - (h - h // 2) + 0.5 * (h % 2 - x.shape[-2] % 2)
            ww = torch.arange(w, device=x.device, dtype=torch.float32) - (w - w // 2) + 0.5 * (w % 2 - x.shape[-1] % 2)
            ids.append(torch.stack([torch.full((h, w), pos, device=x.device, dtype=torch.float32),
                                    hh[:, None].expand(h, w), ww[None, :].expand(h, w)], dim=-1).flatten(0, 1))
            segments.append((length, length + h * w, None))
            pos += max(h, w)
            length += h * w

        pe = self.pe_embedder(torch.cat(ids, dim=0).unsqueeze(0)).transpose(1, 2).contiguous()
        return torch.cat(parts, dim=1), pe, segments

    def forward(self, x, timestep, context, ref_latents=None, image_slots=None, transformer_options={}, **kwargs):
        import comfy.patcher_extension

        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward,
            self,
            comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                     transformer_options)
        ).execute(x, timestep, context, ref_latents, image_slots, transformer_options, **kwargs)

    def _forward(self, x, timesteps, context, ref_latents=None, image_slots=None, transformer_options={}, **kwargs):
        B, C, H, W = x.shape
        dtype = x.dtype
        ref_latents = list(ref_latents or [])
        image_slots = list(image_slots or [])

        hidden_states, pe, segments = self.build_sequence(x, context, ref_latents, image_slots)
        prefix_len = hidden_states.shape[1] - H * W
        patches = transformer_options.get("patches", {})
        for p in patches.get("post_input", []):
            out = p({"img": hidden_states, "pe": pe, "transformer_options": transformer_options})
            hidden_states, pe = out["img"], out.get("pe", pe)

        t = ((timesteps * 1000).to(dtype) / 1000).to(dtype)
        temb = self.time_text_embed(torch.cat([t, t.new_zeros(1)]), dtype)
        scale1, gate1, scale2, gate2 = self.modulation(temb).chunk(4, dim=-1)
        mod = (_split_rows(scale1), _split_rows(gate1.tanh()), _split_rows(scale2), _split_rows(gate2.tanh()),
               torch.zeros_like(scale1[:1, None]))

        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        cache, cached = None, False
        hooked = (blocks_replace or patches.get("post_input") or patches.get("single_block")
                  or patches.get("attn1_patch"))
        if self.prefix_cache_enabled and prefix_len > 0 and not hooked:
            key = prefix_cache_key(x, context, ref_latents, image_slots)
            cache_bytes = 2 * len(self.transformer_blocks) * B * prefix_len * self.inner_dim * hidden_states.element_size()
            cache, cached = self.select_prefix_cache(key, cache_bytes, x.device,
                                                     transformer_options.get("qwen_image21_cache", {}))
        if cached:
            hidden_states, pe, prefix_len = hidden_states[:, prefix_len:], pe[:, prefix_len:], 0
        elif cache is not None:
            prefix_states, hidden_states = hidden_states[:, :prefix_len], hidden_states[:, prefix_len:]
            prefix_pe, pe = pe[:, :prefix_len], pe[:, prefix_len:]
            prefix_len = 0

        transformer_options["total_blocks"] = len(self.transformer_blocks)
        transformer_options["block_type"] = "single"
        prefetch_queue = model_prefetch.make_prefetch_queue(list(self.transformer_blocks), x.device,
                                                            transformer_options)
        model_prefetch.malloc_graph_begin(x.device)
        for i, block in enumerate(self.transformer_blocks):
            model_prefetch.prefetch_queue_pop(prefetch_queue, x.device, block, dtype, malloc_scope="block")
            transformer_options["block_index"] = i
            if cache is not None:
                if not cached:
                    with model_prefetch.pause_malloc_graph():
                        prefix_attn = block_causal_attention(segments[:-1], transformer_options, cache, i,
                                                             prefix_states.shape[1])
                        prefix_states = block(prefix_states, mod, prefix_pe, prefix_attn, prefix_states.shape[1],
                                              transformer_options)
                prefix_k, prefix_v = cache.take(i, x.device, dtype, B).unbind(1)
                if cached:
                    cache.prefetch(i + 1, x.device, dtype)
                attn_fn = prefix_cached_attention(prefix_k, prefix_v, transformer_options)
            else:
                attn_fn = block_causal_attention(segments, transformer_options, cache, i, prefix_len)
            if ("single_block", i) in blocks_replace:
                def block_wrap(args):
                    return {"img": block(args["img"], mod, args["pe"], attn_fn, prefix_len, args["transformer_options"])}
                args = {"img": hidden_states, "vec": temb, "pe": pe, "mod": mod, "attn_fn": attn_fn,
                        "prefix_len": prefix_len, "transformer_options": transformer_options}
                hidden_states = blocks_replace[("single_block", i)](args, {"original_block": block_wrap})["img"]
            else:
                hidden_states = block(hidden_states, mod, pe, attn_fn, prefix_len, transformer_options)
            for p in patches.get("single_block", []):
                hidden_states = p({"img": hidden_states, "x": x, "block_index": i,
                                   "transformer_options": transformer_options})["img"]

        model_prefetch.prefetch_queue_pop(prefetch_queue, x.device, None, malloc_scope="block")
        model_prefetch.malloc_graph_end()
        hidden_states = self.norm_out(hidden_states[:, prefix_len:], temb[:-1])
        hidden_states = self.proj_out(hidden_states)
        return hidden_states.transpose(1, 2).reshape(B, self.out_channels, H, W)


# --- HiDream-O1 --------------------------------------------------------------------------------------------
def make_two_pass_attention(ar_len: int, transformer_options=None, preferred_attention=None):
    from comfy.ldm.modules.attention import optimized_attention

    def two_pass_attention(q, k, v, heads, **kwargs):
        B, H, T, D = q.shape
        if T < k.shape[2]:
            out = optimized_attention(q, k, v, heads, mask=None, skip_reshape=True, skip_output_reshape=True,
                                      transformer_options=transformer_options)
        elif ar_len >= T:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        elif ar_len <= 0:
            out = optimized_attention(q, k, v, heads, mask=None, skip_reshape=True, skip_output_reshape=True,
                                      transformer_options=transformer_options)
        else:
            out_ar = F.scaled_dot_product_attention(q[:, :, :ar_len], k[:, :, :ar_len], v[:, :, :ar_len],
                                                    attn_mask=None, dropout_p=0.0, is_causal=True)
            out_gen = optimized_attention(q[:, :, ar_len:], k, v, heads, mask=None, skip_reshape=True,
                                          skip_output_reshape=True, transformer_options=transformer_options)
            out = torch.cat([out_ar, out_gen], dim=2)
        return out.transpose(1, 2).reshape(B, T, H * D)

    return two_pass_attention


class _DecoderAttention(nn.Module):
    def __init__(self, hidden_size, heads, head_dim, device=None, dtype=None, ops=None):
        from comfy.text_encoders.llama import RMSNorm

        super().__init__()
        self.num_heads = self.num_kv_heads = heads
        self.head_dim = head_dim
        self.q_proj = ops.Linear(hidden_size, heads * head_dim, bias=False, device=device, dtype=dtype)
        self.k_proj = ops.Linear(hidden_size, heads * head_dim, bias=False, device=device, dtype=dtype)
        self.v_proj = ops.Linear(hidden_size, heads * head_dim, bias=False, device=device, dtype=dtype)
        self.o_proj = ops.Linear(heads * head_dim, hidden_size, bias=False, device=device, dtype=dtype)
        self.q_norm = RMSNorm(head_dim, eps=1e-6, device=device, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, eps=1e-6, device=device, dtype=dtype)
        self.comfy_attention = None

    def forward(self, hidden_states, attention_mask=None, freqs_cis=None, optimized_attention=None,
                past_key_value=None):
        from comfy.text_encoders.llama import apply_rope

        batch_size, seq_length, _ = hidden_states.shape
        xq = self.q_proj(hidden_states).view(batch_size, seq_length, self.num_heads, self.head_dim).transpose(1, 2)
        xk = self.k_proj(hidden_states).view(batch_size, seq_length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        xv = self.v_proj(hidden_states).view(batch_size, seq_length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rope(xq, xk, freqs_cis=freqs_cis)

        present_key_value = None
        if past_key_value is not None:
            index = 0
            num_tokens = xk.shape[2]
            if len(past_key_value) > 0:
                past_key, past_value, index = past_key_value
                if past_key.shape[2] >= (index + num_tokens):
                    past_key[:, :, index:index + xk.shape[2]] = xk
                    past_value[:, :, index:index + xv.shape[2]] = xv
                    xk = past_key[:, :, :index + xk.shape[2]]
                    xv = past_value[:, :, :index + xv.shape[2]]
                    present_key_value = (past_key, past_value, index + num_tokens)
                else:
                    xk = torch.cat((past_key[:, :, :index], xk), dim=2)
                    xv = torch.cat((past_value[:, :, :index], xv), dim=2)
                    present_key_value = (xk, xv, index + num_tokens)
            else:
                present_key_value = (xk, xv, index + num_tokens)

        output = optimized_attention(xq, xk, xv, self.num_heads, mask=attention_mask, skip_reshape=True)
        return self.o_proj(output), present_key_value


class _DecoderLayer(nn.Module):
    def __init__(self, hidden_size, heads, head_dim, intermediate_size, device=None, dtype=None, ops=None):
        from comfy.text_encoders.llama import MLP, RMSNorm

        super().__init__()
        self.self_attn = _DecoderAttention(hidden_size, heads, head_dim, device=device, dtype=dtype, ops=ops)
        config = types.SimpleNamespace(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                       mlp_activation="silu")
        self.mlp = MLP(config, device=device, dtype=dtype, ops=ops)
        self.input_layernorm = RMSNorm(hidden_size, eps=1e-6, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=1e-6, device=device, dtype=dtype)

    def forward(self, x, attention_mask=None, freqs_cis=None, optimized_attention=None, past_key_value=None):
        output = x
        residual = x
        x = self.input_layernorm(x)
        x, present_key_value = self.self_attn(hidden_states=x, attention_mask=attention_mask, freqs_cis=freqs_cis,
                                              optimized_attention=optimized_attention,
                                              past_key_value=past_key_value)
        x = residual + x
        residual = x
        x = self.post_attention_layernorm(x)
        x = self.mlp(x)
        x = torch.add(residual, x, out=output)
        return x, present_key_value


class _LanguageModel(nn.Module):
    def __init__(self, hidden_size, heads, head_dim, layers, device=None, dtype=None, ops=None):
        from comfy.text_encoders.llama import RMSNorm

        super().__init__()
        self.head_dim = head_dim
        self.embed_tokens = ops.Embedding(VOCAB, hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList([_DecoderLayer(hidden_size, heads, head_dim, 3 * hidden_size, device=device,
                                                   dtype=dtype, ops=ops) for _ in range(layers)])
        self.norm = RMSNorm(hidden_size, eps=1e-6, device=device, dtype=dtype)

    def compute_freqs_cis(self, position_ids, device):
        from comfy.text_encoders.llama import precompute_freqs_cis

        return precompute_freqs_cis(self.head_dim, position_ids[:1], 5000000.0, device=device)


class HiDreamO1Transformer(nn.Module):
    def __init__(self, in_channels=16, patch_size=2, hidden_size=64, heads=2, layers=6, dtype=None, device=None,
                 operations=None):
        from comfy.ldm.modules.diffusionmodules.mmdit import TimestepEmbedder

        super().__init__()
        self.dtype = dtype
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.tms_token_id = TMS_TOKEN_ID
        self.language_model = _LanguageModel(hidden_size, heads, hidden_size // heads, layers, device=device,
                                             dtype=dtype, ops=operations)
        self.t_embedder1 = TimestepEmbedder(hidden_size, device=device, dtype=dtype, operations=operations)
        patch = patch_size * patch_size * in_channels
        self.x_embedder = nn.Sequential(operations.Linear(patch, hidden_size // 4, bias=False, device=device, dtype=dtype),
                                        operations.Linear(hidden_size // 4, hidden_size, device=device, dtype=dtype))
        self.final_layer2 = operations.Linear(hidden_size, patch, device=device, dtype=dtype)
        self._kv_cache_entries = []

    def clear_kv_cache(self):
        self._kv_cache_entries = []

    def forward(self, x, timesteps, context=None, transformer_options={}, **kwargs):
        import comfy.patcher_extension

        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward,
            self,
            comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                     transformer_options)
        ).execute(x, timesteps, context, transformer_options, **kwargs)

    def _forward(self, x, timesteps, context=None, transformer_options={}, input_ids=None, attention_mask=None,
                 position_ids=None, vinput_mask=None, ar_len=None, **kwargs):
        if input_ids is None or position_ids is None:
            raise ValueError("HiDreamO1Transformer requires input_ids and position_ids in conditioning")
        B, _, H, W = x.shape
        h_p, w_p = H // self.patch_size, W // self.patch_size
        tgt_image_len = h_p * w_p
        z = einops.rearrange(x, 'B C (H p1) (W p2) -> B (H W) (C p1 p2)', p1=self.patch_size, p2=self.patch_size)
        vinputs = z
        inputs_embeds = self.language_model.embed_tokens(input_ids).to(x.dtype)

        sigma = timesteps.float() / 1000.0
        t_pixeldit = 1.0 - sigma
        t_emb = self.t_embedder1(t_pixeldit * 1000, inputs_embeds.dtype)
        tms_mask_3d = (input_ids == self.tms_token_id).unsqueeze(-1).expand_as(inputs_embeds)
        inputs_embeds = torch.where(tms_mask_3d, t_emb.unsqueeze(1).expand_as(inputs_embeds), inputs_embeds)

        vinputs_embedded = self.x_embedder(vinputs.to(inputs_embeds.dtype))
        inputs_embeds = torch.cat([inputs_embeds, vinputs_embedded], dim=1)

        freqs_cis = self.language_model.compute_freqs_cis(position_ids[0].to(x.device), x.device)
        freqs_cis = tuple(t.to(x.dtype) for t in freqs_cis)

        patches_replace = transformer_options.get("patches_replace", {})
        blocks_replace = patches_replace.get("dit", {})
        transformer_options["total_blocks"] = len(self.language_model.layers)
        transformer_options["block_type"] = "double"

        can_cache = not blocks_replace and ar_len > 0
        cache_len = ar_len if can_cache else 0
        ref_id = None
        pos_ids_key = position_ids[..., :cache_len] if can_cache else position_ids
        cache_entries = self._kv_cache_entries
        if cache_entries and cache_entries[0]["input_ids"].device != input_ids.device:
            cache_entries = []
            self._kv_cache_entries = []
        kv_cache = None
        if can_cache:
            for entry in cache_entries:
                ck = entry["input_ids"]
                ep = entry["position_ids"]
                if (entry["cache_len"] == cache_len
                        and ck.shape == input_ids.shape and torch.equal(ck, input_ids)
                        and entry["ref_id"] == ref_id
                        and ep.shape == pos_ids_key.shape and torch.equal(ep, pos_ids_key)):
                    kv_cache = entry
                    break

        if kv_cache is not None:
            hidden_states = inputs_embeds[:, cache_len:]
            sliced_freqs = tuple(t[..., cache_len:, :] for t in freqs_cis)
            for i, layer in enumerate(self.language_model.layers):
                two_pass_attn = make_two_pass_attention(ar_len, transformer_options=transformer_options,
                                                        preferred_attention=layer.self_attn.comfy_attention)
                transformer_options["block_index"] = i
                K_i, V_i = kv_cache["kv"][i]
                hidden_states, _ = layer(
                    x=hidden_states, attention_mask=None, freqs_cis=sliced_freqs, optimized_attention=two_pass_attn,
                    past_key_value=(K_i, V_i, cache_len),
                )
        else:
            snapshots = [] if can_cache else None
            past_kv_cold = () if can_cache else None
            hidden_states = inputs_embeds
            for i, layer in enumerate(self.language_model.layers):
                two_pass_attn = make_two_pass_attention(ar_len, transformer_options=transformer_options,
                                                        preferred_attention=layer.self_attn.comfy_attention)
                transformer_options["block_index"] = i
                if ("double_block", i) in blocks_replace:
                    def block_wrap(args, _layer=layer):
                        out = {}
                        out["x"], _ = _layer(
                            x=args["x"], attention_mask=args.get("attention_mask"),
                            freqs_cis=args["freqs_cis"], optimized_attention=args["optimized_attention"],
                            past_key_value=None,
                        )
                        return out
                    out = blocks_replace[("double_block", i)](
                        {"x": hidden_states, "attention_mask": None,
                         "freqs_cis": freqs_cis, "optimized_attention": two_pass_attn,
                         "transformer_options": transformer_options},
                        {"original_block": block_wrap},
                    )
                    hidden_states = out["x"]
                else:
                    hidden_states, present_kv = layer(
                        x=hidden_states, attention_mask=None,
                        freqs_cis=freqs_cis, optimized_attention=two_pass_attn,
                        past_key_value=past_kv_cold,
                    )
                    if snapshots is not None:
                        K, V, _ = present_kv
                        snapshots.append((K[:, :, :cache_len].contiguous(),
                                          V[:, :, :cache_len].contiguous()))
            if snapshots is not None:
                new_entry = {
                    "input_ids": input_ids.clone(),
                    "cache_len": cache_len,
                    "kv": snapshots,
                    "ref_id": ref_id,
                    "position_ids": pos_ids_key.clone(),
                }
                self._kv_cache_entries = (cache_entries + [new_entry])[-2:]

        if self.language_model.norm is not None:
            hidden_states = self.language_model.norm(hidden_states)

        sliced_offset = cache_len if kv_cache is not None else 0
        if vinput_mask is not None:
            vmask = vinput_mask.to(x.device).bool()
            if sliced_offset > 0:
                vmask = vmask[:, sliced_offset:]
            target_hidden = hidden_states[vmask].view(B, -1, hidden_states.shape[-1])[:, :tgt_image_len]
        else:
            txt_seq_len = input_ids.shape[1]
            start = txt_seq_len - sliced_offset
            target_hidden = hidden_states[:, start:start + tgt_image_len]
        x_pred_tgt = self.final_layer2(target_hidden)

        x_pred_img = einops.rearrange(
            x_pred_tgt, 'B (H W) (C p1 p2) -> B C (H p1) (W p2)',
            H=h_p, W=w_p, p1=self.patch_size, p2=self.patch_size,
        )
        return (x.float() - x_pred_img.float()) / sigma.view(B, 1, 1, 1).clamp_min(1e-3)


# --- making them reachable ----------------------------------------------------------------------------------
def register(monkeypatch=None) -> None:
    """Make both classes importable under their ComfyUI 0.38 module paths (through `monkeypatch` in a test)."""
    modules = {}
    for path, cls in ((QWEN21_MODULE, QwenImage21Transformer2DModel), (HIDREAM_O1_MODULE, HiDreamO1Transformer)):
        package, _, _ = path.rpartition(".")
        module = types.ModuleType(path)
        setattr(module, cls.__name__, cls)
        modules[package] = types.ModuleType(package)
        modules[path] = module
    for name, module in modules.items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, module)
        else:
            sys.modules[name] = module


def _patcher_around(kind: str, net: nn.Module, seed: int, model_class: type):
    from harness.tiny_models import _fill_weights, build_tiny_model

    patcher = build_tiny_model(kind, seed=seed)
    base = patcher.model
    base.diffusion_model = net
    _fill_weights(base, seed, std=0.05)
    base.__class__ = type(model_class.__name__, (model_class, type(base)), {})
    return patcher


class _QwenImage21Base:
    """comfy/model_base.py's QwenImage21 (0.38): the prompt cache lives for one sampling run without hooks."""

    @property
    def current_patcher(self):
        return self.__dict__.get("_current_patcher")

    @current_patcher.setter
    def current_patcher(self, patcher):
        self.__dict__["_current_patcher"] = patcher
        diffusion_model = getattr(self, "diffusion_model", None)
        if diffusion_model is not None:
            diffusion_model.current_patcher = patcher
            diffusion_model.reset_prefix_cache(patcher is not None and len(patcher.hook_patches) == 0)


class _HiDreamO1Base:
    """What comfy/ldm/hidream_o1/conditioning.py gives the model from a prompt: its token ids (the prompt, then
    the timestep token), the prompt's length as the autoregressive prefix, and positions over text and image."""

    def extra_conds(self, **kwargs):
        import comfy.conds

        out = super().extra_conds(**kwargs)
        cross_attn = kwargs.get("cross_attn")
        noise = kwargs.get("noise")
        if cross_attn is None or noise is None:
            return out
        patch = self.diffusion_model.patch_size
        tokens = cross_attn.shape[1]
        prompt = (cross_attn[:1, :, 0].float() * 1e4).abs().long() % (VOCAB - 2) + 1
        input_ids = torch.cat([prompt, torch.full((1, 1), TMS_TOKEN_ID)], dim=1)
        length = tokens + 1 + (noise.shape[-2] // patch) * (noise.shape[-1] // patch)
        out["input_ids"] = comfy.conds.CONDRegular(input_ids)
        out["position_ids"] = comfy.conds.CONDRegular(torch.arange(length).expand(1, 3, length).clone())
        out["ar_len"] = comfy.conds.CONDConstant(tokens)
        return out


def cold_prompt_cache(model) -> None:
    """Empty the model's prompt cache before a sampling run: HiDream-O1 keeps its entries across runs
    (Qwen-Image 2.1 empties its own when a run starts)."""
    net = model.get_model_object("diffusion_model")
    if hasattr(net, "clear_kv_cache"):
        net.clear_kv_cache()


def build_qwen_image21(seed: int = 0, layers: int = 6, **dims):
    """A ModelPatcher around a tiny Qwen-Image 2.1 network (latents and prompts as `harness.tiny_models`'s
    "flux", image latents with a flow schedule as Qwen-Image 2.1's): one token per latent pixel. `dims`:
    `num_attention_heads`, `attention_head_dim`."""
    return _patcher_around("flux", QwenImage21Transformer2DModel(num_layers=layers, context_in_dim=4096,
                                                                 operations=_operations(), **dims),
                           seed, _QwenImage21Base)


def build_hidream_o1(seed: int = 0, layers: int = 6, **dims):
    """A ModelPatcher around a tiny HiDream-O1 network (latents and prompts as `harness.tiny_models`'s "sd3",
    whose flow schedule scales timesteps by 1000 as HiDream-O1's does). `dims`: `hidden_size`, `heads`."""
    return _patcher_around("sd3", HiDreamO1Transformer(layers=layers, operations=_operations(), **dims), seed,
                           _HiDreamO1Base)


def _operations():
    import comfy.ops

    return comfy.ops.disable_weight_init
