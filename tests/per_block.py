"""Per-block checkpointing as users write it: ``torch.utils.checkpoint`` around every repeated block.

The benchmark's per-block alternative (``bench.alternatives``) and the tests that compare ckptc with it use
these, so both measure the same thing.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint


def _same_class_blocks(container: nn.Module) -> bool:
    children = list(container.children())
    return (
        len(children) >= 2
        and len({type(c) for c in children}) == 1
        and any(True for _ in children[0].parameters())  # blocks, not parameter-free activations
    )


def find_block_containers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], str]:
    """The containers of repeated blocks to checkpoint, and how they were chosen.

    The first ``nn.ModuleList`` whose children share a class (``transformer.h``,
    ``model.layers``, ``blocks``...).  Models without one (Enformer, ResNets
    built from ``nn.Sequential``) fall back to every outermost ``nn.Sequential``
    whose children (with parameters) share a class; nested ones are skipped.
    Returns ``([], reason)`` when there is none.
    """
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and _same_class_blocks(module):
            return [(path, module)], f"first nn.ModuleList of same-class blocks: {path}"
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if type(module) is nn.Sequential and _same_class_blocks(module):
            if not any(path.startswith(p + ".") for p, _ in found):
                found.append((path, module))
    if found:
        return found, (
            "no nn.ModuleList of same-class blocks; outermost nn.Sequential of same-class blocks: "
            + ", ".join(p for p, _ in found)
        )
    return [], "no nn.ModuleList or nn.Sequential whose children are same-class blocks with parameters"


def wrap_blocks(model: nn.Module, every: int = 1) -> tuple[list[str], str]:
    """Checkpoint every ``every``-th repeated block (``use_reentrant=False``), in place.

    Replaces the instance's ``forward`` with one that runs the original under
    :func:`torch.utils.checkpoint.checkpoint`.  Returns the wrapped block paths
    and how the containers were found; an empty list means nothing to wrap.
    """
    containers, how = find_block_containers(model)
    wrapped = []
    for path, container in containers:
        for i, block in enumerate(container.children()):
            if i % every != 0:
                continue
            original = block.forward

            def forward(*args: Any, __original: Callable = original, **kwargs: Any) -> Any:
                return checkpoint(__original, *args, use_reentrant=False, **kwargs)

            block.forward = forward  # type: ignore[method-assign]
            wrapped.append(f"{path}.{i}" if path else str(i))
    return wrapped, how
