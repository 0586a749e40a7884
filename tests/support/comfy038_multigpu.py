"""ComfyUI 0.38.1's MultiGPU CFG split, to swap into the real ComfyUI 0.3.75 (which has no MultiGPU).

Read from Comfy-Org/ComfyUI:
- comfy/samplers.py at 311c01406130b2acbe8ab291043502de26cf3871: `_calc_cond_batch` hands a call whose
  model_options hold `multigpu_clones` to `_calc_cond_batch_multigpu`, which spreads the conds over the devices
  (`conds_per_device = ceil(total / devices)`, round robin), then runs `_handle_batch(device, ...)` for every
  device at once on the threads of `model_options["multigpu_thread_pool"]`: inside `torch.no_grad()` (not
  inference mode), `model_options["multigpu_clones"][device].model.apply_model(input_x, timestep_, **c)` with
  `transformer_options` from that clone's `apply_hooks` merged with the main model_options' (the same wrappers for
  every device), plus `cond_or_uncond`, `uuids`, `sigmas`, `sample_sigmas` and `multigpu_thread_device = device`.
- comfy/multigpu.py (stored file id 56344568975): `MultiGPUThreadPool` keeps one persistent worker thread per
  device (it calls `torch.cuda.set_device` first: left out here, the devices are CPUs); `submit` / `get_result`.
- comfy/model_patcher.py at 08d0e510f4e539a1db39072589817136ac6cfa7d: `deepclone_multigpu` first unloads the model
  and its clones (`comfy.model_management.unload_model_and_clones(self)`), then loads a fresh model with the
  loader's `cached_patcher_init` and makes `self.clone(model_override=(fresh.model, ({}, {}, {}, set())))` with
  `load_device = new_load_device`: the same wrappers, callbacks and patches, another BaseModel.

Reduced to what a CPU runs: no memory-fit batching (every cond fits), no hooks, areas or control. The two
"devices" are `cpu` and `cpu:0`, two keys of one CPU, each with its own thread and its own model.
"""

from __future__ import annotations

import math
import queue
import threading

import torch


class MultiGPUThreadPool:
    """comfy/multigpu.py `MultiGPUThreadPool` (0.38.1), without `torch.cuda.set_device`."""

    def __init__(self, devices: list[torch.device]) -> None:
        self._work: dict[torch.device, queue.Queue] = {}
        self._results: dict[torch.device, queue.Queue] = {}
        self._workers = []
        for device in devices:
            self._work[device], self._results[device] = queue.Queue(), queue.Queue()
            worker = threading.Thread(target=self._loop, args=(self._work[device], self._results[device]),
                                      daemon=True)
            worker.start()
            self._workers.append(worker)

    @staticmethod
    def _loop(work: queue.Queue, results: queue.Queue) -> None:
        while True:
            item = work.get()
            if item is None:
                break
            fn, args = item
            try:
                results.put((fn(*args), None))
            except Exception as error:  # noqa: BLE001 - handed back to the caller, as 0.38.1 does
                results.put((None, error))

    def submit(self, device, fn, *args) -> None:
        self._work[device].put((fn, args))

    def get_result(self, device):
        return self._results[device].get()

    def shutdown(self) -> None:
        for work in self._work.values():
            work.put(None)
        for worker in self._workers:
            worker.join(timeout=5.0)


def calc_cond_batch_multigpu(model, conds, x_in, timestep, model_options):
    """comfy/samplers.py `_calc_cond_batch_multigpu` (0.38.1), reduced as the module docstring says."""
    import comfy.patcher_extension
    import comfy.samplers

    out_conds, out_counts, to_run = [], [], []
    for i, cond in enumerate(conds):
        out_conds.append(torch.zeros_like(x_in))
        out_counts.append(torch.ones_like(x_in) * 1e-37)
        for x in cond or []:
            p = comfy.samplers.get_area_and_mult(x, x_in, timestep)
            if p is not None:
                to_run.append((p, i))
    model.current_patcher.prepare_state(timestep)  # 0.3.75 takes no model_options

    devices = list(model_options["multigpu_clones"].keys())
    per_device = max(1, math.ceil(len(to_run) / len(devices)))
    batches: dict[torch.device, list] = {}
    index = 0
    while to_run:
        device = devices[index % len(devices)]
        first = to_run[0]
        batch = [x for x in range(len(to_run)) if comfy.samplers.can_concat_cond(to_run[x][0], first[0])]
        batch = batch[:per_device]
        batches.setdefault(device, []).append([to_run.pop(x) for x in reversed(batch)])
        index += 1

    def handle_batch(device, device_batches):
        model_current = model_options["multigpu_clones"][device].model
        results = []
        with torch.no_grad():
            for to_batch in device_batches:
                input_x = torch.cat([p.input_x for p, _ in to_batch]).to(device)
                c = comfy.samplers.cond_cat([p.conditioning for p, _ in to_batch])
                c = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in c.items()}
                cond_or_uncond = [i for _, i in to_batch]
                timestep_ = torch.cat([timestep.to(device)] * len(to_batch))
                transformer_options = model_current.current_patcher.apply_hooks(hooks=None)
                if "transformer_options" in model_options:
                    transformer_options = comfy.patcher_extension.merge_nested_dicts(
                        transformer_options, model_options["transformer_options"], copy_dict1=False)
                transformer_options["cond_or_uncond"] = cond_or_uncond[:]
                transformer_options["uuids"] = [p.uuid for p, _ in to_batch]
                transformer_options["sigmas"] = timestep.to(device)
                transformer_options["sample_sigmas"] = transformer_options["sample_sigmas"].to(device)
                transformer_options["multigpu_thread_device"] = device
                c["transformer_options"] = transformer_options
                output = model_current.apply_model(input_x, timestep_, **c).to(x_in.device).chunk(len(to_batch))
                results.append((output, [p.mult for p, _ in to_batch], cond_or_uncond))
        return results

    pool = model_options["multigpu_thread_pool"]
    for device, device_batches in batches.items():
        pool.submit(device, handle_batch, device, device_batches)
    for device in batches:
        results, error = pool.get_result(device)
        if error is not None:
            raise error
        for output, mult, cond_or_uncond in results:
            for o, cond_index in enumerate(cond_or_uncond):
                out_conds[cond_index] += output[o] * mult[o]
                out_counts[cond_index] += mult[o]
    return [c / n for c, n in zip(out_conds, out_counts, strict=True)]


def install(monkeypatch) -> None:
    """0.38.1's `_calc_cond_batch` dispatch: calls whose model_options hold `multigpu_clones` go multigpu."""
    import comfy.samplers

    single = comfy.samplers._calc_cond_batch

    def calc_cond_batch(model, conds, x_in, timestep, model_options):
        if "multigpu_clones" in model_options:
            return calc_cond_batch_multigpu(model, conds, x_in, timestep, model_options)
        return single(model, conds, x_in, timestep, model_options)

    monkeypatch.setattr(comfy.samplers, "_calc_cond_batch", calc_cond_batch)


def unload_model_and_clones(patcher) -> None:
    """`comfy.model_management.unload_model_and_clones(model, unload_additional_models=True, all_devices=False)`
    (0.38.1), which 0.3.75 lacks. No stored comfy/model_management.py holds it (02b2b388 has none); its body as
    other projects' tests read it: every loaded model is kept but those of `model`'s clone family and of its nested
    additional models, and `free_memory(1e30, get_torch_device(), keep_loaded)` unloads the rest (fully: weights
    unpatched, backups restored). 0.38 tells a clone by its `clone_base_uuid`, which 0.3.75's patchers lack:
    sharing the model (`is_clone`) stands in for it (a deep clone shares the uuid but not the model, and sits on
    another device, which a free of this one leaves alone)."""
    import comfy.model_management as mm

    family = [patcher, *patcher.get_nested_additional_models()]
    keep = [loaded for loaded in mm.current_loaded_models
            if not any(member.is_clone(loaded.model) for member in family)]
    mm.free_memory(1e30, mm.get_torch_device(), keep)


def device_clone(patcher, fresh_model, device: torch.device):
    """comfy/model_patcher.py `deepclone_multigpu` (0.38.1) on 0.3.75's clone: `patcher` and its clones unloaded,
    then `patcher`'s patches, wrappers, callbacks and model_options over `fresh_model` (the loader's fresh load)
    with empty backups."""
    unload_model_and_clones(patcher)
    clone = patcher.clone()
    clone.model = fresh_model
    clone.backup, clone.object_patches_backup = {}, {}
    clone.load_device = device
    return clone


def with_multigpu(patcher, fresh_model, device: torch.device):
    """`patcher` as MultiGPU leaves it for the sampler: its clone for `device` among its additional models (loaded
    with it), `multigpu_clones` {its device: itself, device: the clone} and the thread pool in its model_options."""
    split = patcher.clone()
    other = device_clone(split, fresh_model, device)
    split.set_additional_models("multigpu", [other])
    # 0.38.1's sampler pre-runs every device clone with the main model (`current_patcher` set on each model)
    import comfy.patcher_extension

    split.add_callback(comfy.patcher_extension.CallbacksMP.ON_PRE_RUN, lambda _patcher: other.pre_run())
    pool = MultiGPUThreadPool([split.load_device, device])
    split.model_options["multigpu_clones"] = {split.load_device: split, device: other}
    split.model_options["multigpu_thread_pool"] = pool
    return split, other, pool
