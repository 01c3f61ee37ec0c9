"""The frozen reference kept in a file between passes: same log-probs, memory only while it runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from ngrpo_lightning.backends import file_weights
from ngrpo_lightning.models.loading import load_policy

pytestmark = pytest.mark.skipif(not hasattr(os, "preadv"), reason="os.preadv is POSIX-only")


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_file_backed_copy_computes_what_the_model_does(tmp_path):
    policy, _ = load_policy("tiny")
    ids = torch.randint(0, policy.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = logits(policy, ids)
    frozen = file_weights.frozen_copy_to_file(policy, tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing is left behind
    assert all(not p.requires_grad for p in frozen.parameters())
    file_weights.release(frozen)
    with pytest.raises(RuntimeError, match="materialized"):
        logits(frozen, ids)  # released: the placeholders refuse to run
    for _ in range(2):  # read back twice: the file stays usable
        with file_weights.materialized(frozen):
            assert torch.equal(logits(frozen, ids), expected)
    # the policy trains on; the copy keeps the initial weights
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    with file_weights.materialized(frozen):
        assert torch.equal(logits(frozen, ids), expected)
        names = dict(frozen.named_parameters())
        assert names.keys() == dict(policy.named_parameters()).keys()


def test_tied_weights_stay_tied(tmp_path):
    policy, _ = load_policy("tiny")
    policy.config.tie_word_embeddings = True
    policy.tie_weights()
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    frozen = file_weights.frozen_copy_to_file(policy, tmp_path)
    file_weights.release(frozen)
    with file_weights.materialized(frozen):
        assert frozen.lm_head.weight is frozen.model.embed_tokens.weight
        assert torch.equal(frozen.lm_head.weight, policy.lm_head.weight)
    assert frozen.lm_head.weight.stride() == (0, 0)  # released again: a one-element placeholder


@pytest.mark.parametrize(
    "choice, accelerator, sharded, expected",
    [
        ("auto", "cpu", False, "file" if sys.platform == "linux" else "memory"),
        ("auto", "cpu", True, "memory"),
        ("auto", "gpu", False, "memory"),
        ("memory", "cpu", False, "memory"),
        ("file", "cpu", False, "file"),
    ],
)
def test_where_the_reference_lives(choice, accelerator, sharded, expected):
    assert file_weights.resolve(choice, accelerator, sharded) == expected


def test_file_is_refused_on_a_gpu():
    with pytest.raises(ValueError, match="model.reference_weights=file .*trainer.accelerator=gpu"):
        file_weights.resolve("file", "gpu", False)


def test_auto_keeps_the_weights_in_memory_on_a_ram_backed_folder(tmp_path):
    ram = next(
        (Path(p) for p in ("/dev/shm", "/run/user", "/tmp") if file_weights.filesystem_type(p) in ("tmpfs", "ramfs")),
        None,
    )
    if ram is None:
        pytest.skip("no tmpfs mount on this machine")
    assert file_weights.resolve("auto", "cpu", False, ram / "not-yet-created" / "outputs") == "memory"
    if file_weights.filesystem_type(tmp_path) not in ("tmpfs", "ramfs"):
        assert file_weights.resolve("auto", "cpu", False, tmp_path) == ("file" if sys.platform == "linux" else "memory")


def test_a_folder_that_cannot_be_written_names_the_way_out(tmp_path):
    policy, _ = load_policy("tiny")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="free space there or set output_dir to a folder with room") as err:
        file_weights.frozen_copy_to_file(policy, blocker / "outputs")
    assert "reference_weights" not in str(err.value)  # no advice to set a key the config no longer has


def test_the_backend_decides_where_the_reference_lives(tmp_path):
    """``model.reference_weights`` is gone: the CPU backend keeps the reference in a file on a
    one-process Linux run whose output_dir is on a disk (``resolve("auto", ...)``), other backends
    in memory."""
    from ngrpo_lightning.backends import CPUBackend, CUDABackend

    cpu = CPUBackend(packing="off")
    assert cpu.reference_in_file(tmp_path, sharded=False) == (
        file_weights.resolve("auto", "cpu", False, tmp_path) == "file"
    )
    assert cpu.reference_in_file(tmp_path, sharded=True) is False
    assert CUDABackend().reference_in_file(tmp_path, sharded=False) is False
