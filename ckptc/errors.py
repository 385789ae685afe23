"""Errors raised by ckptc.  Each message says what went wrong and what to do next."""

from __future__ import annotations

import torch


class CkptcError(Exception):
    """Base class of ckptc's own errors."""


class UntraceableModelError(CkptcError):
    """The model's training step could not be captured as a graph."""

    @classmethod
    def from_exception(cls, model: torch.nn.Module, error: BaseException) -> "UntraceableModelError":
        reason = str(getattr(error, "inner_exception", None) or error).strip().splitlines()[0:3]
        return cls(
            f"ckptc could not capture the training step of {type(model).__name__}: "
            f"{' '.join(reason)}\n"
            "What to do: run the step once with torch.compile(model, backend='aot_eager') to see "
            "where capture fails (TORCH_LOGS=graph_breaks lists graph breaks); move the failing "
            "code out of forward or wrap it with torch.compiler.disable so it runs eagerly; "
            "or checkpoint manually with torch.utils.checkpoint."
        )


class PlanMismatchError(CkptcError):
    """A plan file does not belong to this model, these inputs or this torch version."""


class CorruptPlanError(CkptcError):
    """A plan file cannot be read: truncated, not JSON, or not a ckptc plan."""
