"""One model call watched block by block, for discovery: which blocks of the candidate stacks ran, in what order, how
each was entered (called as a module, or through a method of its class such as `layer.forward_generation(...)`),
the shapes of what went in and came out and where it came from, the multiply-accumulates of the weighted layers
each block ran (and of the whole call), and copies of the few block inputs and outputs that the residuals of the
first call's segments are taken from (so that call captures as a capturing call would, without a second forward).

A block entered twice in one call the same way (Qwen-Image 2.1's first call runs each block on the prompt rows,
then on the image rows) is in two lanes: a lane is a way of entering (module call or method) and how many times the
block was entered that way before in the call (`BlockCall.occurrence`).

Each block's own residual (per stream: what it returned minus what it took, where the stream enters it as the
lane's previous block handed it on) is taken too, and kept where the forward holds on to a block's output after
the lane's next block has taken it (a long skip, as HunyuanDiT's list of skips: every skipped block is then a
segment of its own and needs its own residual); otherwise only the last two of each lane are kept.

A block the forward never enters but whose children it calls itself (Prism's `fused.video_block(...)`) is not
reached; which children were called is recorded for the summary.

A stream may be an object holding tensors (TRELLIS.2's `SparseTensor`: coordinates and feats): it is followed as
a tensor is, its copies and residuals taken per floating-point field (`stream_objects`).

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
from .stream_objects import cloned, described, difference, is_stream_value

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
    occurrence: int = 0  # how many times the forward had entered this block this way before, in this call
    arguments: dict[Place, tuple] = field(default_factory=dict)  # place -> (shape, dtype)
    sources: dict[Place, tuple[int, int]] = field(default_factory=dict)  # place -> (call number, output position)
    outputs: list[tuple | None] = field(default_factory=list)  # per output: (shape, dtype), None when no tensor
    macs: int = 0  # multiply-accumulates of the weighted layers the block ran
    done: bool = False

    @property
    def lane(self) -> tuple[str, int]:
        return (self.entry, self.occurrence)

    def signature(self) -> tuple:
        """The places, shapes and dtypes of its tensor arguments (what tells two lanes' calls apart)."""
        return tuple(sorted(self.arguments.items()))


def shapes_signature(args: tuple, kwargs: dict) -> tuple:
    """`BlockCall.signature` of a call about to be made with these arguments."""
    return tuple(sorted((place, described(value)) for place, value in tensor_arguments(args, kwargs)))


@dataclass
class Recording:
    calls: list[BlockCall]
    macs: list[int]  # per candidate stack
    total_macs: int  # of the whole model call
    inputs: dict[int, dict[Place, torch.Tensor]]  # call number -> copies of its tensor arguments
    outputs: dict[int, tuple]  # call number -> copies of its outputs (None where no tensor)
    # call number -> (where each stream entered it, per stream its output minus that input, None where the shapes
    # differ): the block's own residual
    residuals: dict[int, tuple[list[Place], tuple]] = field(default_factory=dict)
    # stack number -> the children of its blocks the forward called itself, outside any call of their block
    # (ComfyUI 0.38.1's Prism: `fused.video_block(...)`, `fused.audio_block(...)`), in the order first called
    children: dict[int, list[str]] = field(default_factory=dict)

    def keep(self, numbers: list[int]) -> Recording:
        """This recording with only the calls `numbers` (in order), renumbered; sources from calls dropped are
        dropped (those tensors come from outside the kept blocks)."""
        new_number = {old: new for new, old in enumerate(numbers)}
        calls = []
        for old in numbers:
            call = self.calls[old]
            sources = {place: (new_number[source], k) for place, (source, k) in call.sources.items()
                       if source in new_number}
            calls.append(BlockCall(call.stack, call.index, call.entry, call.occurrence, call.arguments, sources,
                                   call.outputs, call.macs, call.done))
        return Recording(calls, self.macs, self.total_macs,
                         {new_number[n]: v for n, v in self.inputs.items() if n in new_number},
                         {new_number[n]: v for n, v in self.outputs.items() if n in new_number},
                         {new_number[n]: v for n, v in self.residuals.items() if n in new_number}, self.children)


def handed_on(calls: list[BlockCall], previous: int, nxt: int, k: int, taken: list[Place]) -> Place | None:
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


def stream_places(calls: list[BlockCall], previous: int, nxt: int) -> list[Place]:
    """Where each of call `previous`'s leading outputs enters call `nxt` (up to the first that does not)."""
    places: list[Place] = []
    for k in range(len(calls[previous].outputs)):
        place = handed_on(calls, previous, nxt, k, places)
        if place is None:
            break
        places.append(place)
    return places


def outputs_of(output) -> tuple:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def tensor_arguments(args: tuple, kwargs: dict) -> list[tuple[Place, object]]:
    """The arguments that may be streams: tensors, and objects holding tensors (`stream_objects`)."""
    found = [((position, ""), arg) for position, arg in enumerate(args) if is_stream_value(arg)]
    return found + [((KEYWORD_ONLY, name), arg) for name, arg in kwargs.items() if is_stream_value(arg)]


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
    in every run of one stack's blocks, the inputs of the first `depth` + 1 calls of each lane and the outputs of
    the last `depth` + 1 are copied (where a segment of the cache may start and end), and the blocks' own
    residuals are taken (see the module's text)."""
    calls: list[BlockCall] = []
    returned: dict[int, tuple[weakref.ref, int, int]] = {}  # id(tensor) -> (reference, call number, output position)
    active: list[int] = []  # call numbers of the blocks running now (outermost entries only)
    running: dict[int, int] = {}  # id(block) -> its call number while it runs
    macs = [0] * len(stacks)
    total = [0]
    inputs: dict[int, dict[Place, torch.Tensor]] = {}
    outputs: dict[int, tuple] = {}
    residuals: dict[int, tuple[list[Place], tuple]] = {}
    entered: dict[tuple[int, str], int] = {}  # (id(block), entry) -> times entered so far
    # per lane (stack, entry, occurrence) of the current run of one stack's blocks: calls so far, the latest call
    # numbers (outputs copied), the latest whose residuals are kept
    lane_calls: dict[tuple, int] = {}
    lane_latest: dict[tuple, list[int]] = {}
    lane_residuals: dict[tuple, list[int]] = {}
    run_stack: list[int | None] = [None]
    stream_inputs: dict[int, tuple[list[Place], dict[Place, torch.Tensor]]] = {}  # while a call runs
    consumed: dict[int, int] = {}  # call number -> the latest call of its lane that took one of its outputs
    streams_taken: dict[int, set[int]] = {}  # call number -> which of its outputs a later call of its lane took
    pending: set[int] = set()  # calls whose outputs were not yet seen released or held
    held = [False]  # the forward held a block output after the next block took it: keep every residual

    def judge(now: int) -> None:
        """Whether the forward still holds the outputs of calls a later call has taken, now that another entered."""
        for number in [n for n in pending if consumed.get(n, now) < now]:
            pending.discard(number)
            for reference, (ref, source, k) in list(returned.items()):
                if source == number and k in streams_taken[number] and ref() is not None \
                        and id(ref()) == reference:
                    held[0] = True

    def lane_of(call: BlockCall) -> tuple:
        return (call.stack, *call.lane)

    def enter(block, number: int, index: int, entry: str, args: tuple, kwargs: dict) -> bool:
        if id(block) in running:  # the block's own forward calling its methods, or a method calling the forward
            return False
        position = len(calls)
        occurrence = entered.get((id(block), entry), 0)
        entered[(id(block), entry)] = occurrence + 1
        call = BlockCall(number, index, entry, occurrence)
        lane = lane_of(call)
        if run_stack[0] != number:  # a new run: the copies of the last one stay as they are
            run_stack[0] = number
            lane_calls.clear()
            lane_latest.clear()
        copy = lane_calls.get(lane, 0) <= depth
        lane_calls[lane] = lane_calls.get(lane, 0) + 1
        arguments = tensor_arguments(args, kwargs)
        for place, tensor in arguments:
            call.arguments[place] = described(tensor)
            source = returned.get(id(tensor))
            if source is not None and source[0]() is tensor:
                call.sources[place] = source[1:]
                if lane_of(calls[source[1]]) == lane:  # a stream handed on (not keys a cache keeps, say)
                    consumed[source[1]] = position
                    streams_taken.setdefault(source[1], set()).add(source[2])
        if copy:
            inputs[position] = {place: cloned(tensor) for place, tensor in arguments}
        calls.append(call)
        judge(position)
        previous = lane_latest.get(lane, [None])[-1]
        if previous is not None and calls[previous].done:
            places = stream_places(calls, previous, position)
            values = dict(arguments)
            stream_inputs[position] = (places, {place: inputs[position][place] if copy else cloned(values[place])
                                                for place in places})
            if len(lane_latest[lane]) == 1 and previous in inputs and previous in outputs:
                # the lane's first call: its residual, now that the streams' places are known
                _take_residual(previous, places, inputs[previous], outputs[previous])
        running[id(block)] = position
        active.append(position)
        return True

    def _take_residual(number: int, places: list[Place], taken: dict[Place, torch.Tensor], output: tuple) -> None:
        values = []
        for k, place in enumerate(places):
            value = output[k] if k < len(output) else None
            values.append(difference(value, taken[place]) if value is not None and is_stream_value(value)
                          and place in taken else None)
        residuals[number] = (places, tuple(values))
        kept = lane_residuals.setdefault(lane_of(calls[number]), [])
        kept.append(number)
        if len(kept) > 2 and not held[0]:
            residuals.pop(kept.pop(0), None)

    def leave(block, output) -> None:
        position = running.pop(id(block))
        active.remove(position)
        call = calls[position]
        call.done = True
        kept = []
        values = outputs_of(output)
        for k, value in enumerate(values):
            if is_stream_value(value):
                call.outputs.append(described(value))
                try:
                    returned[id(value)] = (weakref.ref(value), position, k)
                except TypeError:  # an object without weak references is not followed to the next block
                    pass
                kept.append(cloned(value))
            else:
                call.outputs.append(None)
                kept.append(None)
        outputs[position] = tuple(kept)
        pending.add(position)
        if position in stream_inputs:
            places, taken = stream_inputs.pop(position)
            _take_residual(position, places, taken, values)
        latest = lane_latest.setdefault(lane_of(call), [])
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
                stream_inputs.pop(running.pop(id(block), -1), None)
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

    children: dict[int, list[str]] = {}

    def child_called(block, number: int, name: str) -> None:
        if id(block) not in running and name not in children.setdefault(number, []):
            children[number].append(name)

    for number, stack in enumerate(stacks):
        for index, block in enumerate(stack_members(net.get_submodule(stack.path))):
            for name, child in block.named_children():
                if next(child.parameters(), None) is not None:
                    handles.append(child.register_forward_pre_hook(
                        lambda m, a, block=block, number=number, name=name: child_called(block, number, name)))
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
    return result, Recording(calls, macs, total[0], inputs, outputs, residuals, children)
