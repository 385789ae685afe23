"""Planning a model that does not fit here, and carrying the plan to where it runs (issue 21).

A model built on ``meta`` or under ``FakeTensorMode`` is captured under fake
tensors for a target device: no weight allocated, the same plan as the model
with real weights gets, and the plan file applies to that model.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import resource

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptc
from ckptc.plans import ModelPlan, plan_source_for
from tests.helpers import assert_same_training, step
from tests.test_scale import llama_config
from tests.zoo import ModelCase


def _llama(device: str | None = None, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    if device is None:
        return LlamaForCausalLM(llama_config(64, 2, 32, 256)).train()
    with torch.device(device):
        return LlamaForCausalLM(llama_config(64, 2, 32, 256)).train()


def _ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)


def _decisions(plan: ModelPlan) -> list:
    """Every graph's decisions (kept values, schedule) as its plan file holds them."""
    return [{k: g.to_dict()["plan"].get(k) for k in ("kept", "schedule")} for g in plan.graphs]


@functools.cache
def _real_step() -> ckptc.CapturedStep:
    ids = _ids()
    return ckptc.capture(_llama(), (ids,), {"labels": ids})


def _real_plan(fraction: float = 0.5) -> tuple[ModelPlan, int]:
    step_ = _real_step()
    budget = step_.floor_bytes + int((step_.unoptimized_peak_bytes - step_.floor_bytes) * fraction)
    return step_.plan(budget_bytes=budget), budget


def test_a_plan_made_on_meta_is_the_real_models_plan_and_trains_it_like_eager(tmp_path) -> None:
    real_plan, budget = _real_plan()
    assert real_plan.recompute_flops > 0  # a budget that makes decisions
    meta = _llama("meta")
    ids = _ids("meta")
    offline = ckptc.plan(meta, (ids,), {"labels": ids}, budget_bytes=budget)  # rotary autocast on meta works
    assert offline.to_json() == real_plan.to_json()  # byte-identical decisions
    assert all(p.device.type == "meta" for p in meta.parameters())  # the model is left as it was
    path = tmp_path / "offline.json"
    offline.save(path)
    ids = _ids()
    case = ModelCase("llama", _llama(), (ids,), {"labels": ids})
    reference = copy.deepcopy(case.model)
    fast = ckptc.optimize(case.model, plan=path, verify=False)
    assert_same_training(case, reference, step(case, fast), step(case, reference))
    assert _decisions(fast.plan) == _decisions(real_plan)  # applied as planned


def test_a_model_built_under_fake_tensors_plans_like_the_real_one() -> None:
    real_plan, budget = _real_plan(0.3)
    with FakeTensorMode():
        model = _llama()
        ids = torch.randint(0, 256, (2, 32))
    # Captured outside the mode it was built in, and inside it: the same plan.
    outside = ckptc.plan(model, (ids,), {"labels": ids}, budget_bytes=budget)
    with model.lm_head.weight.fake_mode:
        inside = ckptc.plan(model, (ids,), {"labels": ids}, budget_bytes=budget)
    assert outside.to_json() == inside.to_json() == real_plan.to_json()


def _gpt2(device: str | None = None) -> torch.nn.Module:
    """A tiny GPT-2 with dropout on: dropout's kernels allocate scratch (a mask made in floats)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
    with torch.device(device or "cpu"):
        return GPT2LMHeadModel(config).train()


def test_kernels_scratch_is_priced_offline_as_on_the_real_model() -> None:
    """Offline, each op's scratch is measured as for a real capture, on random data at sizes this
    machine affords (before, it was priced at 0: a floor of 1,421,975 B offline against 1,422,491 B)."""
    ids = torch.randint(0, 256, (2, 32))
    real = ckptc.capture(_gpt2(), (ids,), {"labels": ids})
    meta_ids = ids.to("meta")
    offline = ckptc.capture(_gpt2("meta"), (meta_ids,), {"labels": meta_ids}, device="cpu")
    assert offline.floor_bytes == real.floor_bytes
    assert offline.unoptimized_peak_bytes == real.unoptimized_peak_bytes


def test_an_op_too_large_to_run_is_measured_shrunk_and_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op whose inputs and outputs exceed FULL_SIZE_SCRATCH_BYTES runs with its sizes shrunk alike (a
    matmul's sizes keep agreeing) and its scratch scaled by its operands' bytes: with most ops of a tiny
    GPT-2 above the limit and none run at full size, the floor stays within 0.1% of the one measured at
    full size."""
    from ckptc.pricing import costs

    ids = torch.randint(0, 256, (4, 128))
    full = ckptc.capture(_gpt2(), (ids,), {"labels": ids})
    ran: list[dict[int, int]] = []
    shrunk_sizes = costs._shrunk_sizes

    def recorded(node, limit):
        sizes, scale = shrunk_sizes(node, limit)
        ran.append(sizes)
        return sizes, scale

    monkeypatch.setattr(costs, "FULL_SIZE_SCRATCH_BYTES", 16 * 1024)
    monkeypatch.setattr(costs, "FULL_SIZE_FALLBACK_BYTES", 0)  # none runs at full size
    monkeypatch.setattr(costs, "_shrunk_sizes", recorded)
    torch.compiler.reset()
    shrunk = ckptc.capture(_gpt2(), (ids,), {"labels": ids})
    assert sum(1 for sizes in ran if sizes) > 20  # most ops ran shrunk
    assert abs(shrunk.floor_bytes - full.floor_bytes) <= full.floor_bytes // 1000, (
        shrunk.floor_bytes,
        full.floor_bytes,
    )


def test_offline_planning_allocates_nothing() -> None:
    # 2.4 GiB of fp32 weights on meta: a capture that materialized them (or their gradients)
    # would raise this process's peak resident memory by at least that much.
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(4096, 2, 256, vocab=32000)).train()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    step_ = ckptc.capture(model, (ids,), {"labels": ids}, device="cpu")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert step_.parameter_bytes > 2 * 2**30
    assert step_.unoptimized_peak_bytes > 2 * step_.parameter_bytes  # weights, gradients, activations
    assert grown < 2**30, grown


def test_what_cannot_be_planned_offline_is_refused_with_what_to_do() -> None:
    meta = _llama("meta")
    ids = _ids("meta")
    with pytest.raises(ckptc.UntraceableModelError, match=r"(?s)'meta' device.*device='cpu'"):
        ckptc.plan(meta, (ids,), {"labels": ids}, budget_gb=1, device="meta")
    with pytest.raises(ValueError, match="measure_time"):
        ckptc.capture(meta, (ids,), {"labels": ids}, measure_time=True)
    if not torch.backends.cuda.is_built():
        with pytest.raises(ckptc.UntraceableModelError, match="no CUDA"):
            ckptc.plan(meta, (ids,), {"labels": ids}, budget_gb=1, device="cuda")
    # A device ckptc has no memory model for aborted the interpreter (mps), or raised a bare RuntimeError.
    with pytest.raises(ckptc.InvalidArgumentError, match="'cpu' or 'cuda'"):
        ckptc.plan(meta, (ids,), {"labels": ids}, budget_gb=1, device="mps")
    with pytest.raises(ckptc.InvalidArgumentError, match="banana"):
        ckptc.plan(meta, (ids,), {"labels": ids}, budget_gb=1, device="banana")
    with pytest.raises(ckptc.InvalidArgumentError, match="one CPU device"):  # was a capture error about devices
        ckptc.plan(meta, (ids,), {"labels": ids}, budget_gb=1, device="cpu:1")


def test_plan_files_ignore_the_local_build_suffix_and_refuse_another_release() -> None:
    real_plan, _ = _real_plan()
    release = torch.__version__.split("+")[0]
    ids = _ids()
    for version in (f"{release}+cu128", release):
        plan = ModelPlan.from_dict({**real_plan.to_dict(), "torch_version": version})
        fast = ckptc.optimize(_llama(), plan=plan, verify=False)
        fast(ids, labels=ids).loss.backward()
        assert _decisions(fast.plan) == _decisions(real_plan)
    major, minor, *_ = release.split(".")
    other = f"{major}.{int(minor) + 1}.0+cu128"
    plan = ModelPlan.from_dict({**real_plan.to_dict(), "torch_version": other})
    with pytest.raises(ckptc.PlanMismatchError, match=re.escape(f"torch {other}")):
        ckptc.optimize(_llama(), plan=plan, verify=False)(ids, labels=ids)


def test_a_plan_for_another_device_type_names_the_attention_kernel() -> None:
    cpu_op = "_scaled_dot_product_flash_attention_for_cpu"
    real_plan, _ = _real_plan(0.0)  # at the floor, attention is recomputed: the plan names its op
    data = real_plan.to_dict()
    assert cpu_op in json.dumps(data)
    # What a plan made on a GPU holds: the CUDA flash kernel's op, in another graph.
    cuda = json.loads(json.dumps(data).replace(cpu_op, "_scaled_dot_product_flash_attention"))
    for graph in cuda["graphs"]:
        graph["fingerprint"] = "0" * 64
    ids = _ids()
    with pytest.raises(ckptc.PlanMismatchError, match=r"'_scaled_dot_product_flash_attention', a CUDA kernel.*CPU"):
        ckptc.optimize(_llama(), plan=ModelPlan.from_dict(cuda), verify=False)(ids, labels=ids)
    # A plan that does not name the op (nothing of attention decided): the graph's kernel is named.
    halfway, _ = _real_plan(1.0)
    data = halfway.to_dict()
    data["graphs"][0]["fingerprint"] = "0" * 64
    with pytest.raises(ckptc.PlanMismatchError, match=rf"runs aten op '{cpu_op}', a CPU kernel"):
        ckptc.optimize(_llama(), plan=ModelPlan.from_dict(data), verify=False)(ids, labels=ids)


def test_a_plan_made_with_other_parameters_trainable_says_so_before_any_device_kernel() -> None:
    """A frozen parameter changes the backward, so the fingerprint differs: the refusal names that first,
    and says nothing of the attention kernel the plan itself was made with (it used to lead with it)."""
    real_plan, _ = _real_plan(0.0)  # at the floor the plan names the CPU attention op
    model = _llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    ids = _ids()
    with pytest.raises(ckptc.PlanMismatchError) as refused:
        ckptc.optimize(model, plan=real_plan, verify=False)(ids, labels=ids)
    message = str(refused.value)
    assert "fingerprint differs" in message and "requires_grad" in message, message
    assert "kernel, where" not in message and "another device type" not in message, message


def test_a_plan_with_other_inputs_names_the_inputs_that_differ() -> None:
    real_plan, _ = _real_plan()
    data = real_plan.to_dict()
    data["graphs"][0]["inputs"] = data["graphs"][0]["inputs"][:-1]  # as if one parameter were missing
    plan = ModelPlan.from_dict(data)
    source = plan_source_for(plan)
    step_ = _real_step()
    last = len(data["graphs"][0]["inputs"])
    with pytest.raises(ckptc.PlanMismatchError, match=rf"input {last} only in the model"):
        source(0, step_.records[0].joint_problem)


def test_a_loss_closing_over_meta_tensors_is_refused_with_what_to_do() -> None:
    meta = _llama("meta")
    ids = _ids("meta")

    def loss_fn(output):  # reads the meta ids, which the capture cannot replace
        logits = output.logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))

    with pytest.raises(ckptc.UntraceableModelError, match=r"(?s)meta device.*pass what the loss reads as an input"):
        ckptc.capture(meta, (ids,), loss_fn=loss_fn)
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_offline_planning_works_after_lightning_wraps_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing Lightning replaces ``torch.compile`` with a wrapper that deep-copies its arguments;
    ckptc's own compiles skip it (a copy of its backend would copy the fake model and fail)."""
    wrappers = pytest.importorskip("lightning.fabric.wrappers")
    monkeypatch.setattr(torch, "compile", wrappers._capture_compile_kwargs(inspect.unwrap(torch.compile)))
    with torch.device("meta"):
        model = _llama()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    assert ckptc.plan(model, (ids,), {"labels": ids}, strategy="none", device="cpu").predicted_peak_bytes > 0


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _LayerDrop(torch.nn.Module):
    """Skips a layer when a random draw says so, in Python, as BART's and Whisper's layerdrop do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if torch.rand([]) < 0.0:  # never true, but read in Python
                continue
            x = layer(x)
        return x.square().mean()


def test_code_reading_a_tensors_value_between_graphs_is_named_when_planning_offline() -> None:
    with torch.device("meta"):
        meta = _LayerDrop()
    x = torch.zeros(4, 16, device="meta")
    with pytest.raises(
        ckptc.UntraceableModelError, match=r"offline: test_offline\.py:\d+ \(`if torch\.rand\(\[\]\) < 0\.0"
    ):
        ckptc.capture(meta, (x,), device="cpu")
    real = _LayerDrop()
    ckptc.capture(real, (torch.zeros(4, 16),))  # with values, the same code captures


def test_a_plan_made_with_one_tensor_passed_twice_names_that_when_the_model_gets_two() -> None:
    """Planned offline with ``input_ids=ids, labels=ids`` (one graph input), trained with a batch whose labels
    are their own tensor (two): refused, saying that one tensor passed twice is one input (before: only "input
    30 only in the model", which does not say what to change)."""
    ids, on_meta = _ids(), _ids("meta")
    planned = ckptc.plan(_llama("meta"), (), {"input_ids": on_meta, "labels": on_meta}, budget_gb=1)
    with pytest.raises(ckptc.PlanMismatchError, match=r"one side passed one tensor as two arguments"):
        ckptc.optimize(_llama(), plan=planned)(input_ids=ids, labels=ids.clone())


def test_a_plan_for_fewer_layers_does_not_blame_an_argument_passed_twice() -> None:
    """A layer more than the plan: extra floating-point inputs (its parameters), not one tensor passed twice;
    the message says the model differs from the one planned (before: only the input positions that differ)."""
    x = torch.randn(8, 16)

    def mlp(layers: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(layers)))

    planned = ckptc.plan(mlp(3), (x,), budget_gb=1, loss_fn=lambda out: out.square().mean())
    with pytest.raises(ckptc.PlanMismatchError, match="only in the model") as refused:
        ckptc.optimize(mlp(4), plan=planned)(x).square().mean().backward()
    assert "two arguments" not in str(refused.value)
    assert "the model has 2 floating-point input(s) more" in str(refused.value), refused.value
    assert "other layers or sizes than the one planned" in str(refused.value), refused.value


@pytest.mark.parametrize("entry", ["optimize", "apply"])
def test_training_a_model_without_weights_is_refused_pointing_at_offline_planning(entry: str) -> None:
    """A model built on ``meta`` holds no values: training it through ckptc failed while capturing, naming a
    missing ``torch.meta`` module and advising about graph breaks (a T5: a raw fake-tensor assertion)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    call = ckptc.optimize if entry == "optimize" else ckptc.apply
    with pytest.raises(ckptc.InvalidArgumentError, match=r"meta device.*ckptc\.plan\(model"):
        call(model, budget_bytes=1 << 20)
    assert ckptc.applied(model) is None and all(p.is_meta for p in model.parameters())
