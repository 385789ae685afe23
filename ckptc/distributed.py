"""Per-rank budgets under DDP and FSDP2.

Supported forms (any other order raises :class:`WrapOrderError` naming the one to use):

* ``DDP(ckptc.optimize(model, budget_bytes=B))``;
* FSDP2: ``fully_shard`` on every block and on the root, then
  ``ckptc.optimize(model, budget_bytes=B)`` (or ``torch.compile(model, backend="ckptc")``).

The budget is per rank: it bounds what *this* rank holds during one step.  What
ckptc's graphs see of that is the rank's local parameter shards (a ``DTensor``
counts its local shard), the unsharded parameters of the block a graph computes
(its inputs) and the gradients and activations the graph makes.  What they do
not see, and this module adds to every graph's baseline (:class:`RankContext`):

* DDP: the gradient buckets (one flat copy of the trainable parameters, made
  when ``DDP(...)`` is built and alive from then on), and one more copy of the
  largest bucket for its all-reduce (gloo's work holds one while it runs);
* FSDP2: the root's parameters, which stay unsharded from forward to the end of
  backward; the next block FSDP2 prefetches (its unsharded parameters), the
  reduce-scatter input of the block before (its unsharded gradients), an
  all-gather output beside its copy-out, and an all-gather input (a shard):
  three of the largest block's unsharded bytes and one shard.  Collective
  buffers are freed when their asynchronous work is, so whether two of them
  overlap changes from step to step: ckptc counts the overlap.

Everything else (collective scratch, eager code between graphs, a block graph
that Dynamo compiles once and runs for every layer) is left to the closed loop
of :mod:`ckptc.runtime.step`: the first step of every plan is measured on every rank,
the ranks agree on the largest peak (an all-reduce of the maximum), and if it
exceeds the budget every rank plans again with the same correction.

Same plan on every rank: planning is deterministic (same graph, shapes and
budget give the same plan, as plan files are byte-identical across
processes), and each step ends with an all-reduce of a digest of the step's
plans; ranks that disagree raise :class:`DistributedPlanMismatchError` on their
next call (planning with ``measure_time=True`` measures seconds per rank and
can disagree: make a plan file on one rank and give it to all).

Recomputation adds no communication: a block's backward graph recomputes from
the parameters FSDP2 gathers for that block's backward (the graph's saved
parameter inputs share their storage with FSDP2's unsharded parameters, which
it refills before the block's backward runs), never from a new all-gather.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from ckptc import _torch_internals as internals
from ckptc.errors import DistributedPlanMismatchError, WrapOrderError

if TYPE_CHECKING:
    from ckptc.records import GraphRecord

__all__ = [
    "DistributedPlanMismatchError",
    "WrapOrderError",
    "RankContext",
    "rank_context",
    "plan_digest",
    "check_wrap_order",
    "check_call_order",
    "check_backend_context",
    "local_tensor",
    "local_nbytes",
]

log = logging.getLogger("ckptc.distributed")

SUPPORTED_FORMS = (
    "DDP(ckptc.optimize(model, budget_bytes=B)), or FSDP2 with fully_shard(block) for every block, then "
    "fully_shard(model), then ckptc.optimize(model, budget_bytes=B) (or torch.compile(model, backend='ckptc'))"
)


@dataclass(frozen=True)
class RankContext:
    """What one rank holds that ckptc's graphs do not see.

    Attributes:
        kind: ``"ddp"`` or ``"fsdp2"``.
        rank / world_size: of the default process group.
        resident_bytes: memory that exists before the step begins and that the
            model's tensors do not show (DDP's gradient buckets).
        step_bytes: memory allocated during the step outside the graphs' view
            (FSDP2's unsharded root, prefetched block and reduce-scatter buffer).
    """

    kind: str
    rank: int
    world_size: int
    resident_bytes: int
    step_bytes: int

    @property
    def baseline_bytes(self) -> int:
        """Added to every graph's baseline when planning."""
        return self.resident_bytes + self.step_bytes

    def agree(self, records: Sequence["GraphRecord"], peak_bytes: int | None) -> int | None:
        """End of a step on every rank: check that all ranks ran the same plans and
        return the largest measured peak of any rank (None if no rank measured).

        Raises:
            DistributedPlanMismatchError: the ranks' plans differ.
        """
        digest = plan_digest(records)
        values = torch.tensor([-1 if peak_bytes is None else peak_bytes, digest, -digest], dtype=torch.int64)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        peak, highest, lowest = int(values[0]), int(values[1]), -int(values[2])
        if highest != lowest:
            raise DistributedPlanMismatchError(
                f"rank {self.rank} of {self.world_size} ran a different checkpointing plan than another rank "
                f"for the same step (plan digests {lowest} and {highest}). Every rank must see the same model, "
                "input shapes and ckptc options (budget included); measure_time=True plans by seconds measured "
                "on each rank and can disagree. What to do: make a plan file on one rank "
                "(fast.plan.save(path)) and pass it to every rank as ckptc.optimize(model, plan=path)."
            )
        return None if peak < 0 else peak


def plan_digest(records: Iterable["GraphRecord"]) -> int:
    """A 62-bit digest of the plans of a step's graphs, in the order they ran."""
    h = hashlib.sha256()
    for record in records:
        h.update(f"{record.index}:{len(record.problem)}:{','.join(sorted(record.plan.kept))};".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def check_wrap_order(model: torch.nn.Module) -> None:
    """Raise :class:`WrapOrderError` when ``ckptc.optimize(model)`` gets a model wrapped in the wrong order."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise WrapOrderError(
            "ckptc.optimize got a DistributedDataParallel module; wrap in the other order: "
            "DDP(ckptc.optimize(model, budget_bytes=B)). Supported forms: " + SUPPORTED_FORMS
        )
    if any(isinstance(m, FSDP1) for m in model.modules()):
        raise WrapOrderError(
            "ckptc supports FSDP2 (torch.distributed.fsdp.fully_shard), not FullyShardedDataParallel (FSDP1). "
            "Supported forms: " + SUPPORTED_FORMS
        )
    sharded = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded and not isinstance(model, FSDPModule):
        raise WrapOrderError(
            f"{type(model).__name__} has fully_shard applied to {sharded[0]!r} but not to the model itself; "
            "call fully_shard on every block and then on the root before ckptc.optimize. Supported forms: "
            + SUPPORTED_FORMS
        )


def check_call_order(optimized: torch.nn.Module) -> None:
    """At a training call of ``ckptc.optimize``'s module: refuse ``fully_shard(ckptc.optimize(model))``."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    if isinstance(optimized, FSDPModule):
        raise WrapOrderError(
            "fully_shard was applied to the module ckptc.optimize returned; shard first, then optimize: "
            "fully_shard(block) for every block, fully_shard(model), then ckptc.optimize(model, ...). "
            "Supported forms: " + SUPPORTED_FORMS
        )


def check_backend_context() -> None:
    """For ``torch.compile(..., backend="ckptc")``: refuse ``torch.compile(DDP(model))``.

    Dynamo would split the model at DDP's bucket boundaries and ckptc would plan
    without DDP's buckets; ``DDP(ckptc.optimize(model))`` counts them.
    """
    if is_distributed() and internals.active_ddp_module() is not None:
        raise WrapOrderError(
            "torch.compile(DDP(model), backend='ckptc') is not supported: use "
            "DDP(ckptc.optimize(model, budget_bytes=B)), which counts DDP's gradient buckets in the budget. "
            "Supported forms: " + SUPPORTED_FORMS
        )


def rank_context(model: torch.nn.Module) -> RankContext | None:
    """The accounting of this rank, found from inside a training call of ``model``
    (under DDP its forward is running), or None when not training data-parallel."""
    if not is_distributed():
        return None
    from torch.distributed.fsdp import FSDPModule

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ddp = internals.active_ddp_module()
    if ddp is not None:
        trainable = _dense_bytes(p for p in ddp.module.parameters() if p.requires_grad)
        # With gradient_as_bucket_view the buckets are the gradients, which the graphs count.
        buckets = 0 if getattr(ddp, "gradient_as_bucket_view", False) else trainable
        # The all-reduce of the largest bucket may hold a copy of it (gloo on CPU does, for as
        # long as its worker thread keeps the work alive).
        all_reduce = min(trainable, int(getattr(ddp, "bucket_bytes_cap", trainable)))
        context = RankContext("ddp", rank, world, resident_bytes=buckets, step_bytes=all_reduce)
    elif isinstance(model, FSDPModule):
        blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        root_params = _managed_parameters(model)
        root_unsharded = _dense_bytes(root_params) - sum(local_nbytes(p) for p in root_params)
        largest = max(blocks, key=lambda b: _dense_bytes(_managed_parameters(b)), default=None)
        unsharded = 0 if largest is None else _dense_bytes(_managed_parameters(largest))
        shard = 0 if largest is None else sum(local_nbytes(p) for p in _managed_parameters(largest))
        # Beside the block a graph computes (its inputs): the next block prefetched, the previous
        # block's reduce-scatter input, an all-gather output beside its copy-out, and the
        # all-gather input; the collectives' buffers live until their (asynchronous) work is freed.
        context = RankContext("fsdp2", rank, world, resident_bytes=0, step_bytes=root_unsharded + 3 * unsharded + shard)
    else:
        return None
    log.info(
        "rank %d/%d under %s: %d resident bytes and %d step bytes outside ckptc's graphs",
        rank,
        world,
        context.kind,
        context.resident_bytes,
        context.step_bytes,
    )
    return context


def _managed_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters ``module``'s own ``fully_shard`` manages: not those of nested FSDP2 modules."""
    from torch.distributed.fsdp import FSDPModule

    nested = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    inner = {id(p) for m in nested for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]


def _dense_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the full (unsharded) tensors, each distinct parameter once (tied weights)."""
    seen: dict[int, int] = {}
    for p in params:
        seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (a sharded parameter's gradient is sharded too)."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local shard, any other tensor itself."""
    return internals.local_shard(tensor)
