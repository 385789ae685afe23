"""Random ops that can be recomputed: save the generator state, not the mask.

Before each random op of the forward pass, :func:`capture_rng_state` snapshots
the state of the generator the op draws from (a few bytes on CUDA, 5 KB on
CPU).  A recomputation in backward calls :func:`replay_with_rng_state`, which
runs the op with that state and then restores the generator, so the replayed
op draws exactly the numbers it drew in forward and the random stream seen by
the rest of the program is untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ckptc._torch_internals import is_tangent
from ckptc.pricing.costs import is_random


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def capture_rng_state(device: torch.device) -> torch.Tensor:
    """The current state of ``device``'s default generator (a uint8 tensor on CPU)."""
    return _generator(device).get_state()


def replay_with_rng_state(
    state: torch.Tensor, device: torch.device, op: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Any:
    """Run the random ``op`` as it ran when ``state`` was captured.

    The first three parameters are positional-only: the op's own keyword
    arguments (``torch.randn(..., device=...)`` has a ``device`` too) pass
    through ``kwargs`` without clashing with them.
    """
    generator = _generator(device)
    current = generator.get_state()
    generator.set_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        generator.set_state(current)


def rng_state_nbytes(device: torch.device) -> int:
    """Bytes that one captured state holds on ``device`` (for the cost model)."""
    state = _generator(device).get_state()
    return state.numel() * state.element_size()


def insert_rng_state_nodes(graph: "torch.fx.Graph") -> int:
    """Graph pass: put a :func:`capture_rng_state` node before each forward random op.

    The op's ``meta["ckptc_rng_state"]`` then names its state node, which the
    rewriter passes to :func:`replay_with_rng_state` when it recomputes the op.
    Random ops downstream of a tangent (backward) are left alone: they never
    recompute.  Returns the number of nodes inserted.
    """
    tangent_dependent: set[torch.fx.Node] = set()
    inserted = 0
    for node in list(graph.nodes):
        if is_tangent(node) or any(n in tangent_dependent for n in node.all_input_nodes):
            tangent_dependent.add(node)
            continue
        if node.op != "call_function" or not is_random(node):
            continue
        val = node.meta.get("val")
        example = val[0] if isinstance(val, (tuple, list)) else val
        if not isinstance(example, torch.Tensor):
            continue
        device = example.device
        with graph.inserting_before(node):
            state = graph.call_function(capture_rng_state, (device,))
        state.name = f"rng_state_{node.name}"
        fake_mode = getattr(example, "fake_mode", None)
        nbytes = rng_state_nbytes(device)
        if fake_mode is not None:
            with fake_mode:
                state.meta["val"] = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        state.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        node.meta["ckptc_rng_state"] = state
        inserted += 1
    return inserted
