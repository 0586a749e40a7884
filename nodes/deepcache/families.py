"""The diffusion transformer families DeepCache knows: where each keeps its blocks and how streams pass them.

A family is matched by its ComfyUI model class (subclasses included: ComfyUI's variants of a family, such as
Wan's VACE, camera, S2V, HuMo and Animate models or Chroma Radiance, run the same block loop). Each block
stack is reached one of two ways:

* `patch`: the forward looks up ComfyUI's `patches_replace["dit"][(patch, index)]` for every block and passes
  the streams as a dict ({"img": ..., "txt": ...}); DeepCache installs a block-replace patch there.
* `arguments`: the forward calls the blocks directly; DeepCache swaps the block list for the duration of a
  model call, and `arguments` says at which position / under which keyword each stream enters a block. The
  block returns its streams in `streams` order (a tensor when there is one).

A stream may be a tuple of tensors (LTX-2 passes video and audio as one "img"); each part is cached on its own.
On a swapped list, a stream may also be an object holding tensors (TRELLIS.2's SparseTensor), cached per
floating-point field (`stream_objects`).
`post_hooks` names the list in `transformer_options["patches"]` the forward runs after every block
(`{"img": ..., "block_index": i, ...}`, as ComfyUI 0.38's Lumina, Qwen-Image 2.1 and Wan do).

Qwen-Image 2.1 and HiDream-O1 (ComfyUI 0.38) keep the prompt's keys and values across steps and turn that cache
off whenever a block-replace patch is installed, so their blocks are reached by swapping the block list instead.
Their forwards also call each block for the cache itself (Qwen-Image 2.1 runs the prompt rows alone once per
prompt; HiDream-O1's first call per prompt returns each block's keys and values): `whole_pass` recognises such a
call, which DeepCache leaves alone (HiDream-O1's is its whole sequence, captured on a full step; its later calls
carry only the rows after the prompt, which the captured residual's trailing rows serve), and `extra_outputs`
counts what a block returns after its streams (None when DeepCache skips the block). `prefetched` marks a patched stack whose 0.38 forward prefetches the weights of the
blocks in its list (LTX-2): on cached calls DeepCache swaps the list too, so the blocks it skips are not streamed.
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStack:
    attribute: str  # the nn.ModuleList on the diffusion model (a dotted path when it sits in a submodule)
    streams: tuple[str, ...]  # what a block carries to the next one, in the order it returns them
    patch: str | None = None  # the key kind of patches_replace["dit"] the forward honours for these blocks
    arguments: tuple[tuple[int, str], ...] = ()  # otherwise: (position, keyword) each stream enters by
    skip_attribute: str | None = None  # names a list of block indices the forward never runs
    post_hooks: str | None = None  # the patches list the forward runs after each block, with its block_index
    whole_pass: Callable[[tuple, dict], bool] | None = None  # (args, kwargs) of a call the block must run as is
    # such a call carries the whole sequence (HiDream-O1): a full step captures it like any call, only a cached
    # step must run it as is
    captures_whole_pass: bool = False
    # later calls may carry only the trailing rows of the sequence a full step captured (HiDream-O1 once its
    # prompt cache is filled): the cached residual serves them by its trailing rows
    trailing_rows: bool = False
    extra_outputs: int = 0  # values a block returns after its streams
    prefetched: bool = False  # the forward prefetches the weights of the blocks in its list (ComfyUI 0.38)
    # the forward enters each block through this method of its class (`layer.forward_generation(x, ...)`), not by
    # calling the module; the swapped list's stand-ins answer that method
    method: str | None = None

    def blocks(self, diffusion_model):
        return operator.attrgetter(self.attribute)(diffusion_model)

    def swap_blocks(self, diffusion_model, blocks):
        """Put `blocks` where this stack's list is; return the list that was there."""
        parent_path, _, name = self.attribute.rpartition(".")
        parent = operator.attrgetter(parent_path)(diffusion_model) if parent_path else diffusion_model
        previous = getattr(parent, name)
        setattr(parent, name, blocks)
        return previous


def _qwen_image21_prompt_pass(args: tuple, kwargs: dict) -> bool:
    """Qwen-Image 2.1 filling its prompt cache: `block(x, mod, pe, attn_fn, prefix_len, ...)` on prompt rows only."""
    x = args[0] if args else kwargs.get("x")
    prefix_len = args[4] if len(args) > 4 else kwargs.get("prefix_len", 0)
    return bool(prefix_len) and x is not None and prefix_len == x.shape[1]


def _hidream_o1_cache_fill(args: tuple, kwargs: dict) -> bool:
    """HiDream-O1's first call for a prompt: `past_key_value=()` asks each layer for its keys and values."""
    past = kwargs.get("past_key_value")
    return isinstance(past, tuple) and len(past) == 0


@dataclass(frozen=True)
class Family:
    name: str  # as a user knows it
    module: str
    class_name: str
    stacks: tuple[BlockStack, ...]

    def model_class(self) -> type | None:
        try:
            return getattr(importlib.import_module(self.module), self.class_name)
        except (ImportError, AttributeError):  # an older ComfyUI without this family
            return None


_DOUBLE = BlockStack("double_blocks", ("img", "txt"), patch="double_block")
_SINGLE = BlockStack("single_blocks", ("img",), patch="single_block")

FAMILIES: tuple[Family, ...] = (
    Family("SD3", "comfy.ldm.modules.diffusionmodules.mmdit", "MMDiT",
           (BlockStack("joint_blocks", ("img", "txt"), patch="double_block"),)),
    Family("Flux", "comfy.ldm.flux.model", "Flux", (_DOUBLE, _SINGLE)),
    Family("Chroma", "comfy.ldm.chroma.model", "Chroma",
           (BlockStack("double_blocks", ("img", "txt"), patch="double_block", skip_attribute="skip_mmdit"),
            BlockStack("single_blocks", ("img",), patch="single_block", skip_attribute="skip_dit"))),
    Family("HunyuanVideo", "comfy.ldm.hunyuan_video.model", "HunyuanVideo", (_DOUBLE, _SINGLE)),
    # ComfyUI 0.38.1's Wan forwards run the post-block hooks after every block, a replaced one included
    Family("Wan 2.1/2.2", "comfy.ldm.wan.model", "WanModel",
           (BlockStack("blocks", ("img",), patch="double_block", post_hooks="double_block"),)),
    Family("Qwen-Image", "comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel",
           (BlockStack("transformer_blocks", ("img", "txt"), patch="double_block"),)),
    Family("Qwen-Image 2.1", "comfy.ldm.qwen_image21.model", "QwenImage21Transformer2DModel",
           (BlockStack("transformer_blocks", ("img",), arguments=((0, "x"),), post_hooks="single_block",
                       whole_pass=_qwen_image21_prompt_pass),)),
    # LTX-2 (LTXAVModel) is an LTXVModel whose "img" is the tuple (video, audio)
    Family("LTX-Video / LTX-2", "comfy.ldm.lightricks.model", "LTXVModel",
           (BlockStack("transformer_blocks", ("img",), patch="double_block", prefetched=True),)),
    Family("Lumina 2 / Z-Image", "comfy.ldm.lumina.model", "NextDiT",
           (BlockStack("layers", ("img",), arguments=((0, "x"),), post_hooks="double_block"),)),
    Family("HiDream-O1", "comfy.ldm.hidream_o1.model", "HiDreamO1Transformer",
           (BlockStack("language_model.layers", ("x",), arguments=((0, "x"),), whole_pass=_hidream_o1_cache_fill,
                       captures_whole_pass=True, trailing_rows=True, extra_outputs=1),)),
    Family("HiDream", "comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel",
           (BlockStack("double_stream_blocks", ("img", "txt"), arguments=((0, "image_tokens"), (2, "text_tokens"))),
            BlockStack("single_stream_blocks", ("img",), arguments=((0, "image_tokens"),)))),
    Family("Cosmos Predict2", "comfy.ldm.cosmos.predict2", "MiniTrainDIT",
           (BlockStack("blocks", ("img",), arguments=((0, "x_B_T_H_W_D"),)),)),
)


def family_of(diffusion_model) -> Family | None:
    for family in FAMILIES:
        cls = family.model_class()
        if cls is not None and isinstance(diffusion_model, cls):
            return family
    return None


def supported_names() -> str:
    return ", ".join(family.name for family in FAMILIES)


def block_layout(diffusion_model, family: Family) -> list[tuple[int, int]]:
    """(stack, index) of every block the forward runs, in execution order."""
    layout = []
    for number, stack in enumerate(family.stacks):
        skipped = set(getattr(diffusion_model, stack.skip_attribute, ()) or ()) if stack.skip_attribute else set()
        layout += [(number, index) for index in range(len(stack.blocks(diffusion_model)))
                   if index not in skipped]
    return layout
