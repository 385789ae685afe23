"""Planning a model that does not fit here: capture a step under fake tensors.

A model built on the ``meta`` device (``with torch.device("meta"):``,
accelerate's ``init_empty_weights``) or under ``FakeTensorMode`` has shapes and
dtypes but no storage.  :func:`offline_step` captures its training step as if
it lived on a real device: every parameter, buffer and input is replaced, for
the capture only, by a fake tensor of the same shape, strides and dtype on the
target device (``cpu`` unless told otherwise), so autocast, kernel choice and
the captured aten ops are those of that device and the plan applies to the same
model with real weights there.  No weight or activation is allocated; the model is left as it
was (its parameters and buffers are put back, meta or fake as they were).

Kernels' scratch memory is measured as for a real capture, by running each
distinct op once on random data (:func:`ckptc.pricing.costs.measure_scratch`):
an op larger than :data:`~ckptc.pricing.costs.FULL_SIZE_SCRATCH_BYTES` runs
with its largest sizes shrunk and its scratch scaled up, so nothing runs at full
size.  On a device this process cannot reach (a plan for CUDA made without a
GPU) scratch is priced at 0 bytes; the run-time check measures what that leaves
out on the first training step.  Measured run times (``measure_time``) are not
known offline.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch

from ckptc._torch_internals import fake_tensor_mode, is_storeless, tensor_registries, tree_map
from ckptc.errors import InvalidArgumentError, UntraceableModelError

log = logging.getLogger("ckptc.capture.offline")


def offline_device(
    model: torch.nn.Module, example_inputs: Sequence[Any], example_kwargs: dict[str, Any] | None, device: Any
) -> torch.device | None:
    """The device an offline capture plans for, or None when the step can run here as it is.

    A capture is offline when ``device`` is given, or when the model or its
    inputs hold meta or fake tensors; it then plans for ``device``, else for
    the real device of the fake tensors, else ``cpu``.

    Raises:
        InvalidArgumentError: ``device`` is not a device, or not a CPU or CUDA device (or a CPU index
            other than 0).
        UntraceableModelError: ``device`` is ``meta`` (no kernels there to plan
            for), or a CUDA device on a torch build without CUDA.
    """
    tensors = [
        t
        for t in (*model.parameters(), *model.buffers(), *_leaves((example_inputs, example_kwargs or {})))
        if isinstance(t, torch.Tensor)
    ]
    storeless = [t for t in tensors if is_storeless(t)]
    if device is None and not storeless:
        return None
    if device is None:
        real = [t.device for t in storeless if t.device.type != "meta"]
        device = real[0] if real else torch.device("cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidArgumentError(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r} ({error})"
        ) from None
    if target.type not in ("cpu", "cuda", "meta"):
        raise InvalidArgumentError(
            f"ckptc plans offline for 'cpu' or 'cuda' devices, got {str(target)!r}: its memory model (allocator, "
            "kernel workspaces) covers those two.\nWhat to do: plan for device='cpu' or 'cuda', or plan on the "
            f"{target.type} machine itself with the model's real weights there."
        )
    if target.type == "cpu" and target.index not in (None, 0):
        raise InvalidArgumentError(
            f"device {str(target)!r}: PyTorch has one CPU device, 'cpu' (an index other than 0 fails in every "
            "kernel).\nWhat to do: plan for device='cpu'."
        )
    if target.type == "meta":
        raise UntraceableModelError(
            "ckptc cannot plan for the 'meta' device: it has no kernels, so there is no memory to plan "
            "(transformers' rotary embedding, for one, enters torch.autocast(device_type='meta'), which fails).\n"
            "What to do: keep the model on meta and give the device the plan is for: "
            "ckptc.plan(model, inputs, budget_gb=..., device='cpu') (or 'cuda' on a CUDA build of torch); "
            "from the CLI, `ckptc plan FACTORY --device cpu`."
        )
    if target.type == "cuda" and not torch.backends.cuda.is_built():
        raise UntraceableModelError(
            f"ckptc cannot plan for {target} with this torch build ({torch.__version__}, no CUDA): CUDA kernels "
            "(flash attention, cuBLAS) choose their variant and saved tensors through the CUDA runtime, even on "
            "fake tensors.\nWhat to do: plan on a machine with a CUDA build of torch, or plan for device='cpu' here."
        )
    return target


@contextlib.contextmanager
def offline_step(
    model: torch.nn.Module, example_inputs: Sequence[Any], example_kwargs: dict[str, Any] | None, device: torch.device
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Inside: ``model`` holds fake parameters and buffers on ``device`` and a fake-tensor mode is active;
    yields the example inputs as fake tensors there.  Afterwards the model's own tensors are back."""
    mode, enter = fake_tensor_mode()
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    made: dict[int, Any] = {}  # tied weights stay tied
    with mode if enter else contextlib.nullcontext():

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) not in made:
                new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                if isinstance(t, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                made[id(t)] = new
            return made[id(t)]

        try:
            for module in model.modules():
                for registry in tensor_registries(module):
                    for name, t in list(registry.items()):
                        if t is not None:
                            swapped.append((registry, name, t))
                            registry[name] = fake(t)
            inputs = tuple(tree_map(fake, list(example_inputs)))
            kwargs = tree_map(fake, dict(example_kwargs or {}))
            log.info(
                "offline capture of %s for %s under fake tensors: no weight or activation is allocated",
                type(model).__name__,
                device,
            )
            yield inputs, kwargs
        finally:
            for registry, name, t in reversed(swapped):
                registry[name] = t


def _leaves(tree: Any) -> list[Any]:
    from ckptc._torch_internals import tree_leaves

    return tree_leaves(tree)
