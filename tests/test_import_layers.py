"""The package's imports flow one way (docs/architecture.md): no module imports, directly or
through others, a module that imports it back; and package-internal imports sit at module
level, where a reader sees them (the exceptions are listed, each with its reason)."""

import ast
import os
import tomllib
from pathlib import Path

import ngrpo_lightning
import ngrpo_lightning.callbacks

ROOT = Path(ngrpo_lightning.__file__).parent
CALLBACKS = Path(ngrpo_lightning.callbacks.__file__).parent  # the top-level callbacks/, mapped in by pyproject.toml
REPO = ROOT.parent

# Package-internal imports that stay inside functions, and why.
LAZY_OK = {
    ("ngrpo_lightning.rewards", "ngrpo_lightning.rewards.reward"): "verifier workers must not import torch",
    ("ngrpo_lightning.tracking.logger", "ngrpo_lightning.tracking.system_metrics"): (
        "MLflow is imported only by a run that logs to it: logger=none runs where it is not installed"
    ),
    ("ngrpo_lightning.commands.launch", "ngrpo_lightning.commands.cli"): (
        "OpenMP's settings are in the environment before torch loads"
    ),
    **{
        (
            "ngrpo_lightning.commands.cli",
            f"ngrpo_lightning.{command}",
        ): "help and config errors answer before torch loads"
        for command in (
            "commands.train",
            "commands.eval",
            "checkpoints",
            "checkpoints.export",
            "checkpoints.disk",
            "commands.sweep",
            "commands.compare",
            "commands.compare.command",
            "commands.diagnose",
            "commands.diagnose.command",
            "tracking",
            "tracking.console",
        )
    },
}

# The layers (docs/architecture.md): a module may import its own layer and those below, never above.
LAYERS = {
    "ngrpo_lightning.checks": 0,
    "ngrpo_lightning.registry": 0,
    "ngrpo_lightning.config": 0,
    "ngrpo_lightning.schema": 0,
    "ngrpo_lightning.phases": 0,
    "ngrpo_lightning.compat": 0,  # other libraries' internals: read by every layer above
    "ngrpo_lightning.explorers": 1,
    "ngrpo_lightning.objectives": 1,
    "ngrpo_lightning.data": 1,
    "ngrpo_lightning.rewards": 1,
    "ngrpo_lightning.models": 1,
    "ngrpo_lightning.backends": 1,
    "ngrpo_lightning.rollout": 2,
    "ngrpo_lightning.metrics": 2,
    "ngrpo_lightning.training": 3,
    "ngrpo_lightning.forward": 3,  # a deprecated path of training/forward.py, kept for one release
    "ngrpo_lightning.checkpoints": 3,
    "ngrpo_lightning.tracking": 3,
    "ngrpo_lightning.callbacks": 4,
    "ngrpo_lightning.build": 5,
    "ngrpo_lightning.commands": 6,
}


def layer_of(module: str) -> int | None:
    """The layer of a module: that of the longest entry of :data:`LAYERS` it is or lies in."""
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        if ".".join(parts[:i]) in LAYERS:
            return LAYERS[".".join(parts[:i])]
    return None


def module_name(path: Path, root: Path = ROOT, package: str = "ngrpo_lightning") -> str:
    parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package, the top-level ``callbacks/`` (``ngrpo_lightning.callbacks``) included."""
    found = {}
    for root, package in ((ROOT, "ngrpo_lightning"), (CALLBACKS, "ngrpo_lightning.callbacks")):
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    found[module_name(Path(folder) / f, root, package)] = Path(folder) / f
    return found


def resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    """The package modules an import statement loads (a submodule loads its packages first)."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
    out = []
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            name = ".".join(parts[:i])
            if name in known and not importer.startswith(name + ".") and name != importer:
                out.append(name)
    return out


def import_graph():
    mods = modules()
    known = set(mods)
    edges, lazy = {m: set() for m in mods}, []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                    continue
                targets = resolve(name, path.name == "__init__.py", node, known)
                edges[name].update(targets)
                if targets and id(node) not in top_level and not _in_type_checking(tree, node):
                    lazy += [(name, t) for t in targets]
    return edges, lazy


def _in_type_checking(tree, node) -> bool:
    for block in tree.body:
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            if any(n is node for n in ast.walk(block)):
                return True
    return False


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                return stack[stack.index(t) :] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    edges, _ = import_graph()
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_package_imports_are_at_module_level():
    _, lazy = import_graph()
    unexpected = sorted({pair for pair in lazy if pair[:2] not in LAZY_OK})
    assert not unexpected, f"imports inside functions (move them to the top, or list them with a reason): {unexpected}"


def test_every_module_has_a_layer_and_imports_only_its_own_and_those_below():
    edges, _ = import_graph()
    unplaced = sorted(m for m in edges if m != "ngrpo_lightning" and layer_of(m) is None)
    assert not unplaced, f"modules outside every layer (add them to LAYERS and docs/architecture.md): {unplaced}"
    upward = sorted(
        (m, t, layer_of(m), layer_of(t))
        for m, targets in edges.items()
        for t in targets
        if m != "ngrpo_lightning" and t != "ngrpo_lightning" and layer_of(t) > layer_of(m)
    )
    assert not upward, f"imports from a lower layer up to a higher one: {upward}"


def test_the_architecture_doc_names_every_layer_of_the_test():
    doc = (REPO / "docs" / "architecture.md").read_text()
    for name in LAYERS:
        short = name.removeprefix("ngrpo_lightning.")
        assert f"`{short}/`" in doc or f"`{short}.py`" in doc, short


def test_package_modules_import_the_package_by_its_name():
    """``callbacks/`` installs as ``ngrpo_lightning.callbacks``: an import of a top-level ``callbacks``
    (or ``conf``) works in a checkout's folder only, and is an ImportError everywhere else."""
    wrong = [
        f"{path}:{node.lineno}"
        for path in modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom | ast.Import)
        for name in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
        if name.split(".")[0] in ("callbacks", "conf") and not getattr(node, "level", 0)
    ]
    assert not wrong, wrong


def test_callbacks_are_part_of_the_package():
    assert "ngrpo_lightning.callbacks.replay_buffer" in modules()
    assert CALLBACKS == REPO / "callbacks"


def test_pyproject_installs_every_package_and_the_tree_has_no_links():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {name for name in modules() if (modules()[name].name == "__init__.py")}
    assert packages | {"ngrpo_lightning.conf"} == set(setuptools["packages"])
    assert setuptools["package-dir"] == {"ngrpo_lightning.callbacks": "callbacks", "ngrpo_lightning.conf": "conf"}
    for top in ("ngrpo_lightning", "callbacks", "conf"):
        links = [p for p in (REPO / top).rglob("*") if p.is_symlink()]
        assert not links, f"symbolic links break checkouts on systems without them: {links}"


def test_the_checker_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_run_without_mlflow_imports_everything_it_needs():
    """``logger=none`` needs no MLflow: a machine without it (a GPU image, a cluster node) imports
    the train command, its callbacks and the export without it, and without reasoning-gym."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules.update(mlflow=None, reasoning_gym=None)\n"  # import mlflow -> ModuleNotFoundError
        "import ngrpo_lightning.commands.train, ngrpo_lightning.checkpoints.export, ngrpo_lightning.callbacks\n"
        "import ngrpo_lightning.tracking.logger\n"
        "try:\n    import mlflow\nexcept ImportError:\n    print('without mlflow')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "without mlflow"
