"""The package layout: each folder one layer, imports only go down, no import
cycles, Ray only in the Ray wing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "detached_rl"
BENCHMARKS = PACKAGE.parent / "benchmarks"

# Which layers each layer may import (besides itself). Read top-down: cli may use everything, core nothing.
ALLOWED = {
    "core": set(),
    # Starting a Ray node bound to its address (`detached-rl node`): `ray start` and the bind shim.
    "node": set(),
    "rewards": {"core"},
    "strategies": {"core"},
    "models": {"core"},
    # The weight path: publisher (trainer side), subscriber and receiver (maker and scorer side), the update
    # protocol, its checks and its wire; Ray only in weights.ray_wire.
    "weights": {"core", "models"},
    "generation": {"core", "models", "weights"},
    "algorithms": {"core", "models", "strategies"},
    "scorer": {"core", "models", "weights"},
    "maker": {"core", "models", "weights", "generation", "rewards", "strategies", "scorer"},
    "trainer": {"core", "algorithms", "models", "weights", "strategies"},
    "config": {"core", "algorithms", "models", "weights", "generation", "rewards", "strategies", "scorer",
               "maker", "trainer"},
    "actors": {"core", "algorithms", "models", "weights", "generation", "rewards", "strategies", "scorer",
               "maker", "trainer", "config"},
    "cli": {"core", "algorithms", "models", "weights", "generation", "rewards", "strategies", "scorer",
            "maker", "trainer", "config", "actors", "node"},
    # Migration paths for other systems' users: thin shells over everything below, the
    # CLI's job helpers included.
    "compat": {"core", "algorithms", "models", "weights", "generation", "rewards", "strategies", "scorer",
               "maker", "trainer", "config", "actors", "cli"},
}
# Ray-free layers: everything with logic is a plain class or function, testable without a cluster.
RAY_FREE = {"core", "rewards", "models", "weights", "generation", "algorithms", "scorer", "maker", "trainer",
            "config"}
# The Ray modules of otherwise Ray-free layers.
RAY_WIRES = {"detached_rl.weights.ray_wire"}


def module_name(path: Path) -> str:
    """Dotted module name of a file under the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module this file imports: at the top, inside functions and under `if TYPE_CHECKING` (a type-only
    import is a dependency too; a cycle through one is still a cycle)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def internal_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in files and m != name} for name, path in files.items()}


def layer_of(module: str) -> str | None:
    """The layer (first sub-package) of a module; None for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_belongs_to_a_layer() -> None:
    """No loose modules beside the layers (the package root holds only __init__)."""
    loose = sorted(m for m in internal_graph() if m != "detached_rl" and layer_of(m) is None)
    assert loose == []


def test_layers_import_only_downwards() -> None:
    """Each layer imports only the layers below it (see ALLOWED)."""
    bad = []
    for module, targets in internal_graph().items():
        layer = layer_of(module)
        if layer is None:
            continue
        for target in targets:
            other = layer_of(target)
            if other is not None and other != layer and other not in ALLOWED[layer]:
                bad.append(f"{module} -> {target}")
    assert bad == []


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle found by a depth-first walk of `graph` (module -> the modules it imports)."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                walk(target, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
    return cycles


def test_no_import_cycles() -> None:
    """No module reaches itself through imports (function-level and type-only imports included; sub-package
    `__init__` edges excluded, since importing a.b.c runs a/__init__ and a/b/__init__ without depending on
    them)."""
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in internal_graph().items()}
    assert find_cycles(graph) == []


def test_no_import_cycles_among_benchmarks() -> None:
    """No benchmark script imports one that imports it back (shared parts live in a module of their own)."""
    scripts = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        tree = ast.parse(path.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        graph[name] = {m for m in imported if m in scripts and m != name}
    assert find_cycles(graph) == []


@pytest.mark.parametrize("layer", sorted(RAY_FREE))
def test_plain_layers_do_not_import_ray(layer: str) -> None:
    """Only actors/ and cli/ talk to Ray; the logic below them is testable without a cluster."""
    users = sorted(
        module_name(path) for path in (PACKAGE / layer).rglob("*.py")
        if module_name(path) not in RAY_WIRES
        and any(m == "ray" or m.startswith("ray.") for m in imports_of(path))
    )
    assert users == []


# Who may build or send a weight update: the weights package alone (issue 36).
WEIGHT_PATH_CALLS = ("build_update", "build_weight_update", "dispatch_weight_update", "put_chunk",
                     "send_weight_update")


def test_only_the_weights_package_builds_or_sends_updates() -> None:
    """No module outside `detached_rl/weights/` calls what builds, stores or sends a weight update."""
    callers = []
    for path in PACKAGE.rglob("*.py"):
        if module_name(path).startswith("detached_rl.weights"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in WEIGHT_PATH_CALLS:
                    callers.append(f"{module_name(path)}:{node.lineno} {name}")
    assert callers == []


def test_public_names_keep_working() -> None:
    """The names users rely on (docs/design.md, "Names users rely on") import from the package root."""
    import detached_rl
    from detached_rl import (  # noqa: F401 - importing is the test
        DetachedGRPOTrainer,
        DetachedPPOTrainer,
        Experience,
        ExperienceMakerHolder,
        ReplayBuffer,
        algorithms,
        attach,
        models,
        rewards,
        strategies,
    )

    assert callable(algorithms.policy_loss) and callable(rewards.numeric_answer_reward)
    assert hasattr(strategies, "NaiveStrategy") and hasattr(models, "Actor")
    assert callable(detached_rl.start_trainer_group)


# Ray's private internals: used in one module only (issue 36), so a Ray release is one file to check.
RAY_PRIVATE = ("ray._private", "ray_constants", "_actor_id", "ray._raylet")  # exact names
RAY_SEAM = PACKAGE / "actors" / "ray_seam.py"


def test_ray_internals_only_in_the_seam() -> None:
    """`ray._private`, `ray_constants`, `_actor_id` and `ray._raylet` appear (in code) only in
    actors/ray_seam.py."""
    users = []
    for path in PACKAGE.rglob("*.py"):
        if path == RAY_SEAM:
            continue
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                 for alias in node.names}
        names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        if any(name in RAY_PRIVATE or name.startswith(("ray._private.", "ray._raylet.")) for name in names):
            users.append(module_name(path))
    assert users == []


# What importing an actor shell's module costs: every Ray worker of that role pays it, and so does every
# driver that looks an actor up by name (Ray imports the class's module to make the handle: `detached-rl
# status`, `inspect`, `stop`). A 2-core CI box starts hundreds of them.
SHELL_IMPORTS = """
import sys
import detached_rl.actors.{shell}
heavy = ("transformers", "peft", "loralib", "vllm", "detached_rl.trainer.core",
         "detached_rl.maker.experience_maker")
print(sorted(name for name in heavy if name in sys.modules))
"""


@pytest.mark.parametrize("shell", ["scorer", "maker", "trainer"])
def test_actor_shell_modules_import_no_model_library(shell: str) -> None:
    """transformers, peft and loralib are imported where a model is built, vLLM where an engine starts: a
    driver that asks an actor for its status, or a scorer worker with a Python reward, starts without them."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SHELL_IMPORTS.format(shell=shell)], capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


REFUSAL_IMPORTS = """
import sys
from detached_rl.cli.command_config import refuse_unloadable_models
from detached_rl.config import load_config
try:
    refuse_unloadable_models(load_config(overrides=["model.policy=/nonexistent/model"]))
except ValueError as error:
    print(error)
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


def test_a_model_spec_is_refused_before_torch_is_imported() -> None:
    """`run` checks the model specs and the data before it builds anything: a wrong path is refused in a
    fraction of a second, not after torch and transformers load (7 s on 2 cores)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", REFUSAL_IMPORTS], capture_output=True, text=True, timeout=300,
                         check=True)
    refusal, imported = out.stdout.strip().splitlines()[-2:]
    assert refusal.startswith("model.policy: '/nonexistent/model' is neither"), out.stdout
    assert imported == "[]", out.stdout


# Entries of the package's registries ("package.module:attribute"): imported by name, not by an import line.
REGISTRY_ENTRY = re.compile(r"^(detached_rl(?:\.\w+)+)(?::[\w.]+)?$")


def registry_entries(path: Path) -> set[str]:
    """The modules named by string constants of `path` ("detached_rl.x.y" or "detached_rl.x.y:attr"), and
    the `__main__` of a package so named (`python -m detached_rl.cli`)."""
    named = {match.group(1) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and (match := REGISTRY_ENTRY.match(node.value))}
    return named | {f"{name}.__main__" for name in named}


def test_every_module_is_imported_by_a_test_of_make_test() -> None:
    """No module of the package is left to `make test-e2e` alone: each is imported, directly or through the
    modules they import (registry entries included), by a test module that `make test` runs (not marked
    e2e as a whole)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    tests = [path for path in (PACKAGE.parent / "tests").rglob("*.py")
             if not re.search(r"^pytestmark\s*=.*mark\.e2e", path.read_text(), re.MULTILINE)]
    reached: set[str] = set()
    frontier = {m for path in tests for m in imports_of(path) | registry_entries(path) if m in files}
    while frontier:
        reached |= frontier
        frontier = {m for name in frontier for m in imports_of(files[name]) | registry_entries(files[name])
                    if m in files} - reached
    # a package's __init__ runs whenever one of its modules is imported
    reached |= {name.rsplit(".", depth)[0] for name in reached for depth in range(1, name.count(".") + 1)}
    assert sorted(set(files) - reached) == []
