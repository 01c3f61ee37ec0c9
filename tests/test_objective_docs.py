"""The example objective of docs/objectives.md, run as written: by hand and for one training step."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "objectives.md"


@pytest.fixture(scope="module")
def example_module(tmp_path_factory):
    """The code block under ``<!-- example: my_objectives.py -->``, importable as ``my_objectives``."""
    text = DOC.read_text()
    match = re.search(r"<!-- example: (\w+)\.py -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/objectives.md lost its example block"
    folder = tmp_path_factory.mktemp("doc_example")
    (folder / f"{match.group(1)}.py").write_text(match.group(2))
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(match.group(1))
    finally:
        sys.path.remove(str(folder))


def test_example_objective_matches_hand_computation(example_module):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0], [-0.5, 0.0]])  # ratios e^0.5 = 1.65 (capped at 1.28), 1, 1
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = example_module.CISPO(clip_high=0.28)(logp, old, None, torch.tensor([1.0, -2.0]), mask)
    assert loss.item() == pytest.approx((1.28 * 1.0 + 1.0 * 2.0 - 2.0 * 0.5) / 3)
    loss.backward()
    assert torch.allclose(
        logp.grad, torch.tensor([[-1.28 / 3, -1 / 3], [2 / 3, 0.0]])
    )  # clipped tokens keep a gradient
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="objective.clip_high"):
        example_module.CISPO(clip_high=-1)


def test_example_objective_trains_one_step_from_the_cli(example_module, tmp_path, monkeypatch, capsys):
    from ngrpo_lightning.commands.cli import main

    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "model=tiny",
        "logger=none",
        "trainer.max_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false",
        "validate_before_fit=false",
        "data.train_size=4",
        "data.val_size=0",
        "data.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        f"objective._target_={example_module.__name__}.CISPO",
        "objective.clip_high=0.3",
    ]
    assert main(args) == 0
    assert "Trained 1 step " in capsys.readouterr().out
