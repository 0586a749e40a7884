"""DeepCache for diffusion models no family entry names: their block stacks found in the module tree, the ones that
hold the compute chosen and how streams pass their blocks learned from the first model call, and the result
checked against the uncached model.

- Found: the candidate stacks (`nodes/block_stacks.py` `candidate_stacks`: outermost containers of like blocks).
- Chosen, on the first call of a sampling run that caches, by compute: the multiply-accumulates of the weighted
  layers each stack's blocks ran on that call's shapes (deterministic, the same on every machine). A stack doing at
  least a tenth of the call's work is cached; one that does less (an encoder that runs on a handful of prompt or
  lyric tokens, however many parameters it holds) or that never ran is left out, and the summary says so.
- Learned on the same call, with the model run as it is: how the forward enters each block (a module call, or
  a method of the block's class, as `layer.forward_generation(x, ...)`; a `patches_replace["dit"]` patch's
  `original_block` calls the module; where it enters each block more than once, by two methods or twice as a
  module as Qwen-Image 2.1's first call does on the prompt rows and then the image rows, the heaviest lane is
  cached and the other calls, told apart by method or by their arguments' shapes, run as they are), the order
  the blocks run in (each exactly once per lane), and for each stack which of
  a block's outputs the next block takes, at which argument (by identity: the very tensor, passed on unchanged;
  else the one argument of its shape, where the forward reshapes the stream between blocks). Those are the stack's
  streams; what a block returns after them goes back to the forward as it came. A block output that a later block
  takes outside its streams (a long skip, as HunyuanDiT's) makes every middle block its own segment, so each
  skipped block hands on its own output. That call also keeps copies of the inputs and outputs the first step's
  residuals are taken from, and with long skips every block's own residual, so it captures as a capturing call
  would and the first run costs one cached call more than the next (a fraction of a forward).
- Checked, on the same call's inputs: serving the captured residuals through DeepCache's stand-ins must give the
  uncached output within rounding (where the first call kept too few copies, as when a long skip starts at a
  block after the first middle ones, a capturing call through the stand-ins must also give it bit for bit). A
  model that fails runs uncached, and the run's summary says which stacks were tried and why.
- Kept: what was learned is kept for that diffusion model object (weakly) and its input shapes, across node
  executions and prompts; a DeepCache node with other settings reuses it (a new cache_depth is checked again, on
  a call that is the step's own capture).

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

from ..block_stacks import MIN_TOTAL_SHARE, FoundStack, parameter_count, stack_members
from .dit import block_swap
from .families import BlockStack, Family, supported_names
from .recording import BlockCall, Place, Recording, record_block_calls, shapes_signature, stream_places
from .segments import BlockPlace, middle_places
from .steps import WRAPPER_KEY, FeatureCache, Mode, ModelCall, active_call, active_run, chunk_signature, scratch_call
from .stream_objects import difference, first_tensor, named_parts

log = logging.getLogger("int8_accel.deepcache")

MIN_COMPUTE_SHARE = 0.1  # of the model call's multiply-accumulates, for a stack to be cached

def not_found_message(diffusion_model: torch.nn.Module) -> str:
    cls = type(diffusion_model)
    return (f"DeepCache cannot accelerate this model: its diffusion model is {cls.__name__} (from {cls.__module__}), "
            f"which is none of the models it knows (UNets: SD1.x, SD2.x, SDXL; transformers: {supported_names()}) "
            "and has no stack of transformer blocks it can find (it looks for nn.ModuleList or nn.ModuleDict "
            "containers of two or more blocks of one class, each a module of modules, holding together over "
            f"{100 * MIN_TOTAL_SHARE:.0f}% of the parameters). Bypass this node (Ctrl+B) to run the model without "
            "DeepCache.")


# --- learning from a call ----------------------------------------------------------------------------------------
class LearnFailed(Exception):
    pass


def _parameter_names(block: torch.nn.Module, entry: str) -> list[str]:
    try:
        parameters = inspect.signature(getattr(block, entry) if entry else block.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def learn_family(diffusion_model: torch.nn.Module, stacks: list[FoundStack], calls: list[BlockCall],
                 passes: list[Callable | None] | None = None
                 ) -> tuple[Family, list[tuple[int, int]], bool, list[list[Place]]]:
    """(the family the calls show, its block layout in execution order, whether a block output skips ahead, where
    each stack's streams enter its blocks). `calls`: one lane per stack; `passes`: per stack, what tells the
    forward's other module calls of its blocks (which run as they are), or None."""
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
        entries = {calls[n].entry for n in numbered[number]}
        if len(entries) > 1:
            raise LearnFailed(f"the forward enters the blocks of {stack.path} in more than one way ("
                              + ", ".join(sorted(f".{entry}()" if entry else "module call" for entry in entries))
                              + ")")
        entry = entries.pop()
        names = _parameter_names(stack_members(diffusion_model.get_submodule(stack.path))[0], entry)
        arguments = tuple((position, names[position] if position < len(names) else keyword)
                          for position, keyword in mappings[number])
        extra = max(len(calls[n].outputs) for n in numbered[number]) - len(mappings[number])
        block_stacks.append(BlockStack(stack.path, tuple(f"stream{n}" for n in range(len(mappings[number]))),
                                       arguments=arguments, extra_outputs=extra, method=entry or None,
                                       whole_pass=passes[number] if passes else None))
    long_skip = _long_skip(calls, mappings)
    cls = type(diffusion_model)
    family = Family(f"{cls.__name__} (found)", cls.__module__, cls.__name__, tuple(block_stacks))
    return family, seen, long_skip, mappings


def _stream_places(stack: FoundStack, calls: list[BlockCall], numbers: list[int]) -> list[Place]:
    """Where each of a block's leading outputs enters the next block of the stack: the same for every pair."""
    if len(numbers) < 2:
        raise LearnFailed(f"{stack.path} ran one block only")
    mapping = None
    for previous, nxt in zip(numbers, numbers[1:], strict=False):
        places = stream_places(calls, previous, nxt)
        if mapping is None:
            mapping = places
        elif places != mapping:
            raise LearnFailed(f"the blocks of {stack.path} do not all pass their outputs on the same way")
    if not mapping:
        raise LearnFailed(f"no output of a block of {stack.path} reaches the next block unchanged")
    return mapping


def _long_skip(calls: list[BlockCall], mappings: list[list[Place]]) -> bool:
    """Whether a block's output reaches a later block other than as a stream handed on (HunyuanDiT's skips)."""
    for position, call in enumerate(calls):
        for place, (source, _) in call.sources.items():
            handed_on = place in mappings[call.stack] and (calls[source].stack == call.stack or position == source + 1)
            if not handed_on:
                return True
    return False


# --- choosing by compute ------------------------------------------------------------------------------------------
def _percent(share: float) -> str:
    return f"{100 * share:.0f}%" if share >= 0.01 or share == 0 else "<1%"


Lane = tuple[str, int]  # (entry: "" a module call, else the method; occurrence: the block's how-manieth entry so)


def _lane_name(lane: Lane) -> str:
    entry, occurrence = lane
    return f".{entry}()" if entry else f"module call no. {occurrence + 1} per block"


@dataclass(frozen=True)
class StackCompute:
    stack: FoundStack
    share: float  # of the model call's multiply-accumulates (of its parameters where no weighted layer ran)
    ran: bool
    lane: Lane = ("", 0)  # how the forward entered the blocks for the calls cached
    as_is: tuple[Lane, ...] = ()  # other ways (or times) the forward entered them, whose calls run as they are
    children: tuple[str, ...] = ()  # children of its blocks the forward called itself (where the blocks never ran)

    @property
    def entry(self) -> str:
        return self.lane[0]

    def describe(self, measured: str) -> str:
        how = f", entered by .{self.entry}()" if self.entry else ""
        module_lanes = [lane for lane in self.as_is if not lane[0]]
        if not self.entry and module_lanes:  # Qwen-Image 2.1's first call: the prompt rows, then the image rows
            how += (f", cached on the {_lane_name(self.lane)}; the "
                    + " and ".join(_lane_name(lane) for lane in module_lanes)
                    + " (other shapes) run as they are")
        other = [lane for lane in self.as_is if lane[0]]
        if other:
            how += ", its " + " and ".join(_lane_name(lane) for lane in other) + " calls run as they are"
        return (f"{self.stack.path} ({self.stack.blocks} x {self.stack.block_class}, {_percent(self.share)} of "
                f"the {measured}, {_percent(self.stack.share)} of the parameters{how})")


def choose_by_compute(net: torch.nn.Module, candidates: list[FoundStack],
                      recording: Recording) -> tuple[list[int], list[StackCompute], str]:
    """(the candidates cached, every candidate's compute, what was measured): the stacks doing at least
    MIN_COMPUTE_SHARE of the call's work, in module order. Where the forward enters a stack's blocks in more than
    one way (SenseNova U1.5's `forward_prefix` on the prompt, then `forward_generation` on the image, per block) or
    more than once the same way (Qwen-Image 2.1's first call: the prompt rows, then the image rows), the lane doing
    most of the work is cached and the others run as they are."""
    ran = {call.stack for call in recording.calls}
    lanes: dict[int, dict[Lane, int]] = {}  # stack -> lane -> multiply-accumulates
    for call in recording.calls:
        lane = lanes.setdefault(call.stack, {})
        lane[call.lane] = lane.get(call.lane, 0) + call.macs
    heaviest = {stack: max(lane, key=lane.get) for stack, lane in lanes.items()}
    if recording.total_macs:
        shares = [macs / recording.total_macs for macs in recording.macs]
        measured = "model call's compute"
    else:  # no weighted layer the hooks know ran (a model of other layers): parameters stand in
        total = parameter_count(net) or 1
        shares = [parameter_count(net.get_submodule(stack.path)) / total for stack in candidates]
        measured = "parameters (no compute was measured)"
    computes = [StackCompute(stack, shares[n], n in ran, heaviest.get(n, ("", 0)),
                             tuple(lane for lane in lanes.get(n, {}) if lane != heaviest.get(n)),
                             tuple(recording.children.get(n, ())) if n not in ran else ())
                for n, stack in enumerate(candidates)]
    chosen = [n for n, compute in enumerate(computes) if compute.ran and compute.share >= MIN_COMPUTE_SHARE]
    return chosen, computes, measured


def _other_module_calls(recording: Recording, stack: int, lane: Lane) -> Callable[[tuple, dict], bool] | None:
    """A stack's `whole_pass`: where the forward also calls its blocks as modules outside the cached lane (Qwen-Image
    2.1's prompt rows), whether a call is one of those, told by its arguments' shapes (LearnFailed where the cached
    lane's calls look the same)."""
    other = {call.signature() for call in recording.calls
             if call.stack == stack and call.entry == "" and call.lane != lane}
    if not other or lane[0]:
        return None  # a stand-in answers only the method it caches; module calls then reach the block as they are
    cached = {call.signature() for call in recording.calls if call.stack == stack and call.lane == lane}
    if other & cached:
        raise LearnFailed("the forward calls its blocks more than once per model call with arguments of the same "
                          "shapes, so the calls DeepCache may skip cannot be told from the others")
    return lambda args, kwargs: shapes_signature(args, kwargs) in other


def _why_left_out(compute: StackCompute) -> str:
    if compute.children:  # Prism: containers whose children the forward calls one by one, interleaving streams
        called = ", ".join(f".{name}" for name in compute.children)
        return (f"never ran as blocks: the forward calls their children ({called}) itself, which DeepCache does "
                "not reach")
    return "never ran" if not compute.ran else f"under {_percent(MIN_COMPUTE_SHARE)} of the call's compute"


def _left_out(computes: list[StackCompute], chosen: list[int], measured: str) -> str:
    reasons = [f"{compute.describe(measured)}: {_why_left_out(compute)}"
               for n, compute in enumerate(computes) if n not in chosen]
    return "; left out: " + ", ".join(reasons) if reasons else ""


# --- what is learned once per model ----------------------------------------------------------------------------
@dataclass
class Learned:
    """DeepCache on one model at one cache_depth."""

    family: Family | None = None
    swap: Callable | None = None
    failure: str | None = None  # why the model runs uncached
    note: str = ""  # what the run's summary tells (the blocks cached and left out, or the failure)


@dataclass
class ModelRecord:
    """What the first call taught about a diffusion model at its input shapes (learned once, kept weakly)."""

    stacks: list[FoundStack]  # those cached
    family: Family | None
    layout: list[tuple[int, int]]
    long_skip: bool
    streams: list[list[Place]]  # per cached stack: where each stream enters its blocks (as recorded)
    cached: str  # the summary's account of the stacks cached
    left_out: str  # and of those left out, with why
    failure: str | None = None
    checked: dict[int, Learned] = field(default_factory=dict)  # per cache_depth


_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # diffusion model -> {input shapes: ModelRecord}


def learned_layout(diffusion_model: torch.nn.Module) -> list[tuple[int, int]] | None:
    """The block layout discovery learned for this model (at any input shapes), or None."""
    for record in _MODELS.get(diffusion_model, {}).values():
        if record.failure is None:
            return record.layout
    return None


def forget(diffusion_model: torch.nn.Module) -> None:
    """Drop what was learned for this model (the next caching call learns again)."""
    _MODELS.pop(diffusion_model, None)


def _input_shapes(args: tuple, kwargs: dict) -> tuple:
    def shape(value):  # a list or tuple of tensors (MiniMax H3 takes [video, audio]) by its tensors' shapes
        if isinstance(value, (list, tuple)):
            return tuple(shape(part) for part in value)
        return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None

    return (tuple(shape(a) for a in args), tuple(sorted((k, shape(v)) for k, v in kwargs.items()
                                                        if isinstance(v, torch.Tensor))))


def _learn_model(net: torch.nn.Module, candidates: list[FoundStack],
                 recording: Recording) -> tuple[ModelRecord, Recording]:
    """What the recorded call teaches, and the recording of the stacks cached alone (numbered as those)."""
    chosen, computes, measured = choose_by_compute(net, candidates, recording)
    left_out = _left_out(computes, chosen, measured)
    cls = type(net).__name__
    stacks = [candidates[n] for n in chosen]
    kept = recording.keep([n for n, call in enumerate(recording.calls)
                           if call.stack in chosen and call.lane == computes[call.stack].lane])
    for call in kept.calls:
        call.stack = chosen.index(call.stack)
    if not chosen:
        tried = ", ".join(compute.describe(measured) for compute in computes)
        failure = (f"DeepCache ran {cls} uncached: none of the blocks it found ({tried}) does "
                   f"{_percent(MIN_COMPUTE_SHARE)} of the model call's compute as blocks it reaches ("
                   + "; ".join(f"{compute.stack.path}: {_why_left_out(compute)}" for compute in computes) + ")")
        return ModelRecord([], None, [], False, [], tried, "", failure), kept
    cached = ", ".join(computes[n].describe(measured) for n in chosen)
    try:
        passes = [_other_module_calls(recording, n, computes[n].lane) for n in chosen]
        family, layout, long_skip, streams = learn_family(net, stacks, kept.calls, passes)
    except LearnFailed as why:
        failure = f"DeepCache ran {cls} uncached: the blocks it found ({cached}) did not reproduce the model: {why}"
        return ModelRecord(stacks, None, [], False, [], cached, left_out, failure), kept
    return ModelRecord(stacks, family, layout, long_skip, streams, cached, left_out), kept


def _capture_from_recording(recording: Recording, record: ModelRecord, places: dict[tuple[int, int], BlockPlace],
                            cache: FeatureCache, chunk_ids: list, step: float) -> bool:
    """Put in `cache` the residuals a capturing call through the stand-ins would have put, from the copies the
    recorded call kept (a segment of one block, as every middle block is with long skips, from that block's own
    residual); False where it kept too few."""
    number = {(call.stack, call.index): n for n, call in enumerate(recording.calls)}
    starts, ends, first = {}, {}, None
    for key, place in places.items():
        if place.starts:
            starts[place.segment] = key
        if place.ends:
            ends[place.segment] = key
        if place.resolves_call:
            first = key
    first_inputs = recording.inputs.get(number.get(first, -1))
    first_own = recording.residuals.get(number.get(first, -1))
    if first is None or not (first_inputs or first_own):
        return False
    first_stream = next((first_tensor(first_inputs.get(place)) for place in record.streams[first[0]]
                         if first_inputs.get(place) is not None), None) if first_inputs else None
    if first_stream is None and first_own is not None:  # the stream's shape is its residual's
        first_stream = next((first_tensor(value) for value in first_own[1] if value is not None), None)
    if first_stream is None:
        return False
    signature = chunk_signature(first_stream, len(chunk_ids))
    residuals = []
    for segment, start in starts.items():
        streams = record.streams[start[0]]
        inputs, outputs = recording.inputs.get(number[start]), recording.outputs.get(number[ends[segment]])
        own = recording.residuals.get(number[start]) if start == ends[segment] else None
        if own is not None and own[0] == streams:
            residuals += [part for k, value in enumerate(own[1]) if value is not None
                          for part in named_parts(f"{segment}.stream{k}", value).items()]
            continue
        if inputs is None or outputs is None:
            return False
        for k, place in enumerate(streams):
            value = outputs[k] if k < len(outputs) else None
            if place not in inputs or value is None:
                return False
            residual = difference(value, inputs[place])
            if residual is not None:
                residuals += list(named_parts(f"{segment}.stream{k}", residual).items())
    for name, residual in residuals:
        cache.put(chunk_ids, signature, name, residual, step)
    return True


# --- the check and the wrapper -------------------------------------------------------------------------------------
def _cloned(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of a model output, in order (a forward may return a tuple: Kandinsky 6's video and audio)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for part in value for tensor in _tensors(part)]
    if isinstance(value, dict):
        return [tensor for part in value.values() for tensor in _tensors(part)]
    return []


def _equal(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def _rel(a, b) -> float:
    """The largest relative difference over the outputs' tensors (inf where their structure differs)."""
    ta, tb = _tensors(a), _tensors(b)
    if len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb, strict=True)):
        return float("inf")
    return max((float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))
                for x, y in zip(ta, tb, strict=True)), default=0.0)


def _dtype(value) -> torch.dtype:
    tensors = _tensors(value)
    return tensors[0].dtype if tensors else torch.float32


def tolerance(dtype: torch.dtype) -> float:
    """What serving captured residuals may change on the same inputs: `x + (y - x)` rounds in the model's dtype."""
    return max(1e-4, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-4


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
    """DeepCache on a model whose blocks it found: learns and checks on the first call of a run that caches (once
    per model and input shapes, see the module's text), then swaps the stacks for cached and capturing calls. It
    works from the DIFFUSION_MODEL wrapper (innermost: other nodes' wrappers see the real model) where the forward
    runs those, else from an APPLY_MODEL wrapper inside DeepCache's step wrapper."""

    def __init__(self, candidates: list[FoundStack], depth: int) -> None:
        self.candidates = candidates
        self.depth = depth
        self._learned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # net -> (input shapes, Learned)

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

    def learned(self) -> list[Learned]:
        """What this node's DeepCache learned, one record per diffusion model it ran."""
        return [learned for _, learned in self._learned.values()]

    def _run(self, net: torch.nn.Module, executor, args: tuple, kwargs: dict):
        def call_as_is():
            return executor(*args, **kwargs)

        def fresh_call():  # the learning and checking calls each get their own copies of the inputs
            return executor(*[_cloned(a) for a in args], **{k: _cloned(v) for k, v in kwargs.items()})

        call = active_call()
        shapes = _input_shapes(args, kwargs)
        known = self._learned.get(net)
        learned = known[1] if known is not None and known[0] == shapes else None
        if learned is None:
            record = _MODELS.get(net, {}).get(shapes)
            learned = record.checked.get(self.depth) if record is not None else None
            if learned is None:
                if call is None or call.mode is Mode.FULL:
                    return call_as_is()
                return self._learn_and_check(net, shapes, record, fresh_call, call)
            self._learned[net] = (shapes, learned)
        _tell(learned.note)
        if learned.failure is not None:
            return call_as_is()
        return learned.swap(_Executor(call_as_is, net))

    def _learn_and_check(self, net, shapes: tuple, record: ModelRecord | None, fresh_call: Callable,
                         call: ModelCall):
        reference = recording = None
        if record is None:
            reference, recording = record_block_calls(net, self.candidates, fresh_call, self.depth)
            record, recording = _learn_model(net, self.candidates, recording)
            _MODELS.setdefault(net, {})[shapes] = record
        learned = Learned()
        cls = type(net).__name__
        try:
            if record.failure is not None:
                raise LearnFailed(record.failure)
            if len(record.layout) - 2 * self.depth < 1:
                raise LearnFailed(f"its {len(record.layout)} blocks leave no middle block at cache_depth {self.depth}")
            places = middle_places(record.layout, self.depth, every_block=record.long_skip)
            swap = block_swap(record.family, places)
            learned.family, learned.swap = record.family, swap
            reference = self._check(net, record, places, swap, fresh_call, reference, recording, call)
            learned.note = (f"DeepCache found the blocks of {cls}, which it does not know by name, and caches "
                            f"{record.cached}{record.left_out}; checked against the uncached model on the first call"
                            + ("; a block's output reaches a later block, so every skipped block is served its own"
                               if record.long_skip else ""))
            log.info("%s", learned.note)
        except LearnFailed as why:
            learned.family = learned.swap = None
            text = str(why)
            learned.failure = learned.note = text if text.startswith("DeepCache ran") else (
                f"DeepCache ran {cls} uncached: the blocks it found ({record.cached}) did not reproduce the model: "
                f"{text}")
            log.warning("%s", learned.failure)
        record.checked[self.depth] = learned
        self._learned[net] = (shapes, learned)
        _tell(learned.note)
        return reference if reference is not None else fresh_call()

    def _check(self, net, record: ModelRecord, places: dict, swap: Callable, fresh_call: Callable, reference,
               recording: Recording | None, call: ModelCall):
        """The output the step gets (the reference, or the capturing call's where none was made) once serving the
        captured features reproduces the model; LearnFailed otherwise."""
        run = active_run()
        cache = run.cache.fresh() if run is not None else FeatureCache()
        step = run.step if run is not None else 0
        modes = [Mode.CACHED]
        if recording is None or not _capture_from_recording(recording, record, places, cache, call.chunk_ids, step):
            modes.insert(0, Mode.CAPTURE)
        outputs = {}
        for mode in modes:
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
        if Mode.CAPTURE in outputs:
            if reference is None:  # a cache_depth checked anew: the capturing call is the step's own
                reference = outputs[Mode.CAPTURE]
            elif not _equal(outputs[Mode.CAPTURE], reference):
                raise LearnFailed("capturing through DeepCache's stand-ins changed the output")
        error = _rel(outputs[Mode.CACHED], reference)
        if not error <= tolerance(_dtype(reference)):
            raise LearnFailed(f"serving the captured features on the same inputs changed the output by {error:.2e} "
                              f"(relative; at most {tolerance(_dtype(reference)):.0e} is rounding)")
        if call.mode is Mode.CAPTURE and run is not None:  # this call's features are captured already
            run.cache.adopt(cache)
            call.blocks_seen = True
        return reference


class _Executor:
    """A stand-in for ComfyUI's wrapper executor around the check's calls (the swap reads `class_obj`)."""

    def __init__(self, fresh_call: Callable, net: torch.nn.Module) -> None:
        self._call = fresh_call
        self.class_obj = net

    def __call__(self, *args, **kwargs):
        return self._call()
