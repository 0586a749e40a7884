"""ComfyUI 0.38's per-block weight prefetch under dynamic VRAM (comfy/model_prefetch.py, Comfy-Org/ComfyUI
03fb330a7f50e51fd7b3de126a288b089871c5e6), reduced to what decides which weights are streamed.

A model that prefetches (Qwen-Image 2.1, LTX-2) builds a queue from its block list (`make_prefetch_queue`) and,
at the top of each block's turn, before it looks up block patches, pops it (`prefetch_queue_pop`), which streams
every module of that block holding a VBAR slot (`_v`). On a CPU 0.38 builds no queue; `record_prefetch` puts the
queue in place (as on a CUDA device under dynamic VRAM) and records, per model call, which blocks' weights would
have been streamed. The tiny 0.38 models call these through `harness.comfy038_prefix_models.model_prefetch`.
"""

from __future__ import annotations

import torch


def make_prefetch_queue(queue, device, transformer_options):
    """0.38's `make_prefetch_queue` past its checks (dynamic VRAM on a CUDA device with offload streams)."""
    return [None] + queue + [None]


def prefetch_queue_pop(streamed: list, queue, device, module, dtype=None, core=None, enable_graph=False,
                       generator=None, malloc_scope=None):
    """0.38's `prefetch_queue_pop` without its CUDA-graph branches (no allocation graph runs on a CPU); the
    modules `pin_modules` would stream are appended to `streamed`."""
    if queue is None:
        if core is not None:
            core()
        return
    queue.pop(0)
    prefetch = queue[0]
    if prefetch is not None:
        comfy_modules = []
        prefetch_modules = prefetch if isinstance(prefetch, (list, tuple)) else (prefetch,)
        for root in prefetch_modules:
            for s in root.modules():
                if hasattr(s, "_v"):
                    comfy_modules.append(s)
        streamed.append(comfy_modules)
        queue[0] = (None, (module, comfy_modules))
    if core is not None:
        core()


def record_prefetch(monkeypatch, blocks) -> list[set[int]]:
    """Give every Linear of `blocks` a VBAR slot (as `ModelPatcherDynamic.load` does) and install the prefetch
    above; returns a list that gets, per model call, the indices of the blocks whose weights were streamed."""
    from harness import comfy038_prefix_models

    block_of = {}
    for index, block in enumerate(blocks):
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                monkeypatch.setattr(module, "_v", (index,), raising=False)
                block_of[module] = index
    calls: list[list] = []
    streamed: list[set[int]] = []

    def new_queue(queue, device, transformer_options):
        calls.append([])
        streamed.append(set())
        return make_prefetch_queue(queue, device, transformer_options)

    def pop(*args, **kwargs):
        prefetch_queue_pop(calls[-1], *args, **kwargs)
        streamed[-1] = {block_of[m] for modules in calls[-1] for m in modules}

    prefetch = comfy038_prefix_models.model_prefetch
    monkeypatch.setattr(prefetch, "make_prefetch_queue", new_queue)
    monkeypatch.setattr(prefetch, "prefetch_queue_pop", pop)
    return streamed
