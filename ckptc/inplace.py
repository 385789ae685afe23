"""The in-place form: ``ckptc.apply(model, budget_gb=...)`` and ``ckptc.remove(model)``.

``ckptc.optimize`` returns a new module; frameworks that take a model (the
Hugging Face ``Trainer``, accelerate, Lightning, PEFT) look at the model they
are given: its class (``PreTrainedModel`` for ``save_pretrained``), its
``forward`` signature (the ``Trainer`` keeps only dataset columns that
``forward`` accepts), its ``config`` and its hooks.  ``apply`` leaves all of
that untouched, as ``model.gradient_checkpointing_enable()`` does: it returns
the same object, with the same class, ``forward``, parameters, buffers,
``state_dict`` keys and hooks.

It uses the slot PyTorch itself provides for this, ``nn.Module._compiled_call_impl``
(what ``model.compile()`` sets): ``model(...)`` goes to it instead of
``_call_impl``.  ckptc's entry there hands training calls to the runtime of an
:class:`~ckptc.api.OptimizedModule` built by :func:`ckptc.optimize` (the same
per-shape plans, step tracking and measured verification) and runs every other
call (``eval()``, ``torch.no_grad()``) as the plain model.  Hooks run once per
call, inside the runtime's call of the model.  Copies (``copy.deepcopy``,
``pickle``, ``torch.save``) are plain models: ``nn.Module.__getstate__`` drops
the slot, as it does for ``model.compile()``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from ckptc._torch_internals import module_call_override, set_module_call_override
from ckptc.api import OptimizedModule, live_wrappers, optimize, outside_dynamo
from ckptc.errors import ArgumentTypeError, PlanMismatchError
from ckptc.plans import ModelPlan

log = logging.getLogger("ckptc.inplace")


_STILL_APPLIED = (
    "ckptc.apply's plan file stays applied to this {}: every training call raises this until "
    "ckptc.remove(model) (then it trains without ckptc) or ckptc.apply(model, ...) with another plan."
)


class AppliedCall:
    """What ``model._compiled_call_impl`` holds while ckptc is applied.

    Calls the model through :attr:`optimized` (its runtime plans and runs
    training calls; other calls run the model eagerly).  While that call runs,
    the slot is empty, so the runtime's ``torch.compile`` of the model reaches
    the model's own ``_call_impl`` (hooks, then ``forward``) instead of coming
    back here.
    """

    def __init__(self, model: torch.nn.Module, optimized: OptimizedModule) -> None:
        self.model = model
        self.optimized = optimized

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (is_dynamo_compiling, not is_compiling: see ckptc.api.OptimizedModule.forward)
        return outside_dynamo(self._call, args, kwargs, torch.compiler.is_dynamo_compiling())

    def _call(self, args: tuple, kwargs: dict, traced: bool) -> Any:
        set_module_call_override(self.model, None)
        try:
            return self.optimized._ckptc_call(args, kwargs, traced)
        except PlanMismatchError as error:
            said = _STILL_APPLIED.format(type(self.model).__name__)
            if error.args and isinstance(error.args[0], str) and said not in error.args[0]:
                error.args = (f"{error.args[0]}\n{said}", *error.args[1:])
            raise
        finally:
            set_module_call_override(self.model, self)

    @property
    def plan(self) -> ModelPlan | None:
        return self.optimized.plan

    def __repr__(self) -> str:
        return f"AppliedCall({self.optimized!r})"


def apply(model: torch.nn.Module, budget_gb: float | None = None, **options: Any) -> torch.nn.Module:
    """Plan ``model``'s training calls for a memory budget in place, and return ``model`` itself.

    ``options`` (``budget_bytes``, ``solver``, ``strategy``, ``plan``, ...) and their
    checks are :func:`ckptc.optimize`'s.  ``model`` keeps its class, ``forward`` (and
    its signature), ``config``, parameters, buffers, ``state_dict`` keys and hooks, so
    it can be handed to any framework that takes a model; :func:`applied` gives its
    plan, :func:`remove` undoes it.  Applying again replaces the earlier options (and
    forgets their plans).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, is (or is wrapped by) a ``ckptc.optimize``
            wrapper, or was compiled in place with ``model.compile()`` (both use
            the same slot of the module).
        ValueError: as :func:`ckptc.optimize` (bad budget, no trainable parameters).

    Example:
        >>> model = ckptc.apply(GPT2LMHeadModel(config), budget_gb=8)   # doctest: +SKIP
        >>> Trainer(model=model, args=TrainingArguments("out"), train_dataset=data).train()
        >>> ckptc.applied(model).plan                                    # what is kept / recomputed
    """
    current = module_call_override(model) if isinstance(model, torch.nn.Module) else None
    if current is not None and not isinstance(current, AppliedCall):
        raise TypeError(
            f"{type(model).__name__} was compiled in place with model.compile(), which uses the same slot as "
            "ckptc.apply; apply ckptc to a model that is not compiled in place"
        )
    if isinstance(model, torch.nn.Module) and any(not _in_place(w) for w in live_wrappers(model)):
        raise ArgumentTypeError(
            f"this {type(model).__name__} is already wrapped by ckptc.optimize (an OptimizedModule still in "
            "use); train that wrapper, or drop it (del it) before calling ckptc.apply on the model: both "
            "would plan the same training calls"
        )
    # Build (and check every option) before touching the model: a bad option leaves it as it was.
    with _detached(model):
        optimized = optimize(model, budget_gb, **options)
    if current is not None:
        log.info("ckptc.apply on %s again: the new options replace the earlier ones", type(model).__name__)
    object.__setattr__(optimized, "_ckptc_in_place", True)
    set_module_call_override(model, AppliedCall(model, optimized))
    return model


def _in_place(wrapper: OptimizedModule) -> bool:
    """Whether ``wrapper`` runs a model's calls for :func:`apply` (not a wrapper the caller trains)."""
    return bool(wrapper.__dict__.get("_ckptc_in_place"))


def applied(model: torch.nn.Module) -> OptimizedModule | None:
    """The :class:`~ckptc.api.OptimizedModule` that runs ``model``'s training calls
    since :func:`apply` (``.plan``, ``.compiler``), or None if ckptc is not applied."""
    entry = module_call_override(model)
    return entry.optimized if isinstance(entry, AppliedCall) else None


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`apply`: ``model`` runs as before it (its plans are forgotten); returns ``model``.

    A model ckptc is not applied to is returned unchanged.
    """
    if isinstance(module_call_override(model), AppliedCall):
        set_module_call_override(model, None)
    return model


@contextlib.contextmanager
def _detached(model: Any) -> Iterator[None]:
    """Empty the slot while ``optimize`` checks the model (it refuses applied models); put it back
    if that fails, so a bad option leaves the model as it was."""
    entry = module_call_override(model) if isinstance(model, torch.nn.Module) else None
    if entry is not None:
        set_module_call_override(model, None)
    try:
        yield
    except BaseException:
        if entry is not None:
            set_module_call_override(model, entry)
        raise


def is_applied(model: Any) -> bool:
    """Whether ckptc is applied to ``model`` in place (``optimize`` refuses such a model)."""
    return isinstance(model, torch.nn.Module) and isinstance(module_call_override(model), AppliedCall)
