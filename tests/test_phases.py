"""A training step's named phases (ngrpo_lightning/phases.py): timed, reported to Lightning's
profiler, ranges in torch.profiler's trace, and read back per phase by benchmarks/step_profile.py."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import ScriptedReward, tiny_rl, tiny_trainer
from lightning.pytorch.profilers import SimpleProfiler
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from ngrpo_lightning.phases import PHASES, phase

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import step_profile  # noqa: E402


def test_a_phase_times_its_block_and_names_it_for_both_profilers():
    lightning_profiler = SimpleProfiler()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("update", torch.device("cpu"), lightning_profiler) as timed:
            torch.ones(256, 256) @ torch.ones(256, 256)
    assert timed.seconds > 0
    assert len(lightning_profiler.recorded_durations["ngrpo/update"]) == 1
    report = step_profile.phase_report(prof.events())
    assert list(report) == ["update"]
    assert report["update"]["calls"] == 1 and report["update"]["host_s"] > 0
    assert "aten::mm" in [name for name, _, _ in report["update"]["top_host_ops"]]
    assert report["update"]["kernels"] == 0 and report["update"]["device_s"] == 0  # a CPU has no kernels


def test_a_phase_report_on_a_cpu_gives_its_products_time_and_rate():
    a, b, c = torch.randn(64, 96), torch.randn(96, 128), torch.randn(8, 64, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with phase("update", torch.device("cpu")):
            a @ b  # 2 x 64 x 96 x 128 FLOPs
            torch.randn(64, 128).addmm_(a, b)  # as many as the first
            torch.bmm(c, c.transpose(1, 2))  # attention's kind of product: not a linear layer's
            torch.relu(a)
    update = step_profile.phase_report(prof.events())["update"]
    mm = [e for e in prof.events() if e.name in step_profile.PRODUCTS]
    assert len(mm) == 2 and update["products_s"] == pytest.approx(sum(e.self_cpu_time_total for e in mm) / 1e6)
    assert update["products_gflops"] == pytest.approx(2 * (2 * 64 * 96 * 128) / update["products_s"] / 1e9)
    row = step_profile.phase_rows({}, {"update": update})[0]
    assert row["products_s"] == round(update["products_s"], 3) and row["products_gflops"] is not None


def test_product_flops_reads_each_products_operands():
    assert step_profile.product_flops("aten::mm", [[4, 5], [5, 6]]) == 2 * 4 * 5 * 6
    assert step_profile.product_flops("aten::addmm_", [[4, 6], [4, 5], [5, 6], [], []]) == 2 * 4 * 5 * 6
    linear = step_profile.product_flops("mkldnn::_linear_pointwise", [[32, 1, 576], [1536, 576], []])
    assert linear == 2 * 32 * 576 * 1536  # oneDNN's: x [..., K] times weight [N, K]
    assert step_profile.product_flops("aten::mm", []) == 0  # shapes not recorded


def test_a_phase_report_owns_the_device_work_that_starts_inside_it():
    """What a GPU trace holds and no operation of the range launched: a CUDA graph's replayed
    kernels (linked to no operation) and the backward's, launched from autograd's own thread.
    Each belongs to the innermost phase whose time range holds its start. The events are built as
    the profiler builds them from a GPU's trace (this machine records no device)."""

    def event(name, start, end, thread=1, device=DeviceType.CPU):
        return FunctionEvent(id=0, name=name, thread=thread, start_us=start, end_us=end, device_type=device)

    events = [
        event("ngrpo/rollout", 0, 100),
        event("ngrpo/rollout", 20, 55, thread=0, device=DeviceType.CUDA),  # the range on the device's timeline
        event("cudaGraphLaunch", 10, 12),
        event("graph kernel", 20, 30, thread=0, device=DeviceType.CUDA),
        event("graph kernel", 40, 55, thread=0, device=DeviceType.CUDA),
        event("ngrpo/update", 200, 300),
        event("aten::mm", 210, 215, thread=7),  # the backward's thread
        event("gemm kernel", 220, 228, thread=0, device=DeviceType.CUDA),
        event("ngrpo/logprobs", 250, 280),  # nested: its own phase
        event("late kernel", 260, 262, thread=0, device=DeviceType.CUDA),
        event("stray kernel", 400, 410, thread=0, device=DeviceType.CUDA),  # inside no phase
    ]
    report = step_profile.phase_report(events)
    assert report["rollout"]["calls"] == 1 and report["rollout"]["host_s"] == pytest.approx(100e-6)
    assert report["rollout"]["kernels"] == 2 and report["rollout"]["graph_launches"] == 1
    assert report["rollout"]["device_s"] == pytest.approx(25e-6)
    assert report["rollout"]["top_kernels"] == [["graph kernel", pytest.approx(25e-6), 2]]
    assert report["update"]["kernels"] == 1 and [op for op, _, _ in report["update"]["top_host_ops"]] == ["aten::mm"]
    assert report["logprobs"]["kernels"] == 1 and report["logprobs"]["host_s"] == pytest.approx(30e-6)
    assert report["update"]["host_s"] == pytest.approx(100e-6)  # a phase's time is its range's, nested ones included
    assert report["update"]["products_s"] is None  # on a device the host's products are launches, not the work


def test_a_failing_block_is_not_timed_and_its_error_goes_through():
    with pytest.raises(ValueError, match="inside"):
        with phase("reward") as timed:
            raise ValueError("inside")
    assert timed.seconds == 0.0


def test_a_profiled_training_step_reports_its_four_phases(tiny, tmp_path):
    module, datamodule = tiny_rl(tiny, ScriptedReward([1, 0]))
    profile = step_profile.StepProfile(step=1, trace=tmp_path / "step.trace.json.gz")
    tiny_trainer(2, callbacks=[profile]).fit(module, datamodule=datamodule)
    report = profile.report
    assert report is not None and set(report) == set(PHASES)  # the step's rollout is inside the window
    for name in PHASES:
        assert report[name]["calls"] == 1 and report[name]["host_s"] > 0, name
    for name in ("rollout", "update"):  # the model's products run inside these (no KL term: no reference pass)
        assert any(op in ("aten::mm", "aten::addmm", "aten::linear") for op, _, _ in report[name]["top_host_ops"])
        assert report[name]["products_s"] > 0 and report[name]["products_gflops"] > 0, name  # shapes recorded
    assert (tmp_path / "step.trace.json.gz").stat().st_size > 1000
    rows = step_profile.phase_rows({"run": "tiny"}, report)
    assert [r["phase"] for r in rows] == list(report) and all(r["run"] == "tiny" for r in rows)


def test_the_first_step_cannot_be_profiled():
    with pytest.raises(ValueError, match="step=0"):
        step_profile.StepProfile(step=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh runs this)")
def test_a_phase_on_a_gpu_waits_for_its_kernels():  # pragma: no cover - no GPU in CI
    a = torch.randn(4096, 4096, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with phase("update", torch.device("cuda")) as timed:
        start.record()
        for _ in range(50):  # about 7 TFLOP: milliseconds of device time, microseconds to queue
            a = a @ a / 64
        end.record()
    assert end.query()  # the phase waited: its kernels have run
    assert timed.seconds >= 0.95 * start.elapsed_time(end) / 1000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh runs this)")
def test_a_phase_report_on_a_gpu_counts_its_kernels_graph_replays_included():  # pragma: no cover - no GPU in CI
    a = torch.randn(1024, 1024, device="cuda")
    out = torch.empty_like(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(a @ a)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(a @ a)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with phase("update", torch.device("cuda")):
            for _ in range(10):
                a @ a
        with phase("rollout", torch.device("cuda")):
            for _ in range(10):
                graph.replay()
    report = step_profile.phase_report(prof.events())
    assert report["update"]["kernels"] >= 10 and report["update"]["device_s"] > 0
    assert report["rollout"]["graph_launches"] == 10
    assert report["rollout"]["kernels"] >= 10 and report["rollout"]["device_s"] > 0  # the replays' kernels
    assert 0 < report["update"]["busy"]
