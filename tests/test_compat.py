"""One compat layer (``ngrpo_lightning/compat/``): every read or write of another library's
internals lives there, one module per library, each naming the versions it was tested on and
failing clearly where an internal is gone; nothing is written on tensors or modules the package
does not own, and no cache lives at module level."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ngrpo_lightning
import ngrpo_lightning.callbacks
from ngrpo_lightning.compat import CompatError, Library, UntestedVersionWarning

ROOT = Path(ngrpo_lightning.__file__).parent
COMPAT = ROOT / "compat"
SOURCES = sorted(
    p
    for top in (ROOT, Path(ngrpo_lightning.callbacks.__file__).parent)
    for p in top.rglob("*.py")
    if COMPAT not in p.parents
)
LIBRARIES = ("torch", "transformers", "peft", "lightning", "mlflow", "vllm", "stdlib")

# Underscored names of other libraries that are their public API, and why.
PUBLIC_UNDERSCORED = {
    "_exit": "os._exit: documented in the os module (exit without cleanup, for a forked child)",
}

# Module-level objects that change after import and are no run's state, and why.
_REGISTRY = "a Registry of named components (registry.py): filled by the register decorators as the classes are defined"
MODULE_LEVEL_OK = {
    ("ngrpo_lightning.backends.base", "BACKENDS"): _REGISTRY,
    ("ngrpo_lightning.backends.speedups", "SPEEDUPS"): _REGISTRY,
    ("ngrpo_lightning.explorers.base", "EXPLORERS"): _REGISTRY,
    ("ngrpo_lightning.objectives.advantages", "ADVANTAGE_ESTIMATORS"): _REGISTRY,
    ("ngrpo_lightning.objectives.base", "OBJECTIVES"): _REGISTRY,
    ("ngrpo_lightning.rollout.engine", "ENGINES"): _REGISTRY,
}


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in SOURCES}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_here(trees) -> set[str]:
    """Every name the package (outside compat/) defines: its functions, classes, variables,
    arguments, attributes it sets on self or cls, and slots."""
    names = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name):
                if n.value.id in ("self", "cls"):
                    names.add(n.attr)
            elif isinstance(n, ast.alias) and n.asname:
                names.add(n.asname)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
                names.update(
                    c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
    return names


def foreign_private_reads() -> list[str]:
    """``x._name``, ``getattr/setattr/hasattr/delattr(x, "_name")`` and imports of ``_private``
    modules where the package does not define ``_name`` itself: another library's internals."""
    trees = _trees()
    ours = _defined_here(trees) | set(PUBLIC_UNDERSCORED)
    found = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            hit = None
            if isinstance(n, ast.Attribute) and _is_private(n.attr) and n.attr not in ours:
                hit = n.attr
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(n.args) > 1
                and isinstance(n.args[1], ast.Constant)
                and isinstance(n.args[1].value, str)
                and _is_private(n.args[1].value)
                and n.args[1].value not in ours
            ):
                hit = n.args[1].value
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                hit = n.module if any(_is_private(part) for part in n.module.split(".")) else None
            elif isinstance(n, ast.Import):
                hit = next((a.name for a in n.names if any(_is_private(p) for p in a.name.split("."))), None)
            if hit:
                found.append(f"{path.relative_to(ROOT.parent)}:{n.lineno}: {hit}")
    return found


def test_no_private_attribute_of_another_library_outside_compat():
    found = foreign_private_reads()
    assert not found, "read another library's internals in ngrpo_lightning/compat/ only:\n" + "\n".join(found)


def _scanning(tmp_path, monkeypatch, source: str) -> None:
    """Have the checks below read one module ``ngrpo_lightning/kept.py`` of ``source``."""
    path = tmp_path / "ngrpo_lightning" / "kept.py"
    path.parent.mkdir()
    path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", [path])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", path.parent)


def test_the_scan_sees_an_internal_read(tmp_path, monkeypatch):
    source = "import os\nfrom torch.utils._python_dispatch import TorchDispatchMode\n\n\nclass A:\n"
    source += "    def f(self, module):\n        self._own = module._parameters, getattr(module, '_buffers')\n"
    source += "        os._exit(self._own)\n"
    _scanning(tmp_path, monkeypatch, source)
    found = [hit.split(": ")[1] for hit in foreign_private_reads()]
    assert sorted(found) == ["_buffers", "_parameters", "torch.utils._python_dispatch"]


def test_nothing_is_written_on_tensors_or_modules_as_an_ngrpo_attribute():
    """State the package derives from another library's objects (a mask's bias, ``sin'``, a
    tensor's recipe) is held by an object of the run, not written on them (``_ngrpo_*``)."""
    pattern = re.compile(r"""[."']_ngrpo""")
    found = [
        f"{path.relative_to(ROOT.parent)}:{i}: {line.strip()}"
        for path in SOURCES
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_what_a_forward_derives_from_transformers_tensors_is_held_by_the_run_not_on_them(tiny):
    """The fused attentions of a model share one memo for ``sin'``; the registered ``sdpa_gqa``
    owns the memo of its masks' biases; nothing is written on ``sin`` or a mask, and nothing is
    kept once the forward's tensors are gone."""
    import copy
    import gc

    from transformers import AttentionInterface

    from ngrpo_lightning.backends import attention
    from ngrpo_lightning.backends.fused import FusedRotaryAttention, fused_modules

    model = copy.deepcopy(tiny[0]).eval()
    fused_modules(model)
    attentions = [m for m in model.modules() if isinstance(m, FusedRotaryAttention)]
    assert len(attentions) == model.config.num_hidden_layers and len({id(m.rotary_memo) for m in attentions}) == 1
    model.set_attn_implementation(attention.register())
    registered = AttentionInterface().get(attention.NAME)
    assert (
        isinstance(registered, attention.SdpaGqaAttention)
        and AttentionInterface().get(attention.register()) is registered
    )
    seen = []
    hook = model.model.rotary_emb.register_forward_hook(lambda module, args, out: seen.append(out))
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=(ids != 0).long())
    hook.remove()
    memo = attentions[0].rotary_memo
    cos, sin = seen.pop()
    assert not vars(sin) and len(memo) == 1  # sin' made once, for the forward's sin
    del cos, sin
    gc.collect()
    assert len(memo) == 0 and len(registered.memo) == 0  # gone with the forward's tensors


_EMPTY = ("dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary", "WeakValueDictionary")
_EMPTY += ("WeakIdKeyDictionary",)
_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "pop", "popitem", "clear", "remove"}
_MUTATORS |= {"discard", "__setitem__"}


def _registry(value: ast.expr) -> bool:
    return isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "Registry"


def _container(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp):
        return True
    return _registry(value) or isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in _EMPTY


def _empty(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict | ast.List | ast.Set):
        return not (value.keys if isinstance(value, ast.Dict) else value.elts)
    return isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in _EMPTY and not value.args


def module_level_caches() -> list[str]:
    """Module-level containers that start empty (a cache's start) or that any function of their
    module changes (item assignment, ``.append``, ``.update``, ...), ``__all__`` aside; and every
    module-level ``Registry``. Those of :data:`MODULE_LEVEL_OK` are allowed, for their reason."""
    found = []
    for path, tree in _trees().items():
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        containers = {}
        for n in tree.body:
            value = n.value if isinstance(n, ast.Assign | ast.AnnAssign) else None
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id != "__all__" and value is not None and _container(value):
                    containers[t.id] = _empty(value) or _registry(value)
        for n in ast.walk(tree):
            changed = None
            if (
                isinstance(n, ast.Subscript)
                and isinstance(n.ctx, ast.Store | ast.Del)
                and isinstance(n.value, ast.Name)
            ):
                changed = n.value.id
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _MUTATORS:
                changed = n.func.value.id if isinstance(n.func.value, ast.Name) else None
            elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id in containers:
                changed = n.target.id
            if changed in containers:
                containers[changed] = True
        found += [
            f"{module}.{name}" for name, hit in containers.items() if hit and (module, name) not in MODULE_LEVEL_OK
        ]
    return found


def test_no_cache_at_module_level():
    """A run's state belongs to the run's objects (an engine, a backend, a recording forward):
    no module-level container that starts empty or is changed after import. Memoized pure
    functions of hashable arguments (``functools.cache``: ``packing.packing_available``,
    ``swap.swapped_class``, ``lora.writes_out_dtype``) hold facts of the build, not of a run."""
    found = module_level_caches()
    assert not found, f"module-level caches (move them into the object that owns them): {found}"
    stale = [key for key in MODULE_LEVEL_OK if key[1] not in vars(importlib.import_module(key[0]))]
    assert not stale, f"allowed names that are gone: {stale}"


def test_the_cache_check_sees_a_cache(tmp_path, monkeypatch):
    _scanning(tmp_path, monkeypatch, "_SEEN = {}\nTABLE = {'a': 1}\nKEPT = {'a': 1}\n\n\ndef f(k):\n    KEPT[k] = 1\n")
    assert module_level_caches() == ["ngrpo_lightning.kept._SEEN", "ngrpo_lightning.kept.KEPT"]


# ------------------------------------------------------------------ the modules
def _compat(name: str):
    if name == "mlflow":
        pytest.importorskip("mlflow")
    return importlib.import_module(f"ngrpo_lightning.compat.{name}")


@pytest.mark.parametrize("name", LIBRARIES)
def test_each_compat_module_states_the_versions_it_was_tested_on(name):
    module = _compat(name)
    assert isinstance(module.TESTED, dict) and module.TESTED
    for distribution, spec in module.TESTED.items():
        assert re.fullmatch(r"[a-z-]+", distribution) and re.match(r"[=<>~]", spec), (distribution, spec)
    assert "tested on" in module.__doc__.splitlines()[0] + module.__doc__.splitlines()[1], module.__doc__[:200]


def test_the_compat_modules_are_the_ones_named():
    assert sorted(p.stem for p in COMPAT.glob("*.py") if p.stem != "__init__") == sorted(LIBRARIES)


def test_a_missing_internal_raises_compat_error_naming_library_and_versions():
    from ngrpo_lightning.compat import torch as torch_compat

    with pytest.raises(CompatError) as err:
        torch_compat.tensor_version(object())  # an object without the attribute
    message = str(err.value)
    assert "torch has no Tensor._version" in message
    assert f"torch {torch_compat.TORCH.version} is installed" in message
    assert f"tested on torch{torch_compat.TESTED['torch']}" in message
    assert isinstance(err.value, RuntimeError) and isinstance(err.value.__cause__, AttributeError)
    with pytest.raises(CompatError, match=r"lightning has no object\._save_topk_checkpoint"):
        _compat("lightning").save_topk(object(), None, {})


def test_a_library_outside_its_tested_versions_warns_once_and_an_absent_one_not_at_all():
    library = Library("torch", {"torch": ">=99"})
    assert library.version == torch.__version__ and not library.is_tested()
    with pytest.warns(UntestedVersionWarning, match=r"torch .* is installed; .* tested on torch>=99"):
        library.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library.warn_if_untested()  # once
        absent = Library("nothing", {"no-such-distribution-here": "==1.0"})
        absent.warn_if_untested()
    assert absent.version is None and "not installed" in str(absent.error("thing"))
