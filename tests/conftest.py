"""Test isolation: every test starts with Dynamo's caches and the solvers' memoised results empty.

Dynamo caches compiled frames per code object (GPT-2's forward, say) across
model instances and stops compiling after a recompile limit; tests that
compile the same model class many times must not see each other's frames.

One intra-op thread per test process: ``make test`` runs two xdist workers on
two cores, and each worker's default of one OpenMP thread per core put four
busy threads on two cores (the tiny models' ops gain nothing from a second
thread, and idle OpenMP threads spin).  Subprocesses the tests start (the
benchmark, plan files applied in another process) inherit the setting.  An
``OMP_NUM_THREADS`` set by the caller is kept.

The solvers memoise results per problem content (``solvers.problem.clear_shared_caches``):
a test that changes a solver's module constant must not see another test's results.

Each test runs with the heap that imports and earlier tests of its file left frozen (:func:`fresh_dynamo`,
:func:`frozen_heap`):
ckptc collects garbage on some steps (a step's results left in an exception's reference cycles), and a
full collection over the half million objects torch and transformers leave in a test process took 0.3-2.4 s,
about a sixth of the heaviest files' time.  Objects a test makes are collected as usual; what it leaves
to the file's later tests is frozen with the rest until the file ends.

The longest files run first (:func:`pytest_collection_modifyitems`): ``make test`` hands whole files to
its two workers as they finish (``--dist loadfile``), so a long file collected last (they sort late
alphabetically) left one worker idle while the other ran it.
"""

import gc
import os

import pytest
import torch

from solvers.problem import clear_shared_caches

if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# About 150-200 s of CPU each, then 50-100 s (the latest durations run); the other files keep their order.
_LONGEST_FIRST = (
    "test_step_budget.py",
    "test_training_loops.py",
    "test_inductor.py",
    "test_hardening.py",
    "test_routing.py",
    "test_distributed.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    yield
    gc.unfreeze()  # what the file's tests froze and left as garbage goes at the next file's first collection


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    clear_shared_caches()
    gc.collect()
    gc.freeze()
    yield
    torch.compiler.reset()
