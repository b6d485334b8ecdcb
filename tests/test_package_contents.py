"""What a plain `pip install .` ships, checked in seconds: the wheel built from this checkout holds every
module of the package, its package data (the default job's `run.yaml`, the bind shim's C source) and the
`detached-rl` command. `make test-e2e` (tests/test_install.py) installs that wheel into a fresh venv and runs
the main job with it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement

from tests.conftest import ROOT
from tests.test_install import NOT_COPIED

PACKAGE = ROOT / "detached_rl"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel pip builds from a copy of the checkout (its build backend, without its build isolation: the
    venv's setuptools, so no index is needed)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "--wheel-dir", str(work / "dist"), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    (path,) = (work / "dist").glob("detached_rl-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def test_the_wheel_ships_every_module_of_the_package(wheel: zipfile.ZipFile) -> None:
    shipped = set(wheel.namelist())
    modules = {str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")
               if "__pycache__" not in path.parts}
    assert modules and sorted(modules - shipped) == []


def test_the_wheel_ships_the_default_job_config_and_the_bind_shim_source(wheel: zipfile.ZipFile) -> None:
    data = {name for name in wheel.namelist() if not name.endswith(".py") and name.startswith("detached_rl/")}
    expected = {str(path.relative_to(ROOT)) for pattern in ("config/*.yaml", "node/*.c")
                for path in PACKAGE.glob(pattern)}
    assert {"detached_rl/config/run.yaml", "detached_rl/node/bind_shim.c"} <= expected
    assert expected <= data
    for name in expected:  # byte for byte what the checkout holds
        assert wheel.read(name) == (ROOT / name).read_bytes(), name


def test_the_wheel_declares_the_command_and_the_runtime_dependencies(wheel: zipfile.ZipFile) -> None:
    info = next(name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt"))
    assert "detached-rl = detached_rl.cli.main:main" in wheel.read(info).decode()
    metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [Requirement(line.split(":", 1)[1]) for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    names = {requirement.name for requirement in requires
             if requirement.marker is None or "extra" not in str(requirement.marker)}
    # what a plain install needs to run the main job: the trainer, Ray, the models, the plot and TensorBoard
    assert {"torch", "ray", "transformers", "peft", "matplotlib", "tensorboard", "datasets"} <= names, names
