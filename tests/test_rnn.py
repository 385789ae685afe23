"""Recurrent modules: captured exactly, or refused with the module's name; never trained unplanned.

Dynamo skips ``nn.LSTM``/``GRU``/``RNN`` unless ``allow_rnn`` is set (ckptc sets
it around its compiles); the unrolled trace leaves out the dropout between
stacked layers, and packed sequences still run eagerly.  ckptc captures the
exact case (no inter-layer dropout, padded inputs) and refuses the others.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ckptc
from ckptc.errors import UntraceableModelError


class Tagger(nn.Module):
    """A sequence tagger: embedding, a recurrent encoder (``encoder.rnn``), a linear head."""

    def __init__(self, cell: type[nn.RNNBase], dropout: float, packed: bool = False, raw_input: bool = False) -> None:
        super().__init__()
        # raw_input: the model's input goes straight into the RNN (it needs no gradient).
        self.embed = nn.Identity() if raw_input else nn.Linear(8, 16)
        self.encoder = nn.Module()
        self.encoder.rnn = cell(8 if raw_input else 16, 16, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(16, 3)
        self.packed = packed

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.packed:
            h = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        h, _ = self.encoder.rnn(h)
        if self.packed:
            h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True)
        return self.head(torch.tanh(h)).square().mean()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # Three time steps: the captured RNN is unrolled, so capture time grows with the length.
    return torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 2])


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_rnn_with_dropout_between_layers_is_refused_naming_the_module(cell: type[nn.RNNBase]) -> None:
    torch.manual_seed(0)
    model = Tagger(cell, dropout=0.3)
    before = copy.deepcopy(model.state_dict())
    x, lengths = _inputs()
    fast = ckptc.optimize(model, budget_bytes=10**4)  # refused before the budget matters
    with pytest.raises(UntraceableModelError, match=r"'encoder\.rnn'.*dropout=0\.3") as raised:
        fast(x, lengths)
    assert "torch.utils.checkpoint" in str(raised.value) and cell.__name__ in str(raised.value)
    with pytest.raises(UntraceableModelError, match=r"'encoder\.rnn'"):
        ckptc.plan(model, (x, lengths), budget_bytes=10**9)
    # Evaluation and no_grad calls have nothing to plan: they run the model eagerly, as it is.
    with torch.no_grad():
        torch.manual_seed(1)
        ours = fast(x, lengths)
        torch.manual_seed(1)
        assert torch.equal(ours, model(x, lengths))  # dropout included
    model.eval()
    assert torch.equal(fast(x, lengths), model(x, lengths))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_rnn_run_eagerly_on_packed_sequences_is_refused_after_the_call() -> None:
    """Packed sequences are not captured even under allow_rnn: the check on graph inputs catches it."""
    torch.manual_seed(0)
    model = Tagger(nn.LSTM, dropout=0.0, packed=True)
    with pytest.raises(UntraceableModelError, match=r"LSTM 'encoder\.rnn' ran outside the captured graphs"):
        ckptc.optimize(model, budget_bytes=10**9)(*_inputs())


@pytest.mark.parametrize("raw_input", [False, True], ids=["behind a linear layer", "fed the model's input"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_rnn_without_dropout_is_captured_and_trains_like_eager_within_the_budget(
    cell: type[nn.RNNBase], raw_input: bool
) -> None:
    """An LSTM fed the model's input crashed the process (oneDNN's inference kernel, traced for training)."""
    torch.manual_seed(0)
    model = Tagger(cell, dropout=0.0, raw_input=raw_input)
    model.unused = nn.GRU(4, 4)  # an RNN the forward never calls is not refused
    reference = copy.deepcopy(model)
    x, lengths = _inputs()
    unoptimized = ckptc.plan(copy.deepcopy(model), (x, lengths), strategy="none")
    assert len(unoptimized.graphs) == 1
    budget = (unoptimized.min_feasible_bytes + unoptimized.unoptimized_peak_bytes) // 2
    fast = ckptc.optimize(model, budget_bytes=budget)
    loss = fast(x, lengths)
    loss.backward()
    ref_loss = reference(x, lengths)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) == name.startswith("unused."), name
        assert q.grad is None or torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    assert fast.plan is not None and fast.plan.values("recomputed"), "a halfway budget recomputes something"

    for p in model.parameters():
        p.grad = None
    fast(x, lengths).backward()  # the first step after planning is measured (verify=True)
    assert fast.plan.measured_peak_bytes is not None and fast.plan.measured_peak_bytes <= budget


class _NestedTagger(Tagger):
    """The recurrent call nested in an expression: where plain ``torch.compile`` (no ``allow_rnn``) breaks the
    graph there, Dynamo cannot resume mid-expression, so it runs the whole ``forward`` eagerly and marks its
    code to be skipped for every later compile."""

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder.rnn(self.embed(x))[0])).square().mean()


def test_a_forward_an_earlier_plain_torch_compile_skipped_is_captured_by_ckptc() -> None:
    """Dynamo's skip mark, left by a compile under another configuration, must not make ckptc train unplanned
    (it refused: "torch.compile ran the call without any captured graph")."""
    x, lengths = _inputs()
    torch._dynamo.reset()
    torch.compile(_NestedTagger(nn.GRU, dropout=0.0), backend="eager")(x, lengths).backward()
    torch.manual_seed(0)
    model = _NestedTagger(nn.GRU, dropout=0.0)
    reference = copy.deepcopy(model)
    plan = ckptc.plan(copy.deepcopy(model), (x, lengths), strategy="none")
    fast = ckptc.optimize(model, budget_bytes=plan.unoptimized_peak_bytes)
    fast(x, lengths).backward()
    reference(x, lengths).backward()
    assert fast.plan is not None and len(fast.plan.graphs) == 1
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_the_backend_given_a_model_whose_rnn_dynamo_runs_eagerly_says_so_once() -> None:
    """Under the caller's Dynamo configuration (``allow_rnn`` off by default) the recurrent module runs eagerly
    under ``torch.compile``: unplanned and uncounted, a tagger measured 1.8x its budget without a word.  A
    backend told the model warns once, naming the module and what to do; with ``allow_rnn`` on it is quiet."""
    model = Tagger(nn.LSTM, dropout=0.0)
    with pytest.warns(ckptc.CkptcWarning, match=r"(?s)encoder\.rnn \(LSTM\) will run eagerly.*allow_rnn = True"):
        ckptc.backend(budget_gb=1, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptc.CkptcWarning)
        ckptc.backend(budget_gb=1, model=model)  # once per model
        with torch._dynamo.config.patch(allow_rnn=True):
            ckptc.backend(budget_gb=1, model=Tagger(nn.GRU, dropout=0.0))


@pytest.mark.parametrize("entry", ["optimize", "apply"])
def test_a_model_trained_through_optimize_is_not_told_its_rnn_will_run_eagerly(entry: str) -> None:
    """ckptc.optimize compiles with ``allow_rnn`` on, so the recurrent module is traced and planned: it was told,
    as the backend tells a model under the caller's configuration, that the module would run eagerly and
    that it should train through ckptc.optimize, which it was doing."""
    model = Tagger(nn.LSTM, dropout=0.0)
    x, lengths = torch.randn(2, 6, 8), torch.tensor([6, 6])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fast = ckptc.optimize(model, budget_gb=1) if entry == "optimize" else ckptc.apply(model, budget_gb=1)
        fast(x, lengths).backward()
    told = [str(w.message) for w in seen if "will run eagerly" in str(w.message)]
    assert told == [], told
    assert (ckptc.applied(model) if entry == "apply" else fast).plan is not None
