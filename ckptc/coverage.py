"""What of the model's training step ckptc's graphs cover, and what they cannot.

Two concerns, one home:

* **Refusals.**  Code that Dynamo does not capture runs eagerly between the
  graphs ckptc plans: its activations are neither counted nor checkpointed,
  so the budget would silently not hold.  Recurrent modules (``nn.LSTM``,
  ``nn.GRU``, ``nn.RNN``) are the common case.  ckptc captures them (Dynamo's
  ``allow_rnn``, enabled around ckptc's compiles, unrolls them into the graph),
  but that trace drops the dropout between stacked layers, and packed
  sequences are still skipped.  :func:`refuse_before_capture` refuses a
  training call whose RNNs would train with wrong gradients;
  :func:`refuse_uncaptured` refuses a call after which an RNN's parameters
  were in no planned graph (it ran eagerly, unplanned).  Both raise
  :class:`~ckptc.errors.UntraceableModelError` naming the module.
* **The coverage report** (:class:`Coverage`): per captured graph, its share of
  the step's FLOPs and memory and the reason for the graph break that ended it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

import torch

from ckptc.errors import UntraceableModelError

if TYPE_CHECKING:
    from ckptc.compiler import GraphRecord

log = logging.getLogger("ckptc.coverage")

_WHAT_TO_DO = (
    "What to do: optimize only the submodules that do not contain '{name}' (each with ckptc.optimize and a "
    "share of the budget) and run '{name}' as it is, or checkpoint the model yourself with "
    "torch.utils.checkpoint."
)


def recurrent_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.RNNBase]]:
    """Every ``nn.LSTM``/``nn.GRU``/``nn.RNN`` in ``model`` with its qualified name (``encoder.rnn``)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.RNNBase)]


def _drops_dropout(rnn: torch.nn.RNNBase) -> bool:
    """Whether the captured (unrolled) RNN would differ from eager: dropout between stacked layers."""
    return rnn.training and rnn.dropout > 0 and rnn.num_layers > 1


def refuse_before_capture(model: torch.nn.Module) -> None:
    """Refuse a training call of ``model`` whose capture would train differently from eager.

    Raises:
        UntraceableModelError: an RNN applies dropout between its layers; the
            captured graph would silently leave it out (gradients differ).
    """
    for name, rnn in recurrent_modules(model):
        if _drops_dropout(rnn):
            raise UntraceableModelError(
                f"ckptc cannot train {type(model).__name__} within a budget: its {type(rnn).__name__} "
                f"'{name}' applies dropout={rnn.dropout} between its {rnn.num_layers} layers, and "
                "torch.compile's trace of recurrent modules leaves that dropout out (gradients would differ "
                "from eager PyTorch), while running it eagerly would leave its activations unplanned.\n"
                + _WHAT_TO_DO.format(name=name)
                + f" Or set dropout=0 on '{name}' (captured exactly, unrolled over time steps)."
            )


def refuse_uncaptured(model: torch.nn.Module, ran: Iterable[GraphRecord]) -> None:
    """Refuse a training call in which an RNN ran outside every planned graph.

    ``ran`` are the graphs the call ran; each records the ids of its inputs
    (parameters included).  An RNN with trainable parameters that no graph
    took ran eagerly: its activations were not counted.

    Raises:
        UntraceableModelError: naming the first such module.
    """
    rnns = recurrent_modules(model)
    if not rnns:
        return
    seen: set[int] = set().union(*(r.input_ids for r in ran))
    for name, rnn in rnns:
        trainable = [p for p in rnn.parameters() if p.requires_grad]
        if trainable and not any(id(p) in seen for p in trainable):
            raise UntraceableModelError(
                f"ckptc cannot train {type(model).__name__} within a budget: its {type(rnn).__name__} "
                f"'{name}' ran outside the captured graphs (torch.compile does not capture recurrent "
                "modules called with packed sequences or in code it skips), so its activations would be "
                "neither counted nor checkpointed and the budget would not hold.\n"
                + _WHAT_TO_DO.format(name=name)
                + " Padded (not packed) inputs are captured."
            )

