# ruff: noqa: F811 (the fixtures imported from tests.support.deepcache_tiny are test arguments here)
"""DeepCache against ComfyUI 0.38's block contracts, each swapped alone into the real 0.3.75 model class it
changes (0.3.75's own forward is the control):

* Lumina 2 / Z-Image: 0.38's `NextDiT._forward` (comfy/ldm/lumina/model.py) runs the `patches["double_block"]`
  post-block hooks after every layer and writes their result into the hidden states in place.
* Wan 2.1/2.2: 0.38.1's `WanModel.forward_orig` (comfy/ldm/wan/model.py at 0c9a69ae) runs the
  `patches["double_block"]` post-block hooks after every block, a replaced one included, and takes their "img".
* LTX-2: 0.38's `LTXAVModel._process_transformer_blocks` (comfy/ldm/lightricks/av_model.py), an LTXVModel
  subclass, hands its blocks and their `patches_replace["dit"]` patches the stream "img" as the tuple
  (video, audio) and edits both in place.
"""

from __future__ import annotations

import pytest
import torch

from harness import comfy038_prefix_models
from harness.tiny_models import build_tiny_model, sample
from tests.support import comfy038_prefetch
from tests.support.deepcache_tiny import deepcache, held_sigmas, one_thread  # noqa: F401 (fixtures)
from tests.support.int8_checks import rel


# --- Lumina 2: 0.38's post-block hooks --------------------------------------------------------------------
def lumina_038_forward(self, x, timesteps, context, num_tokens, attention_mask=None, **kwargs):
    """0.3.75's NextDiT._forward with the block loop of 0.38's NextDiT._forward: after each layer, every
    `patches["double_block"]` hook gets the image and caption parts and its result is written back in place."""
    import comfy.ldm.common_dit

    t = 1.0 - timesteps
    bs, c, h, w = x.shape
    x = comfy.ldm.common_dit.pad_to_patch_size(x, (self.patch_size, self.patch_size))
    t = self.t_embedder(t * self.time_scale, dtype=x.dtype)
    adaln_input = t
    cap_feats = self.cap_embedder(context)
    transformer_options = kwargs.get("transformer_options", {})
    x_is_tensor = isinstance(x, torch.Tensor)
    img, mask, img_size, cap_size, freqs_cis = self.patchify_and_embed(x, cap_feats, attention_mask, t, num_tokens,
                                                                       transformer_options=transformer_options)
    freqs_cis = freqs_cis.to(img.device)
    patches = transformer_options.get("patches", {})
    transformer_options["total_blocks"] = len(self.layers)
    transformer_options["block_type"] = "double"
    img_input = img
    for i, layer in enumerate(self.layers):
        transformer_options["block_index"] = i
        img = layer(img, mask, freqs_cis, adaln_input, transformer_options=transformer_options)
        for patch in patches.get("double_block", []):
            out = patch({"img": img[:, cap_size[0]:], "img_input": img_input[:, cap_size[0]:],
                         "txt": img[:, :cap_size[0]], "vec": adaln_input, "x": x, "block_index": i,
                         "transformer_options": transformer_options})
            if "img" in out:
                img[:, cap_size[0]:] = out["img"]
            if "txt" in out:
                img[:, :cap_size[0]] = out["txt"]
    img = self.final_layer(img, adaln_input)
    img = self.unpatchify(img, img_size, cap_size, return_tensor=x_is_tensor)[:, :, :h, :w]
    return -img


class HookRecorder:
    """A post-block hook that changes the image tokens (so skipping or doubling it shows in the output) and
    records, per diffusion-model call, the block indices it ran for."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __deepcopy__(self, memo):  # ModelPatcher.clone deep-copies model_options: keep recording here
        return self

    def start(self, *_):
        self.calls.append([])

    def __call__(self, args: dict) -> dict:
        self.calls[-1].append(args["block_index"])
        return {"img": args["img"] * 0.9 + 0.1 * torch.tanh(args["img"])}


@pytest.fixture
def lumina_038(monkeypatch):
    from comfy.ldm.lumina.model import NextDiT

    model = build_tiny_model("lumina2", weight_std=0.05)
    recorder = HookRecorder()
    hooked = model.clone()
    hooked.set_model_double_block_patch(recorder)
    return model, hooked, recorder, lambda: monkeypatch.setattr(NextDiT, "_forward", lumina_038_forward)


def _recording(model, recorder):
    net = model.get_model_object("diffusion_model")
    return net.register_forward_pre_hook(recorder.start)


def test_lumina_post_block_hooks_run_only_on_the_blocks_that_run(deepcache, lumina_038):
    model, hooked, recorder, use_038 = lumina_038
    layers = len(model.get_model_object("diffusion_model").layers)
    handle = _recording(model, recorder)
    try:
        control = sample(hooked, "lumina2", steps=6)
        assert recorder.calls == [[]] * 6  # 0.3.75's own forward runs no post-block hook
        assert torch.equal(sample(deepcache.apply_deepcache(hooked, 1, 1), "lumina2", steps=6), control)
        use_038()
        _hooks_run_only_on_the_blocks_that_run(deepcache, model, hooked, recorder, "lumina2", layers, control)
    finally:
        handle.remove()


def _hooks_run_only_on_the_blocks_that_run(deepcache, model, hooked, recorder, kind: str, blocks: int,
                                           control: torch.Tensor) -> None:
    """With a 0.38 forward that runs post-block hooks after every block swapped in: the hooks run after every
    block and change the output; DeepCache at interval 1 is the model alone bit for bit; at interval 3 a cached
    step runs the hooks of the blocks that run only (the first and last block, and the middle segment's last one
    standing for the segment), in reuse and forecast mode; held sigmas give the full step's result."""
    recorder.calls.clear()
    plain = sample(hooked, kind, steps=6)
    assert recorder.calls == [list(range(blocks))] * 6
    assert rel(plain, control) > 1e-3  # the hooks change the output
    for mode in ("reuse", "forecast"):
        assert torch.equal(sample(deepcache.apply_deepcache(hooked, 1, 1, mode=mode), kind, steps=6), plain)
        recorder.calls.clear()
        sample(deepcache.apply_deepcache(hooked, 3, 1, mode=mode), kind, steps=6)
        assert recorder.calls == [list(range(blocks)) if step % 3 == 0 else [0, blocks - 2, blocks - 1]
                                  for step in range(6)], mode
    # held sigmas: a cached step sees the full step's input and must give its result; a hook of the segment's last
    # block counted in the residual and run again, or one of a skipped block writing into the passed-through
    # tokens, would be far off
    sigmas = held_sigmas(model)
    held = sample(hooked, kind, sigmas=sigmas, batch=2)
    assert rel(sample(deepcache.apply_deepcache(hooked, 3, 1), kind, sigmas=sigmas, batch=2), held) < 2e-6


# --- Wan: 0.38.1's post-block hooks -----------------------------------------------------------------------
def wan_038_forward_orig(self, x, t, context, clip_fea=None, freqs=None, transformer_options=None, **kwargs):
    """0.3.75's WanModel.forward_orig (text to video: no reference latent, no CLIP features) with the block loop
    of 0.38.1's: after each block, replaced or not, every `patches["double_block"]` hook gets the image tokens
    with the block index, and its "img" goes on."""
    from comfy.ldm.wan.model import sinusoidal_embedding_1d

    transformer_options = {} if transformer_options is None else transformer_options
    x_input = x
    x = self.patch_embedding(x.float()).to(x.dtype)
    grid_sizes = x.shape[2:]
    x = x.flatten(2).transpose(1, 2)
    e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype))
    e = e.reshape(t.shape[0], -1, e.shape[-1])
    e0 = self.time_projection(e).unflatten(2, (6, self.dim))
    context = self.text_embedding(context)
    blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
    patches = transformer_options.get("patches", {})
    for i, block in enumerate(self.blocks):
        transformer_options["block_index"] = i
        if ("double_block", i) in blocks_replace:
            def block_wrap(args, block=block):
                return {"img": block(args["img"], context=args["txt"], e=args["vec"], freqs=args["pe"],
                                     context_img_len=None, transformer_options=args["transformer_options"])}
            x = blocks_replace[("double_block", i)]({"img": x, "txt": context, "vec": e0, "pe": freqs,
                                                     "transformer_options": transformer_options},
                                                    {"original_block": block_wrap})["img"]
        else:
            x = block(x, e=e0, freqs=freqs, context=context, context_img_len=None,
                      transformer_options=transformer_options)
        for patch in patches.get("double_block", []):
            x = patch({"img": x, "x": x_input, "vec": e, "block_index": i, "img_offset": 0,
                       "transformer_options": transformer_options})["img"]
    x = self.head(x, e)
    return self.unpatchify(x, grid_sizes)


def test_wan_post_block_hooks_run_only_on_the_blocks_that_run(deepcache, monkeypatch):
    """On a cached step DeepCache's block patch passes a skipped middle block's input through; 0.38.1's Wan forward
    then runs the post-block hooks on it anyway unless DeepCache gates them, as it does for Lumina's: a hook of a
    skipped block must not run (it would change the passed-through tokens), the segment's last block stands for
    the segment, interval 1 is the model alone bit for bit."""
    from comfy.ldm.wan.model import WanModel

    model = build_tiny_model("wan21", weight_std=0.05)
    recorder = HookRecorder()
    hooked = model.clone()
    hooked.set_model_double_block_patch(recorder)
    blocks = len(model.get_model_object("diffusion_model").blocks)
    handle = _recording(model, recorder)
    try:
        control = sample(hooked, "wan21", steps=6)
        assert recorder.calls == [[]] * 6  # 0.3.75's own forward runs no post-block hook
        monkeypatch.setattr(WanModel, "forward_orig", wan_038_forward_orig)
        _hooks_run_only_on_the_blocks_that_run(deepcache, model, hooked, recorder, "wan21", blocks, control)
    finally:
        handle.remove()


# --- LTX-2: the (video, audio) tuple stream ---------------------------------------------------------------
AUDIO_TOKENS = 4


def ltx2_038_forward(self, x, timestep, context, attention_mask, frame_rate=25, transformer_options=None,
                     keyframe_idxs=None, **kwargs):
    """0.3.75's LTXVModel._forward with the block contract of 0.38's LTXAVModel: the blocks and their
    `patches_replace["dit"][("double_block", i)]` patches carry "img" = (video, audio) and return it the same way;
    each block's turn starts with the weight prefetch (comfy/ldm/lightricks/av_model.py
    `_process_transformer_blocks`, Comfy-Org/ComfyUI 0a29ddae76c003faac77c5c283e4f1c8cd10acca; on a CPU 0.38
    builds no prefetch queue).
    The audio tokens here are the first video tokens, run through the same blocks as a second sequence and added
    back before the output projection, so both parts of the tuple reach the result."""
    import math

    from comfy.ldm.lightricks.model import latent_to_pixel_coords, precompute_freqs_cis

    transformer_options = {} if transformer_options is None else transformer_options
    orig_shape = list(x.shape)
    x, latent_coords = self.patchifier.patchify(x)
    pixel_coords = latent_to_pixel_coords(latent_coords=latent_coords, scale_factors=self.vae_scale_factors,
                                          causal_fix=self.causal_temporal_positioning)
    fractional_coords = pixel_coords.to(torch.float32)
    fractional_coords[:, 0] = fractional_coords[:, 0] * (1.0 / frame_rate)
    vx = self.patchify_proj(x)
    ax = vx[:, :AUDIO_TOKENS].clone()
    if attention_mask is not None and not torch.is_floating_point(attention_mask):
        attention_mask = (attention_mask - 1).to(vx.dtype).reshape(
            (attention_mask.shape[0], 1, -1, attention_mask.shape[-1])) * torch.finfo(vx.dtype).max
    v_pe = precompute_freqs_cis(fractional_coords, dim=self.inner_dim, out_dtype=vx.dtype)
    a_pe = v_pe[:, :, :AUDIO_TOKENS]  # (batch, 1, tokens, ...)
    batch_size = vx.shape[0]
    timestep, embedded_timestep = self.adaln_single((timestep * 1000.0).flatten(),
                                                    {"resolution": None, "aspect_ratio": None},
                                                    batch_size=batch_size, hidden_dtype=vx.dtype)
    timestep = timestep.view(batch_size, -1, timestep.shape[-1])
    embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.shape[-1])
    if self.caption_projection is not None:
        context = self.caption_projection(context).view(batch_size, -1, vx.shape[-1])

    blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
    prefetch = comfy038_prefix_models.model_prefetch
    prefetch_queue = prefetch.make_prefetch_queue(list(self.transformer_blocks), vx.device, transformer_options)
    for i, block in enumerate(self.transformer_blocks):
        prefetch.prefetch_queue_pop(prefetch_queue, vx.device, block, malloc_scope="block")

        def run(pair, options, block=block):
            video, audio = pair
            video = block(video, context=context, attention_mask=attention_mask, timestep=timestep, pe=v_pe,
                          transformer_options=options)
            audio = block(audio, context=context, attention_mask=attention_mask, timestep=timestep, pe=a_pe,
                          transformer_options=options)
            return video, audio

        if ("double_block", i) in blocks_replace:
            out = blocks_replace[("double_block", i)](
                {"img": (vx, ax), "transformer_options": transformer_options},
                {"original_block": lambda args, run=run: {"img": run(args["img"], args["transformer_options"])}})
            vx, ax = out["img"]
        else:
            vx, ax = run((vx, ax), transformer_options)
    prefetch.prefetch_queue_pop(prefetch_queue, vx.device, None, malloc_scope="block")

    x = vx.clone()
    x[:, :AUDIO_TOKENS] += ax
    scale_shift_values = self.scale_shift_table[None, None].to(device=x.device, dtype=x.dtype) \
        + embedded_timestep[:, :, None]
    shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]
    x = self.norm_out(x)
    x = torch.addcmul(x, x, scale).add_(shift)
    x = self.proj_out(x)
    return self.patchifier.unpatchify(latents=x, output_height=orig_shape[3], output_width=orig_shape[4],
                                      output_num_frames=orig_shape[2],
                                      out_channels=orig_shape[1] // math.prod(self.patchifier.patch_size))


@pytest.fixture
def ltx2(monkeypatch):
    from comfy.ldm.lightricks.model import LTXVModel

    model = build_tiny_model("ltxv", weight_std=0.05)
    monkeypatch.setattr(LTXVModel, "_forward", ltx2_038_forward)
    return model


def test_ltx2_tuple_stream_interval_one_is_bit_identical(deepcache, ltx2):
    plain = sample(ltx2, "ltxv", steps=4)
    for mode in ("reuse", "forecast"):
        assert torch.equal(sample(deepcache.apply_deepcache(ltx2, 1, 1, mode=mode), "ltxv", steps=4), plain)


def test_ltx2_tuple_stream_caches_video_and_audio(deepcache, ltx2):
    """Held sigmas: the cached steps must give the full step's result, which needs the residual of both parts
    of the (video, audio) tuple (the audio part alone moves the first tokens of the output)."""
    sigmas = held_sigmas(ltx2)
    plain = sample(ltx2, "ltxv", sigmas=sigmas, batch=2)
    cached = sample(deepcache.apply_deepcache(ltx2, 3, 1), "ltxv", sigmas=sigmas, batch=2)
    assert rel(cached, plain) < 2e-6
    moving = sample(deepcache.apply_deepcache(ltx2, 3, 1), "ltxv", steps=6)
    assert torch.isfinite(moving).all() and not torch.equal(moving, sample(ltx2, "ltxv", steps=6))


def test_ltx2_cached_steps_prefetch_only_the_blocks_they_run(deepcache, ltx2, monkeypatch):
    """Under dynamic VRAM 0.38's LTX-2 streams each block's weights before it looks up the block's patch: on a
    cached step DeepCache's list of stand-ins leaves the middle blocks it skips out (the patches still decide)."""
    blocks = ltx2.model.diffusion_model.transformer_blocks
    streamed = comfy038_prefetch.record_prefetch(monkeypatch, blocks)
    every_block = set(range(len(blocks)))
    plain = sample(ltx2, "ltxv", steps=3)
    assert streamed == [every_block] * 3  # the control
    streamed.clear()
    cached = sample(deepcache.apply_deepcache(ltx2, 3, 1), "ltxv", steps=3)
    assert streamed == [every_block, {0, len(blocks) - 1}, {0, len(blocks) - 1}], streamed
    assert torch.isfinite(cached).all() and not torch.equal(cached, plain)
