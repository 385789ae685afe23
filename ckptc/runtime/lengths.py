"""Variable input lengths: one plan per bucket of lengths, not one per length.

Capturing and planning a step takes seconds; a training loop over sequences of
varying length would pay that for every new length.  :class:`LengthBuckets`
watches the input shapes of one model's training calls.  Inputs of one
*family* (same structure, dtypes, devices, number of dimensions) that differ
only in some dimensions make those dimensions *varying*.  From then on a
varying size selects a bucket of sizes, ``(2**(k-1), 2**k]``, instead of
itself: the plan's key names the bucket, the dimension is marked dynamic for
Dynamo with the bucket as its range, and every symbolic size in the captured
graph is priced at the bucket's top (:func:`ckptc.pricing.costs.priced_size`), so the
plan fits the budget for every length in the bucket.  The first length of a
family is planned exactly (a model trained at one length never pays for a
bucket); a bucket whose top does not fit the budget falls back to exact
lengths (:meth:`LengthBuckets.refuse_bucket`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

import solvers
from ckptc import _torch_internals as internals

log = logging.getLogger("ckptc.runtime.lengths")

SMALLEST_BUCKETED = 3  # sizes 0, 1 and 2 stay exact (Dynamo specializes them anyway)


def bucket_of(size: int) -> tuple[int, int]:
    """The bucket ``(low, high)`` of sizes that share a plan: ``low <= size <= high``,
    ``high`` a power of two and ``low = high / 2 + 1``."""
    if size < SMALLEST_BUCKETED:
        return size, size
    high = 1 << (size - 1).bit_length()
    return high // 2 + 1, high


@dataclass
class _Family:
    shapes: list[tuple[int, ...] | None]
    varying: set[tuple[int, int]] = field(default_factory=set)  # (tensor leaf index, dimension)


class LengthBuckets:
    """Which input dimensions vary between training calls, and the bucket each call falls in."""

    def __init__(self) -> None:
        self.families: dict[tuple, _Family] = {}
        self.buckets_planned: set[tuple] = set()
        self.refused: set[tuple] = set()
        self.last_bucket: tuple | None = None  # the bucketed key of the latest call, None if exact
        self.exact: set[tuple] = set()  # signatures planned for their exact sizes

    def key(self, args: tuple, kwargs: dict, signature: tuple) -> tuple:
        """The plan key of a call: ``signature`` (one described leaf per entry after the first,
        as :func:`ckptc.runtime.step._signature` builds it) with varying sizes replaced by their bucket.

        Marks the varying dimensions of this call's tensors dynamic, ranging over their
        bucket, so the plan's graphs run for every size in it without capturing again.
        """
        leaves = internals.tree_leaves((args, kwargs))
        for leaf in leaves:  # marks stay on tensor objects: a tensor passed again starts unmarked
            if isinstance(leaf, torch.Tensor):
                internals.unmark_dynamic(leaf)
        shapes = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        family_key = (
            len(signature),
            tuple(
                (entry[1:], len(entry[0])) if isinstance(leaf, torch.Tensor) else entry
                for leaf, entry in zip(leaves, signature[1:], strict=False)
            ),
            signature[0],
            signature[len(leaves) + 1 :],
        )
        self.last_bucket = None
        family = self.families.get(family_key)
        if family is None:
            self.families[family_key] = _Family(shapes)
            self.exact.add(signature)
            return signature
        for i, (old, new) in enumerate(zip(family.shapes, shapes, strict=True)):
            if old is not None and new is not None:
                family.varying.update((i, d) for d, (a, b) in enumerate(zip(old, new, strict=True)) if a != b)
        family.shapes = shapes
        if not family.varying or signature in self.exact:  # a size planned exactly keeps its plan
            return signature
        buckets = {(i, d): bucket_of(shapes[i][d]) for i, d in sorted(family.varying)}  # type: ignore[index]
        described = list(signature)
        for (i, d), bucket in buckets.items():
            entry = described[i + 1]
            shape = list(entry[0])
            # A size that is its own bucket stays a size: the key of a shape planned before another
            # dimension began to vary (a bucket of lengths at batch 2, before a batch of 3) is unchanged.
            shape[d] = bucket if bucket[0] < bucket[1] else bucket[0]
            described[i + 1] = (tuple(shape), *entry[1:])
        bucketed = tuple(described)
        if bucketed in self.refused:
            self.exact.add(signature)
            return signature
        for (i, d), (low, high) in buckets.items():
            if low < high:
                internals.mark_dynamic(leaves[i], d, low, high)
        self.last_bucket = bucketed
        if bucketed not in self.buckets_planned:
            self.buckets_planned.add(bucketed)
            names = _leaf_names(args, kwargs, len(leaves))
            log.info(
                "new length bucket: planning once for %s",
                ", ".join(f"{names[i]} dim {d} in [{lo}, {hi}]" for (i, d), (lo, hi) in buckets.items()),
            )
        return bucketed

    def fall_back(self, error: BaseException) -> bool:
        """Whether a call that failed with ``error`` should run again planned for its exact sizes.

        True when the call's sizes were bucketed and the bucket cannot be planned: its top does not
        fit the budget (the call's own sizes may), or the model's code needs the exact size of a
        varying dimension (capture conflicts with marking it dynamic).  The bucket's sizes are
        planned one by one from then on.
        """
        bucket, self.last_bucket = self.last_bucket, None
        if bucket is None or bucket in self.refused:
            return False
        if not isinstance(error, solvers.InfeasibleBudgetError) and not internals.is_dynamic_shape_conflict(error):
            return False
        self.refused.add(bucket)
        log.info("length bucket planned one length at a time from now on: %s", error)
        return True


def _leaf_names(args: tuple, kwargs: dict, count: int) -> list[str]:
    """A name for each of the call's ``count`` leaves, for messages: its argument (``argument 0``, a keyword),
    with the leaf's position inside it where the argument holds several."""
    names: list[str] = []
    for label, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        inner = len(internals.tree_leaves(value))
        names += [label] if inner == 1 else [f"{label}[{j}]" for j in range(inner)]
    return names if len(names) == count else [f"input {i}" for i in range(count)]
