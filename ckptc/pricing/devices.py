"""What a device's allocator adds to the bytes a step's tensors hold.

The budget is what the device's allocator counts (``torch.cuda.max_memory_allocated``
on CUDA, the CPU allocator's events on CPU).  On CPU that is the tensors'
storage bytes.  PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``)
counts whole blocks instead, and cuBLAS keeps a workspace per handle and stream
allocated through it:

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
* requests up to 1 MiB (``kSmallSize``) come from 2 MiB segments, split at
  512-byte granularity: the block is the rounded size;
* larger requests come from 20 MiB segments (``kLargeBuffer``) below 10 MiB
  (``kMinLargeAlloc``), else from a segment of their size rounded up to 2 MiB
  (``kRoundLarge``); a large-pool block is split only when more than 1 MiB
  would remain, so a request whose 2 MiB rounding leaves at most 1 MiB gets
  (and is counted as) the whole segment;
* each cuBLAS handle (one per thread: the training thread and autograd's
  device thread) keeps a workspace of ``CUBLAS_WORKSPACE_CONFIG``'s size, by
  default 32 MiB on compute capability 9-12 (Hopper, Blackwell) and
  4096 KiB * 2 + 16 KiB * 8 below, and a cuBLASLt workspace (``addmm`` with a
  bias) of ``CUBLASLT_WORKSPACE_SIZE`` KiB, by default 1 MiB: on an H200
  (torch 2.11) the training thread held 32 MiB + 1 MiB, allocated at its first
  product, and autograd's thread 32 MiB (``bench/results/gpu.md``).

Blocks reused from the cache can be larger than a fresh segment's (a freed
12 MiB block serves an 11.5 MiB request whole); :func:`block_bytes` prices the
fresh-segment case, the planning margin allows for the rest
(:data:`CACHE_REUSE_DIVISOR`), and the run-time check measures it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from ckptc._torch_internals import is_flash_attention_backward

log = logging.getLogger("ckptc.pricing.devices")

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
# Threads with their own cuBLAS handle (and workspaces) in a training step: the caller's and autograd's.
CUBLAS_HANDLES_PER_STEP = 2
#: A block served from the caching allocator's cache is split only when more than 1 MiB would remain, so it
#: can count up to 1 MiB more than a fresh segment's, and what is cached depends on the steps before.  On an
#: H200, settled steps peaked up to 1.44% of the activations kept for backward above the block-rounded
#: prediction (Llama, bench size, ``bench/results/gpu.md``): the planning margin allows 1/64 of them more.
CACHE_REUSE_DIVISOR = 64


def round_size(nbytes: int) -> int:
    """The allocator's request size: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def block_bytes(nbytes: int, expandable_segments: bool = False) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request of ``nbytes`` (0 allocates nothing).

    With ``expandable_segments`` every block is split at 512-byte granularity.
    """
    if nbytes <= 0:
        return 0
    size = round_size(nbytes)
    if size < MIN_LARGE_ALLOC or expandable_segments:
        return size  # small pool, or a 20 MiB large segment with far more than 1 MiB left: split
    segment = -(-size // ROUND_LARGE) * ROUND_LARGE
    return segment if segment - size <= SMALL_SIZE else size


def cublas_workspace_bytes(config: str | None = None, capability: tuple[int, int] | None = None) -> int:
    """One cuBLAS handle's workspace: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs, summed
    as ``CublasHandlePool.cpp`` does) or the default for the compute capability (unknown: the larger)."""
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if capability is None or 9 <= capability[0] <= 12:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(config: str | None = None) -> int:
    """One thread's cuBLASLt workspace: ``CUBLASLT_WORKSPACE_SIZE`` (KiB), by default 1 MiB."""
    if config and config.strip().isdigit():
        return int(config) * 1024
    return 1024 * 1024


#: Streaming multiprocessors assumed for a CUDA device this process cannot query (H100 and H200 SXM).
DEFAULT_SM_COUNT = 132


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def flash_attention_backward_workspace(
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    element_size: int,
    *,
    deterministic: bool = False,
    sm_count: int = DEFAULT_SM_COUNT,
) -> list[int]:
    """Bytes of each temporary CUDA's flash-attention backward allocates and frees before returning.

    Shapes are SDPA's ``(batch, heads, seq, head_dim)``.  From ``mha_bwd`` in PyTorch's
    ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``: the row sums of
    ``dout * out`` in fp32 (``softmax_d``, batch x heads x seq rounded to 128), the fp32
    accumulator of the query's gradient (``dq_accum``, batch x seq rounded to 128 x heads x
    head_dim rounded to 32, or to 64 above 128; under deterministic algorithms one per split,
    ``ceil(SMs / (batch * heads))`` of them), and, where the key has fewer heads than the query
    (grouped-query attention), the key's and value's gradients at the query's heads before they
    are summed per group.  The gradients returned are the op's outputs, priced as such.
    """
    batch, heads, seq_q, head_dim = query_shape
    heads_k, seq_k = key_shape[1], key_shape[2]
    head_dim_rounded = _round_up(_round_up(head_dim, 8), 32 if head_dim <= 128 else 64)
    seq_q_rounded = _round_up(seq_q, 128)
    splits = -(-sm_count // max(1, batch * heads)) if deterministic else 1
    sizes = [batch * heads * seq_q_rounded * 4, splits * batch * seq_q_rounded * heads * head_dim_rounded * 4]
    if heads_k != heads:
        sizes += [batch * seq_k * heads * head_dim * element_size] * 2
    return sizes


def kernel_workspace_bytes(
    target: object, shapes: Sequence[tuple[int, ...] | None], element_size: int, device: torch.device
) -> int | None:
    """What ``target`` (an aten op) allocates and frees on ``device`` before returning, as its allocator
    counts it, where the kernel's source says so: the price of a kernel's scratch when it cannot be
    measured (a plan for CUDA made without a GPU).  ``shapes`` are its positional arguments' shapes
    (``None`` for one that is not a tensor), ``element_size`` its first tensor's.  ``None`` for an op
    without such a rule (priced at 0; the run-time check measures it)."""
    if torch.device(device).type != "cuda":
        return None
    if is_flash_attention_backward(target):
        query, key = shapes[1], shapes[2]
        if query is None or key is None or len(query) != 4 or len(key) != 4:
            return None
        sizes = flash_attention_backward_workspace(
            query, key, element_size, deterministic=torch.are_deterministic_algorithms_enabled()
        )
        model = memory_model(device)
        return sum(model.storage_bytes(size) for size in sizes)
    return None


@dataclass(frozen=True)
class MemoryModel:
    """How one device type's allocator counts a step's memory.

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        rounds_blocks: sizes are priced as the allocator's blocks (:func:`block_bytes`).
        step_overhead_bytes: held through every step outside any tensor of the graph
            (cuBLAS workspaces), counted in each graph's baseline.
        cache_reuse_divisor: blocks served from a cache may count above their priced size by up to
            1/``cache_reuse_divisor`` of the activations a plan keeps (0: the allocator has no cache).
    """

    device_type: str
    rounds_blocks: bool = False
    step_overhead_bytes: int = 0
    expandable_segments: bool = False
    cache_reuse_divisor: int = 0

    def storage_bytes(self, nbytes: int) -> int:
        """What one storage of ``nbytes`` costs on this device."""
        return block_bytes(nbytes, self.expandable_segments) if self.rounds_blocks else nbytes

    def rounding_slack(self, largest: int) -> int:
        """The most a storage of up to ``largest`` bytes can cost above its bytes (see :func:`block_bytes`)."""
        if not self.rounds_blocks:
            return 0
        if largest < MIN_LARGE_ALLOC or self.expandable_segments:
            return MIN_BLOCK
        return SMALL_SIZE + MIN_BLOCK


def memory_model(device: torch.device | str) -> MemoryModel:
    """The memory model of the device a plan targets (CUDA: the caching allocator; others: storage bytes)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _storage_bytes_model(device.type)
    return _cuda_model(
        str(device),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        os.environ.get("CUBLASLT_WORKSPACE_SIZE"),
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    )


@functools.lru_cache(maxsize=16)
def _storage_bytes_model(device_type: str) -> MemoryModel:
    # One per device type: resident_bytes asks for every storage it counts.
    return MemoryModel(device_type)


@functools.lru_cache(maxsize=16)
def _cuda_model(device: str, workspace_config: str | None, lt_config: str | None, alloc_conf: str) -> MemoryModel:
    capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
    expandable = bool(re.search(r"expandable_segments\s*:\s*true", alloc_conf, re.IGNORECASE))
    workspace = block_bytes(cublas_workspace_bytes(workspace_config, capability), expandable)
    workspace += block_bytes(cublaslt_workspace_bytes(lt_config), expandable)
    model = MemoryModel("cuda", True, CUBLAS_HANDLES_PER_STEP * workspace, expandable, CACHE_REUSE_DIVISOR)
    log.info("%s memory model: %s", device, model)
    return model


def graph_device(tensors: list[torch.Tensor]) -> torch.device:
    """The device a graph's step runs on: that of its first tensor not on the CPU, else the CPU."""
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")
