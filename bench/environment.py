"""Where and with what the benchmark ran: code provenance, machine load, Rockmate's status."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import ckptc

ROCKMATE_NOTE = (
    "Rockmate not included. `pip install rockmate==2.0.0` (tried once) installs rockmate 2.0.0 and rkgb 2.0.0 "
    "but pins pulp==2.7.0, downgrading PuLP 3.3.2 below ckptc's requirement pulp>=2.8; after restoring "
    "PuLP 3.3.2, `import rockmate` fails with \"ModuleNotFoundError: No module named 'rkgb.core'\": the "
    "rkgb 2.0.0 wheel on PyPI ships only rkgb/__init__.py and rkgb/rkgb.py, without the rkgb.core and "
    "rkgb.lowlevel subpackages its __init__ imports. It was uninstalled again (with the dependencies it "
    "added); the environment is as before (pip check clean, transformers imports)."
)


def provenance() -> dict[str, Any]:
    """Which code produced the results: the commit (``BENCH_SOURCE_COMMIT`` when run from a
    snapshot of the tree, else ``git rev-parse HEAD``) and where ckptc was imported from."""
    commit = os.environ.get("BENCH_SOURCE_COMMIT")
    dirty = None
    if not commit:
        import subprocess

        root = Path(__file__).resolve().parent.parent
        try:
            commit = (
                subprocess.run(
                    ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
                ).stdout.strip()
                or None
            )
            status = subprocess.run(
                ["git", "status", "--porcelain", "--", "ckptc", "solvers", "bench/*.py"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            dirty = bool(status.strip())
        except (OSError, subprocess.SubprocessError):
            commit = None
    # Relative to the repository: results never record this machine's paths.
    root = Path(__file__).resolve().parent.parent
    package = Path(ckptc.__file__).resolve().parent
    where = str(package.relative_to(root)) if package.is_relative_to(root) else "installed package"
    return {"commit": commit, "code_modified_since_commit": dirty, "ckptc_path": where}


def rockmate_status() -> dict[str, Any]:
    """Whether Rockmate can be used here, checked at run time, with the known reason if not."""
    try:
        importlib.import_module("rockmate")
    except Exception as error:  # noqa: BLE001 - any import failure means "not usable"
        return {"usable": False, "import_error": f"{type(error).__name__}: {error}", "note": ROCKMATE_NOTE}
    return {
        "usable": False,
        "import_error": None,
        "note": "rockmate imports, but this benchmark has no Rockmate runner (the install attempt failed); "
        + ROCKMATE_NOTE,
    }


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
