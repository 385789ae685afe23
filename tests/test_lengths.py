"""Variable sequence lengths: one plan per bucket of lengths, and the budget holds at every length.

The first length is planned exactly; once a dimension varies, its sizes fall in
power-of-two buckets ``(2**(k-1), 2**k]``, each planned once with the dimension
dynamic and every size priced at the bucket's top.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

import ckptc
from ckptc.meter import measure_peak, resident_bytes
from ckptc.runtime.lengths import bucket_of
from tests.zoo import get_case


def test_buckets_are_powers_of_two() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17, 32, 33)] == [
        (1, 1),
        (2, 2),
        (3, 4),
        (3, 4),
        (5, 8),
        (9, 16),
        (17, 32),
        (17, 32),
        (33, 64),
    ]


def test_lengths_in_one_bucket_share_a_plan_within_the_budget_and_train_like_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    case = get_case("gpt2", seq_len=32)
    model = case.model
    reference = copy.deepcopy(model)

    def run(net: torch.nn.Module, length: int) -> torch.Tensor:
        ids = case.example_inputs[0][:, :length].contiguous()
        for p in net.parameters():
            p.grad = None
        torch.manual_seed(length)  # dropout
        loss = net(ids, labels=ids.clone()).loss
        loss.backward()
        return loss.detach()

    for p in reference.parameters():
        p.grad = None
    eager_peak = measure_peak(lambda: run(reference, 32), baseline_bytes=resident_bytes(reference))[1].peak_bytes
    budget = int(0.8 * eager_peak)  # below keeping everything at the bucket's top: something is recomputed
    # hold_outputs=False: ``run`` keeps only the loss, as the plans are told upfront; left to watch (None),
    # the first step of each plan counts the logits held and the bucket is compiled and planned once more.
    fast = ckptc.optimize(model, budget_bytes=budget, verify=False, hold_outputs=False)
    lengths = (24, 20, 32, 17, 28, 31, 18, 25)
    with caplog.at_level(logging.INFO, logger="ckptc.runtime.lengths"):
        for length in lengths:
            run(fast, length)  # planning allocates too (it profiles ops): measure a step that does not plan
            ids = case.example_inputs[0][:, :length]
            for p in model.parameters():
                p.grad = None  # before the baseline is taken: the budget counts a step from None gradients
            _, measured = measure_peak(
                lambda length=length: run(fast, length), baseline_bytes=resident_bytes(model, ids, ids)
            )
            assert measured.peak_bytes <= budget, (length, measured.peak_bytes, budget)
            if length in (20, 31):
                loss = run(fast, length)
                ours = [p.grad.clone() for p in model.parameters()]
                assert torch.allclose(loss, run(reference, length), rtol=1e-4, atol=1e-5)
                for mine, ref in zip(ours, (p.grad for p in reference.parameters()), strict=True):
                    assert torch.allclose(mine, ref, rtol=1e-4, atol=1e-5)
    runtime = fast._ckptc_runtime
    assert len(runtime.plans) == 2  # length 24 exactly, then the bucket [17, 32] once
    assert [r.getMessage() for r in caplog.records if "new length bucket" in r.getMessage()] == [
        "new length bucket: planning once for input_ids dim 1 in [17, 32], labels dim 1 in [17, 32]"
    ]


def test_a_bucket_that_cannot_be_planned_falls_back_to_exact_lengths() -> None:
    """Its top over the budget (or the model pinning the size): that bucket's lengths are planned one by one."""
    import solvers
    from ckptc.runtime.lengths import LengthBuckets
    from ckptc.runtime.step import _signature

    buckets = LengthBuckets()

    def key(length: int) -> tuple:
        x = torch.zeros(2, length)
        return buckets.key((x,), {}, _signature((x,), {}))

    assert key(20) == _signature((torch.zeros(2, 20),), {})  # the first length: exact
    bucketed = key(24)
    assert bucketed[1][0] == (2, (17, 32))
    assert key(30) == bucketed  # same bucket, same plan
    assert not buckets.fall_back(ValueError("not a planning failure"))
    key(30)
    assert buckets.fall_back(solvers.InfeasibleBudgetError(100, 200))
    assert key(30) == _signature((torch.zeros(2, 30),), {})  # exact from now on
    assert not buckets.fall_back(solvers.InfeasibleBudgetError(100, 200))  # an exact length: the error stands
    assert key(40)[1][0] == (2, (33, 64))  # other buckets are unaffected


def test_a_shape_keeps_its_bucket_when_another_dimension_begins_to_vary() -> None:
    """Lengths vary first (batch 2), then the batch does (a last smaller or larger batch): the shapes at batch 2
    keep the key, and so the plan, of their length bucket (before: the batch's exact size entered the key as a
    bucket of one, and every shape planned before was planned again, 5-9 s each on a genomic model)."""
    from ckptc.runtime.lengths import LengthBuckets
    from ckptc.runtime.step import _signature

    buckets = LengthBuckets()

    def key(batch: int, length: int) -> tuple:
        x = torch.zeros(batch, length)
        return buckets.key((x,), {}, _signature((x,), {}))

    key(2, 20)
    planned = key(2, 24)
    assert key(3, 20) != planned  # a new batch size: a bucket of its own
    assert key(2, 24) == planned
    assert key(2, 30) == planned


def test_a_model_that_needs_the_exact_length_is_planned_per_length(caplog: pytest.LogCaptureFixture) -> None:
    """Capture pins a dimension marked dynamic (the code branches on its exact value): ckptc plans that
    bucket's lengths one by one instead of failing, and says so in its own log, not with Dynamo's error
    traceback ("Error while creating guard", which it caught)."""

    class PinsTheLength(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.proj(x))
            if x.shape[1] == 24:
                h = h * 2
            return h.square().sum()

    torch.manual_seed(0)
    fast = _trained_like_eager_at(PinsTheLength(), lambda length: torch.randn(2, length, 8), (20, 24, 28, 24))
    assert fast._ckptc_runtime.lengths.refused  # the bucket (16, 32] fell back to exact lengths
    assert not [r for r in caplog.records if r.name == "torch._guards" and r.levelno >= logging.ERROR]


def test_a_model_that_pins_the_length_and_updates_buffers_is_planned_per_length() -> None:
    """As above, the size pinned by a view over pairs of positions (``L // 2``, an Enformer-style
    pooling) in a model whose BatchNorm updates its running statistics: the failed capture of the
    bucket ran the forward (and, to tell the model's error from the capture's, once eagerly), and
    put the statistics back, so the call runs again for its exact length (before: refused with
    ``UntraceableModelError`` saying eager raises the error too, which it does not)."""

    class PairPooling(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 8, 3, padding=1)
            self.norm = torch.nn.BatchNorm1d(8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.gelu(self.norm(self.conv(x)))
            batch, channels, length = h.shape
            h = h.view(batch, channels, length // 2, 2).softmax(-1).sum(-1)
            return self.head(h.transpose(1, 2)).square().mean()

    torch.manual_seed(0)
    fast = _trained_like_eager_at(PairPooling(), lambda length: torch.randn(2, 4, length), (20, 24, 24, 28))
    assert fast._ckptc_runtime.lengths.refused  # the bucket (16, 32] fell back to exact lengths


def _trained_like_eager_at(model: torch.nn.Module, batch: Any, lengths: tuple[int, ...]) -> Any:
    """``ckptc.optimize(model)`` trained on ``batch(length)`` for each of ``lengths`` beside an eager copy,
    asserting the loss, every gradient and every buffer equal eager's at each; returns the optimized model."""
    reference = copy.deepcopy(model)
    fast = ckptc.optimize(model, budget_bytes=10**8)
    for length in lengths:
        x = batch(length)
        for net in (model, reference):
            net.zero_grad(set_to_none=True)
        loss, ref_loss = fast(x), reference(x)
        loss.backward()
        ref_loss.backward()
        assert torch.allclose(loss, ref_loss)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad)
        for b, c in zip(model.buffers(), reference.buffers(), strict=True):
            assert torch.equal(b, c)
    return fast


def test_a_bucket_planned_again_under_accumulation_runs_every_length_of_it() -> None:
    """Gradient accumulation over micro-batches of varying lengths: a bucket's plan (symbolic sizes) made
    from None gradients is made again when a micro-batch starts with gradients resident.  Planned again in
    place, AOTAutograd traced outside Dynamo's compile specialized the graph to one length, and the next
    length of the bucket failed (``shape '[320, 32]' is invalid for input of size 8448``); a bucket is
    therefore planned again through a new ``torch.compile``."""
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True) for _ in range(2)]
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), *layers, torch.nn.Linear(64, 1))
    reference = copy.deepcopy(model)
    fast = ckptc.optimize(model, budget_bytes=5_000_000)
    for step, lengths in enumerate([(64, 64), (40, 64), (33, 40), (40, 33)]):
        batches = [torch.randn(8, n, 32, generator=torch.Generator().manual_seed(10 * step + n)) for n in lengths]
        for trained, net in ((fast, model), (reference, reference)):
            for p in net.parameters():
                p.grad = None
            torch.manual_seed(step)
            for x in batches:
                trained(x).mean().backward()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5), step
