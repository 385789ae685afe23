"""The CUDA memory model, without a GPU (issue 21): the caching allocator's rules on recorded
sizes, cuBLAS workspaces, and the tensors CUDA's flash attention saves, priced on fake CUDA tensors."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import ckptc
import ckptc.pricing.problem
import solvers
from ckptc.planning.account import planning_margin
from ckptc.pricing.costs import annotate_costs, measure_scratch
from ckptc.pricing.devices import (
    MemoryModel,
    block_bytes,
    cublas_workspace_bytes,
    flash_attention_backward_workspace,
    graph_device,
    kernel_workspace_bytes,
    memory_model,
)

MiB = 1 << 20


@pytest.mark.parametrize(
    ("requested", "counted"),
    [
        (1, 512),  # kMinBlockSize
        (512, 512),
        (513, 1024),
        (16384, 16384),  # Llama-8B RMSNorm rsqrt [1, 4096, 1] fp32
        (MiB, MiB),  # the largest small-pool request: Llama-8B rotary cos [1, 4096, 128] bf16
        (MiB + 1, MiB + 512),  # large pool, from a 20 MiB segment: split
        (5 * MiB + 3, 5 * MiB + 512),
        (10 * MiB, 10 * MiB),  # kMinLargeAlloc: its own segment, rounded to 2 MiB, nothing left
        (10 * MiB + 1, 10 * MiB + 512),  # segment 12 MiB, 2 MiB - 512 left: split
        (11 * MiB, 12 * MiB),  # 1 MiB left is not more than kSmallSize: the whole segment
        (23 * MiB + 100, 24 * MiB),
        (8 * 1024 * 768 * 4, 24 * MiB),  # GPT-2 bench activation [8, 1024, 768] fp32
        (4096 * 128256 * 4, 4096 * 128256 * 4),  # Llama-3 logits [1, 4096, 128256] fp32: 2004 MiB
        (0, 0),  # an empty tensor allocates nothing
    ],
)
def test_caching_allocator_blocks_on_recorded_sizes(requested: int, counted: int) -> None:
    assert block_bytes(requested) == counted


def test_expandable_segments_split_every_block() -> None:
    assert block_bytes(11 * MiB, expandable_segments=True) == 11 * MiB
    assert block_bytes(100, expandable_segments=True) == 512


def test_a_storage_growing_with_a_routed_count_never_rounds_above_its_slack() -> None:
    """A value that grows with tokens routed to an expert is priced at a count below its bound by its bytes
    per unit plus the most the allocator's block rounding can add at any size up to its bound."""
    cuda = MemoryModel("cuda", rounds_blocks=True)
    for largest in (4096, 9 * MiB, 10 * MiB, 64 * MiB, 3 * 1024 * MiB):
        slack = cuda.rounding_slack(largest)
        for nbytes in range(0, largest + 1, max(1, largest // 997)):
            assert block_bytes(nbytes) <= nbytes + slack, (largest, nbytes)
    assert MemoryModel("cpu").rounding_slack(64 * MiB) == 0


def test_cublas_workspace_follows_the_config_and_the_compute_capability() -> None:
    assert cublas_workspace_bytes(None, (9, 0)) == 32 * MiB  # Hopper
    assert cublas_workspace_bytes(None, (10, 0)) == 32 * MiB  # Blackwell
    assert cublas_workspace_bytes(None, (8, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8  # Ampere: :4096:2:16:8
    assert cublas_workspace_bytes(":4096:8", (8, 0)) == 32 * MiB
    assert cublas_workspace_bytes(":16:8", (9, 0)) == 128 * 1024
    assert cublas_workspace_bytes(None, None) == 32 * MiB  # unknown device: the larger


def test_the_memory_model_is_chosen_by_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cpu = memory_model("cpu")
    assert cpu.storage_bytes(1) == 1 and cpu.step_overhead_bytes == 0
    cuda = memory_model("cuda")
    assert cuda.storage_bytes(1) == 512 and cuda.storage_bytes(11 * MiB) == 12 * MiB
    if not torch.cuda.is_available():
        # Two threads (caller and autograd), each with a cuBLAS and a cuBLASLt workspace.
        assert cuda.step_overhead_bytes == 2 * (32 + 1) * MiB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "256")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    small = memory_model("cuda")
    assert small.step_overhead_bytes == 2 * (128 + 256) * 1024 and small.storage_bytes(11 * MiB) == 11 * MiB
    with FakeTensorMode():
        tensors = [torch.empty(2), torch.empty(2, device="cuda")]
    assert graph_device(tensors).type == "cuda" and graph_device(tensors[:1]).type == "cpu"


def _flash_attention_step() -> tuple[fx.GraphModule, dict[int, fx.Node], fx.Node, fx.Node]:
    """A forward and backward of CUDA's flash attention kernel, on fake CUDA tensors: the shapes
    are PyTorch's own meta kernels' (Llama-3-8B attention: 32 heads, seq 4096, head 128, bf16).
    Returns the graph, the forward's outputs by index, the forward and the backward."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    graph = fx.Graph()
    with FakeTensorMode():
        q = torch.empty(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
        names = ("primals_1", "primals_2", "primals_3", "tangents_1")
        inputs = {name: graph.placeholder(name) for name in names}
        for node in inputs.values():
            node.meta["val"] = torch.empty_like(q)
        outs = flash(q, q, q, 0.1, True)  # dropout: the kernel draws, and saves its seed and offset
        forward = graph.call_function(flash, (inputs["primals_1"], inputs["primals_2"], inputs["primals_3"], 0.1, True))
        forward.meta["val"] = outs
        got = {}
        for i in (0, 1, 6, 7, 8):
            got[i] = graph.call_function(operator.getitem, (forward, i))
            got[i].meta["val"] = outs[i]
        out, lse, _, _, max_q, max_k, seed, offset, _ = outs
        args = (q, q, q, q, out, lse, None, None, max_q, max_k, 0.1, True, seed, offset)
        grads = flash_backward(*args)
        node_args = (
            inputs["tangents_1"],
            inputs["primals_1"],
            inputs["primals_2"],
            inputs["primals_3"],
            got[0],
            got[1],
            None,
            None,
            max_q,
            max_k,
            0.1,
            True,
            got[6],
            got[7],
        )
        backward = graph.call_function(flash_backward, node_args)
        backward.meta["val"] = grads
        graph.output((got[0], backward))
    return fx.GraphModule(torch.nn.Module(), graph), got, forward, backward


def test_cuda_flash_attention_saves_logsumexp_and_the_rng_state_priced_as_blocks() -> None:
    gm, got, forward, backward = _flash_attention_step()
    costs = annotate_costs(gm)
    by_name = {node: costs[node] for node in got.values()}
    out_cost, lse_cost, seed_cost, offset_cost, mask_cost = (by_name[got[i]] for i in (0, 1, 6, 7, 8))
    assert out_cost.bytes == 32 * MiB and out_cost.kind == "forward"
    assert lse_cost.bytes == 32 * 4096 * 4  # fp32 log-sum-exp per row: 512 KiB
    assert seed_cost.bytes == offset_cost.bytes == 512  # 16 and 8 bytes, each a 512-byte block
    assert mask_cost.bytes == 0  # the empty debug mask
    # What backward reads from forward: the output, the log-sum-exp and the RNG state.
    saved = {n for n in backward.all_input_nodes if n.op != "placeholder"}
    assert saved == {got[0], got[1], got[6], got[7]}
    assert costs[forward].op == "_scaled_dot_product_flash_attention"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the scratch is measured, not modelled")
def test_flash_attention_backwards_workspace_is_priced_for_cuda_without_a_gpu() -> None:
    """Planned for CUDA on a machine without one, flash attention's backward is priced at the temporaries
    its kernel allocates (``mha_bwd``): the fp32 row sums, 32 x 4096 x 4 B = 512 KiB, and the fp32
    accumulator of the query's gradient, 4096 x 32 x 128 x 4 B = 64 MiB (it was priced at 0)."""
    gm, _, forward, backward = _flash_attention_step()
    annotate_costs(gm)
    measure_scratch(gm)
    assert backward.meta["ckptc"].scratch_bytes == 512 * 1024 + 64 * MiB
    assert forward.meta["ckptc"].scratch_bytes == 0  # no rule for the forward: its temporaries are outputs


def test_flash_attention_backwards_workspace_follows_the_kernels_rounding_and_grouped_heads() -> None:
    # seq 1000 -> 1024 rows, head 80 -> 96 (rounded to 32 up to 128), 64 heads -> 4 splits of 132 SMs
    assert flash_attention_backward_workspace((2, 16, 1000, 80), (2, 16, 1000, 80), 2) == [
        2 * 16 * 1024 * 4,
        2 * 1024 * 16 * 96 * 4,
    ]
    assert flash_attention_backward_workspace((1, 32, 1000, 80), (1, 32, 1000, 80), 2, deterministic=True)[1] == (
        5 * 1024 * 32 * 96 * 4
    )
    # head 192 -> 192 (rounded to 64); grouped-query attention: the key's and value's gradients at 32 heads
    grouped = flash_attention_backward_workspace((1, 32, 4096, 192), (1, 8, 4096, 192), 2)
    assert grouped[1] == 4096 * 32 * 192 * 4 and grouped[2:] == [4096 * 32 * 192 * 2] * 2
    assert kernel_workspace_bytes(torch.ops.aten.mm.default, [(2, 2), (2, 2)], 4, torch.device("cuda")) is None
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    shapes = [(1, 32, 4096, 128)] * 4
    assert kernel_workspace_bytes(flash_backward, shapes, 2, torch.device("cpu")) is None


def test_the_planning_margin_allows_for_blocks_served_from_the_cache() -> None:
    """A cached block is split only when more than 1 MiB would remain: on an H200, settled steps peaked up
    to 1.44% of the kept activations above the block-rounded prediction (Llama, bench size).  The margin of a
    graph on the caching allocator covers that share; on the CPU (no cache) it stays as it was."""
    x = solvers.Node("x", 64 * MiB, 0.0, "input")
    f1 = solvers.Node("f1", 48 * MiB, 1.0, "forward", ("x",))
    f2 = solvers.Node("f2", 16 * MiB, 1.0, "forward", ("f1",), output=True)
    b2 = solvers.Node("b2", 16 * MiB, 0.0, "backward", ("f2", "f1"))
    b1 = solvers.Node("b1", 64 * MiB, 0.0, "backward", ("b2", "x"), output=True)
    problem = solvers.Problem([x, f1, f2, b2, b1])
    unoptimized = solvers.simulate(problem, solvers.Plan(kept=frozenset({"f1", "f2"})))
    cpu, cuda = (planning_margin(problem, unoptimized, memory_model(device)) for device in ("cpu", "cuda"))
    assert unoptimized.kept_bytes >= 48 * MiB
    assert cpu == unoptimized.kept_bytes // 200
    assert cuda - cpu == unoptimized.kept_bytes // 64 >= unoptimized.kept_bytes * 0.0144


def test_keeping_everything_on_a_caching_allocator_is_priced_with_its_cache_allowance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a budget at the block-rounded keep-everything peak got the keep-everything plan, to which no
    margin applied, and measured 0.1-5 MiB above it on an H200.  On a caching allocator the unoptimized peak
    includes the cache allowance: a budget there keeps everything, one at the priced peak recomputes a
    little, and the floor stays below.  The CPU stands in for the allocator (its allowance patched in)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])
    x = torch.randn(256, 64)
    priced = ckptc.capture(copy.deepcopy(model), (x,))
    cached = MemoryModel("cpu", cache_reuse_divisor=64)
    monkeypatch.setattr(ckptc.pricing.problem, "memory_model", lambda device: cached)
    step = ckptc.capture(copy.deepcopy(model), (x,))
    (record,) = step.records
    allowance = record.unoptimized_kept_bytes // 64
    assert allowance > 0 and step.unoptimized_peak_bytes == priced.unoptimized_peak_bytes + allowance
    assert step.plan(budget_bytes=step.unoptimized_peak_bytes).recompute_flops == 0
    within = step.plan(budget_bytes=priced.unoptimized_peak_bytes)
    assert within.recompute_flops > 0 and within.predicted_peak_bytes <= priced.unoptimized_peak_bytes - allowance
    assert priced.floor_bytes < step.floor_bytes <= step.unoptimized_peak_bytes


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.py)")


class _LossHeadFirst(torch.nn.Module):
    """A linear layer and a wide loss head: the step peaks where backward begins, before its first product."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.proj(x), dim=-1).exp().mean()


@needs_cuda
def test_the_check_on_cuda_counts_the_workspaces_through_the_whole_step() -> None:
    """On an H200 the run-time check read 35-67 MB below max_memory_allocated: cuBLAS's workspaces,
    allocated at the first step and held for good, were memory from before the measured span."""
    from ckptc.meter import measure_peak, resident_bytes

    model, x = _LossHeadFirst().cuda(), torch.randn(4096, 256, device="cuda")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).backward()

    step()
    step()  # every thread's workspaces are allocated, as in any later step
    # The check allocates each thread's cuBLAS and cuBLASLt workspaces (this step's backward runs no
    # cuBLASLt product): once it has, the device holds what it measures.
    measure_peak(step, baseline_bytes=0, device="cuda")
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    absolute = torch.cuda.max_memory_allocated()  # nothing else lives on the device
    model.zero_grad(set_to_none=True)
    _, measured = measure_peak(step, baseline_bytes=resident_bytes(model, x), device="cuda")
    assert abs(measured.peak_bytes - absolute) <= 64 * 1024, (measured.peak_bytes, absolute)


@needs_cuda
def test_scratch_is_measured_on_cuda() -> None:
    """An op's temporary memory on the GPU (a sort's radix-sort buffers) is priced, not taken as 0."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ckptc.pricing.costs import measure_scratch

    def sort_values(x: torch.Tensor) -> torch.Tensor:
        return torch.sort(x, dim=0).values

    graph = make_fx(sort_values)(torch.randn(1 << 22, device="cuda"))
    annotate_costs(graph)
    assert measure_scratch(graph) >= 1
    (sort,) = [n for n in graph.graph.nodes if n.op == "call_function" and "sort" in str(n.target)]
    assert sort.meta["ckptc"].scratch_bytes > 0


@needs_cuda
def test_on_cuda_a_plans_first_three_steps_are_measured_within_the_budget() -> None:
    """The caching allocator serves later steps from its cache: the check measures three steps of a plan
    (ckptc.meter.STEPS_TO_VERIFY), each within the budget, and then no more."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)])
    x = torch.randn(4096, 256, device="cuda")
    step_ = ckptc.capture(model.cuda(), (x,))
    fast = ckptc.optimize(model, budget_bytes=(step_.floor_bytes + step_.unoptimized_peak_bytes) // 2)
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        fast(x).square().mean().backward()
    (shape,) = fast.step_runtime.plans.values()
    assert sum(shape.steps_within_budget.values()) == 3, shape
    assert fast.plan.measured_peak_bytes <= fast.plan.budget_bytes
