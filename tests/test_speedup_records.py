"""Speed-ups on by default only where a record shows them paying (backends/speedups.py).

The registry names, per device, the record behind each default; the records are data in
``benchmarks/results/records/``. A default without a record that exists, is of that device and
shows the run with the speed-up beating the same run without it fails here."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from ngrpo_lightning.backends import BACKENDS, CPUBackend, CUDABackend
from ngrpo_lightning.backends.speedups import SPEEDUPS

RECORDS = Path(__file__).parents[1] / "benchmarks" / "results" / "records"


def pays(record: dict) -> bool:
    better, worse = (
        (record["with"], record["without"]) if record["lower_is_better"] else (-record["with"], -record["without"])
    )
    return better < worse


def defaults():
    return [(s, device) for s in SPEEDUPS.values() for device in s.evidence]


@pytest.mark.parametrize("speedup, device", defaults(), ids=lambda x: getattr(x, "name", x))
def test_every_default_has_a_record_that_pays(speedup, device):
    path = RECORDS / speedup.evidence[device]
    assert path.is_file(), f"{speedup.name} is on by default on {device}, but its record {path.name} is missing"
    record = json.loads(path.read_text())
    assert record["device"] == device
    assert record["date"] and record["machine"] and record["workload"] and record["metric"]
    if record["question"] == "measured_code":  # the last code measured on the device, with what was in it
        assert speedup.name in record["speedups"]
    else:
        assert record["question"] == "speedup" and record["speedup"] in (speedup.name, *speedup.parts)
    assert pays(record), f"{path.name}: {record['with']} with against {record['without']} without"


def test_records_are_complete_data():
    """Every record names its machine, date and commit field, and a comparison gives both figures."""
    files = sorted(RECORDS.glob("*.json"))
    assert len(files) > 10
    for path in files:
        record = json.loads(path.read_text())
        assert "date" in record and "commit" in record, path.name
        if record.get("question") == "speedup":
            assert isinstance(record["with"], int | float) and isinstance(record["without"], int | float), path.name


def test_backends_apply_only_registered_speedups_of_their_device():
    for cls in {c for c in BACKENDS.values()}:
        for name in cls.speedups:
            assert cls.device_type in SPEEDUPS[name].devices, (cls.__name__, name)


def test_gpu_defaults_are_the_code_measured_on_a_gpu():
    """Until measured on a GPU, what came after the last GPU run is off by default there."""
    gpu = CUDABackend(torch.bfloat16)
    for name in ("whole_step_graphs", "fewer_kernels_per_layer", "joined_reference", "width_buckets", "decoding_copy"):
        assert not gpu.uses(name)
    assert gpu.static_decoding and gpu.decode_graphs == "cuda" and not gpu.decode_whole_steps
    assert gpu.copy_within_share is None and gpu.decode_checks_every == 8
    measured = json.loads((RECORDS / "measured_code-cuda-2026-11-27.json").read_text())["speedups"]
    assert gpu.active <= set(measured)


def test_disable_and_enable_by_name():
    cpu = CPUBackend(disable=["packed_products", "grouped_attention"])
    assert cpu.packing == "off" and cpu.attention == "sdpa" and not cpu.uses("packed_products")
    reasons = {name: (on, why) for name, on, why in cpu.speedup_reasons()}
    assert reasons["packed_products"] == (False, reasons["packed_products"][1])
    assert "backend.disable" in reasons["packed_products"][1]
    assert "measured" in reasons["recompute_activations"][1]
    gpu = CUDABackend(enable=["whole_step_graphs"], disable=["decode_graphs"])
    assert gpu.decode_whole_steps and not gpu.static_decoding and gpu.decode_graphs is None
    with pytest.raises(
        ValueError, match=r"backend\.disable=\['decode_graphs'\]: 'decode_graphs' is not a speed-up of the cpu backend"
    ):
        CPUBackend(disable=["decode_graphs"])
    with pytest.raises(ValueError, match=r"allowed \["):
        CPUBackend(enable=["packing"])


def test_old_backend_names_warn_and_mean_the_same():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = BACKENDS["cuda_eager"](torch.float32)
    assert any("backend.disable=[decode_graphs]" in str(w.message) for w in caught)
    assert not eager.static_decoding and eager.decode_graphs is None
    assert not BACKENDS["cuda_model_step"](torch.float32).decode_whole_steps


def test_docs_measurements_is_the_records_rendered():
    """docs/measurements.md is generated from the records by benchmarks/render.py, never edited by hand."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    render = [sys.executable, str(root / "benchmarks" / "render.py"), "--check", str(root / "docs" / "measurements.md")]
    proc = subprocess.run(render, capture_output=True, text=True)
    assert proc.returncode == 0, "docs/measurements.md is stale: python benchmarks/render.py > docs/measurements.md"
