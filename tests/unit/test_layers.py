"""docs/architecture.md's layer rules, as import contracts (``.importlinter``), one test each.

Each contract test runs import-linter's ``lint-imports`` on one contract and
fails with its report: the contract's name and every import chain that breaks
it. The contracts see the package's static imports; what ``import keras_dist``
and kdrun really import at start-up (the package ``__init__`` runs first for
every module, which a contract cannot see) is checked by running them.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
CONFIG = ROOT / ".importlinter"
PREFIX = "importlinter:contract:"


def _contracts() -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    return [section[len(PREFIX):] for section in parser.sections() if section.startswith(PREFIX)]


def test_the_contracts_are_there():
    assert len(_contracts()) >= 5, f"{CONFIG} holds the contracts {_contracts()}"


@pytest.mark.parametrize("contract", _contracts())
def test_import_contract(contract):
    pytest.importorskip(
        "importlinter", reason="import-linter is not installed (the test extra installs it)")
    # lint-imports sits beside this interpreter in a virtual environment.
    beside = Path(sys.executable).with_name("lint-imports")
    lint = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert lint, "import-linter is installed but its lint-imports command is not found"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [lint, str(CONFIG), "--contract", contract, "--no-cache", "--no-logo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, (
        f"import contract {contract!r} ({CONFIG.name}) is broken:\n"
        f"{result.stdout}{result.stderr}")


FRAMEWORKS = ("tensorflow", "keras", "jax", "torch", "mpi4py.MPI")


@pytest.mark.parametrize("module", ["keras_dist", "keras_dist.run"])
def test_importing_starts_no_framework_and_no_mpi(module):
    """``import keras_dist`` and kdrun start neither a framework nor MPI: a numpy or
    torch user pays no TensorFlow start-up, nor does every kdrun launch."""
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", (
        f"import {module} imported {result.stdout.strip()}")
