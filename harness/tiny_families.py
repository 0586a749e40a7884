"""Tiny random-weight models of the diffusion families DeepCache has no block rules for, plus made-up ones.

Each ComfyUI family is built the way a loader builds it: its own `comfy.supported_models` config class with a
shrunk `unet_config`, `cfg.get_model(...)`, random weights (harness.tiny_models.build_random_model), wrapped in a
ModelPatcher. The made-up families ("made_up...") are diffusion models no ComfyUI family uses, with blocks under
unusual names and called in unusual ways (each a pattern met in a ComfyUI model, written anew here), for testing
how block discovery copes.

How each family's forward reaches its main block stack (`FamilySpec.block_stack`):

- auraflow: `single_layers` (after 2 `double_layers`); honours patches_replace["dit"] with ("single_block", i)
  (args img/vec/transformer_options) and ("double_block", i) (img/txt/vec); no long skips.
- pixart: `blocks`; plain iteration, no patches_replace; no long skips.
- hunyuan_dit: `blocks`; honours ("double_block", i) (args img/txt/vec/pe/skip); long skips from the first half
  of the blocks into the second half.
- mochi: `blocks`; honours ("double_block", i) (img/txt/vec/rope_cos/rope_sin/num_tokens); no long skips.
- cosmos1: `blocks` (an nn.ModuleDict "block0".."blockN"); plain iteration over `.items()`, the extra position
  embedding added to the hidden state in place before every block; no long skips.
- omnigen2: `layers` (after the context/noise refiners); plain iteration; no long skips.
- ace_step: `transformer_blocks`; plain iteration, every argument by keyword; no long skips.
- stable_audio: `transformer.layers`; honours ("double_block", i) (img/txt/vec/pe); no long skips.
- hunyuan3d: `single_blocks` (after 2 `double_blocks`); honours ("single_block", i) and ("double_block", i)
  (img/txt/vec/pe/attn_mask); no long skips.
- hunyuan3d21: `blocks`; honours ("block", i) with args x/t/cond/skip, and the replacement returns the tensor
  itself (not a dict); long skips like HunyuanDiT's.
- made_up: `stages` (nn.ModuleList); plain iteration, `stage(cond_vec, tokens, scale=..., context=...)` returns
  `(tokens, aux)` and `aux` is dropped; no long skips.
- made_up_side_channel: `cells` (nn.ModuleDict); plain iteration, `cell(tokens, vec)` returns tokens, but each
  cell also reads the tensor the previous cell left in a dict the cells share, so skipping one changes the result.
- made_up_side_stack: `stages` (narrow, on 1024 image tokens: most of the compute, a few percent of the weights)
  beside `style_encoder`, a stack of wide blocks on 2 style tokens taken from the prompt (most of the weights, a
  few percent of the compute) whose pooled output conditions every stage, as a lyric or prompt encoder inside a
  diffusion model does (ACE-Step's lyric encoder).
- made_up_methods: `stages`; the forward never calls a stage as a module but a method of its class,
  `stage.denoise(cond_vec, tokens, scale=..., context=...)`, once per stage and step (ComfyUI 0.38.1's SenseNova
  U1.5 calls `layer.forward_generation(...)`).
- made_up_two_lanes: `layers`; each layer is entered twice per call through two methods: `layer.prompt_pass(prompt,
  vec)` returns the prompt rows and their keys and values, which `layer.image_pass(image, vec, keys, values)`
  attends to on the image rows (SenseNova U1.5's forward_prefix / forward_generation, Wan Animate 2's forward_pose
  / forward_gen beside it).
- made_up_prompt_cache: `layers`; each layer called as a module twice on a sampling run's first call, `layer(prompt,
  vec)` on the prompt rows, then `layer(image, vec, keys, values)` on the image rows; the prompt's keys and values
  are kept on the model for the run, so later calls run the image rows only (ComfyUI 0.38.1's Qwen-Image 2.1
  and its prompt cache).
- made_up_twice: `stages`; the forward runs the whole stack twice per call on the same rows (a recurrent pass):
  the two calls of a block cannot be told apart, so discovery must refuse it.
- made_up_packed: `rows`; the samples' image tokens packed one after another into one [samples x tokens, width]
  tensor with no batch dimension, each block `block(rows, vec, spans)` adding its residuals into `rows` in place
  and returning it (ComfyUI 0.38.1's MiniMax H3 packs text, audio and video rows so and accumulates in place).
- made_up_sparse: `sparse_blocks`; the stream between blocks is no tensor but a `SparseRows` object (integer
  coordinates: sample and position of each row, and the rows' features `feats`, packed without a batch dimension);
  each block `block(rows, vec)` returns a new SparseRows with new feats and the same coordinates (the pattern of
  ComfyUI 0.38.1's TRELLIS.2 sparse stages and their SparseTensor).
- made_up_fused: `stages` after `fusion_blocks`, a ModuleList of FusedPair containers the forward never calls: it
  calls each container's children itself, interleaving a video stream (the image tokens) and an audio stream (from
  the prompt), `video += fused.audio_to_video(video, audio)`, `audio += fused.video_to_audio(audio, video before)`,
  then `fused.video_block(...)` and `fused.audio_block(...)`; then the stages on the video stream alone (the
  pattern of ComfyUI 0.38.1's Prism and its fusion blocks before the remaining video blocks).

None of them honours transformer_options.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from harness.tiny_models import build_random_model


class FamilySpec(NamedTuple):
    """A tiny family: ComfyUI config class name (or a made-up one), its unet_config and what sampling needs."""

    config_class: str
    unet_config: dict[str, Any]
    latent_shape: tuple[int, ...]  # without the batch dimension
    context_dim: int  # width of the text (or image-embedding) conditioning
    tokens: int  # conditioning length
    block_stack: str  # dotted path of the main block container on the diffusion model
    cfg: float = 3.0  # default CFG scale for sample_family
    entry: str = ""  # the method of a block the forward enters the main stack's blocks by ("": a module call)
    counted: str = ""  # "image rows": only the module calls on the image rows count as the stack's block calls


def _made_up_variant(variant: str, block_stack: str, latent_shape: tuple[int, ...] = (4, 8, 8),
                     **spec: str) -> FamilySpec:
    """A variant of the made-up model at its standard size (6 blocks 64 wide, 2 heads, patch 2)."""
    config = {"image_model": "made_up", "variant": variant, "in_channels": 4, "hidden_size": 64, "depth": 6,
              "num_heads": 2, "context_dim": 64, "patch_size": 2}
    return FamilySpec("MadeUp", config, latent_shape, 64, 8, block_stack, **spec)


NEW_FAMILIES: dict[str, FamilySpec] = {
    # MMDiT: 2 double (joint) blocks then 6 single blocks; max_seq must be a square (8x8 patches = 16x16 latent)
    "auraflow": FamilySpec("AuraFlow", {
        "in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 64, "n_layers": 8, "n_double_layers": 2,
        "n_heads": 2, "global_conddim": 64, "cond_seq_dim": 64, "max_seq": 64},
        (4, 16, 16), 64, 8, "single_layers"),
    # PixArt Sigma (no micro-conditioning). Its forward takes the position embedding's base size and
    # interpolation from round(((H + W) // 2) / 64), H and W in latent pixels: (H + W) // 2 must be at least 33
    # (at 32 Python rounds 0.5 to 0 and the embedding raises ZeroDivisionError), hence the 8x64 latent.
    "pixart": FamilySpec("PixArtSigma", {
        "image_model": "pixart_sigma", "input_size": 32, "patch_size": 2, "in_channels": 4, "hidden_size": 64,
        "depth": 6, "num_heads": 2, "caption_channels": 64, "model_max_length": 8, "micro_condition": False},
        (4, 8, 64), 64, 8, "blocks"),
    # depth must be even for the long skips to balance (ComfyUI's skip stack pops depth - 1 - depth // 2 times
    # and pushes depth // 2 - 1 times); text_len / text_len_t5 must equal the prompts' lengths
    "hunyuan_dit": FamilySpec("HunyuanDiT", {
        "image_model": "hydit", "input_size": 32, "patch_size": 2, "in_channels": 4, "hidden_size": 64, "depth": 6,
        "num_heads": 2, "text_states_dim": 64, "text_states_dim_t5": 64, "text_len": 8, "text_len_t5": 8},
        (4, 16, 16), 64, 8, "blocks"),
    # every block asserts int(hidden_size_x * mlp_ratio_x) == 1536 * 8 = 12288, so its visual FFN is 8192 wide
    # (2/3 of it) whatever the width: width 16 with ratio 768 and 2 heads of 8 (widths down to 2 run too)
    "mochi": FamilySpec("GenmoMochi", {
        "image_model": "mochi_preview", "depth": 6, "patch_size": 2, "num_heads": 2, "hidden_size_x": 16,
        "hidden_size_y": 16, "mlp_ratio_x": 768.0, "mlp_ratio_y": 4.0, "learn_sigma": False, "in_channels": 12,
        "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
        "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
        "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 64, "t5_token_length": 8, "rope_theta": 10000.0},
        (12, 2, 8, 8), 64, 8, "blocks"),
    # Cosmos 1 (GeneralDIT): its forward needs the learnable extra position embedding and THWBD blocks
    "cosmos1": FamilySpec("CosmosT2V", {
        "image_model": "cosmos", "max_img_h": 32, "max_img_w": 32, "max_frames": 8, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "block_config": "FA-CA-MLP",
        "concat_padding_mask": True, "pos_emb_cls": "rope3d", "pos_emb_learnable": False,
        "pos_emb_interpolation": "crop", "block_x_format": "THWBD", "affline_emb_norm": True, "use_adaln_lora": True,
        "adaln_lora_dim": 32, "num_blocks": 6, "num_heads": 2, "crossattn_emb_channels": 64,
        "extra_per_block_abs_pos_emb": True, "extra_per_block_abs_pos_emb_type": "learnable",
        "rope_h_extrapolation_ratio": 1.0, "rope_w_extrapolation_ratio": 1.0, "rope_t_extrapolation_ratio": 2.0},
        (16, 2, 8, 8), 64, 8, "blocks"),
    "omnigen2": FamilySpec("Omnigen2", {
        "image_model": "omnigen2", "axes_dim_rope": [8, 12, 12], "axes_lens": [1024, 1664, 1664],
        "ffn_dim_multiplier": None, "hidden_size": 64, "in_channels": 16, "multiple_of": 16, "norm_eps": 1e-5,
        "num_attention_heads": 2, "num_kv_heads": 1, "num_layers": 6, "num_refiner_layers": 1, "out_channels": None,
        "patch_size": 2, "text_feat_dim": 64, "timestep_scale": 1000.0},
        (16, 8, 8), 64, 8, "layers"),
    # the lyric encoder (a 6-block conformer) is fixed at 1024 wide and lyric_proj reads it as lyric_hidden_size,
    # so that stays 1024; a 16-token lyric vocabulary keeps its embedding small. speaker_embedding_dim is 512
    # because ComfyUI always feeds 512 zeros.
    # the lyric encoder is fixed at 1024 wide (84 M parameters): the transformer is made wide enough (384) to hold
    # a tenth of the weights, as the real model's holds most of them, so it counts as a block stack
    "ace_step": FamilySpec("ACEStep", {
        "audio_model": "ace", "attention_head_dim": 64, "in_channels": 8, "max_height": 16, "max_position": 32768,
        "max_width": 32768, "mlp_ratio": 2.5, "num_attention_heads": 6, "num_layers": 6, "out_channels": 8,
        "patch_size": [16, 1], "rope_theta": 1000000.0, "speaker_embedding_dim": 512, "text_embedding_dim": 64,
        "ssl_encoder_depths": [1, 1], "ssl_latent_dims": [64, 64], "ssl_names": ["mert", "m-hubert"],
        "lyric_encoder_vocab_size": 16, "lyric_hidden_size": 1024},
        (8, 16, 16), 64, 8, "transformer_blocks"),
    # the seconds embedders are 768 wide: text tokens 768 wide, global conditioning 2 x 768
    "stable_audio": FamilySpec("StableAudio", {
        "audio_model": "dit1.0", "io_channels": 64, "embed_dim": 64, "depth": 6, "num_heads": 2,
        "cond_token_dim": 768, "global_cond_dim": 1536, "project_cond_tokens": False},
        (64, 32), 768, 8, "transformer.layers"),
    "hunyuan3d": FamilySpec("Hunyuan3Dv2", {
        "image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0,
        "num_heads": 2, "depth": 2, "depth_single_blocks": 6, "qkv_bias": True, "guidance_embed": True},
        (64, 32), 64, 8, "single_blocks"),
    # depth must be odd for the long skips to balance; its forward swaps the two halves of the batch, so it
    # needs cond and uncond in one call (CFG > 1)
    "hunyuan3d21": FamilySpec("Hunyuan3Dv2_1", {
        "image_model": "hunyuan3d2_1", "in_channels": 64, "context_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0,
        "num_heads": 2, "depth": 7, "qkv_bias": False, "guidance_cond_proj_dim": None, "num_moe_layers": 2,
        "num_experts": 2, "moe_top_k": 1},
        (64, 32), 64, 8, "blocks"),
    "made_up": FamilySpec("MadeUp", {
        "image_model": "made_up", "in_channels": 4, "hidden_size": 64, "depth": 6, "num_heads": 2,
        "context_dim": 64, "patch_size": 2, "side_channel": False},
        (4, 8, 8), 64, 8, "stages"),
    "made_up_side_channel": FamilySpec("MadeUp", {
        "image_model": "made_up", "in_channels": 4, "hidden_size": 64, "depth": 6, "num_heads": 2,
        "context_dim": 64, "patch_size": 2, "side_channel": True},
        (4, 8, 8), 64, 8, "cells"),
    # the last stage also takes the second stage's output (a long skip from a block a cached step skips)
    "made_up_long_skip": FamilySpec("MadeUp", {
        "image_model": "made_up", "in_channels": 4, "hidden_size": 64, "depth": 6, "num_heads": 2,
        "context_dim": 64, "patch_size": 2, "side_channel": False, "long_skip": True},
        (4, 8, 8), 64, 8, "stages"),
    # patch 1 on 16x32: 512 image tokens through 6 stages 64 wide; 12 style blocks 192 wide on 2 tokens
    "made_up_side_stack": FamilySpec("MadeUp", {
        "image_model": "made_up", "variant": "side_stack", "in_channels": 4, "hidden_size": 64, "depth": 6,
        "num_heads": 2, "context_dim": 64, "patch_size": 1, "style_width": 192, "style_depth": 12,
        "style_tokens": 2},
        (4, 16, 32), 64, 8, "stages"),
    "made_up_methods": _made_up_variant("methods", "stages", entry="denoise"),
    "made_up_two_lanes": _made_up_variant("two_lanes", "layers", entry="image_pass"),
    # 64 image rows through each layer per call; the 8 prompt rows once per sampling run, by the same module
    "made_up_prompt_cache": _made_up_variant("prompt_cache", "layers", latent_shape=(4, 16, 16),
                                             counted="image rows"),
    "made_up_twice": _made_up_variant("twice", "stages"),
    "made_up_packed": _made_up_variant("packed", "rows"),
    "made_up_sparse": _made_up_variant("sparse", "sparse_blocks"),
    "made_up_fused": _made_up_variant("fused", "stages"),
}


# ---------------------------------------------------------------------------------------------------------------
# The made-up diffusion model (plain torch; ComfyUI hands it its `operations`)


def _timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = q.shape
    q, k, v = (t.reshape(b, t.shape[1], heads, d // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, n, d)


def _add_gated_attention_mlp(block: nn.Module, dim: int, modulation_chunks: int, ops: dict, operations) -> None:
    """The layers of a gated self-attention + MLP block, registered on `block` in one order (its seeded weights
    depend on it): modulation, norm, qkv, projection, norm, MLP."""
    block.mod = operations.Linear(dim, modulation_chunks * dim, **ops)
    block.norm1 = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
    block.qkv = operations.Linear(dim, 3 * dim, **ops)
    block.proj = operations.Linear(dim, dim, **ops)
    block.norm2 = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
    block.mlp_in = operations.Linear(dim, 4 * dim, **ops)
    block.mlp_out = operations.Linear(4 * dim, dim, **ops)


class MadeUpStage(nn.Module):
    """Self-attention, cross-attention and MLP; `forward(cond_vec, tokens, scale=..., context=...)` returns
    `(tokens, aux)` where `aux` (a per-sample energy) is a by-product the next stage does not take."""

    def __init__(self, dim: int, heads: int, context_dim: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        self.mod = operations.Linear(dim, 4 * dim, **ops)
        self.norm1 = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
        self.qkv = operations.Linear(dim, 3 * dim, **ops)
        self.proj = operations.Linear(dim, dim, **ops)
        self.norm2 = operations.LayerNorm(dim, eps=1e-6, **ops)
        self.q_ctx = operations.Linear(dim, dim, **ops)
        self.kv_ctx = operations.Linear(context_dim, 2 * dim, **ops)
        self.out_ctx = operations.Linear(dim, dim, **ops)
        self.norm3 = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
        self.mlp_in = operations.Linear(dim, 4 * dim, **ops)
        self.mlp_out = operations.Linear(4 * dim, dim, **ops)

    def forward(self, cond_vec: torch.Tensor, tokens: torch.Tensor, *, scale: float, context: torch.Tensor,
                skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if skip is not None:
            tokens = tokens + 0.5 * skip
        shift, gain, gate_attn, gate_mlp = self.mod(torch.nn.functional.silu(cond_vec)).unsqueeze(1).chunk(4, dim=-1)
        h = self.norm1(tokens) * (1 + gain) + shift
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        tokens = tokens + scale * gate_attn * self.proj(_attention(q, k, v, self.heads))
        k, v = self.kv_ctx(context).chunk(2, dim=-1)
        tokens = tokens + self.out_ctx(_attention(self.q_ctx(self.norm2(tokens)), k, v, self.heads))
        h = self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm3(tokens))))
        tokens = tokens + scale * gate_mlp * h
        aux = h.pow(2).mean(dim=(1, 2))
        return tokens, aux


class SideChannelCell(nn.Module):
    """`forward(tokens, vec)` returns tokens; it also adds the unit-scale tensor the previous cell left in `memory`
    (a dict shared by all cells of one model) and leaves its own there for the next cell, so a cell that is skipped
    (or replayed from a cache) leaves the next one a stale tensor."""

    def __init__(self, dim: int, heads: int, memory: dict, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        self.memory = memory
        self.mod = operations.Linear(dim, 3 * dim, **ops)
        self.norm1 = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
        self.qkv = operations.Linear(dim, 3 * dim, **ops)
        self.proj = operations.Linear(dim, dim, **ops)
        self.norm2 = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)
        self.mlp_in = operations.Linear(dim, 2 * dim, **ops)
        self.mlp_out = operations.Linear(2 * dim, dim, **ops)
        self.norm_carry = operations.LayerNorm(dim, elementwise_affine=False, eps=1e-6, **ops)

    def forward(self, tokens: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        carry = self.memory.get("carry")
        if carry is not None:
            tokens = tokens + carry
        shift, gain, gate = self.mod(torch.nn.functional.silu(vec)).unsqueeze(1).chunk(3, dim=-1)
        h = self.norm1(tokens) * (1 + gain) + shift
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        tokens = tokens + gate * self.proj(_attention(q, k, v, self.heads))
        h = self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(tokens))))
        self.memory["carry"] = 0.5 * self.norm_carry(h)
        return tokens + h


class _PatchTransformerIO:
    """What the made-up transformers share around their blocks: the patch embedding, the timestep and pooled-context
    vector, and the output head (set up in this order around the blocks, so the parameters keep their order)."""

    def _init_embeddings(self, in_channels: int, hidden_size: int, context_dim: int, patch_size: int, positions: int,
                         operations, ops: dict) -> None:
        self.patch_size = patch_size
        self.x_in = operations.Linear(in_channels * patch_size * patch_size, hidden_size, **ops)
        self.pos = nn.Parameter(torch.empty(1, positions, hidden_size, **ops))
        self.t_in = nn.Sequential(operations.Linear(256, hidden_size, **ops), nn.SiLU(),
                                  operations.Linear(hidden_size, hidden_size, **ops))
        self.pool_in = operations.Linear(context_dim, hidden_size, **ops)

    def _init_head(self, in_channels: int, hidden_size: int, operations, ops: dict) -> None:
        self.norm_out = operations.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6, **ops)
        self.x_out = operations.Linear(hidden_size, in_channels * self.patch_size * self.patch_size, **ops)

    def _embed(self, x: torch.Tensor, timesteps: torch.Tensor,
               context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, h, w = x.shape
        p = self.patch_size
        tokens = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), -1)
        tokens = self.x_in(tokens)
        tokens = tokens + self.pos[:, :tokens.shape[1]].to(tokens)
        vec = self.t_in(_timestep_features(timesteps, 256).to(tokens.dtype)) + self.pool_in(context.mean(dim=1))
        return tokens, vec

    def _head(self, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        b, c, h, w = shape
        p = self.patch_size
        out = self.x_out(self.norm_out(tokens))
        return out.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class MadeUpDiT(_PatchTransformerIO, nn.Module):
    """A diffusion transformer no ComfyUI family uses: `forward(x, timesteps, context, **kwargs)` on a 4-D latent.

    Its blocks are `stages` (MadeUpStage, an nn.ModuleList) or, with `side_channel`, `cells` (SideChannelCell, an
    nn.ModuleDict "cell_0".. whose cells talk through a shared dict). It ignores transformer_options."""

    def __init__(self, in_channels: int = 4, hidden_size: int = 64, depth: int = 6, num_heads: int = 2,
                 context_dim: int = 64, patch_size: int = 2, side_channel: bool = False, long_skip: bool = False,
                 image_model: str | None = None, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.dtype = dtype
        self.in_channels = in_channels
        self.hidden_size = hidden_size
        self.side_channel = side_channel
        self.long_skip = long_skip
        self._init_embeddings(in_channels, hidden_size, context_dim, patch_size, 256, operations, ops)
        if side_channel:
            self.memory: dict[str, torch.Tensor] = {}
            self.cells = nn.ModuleDict({
                f"cell_{i}": SideChannelCell(hidden_size, num_heads, self.memory, operations=operations, **ops)
                for i in range(depth)})
        else:
            self.stages = nn.ModuleList([
                MadeUpStage(hidden_size, num_heads, context_dim, operations=operations, **ops) for _ in range(depth)])
            self.stage_scales = [1.0 / (1 + i) ** 0.5 for i in range(depth)]
        self._init_head(in_channels, hidden_size, operations, ops)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, **kwargs) -> torch.Tensor:
        tokens, vec = self._embed(x, timesteps, context)
        if self.side_channel:
            self.memory.clear()
            for cell in self.cells.values():
                tokens = cell(tokens, vec)
            self.memory.clear()
        else:
            kept = None
            for i, stage in enumerate(self.stages):
                skip = kept if self.long_skip and i == len(self.stages) - 1 else None
                tokens, _aux = stage(vec, tokens, scale=self.stage_scales[i], context=context, skip=skip)
                if self.long_skip and i == 1:
                    kept = tokens
        return self._head(tokens, x.shape)


class StyleBlock(nn.Module):
    """A wide pre-norm transformer block for the side stack: `forward(tokens)` returns tokens."""

    def __init__(self, dim: int, heads: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        self.norm1 = operations.LayerNorm(dim, eps=1e-6, **ops)
        self.qkv = operations.Linear(dim, 3 * dim, **ops)
        self.proj = operations.Linear(dim, dim, **ops)
        self.norm2 = operations.LayerNorm(dim, eps=1e-6, **ops)
        self.mlp_in = operations.Linear(dim, 4 * dim, **ops)
        self.mlp_out = operations.Linear(4 * dim, dim, **ops)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(tokens)).chunk(3, dim=-1)
        tokens = tokens + 0.5 * self.proj(_attention(q, k, v, self.heads))
        return tokens + 0.5 * self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(tokens))))


class MethodStage(MadeUpStage):
    """A MadeUpStage whose work is the method `denoise`, which the forward calls instead of the module."""

    def denoise(self, cond_vec: torch.Tensor, tokens: torch.Tensor, *, scale: float,
                context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return MadeUpStage.forward(self, cond_vec, tokens, scale=scale, context=context)

    def forward(self, *args, **kwargs):
        raise RuntimeError("MethodStage is entered by denoise(), never called as a module")


class TwoLaneLayer(nn.Module):
    """One layer with two ways in: `prompt_pass(prompt, vec)` -> (prompt, keys, values) on the prompt rows, and
    `image_pass(image, vec, keys, values)` -> image, attending to the image rows and the prompt's keys and values."""

    def __init__(self, dim: int, heads: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        self.prompt_qkv = operations.Linear(dim, 3 * dim, **ops)
        self.prompt_out = operations.Linear(dim, dim, **ops)
        _add_gated_attention_mlp(self, dim, 3, ops, operations)

    def prompt_pass(self, prompt: torch.Tensor, vec: torch.Tensor):
        q, k, v = self.prompt_qkv(prompt).chunk(3, dim=-1)
        return prompt + 0.5 * self.prompt_out(_attention(q, k, v, self.heads)), k, v

    def image_pass(self, image: torch.Tensor, vec: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
        shift, gain, gate = self.mod(torch.nn.functional.silu(vec)).unsqueeze(1).chunk(3, dim=-1)
        q, k, v = self.qkv(self.norm1(image) * (1 + gain) + shift).chunk(3, dim=-1)
        attended = _attention(q, torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1), self.heads)
        image = image + gate * self.proj(attended)
        return image + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(image))))

    def forward(self, *args, **kwargs):
        raise RuntimeError("TwoLaneLayer is entered by prompt_pass() and image_pass(), never called as a module")


class PromptCacheLayer(nn.Module):
    """One layer called as a module two ways: `layer(prompt, vec)` -> (prompt, keys, values) on the prompt rows, and
    `layer(image, vec, keys, values)` -> image, attending to the image rows and the prompt's keys and values."""

    def __init__(self, dim: int, heads: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        _add_gated_attention_mlp(self, dim, 3, ops, operations)

    def forward(self, rows: torch.Tensor, vec: torch.Tensor, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None):
        shift, gain, gate = self.mod(torch.nn.functional.silu(vec)).unsqueeze(1).chunk(3, dim=-1)
        q, k, v = self.qkv(self.norm1(rows) * (1 + gain) + shift).chunk(3, dim=-1)
        prompt_pass = keys is None
        if not prompt_pass:
            k, v = torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)
        rows = rows + gate * self.proj(_attention(q, k, v, self.heads))
        rows = rows + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(rows))))
        return (rows, k, v) if prompt_pass else rows


class PackedBlock(nn.Module):
    """`forward(rows, vec, spans)` on the samples' rows packed one after another ([samples x tokens, width], no batch
    dimension); `spans` is a Python list of each sample's (start, stop). It adds its gated residuals into `rows` in
    place and returns that same tensor."""

    def __init__(self, dim: int, heads: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        _add_gated_attention_mlp(self, dim, 4, ops, operations)

    def forward(self, rows: torch.Tensor, vec: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        modulation = self.mod(torch.nn.functional.silu(vec))
        per_row = torch.cat([modulation[i:i + 1].expand(stop - start, -1) for i, (start, stop) in enumerate(spans)])
        shift, gain, gate_attn, gate_mlp = per_row.chunk(4, dim=-1)
        q, k, v = self.qkv(self.norm1(rows) * (1 + gain) + shift).chunk(3, dim=-1)
        attended = torch.cat([_attention(q[None, a:b], k[None, a:b], v[None, a:b], self.heads)[0] for a, b in spans])
        rows.addcmul_(self.proj(attended), gate_attn)
        rows.addcmul_(self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(rows)))), gate_mlp)
        return rows


class SparseRows:
    """A made-up sparse stream: `coords` [rows, 2] (integer sample and position of each row, sample-major) and
    `feats` [rows, width]; a block makes a new one with `with_feats`, keeping the coordinates."""

    def __init__(self, coords: torch.Tensor, feats: torch.Tensor) -> None:
        self.coords = coords
        self.feats = feats

    def with_feats(self, feats: torch.Tensor) -> SparseRows:
        return SparseRows(self.coords, feats)

    def spans(self) -> list[tuple[int, int]]:
        counts = torch.bincount(self.coords[:, 0]).tolist()
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [(start, start + count) for start, count in zip(starts, counts, strict=True)]


class SparseBlock(PackedBlock):
    """`forward(rows: SparseRows, vec)` -> a new SparseRows: attention within each sample's rows and an MLP, gated
    by the sample's modulation (looked up by each row's sample coordinate); the input is left as it was."""

    def forward(self, rows: SparseRows, vec: torch.Tensor) -> SparseRows:
        shift, gain, gate_attn, gate_mlp = self.mod(torch.nn.functional.silu(vec))[rows.coords[:, 0]].chunk(4, dim=-1)
        q, k, v = self.qkv(self.norm1(rows.feats) * (1 + gain) + shift).chunk(3, dim=-1)
        attended = torch.cat([_attention(q[None, a:b], k[None, a:b], v[None, a:b], self.heads)[0]
                              for a, b in rows.spans()])
        feats = rows.feats + gate_attn * self.proj(attended)
        feats = feats + gate_mlp * self.mlp_out(torch.nn.functional.gelu(self.mlp_in(self.norm2(feats))))
        return rows.with_feats(feats)


class CrossConditioner(nn.Module):
    """`forward(rows, other)`: what `rows` take from the other stream's rows (cross-attention), to be added to them."""

    def __init__(self, dim: int, heads: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.heads = heads
        self.norm = operations.LayerNorm(dim, eps=1e-6, **ops)
        self.q = operations.Linear(dim, dim, **ops)
        self.kv = operations.Linear(dim, 2 * dim, **ops)
        self.out = operations.Linear(dim, dim, **ops)

    def forward(self, rows: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        k, v = self.kv(other).chunk(2, dim=-1)
        return self.out(_attention(self.q(self.norm(rows)), k, v, self.heads))


class FusedPair(nn.Module):
    """A container of a video block, an audio block and their two cross-stream conditioners; it has no forward of
    its own (the model's forward calls its children)."""

    def __init__(self, dim: int, heads: int, context_dim: int, dtype=None, device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device, operations=operations)
        self.audio_to_video = CrossConditioner(dim, heads, **ops)
        self.video_to_audio = CrossConditioner(dim, heads, **ops)
        self.video_block = MadeUpStage(dim, heads, context_dim, **ops)
        self.audio_block = MadeUpStage(dim, heads, context_dim, **ops)


class MadeUpVariantDiT(_PatchTransformerIO, nn.Module):
    """The made-up variants (`variant`): "side_stack", "methods", "two_lanes", "prompt_cache", "packed", "sparse",
    "fused", "twice" (see
    the module doc); the patching,
    embeddings and output head are MadeUpDiT's."""

    def __init__(self, variant: str, in_channels: int = 4, hidden_size: int = 64, depth: int = 6,
                 num_heads: int = 2, context_dim: int = 64, patch_size: int = 2, style_width: int = 256,
                 style_depth: int = 8, style_tokens: int = 2, image_model: str | None = None, dtype=None,
                 device=None, operations=None) -> None:
        super().__init__()
        ops = dict(dtype=dtype, device=device)
        self.dtype = dtype
        self.variant = variant
        self.style_tokens = style_tokens
        self._init_embeddings(in_channels, hidden_size, context_dim, patch_size, 1024, operations, ops)
        if variant in ("two_lanes", "prompt_cache"):
            self.prompt_in = operations.Linear(context_dim, hidden_size, **ops)
            layer = TwoLaneLayer if variant == "two_lanes" else PromptCacheLayer
            self.layers = nn.ModuleList([layer(hidden_size, num_heads, operations=operations, **ops)
                                         for _ in range(depth)])
            self.prompt_cache: list[tuple[torch.Tensor, list]] = []  # (prompt, per layer (keys, values)), one run's
        elif variant == "packed":
            self.rows = nn.ModuleList([PackedBlock(hidden_size, num_heads, operations=operations, **ops)
                                       for _ in range(depth)])
        elif variant == "sparse":
            self.sparse_blocks = nn.ModuleList([SparseBlock(hidden_size, num_heads, operations=operations, **ops)
                                                for _ in range(depth)])
        else:
            if variant == "fused":
                self.audio_in = operations.Linear(context_dim, hidden_size, **ops)
                self.fusion_blocks = nn.ModuleList([FusedPair(hidden_size, num_heads, context_dim,
                                                              operations=operations, **ops) for _ in range(2)])
            stage = MethodStage if variant == "methods" else MadeUpStage
            self.stages = nn.ModuleList([stage(hidden_size, num_heads, context_dim, operations=operations, **ops)
                                         for _ in range(depth)])
            self.stage_scales = [1.0 / (1 + i) ** 0.5 for i in range(depth)]
        if variant == "side_stack":
            self.style_in = operations.Linear(context_dim, style_width, **ops)
            self.style_encoder = nn.ModuleList([StyleBlock(style_width, num_heads, operations=operations, **ops)
                                                for _ in range(style_depth)])
            self.style_out = operations.Linear(style_width, hidden_size, **ops)
        self._init_head(in_channels, hidden_size, operations, ops)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, **kwargs) -> torch.Tensor:
        tokens, vec = self._embed(x, timesteps, context)
        if self.variant == "side_stack":
            style = self.style_in(context[:, :self.style_tokens])
            for block in self.style_encoder:
                style = block(style)
            vec = vec + self.style_out(style.mean(dim=1))
        if self.variant == "two_lanes":
            prompt = self.prompt_in(context)
            for layer in self.layers:
                prompt, keys, values = layer.prompt_pass(prompt, vec)
                tokens = layer.image_pass(tokens, vec, keys, values)
        elif self.variant == "prompt_cache":
            tokens = self._through_prompt_cache(tokens, vec, context)
        elif self.variant == "packed":
            samples, length = tokens.shape[:2]
            spans = [(i * length, (i + 1) * length) for i in range(samples)]
            rows = tokens.reshape(samples * length, -1).clone()
            for block in self.rows:
                rows = block(rows, vec, spans)
            tokens = rows.reshape(samples, length, -1)
        elif self.variant == "sparse":
            samples, length = tokens.shape[:2]
            positions = torch.arange(samples * length, device=tokens.device)
            sparse = SparseRows(torch.stack([positions // length, positions % length], dim=1),
                                tokens.reshape(samples * length, -1))
            for block in self.sparse_blocks:
                sparse = block(sparse, vec)
            tokens = sparse.feats.reshape(samples, length, -1)
        else:
            if self.variant == "fused":
                tokens = self._through_fusion_blocks(tokens, vec, context)
            for _ in range(2 if self.variant == "twice" else 1):
                for i, stage in enumerate(self.stages):
                    enter = stage.denoise if self.variant == "methods" else stage
                    tokens, _aux = enter(vec, tokens, scale=self.stage_scales[i], context=context)
        return self._head(tokens, x.shape)


    def _through_fusion_blocks(self, video: torch.Tensor, vec: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The video and audio streams through each FusedPair's children, interleaved (Prism's fusion blocks)."""
        audio = self.audio_in(context)
        for fused in self.fusion_blocks:
            before = video
            video = video + fused.audio_to_video(video, audio)
            audio = audio + fused.video_to_audio(audio, before)
            video, _aux = fused.video_block(vec, video, scale=1.0, context=context)
            audio, _aux = fused.audio_block(vec, audio, scale=1.0, context=context)
        return video

    def _through_prompt_cache(self, tokens: torch.Tensor, vec: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The layers on the image rows; a prompt not seen yet in this sampling run first goes through every layer
        on its own rows (before that layer's image rows), and its keys and values are kept for the run's later
        calls (the pattern of ComfyUI 0.38.1's Qwen-Image 2.1, which keeps its prompt's keys and values)."""
        kept = next((per_layer for prompt, per_layer in self.prompt_cache
                     if prompt.shape == context.shape and torch.equal(prompt, context)), None)
        prompt = None
        if kept is None:
            kept, prompt = [], self.prompt_in(context)
            self.prompt_cache.append((context.clone(), kept))
        for i, layer in enumerate(self.layers):
            if prompt is not None:
                prompt, keys, values = layer(prompt, vec)
                kept.append((keys, values))
            tokens = layer(tokens, vec, *kept[i])
        return tokens


def _made_up_net(variant: str | None = None, **config) -> nn.Module:
    """The made-up diffusion model a config's `variant` names (none: MadeUpDiT)."""
    return MadeUpDiT(**config) if variant is None else MadeUpVariantDiT(variant, **config)


_MADE_UP_CONFIG: type | None = None


def _made_up_config() -> type:
    """A ComfyUI model config (supported_models_base.BASE) whose get_model gives a BaseModel around MadeUpDiT."""
    global _MADE_UP_CONFIG
    if _MADE_UP_CONFIG is None:
        import comfy.latent_formats
        import comfy.model_base
        import comfy.supported_models_base

        class MadeUpModel(comfy.model_base.BaseModel):
            def __init__(self, model_config, model_type=comfy.model_base.ModelType.FLOW, device=None):
                super().__init__(model_config, model_type, device=device, unet_model=_made_up_net)

            @property
            def current_patcher(self):
                return self.__dict__.get("_current_patcher")

            @current_patcher.setter
            def current_patcher(self, patcher) -> None:
                # ModelPatcher sets it when a sampling run starts and clears it when the run ends: a prompt cache
                # lives for one run
                self.__dict__["_current_patcher"] = patcher
                net = self.__dict__.get("_modules", {}).get("diffusion_model")
                if getattr(net, "prompt_cache", None) is not None:
                    net.prompt_cache.clear()

        class MadeUp(comfy.supported_models_base.BASE):
            unet_config = {"image_model": "made_up"}
            unet_extra_config = {}
            sampling_settings = {"multiplier": 1.0, "shift": 1.0}
            latent_format = comfy.latent_formats.SD15
            supported_inference_dtypes = [torch.float32]

            def get_model(self, state_dict, prefix="", device=None):
                return MadeUpModel(self, device=device)

        _MADE_UP_CONFIG = MadeUp
    return _MADE_UP_CONFIG


# ---------------------------------------------------------------------------------------------------------------


def _spec(kind: str) -> FamilySpec:
    if kind not in NEW_FAMILIES:
        raise ValueError(f"unknown family {kind!r}; known: {', '.join(NEW_FAMILIES)}")
    return NEW_FAMILIES[kind]


def family_config(kind: str):
    """The ComfyUI model config for the tiny `kind` (what model detection would return for a real checkpoint)."""
    spec = _spec(kind)
    if spec.config_class == "MadeUp":
        return _made_up_config()(dict(spec.unet_config))
    import comfy.supported_models

    cfg = getattr(comfy.supported_models, spec.config_class)(dict(spec.unet_config))
    if spec.config_class == "StableAudio":
        # its get_model loads the seconds-start/total embedders from the checkpoint's state dict (strictly): hand
        # it what a checkpoint holds there (the values are replaced by random ones afterwards)
        import comfy.ldm.audio.embedders

        embedder = comfy.ldm.audio.embedders.NumberConditioner(768, min_val=0, max_val=512).state_dict()
        checkpoint = {f"conditioner.conditioners.{name}.{key}": value
                      for name in ("seconds_start", "seconds_total") for key, value in embedder.items()}
        get_model = cfg.get_model
        cfg.get_model = lambda state_dict, prefix="", device=None: get_model(
            {**checkpoint, **state_dict}, prefix=prefix, device=device)
    return cfg


def build_family(kind: str, seed: int = 0):
    """A ModelPatcher around the tiny `kind` model (a key of NEW_FAMILIES), fp32, on the CPU, random weights."""
    model = build_random_model(family_config(kind), seed)
    with torch.no_grad():  # Stable Audio's norms keep their scale as `gamma`, which the filler zeroes: set to 1
        for name, parameter in model.model.diffusion_model.named_parameters():
            if name.endswith(".gamma"):
                parameter.fill_(1.0)
    return model


def block_stack(kind: str) -> str:
    """Dotted path of the family's main block container on `model.model.diffusion_model` (see the module doc for
    how its forward reaches the blocks)."""
    return _spec(kind).block_stack


def counts_block_call(kind: str, args: tuple, kwargs: dict) -> bool:
    """Whether a module call of a main-stack block counts as one of the stack's block calls (made_up_prompt_cache:
    its image-row calls; the prompt rows run once per sampling run, cached or not)."""
    return _spec(kind).counted != "image rows" or len(args) + len(kwargs) > 2


def block_entry(kind: str) -> str:
    """The method of a block the family's forward enters its main stack's blocks by ("": a module call)."""
    return _spec(kind).entry


def family_latent(kind: str, batch: int = 1) -> torch.Tensor:
    """The zero latent of the tiny `kind` model (what its empty-latent node would give, small)."""
    return torch.zeros(batch, *_spec(kind).latent_shape)


def family_conditioning(kind: str, batch: int = 1, seed: int = 1) -> tuple[list, list]:
    """Positive and negative CONDITIONING lists carrying every key the family's model_base extra_conds needs."""
    spec = _spec(kind)
    gen = torch.Generator().manual_seed(seed)
    n = spec.tokens

    def one() -> list:
        extra: dict[str, Any] = {}
        if kind == "hunyuan_dit":  # CLIP mask, mT5 states and mask
            extra["attention_mask"] = torch.ones(batch, n, dtype=torch.long)
            extra["conditioning_mt5xl"] = torch.randn(batch, n, spec.unet_config["text_states_dim_t5"], generator=gen)
            extra["attention_mask_mt5xl"] = torch.ones(batch, n, dtype=torch.long)
        elif kind in ("mochi", "omnigen2"):  # one row: model_base turns its sum into num_tokens
            extra["attention_mask"] = torch.ones(1, n, dtype=torch.long)
        elif kind == "ace_step":
            vocab = spec.unet_config["lyric_encoder_vocab_size"]
            extra["conditioning_lyrics"] = torch.randint(0, vocab, (batch, 6), generator=gen)
        elif kind == "stable_audio":
            extra["seconds_start"] = 0.0
            extra["seconds_total"] = 10.0
        return [[torch.randn(batch, n, spec.context_dim, generator=gen), extra]]

    return one(), one()


def sample_family(model, kind: str, *, steps: int = 2, sigmas: torch.Tensor | None = None, seed: int = 0,
                  cfg: float | None = None, batch: int = 1) -> torch.Tensor:
    """Run ComfyUI's own sampler (euler, normal schedule) on the tiny `kind` model and return the denoised latent;
    `sigmas` replaces the schedule; `cfg` defaults to the family's (CFG > 1, as hunyuan3d21 requires)."""
    import comfy.sample

    positive, negative = family_conditioning(kind, batch=batch)
    latent = family_latent(kind, batch)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(
            model, noise, steps, _spec(kind).cfg if cfg is None else cfg, "euler", "normal", positive, negative,
            latent, denoise=1.0, disable_pbar=True, seed=seed, sigmas=sigmas,
        )
