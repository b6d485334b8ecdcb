"""Shared fixtures: the device the tests run on (`--device`), the local Ray cluster the test modules that ask
for it share, and the session's tiny `run`."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests import helpers
from tests.shared_cluster import SharedCluster

ROOT = Path(__file__).resolve().parents[1]

# Set to a fresh value in the environment of every Ray cluster or job a test starts: their processes (GCS,
# raylet, workers, client servers) inherit it, so a test counts and ends only its own, never another
# cluster's on the same machine (a CI box may run several).
CLUSTER_MARKER = "DETACHED_RL_TEST_CLUSTER"

# Keep Ray quiet and self-contained: no token auth prompts from a stray ~/.ray/auth_token,
# no dashboard, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # lets a local cluster bind to 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEVICE_OPTION = "--device"


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--device cpu|cuda|cuda:N`: where the non-Ray tests put their models and data, and whether Ray test
    actors ask for GPUs."""
    parser.addoption(DEVICE_OPTION, default="cpu", metavar="cpu|cuda|cuda:N",
                     help="device of the tests' models and data (default cpu; cuda runs the GPU lane, "
                          "`make test-gpu`)")


def parse_test_device(value: str) -> torch.device:
    """The device `--device value` names, refused with a message unless it is cpu,
    cuda or cuda:N and present."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise pytest.UsageError(f"{DEVICE_OPTION} {value!r}: the tests run on 'cpu', 'cuda' or 'cuda:N' only")
    device = torch.device(value)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise pytest.UsageError(f"{DEVICE_OPTION} {value!r}: torch.cuda.is_available() is false "
                                f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise pytest.UsageError(f"{DEVICE_OPTION} {value!r}: only {torch.cuda.device_count()} CUDA "
                                "device(s) here")
    # With the index: a parameter moved to "cuda" reports cuda:0, and torch.device("cuda") != cuda:0.
    return torch.device("cuda", index)


def pytest_configure(config: pytest.Config) -> None:
    """Check `--device` and hand it to the test builders in `tests.helpers`; under pytest-xdist, give each
    worker its share of the cores for torch's threads (more threads than cores spin and wait for each
    other)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    device = parse_test_device(config.getoption(DEVICE_OPTION))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # library code that picks `default_device()` picks this one too
    helpers.set_lane_device(device)


# Fixtures that start a Ray cluster: a test that uses one (directly or through another fixture) is a Ray test,
# marked `ray` whether or not its module says so (`make test-fast` leaves them out).
RAY_FIXTURES = frozenset({"ray_cluster", "gpu_cluster"})


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark `ray` a test on a Ray cluster fixture."""
    if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("ray") is None:
        item.add_marker(pytest.mark.ray)


# The longest modules first (a module ranks by its test that ranks first; stable otherwise): under
# pytest-xdist (`make test-fast`, `make test TEST_WORKERS=N`: `--dist loadfile --no-loadscope-reorder`) a
# worker that takes a long module early leaves the short ones to fill the other workers' time, instead of
# one long module running alone at the end.
RUN_FIRST = ("multihost", "install", "slow", "ray")


def run_order(item: pytest.Item) -> int:
    """The class of `item` in `RUN_FIRST` (its first marker there), or after all of them."""
    return next((rank for rank, mark in enumerate(RUN_FIRST) if item.get_closest_marker(mark) is not None),
                len(RUN_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests longest class first (`RUN_FIRST`); skip the tests marked `gpu` unless this run is on
    CUDA (`--device cuda`)."""
    # by module: a module's tests stay together (its module-scoped fixtures are set up once)
    ranks: dict[Path, int] = {}
    for item in items:
        ranks[item.path] = min(ranks.get(item.path, len(RUN_FIRST)), run_order(item))
    _SHARING_MODULES.update(item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ()))
    # the modules sharing the Ray cluster one after another: it starts once
    items.sort(key=lambda item: (ranks[item.path], item.path not in _SHARING_MODULES))
    if helpers.lane_device().type == "cuda":
        return
    skip = pytest.mark.skip(reason="needs CUDA: runs with --device cuda (make test-gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    """Name the lane in pytest's header."""
    return f"test device: {helpers.lane_device()}"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device this run puts the non-Ray tests' models and data on (`--device`, default cpu)."""
    return helpers.lane_device()


def new_cluster_marker() -> str:
    """A value for `CLUSTER_MARKER` that no other cluster on this machine carries."""
    return uuid.uuid4().hex


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes (other than this one) whose environment has `CLUSTER_MARKER=marker`."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(CLUSTER_MARKER) == marker:
                found.append(proc)
    return found


def stop_marked(marker: str, grace: float = 15.0, rounds: int = 3) -> None:
    """Terminate, then kill, every process carrying `marker` and their descendants, the GCS last; scan again,
    since a dying raylet may have started a fresh worker meanwhile."""
    for _ in range(rounds):
        processes = marked_processes(marker)
        if not processes:
            return
        # Ray's agents do not inherit the marker (the raylet starts them with an environment of its own).
        for proc in list(processes):
            with contextlib.suppress(psutil.Error):
                processes.extend(child for child in proc.children(recursive=True) if child not in processes)
        # A GCS terminated beside its raylet lingers until killed (the grace); after it, it exits in ~2 s.
        last = [proc for proc in processes if _name(proc) == "gcs_server"]
        for wave in ([proc for proc in processes if proc not in last], last):
            _end(wave, grace)


def _name(proc: psutil.Process) -> str:
    """The process's name, or "" once it is gone."""
    with contextlib.suppress(psutil.Error):
        return proc.name()
    return ""


def _end(processes: list[psutil.Process], grace: float) -> None:
    """Terminate `processes`; kill those still alive after `grace` s."""
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's one tiny `detached-rl run` (tests/tiny_run.py), started when a test first reads it."""
    from tests.tiny_run import run_tiny_job

    return run_tiny_job(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def cluster_marker() -> str:
    """A fresh `CLUSTER_MARKER` value for the cluster this module starts."""
    return new_cluster_marker()


SHARED = SharedCluster(ROOT, CLUSTER_MARKER, new_cluster_marker)
_SHARING_MODULES: set[Path] = set()  # the collected modules with a test on `ray_cluster`
_SERVED_MODULES: set[Path] = set()  # the modules `ray_cluster` was handed to


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Any:
    """The `ray` module connected to the local Ray cluster the modules that ask for it share
    (tests/shared_cluster.py): cleared of what the module before left, bound to loopback, its processes
    carrying `ray_cluster_marker`."""
    _SERVED_MODULES.add(request.path)
    return SHARED.acquire()


@pytest.fixture
def ray_cluster_marker(ray_cluster: Any) -> str:
    """The `CLUSTER_MARKER` value of `ray_cluster`'s processes."""
    assert SHARED.marker is not None
    return SHARED.marker


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """End the shared cluster before a test that does not ask for it (it may start its own driver, or check
    that none runs); start it again for a test of a module it was handed to (that module's fixture holds the
    `ray` module, not the connection)."""
    if "ray_cluster" not in getattr(item, "fixturenames", ()):
        SHARED.end()
    elif not SHARED.running and item.path in _SERVED_MODULES:
        SHARED.acquire()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End the shared cluster with the session."""
    SHARED.end()
