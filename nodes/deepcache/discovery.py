"""DeepCache for diffusion models no family entry names: their block stacks found in the module tree, how streams
pass the blocks learned from the first model call, and the result checked against the uncached model.

- Found: its block stacks (`nodes/block_stacks.py`: containers of like blocks holding most of its parameters).
- Learned, on the first call of a sampling run, with the model run as it is: the order the blocks run in (each
  exactly once), and for each stack which of a block's outputs the next block takes, at which argument (by
  identity: the very tensor, passed on unchanged; else the one argument of its shape, where the forward reshapes
  the stream between blocks). Those are the stack's streams; what a block returns after them
  goes back to the forward as it came. A block output that a later block takes outside its streams (a long skip,
  as HunyuanDiT's) makes every middle block its own segment, so each skipped block hands on its own output.
- Checked, on the same call's inputs: the stacks swapped for DeepCache's stand-ins must give the uncached output
  bit for bit while capturing, and within rounding when serving the captured residuals. A model that fails runs
  uncached, and the run's summary says which stacks were tried and why.

Blocks are reached by swapping their container for the duration of a model call, which also serves forwards that
look blocks up through `patches_replace["dit"]` (the stand-in is what `original_block` calls).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..block_stacks import MIN_TOTAL_SHARE, FoundStack, describe, stack_members
from .dit import block_swap
from .families import BlockStack, Family, supported_names
from .segments import middle_places
from .steps import WRAPPER_KEY, FeatureCache, Mode, ModelCall, active_call, active_run, scratch_call

log = logging.getLogger("int8_accel.deepcache")

KEYWORD_ONLY = 1 << 20  # the position of a stream that enters only by keyword


def not_found_message(diffusion_model: torch.nn.Module) -> str:
    cls = type(diffusion_model)
    return (f"DeepCache cannot accelerate this model: its diffusion model is {cls.__name__} (from {cls.__module__}), "
            f"which is none of the models it knows (UNets: SD1.x, SD2.x, SDXL; transformers: {supported_names()}) "
            "and has no stack of transformer blocks it can find (it looks for nn.ModuleList or nn.ModuleDict "
            "containers of two or more blocks of one class, each a module of modules, holding together over "
            f"{100 * MIN_TOTAL_SHARE:.0f}% of the parameters). Bypass this node (Ctrl+B) to run the model without "
            "DeepCache.")


# --- learning from a call ----------------------------------------------------------------------------------------
Place = tuple[int, str]  # (position, keyword) of an argument; KEYWORD_ONLY when it came by keyword only


@dataclass
class _BlockCall:
    """One block call, as discovery keeps it: no tensor (on a GPU, every block's activations of a video model would
    be gigabytes), only each tensor argument's shape and dtype and, where it is a tensor an earlier block returned,
    which (call, output position); the same of the outputs, with a weak reference for identity checks."""

    stack: int
    index: int
    arguments: dict[Place, tuple] = field(default_factory=dict)  # place -> (shape, dtype)
    sources: dict[Place, tuple[int, int]] = field(default_factory=dict)  # place -> (call number, output position)
    outputs: list[tuple | None] = field(default_factory=list)  # per output: (shape, dtype), None when no tensor
    done: bool = False


class LearnFailed(Exception):
    pass


def _parameter_names(block: torch.nn.Module) -> list[str]:
    try:
        parameters = inspect.signature(block.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _outputs(output) -> tuple:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def _tensor_arguments(args: tuple, kwargs: dict) -> list[tuple[Place, torch.Tensor]]:
    found = [((position, ""), arg) for position, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
    return found + [((KEYWORD_ONLY, name), arg) for name, arg in kwargs.items() if isinstance(arg, torch.Tensor)]


def record_block_calls(diffusion_model: torch.nn.Module, stacks: list[FoundStack], run: Callable[[], object]):
    """(what `run` returned, every block call it made in order): each found block hooked for the one call."""
    calls: list[_BlockCall] = []
    returned: dict[int, tuple[weakref.ref, int, int]] = {}  # id(tensor) -> (reference, call number, output position)
    handles = []

    def before(module, args, kwargs, number: int, index: int):
        call = _BlockCall(number, index)
        for place, tensor in _tensor_arguments(args, kwargs):
            call.arguments[place] = (tuple(tensor.shape), tensor.dtype)
            source = returned.get(id(tensor))
            if source is not None and source[0]() is tensor:
                call.sources[place] = source[1:]
        calls.append(call)

    def after(module, args, kwargs, output, number: int, index: int):
        position = next(n for n in range(len(calls) - 1, -1, -1)
                        if calls[n].stack == number and calls[n].index == index and not calls[n].done)
        call = calls[position]
        call.done = True
        for k, value in enumerate(_outputs(output)):
            if isinstance(value, torch.Tensor):
                call.outputs.append((tuple(value.shape), value.dtype))
                returned[id(value)] = (weakref.ref(value), position, k)
            else:
                call.outputs.append(None)

    for number, stack in enumerate(stacks):
        for index, block in enumerate(stack_members(diffusion_model.get_submodule(stack.path))):
            handles.append(block.register_forward_pre_hook(
                lambda m, a, k, number=number, index=index: before(m, a, k, number, index), with_kwargs=True))
            handles.append(block.register_forward_hook(
                lambda m, a, k, o, number=number, index=index: after(m, a, k, o, number, index), with_kwargs=True))
    try:
        return run(), calls
    finally:
        for handle in handles:
            handle.remove()


def learn_family(diffusion_model: torch.nn.Module, stacks: list[FoundStack],
                 calls: list[_BlockCall]) -> tuple[Family, list[tuple[int, int]], bool]:
    """(the family the calls show, its block layout in execution order, whether a block output skips ahead)."""
    seen = [(call.stack, call.index) for call in calls]
    if len(set(seen)) != len(seen):
        repeated = next(key for key in seen if seen.count(key) > 1)
        raise LearnFailed(f"block {repeated[1]} of {stacks[repeated[0]].path} ran more than once in one model call")
    ran = {call.stack for call in calls}
    for number, stack in enumerate(stacks):
        if number not in ran:
            raise LearnFailed(f"{stack.path} ran none of its blocks")
    numbered: dict[int, list[int]] = {}
    for position, call in enumerate(calls):
        numbered.setdefault(call.stack, []).append(position)
    mappings = [_stream_places(stack, calls, numbered[number]) for number, stack in enumerate(stacks)]
    block_stacks = []
    for number, stack in enumerate(stacks):
        names = _parameter_names(stack_members(diffusion_model.get_submodule(stack.path))[0])
        arguments = tuple((position, names[position] if position < len(names) else keyword)
                          for position, keyword in mappings[number])
        extra = max(len(calls[n].outputs) for n in numbered[number]) - len(mappings[number])
        block_stacks.append(BlockStack(stack.path, tuple(f"stream{n}" for n in range(len(mappings[number]))),
                                       arguments=arguments, extra_outputs=extra))
    long_skip = _long_skip(calls, mappings)
    cls = type(diffusion_model)
    family = Family(f"{cls.__name__} (found)", cls.__module__, cls.__name__, tuple(block_stacks))
    return family, seen, long_skip


def _handed_on(calls: list[_BlockCall], previous: int, nxt: int, k: int, taken: list[Place]) -> Place | None:
    """Where call `nxt` took output `k` of call `previous`: the very tensor, else the one argument of its shape
    (the forward reshaped the stream between blocks, as HiDream swaps the prompt rows it appends)."""
    for place, source in calls[nxt].sources.items():
        if source == (previous, k):
            return place
    shape = calls[previous].outputs[k]
    if shape is None:
        return None
    alike = [place for place, argument in calls[nxt].arguments.items() if argument == shape and place not in taken]
    return alike[0] if len(alike) == 1 else None


def _stream_places(stack: FoundStack, calls: list[_BlockCall], numbers: list[int]) -> list[Place]:
    """Where each of a block's leading outputs enters the next block of the stack: the same for every pair."""
    if len(numbers) < 2:
        raise LearnFailed(f"{stack.path} ran one block only")
    mapping = None
    for previous, nxt in zip(numbers, numbers[1:], strict=False):
        places: list[Place] = []
        for k in range(len(calls[previous].outputs)):
            place = _handed_on(calls, previous, nxt, k, places)
            if place is None:
                break
            places.append(place)
        if mapping is None:
            mapping = places
        elif places != mapping:
            raise LearnFailed(f"the blocks of {stack.path} do not all pass their outputs on the same way")
    if not mapping:
        raise LearnFailed(f"no output of a block of {stack.path} reaches the next block unchanged")
    return mapping


def _long_skip(calls: list[_BlockCall], mappings: list[list[Place]]) -> bool:
    """Whether a block's output reaches a later block other than as a stream handed on (HunyuanDiT's skips)."""
    for position, call in enumerate(calls):
        for place, (source, _) in call.sources.items():
            handed_on = place in mappings[call.stack] and (calls[source].stack == call.stack or position == source + 1)
            if not handed_on:
                return True
    return False


# --- the check and the wrapper -------------------------------------------------------------------------------------
def _cloned(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    """What serving captured residuals may change on the same inputs: `x + (y - x)` rounds in the model's dtype."""
    return max(1e-4, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-4


@dataclass
class Learned:
    family: Family | None = None
    swap: Callable | None = None
    failure: str | None = None  # why the model runs uncached
    note: str = ""  # what the run's summary tells (the blocks found, or the failure)


def _tell(note: str) -> None:
    """Put `note` in the summary of the sampling run whose model call is executing (once per run)."""
    run = active_run()
    if run is not None and note and note not in run.notes:
        run.notes.append(note)


def runs_diffusion_model_wrappers(diffusion_model: torch.nn.Module) -> bool:
    """Whether the model's forward runs ComfyUI's DIFFUSION_MODEL wrappers (most DiTs do; SD3's MMDiT, PixArt and
    HunyuanDiT do not), read from its source."""
    try:
        return "DIFFUSION_MODEL" in inspect.getsource(type(diffusion_model).forward)
    except (OSError, TypeError):
        return False


class DiscoveredBlocks:
    """DeepCache on a model whose blocks it found: learns and checks on the first call of a run that caches, then
    swaps the stacks for cached and capturing calls. It works from the DIFFUSION_MODEL wrapper (innermost: other
    nodes' wrappers see the real model) where the forward runs those, else from an APPLY_MODEL wrapper inside
    DeepCache's step wrapper."""

    def __init__(self, stacks: list[FoundStack], depth: int) -> None:
        self.stacks = stacks
        self.depth = depth
        self._learned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def install(self, model) -> None:
        from comfy.patcher_extension import WrappersMP

        if runs_diffusion_model_wrappers(model.get_model_object("diffusion_model")):
            model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, self.diffusion_model)
        else:
            model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, self.apply_model)

    def diffusion_model(self, executor, *args, **kwargs):
        return self._run(executor.class_obj, executor, args, kwargs)

    def apply_model(self, executor, *args, **kwargs):
        return self._run(executor.class_obj.diffusion_model, executor, args, kwargs)

    def _run(self, net: torch.nn.Module, executor, args: tuple, kwargs: dict):
        def call_as_is():
            return executor(*args, **kwargs)

        def fresh_call():  # the learning and checking calls each get their own copies of the inputs
            return executor(*[_cloned(a) for a in args], **{k: _cloned(v) for k, v in kwargs.items()})

        call = active_call()
        learned = self._learned.get(net)
        if learned is None:
            if call is None or call.mode is Mode.FULL:
                return call_as_is()
            return self._learn_and_check(net, fresh_call, call)
        _tell(learned.note)
        if learned.failure is not None:
            return call_as_is()
        return learned.swap(_Executor(call_as_is, net))

    def _learn_and_check(self, net, fresh_call: Callable, call: ModelCall):
        reference, calls = record_block_calls(net, self.stacks, fresh_call)
        learned = Learned()
        try:
            family, layout, long_skip = learn_family(net, self.stacks, calls)
            calls.clear()
            if len(layout) - 2 * self.depth < 1:
                raise LearnFailed(f"its {len(layout)} blocks leave no middle block at cache_depth {self.depth}")
            places = middle_places(layout, self.depth, every_block=long_skip)
            swap = block_swap(family, places)
            learned.family, learned.swap = family, swap
            self._check(net, swap, fresh_call, reference, call)
            learned.note = (f"DeepCache found the blocks of {type(net).__name__}, which it does not know by name: "
                            f"{describe(self.stacks)}; checked against the uncached model on the first call"
                            + ("; a block's output reaches a later block, so every skipped block is served its own"
                               if long_skip else ""))
            log.info("%s", learned.note)
        except LearnFailed as why:
            learned.family = learned.swap = None
            learned.failure = learned.note = (
                f"DeepCache ran {type(net).__name__} uncached: the blocks it found ({describe(self.stacks)}) did not "
                f"reproduce the model: {why}")
            log.warning("%s", learned.failure)
        _tell(learned.note)
        self._learned[net] = learned
        return reference

    def _check(self, net, swap: Callable, fresh_call: Callable, reference, call: ModelCall) -> None:
        run = active_run()
        cache = run.cache.fresh() if run is not None else FeatureCache()
        step = run.step if run is not None else 0
        outputs = {}
        for mode in (Mode.CAPTURE, Mode.CACHED):
            with scratch_call(mode, call.chunk_ids, cache, step) as check:
                try:
                    outputs[mode] = swap(_Executor(fresh_call, net))
                except Exception as error:  # noqa: BLE001 - whatever the stand-ins broke, the model runs uncached
                    raise LearnFailed(f"a {mode.value} call through DeepCache's stand-ins raised "
                                      f"{type(error).__name__}: {error}") from error
            if not check.blocks_seen:
                raise LearnFailed("the forward never called the blocks DeepCache put in place of them")
            if check.fell_back:
                raise LearnFailed("the captured features did not serve the same inputs")
        if not torch.equal(outputs[Mode.CAPTURE], reference):
            raise LearnFailed("capturing through DeepCache's stand-ins changed the output")
        error = _rel(outputs[Mode.CACHED], reference)
        if not error <= tolerance(reference.dtype):
            raise LearnFailed(f"serving the captured features on the same inputs changed the output by {error:.2e} "
                              f"(relative; at most {tolerance(reference.dtype):.0e} is rounding)")
        if call.mode is Mode.CAPTURE and run is not None:  # this call's features are captured already
            run.cache.adopt(cache)
            call.blocks_seen = True


class _Executor:
    """A stand-in for ComfyUI's wrapper executor around the check's calls (the swap reads `class_obj`)."""

    def __init__(self, fresh_call: Callable, net: torch.nn.Module) -> None:
        self._call = fresh_call
        self.class_obj = net

    def __call__(self, *args, **kwargs):
        return self._call()
