"""One model call watched block by block, for discovery: which blocks of the candidate stacks ran, in what order, how
each was entered (called as a module, or through a method of its class such as `layer.forward_generation(...)`),
the shapes of what went in and came out and where it came from, the multiply-accumulates of the weighted layers
each block ran (and of the whole call), and copies of the few block inputs and outputs that the residuals of the
first call's segments are taken from (so that call captures as a capturing call would, without a second forward).

Compute is counted, not timed: a weighted layer (a Linear or Conv, any module with a 2-D or larger `weight`) costs
`weight.numel()` multiply-accumulates per output position, the same on every machine.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..block_stacks import FoundStack, stack_members

KEYWORD_ONLY = 1 << 20  # the position of an argument that enters only by keyword
MODULE_CALL = ""  # BlockCall.entry of a block called as a module
Place = tuple[int, str]  # (position, keyword) of an argument; KEYWORD_ONLY when it came by keyword only


@dataclass
class BlockCall:
    """One block call, as discovery keeps it: no tensor (on a GPU, every block's activations of a video model would
    be gigabytes), only each tensor argument's shape and dtype and, where it is a tensor an earlier block returned,
    which (call, output position); the same of the outputs."""

    stack: int
    index: int
    entry: str = MODULE_CALL  # how the forward entered the block: a module call, else the method's name
    arguments: dict[Place, tuple] = field(default_factory=dict)  # place -> (shape, dtype)
    sources: dict[Place, tuple[int, int]] = field(default_factory=dict)  # place -> (call number, output position)
    outputs: list[tuple | None] = field(default_factory=list)  # per output: (shape, dtype), None when no tensor
    macs: int = 0  # multiply-accumulates of the weighted layers the block ran
    done: bool = False


@dataclass
class Recording:
    calls: list[BlockCall]
    macs: list[int]  # per candidate stack
    total_macs: int  # of the whole model call
    inputs: dict[int, dict[Place, torch.Tensor]]  # call number -> copies of its tensor arguments
    outputs: dict[int, tuple]  # call number -> copies of its outputs (None where no tensor)

    def keep(self, numbers: list[int]) -> Recording:
        """This recording with only the calls `numbers` (in order), renumbered; sources from calls dropped are
        dropped (those tensors come from outside the kept blocks)."""
        new_number = {old: new for new, old in enumerate(numbers)}
        calls = []
        for old in numbers:
            call = self.calls[old]
            sources = {place: (new_number[source], k) for place, (source, k) in call.sources.items()
                       if source in new_number}
            calls.append(BlockCall(call.stack, call.index, call.entry, call.arguments, sources, call.outputs,
                                   call.macs, call.done))
        return Recording(calls, self.macs, self.total_macs,
                         {new_number[n]: v for n, v in self.inputs.items() if n in new_number},
                         {new_number[n]: v for n, v in self.outputs.items() if n in new_number})


def outputs_of(output) -> tuple:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def tensor_arguments(args: tuple, kwargs: dict) -> list[tuple[Place, torch.Tensor]]:
    found = [((position, ""), arg) for position, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
    return found + [((KEYWORD_ONLY, name), arg) for name, arg in kwargs.items() if isinstance(arg, torch.Tensor)]


def block_methods(block: torch.nn.Module) -> list[str]:
    """The methods a forward may enter the block by: plain functions of its own classes (not nn.Module's), dunders and
    `forward` (a module call) aside."""
    names: list[str] = []
    for cls in type(block).__mro__:
        if cls is torch.nn.Module or cls is object:
            break
        for name, value in vars(cls).items():
            if isinstance(value, types.FunctionType) and not name.startswith("__") and name != "forward" \
                    and name not in names:
                names.append(name)
    return names


def _weighted_layers(net: torch.nn.Module) -> list[torch.nn.Module]:
    layers = []
    for module in net.modules():
        weight = getattr(module, "weight", None)
        if (next(module.children(), None) is None and isinstance(weight, torch.Tensor) and weight.dim() >= 2
                and not isinstance(module, torch.nn.Embedding)):
            layers.append(module)
    return layers


def record_block_calls(net: torch.nn.Module, stacks: list[FoundStack], run: Callable[[], object],
                       depth: int) -> tuple[object, Recording]:
    """(what `run` returned, the recording of the call): each candidate block watched for the one call. `depth`:
    in every run of one stack's blocks, the inputs of the first `depth` + 1 calls of each way of entering them (a
    lane: module call, or one method) and the outputs of the last `depth` + 1 are copied (where a segment of the
    cache may start and end)."""
    calls: list[BlockCall] = []
    returned: dict[int, tuple[weakref.ref, int, int]] = {}  # id(tensor) -> (reference, call number, output position)
    active: list[int] = []  # call numbers of the blocks running now (outermost entries only)
    running: dict[int, int] = {}  # id(block) -> its call number while it runs
    macs = [0] * len(stacks)
    total = [0]
    inputs: dict[int, dict[Place, torch.Tensor]] = {}
    outputs: dict[int, tuple] = {}
    # per lane (stack, entry) of the current run of one stack's blocks: calls so far, and the latest call numbers
    lane_calls: dict[tuple[int, str], int] = {}
    lane_latest: dict[tuple[int, str], list[int]] = {}
    run_stack: list[int | None] = [None]

    def enter(block, number: int, index: int, entry: str, args: tuple, kwargs: dict) -> bool:
        if id(block) in running:  # the block's own forward calling its methods, or a method calling the forward
            return False
        position = len(calls)
        call = BlockCall(number, index, entry)
        if run_stack[0] != number:  # a new run: the copies of the last one stay as they are
            run_stack[0] = number
            lane_calls.clear()
            lane_latest.clear()
        copy = lane_calls.get((number, entry), 0) <= depth
        lane_calls[(number, entry)] = lane_calls.get((number, entry), 0) + 1
        copies = {}
        for place, tensor in tensor_arguments(args, kwargs):
            call.arguments[place] = (tuple(tensor.shape), tensor.dtype)
            source = returned.get(id(tensor))
            if source is not None and source[0]() is tensor:
                call.sources[place] = source[1:]
            if copy:
                copies[place] = tensor.clone()
        if copy:
            inputs[position] = copies
        calls.append(call)
        running[id(block)] = position
        active.append(position)
        return True

    def leave(block, output) -> None:
        position = running.pop(id(block))
        active.remove(position)
        call = calls[position]
        call.done = True
        kept = []
        for k, value in enumerate(outputs_of(output)):
            if isinstance(value, torch.Tensor):
                call.outputs.append((tuple(value.shape), value.dtype))
                returned[id(value)] = (weakref.ref(value), position, k)
                kept.append(value.clone())
            else:
                call.outputs.append(None)
                kept.append(None)
        outputs[position] = tuple(kept)
        latest = lane_latest.setdefault((call.stack, call.entry), [])
        latest.append(position)
        if len(latest) > depth + 1:  # no longer among the last depth + 1 of its lane
            outputs.pop(latest.pop(0), None)

    def count(module, args, output) -> None:
        if not isinstance(output, torch.Tensor):
            return
        weight = module.weight
        work = output.numel() // max(weight.shape[0], 1) * weight.numel()
        total[0] += work
        if active:
            call = calls[active[0]]
            call.macs += work
            macs[call.stack] += work

    def entering_method(block, method, number: int, index: int, name: str):
        def watched(*args, **kwargs):
            if not enter(block, number, index, name, args, kwargs):
                return method(*args, **kwargs)
            try:
                output = method(*args, **kwargs)
            except BaseException:
                running.pop(id(block), None)
                raise
            leave(block, output)
            return output

        return watched

    handles = [layer.register_forward_hook(count) for layer in _weighted_layers(net)]
    patched: list[tuple[torch.nn.Module, str]] = []
    entered_by_module: set[int] = set()

    def before(module, args, kwargs, number: int, index: int):
        if enter(module, number, index, MODULE_CALL, args, kwargs):
            entered_by_module.add(len(calls) - 1)

    def after(module, args, kwargs, output):
        position = running.get(id(module))
        if position is not None and position in entered_by_module:
            leave(module, output)

    for number, stack in enumerate(stacks):
        for index, block in enumerate(stack_members(net.get_submodule(stack.path))):
            handles.append(block.register_forward_pre_hook(
                lambda m, a, k, number=number, index=index: before(m, a, k, number, index), with_kwargs=True))
            handles.append(block.register_forward_hook(after, with_kwargs=True))
            for name in block_methods(block):
                if name not in block.__dict__:
                    block.__dict__[name] = entering_method(block, getattr(block, name), number, index, name)
                    patched.append((block, name))
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
        for block, name in patched:
            del block.__dict__[name]
    return result, Recording(calls, macs, total[0], inputs, outputs)
