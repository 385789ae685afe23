"""Test isolation: every test starts with Dynamo's caches empty.

Dynamo caches compiled frames per code object (GPT-2's forward, say) across
model instances and stops compiling after a recompile limit; tests that
compile the same model class many times must not see each other's frames.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()
