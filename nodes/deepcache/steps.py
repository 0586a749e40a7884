"""DeepCache step planning: which sampler evaluation runs the whole network and which reuses cached features.

Everything here is plain Python that runs outside any compiled region (sampler-level wrappers). The per-run
state is a `DeepCacheRun` created by the OUTER_SAMPLE wrapper and carried to the model through
`transformer_options[STATE_KEY]`; it is dropped when the sampling run ends, so nothing leaks into the next
prompt, the next batch or another clone of the model. While one model call runs, the APPLY_MODEL wrapper also
makes the run the active one (`active_run()`), which is how the block-level code finds it: not every model
hands `transformer_options` to its blocks.

Steps are counted from the sampler's sigma schedule and its per-step callback, never from model calls:
cond and uncond (batched or not) share one evaluation, and the extra evaluations of multi-evaluation
samplers (heun's corrector, dpm2's midpoint) always run in full.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..wrapper_args import replace_wrapper_arg, wrapper_arg
from .settings import CacheMode, DeepCacheSettings

STATE_KEY = "int8_accel_deepcache"
WRAPPER_KEY = "int8_accel_deepcache"

log = logging.getLogger("int8_accel.deepcache")

# k-diffusion samplers whose corrector evaluates the model at the *next* schedule sigma right after the
# step callback, before that next step's own evaluation: the first evaluation there is the intermediate one.
SECOND_STAGE_AT_NEXT_SIGMA = frozenset({"sample_heun", "sample_heunpp2"})


class Mode(enum.Enum):
    FULL = "full"  # run the network unchanged, cache nothing
    CAPTURE = "capture"  # run the network unchanged and cache the deep features
    CACHED = "cached"  # run only the shallow blocks on top of the cached deep features


def plan_steps(sigmas: Sequence[float], interval: int, start_sigma: float, end_sigma: float) -> list[Mode]:
    """Mode of each sampler step: inside (end_sigma, start_sigma] one full step every `interval` steps."""
    steps = len(sigmas) - 1
    in_range = [start_sigma >= sigmas[i] > end_sigma for i in range(steps)]
    first = next((i for i in range(steps) if in_range[i]), None)
    cached = [first is not None and in_range[i] and (i - first) % interval != 0 for i in range(steps)]
    modes = []
    for i in range(steps):
        if cached[i]:
            modes.append(Mode.CACHED)
        elif any(cached[i + 1:]):
            modes.append(Mode.CAPTURE)
        else:
            modes.append(Mode.FULL)
    return modes


class Trajectory:
    """One cached feature over the full steps, as a function of the sampler's step number: its value at the last
    full step and its divided differences (first, second, ... order), TaylorSeer-style; each full step refreshes
    them. Over the step number rather than sigma: on the tiny models of every family tried (SD1.5, Flux, Wan,
    Lumina 2, 20 steps, interval 3 and 5) the step-number forecast beat reuse everywhere, the sigma one lost to
    reuse on Wan (shifted flow schedules space sigma very unevenly)."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.step: float | None = None
        self.terms: list[torch.Tensor] = []  # value, then one difference per order reached so far

    def record(self, step: float, value: torch.Tensor) -> None:
        terms = [value]
        if self.order and self.step is not None and step != self.step:
            gap = step - self.step
            for previous in self.terms[:self.order]:
                terms.append((terms[-1] - previous) / gap)
        self.step, self.terms = step, terms

    def trailing(self, drop: int) -> Trajectory:
        """This trajectory without its first `drop` rows (dim 1)."""
        kept = Trajectory(self.order)
        kept.step, kept.terms = self.step, [term[:, drop:] for term in self.terms]
        return kept

    def at(self, step: float) -> torch.Tensor:
        if len(self.terms) == 1:
            return self.terms[0]
        distance = step - self.step
        out = self.terms[0].clone()
        for order, term in enumerate(self.terms[1:], start=1):
            out.add_(term, alpha=distance ** order / math.factorial(order))
        return out


class FeatureCache:
    """Deep features per conditioning chunk (cond uuid), each entry tagged with the input signature it
    was computed for (chunk batch, shape, dtype); a lookup with another signature is a miss. Reuse gives the
    value of the last full step; forecast extrapolates it to the step asked for (one extra tensor per order)."""

    def __init__(self, mode: CacheMode = CacheMode.REUSE) -> None:
        self.order = mode.order
        self._entries: dict[object, tuple[tuple, dict[str, Trajectory]]] = {}

    def put(self, chunk_ids: Sequence, signature: tuple, name: str, tensor: torch.Tensor, step: float,
            trailing_rows: bool = False) -> None:
        """`trailing_rows`: an entry for a longer sequence, otherwise the same, keeps its history by its trailing
        rows (the forecast's differences included)."""
        if not chunk_ids or tensor.shape[0] % len(chunk_ids):
            return  # not one equal slice per cond: leave it uncached (a later lookup misses and recomputes)
        pieces = tensor.split(tensor.shape[0] // len(chunk_ids), dim=0)
        for chunk_id, piece in zip(chunk_ids, pieces, strict=True):
            entry = self._entries.get(chunk_id)
            drop = None if entry is None else _rows_to_drop(entry[0], signature, trailing_rows)
            if drop:
                entry = (signature, {key: trajectory.trailing(drop) for key, trajectory in entry[1].items()})
                self._entries[chunk_id] = entry
            elif drop is None:
                entry = (signature, {})
                self._entries[chunk_id] = entry
            entry[1].setdefault(name, Trajectory(self.order)).record(step, piece)

    def get(self, chunk_ids: Sequence, signature: tuple, step: float, names: Sequence[str] | None = None,
            trailing_rows: bool = False) -> dict | None:
        """All `names` (default: every name cached for the first chunk) for every chunk at `step`, or None.
        `trailing_rows`: an entry for a longer sequence (dim 1), otherwise the same, serves by its trailing rows."""
        found = []
        for chunk_id in chunk_ids:
            entry = self._entries.get(chunk_id)
            drop = None if entry is None else _rows_to_drop(entry[0], signature, trailing_rows)
            if drop is None:
                return None
            found.append((entry[1], drop))
        if not found:
            return None
        wanted = list(names) if names is not None else sorted(found[0][0])
        if not wanted or any(name not in tensors for tensors, _ in found for name in wanted):
            return None
        values = [{name: tensors[name].at(step)[:, drop:] if drop else tensors[name].at(step) for name in wanted}
                  for tensors, drop in found]
        if len(values) == 1:
            return values[0]
        return {name: torch.cat([chunk[name] for chunk in values], dim=0) for name in wanted}

    def tensors(self) -> int:
        """How many tensors the cache holds (the forecast's differences included)."""
        return sum(len(t.terms) for _, names in self._entries.values() for t in names.values())

    def clear(self) -> None:
        self._entries.clear()

    def fresh(self) -> FeatureCache:
        """An empty cache that keeps what this one keeps (the forecast's order)."""
        cache = FeatureCache()
        cache.order = self.order
        return cache

    def adopt(self, other: FeatureCache) -> None:
        """Take `other`'s entries (features captured apart, for calls this cache has none of yet)."""
        self._entries.update(other._entries)


@dataclass
class ModelCall:
    """One call of the diffusion model inside an evaluation (cond and uncond batched, or one of them)."""

    mode: Mode
    chunk_ids: list
    signature: tuple | None = None
    captured: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)
    cached: dict | None = None
    blocks_seen: bool = False  # a cached or capturing call reached DeepCache's block-level code
    fell_back: bool = False  # a cached call found no usable cache and captured instead


class DeepCacheRun:
    """State of one sampling run: the step plan, where the sampler is, the feature cache, the counts."""

    def __init__(self, settings: DeepCacheSettings, sigmas: torch.Tensor, model_sampling, sampler) -> None:
        self.settings = settings
        self.sigmas = [float(s) for s in sigmas.flatten().tolist()]
        start_sigma = float(model_sampling.percent_to_sigma(settings.start_percent))
        end_sigma = float(model_sampling.percent_to_sigma(settings.end_percent))
        self.plan = plan_steps(self.sigmas, settings.cache_interval, start_sigma, end_sigma)
        function = getattr(sampler, "sampler_function", None)
        self.second_stage_at_next_sigma = getattr(function, "__name__", "") in SECOND_STAGE_AT_NEXT_SIGMA
        self.completed_step = -1
        self.evaluations_at_target = 0
        self.callbacks_seen = 0
        self.mode = Mode.FULL
        self.evaluation_fell_back = False
        self.cache = FeatureCache(settings.cache_mode)
        self.step = -1  # the sampler step the current evaluation belongs to (counted by sigma)
        self.full_steps = 0
        self.cached_steps = 0
        self.extra_evaluations = 0
        self.cache_misses = 0
        self.blocks_reached = False  # some call of this run reached DeepCache's block-level code
        self.notes: list[str] = []  # what the run's summary must tell besides the counts (a model run uncached)

    # --- sampler level -----------------------------------------------------------------------------
    def wrap_callback(self, callback: Callable | None) -> Callable:
        def step_done(step, *args, **kwargs):
            self.completed_step = int(step)
            self.evaluations_at_target = 0
            self.callbacks_seen += 1
            if callback is not None:
                return callback(step, *args, **kwargs)

        return step_done

    def begin_evaluation(self, timestep: torch.Tensor) -> Mode:
        """Classify one sampler evaluation (a predict_noise call) and return the mode it runs in."""
        sigma = float(timestep.flatten()[0])
        target = self.completed_step + 1
        self.evaluation_fell_back = False
        mode = Mode.FULL
        if target < len(self.plan) and math.isclose(sigma, self.sigmas[target], rel_tol=1e-4, abs_tol=1e-7):
            self.evaluations_at_target += 1
            main = 2 if (self.second_stage_at_next_sigma and target >= 1) else 1
            if self.evaluations_at_target == main:
                mode = self.plan[target]
                self.step = target
                if mode is Mode.CACHED:
                    self.cached_steps += 1
                else:
                    self.full_steps += 1
                self.mode = mode
                return mode
        self.extra_evaluations += 1
        self.mode = mode
        return mode

    def summary(self, notes: bool = True) -> str:
        """The counts of the run, then (`notes`) one line per note."""
        steps = len(self.plan)
        text = (f"DeepCache: {steps} steps, {self.full_steps} full, {self.cached_steps} cached "
                f"(interval {self.settings.cache_interval}, depth {self.settings.cache_depth})")
        if self.extra_evaluations:
            text += f", {self.extra_evaluations} intermediate evaluations run in full"
        if self.cache_misses:
            text += f", {self.cache_misses} cached calls recomputed after a cache miss"
        if self.callbacks_seen == 0 and steps > 1:
            text += "; the sampler reported no steps, so every evaluation after the first ran in full"
        return "\n".join([text, *(self.notes if notes else ())])

    def release(self) -> None:
        self.cache.clear()

    # --- model-call level --------------------------------------------------------------------------
    def begin_call(self, transformer_options: dict) -> ModelCall:
        """A new model call of this run. It is not stored on the run: under ComfyUI 0.38's MultiGPU several
        calls of one evaluation run at once, one per device thread (`samplers._calc_cond_batch_multigpu`), each
        with its own chunks; the APPLY_MODEL wrapper makes it the active call of its own thread only."""
        chunk_ids = transformer_options.get("uuids") or transformer_options.get("cond_or_uncond") or [0]
        return ModelCall(mode=self.mode, chunk_ids=list(chunk_ids))

    def fall_back_to_capture(self, call: ModelCall) -> None:
        """A cached call found no usable cache (new shape, dtype or cond): run it in full and cache it."""
        call.mode = Mode.CAPTURE
        with _COUNTS_LOCK:  # MultiGPU: the calls of one evaluation may fall back at once, from their threads
            self.cache_misses += 1
            if not self.evaluation_fell_back:
                self.evaluation_fell_back = True
                self.cached_steps -= 1
                self.full_steps += 1


def current_run(transformer_options: dict | None) -> DeepCacheRun | None:
    run = (transformer_options or {}).get(STATE_KEY)
    return run if isinstance(run, DeepCacheRun) else None


# Context variables: each thread has its own, so the calls MultiGPU runs at once on its device threads never see
# one another's (a thread starts with an empty context; the wrapper sets both inside the thread that calls).
_ACTIVE_RUN: contextvars.ContextVar[DeepCacheRun | None] = contextvars.ContextVar("int8_accel_deepcache_run",
                                                                                   default=None)
_ACTIVE_CALL: contextvars.ContextVar[ModelCall | None] = contextvars.ContextVar("int8_accel_deepcache_call",
                                                                                 default=None)
_COUNTS_LOCK = threading.Lock()


class _ScratchRun:
    """What block-level code reads of a run, for calls made apart from the sampling run (discovery's check)."""

    def __init__(self, cache: FeatureCache, step: float) -> None:
        self.cache = cache
        self.step = step

    def fall_back_to_capture(self, call: ModelCall) -> None:
        call.mode = Mode.CAPTURE
        call.fell_back = True


@contextlib.contextmanager
def scratch_call(mode: Mode, chunk_ids: Sequence, cache: FeatureCache, step: float) -> Iterator[ModelCall]:
    """A model call in `mode` made active in this thread for the block, on `cache` at `step` instead of the
    sampling run's state; the call records whether the block-level code was reached and whether it fell back."""
    call = ModelCall(mode=mode, chunk_ids=list(chunk_ids))
    token, call_token = _ACTIVE_RUN.set(_ScratchRun(cache, step)), _ACTIVE_CALL.set(call)
    try:
        yield call
    finally:
        _ACTIVE_CALL.reset(call_token)
        _ACTIVE_RUN.reset(token)


def active_run() -> DeepCacheRun | None:
    """The run whose model call is executing right now (set only inside the APPLY_MODEL wrapper)."""
    return _ACTIVE_RUN.get()


def active_call() -> ModelCall | None:
    """The model call executing right now in this thread (set only inside the APPLY_MODEL wrapper)."""
    return _ACTIVE_CALL.get() if _ACTIVE_RUN.get() is not None else None


def _rows_to_drop(stored: tuple, wanted: tuple, trailing_rows: bool) -> int | None:
    """How an entry cached under signature `stored` serves a call of signature `wanted`: 0 as it is; with
    `trailing_rows`, by dropping this many leading rows (dim 1) of a longer sequence that is otherwise the same
    (batch, trailing dims, dtype, device); None when it does not."""
    if stored == wanted:
        return 0
    (batch, shape, *rest), (wanted_batch, wanted_shape, *wanted_rest) = stored, wanted
    if not trailing_rows or (batch, rest, len(shape)) != (wanted_batch, wanted_rest, len(wanted_shape)) or not shape:
        return None
    if shape[1:] != wanted_shape[1:] or shape[0] <= wanted_shape[0]:
        return None
    return shape[0] - wanted_shape[0]


def chunk_signature(tensor: torch.Tensor, chunks: int) -> tuple:
    return (tensor.shape[0] // max(chunks, 1), tuple(tensor.shape[1:]), tensor.dtype, tensor.device)


# --- wrappers ----------------------------------------------------------------------------------------
def make_outer_sample_wrapper(settings: DeepCacheSettings) -> Callable:
    def deepcache_outer_sample(executor, *args, **kwargs):
        import comfy.model_patcher

        guider = executor.class_obj
        sigmas = wrapper_arg(args, kwargs, 3, "sigmas")
        sampler = wrapper_arg(args, kwargs, 2, "sampler", None)
        model_sampling = guider.model_patcher.get_model_object("model_sampling")
        run = DeepCacheRun(settings, sigmas, model_sampling, sampler)
        callback = run.wrap_callback(wrapper_arg(args, kwargs, 5, "callback", None))
        args, kwargs = replace_wrapper_arg(args, kwargs, 5, "callback", callback)
        original_options = guider.model_options
        guider.model_options = comfy.model_patcher.create_model_options_clone(original_options)
        guider.model_options.setdefault("transformer_options", {})[STATE_KEY] = run
        try:
            return executor(*args, **kwargs)
        finally:
            guider.model_options = original_options
            log.info(run.summary())
            run.release()

    return deepcache_outer_sample


def deepcache_predict_noise(executor, *args, **kwargs):
    timestep = wrapper_arg(args, kwargs, 1, "timestep")
    model_options = wrapper_arg(args, kwargs, 2, "model_options", {})
    run = current_run(model_options.get("transformer_options"))
    if run is None:
        return executor(*args, **kwargs)
    run.begin_evaluation(timestep)
    try:
        return executor(*args, **kwargs)
    finally:
        run.mode = Mode.FULL  # a model call outside a sampler evaluation never reuses the cache


def make_apply_model_wrapper(uncached_message: Callable[[object], str] | None) -> Callable:
    """The APPLY_MODEL wrapper: one ModelCall per model call, made the active one while it runs.

    `uncached_message(diffusion_model)`, when given, is raised if a call that should have cached or reused deep
    features did not reach DeepCache's block-level code and no call of the run has yet: the model runs its
    blocks some other way. (Once blocks were reached, a call without them is one another wrapper answered
    without running the model, as ComfyUI's EasyCache does.)"""

    def deepcache_apply_model(executor, *args, **kwargs):
        transformer_options = wrapper_arg(args, kwargs, 5, "transformer_options", None)
        run = current_run(transformer_options)
        if run is None:
            return executor(*args, **kwargs)
        call = run.begin_call(transformer_options)
        token, call_token = _ACTIVE_RUN.set(run), _ACTIVE_CALL.set(call)
        try:
            out = executor(*args, **kwargs)
        finally:
            _ACTIVE_CALL.reset(call_token)
            _ACTIVE_RUN.reset(token)
        if call.blocks_seen:
            run.blocks_reached = True
        elif uncached_message is not None and call.mode is not Mode.FULL and not run.blocks_reached:
            raise RuntimeError(uncached_message(executor.class_obj.diffusion_model))
        return out

    return deepcache_apply_model


def install_step_wrappers(model, settings: DeepCacheSettings,
                          uncached_message: Callable[[object], str] | None = None) -> None:
    """Register the sampler-level wrappers on `model` (a clone the caller owns)."""
    from comfy.patcher_extension import WrappersMP

    model.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, make_outer_sample_wrapper(settings))
    model.add_wrapper_with_key(WrappersMP.PREDICT_NOISE, WRAPPER_KEY, deepcache_predict_noise)
    model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, make_apply_model_wrapper(uncached_message))
