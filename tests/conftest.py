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
"""

import os

import pytest
import torch

from solvers.problem import clear_shared_caches

if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    clear_shared_caches()
    yield
    torch.compiler.reset()
