"""Public API: ``ckptc.optimize``, ``ckptc.capture`` and ``ckptc.plan``.

``optimize(model, budget_gb=40)`` returns a module that trains like ``model``
within the budget.  Its first training call captures the step, solves and
rewrites; later calls with the same input shapes reuse the plan; new shapes
plan again.  Calls under ``torch.no_grad()`` or in ``eval()`` mode run the
original model eagerly: nothing to plan, nothing to recompute.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import types
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ckptc import _torch_internals as internals
from ckptc.backend import configured
from ckptc.capture.compiler import CheckpointCompiler
from ckptc.capture.coverage import Coverage
from ckptc.capture.offline import offline_device, offline_step
from ckptc.distributed import check_call_order, check_wrap_order, rank_context
from ckptc.errors import (
    ArgumentTypeError,
    CkptcError,
    InvalidArgumentError,
    UntraceableModelError,
    is_models_own,
    warn_once,
)
from ckptc.options import CheckpointOptions, refuse_unknown
from ckptc.planning.account import unnamed_gradient_bytes
from ckptc.planning.planner import CapturedStep
from ckptc.planning.policies import warn_unmatched_patterns
from ckptc.plans import ModelPlan, _parameter_sizes, applied_plan
from ckptc.records import GraphRecord
from ckptc.runtime.step import ForwardState, ShapePlan, StepRuntime, refuse_unplanned
from ckptc.runtime.tracker import ResultLifetimes

log = logging.getLogger("ckptc.api")

# The wrappers ckptc.optimize made, by model: ckptc.apply refuses a model a live one wraps.
_WRAPPERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet] = weakref.WeakKeyDictionary()


class _SignedForward:
    """``OptimizedModule.forward`` bound to one module, reporting the wrapped model's
    ``forward`` signature to ``inspect.signature`` (the Hugging Face Trainer keeps only
    the dataset columns the model's ``forward`` accepts)."""

    __slots__ = ("function", "module")
    __name__ = "forward"

    def __init__(self, function: Callable[..., Any], module: torch.nn.Module) -> None:
        self.function = function
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.module.__dict__["_ckptc_model"].forward)

    def __repr__(self) -> str:
        return f"<bound method OptimizedModule.forward of {self.module!r}>"


class _model_signature:
    """Descriptor for ``OptimizedModule.forward``: binds it as a :class:`_SignedForward`."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __get__(self, module: torch.nn.Module | None, owner: type | None = None) -> Any:
        return self.function if module is None else _SignedForward(self.function, module)


def live_wrappers(model: torch.nn.Module) -> list["OptimizedModule"]:
    """The :class:`OptimizedModule` objects ``ckptc.optimize`` made for ``model`` that are still alive."""
    wrappers = _WRAPPERS.get(model)
    if wrappers:
        gc.collect()  # compiled graphs hold reference cycles: a wrapper the caller dropped goes now
    return list(wrappers or ())


class OptimizedModule(torch.nn.Module):
    """``model`` with activation checkpointing planned for a memory budget.

    Shares ``model``'s parameters, buffers and submodules (so ``state_dict()``
    has the same keys and an optimizer over either module's parameters trains
    both).  After the first training call, :attr:`plan` describes what is kept
    and what is recomputed.  Training calls run through a
    :class:`~ckptc.runtime.step.StepRuntime` (per-shape plans, step tracking, measured
    verification).  ``training`` is the wrapped model's flag.  Copies
    (``copy.deepcopy``, ``pickle``, ``torch.save``) keep the model and the
    options and plan again on their first training call.
    """

    def __init__(
        self, model: torch.nn.Module, compiler: CheckpointCompiler, *, verify: bool = True, max_plans: int = 8
    ) -> None:
        super().__init__()
        # Share the registries instead of registering `model` as a child, so
        # parameter names and state_dict keys stay exactly the model's.
        internals.share_registries(self, model)
        object.__setattr__(self, "_ckptc_model", model)
        object.__setattr__(self, "_ckptc_compiler", compiler)
        object.__setattr__(self, "_ckptc_runtime", StepRuntime(model, compiler, verify=verify, max_plans=max_plans))
        _WRAPPERS.setdefault(model, weakref.WeakSet()).add(self)

    # `training` is the wrapped model's: model.eval() on the original shows here.
    @property  # type: ignore[override]
    def training(self) -> bool:
        model = self.__dict__.get("_ckptc_model")
        return True if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_ckptc_model")
        if model is not None:
            model.training = mode

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_ckptc_runtime", None)  # compiled graphs: planned again lazily
        runtime = self.__dict__["_ckptc_runtime"]
        state["_ckptc_options"] = {"verify": runtime.verify, "max_plans": runtime.max_plans}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = state.pop("_ckptc_options", {})
        self.__dict__.update(state)
        object.__setattr__(self, "_ckptc_runtime", StepRuntime(self._ckptc_model, self._ckptc_compiler, **options))

    @property
    def step_runtime(self) -> StepRuntime:
        """The :class:`~ckptc.runtime.step.StepRuntime` that runs this module's training calls (its per-shape
        plans, the records of the last step)."""
        return self._ckptc_runtime

    @property
    def original_module(self) -> torch.nn.Module:
        return self._ckptc_model

    @property
    def compiler(self) -> CheckpointCompiler:
        """The compiler of the most recently used input shape's plan."""
        return self._ckptc_runtime.compiler

    @property
    def plan(self) -> ModelPlan | None:
        """The plan of the last training step (None before the first one), with the
        measured peak of its first step when verification is on."""
        runtime = self._ckptc_runtime
        records = runtime.step_records()
        if not records:
            return None
        unique = list({id(r): r for r in records}.values())  # a graph run twice is one plan
        compiler = runtime.compiler
        result = ModelPlan.from_records(unique, compiler.options, compiler.model)
        if runtime.last is not None:
            result.measured_peak_bytes = runtime.last.measured_peak_bytes
            if runtime.last.eager is not None:
                result.coverage = Coverage.of(runtime.last.eager, records)
        return result

    def train(self, mode: bool = True) -> "OptimizedModule":
        self._ckptc_model.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        # Parameters, buffers and submodules first (the shared registries), then the wrapped
        # model's own attributes (config, save_pretrained, generate), as torch.compile's wrapper
        # does; `module` is the wrapped model (transformers' unwrap_model follows `.module`).
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_ckptc_model")
            if model is None or name.startswith("__"):
                raise
        if name == "module" and not hasattr(model, "module"):
            return model
        found = getattr(model, name)
        if inspect.ismethod(found) and found.__self__ is model and not hasattr(torch.nn.Module, name):
            return _unplanned_method(model, name, found)
        return found

    @_model_signature
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # (is_dynamo_compiling: Dynamo folds it to True in the code it traces; is_compiling reads a flag
        # every thread shares, set while another thread compiles.)
        return outside_dynamo(self._ckptc_call, args, kwargs, torch.compiler.is_dynamo_compiling())

    def _ckptc_call(self, args: tuple, kwargs: dict, traced: bool = False) -> Any:
        """One call of the model (``traced``: an outer ``torch.compile`` traced the caller)."""
        model = self._ckptc_model
        if traced:
            warn_once(
                model,
                "outer-compile",
                f"ckptc: torch.compile traced a call of {type(model).__name__} that ckptc runs: that compile "
                "compiles none of it (ckptc captures and compiles the training step itself; its graphs run "
                "op by op unless compiler='inductor' is given). What to do: drop the outer torch.compile and "
                "pass compiler='inductor' to ckptc.optimize/ckptc.apply for Inductor's kernels.",
                stacklevel=4,
            )
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in model.parameters()):
            return model(*args, **kwargs)
        transform = internals.func_transform_running()
        if transform is not None:
            # The transform's tensors wrap the batch (vmap) or track gradients outside autograd's graph
            # (grad): ckptc's capture cannot see them, and the transform computes its gradients itself.
            warn_once(
                model,
                "func-transform",
                f"ckptc: {type(model).__name__} was called under torch.func.{transform} (a torch.func "
                "transform: vmap, grad, jacrev, ...); ckptc plans training steps whose gradients autograd "
                "computes (loss.backward(), torch.autograd.grad), not calls inside such transforms, so these "
                "calls run eagerly, unplanned and unmeasured, and the budget does not hold for them. What to "
                "do: call the model outside the transform to train under the budget, or use "
                "torch.utils.checkpoint inside it.",
                stacklevel=4,
            )
            return model(*args, **kwargs)
        if not model.training:
            return _warn_on_backward_in_eval_mode(model, model(*args, **kwargs))
        check_call_order(self)
        _refuse_optimized_submodules(model)  # a submodule optimized after the model was
        return self._ckptc_runtime.call(args, kwargs)

    def __repr__(self) -> str:
        return f"OptimizedModule({self._ckptc_compiler!r}, module={type(self._ckptc_model).__name__})"


@torch.compiler.disable(reason="ckptc captures and compiles the training step itself")
def outside_dynamo(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` where an outer ``torch.compile`` (of a model ckptc runs, or of code calling
    it) does not trace: it breaks its graph here, and ckptc's own compiles run inside as usual.
    Traced, ckptc's runtime (its Python bookkeeping and its own ``torch.compile``) crashed Dynamo."""
    return call(*args)


def _unplanned_method(model: torch.nn.Module, name: str, method: types.MethodType) -> types.MethodType:
    """``method`` (the model's own, reached through the wrapper: ``fast.encode_text(...)``), still bound
    to the model, warning once if a backward runs through what a call of it returned by the model's own
    eager ops: ckptc plans only calls of the model itself, so such a step (a two-tower model trained
    through its encoders) ran unplanned."""

    @functools.wraps(method.__func__)
    def call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = method(*args, **kwargs)
        if not torch.is_grad_enabled() or "unplanned-method" in _told.get(model, ()):
            return output
        if not _reaches_parameters_eagerly(output, model):
            return output  # a loss computed from planned results (fast.compute_loss(out, y)) is the step's
        cls = type(model).__name__
        message = (
            f"ckptc: a backward ran through a call of {cls}.{name}(...) made through ckptc's wrapper; ckptc "
            f"plans only calls of the model itself ({cls}.forward), so that step ran {name} eagerly, unplanned "
            "and unmeasured, and the budget did not hold for it. What to do: compute it in forward and call "
            f"the wrapper (fast(...)), or pass ckptc.optimize a module whose forward calls {name}."
        )
        return _warn_on_backward(model, "unplanned-method", message, output)

    return types.MethodType(call, model)


def _reaches_parameters_eagerly(output: Any, model: torch.nn.Module) -> bool:
    """Whether the autograd graph of ``output`` reaches a parameter of ``model`` by eager ops, not
    only through compiled graphs (ckptc's planned calls)."""
    params = {id(p) for p in model.parameters() if p.requires_grad}
    tensors = [t for t in internals.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return any(id(t) in params for t in internals.tensors_held_for_backward(tensors, saved=False))


_told: weakref.WeakKeyDictionary[torch.nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _warn_on_backward(model: torch.nn.Module, key: str, message: str, output: Any) -> Any:
    """Warn ``message`` once (per model and ``key``) when a backward runs through ``output``, a call of
    ``model`` that ran eagerly, outside ckptc's plans."""
    if key in _told.get(model, ()):
        return output
    tensors = [t for t in internals.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]

    @internals.outside_user_compile
    def warn(_: torch.Tensor) -> None:
        _told.setdefault(model, set()).add(key)  # no more hooks on such calls; warn_once says it once
        warn_once(model, key, message)

    if tensors:
        tensors[0].register_hook(warn)
    return output


def _warn_on_backward_in_eval_mode(model: torch.nn.Module, output: Any) -> Any:
    """An eval-mode call with gradients enabled runs eagerly, unplanned: an evaluation that forgot
    ``torch.no_grad()``, or training in eval mode (to turn dropout off).  If a backward runs through
    it, it was training: warn once, since the budget did not hold for that step."""
    message = (
        f"ckptc: a backward ran through a call of {type(model).__name__} made in eval mode; ckptc plans "
        "only training-mode calls, so that step ran eagerly, unplanned and unmeasured, and the budget "
        "did not hold for it. What to do: train in train mode (model.train(); set dropout's p to 0 to "
        "turn it off), or run evaluation under torch.no_grad()."
    )
    return _warn_on_backward(model, "eval-training", message, output)


def optimize(
    model: torch.nn.Module,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    solver: str = "auto",
    strategy: str = "auto",
    plan: str | ModelPlan | None = None,
    must_save: Sequence[str] = (),
    must_recompute: Sequence[str] = (),
    compiler: str = "eager",
    measure_time: bool = False,
    measure_scratch: bool = True,
    hold_outputs: bool | None = None,
    time_limit: float | None = None,
    progress: Callable[[float, str], None] | None = None,
    verify: bool = True,
    max_plans: int = 8,
    **unknown: Any,
) -> OptimizedModule:
    """Return a module that trains like ``model`` within a memory budget.

    The planning options are those of :class:`~ckptc.options.CheckpointOptions`
    (checked there, once: an unknown name or a bad value raises ``ValueError``).

    Args:
        model: any ``nn.Module`` with trainable parameters.
        budget_gb / budget_bytes: peak memory of one forward+backward step on the
            model's device: parameters, buffers, inputs, gradients, activations
            and temporaries (not optimizer state).  Give one of them, or neither
            for ``strategy="none"``-like behaviour with ``"auto"``.
        solver: ``"auto"`` or a name in ``solvers.METHODS``.
        strategy: ``"auto"`` (solver under the budget), ``"none"``, ``"layer"``,
            ``"segment"`` or ``"selective"``.
        plan: a plan file path or :class:`ModelPlan` to apply without solving.
        must_save / must_recompute: patterns over stable node names such as
            ``"transformer.h.*.attn.*"`` or ``"*.softmax*"``.
        compiler: ``"eager"`` (default) or ``"inductor"``.
        measure_time / measure_scratch: price recomputation by measured seconds
            instead of FLOPs; measure kernels' scratch memory (on by default).
        hold_outputs: whether the caller keeps forward results other than the
            loss (logits) alive until backward ends.  None (default) watches:
            the first plans count them held until a step shows what the caller
            does; if the model computes and returns its own scalar loss and the
            caller dropped the results before backward ended
            (``loss = model(x, labels=y).loss``), the step is planned again with
            them counted only during forward.  Without its own loss, a single
            graph whose results died once the caller's loss used them
            (``loss = criterion(model(x), y)``) is planned again with them
            dropped after forward and what that loss held counted there, once a
            measured step showed it; otherwise they count until backward ends.
            True (results held, and their gradients counted: the loss may use
            them) / False (dropped after forward) decide upfront.
        verify: measure the peak of the first step of every plan (forward start
            to backward end) and, if it exceeds the budget, plan again with
            the excess counted (at most 3 times, then raise
            :class:`~ckptc.errors.BudgetExceededError`).  Costs one profiled step
            per plan on CPU (a few reads of the allocator's counters on CUDA).
        max_plans: how many input shapes keep their plan (least recently used
            ones are forgotten and planned again when they come back).

    Raises:
        ckptc.UnknownOptionError: a keyword ``optimize`` does not take (the message lists the valid ones).
        ckptc.ArgumentTypeError: ``model`` is not an ``nn.Module``, or an argument has the wrong type.
        ckptc.InvalidArgumentError: the budget is not a positive finite number, an option's value is
            not one ckptc takes, or the model has no trainable parameters.
        solvers.InfeasibleBudgetError: (on the first training call) the budget is
            below the smallest feasible budget, which the message gives.

    Example:
        >>> fast = ckptc.optimize(model, budget_gb=40)      # doctest: +SKIP
        >>> loss = fast(input_ids, labels=labels).loss; loss.backward()
    """
    refuse_unknown("ckptc.optimize argument", unknown, _keywords(optimize), "arguments")
    if not isinstance(verify, bool):
        raise InvalidArgumentError(f"verify must be True or False, got {verify!r}")
    _check_model(model)
    _refuse_weightless(model)
    compiler_ = configured(
        budget_gb,
        budget_bytes=budget_bytes,
        solver=solver,
        strategy=strategy,
        plan=plan,
        must_save=must_save,
        must_recompute=must_recompute,
        compiler=compiler,
        hold_outputs=hold_outputs,
        measure_time=measure_time,
        measure_scratch=measure_scratch,
        time_limit=time_limit,
        model=model,
        progress=progress,
    )
    return OptimizedModule(model, compiler_, verify=verify, max_plans=max_plans)


def _keywords(function: Callable) -> list[str]:
    """The names ``function`` takes by keyword (its ``**options`` aside)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds and p.name != "model"]


def example_call(example_inputs: Any, example_kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example call's positional and keyword inputs as a tuple and a dict.

    A single tensor is the one positional input (``capture(model, ids)``), as in
    ``torch.jit.trace``; ``tuple(ids)`` would have made each of its rows an input.

    Raises:
        ArgumentTypeError: the inputs are not a sequence (a dict is named: keyword
            inputs go in ``example_kwargs``), or the keyword inputs are not a dict
            with string keys.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        raise ArgumentTypeError(
            "example_inputs is a dict; keyword inputs go in example_kwargs: "
            "ckptc.capture(model, (), {'input_ids': ids, ...})"
        )
    if not isinstance(example_inputs, Sequence) or isinstance(example_inputs, (str, bytes)):
        raise ArgumentTypeError(
            f"example_inputs is a {type(example_inputs).__name__}; give the model's positional inputs as a tuple "
            "(a single tensor may be given as it is)"
        )
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, Mapping) or not all(isinstance(k, str) for k in example_kwargs):
        raise ArgumentTypeError(
            f"example_kwargs is a {type(example_kwargs).__name__}; give the model's keyword inputs as a dict "
            "of names to values"
        )
    return tuple(example_inputs), dict(example_kwargs)


def _refuse_weightless(model: torch.nn.Module) -> None:
    """Refuse to train a model whose parameters hold no values (built on ``meta`` or under fake tensors):
    capturing its step failed later with an error about devices or fake tensors and advice about graph breaks."""
    weightless = next((p for p in model.parameters() if p.is_meta or internals.is_fake(p)), None)
    if weightless is not None:
        where = "on the meta device" if weightless.is_meta else "fake tensors"
        raise InvalidArgumentError(
            f"{type(model).__name__}'s parameters are {where}: they hold no values, so it cannot train. "
            "What to do: to plan it without its weights, call ckptc.plan(model, example_inputs, budget_gb=..., "
            "device=...) or run `ckptc plan FACTORY --device ...` (see 'Planning a model that does not fit "
            "here'), then apply the plan file to the model with its weights loaded (model.to_empty(device=...) "
            "and load_state_dict)."
        )


def _is_optimized(module: torch.nn.Module) -> bool:
    """Whether ckptc runs ``module``: an :class:`OptimizedModule`, or a module ``ckptc.apply`` was called on."""
    return isinstance(module, OptimizedModule) or isinstance(
        getattr(internals.module_call_override(module), "optimized", None), OptimizedModule
    )


def _refuse_optimized_submodules(model: torch.nn.Module) -> None:
    """Refuse a model one of whose submodules ckptc optimizes too, whichever was optimized first.

    Raises:
        ArgumentTypeError: naming the submodule and what to do.
    """
    # A walk by children: it runs on every training call, and named_modules builds every module's dotted name.
    stack = list(model.children())
    while stack:
        module = stack.pop()
        if _is_optimized(module):
            name = next(n for n, m in model.named_modules() if m is module)
            # As Python spells it: model.blocks[0], not model.blocks.0.
            spelled = "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in name.split("."))
            raise ArgumentTypeError(
                f"{type(model).__name__}.{name} is optimized by ckptc, and so is {type(model).__name__}: a plan "
                f"covers either the whole model or its submodules, not both (the model's plan would leave the "
                f"submodule's budget unkept, or the submodule's call would split the model's plan). Optimize the "
                f"whole model with the submodule restored (model{spelled} = model{spelled}.original_module, or "
                "ckptc.remove on it), or keep only the submodules optimized and train the model as it is"
            )
        stack.extend(module.children())


def _check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"ckptc.optimize expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, OptimizedModule):
        raise ArgumentTypeError("this module is already optimized; pass its original_module instead")
    # ckptc.apply's entry in the model's call slot runs an OptimizedModule (ckptc.inplace builds on this module).
    if isinstance(getattr(internals.module_call_override(model), "optimized", None), OptimizedModule):
        raise ArgumentTypeError(
            f"ckptc.apply was already called on this {type(model).__name__}; train it as it is, "
            "or call ckptc.remove(model) first"
        )
    _refuse_optimized_submodules(model)
    check_wrap_order(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidArgumentError(
            f"{type(model).__name__} has no trainable parameters (none requires grad), and ckptc.optimize plans "
            "steps that train parameters.\nWhat to do: set requires_grad on the parameters to train; for "
            "gradients of the inputs alone (adversarial examples, attribution), use torch.compile(model, "
            "backend=ckptc.backend(budget_gb=..., model=model)), which plans every graph that needs gradients"
        )


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | torch.device | None = None,
    **options: Any,
) -> CapturedStep:
    """Capture one training step of ``model`` once, to plan it under any number of budgets.

    A model on the ``meta`` device or built under ``FakeTensorMode`` (or any
    model, given ``device``) is captured offline, for ``device`` (default: the
    fake tensors' device, else ``cpu``), under fake tensors: no weight or
    activation is allocated, kernels' scratch is measured on shrunk copies of
    large ops, and the plan is the one the same model with real weights gets
    there (:mod:`ckptc.capture.offline`).

    Runs one forward and backward pass on the example inputs (to capture every
    graph, including those after graph breaks) and restores the parameters'
    gradients, the buffers (BatchNorm statistics), the random state and the
    gradients of example inputs that require one afterwards, so the model and
    its inputs are left exactly as they were.  Results of the graphs that the
    model itself keeps through backward (a forward hook storing a layer's
    output) are found on that step and counted held (the step runs once more).  ``options`` are those
    of :func:`optimize` that shape the captured problem (``must_save``,
    ``must_recompute``, ``hold_outputs``, ``compiler``, ``measure_time``) and
    the defaults of :meth:`CapturedStep.plan` (``strategy``, ``solver``,
    ``time_limit``); a budget is given to ``plan``.  ``example_inputs`` is a
    tuple of positional inputs, or one tensor for a model that takes one.

    Example:
        >>> step = ckptc.capture(model, (input_ids,), {"labels": labels})   # doctest: +SKIP
        >>> step.floor_bytes, step.unoptimized_peak_bytes
        >>> [step.plan(budget_bytes=b) for b in budgets]                    # no capture again
    """
    for name in ("budget_gb", "budget_bytes", "plan"):
        if options.get(name) is not None:
            raise InvalidArgumentError(f"ckptc.capture takes no {name}; give the budget to CapturedStep.plan(...)")
    checked = CheckpointOptions.from_user(
        {k: v for k, v in options.items() if k not in ("verify", "max_plans", "progress")}
    )
    _check_model(model)
    example_inputs, example_kwargs = example_call(example_inputs, example_kwargs)
    if not model.training or not torch.is_grad_enabled():
        raise InvalidArgumentError(
            f"ckptc.capture captures a training step, but {type(model).__name__} is in eval mode or gradients "
            "are disabled (torch.no_grad), so no backward would be captured. What to do: call model.train() "
            "and capture outside torch.no_grad()."
        )
    target = offline_device(model, example_inputs, example_kwargs, device)
    if target is not None:
        if checked.measure_time:
            raise ValueError(
                "measure_time=True runs every op on real tensors, which an offline capture (meta or fake "
                "tensors, or device=...) does not do; plan without it"
            )
    # Captured keeping everything; CapturedStep.plan decides for each budget afterwards.
    # Traced as the target compiler traces (the plan's node names are its graph's), run without kernels.
    template = CheckpointCompiler(checked.replace(strategy="none"), model=model, generate_kernels=False)
    ranks = rank_context(model)
    shape = ShapePlan.first((), template, ranks)
    ran: list[GraphRecord] = []  # the step's graphs in the order they ran (a graph repeats for layers compiled once)
    with contextlib.ExitStack() as stack:
        stack.enter_context(internals.compiled_code_forgotten())  # nothing runs the capture's graphs again
        inputs, kwargs = example_inputs, example_kwargs
        if target is not None:
            inputs, kwargs = stack.enter_context(offline_step(model, inputs, kwargs, target))
        with training_state_restored(model, inputs, kwargs):
            for p in model.parameters():
                p.grad = None
            # Which graphs' results the eager code between graphs lets go, what it saves for its backward,
            # and whether the model holds results past backward, as optimize's steps note them.
            lifetimes = ResultLifetimes(watch_results=True)
            with _capture_errors(model):
                shape.compile(model, template, ran, lifetimes)
            _reference_step(model, shape, template, ran, inputs, kwargs, loss_fn, target, reference=ranks is None)
            if lifetimes.results_alive() and shape.replans.observed_results(True, ran):
                # The model holds results of its graphs past backward (a forward hook storing a layer's
                # output): the step runs again with the graphs planned counting them held.
                log.info("%s holds results of its graphs through backward: counted held", type(model).__name__)
                del ran[:]
                lifetimes.begin()
                _reference_step(model, shape, template, ran, inputs, kwargs, loss_fn, target, reference=False)
    records = list({id(r): r for r in ran}.values())
    warn_unmatched_patterns(model, type(model).__name__, [r.joint_problem for r in records], checked)
    position = {id(r): i for i, r in enumerate(records)}
    coverage = None if shape.eager is None else Coverage.of(shape.eager, ran)
    sizes = _parameter_sizes(model)
    return CapturedStep(
        records,
        checked,
        model_name=type(model).__name__,
        coverage=coverage,
        sequence=[position[id(r)] for r in ran],
        unnamed_gradient_bytes=unnamed_gradient_bytes(model, ran),
        results_let_go=shape.replans.account.results_let_go,
        results_held=checked.hold_outputs is None and shape.replans.account.hold_outputs is True,
        **sizes,
    )


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor = (),
    example_kwargs: dict[str, Any] | None = None,
    budget_gb: float | None = None,
    *,
    budget_bytes: int | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    plan: str | ModelPlan | None = None,
    progress: Callable[[float, str], None] | None = None,
    device: str | torch.device | None = None,
    **options: Any,
) -> ModelPlan:
    """Plan one training step of ``model`` without training it: ``capture(...).plan(...)``.

    ``plan`` (a plan file or :class:`ModelPlan`) applies its decisions to the
    captured graphs instead of solving.  The model is left exactly as it was
    (see :func:`capture`).  A model on ``meta`` or under fake tensors, or
    ``device=...``, is planned offline for that device (see :func:`capture`).
    """
    budget = CheckpointOptions.from_user(budget_gb=budget_gb, budget_bytes=budget_bytes).budget_bytes
    source = None
    if plan is not None:
        source, budget, hold = applied_plan(plan, budget, options.get("hold_outputs"))
        options["hold_outputs"] = hold
    step = capture(model, example_inputs, example_kwargs, loss_fn=loss_fn, device=device, **options)
    return step.plan(budget_bytes=budget, plan_source=source, progress=progress)


@contextlib.contextmanager
def training_state_restored(model: torch.nn.Module, *inputs: Any) -> Iterator[None]:
    """Run trial steps on ``model`` and then put back its gradients, buffers
    (BatchNorm statistics) and the global random state, and the gradients of the
    tensors in ``inputs`` that are leaves requiring one (an input the caller
    differentiates, as in adversarial training), so nothing is lost.  An input the
    forward updates in place keeps the one update a call makes."""
    leaves = [t for t in internals.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
    saved_grads = {p: p.grad for p in [*model.parameters(), *leaves]}
    for leaf in leaves:
        leaf.grad = None  # the trial steps' backward would add into it in place
    saved = ForwardState(model)
    try:
        yield
    finally:
        for p, g in saved_grads.items():
            p.grad = g
        saved.restore()


def _reference_step(
    model: torch.nn.Module,
    shape: ShapePlan,
    template: CheckpointCompiler,
    ran: list[GraphRecord],
    inputs: tuple,
    kwargs: dict,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    target: torch.device | None,
    *,
    reference: bool,
) -> None:
    """``capture``'s training step: the planning call, appending its graphs to ``ran``, then the loss's
    backward; nothing it returns outlives it."""
    with _capture_errors(model):
        output = shape.plan_call(model, template, ran, inputs, kwargs, reference=reference)
        refuse_unplanned(model, ran, shape.eager, output)
    try:  # the caller's loss function: its own errors are raised as they are
        loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
    except RuntimeError as error:
        if target is None or "meta" not in str(error):
            raise
        why = str(error).splitlines()[0][:200]
        raise UntraceableModelError(
            f"ckptc captured {type(model).__name__} offline for {target}, but the loss function read a "
            f"tensor on the meta device ({why}): it closes over a tensor that is not one of "
            "the example inputs, so the capture could not replace it.\nWhat to do: pass what the loss "
            "reads as an input (labels=ids) or compute the loss inside the model's forward."
        ) from None
    with _capture_errors(model):
        loss.backward()


@contextlib.contextmanager
def _capture_errors(model: torch.nn.Module) -> Iterator[None]:
    """ckptc's errors and running out of memory as they are; any other failure of the captured step as
    one :class:`UntraceableModelError`, the underlying error chained."""
    try:
        yield
    except (CkptcError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as error:
        if is_models_own(error):
            raise  # the model's own code raised it, as eager PyTorch does (inputs it rejects, say)
        raise UntraceableModelError.from_exception(model, error) from error


def _default_loss(output: Any) -> torch.Tensor:
    """The model's own loss if it returns one, else the sum of its first output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    raise ArgumentTypeError(f"cannot derive a loss from a {type(output).__name__}; pass loss_fn=... to ckptc.plan")
