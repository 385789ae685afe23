"""Architecture boundaries, checked on the source text (no model runs here).

* Every private PyTorch API that ckptc uses lives in ``ckptc/_torch_internals.py``:
  no other ``ckptc/*.py`` imports or spells a private torch name.
* ``solvers/`` never imports torch (checked by importing it in a fresh
  interpreter in ``tests/test_solvers_core.py``; here on the source, so a lazy
  import inside a function is caught too).
* ``tests/`` never imports ``bench`` (the model zoo lives in ``tests/``; the
  benchmark may import from the tests, not the other way round).
* The modules of ``ckptc/`` import each other without a circle, counting
  top-level, in-function and ``TYPE_CHECKING`` imports alike: every module has
  a floor, and imports only from below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent

# Private torch attributes reached through objects rather than dotted names
# (``prof.profiler.kineto_results``, ``op._schema``, ``op._opname``, AOTAutograd's ``fn._boxed_call``,
# ``nn.Module``'s registries), also when spelled as a string (``getattr(op, "_opname")``).
PRIVATE_TORCH_ATTRIBUTES = frozenset(
    {"kineto_results", "_schema", "_opname", "_overloadname", "_boxed_call", "_parameters", "_buffers", "_modules"}
)


def _is_private(component: str) -> bool:
    """``_ops``, ``_pytree`` are private; dunders (``__version__``) are not."""
    return component.startswith("_") and not (component.startswith("__") and component.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    """``torch.utils._pytree.tree_map`` as its components, or None for anything but a name chain."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def private_torch_uses(source: str, filename: str = "<string>") -> list[str]:
    """Every import or attribute access of a private torch name in ``source``, as ``"line: name"``.

    A name is private if a component of its dotted path under ``torch`` starts
    with an underscore (``torch._ops``, ``torch.utils._pytree``, ``from torch
    import _dynamo``), or if it is one of :data:`PRIVATE_TORCH_ATTRIBUTES`.
    Aliases are followed: after ``import torch.fx as fx``, ``fx._x`` is
    ``torch.fx._x``.
    """
    tree = ast.parse(source, filename)
    aliases: dict[str, list[str]] = {}  # local name -> dotted torch path it stands for
    found: list[str] = []

    def report(node: ast.AST, parts: list[str]) -> None:
        found.append(f"{filename}:{node.lineno}: {'.'.join(parts)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch":
                    if any(_is_private(p) for p in parts):
                        report(node, parts)
                    aliases[alias.asname or parts[0]] = parts if alias.asname else ["torch"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module.split(".")
            if base[0] != "torch":
                continue
            for alias in node.names:
                parts = [*base, alias.name]
                if any(_is_private(p) for p in parts) or alias.name in PRIVATE_TORCH_ATTRIBUTES:
                    report(node, parts)
                aliases[alias.asname or alias.name] = parts
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in PRIVATE_TORCH_ATTRIBUTES
        ):
            report(node, [node.args[1].value])
        if isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_TORCH_ATTRIBUTES:
                report(node, [node.attr])
                continue
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                full = [*aliases[parts[0]], *parts[1:]]
                if any(_is_private(p) for p in full):
                    report(node, full)
    # torch._ops.OpOverload is also reported as its prefix torch._ops: both name the same place
    return sorted(set(found))


def _imports(source: str, filename: str) -> set[str]:
    """Top-level package names imported anywhere in ``source`` (function bodies included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


def _sources(folder: str) -> list[Path]:
    paths = sorted((REPO / folder).rglob("*.py"))
    assert paths, f"no sources under {folder}/"
    return paths


def test_private_torch_apis_live_only_in_torch_internals():
    offenders = []
    for path in _sources("ckptc"):
        if path.name == "_torch_internals.py":
            continue
        offenders += private_torch_uses(path.read_text(), str(path.relative_to(REPO)))
    assert not offenders, (
        "private PyTorch APIs outside ckptc/_torch_internals.py; add a named helper there and call it:\n"
        + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\ntorch._ops.OpOverload", ["torch._ops"]),
        ("import torch\nx = torch.utils._pytree.tree_map", ["torch.utils._pytree"]),
        ("from torch.utils._pytree import tree_flatten", ["torch.utils._pytree.tree_flatten"]),
        ("from torch import _dynamo", ["torch._dynamo"]),
        ("import torch._dynamo", ["torch._dynamo"]),
        ("import torch.fx as fx\nfx._symbolic_trace", ["torch.fx._symbolic_trace"]),
        ("import torch as t\nt._C", ["torch._C"]),
        ("prof.profiler.kineto_results.events()", ["kineto_results"]),
        ("op._schema.is_mutable", ["_schema"]),
        ('str(getattr(node.target, "_opname", node.target))', ["_opname"]),
        ("forward._boxed_call = True", ["_boxed_call"]),
        ("self._parameters = model._parameters", ["_parameters"]),
        ("import torch\ntorch.__version__\ntorch.fx.node.map_arg\nself._cache", []),
        ("from torch.multiprocessing.reductions import StorageWeakRef", []),
    ],
)
def test_private_name_scanner(source, expected):
    """The scanner itself: it catches each form of private access and lets public names through."""
    found = private_torch_uses(source)
    assert len(found) >= len(expected) and all(any(e in f for f in found) for e in expected), found
    if not expected:
        assert found == []


def test_solvers_never_import_torch():
    offenders = {
        str(path.relative_to(REPO)): bad
        for path in _sources("solvers")
        if (bad := _imports(path.read_text(), str(path)) & {"torch", "ckptc"})
    }
    assert not offenders, f"solvers/ must stay torch-free (it is used without torch): {offenders}"


def test_tests_never_import_bench():
    offenders = {
        str(path.relative_to(REPO)): "bench"
        for path in _sources("tests")
        if "bench" in _imports(path.read_text(), str(path))
    }
    assert not offenders, (
        f"tests import the benchmark: {sorted(offenders)}; models the tests need belong in tests/zoo.py "
        "(bench may import from tests, not the other way round)"
    )


def ckptc_imports(source: str, module: str, modules: set[str]) -> set[str]:
    """The ``ckptc`` modules that ``source`` (the module ``module``, dotted below ``ckptc``, such as
    ``planning.planner``) imports, anywhere in it: top level, inside functions and under ``TYPE_CHECKING``
    alike.  Names are dotted below ``ckptc`` too; a name that is not a module (a function) is not an edge."""
    package = module.rpartition(".")[0]
    found: set[str] = set()

    def imported_from(base: str, names: list[str]) -> None:
        for name in names:  # from ckptc.pricing import costs: the module pricing.costs
            dotted = f"{base}.{name}" if base else name
            found.add(dotted if dotted in modules else base)

    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ckptc.") for a in node.names if a.name.startswith("ckptc.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ckptc" or node.module.startswith("ckptc."):
                imported_from(node.module.removeprefix("ckptc").removeprefix("."), [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom):  # relative: from .planner import decide, from .. import meter
            parts = package.split(".") if package else []
            parts = parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else [])
            imported_from(".".join(parts), [a.name for a in node.names])
    return (found & modules) - {module}


def test_ckptc_import_scanner():
    """The scanner itself: every form of import is an edge, lazy and TYPE_CHECKING ones included."""
    source = (
        "import ckptc.pricing.costs\nfrom ckptc import _torch_internals as internals\n"
        "from ckptc.planning.planner import decide\nfrom ckptc.capture import rng\n"
        "if TYPE_CHECKING:\n    from ckptc.plans import ModelPlan\n"
        "def f():\n    from .devices import x\n    from .. import meter\n    import torch, solvers\n"
    )
    names = {"pricing.costs", "_torch_internals", "planning.planner", "plans", "capture.rng", "meter"}
    names |= {"pricing.devices", "pricing.problem", "api"}
    imported = names - {"api", "pricing.problem"}
    assert ckptc_imports(source, "pricing.problem", names) == imported


def _ckptc_modules() -> dict[str, Path]:
    """Every module of ``ckptc/`` by its dotted name below ``ckptc`` (``meter``, ``planning.planner``)."""
    root = REPO / "ckptc"
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            paths[".".join(parts)] = path
    return paths


def test_ckptc_imports_form_no_circle():
    """No import circle in ckptc/: each module has a floor and imports only from floors below it."""
    paths = _ckptc_modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for module, path in paths.items():
        graph.add_edges_from((module, imported) for imported in ckptc_imports(path.read_text(), module, set(paths)))
    cycles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    cycle = [a for a, _ in nx.find_cycle(graph.subgraph(cycles[0]))] if cycles else []
    assert not cycles, (
        f"import circles in ckptc/ among {[sorted(c) for c in cycles]}; one of them: "
        f"{' -> '.join([*cycle, cycle[0]])}. Move what both sides need to "
        "the lower module (or ckptc/records.py) instead of importing upward, lazily or under TYPE_CHECKING."
    )
