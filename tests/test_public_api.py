"""The public API stays stable: every name in tests/public_api.json is still importable from
``ngrpo_lightning`` with a signature that accepts what it accepted (a parameter may be added with a
default, never removed or renamed), and a name that moved keeps its old path for a release with a
DeprecationWarning naming its new home.

After adding a public name: ``python tests/test_public_api.py`` writes the file anew (review the diff:
a removal there is a breaking change, which needs a shim and a CHANGELOG.md entry first)."""

import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

import pytest

import ngrpo_lightning

SNAPSHOT = Path(__file__).with_name("public_api.json")


def signature_of(obj) -> list[dict] | None:
    """The parameters a caller may pass (``__init__``'s for a class): name, kind, has a default."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    return [
        {"name": p.name, "kind": p.kind.name, "default": p.default is not inspect.Parameter.empty}
        for p in params
        if p.name != "self"
    ]


def saved() -> dict:
    """The recorded public names and signatures (empty before the first recording)."""
    return json.loads(SNAPSHOT.read_text()) if SNAPSHOT.is_file() else {}


def snapshot() -> dict:
    return {name: signature_of(getattr(ngrpo_lightning, name)) for name in ngrpo_lightning.__all__}


@pytest.mark.parametrize("name", sorted(saved()))
def test_a_public_name_keeps_working_as_it_did(name):
    recorded = saved()[name]
    assert name in ngrpo_lightning.__all__, f"ngrpo_lightning.{name} left the public API without a shim"
    now = signature_of(getattr(ngrpo_lightning, name))
    if recorded is None or now is None:
        return
    current = {p["name"]: p for p in now}
    catch_all = {p["kind"] for p in now} & {"VAR_KEYWORD"}
    for p in recorded:
        if p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            continue
        assert p["name"] in current or catch_all, f"{name}: parameter {p['name']!r} was removed or renamed"
    for p in now:
        new = p["name"] not in {s["name"] for s in recorded}
        assert not (new and not p["default"] and p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")), (
            f"{name}: new parameter {p['name']!r} has no default: every existing call breaks"
        )


def test_the_snapshot_lists_every_public_name():
    assert sorted(saved()) == sorted(ngrpo_lightning.__all__), (
        "run python tests/test_public_api.py to record the public names"
    )


def test_import_ngrpo_lightning_loads_no_model_library():
    code = "import ngrpo_lightning, sys; print('torch' in sys.modules, 'lightning' in sys.modules)"
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    "old, attribute, new",
    [
        ("ngrpo_lightning.models", "load_policy", "ngrpo_lightning.load_policy"),
        ("ngrpo_lightning.models", "load_tokenizer", "ngrpo_lightning.load_tokenizer"),
        ("ngrpo_lightning.forward", "response_logprobs", "ngrpo_lightning.training.forward"),
    ],
)
def test_a_moved_name_works_for_a_release_and_names_its_new_home(old, attribute, new):
    sys.modules.pop("ngrpo_lightning.forward", None)  # its warning comes at import
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
        found = getattr(module, attribute)
    home = new if new.endswith(attribute) else f"{new}.{attribute}"
    module_name, _, name = home.rpartition(".")
    assert found is getattr(importlib.import_module(module_name), name)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT} ({len(ngrpo_lightning.__all__)} names)")
