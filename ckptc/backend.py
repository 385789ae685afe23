"""``torch.compile`` backend entry points.

After ``pip install``, ``torch.compile(model, backend="ckptc", options={...})``
works without importing ckptc first: the package declares
:func:`ckptc_backend` in the ``torch_dynamo_backends`` entry-point group.
``ckptc.backend(budget_gb=..., compiler=...)`` returns a configured backend
object instead.

Options (both ways): those of :class:`~ckptc.options.CheckpointOptions`
(``budget_gb`` or ``budget_bytes``, ``solver``, ``strategy``, ``must_save``,
``must_recompute``, ``compiler``, ``hold_outputs``, ``measure_time``,
``measure_scratch``, ``time_limit``) and ``plan`` (a plan file or
:class:`~ckptc.plans.ModelPlan`).

One budget covers all graphs of one ``torch.compile`` call (graph breaks
included): Dynamo calls the backend once per graph with the same options, and
the graphs of one call share one :class:`~ckptc.capture.compiler.CheckpointCompiler`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ckptc import _torch_internals as internals
from ckptc.capture.compiler import CheckpointCompiler, refuse_compile_args
from ckptc.capture.coverage import recurrent_modules
from ckptc.errors import CkptcError, InvalidArgumentError, warn_once
from ckptc.options import CheckpointOptions
from ckptc.plans import ModelPlan, applied_plan

# One compiler per options dict: Dynamo passes the same dict for every graph of
# one torch.compile call.  The dict is kept alive with its compiler so its id
# is never reused while the entry exists.
_compilers: dict[int, tuple[dict[str, Any], CheckpointCompiler]] = {}


def backend(
    budget_gb: float | None = None,
    *,
    plan: str | ModelPlan | None = None,
    model: torch.nn.Module | None = None,
    progress: Callable[[float, str], None] | None = None,
    **options: Any,
) -> CheckpointCompiler:
    """A configured ``torch.compile`` backend.

    ``options`` are those of :class:`~ckptc.options.CheckpointOptions`
    (``budget_bytes``, ``solver``, ``strategy``, ``must_save``, ``must_recompute``,
    ``compiler``, ``hold_outputs``, ``measure_time``, ``time_limit``); an
    unknown name or a bad value raises ``ValueError``.  ``plan`` applies a plan
    file or :class:`ModelPlan` instead of solving.  ``model`` lets each graph count
    the parameters, buffers and gradients that it does not see (after a graph
    break, in eager code, frozen) in its baseline; without it the model being
    compiled is found on the stack (its ``torch.compile`` wrapper's call, its own
    call under ``model.compile()``, the one module a compiled function is called
    with), and otherwise what the graphs do not take is learned from the first
    step that runs (eager code after the last graph is not seen).

    The backend plans and measures only what Dynamo hands it: code Dynamo runs
    eagerly (a skipped frame, say after a graph break inside a loop) is neither
    planned nor counted.  ``torch.compile(..., fullgraph=True)`` makes Dynamo raise
    at a break instead; :func:`ckptc.optimize` refuses such a model naming Dynamo's reason for the break.

    Example:
        >>> compiled = torch.compile(model, backend=ckptc.backend(budget_gb=40))  # doctest: +SKIP
    """
    compiler = configured(budget_gb, plan=plan, model=model, progress=progress, **options)
    if model is not None:
        _warn_if_recurrent_modules_run_eagerly(model)
    return compiler


def configured(
    budget_gb: float | None = None,
    *,
    plan: str | ModelPlan | None = None,
    model: torch.nn.Module | None = None,
    progress: Callable[[float, str], None] | None = None,
    **options: Any,
) -> CheckpointCompiler:
    """The compiler :func:`backend` returns, without its warning about recurrent modules, which the
    caller's Dynamo configuration leaves untraced: :func:`ckptc.optimize` compiles under its own, which
    traces them (it warned every LSTM model trained through it that it would run eagerly)."""
    checked = CheckpointOptions.from_user(options, budget_gb=budget_gb)
    if internals.dynamo_disabled():
        warn_once(
            CheckpointCompiler,
            "dynamo-disabled",
            "ckptc: torch.compile is turned off in this process (TORCH_COMPILE_DISABLE=1, or "
            "torch._dynamo.config.disable = True): it runs every call eagerly and never calls this backend, "
            "so nothing is planned and the budget does not hold. What to do: unset TORCH_COMPILE_DISABLE.",
            stacklevel=3,  # past configured() and backend() or ckptc.optimize
        )
    source = None
    if plan is not None:
        chosen = [name for name in ("strategy", "solver", "must_save", "must_recompute") if options.get(name)]
        chosen = [n for n in chosen if options[n] != getattr(CheckpointOptions(), n)]
        if chosen:
            raise InvalidArgumentError(
                f"plan= applies a plan as it is, so {', '.join(chosen)} would change nothing; pass them to "
                "ckptc.plan when making the plan, or drop plan= to plan here"
            )
        source, budget, hold = applied_plan(plan, checked.budget_bytes, checked.hold_outputs)
        checked = checked.replace(budget_bytes=budget, hold_outputs=hold)
    return CheckpointCompiler(checked, model=model, plan_source=source, progress=progress)


def _warn_if_recurrent_modules_run_eagerly(model: torch.nn.Module) -> None:
    """The backend runs under the caller's Dynamo configuration, where recurrent modules are not traced
    by default: they run eagerly, neither planned nor counted, and the budget does not hold."""
    rnns = [name for name, _ in recurrent_modules(model)]
    if rnns and not internals.dynamo_traces_rnns():
        warn_once(
            model,
            "backend-rnn-eager",
            f"ckptc: {type(model).__name__}'s {', '.join(rnns[:3])} ({type(model.get_submodule(rnns[0])).__name__}) "
            "will run eagerly under torch.compile: Dynamo does not trace recurrent modules unless "
            "torch._dynamo.config.allow_rnn is True, so their activations are neither planned nor counted "
            "and the budget does not hold (a tagger with a 2-layer LSTM measured 1.8x its budget). What to do: "
            "set torch._dynamo.config.allow_rnn = True before compiling, or train the model through "
            "ckptc.optimize, which traces them.",
            stacklevel=3,
        )


def ckptc_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, **compile_args: Any
) -> Callable:
    """The ``backend="ckptc"`` entry point: plans each graph under ``options``.

    ``torch.compile`` hands string backends its ``mode`` too; ckptc has no modes (``mode=None`` or
    ``"default"`` is accepted), and anything else is refused saying what to pass instead.
    """
    try:
        refuse_compile_args(compile_args)
        options = options or {}
        entry = _compilers.get(id(options))
        if entry is None or entry[0] is not options:
            entry = (options, backend(**options))
            _compilers[id(options)] = entry
    except CkptcError as error:
        # Dynamo would hand it to the caller wrapped in its BackendCompilerFailed: not a CkptcError.
        raise internals.raised_through_dynamo(error) from error.__cause__
    return entry[1](gm, example_inputs)
