"""The one home of every private PyTorch API that ckptc uses.

A torch upgrade that moves or renames one of these touches this file only.
Everything here is a thin alias or adapter: no ckptc logic lives here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

# Joint-graph capture and the AOTAutograd runtime (autograd.Function wrapper,
# input mutations, aliasing, boxed calling convention).
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import _extract_fwd_bwd_modules
from torch.fx.graph import _BoxedCodeGen

__all__ = [
    "aot_backend",
    "boxed",
    "split_joint_graph",
    "reset_dynamo",
    "dynamo_explain",
    "inductor_compile",
    "is_tangent",
    "is_primal",
    "BackendCompilerFailed",
    "DynamoError",
    "compile_limits",
    "outside_fake_mode",
]


def aot_backend(
    fw_compiler: Callable[[fx.GraphModule, Sequence[Any]], Callable],
    bw_compiler: Callable[[fx.GraphModule, Sequence[Any]], Callable],
    partition_fn: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
) -> Callable:
    """A ``torch.compile`` backend built on AOTAutograd with our partitioner.

    ``partition_fn(joint_module, joint_inputs, *, num_fwd_outputs, **kw)`` receives
    the aten-level joint forward+backward graph (fake-tensor metadata in
    ``node.meta["val"]``) and returns the forward and backward graph modules.
    """
    return _aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=fw_compiler,
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
    )


def boxed(gm: fx.GraphModule) -> Callable:
    """Make ``gm`` run with the boxed calling convention.

    The generated code takes its inputs as one list and clears it, so each input
    (a saved activation, in backward) is freed right after its last use instead of
    living until the graph returns.
    """
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return make_boxed_func(gm.forward) if not getattr(gm, "_boxed_call", False) else gm


def split_joint_graph(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Cut a joint graph into AOTAutograd's forward and backward modules.

    The forward returns ``fwd_outputs + saved_values + saved_sym_nodes``; the
    backward takes ``saved_sym_nodes + saved_values + tangents``.  Both keep the
    node order of ``joint`` (dead code removed), so the joint graph's order is the
    execution order.
    """
    return _extract_fwd_bwd_modules(
        joint,
        saved_values,
        saved_sym_nodes,
        num_fwd_outputs=num_fwd_outputs,
    )


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def is_primal(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" not in str(node.target)


def reset_dynamo() -> None:
    torch._dynamo.reset()


def dynamo_explain(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return torch._dynamo.explain(fn)(*args, **kwargs)


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs)


from torch._dynamo.exc import BackendCompilerFailed  # noqa: E402
from torch._dynamo.exc import TorchDynamoException as DynamoError  # noqa: E402


def compile_limits():
    """Raise Dynamo's recompile limits while ckptc-compiled code runs.

    Every ``optimize`` call compiles the model's code again with its own
    backend; past Dynamo's default limit of 8 it would silently fall back to
    eager execution, which would also silently drop the plan.
    """
    return torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096)


def outside_fake_mode():
    """Run real tensor code from inside a compiler pass (AOTAutograd's fake mode is active there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(_disable_current_modes())
    return stack
