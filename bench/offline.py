"""Planned offline: billion-parameter steps planned on a machine that cannot hold them (issue 21).

    python -m bench.offline --model llama3-8b     # one model per process (its peak RSS is the process's)
    python -m bench.offline --model hyena-1b
    python -m bench.offline --model olmoe-1b-7b-4-layers

The model is built on the ``meta`` device (no weights) and planned with
``ckptc.capture(..., device="cpu")``: the step is captured under fake tensors,
no weight or activation is allocated.  Prints one markdown row and writes it, with the JSON,
to ``bench/results/offline_<model>.{md,json}``: ckptc's floor, the unoptimized
peak, per-block checkpointing's predicted peak (strategy ``layer``), ckptc's
plan at 40 and 80 GiB with its recompute (% of step FLOPs), capture and plan
time, and the process's peak RSS.  Optimizer state is not in any figure (the
budget does not count it: Adam's moments add 2x the fp32 parameters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ckptc
import solvers.api
from ckptc.planning.planner import unoptimized_result

GiB = 2**30


def llama3_8b(seq: int = 4096) -> tuple[torch.nn.Module, tuple, dict, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=seq,
        rope_theta=500000.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return _causal_lm_on_meta(LlamaForCausalLM, config, batch=1, seq=seq)


def _causal_lm_on_meta(
    model_class: Any, config: Any, *, batch: int, seq: int
) -> tuple[torch.nn.Module, tuple, dict, Any]:
    """A transformers causal LM built on ``meta`` in bf16, with token ids that are also its labels."""
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        model = model_class(config).train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}, None


def hyena_1b(seq: int = 32768) -> tuple[torch.nn.Module, tuple, dict, Any]:
    from tests.hyena import HyenaConfig, HyenaDNA, next_token_loss

    class WithLoss(torch.nn.Module):
        # The loss reads the inputs: computed inside forward, it sees the capture's fake inputs
        # (a loss_fn closing over the meta tensors would not).
        def __init__(self) -> None:
            super().__init__()
            self.model = HyenaDNA(HyenaConfig(d_model=2048, n_layer=24, filter_width=64, max_seq_len=seq))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return next_token_loss(self.model(ids), ids)

    with torch.device("meta"):
        model = WithLoss().train()
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, (ids,), {}, lambda loss: loss


def olmoe_1b_7b_4_layers(seq: int = 4096) -> tuple[torch.nn.Module, tuple, dict, Any]:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=4,  # of 16: the whole model's one graph would exceed ckptc's 8,000 ops
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return _causal_lm_on_meta(OlmoeForCausalLM, config, batch=4, seq=seq)


MODELS = {
    "olmoe-1b-7b-4-layers": (
        olmoe_1b_7b_4_layers,
        "OLMoE-1B-7B shape, 4 of its 16 layers, 64 experts, top-8, batch 4 x 4096, bf16",
    ),
    "llama3-8b": (llama3_8b, "Llama-3-8B shape, seq 4096, bf16"),
    "hyena-1b": (hyena_1b, "HyenaDNA-style, d_model 2048, 24 layers, 32k nt, fp32"),
}


class _default_dtype:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *_: Any) -> None:
        torch.set_default_dtype(self.saved)


def _plan(step: ckptc.CapturedStep, **kwargs: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        plan = step.plan(**kwargs)
    except ckptc.InfeasibleBudgetError as error:
        return {"infeasible": True, "floor_bytes": error.min_feasible_bytes, "seconds": time.perf_counter() - start}
    return {
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "recompute_percent": plan.recompute_percent,
        "seconds": time.perf_counter() - start,
    }


def run(name: str) -> dict[str, Any]:
    build, label = MODELS[name]
    model, inputs, kwargs, loss_fn = build()
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    step = ckptc.capture(model, inputs, kwargs, loss_fn=loss_fn, device="cpu")
    capture_s = time.perf_counter() - start
    result = {
        "model": name,
        "label": label or f"{parameters / 1e9:.2f} B parameters",
        "parameters": parameters,
        "nodes": sum(len(r.problem) for r in step.records),
        "graphs": step.graphs,
        "capture_s": capture_s,
        "floor_bytes": step.floor_bytes,
        "unoptimized_peak_bytes": step.unoptimized_peak_bytes,
        "parameter_bytes": step.parameter_bytes,
        "layer": _plan(step, strategy="layer"),
        "40": _plan(step, budget_gb=40),
        "80": _plan(step, budget_gb=80),
    }
    if any(r.problem.size_groups for r in step.records):
        # What the unoptimized peak was with every routed count priced at its own bound.
        result["unoptimized_peak_at_bounds_bytes"] = max(
            unoptimized_result(
                dataclasses.replace(r.joint_problem, problem=solvers.api.at_bounds(r.joint_problem.problem))
            ).peak_bytes
            for r in step.records
        )
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def row(r: dict[str, Any]) -> str:
    def gib(n: int | None) -> str:
        return "-" if n is None else f"{n / GiB:.2f} GiB"

    def planned(p: dict[str, Any]) -> str:
        if p.get("infeasible"):
            return f"infeasible (floor {gib(p['floor_bytes'])})"
        return f"{gib(p['predicted_peak_bytes'])} ({p['recompute_percent']:.1f}%)"

    plan_s = r["40"]["seconds"] + r["80"]["seconds"]
    return (
        f"| {r['model']} ({r['label']}; {r['parameters'] / 1e9:.2f} B params, {r['nodes']:,} nodes) | "
        f"{gib(r['floor_bytes'])} | {gib(r['unoptimized_peak_bytes'])} | {planned(r['layer'])} | "
        f"{planned(r['40'])} | {planned(r['80'])} | {r['capture_s']:.0f} s + {plan_s:.1f} s | "
        f"{r['peak_rss_bytes'] / GiB:.2f} GiB |"
    )


HEADER = (
    "| model | floor | unoptimized peak | per-block (`layer`) | ckptc @40 GiB (recompute) | ckptc @80 GiB | "
    "capture + plan (both budgets) | peak RSS |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    result = run(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"offline_{args.model}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"offline_{args.model}.md").write_text(HEADER + "\n" + row(result) + "\n")
    print(HEADER)
    print(row(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
