"""What DeepCache did on the last sampling run, shown on its node in the page: steps full and cached, and how
many blocks each cached step skipped."""

from __future__ import annotations

from comfy.patcher_extension import WrappersMP

from ..block_stacks import candidate_stacks
from ..page import show_on_node
from .discovery import learned_layout
from .families import block_layout, family_of
from .steps import WRAPPER_KEY, current_run
from .unet import is_unet


def skipped_blocks(diffusion_model, cache_depth: int) -> tuple[int, int]:
    """(blocks a cached step skips, blocks a full step runs) for this model at `cache_depth`."""
    if is_unet(diffusion_model):
        total = len(diffusion_model.input_blocks) + len(diffusion_model.output_blocks)
        total += 1 if diffusion_model.middle_block is not None else 0
        return total - 2 * cache_depth, total
    family = family_of(diffusion_model)
    if family is None:  # the stacks discovery caches (every candidate until a call has shown which)
        layout = learned_layout(diffusion_model)
        total = len(layout) if layout is not None else sum(
            stack.blocks for stack in candidate_stacks(diffusion_model))
    else:
        total = len(block_layout(diffusion_model, family))
    return total - 2 * cache_depth, total


def show_runs_on_node(model, cache_depth: int, node_id: str | None) -> None:
    """After every sampling run of `model` (a DeepCache clone), put that run's summary on the node `node_id`.

    Added under DeepCache's own wrapper key after its step wrapper, so it runs inside it while the run's state is
    still in the guider's options, and a later DeepCache node on the same model removes it with the rest."""
    if node_id is None:
        return
    diffusion_model = model.get_model_object("diffusion_model")

    def deepcache_page_summary(executor, *args, **kwargs):
        guider = executor.class_obj
        try:
            return executor(*args, **kwargs)
        finally:
            run = current_run(guider.model_options.get("transformer_options"))
            if run is not None:
                skipped, total = skipped_blocks(diffusion_model, cache_depth)  # after the run: what it learned
                show_on_node("\n".join([f"{run.summary(notes=False)}; each cached step skipped {skipped} of {total} "
                                         "blocks", *run.notes]), node_id)

    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, deepcache_page_summary)
