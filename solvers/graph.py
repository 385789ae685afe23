"""Graph helpers shared by the solvers: storages and the forward path.

Pure functions over a :class:`~solvers.Problem`'s index arrays, cached on the
problem; no solver reaches into another solver's private functions.
"""

from __future__ import annotations

from solvers.problem import FORWARD_CODE, INPUT_CODE, RECOMPUTE_CODE, SAVE_CODE, Problem

__all__ = ["storage_roots", "forward_path", "keep_all_mask", "COPY_OPS"]


def storage_roots(problem: Problem) -> list[int]:
    """Per node, the node whose storage its bytes are counted in (conservatively).

    A view counts in its alias root's storage. A getitem of a multi-output op
    (``part_of``) is counted in the op's whole storage: the simulator moves
    the getitem's bytes out of the op's storage, so counting the whole op
    while either is alive over-estimates, never under-estimates. O(nodes).

    >>> storage_roots(Problem.training_chain(2))
    [0, 1, 2, 3, 4]
    """
    cached = problem._cache.get("graph.storage_roots")
    if cached is not None:
        return cached
    alias_of, part_of, nbytes = problem._alias_of, problem._part_of, problem._bytes
    roots = list(problem._alias_root)
    for v in range(len(roots)):
        # (a getitem of 0 bytes owns no storage and pins nothing)
        if alias_of[v] < 0 and part_of[v] >= 0 and nbytes[v] > 0:
            roots[v] = roots[part_of[v]]
        elif alias_of[v] >= 0:
            roots[v] = roots[alias_of[v]]
    problem._cache["graph.storage_roots"] = roots
    return roots


def forward_path(problem: Problem) -> list[int]:
    """Forward nodes the forward phase always computes: ancestors-or-self of forward outputs, in order.

    Other forward nodes (transposes of activations that only backward reads,
    which joint graphs count as forward) are computed in forward only if kept.

    >>> forward_path(Problem.training_chain(3))
    [1, 2, 3]
    """
    cached = problem._cache.get("graph.forward_path")
    if cached is not None:
        return cached
    output, fwd_preds = problem._output, problem._fwd_preds
    on_path = bytearray(len(problem.nodes))
    for v in reversed(problem._forward_idx):
        if on_path[v] or output[v]:
            on_path[v] = 1
            for q in fwd_preds[v]:
                on_path[q] = 1
    path = [v for v in problem._forward_idx if on_path[v]]
    problem._cache["graph.forward_path"] = path
    return path


# Ops that only copy their input into new memory. Autograd never saves such a copy
# next to its source (eager PyTorch often skips the copy altogether, e.g. dropout
# with p=0 or a contiguous() of a contiguous tensor); AOTAutograd's decompositions
# make them explicit.
COPY_OPS = frozenset({"clone", "contiguous", "_to_copy", "copy", "lift_fresh_copy", "alias_copy"})


def keep_all_mask(problem: Problem, *, own_checkpoints: bool = False) -> bytearray:
    """Keep every forward value a backward node reads, as eager autograd does.

    Decided per storage (a kept view pins its base): a storage that only
    copies another storage that is kept anyway (or resident) is recomputed
    from it instead, as eager autograd never holds both. Outputs stay alive
    on their own and are not marked. Policies honoured. O(nodes).

    ``own_checkpoints=True`` gives what the model runs by itself: values inside
    its own ``torch.utils.checkpoint`` regions (``Node.checkpointed``) are
    recomputed as written, and what those regions read from outside is kept.
    """
    from solvers.simulator import honour_policies_mask

    if own_checkpoints and any(node.checkpointed for node in problem.nodes):
        return _own_checkpoint_mask(problem)

    mask = bytearray(len(problem.nodes))
    read, output, kind, root = problem._read_by_backward, problem._output, problem._kind, problem._alias_root
    kept_storage = bytearray(len(problem.nodes))
    for v in problem._forward_idx:
        if read[v] and not output[v]:
            mask[v] = 1
            kept_storage[root[v]] = 1
    for v in range(len(problem.nodes)):
        if output[v] or kind[v] == INPUT_CODE:
            kept_storage[root[v]] = 1
    redundant = bytearray(len(problem.nodes))
    for v in problem._forward_idx:
        if kept_storage[v] and root[v] == v:
            source = _copied_kept_value(problem, v, kept_storage)
            if source >= 0:
                redundant[v] = 1
                if kind[source] == FORWARD_CODE and not output[source]:
                    # Materialise the very value the copy reads (free: its storage is kept),
                    # so recomputing the copy starts from it rather than from further back.
                    mask[source] = 1
    for v in problem._forward_idx:
        if mask[v] and redundant[root[v]]:
            mask[v] = 0
    return honour_policies_mask(problem, mask) if any(problem._policy) else mask


def _copied_kept_value(problem: Problem, v: int, kept_storage: bytearray) -> int:
    """The value ``v`` copies when ``v`` is a plain copy of a kept storage, else -1."""
    node = problem.nodes[v]
    if node.op not in COPY_OPS or problem._policy[v] == SAVE_CODE or problem._output[v] or problem._bytes[v] == 0:
        return -1
    preds = problem._fwd_preds[v] or tuple(u for u in problem._preds[v] if problem._kind[u] == INPUT_CODE)
    if len(preds) != 1 or problem._policy[preds[0]] == RECOMPUTE_CODE:
        return -1
    source = problem._alias_root[preds[0]]
    if not kept_storage[source] or problem._bytes[source] < problem._bytes[v]:
        return -1
    return preds[0]


def _own_checkpoint_mask(problem: Problem) -> bytearray:
    """Keep everything backward reads except the values inside checkpointed
    regions and views of them; the values those regions read from outside are
    kept, as ``checkpoint()`` saves its inputs.
    """
    from solvers.simulator import honour_policies_mask

    mask = bytearray(keep_all_mask(problem))
    nodes, root, kind = problem.nodes, problem._alias_root, problem._kind
    inside = bytearray(len(nodes))
    for v in problem._forward_idx:
        if nodes[v].checkpointed or nodes[root[v]].checkpointed:
            inside[v] = 1
            mask[v] = 0
    for v in problem._forward_idx:
        if inside[v]:
            for u in problem._fwd_preds[v]:
                if not inside[u] and kind[u] == FORWARD_CODE and not problem._output[u]:
                    mask[u] = 1
    return honour_policies_mask(problem, mask) if any(problem._policy) else mask
