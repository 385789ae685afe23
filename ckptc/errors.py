"""Errors raised by ckptc.  Each message says what went wrong and what to do next.

Every error ckptc raises derives from :class:`CkptcError`, which is defined in
:mod:`solvers.errors` (so ``solvers`` stays importable without ckptc) and is
also the base of the solvers' errors, ``InfeasibleBudgetError`` included.

Errors about the value of an argument are also :class:`ValueError`, so code
that guards a call with ``except ValueError`` keeps working:

* ``InvalidArgumentError``: a budget or option with a value ckptc does not take
  (quoted); ``ArgumentTypeError`` (also a :class:`TypeError`) for a wrong type;
  ``UnknownOptionError`` (both) for a keyword ckptc does not know (the message
  lists the valid names);
* ``InfeasibleBudgetError``: the budget is below the smallest feasible one, or below the peak a plan
  file given with it predicts;
* ``CorruptPlanError``: the plan file's content is not a valid plan;
  ``PlanFileNotFoundError`` (also a :class:`FileNotFoundError`): there is no file at the path;
* ``PlanMismatchError``: the plan belongs to another model, other inputs or
  another torch version.

``UntraceableModelError`` is not: the model's code, not an argument's value,
is what capture could not handle.
"""

from __future__ import annotations

import logging
import sys
import traceback
import warnings
import weakref
from typing import Any

import torch

from solvers.errors import CkptcError

__all__ = [
    "CkptcError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownOptionError",
    "UntraceableModelError",
    "PlanMismatchError",
    "CorruptPlanError",
    "PlanFileNotFoundError",
    "WrapOrderError",
    "DistributedPlanMismatchError",
    "CkptcWarning",
    "warn_once",
]


class InvalidArgumentError(CkptcError, ValueError):
    """An argument (a budget, an option) has a value ckptc does not take; the message quotes it."""


class ArgumentTypeError(CkptcError, TypeError):
    """An argument has a type ckptc does not take (a model that is not an ``nn.Module``, a
    budget that is not a number); the message names the type given and the one expected."""


class UnknownOptionError(InvalidArgumentError, TypeError):
    """A keyword ckptc does not know; the message lists the valid names (and the closest one).

    Also a :class:`TypeError`, as Python's own error for an unexpected keyword is."""


class UntraceableModelError(CkptcError):
    """The model's training step could not be captured as a graph."""

    @classmethod
    def from_exception(
        cls, model: torch.nn.Module | str, error: BaseException, stage: str = "capture"
    ) -> "UntraceableModelError":
        """The error for ``error`` raised while ckptc captured, planned or ran (``stage``) the step;
        raise it ``from error`` so the underlying error stays chained."""
        reason = str(getattr(error, "inner_exception", None) or error).strip().splitlines()[0:3]
        name = model if isinstance(model, str) else type(model).__name__
        read = {type(e).__name__ for e in _chain(error)}
        if "DataDependentOutputException" in read or (
            "GuardOnDataDependentSymNode" in read and _user_frame(error) != "the model's code"
        ):
            # Raised by a fake tensor asked for its value outside a traced graph (with a shape
            # environment: a branch on the symbol standing for it, raised in the model's own frame,
            # which a traced frame never is): the model's eager code between graphs ran on the fake
            # or meta tensors of an offline capture.
            return cls(
                f"ckptc could not {stage} the training step of {name} offline: {_user_frame(error)} reads the "
                "value of a tensor (a Python `if` on a tensor, .item(), torch.rand(...) < p) in code that runs "
                "between compiled graphs, and under fake or meta tensors no tensor has a value.\n"
                "What to do: plan the model with real weights, or change that code so it does not read a "
                "tensor's value in Python during training (for a model option such as layerdrop, one that "
                "skips the read)."
            )
        return cls(
            f"ckptc could not {stage} the training step of {name}: {type(error).__name__}: "
            f"{' '.join(reason)}\n"
            "What to do: run the step once with torch.compile(model, backend='aot_eager') to see "
            "where capture fails (TORCH_LOGS=graph_breaks lists graph breaks); move the failing "
            "code out of forward or wrap it with torch.compiler.disable so it runs eagerly; "
            "or checkpoint manually with torch.utils.checkpoint.  If the error is about the inputs (a dtype "
            "or shape the model does not take), eager PyTorch raises it too: call the model once without "
            "ckptc to check."
        )


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from or during, outermost first."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _outside_torch_and_ckptc(filename: str) -> bool:
    """Whether ``filename`` is code of the user's: not torch's, not ckptc's, and not code FX or Dynamo
    generates (a made-up file name, "proxy_tensor.py:1738 in wrapped")."""
    import os

    skip = (os.path.dirname(torch.__file__ or ""), os.path.dirname(__file__))
    return not filename.startswith(skip) and os.path.isfile(filename)


def _user_frame(error: BaseException) -> str:
    """``file:line (`code`)`` of the innermost frame outside torch and ckptc where ``error`` was
    raised, or ``the model's code`` if there is none."""
    import os

    frames = [f for e in _chain(error) for f in traceback.extract_tb(e.__traceback__)]
    mine = [f for f in frames if _outside_torch_and_ckptc(f.filename)]
    if not mine:
        return "the model's code"
    frame = mine[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} (`{(frame.line or '').strip()}`)"


class UnboundedSizeError(UntraceableModelError):
    """A size in the captured graph depends on the data with no upper bound known (one read with
    ``.item()``): no plan could promise to fit a budget.  Capture tries again with such values
    breaking the graph, as plain ``torch.compile`` does, before raising it."""


class PlanMismatchError(CkptcError, ValueError):
    """A plan file does not belong to this model, these inputs or this torch version."""


class CorruptPlanError(CkptcError, ValueError):
    """A plan file cannot be read: truncated, not JSON, not a ckptc plan, or a
    field with a wrong type or value (the message names the field)."""


class PlanFileNotFoundError(CkptcError, FileNotFoundError):
    """No plan file at the path given (``load_plan``, ``plan=``)."""


class WrapOrderError(CkptcError, TypeError):
    """ckptc and a data-parallel wrapper were combined in an order ckptc does not support
    (the message names the supported one: ``DDP(ckptc.optimize(model))``, or ``fully_shard``
    on every block and the root before ``ckptc.optimize``)."""


class DistributedPlanMismatchError(CkptcError):
    """Ranks planned different checkpointing for the same step (their plans' digests differ)."""


class BudgetExceededError(CkptcError):
    """A measured training step used more memory than the budget, and replanning
    with the measured excess did not bring it under the budget.

    Attributes:
        measured_peak_bytes: the peak of the last measured step.
        budget_bytes: the budget.
        min_feasible_bytes: the smallest budget expected to work (the floor of
            the plan corrected by everything measured so far).
    """

    def __init__(
        self,
        measured_peak_bytes: int,
        budget_bytes: int,
        min_feasible_bytes: int,
        replans: int,
        what_to_do: str | None = None,
    ) -> None:
        self.measured_peak_bytes = measured_peak_bytes
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.replans = replans
        self.what_to_do = what_to_do
        if what_to_do is None:
            what_to_do = (
                f"after replanning {replans} time(s) with the measured excess counted. The smallest budget "
                f"expected to work is {min_feasible_bytes} bytes: pass budget_bytes=... at least that, or find "
                "what allocates outside the model's graphs (eager code between graph breaks, hooks) and move "
                "it out of the step."
            )
        super().__init__(
            f"the training step measured a peak of {measured_peak_bytes} bytes, above the budget of "
            f"{budget_bytes} bytes, {what_to_do}"
        )

    def __reduce__(self):
        return (
            type(self),
            (self.measured_peak_bytes, self.budget_bytes, self.min_feasible_bytes, self.replans, self.what_to_do),
        )


class CkptcWarning(RuntimeWarning):
    """What a user should act on although training goes on: the cause and what to do.

    Issued through :mod:`warnings`, once per cause and object; everything else ckptc has to
    say goes to ``logging.getLogger("ckptc")`` (``warnings.filterwarnings("ignore",
    category=ckptc.CkptcWarning)`` silences these)."""


_warned: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()
_log = logging.getLogger("ckptc")


def outside_stacklevel() -> int:
    """The ``stacklevel`` that points a :func:`warn_once` made by this function's caller at the innermost
    frame calling it from outside torch and ckptc (the model's code, or the training loop)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and not _outside_torch_and_ckptc(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(owner: Any, key: str, message: str, stacklevel: int = 2) -> None:
    """Warn ``message`` as a :class:`CkptcWarning` the first time ``key`` comes up for ``owner``
    (a model, a runtime); also logged at INFO on ``ckptc`` for log files."""
    keys = _warned.setdefault(owner, set())
    if key in keys:
        return
    keys.add(key)
    _log.info("%s", message)
    warnings.warn(message, CkptcWarning, stacklevel=stacklevel + 1)


_MODELS_OWN = "_ckptc_models_own"  # set on an error the model's own code raised, running as in eager PyTorch


def models_own(error: BaseException) -> BaseException:
    """Mark ``error`` as the model's own (its code raised it as eager PyTorch would, not ckptc's capture):
    every entry point raises it as it is.  Returns ``error``."""
    try:
        setattr(error, _MODELS_OWN, True)
    except AttributeError:  # an exception type without a __dict__: taken for a capture failure
        pass
    return error


def is_models_own(error: BaseException) -> bool:
    """Whether ``error`` was marked by :func:`models_own`."""
    return bool(getattr(error, _MODELS_OWN, False))


def release_frames(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback and its causes'.

    An exception caught to try again is part of reference cycles (a frame holds the exception that
    holds the frame), so the tensors a failed attempt made stay alive until the cyclic garbage
    collector runs: through the next attempt's step, where the budget counts them.
    """
    for cause in _chain(error):
        traceback.clear_frames(cause.__traceback__)
