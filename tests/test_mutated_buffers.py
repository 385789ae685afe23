"""Buffers read through views and updated later in the same forward (running
normalisers, EMA statistics): a recomputed reader would see the updated values
and give gradients off by several percent.  Every reader is saved instead."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckptc
from tests.helpers import assert_trains_like_eager_within

# How the forward reads the buffer before updating it.
READS = {
    "direct": lambda h, mean: h - mean,
    "index": lambda h, mean: h - mean[None, :],
    "view": lambda h, mean: h - mean.view(1, -1),
    "view_chain": lambda h, mean: h - mean.view(1, -1).expand(h.shape[0], -1),
}


class _RunningNorm(nn.Module):
    """Centres by a running mean that it updates after reading it (EMA statistics)."""

    def __init__(self, read: str, width: int = 16) -> None:
        super().__init__()
        self.read = READS[read]
        self.register_buffer("mean", torch.full((width,), 0.5))
        self.inp = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        centred = self.read(h, self.mean)
        self.mean.mul_(0.9).add_(0.1 * h.mean(0).detach())
        return self.out(torch.tanh(centred) * 2).square().mean()


def _assert_trains_like_eager(model: nn.Module, optimized: nn.Module, reference: nn.Module, steps: int = 2) -> None:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    for _ in range(steps):  # the buffer changes every step
        losses = []
        for m, params in ((optimized, model.parameters()), (reference, reference.parameters())):
            for p in params:
                p.grad = None
            loss = m(x)
            loss.backward()
            losses.append(loss.detach())
        assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-7)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), (
                f"{name}: relative error {((p.grad - q.grad).abs().max() / q.grad.abs().max()).item():.3g}"
            )
        assert torch.equal(model.mean, reference.mean)


@pytest.mark.parametrize("read", ["index", "view", "view_chain"])
def test_buffer_read_through_views_then_updated_gives_eager_gradients(read: str) -> None:
    torch.manual_seed(0)
    model = _RunningNorm(read)
    reference = copy.deepcopy(model)
    # tanh recomputed in backward needs its input, which reads the buffer through a view
    optimized = ckptc.optimize(model, strategy="none", must_recompute=["*tanh*"])
    _assert_trains_like_eager(model, optimized, reference)
    assert any(v.op == "tanh" for v in optimized.plan.values("recomputed"))
    assert any(v.op == "sub" for v in optimized.plan.values("kept"))


def test_must_recompute_does_not_override_saving_a_reader_of_an_updated_buffer(caplog) -> None:
    torch.manual_seed(0)
    model = _RunningNorm("direct")
    reference = copy.deepcopy(model)
    optimized = ckptc.optimize(model, strategy="none", must_recompute=["*sub*", "*tanh*"])
    with caplog.at_level("WARNING", logger="ckptc"):
        _assert_trains_like_eager(model, optimized, reference)
    assert "updates in place" in caplog.text


class _RenormedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up in place, in forward: AOTAutograd
    writes the new weight back after the forward graph has run."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32, max_norm=1.0)
        self.l1, self.l2, self.l3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.l1(self.emb(ids)))
        return self.l3(nn.functional.gelu(self.l2(h)) + h)


def test_an_input_written_back_after_the_forward_is_never_recomputed_from() -> None:
    """At the floor, with the loss outside the model, the step is planned again; the plan that recomputed
    the renormalized weight from the weight saved the weight itself, which AOTAutograd's write-back then
    changed: the next backward raised "modified by an inplace operation".  What reads such an input is saved
    (``ckptc._torch_internals.inputs_written_back``); gradients equal eager's and the step fits its budget."""
    torch.manual_seed(0)
    reference = _RenormedEmbedding()
    ids = torch.randint(0, 100, (8, 64), generator=torch.Generator().manual_seed(1))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten())

    floor = ckptc.capture(copy.deepcopy(reference), (ids,), loss_fn=loss).floor_bytes
    assert_trains_like_eager_within(reference, floor, (ids,), loss=loss, steps=3)


class _MemoryBank(nn.Module):
    """Scores against a snapshot of a bank of keys (``bank.clone()``, as MoCo reads its queue); with
    ``enqueue_inside``, the forward then writes new keys into the bank after a graph break (MoCo's enqueue
    reads its pointer with ``int()``)."""

    def __init__(self, enqueue_inside: bool) -> None:
        super().__init__()
        self.encode, self.head = nn.Linear(32, 16), nn.Linear(64, 8)
        self.register_buffer("bank", torch.randn(64, 16))
        self.enqueue_inside = enqueue_inside

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keys = torch.tanh(self.encode(x))
        loss = nn.functional.mse_loss(self.head(keys @ self.bank.clone().T), y)
        if self.enqueue_inside:
            torch._dynamo.graph_break()
            self.bank[:8] = keys[:8].detach()
        return loss


@pytest.mark.parametrize("entry", ["optimize", "backend"])
@pytest.mark.parametrize("update", ["inside after a graph break", "caller in place", "caller through .data"])
def test_a_snapshot_of_a_buffer_updated_before_backward_is_kept_not_recomputed(update: str, entry: str) -> None:
    """A copy of a buffer (or of any input that receives no gradient) is the value as it was: a later graph,
    or the caller between forward and backward, may change the buffer.  It was recomputed from the buffer
    in backward at every budget (a copy of a resident storage looked free to recompute): a raw autograd
    error ("modified by an inplace operation"), or through ``.data`` silently wrong gradients.  Now such a
    copy is saved, as eager autograd saves it, and training equals eager's."""
    torch.manual_seed(0)
    reference = _MemoryBank(enqueue_inside=update.startswith("inside"))
    x, y = torch.randn(256, 32), torch.randn(256, 8)
    model = copy.deepcopy(reference)
    fast = (
        ckptc.optimize(model, budget_gb=1)
        if entry == "optimize"
        else torch.compile(model, backend=ckptc.backend(budget_gb=1, model=model))
    )
    for step in range(3):
        for net, call in ((reference, reference), (model, fast)):
            net.zero_grad(set_to_none=True)
            loss = call(x + step, y)
            if update == "caller in place":
                net.bank.mul_(0.5)
            elif update == "caller through .data":
                net.bank.data.mul_(0.5)
            loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
        torch.testing.assert_close(model.bank, reference.bank)


class _QuantizationAware(nn.Module):
    """A net prepared for quantization-aware training: its per-channel observers' ``min_val``/``max_val``
    buffers are empty until the first forward resizes them in place."""

    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.dequant(self.body(self.quant(x))), y)


def _quantization_aware() -> nn.Module:
    torch.manual_seed(0)
    model = _QuantizationAware().train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    return torch.ao.quantization.prepare_qat(model)


def test_a_buffer_the_first_forward_resizes_is_put_back_and_trains_like_eager() -> None:
    """``ckptc.capture`` and the call that plans run the forward and put back what it changed; a buffer it
    resized could not be copied back (a raw ``RuntimeError: The size of tensor a (64) must match the size
    of tensor b (0)`` on a fresh quantization-aware model).  Now its shape comes back with its value: the
    capture works, and training from the first step equals eager's, buffers included."""
    x, y = torch.randn(512, 32), torch.randn(512, 8)
    model = _quantization_aware()
    assert any(b.numel() == 0 for b in model.buffers())  # observers not yet sized
    assert ckptc.capture(copy.deepcopy(model), (x, y)).floor_bytes > 0
    reference = copy.deepcopy(model)
    fast = ckptc.optimize(model, budget_gb=1)
    for step in range(3):
        for net, call in ((reference, reference), (model, fast)):
            net.zero_grad(set_to_none=True)
            call(x + step, y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"step {step}: {name}")
        for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(b, c, msg=f"step {step}: {name}")


@pytest.mark.parametrize("entry", ["optimize", "backend"])
def test_batch_norm_called_twice_before_one_backward_is_recomputed_without_its_statistics(entry: str) -> None:
    """A discriminator's loop: BatchNorm in training mode called on two batches, then one backward.  The
    second call updates the running statistics in place before the first call's backward; a recomputation of
    the first call's BatchNorm that read them had them saved for backward, and autograd refused that backward
    ("modified by an inplace operation", a raw ``RuntimeError``) at budgets that recompute it.  Its
    recomputation reads the batch alone (:func:`ckptc.rewrite.rewriter._batch_norm_without_statistics`)."""

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.norm = nn.Linear(32, 64), nn.BatchNorm1d(64)
            self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(torch.relu(self.norm(self.inp(x))))

    class Twice(nn.Module):  # the step, for its budget range
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (self.inner(a) - self.inner(b)).square().mean()

    torch.manual_seed(0)
    model = Normed()
    real, fake = torch.randn(128, 32), torch.randn(128, 32) + 0.3
    step = ckptc.capture(Twice(copy.deepcopy(model)), (real, fake))
    budget = step.floor_bytes + 3 * (step.unoptimized_peak_bytes - step.floor_bytes) // 10
    eager = copy.deepcopy(model)
    fast = (
        ckptc.optimize(model, budget_bytes=budget)
        if entry == "optimize"
        else torch.compile(model, backend=ckptc.backend(budget_bytes=budget, model=model))
    )
    for _ in range(3):
        for net, owner in ((fast, model), (eager, eager)):
            owner.zero_grad(set_to_none=True)
            (net(real) - net(fake)).square().mean().backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        for b, c in zip(model.buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(b, c)
