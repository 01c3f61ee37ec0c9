"""The vLLM runner patch without starting vLLM: which runner it accepts, how the engine asks for
Model Runner V1, what one rollout session records step by step (batch rows reordered, partial
prefills discarded, a preempted request recomputed), and the order of sleep, wake and sync.

The same code runs against real vLLM in tests/test_vllm_engine.py."""

import types

import numpy as np
import pytest
import torch

from ngrpo_lightning.compat import vllm as patch
from ngrpo_lightning.compat.vllm import PATCHED_RUNNER, check_runner
from ngrpo_lightning.explorers import ExplorerStep
from ngrpo_lightning.rollout.vllm_session import RolloutSession, StepRecords
from ngrpo_lightning.rollout.vllm_support import RUNNER_ENV, VLLMRunnerError, VLLMVersionError, select_model_runner_v1


def fake_class(qualified: str, base=object):
    module, _, name = qualified.rpartition(".")
    return type(name, (base,), {"__module__": module})


class Buffer:
    def __init__(self, values):
        self.np = np.asarray(values)


def fake_runner(cls=None, **batch):
    """A runner with the attributes the patch reads, of class ``cls`` (default: a V1 subclass)."""
    cls = cls or fake_class("vllm.v1.worker.cpu_model_runner.CPUModelRunner", fake_class(PATCHED_RUNNER))
    runner = cls()
    runner.input_batch = types.SimpleNamespace(
        req_ids=[],
        num_reqs=0,
        num_tokens_no_spec=np.zeros(0, np.int32),
        num_prompt_tokens=np.zeros(0, np.int32),
        num_computed_tokens_cpu=np.zeros(0, np.int32),
    )
    runner.discard_request_mask, runner.query_start_loc = Buffer([]), Buffer([0])
    runner._sample = runner._preprocess = lambda *a, **k: None
    runner.enable_prompt_embeds, runner.inputs_embeds = True, None
    return runner


def set_batch(runner, req_ids, tokens_so_far, prompt_lens, computed, scheduled, discard=None):
    """The runner's persistent batch for one step (rows in vLLM's order of that step)."""
    n = len(req_ids)
    runner.input_batch.req_ids[:] = req_ids  # vLLM reuses its list: the session must copy it
    runner.input_batch.num_reqs = n
    runner.input_batch.num_tokens_no_spec = np.array(tokens_so_far, np.int32)
    runner.input_batch.num_prompt_tokens = np.array(prompt_lens, np.int32)
    runner.input_batch.num_computed_tokens_cpu = np.array(computed, np.int32)
    runner.discard_request_mask = Buffer(discard or [False] * n)
    runner.query_start_loc = Buffer(np.concatenate([[0], np.cumsum(scheduled)]))


# ---------------------------------------------------------------- runner selection
def test_check_runner_accepts_model_runner_v1_and_its_subclasses():
    check_runner(fake_runner())
    check_runner(fake_runner(fake_class(PATCHED_RUNNER)))


def test_check_runner_refuses_another_runner_by_name():
    v2 = fake_class("vllm.v1.worker.gpu.model_runner.GPUModelRunner")
    with pytest.raises(VLLMRunnerError) as err:
        check_runner(fake_runner(v2))
    message = str(err.value)
    assert "vllm.v1.worker.gpu.model_runner.GPUModelRunner" in message  # the class it got
    assert PATCHED_RUNNER in message and "Model Runner V1" in message  # the class it needs
    assert "vllm" in message and "rollout.engine=hf" in message and "docs/vllm.md" in message  # version, what to do


def test_check_runner_refuses_the_real_model_runner_v2():
    """The V2 runner of the installed vLLM build (never constructed: it needs Triton)."""
    pytest.importorskip("vllm")
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2
    except Exception as err:  # noqa: BLE001 - any import problem of an optional module
        pytest.skip(f"vLLM's Model Runner V2 does not import here: {err}")
    with pytest.raises(VLLMRunnerError, match="vllm.v1.worker.gpu.model_runner.GPUModelRunner"):
        check_runner(object.__new__(ModelRunnerV2))


def test_check_runner_names_missing_internals():
    runner = fake_runner()
    del runner.input_batch.num_tokens_no_spec
    with pytest.raises(VLLMVersionError, match="input_batch.num_tokens_no_spec"):
        check_runner(runner)


def test_the_engine_asks_for_model_runner_v1(monkeypatch):
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    select_model_runner_v1()
    import os

    assert os.environ[RUNNER_ENV] == "0"
    monkeypatch.setenv(RUNNER_ENV, "0")
    select_model_runner_v1()


@pytest.mark.parametrize("value, says", [("1", "asks vLLM for Model Runner V2"), ("true", "is not 0 or 1")])
def test_a_request_for_model_runner_v2_is_refused(monkeypatch, value, says):
    monkeypatch.setenv(RUNNER_ENV, value)
    with pytest.raises(VLLMRunnerError) as err:
        select_model_runner_v1()
    assert says in str(err.value) and f"{RUNNER_ENV}={value}" in str(err.value)
    assert "Model Runner V1" in str(err.value) and "rollout.engine=hf" in str(err.value)


# ----------------------------------------------------------------- one session
class ScriptedExplorer:
    """Emits ``tokens``; rows in ``mixed`` feed the mixture of ids (3, 4) with weights (0.75, 0.25)."""

    temperature = 1.0

    def __init__(self):
        self.script = []

    def step(self, logits, generator=None):
        tokens, mixed = self.script.pop(0)
        b = logits.shape[0]
        return ExplorerStep(
            tokens=torch.tensor(tokens),
            mixed=torch.tensor(mixed),
            ids=torch.tensor([[3, 4]] * b),
            weights=torch.tensor([[0.75, 0.25]] * b),
        )


@pytest.fixture
def session(monkeypatch):
    monkeypatch.setattr(patch, "sampler_output", lambda tokens: tokens)  # vLLM's SamplerOutput is not needed here
    E = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    return RolloutSession(embedding=E, temperature=1.0, explorer=ScriptedExplorer())


def test_a_session_records_named_steps_and_feeds_mixtures_back_by_request(session):
    runner, E = fake_runner(), session.embedding
    explorer, logits = session.explorer, torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    mixture = 0.75 * E[3] + 0.25 * E[4]

    # step 1: prefill of a (3 prompt tokens) and b (2); c's prompt is only partly prefilled: discarded
    set_batch(runner, ["a-1", "b-2", "c-3"], [3, 2, 1], [3, 2, 4], [0, 0, 0], [3, 2, 1], discard=[False, False, True])
    explorer.script.append(([5, 6, 7], [True, False, True]))
    session.sample(runner, logits[:3], native_sample=None)
    [chunk] = session.records
    assert isinstance(chunk, StepRecords) and chunk.req_ids == ["a-1", "b-2", "c-3"]
    assert chunk.records.row.tolist() == [0] and chunk.records.pos.tolist() == [0]  # c's mixed row is not a step
    assert set(session.mixtures) == {"a-1"} and torch.allclose(session.mixtures["a-1"][0], mixture)

    # step 2: a decode step, rows reordered by vLLM: the mixture goes to a's row, wherever it is
    set_batch(runner, ["b-2", "a-1"], [3, 4], [2, 3], [2, 3], [1, 1])
    inputs = torch.zeros(2, 4)
    session.overwrite_inputs(runner, inputs)
    assert torch.equal(inputs[0], torch.zeros(4)) and torch.allclose(inputs[1], mixture)
    explorer.script.append(([1, 2], [True, False]))
    session.sample(runner, logits[3:5], native_sample=None)  # b's response position 1 is mixed

    # step 3: a is preempted and recomputed from its 3 prompt tokens and 2 response tokens: its
    # response position 0 (absolute position 3) gets its mixture back; position 1 was not mixed
    set_batch(runner, ["a-1"], [5], [3], [0], [5])
    inputs = torch.zeros(5, 4)
    session.overwrite_inputs(runner, inputs)
    assert torch.allclose(inputs[3], mixture) and not inputs[[0, 1, 2, 4]].any()
    explorer.script.append(([0], [False]))
    session.sample(runner, logits[5:6], native_sample=None)

    row_of, lengths = {"a-1": 0, "b-2": 1, "c-3": 2}, torch.tensor([3, 2, 0])
    records = session.input_records(row_of, lengths)
    assert records.row.tolist() == [0, 1] and records.pos.tolist() == [0, 1]  # ordered by row, then position
    assert records.ids.tolist() == [[3, 4], [3, 4]] and torch.allclose(records.weights, torch.tensor([0.75, 0.25]))
    assert records.noise_seed.dtype == torch.long and records.noise_scale.dtype == torch.float32

    table = session.logprob_table(row_of, lengths, width=3)
    logp = logits.log_softmax(-1)
    assert torch.allclose(table[0], torch.stack([logp[0, 5], logp[4, 2], logp[5, 0]]))
    assert torch.allclose(table[1, :2], torch.stack([logp[1, 6], logp[3, 1]])) and table[1, 2] == 0
    assert not table[2].any()  # the discarded row sampled nothing
    assert session.request_ids() == {"a-1", "b-2", "c-3"}


def test_records_past_the_end_of_a_response_are_dropped(session):
    runner = fake_runner()
    set_batch(runner, ["a-1"], [7], [3], [6], [1])  # the 5th response token (position 4), mixed
    session.explorer.script.append(([5], [True]))
    session.sample(runner, torch.zeros(1, 8), native_sample=None)
    assert len(session.input_records({"a-1": 0}, torch.tensor([5]))) == 1
    assert len(session.input_records({"a-1": 0}, torch.tensor([4]))) == 0


# -------------------------------------------------- sleep, wake and sync on GPU
class FakeLLM:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags):
        self.calls.append("wake:" + ",".join(tags))


def sleeping_engine(level, policy=None):
    """A VLLMEngine's weight and sleep state machine around a fake vLLM, asleep after a rollout."""
    from ngrpo_lightning.rollout.vllm_engine import VLLMEngine

    calls = []
    engine = object.__new__(VLLMEngine)
    engine.llm, engine.policy, engine.sleep_level = FakeLLM(calls), policy, level
    engine.runner = types.SimpleNamespace(
        reload_weights=lambda weights_iterator, is_checkpoint_format: calls.append(
            "sync:" + ",".join(n for n, _ in weights_iterator)
        )
    )
    engine.asleep, engine.weights_version = set(), 3
    engine._sleep()
    return engine, calls


def test_level_1_keeps_the_last_synced_weights_across_sleeps():
    engine, calls = sleeping_engine(1)
    assert engine.weights_version == 3 and engine.asleep == {"weights", "kv_cache"}
    engine._ensure_weights()  # nothing to restore: the weights were offloaded, not dropped
    engine._wake()
    assert calls == ["sleep1", "wake:weights,kv_cache"]


def test_level_2_wakes_weights_then_syncs_then_wakes_the_kv_cache():
    from ngrpo_lightning.rollout.vllm_engine import WEIGHTS_DISCARDED

    engine, calls = sleeping_engine(2)
    assert engine.weights_version == WEIGHTS_DISCARDED  # never a policy version: the DataModule syncs next
    engine.sync_weights([("w", torch.zeros(1))], version=4)
    engine._ensure_weights()
    engine._wake()
    assert calls == ["sleep2", "wake:weights", "sync:w", "wake:kv_cache"] and engine.weights_version == 4


def test_level_2_without_a_sync_restores_the_live_policy_or_refuses():
    engine, calls = sleeping_engine(2, policy=torch.nn.Linear(1, 1, bias=False))
    engine._ensure_weights()
    assert calls == ["sleep2", "wake:weights", "sync:weight"] and engine.weights_version is None
    engine, _ = sleeping_engine(2)
    with pytest.raises(RuntimeError, match="sleep level 2 dropped"):
        engine._ensure_weights()


# ------------------------------------- the neighbor search, mixing's main per-step cost
def test_two_stage_cpu_neighbor_search_is_exact_with_many_ties():
    """The CPU cosine search ranks float16 candidates in float64 (neighbor_index.py): it equals
    a float64 brute force, also for an anchor with more tied rows than candidate slots."""
    from ngrpo_lightning.explorers.neighbor_index import CANDIDATE_SLACK, NeighborIndex, score_error

    e = torch.randn(2000, 64, generator=torch.Generator().manual_seed(1))
    e[100 : 100 + CANDIDATE_SLACK + 8] = e[5].clone()  # more ties than slots: ranked over all columns
    e[200:203] = 2 * e[6]  # equal directions: cosine ties
    index = NeighborIndex(e, 3, exclude_ids=[101], chunk_size=300)
    assert index.two_stage
    keys = torch.nn.functional.normalize(e, dim=-1).double()
    s = keys @ keys.T
    s.fill_diagonal_(float("-inf"))
    s[:, 101] = float("-inf")
    expected = s.sort(dim=-1, descending=True, stable=True).indices[:, :3]
    anchors = torch.tensor([5, 6, 100, 200, 7, 1999])
    assert torch.equal(index.search(anchors[:2]), expected[anchors[:2]])  # float16 stage 1 (few anchors)
    assert torch.equal(index.search(anchors), expected[anchors])  # float32 stage 1
    assert index.search(torch.tensor([5]))[0].tolist() == [100, 102, 103]
    half = (index.half_keys[:8] @ index.half_keys.T).double() - keys[:8] @ keys.T
    assert half.abs().max() <= score_error(64, half=True) / 4  # the kernel sums float16 products in float32
