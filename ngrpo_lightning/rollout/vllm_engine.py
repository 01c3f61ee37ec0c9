"""VLLMEngine: rollouts with vLLM, every explorer running inside its decoding loop.

vLLM keeps its own copy of the weights, loaded from the policy's directory; :meth:`VLLMEngine.sync_weights` replaces
them with the policy's current ones before a rollout whenever the policy took optimizer steps. Plain sampling
(``TemperatureExplorer``) is vLLM's own sampler; any other explorer decides each step in its place through the runner
patch of :mod:`ngrpo_lightning.compat.vllm` (one call's session: :mod:`.vllm_session`), its non-discrete steps coming
back as records that training replays exactly as with :class:`~.hf_engine.HFEngine`.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), each training process driving its own colocated
engine. The patch is for vLLM's Model Runner V1, selected explicitly (``VLLM_USE_V2_MODEL_RUNNER=0``); start-up fails,
naming the runner class, on another one. On GPU, CUDA graphs stay on and the engine sleeps between rollouts
(``sleep``): wake weights -> sync -> wake KV cache -> generate -> sleep (docs/vllm.md, "Weight sync"). Weights are
never reloaded from disk after start-up: that would overwrite a sync.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

import torch

from ngrpo_lightning.compat.vllm import install, runner_class
from ngrpo_lightning.explorers import Explorer, TemperatureExplorer
from ngrpo_lightning.models.loading import resolve_model_path
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.engine import RolloutEngine, eos_token_ids, full_named_tensors, register_engine
from ngrpo_lightning.rollout.padding import pad_rows
from ngrpo_lightning.rollout.vllm_session import RolloutSession
from ngrpo_lightning.rollout.vllm_support import VLLMVersionError, check_vllm, select_model_runner_v1

WEIGHTS_DISCARDED = -1  # weights_version after a level-2 sleep: never a policy version, so the next rollout syncs


def _start_in_process() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the runner is reachable
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # never pin the trainer's threads


class _RotaryCacheNotSynced(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" at every sync: a derived cache, put back as it was
    (tests/test_vllm_engine.py). Other layers' warnings show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def _quiet_rotary_reload() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryCacheNotSynced) for f in logger.filters):
        logger.addFilter(_RotaryCacheNotSynced())


def _made_outside_inference(named_tensors: Iterable[tuple[str, torch.Tensor]]):
    """``named_tensors`` one at a time, each made with inference mode off (a sharded state dict gathers only so)."""
    tensors = iter(named_tensors)
    while True:
        with torch.inference_mode(False):
            item = next(tensors, None)
        if item is None:
            return
        yield item[0], item[1].detach()


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM (its own copy of the weights: ``needs_sync``).

    Args:
        model: a local model directory in Hugging Face format (safetensors).
        tokenizer: the policy's tokenizer (pad token required).
        max_new_tokens: default response length limit.
        seed: seed of the engine's sampling (explorer generator and per-request seeds).
        ignore_eos: no id ends a response: every row is ``max_new_tokens`` long (``rollout.ignore_eos``).
        dtype: vLLM's compute dtype (use the policy's: ``float32`` for exact agreement).
        max_model_len: longest prompt + response.
        gpu_memory_utilization: share of GPU memory vLLM may take (colocated with training).
        kv_cache_gib: KV cache size on CPU.
        sleep: on GPU, release vLLM's memory between rollouts: ``True``/``1`` = level 1 (weights to host memory, KV
            cache freed); ``2`` = weights discarded too (each rollout then syncs from :meth:`from_policy`'s live
            policy, or is refused); ``False``/``0`` = never. Ignored on CPU.
        enforce_eager: ``None`` = eager on CPU, CUDA graphs on GPU (they see the mixed inputs).
        engine_kwargs: further ``vllm.LLM`` arguments.
        policy: the live policy the engine mirrors (:meth:`from_policy`); restores weights a level-2 sleep discarded.
    """

    settings_key = "vllm"  # rollout.vllm.*
    needs_sync = True  # vLLM decodes with its own copy of the weights

    def __init__(
        self,
        model: str,
        tokenizer,
        max_new_tokens: int = 256,
        seed: int = 0,
        ignore_eos: bool = False,
        dtype: str = "float32",
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gib: float = 1.0,
        sleep: bool | int = True,
        enforce_eager: bool | None = None,
        engine_kwargs: dict | None = None,
        policy: torch.nn.Module | None = None,
    ):
        check_vllm()
        self.check_settings({"sleep": sleep}, "rollout.vllm")
        _start_in_process()
        _quiet_rotary_reload()
        select_model_runner_v1()  # the runner the explorers are patched into: before vLLM builds its config
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        from vllm import LLM

        self.tokenizer, self.max_new_tokens, self.seed, self.policy = tokenizer, max_new_tokens, seed, policy
        if tokenizer.pad_token_id is None:
            raise ValueError("VLLMEngine needs a tokenizer with a pad token")
        self.on_gpu = torch.cuda.is_available()
        self.sleep_level = int(sleep) if self.on_gpu else 0
        self.sleep_enabled = self.sleep_level > 0
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm = LLM(
            model=model,
            tokenizer=model,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enable_prompt_embeds=True,
            enable_prefix_caching=False,
            async_scheduling=False,
            enforce_eager=(not self.on_gpu) if enforce_eager is None else enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.sleep_enabled,
            **(engine_kwargs or {}),
        )
        # vLLM's CPU worker sets its own thread count and disables torch.set_num_threads: restored for the trainer
        self.serving_threads = torch.get_num_threads()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        try:
            self.runner = self._runner()
            install(self.runner)  # checks the runner's class first: Model Runner V1, or a clear error
        except Exception:
            self.close()
            raise
        self.runner_class = runner_class(self.runner)
        gen_cfg = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        self.set_eos_ids(eos_token_ids(gen_cfg.get("eos_token_id"), tokenizer), ignore_eos)
        self.asleep: set[str] = set()  # parts released by LLM.sleep (GPU): "weights", "kv_cache"
        self.weights_version = None  # policy version of the weights vLLM holds (None: the files on disk)

    @classmethod
    def check_available(cls) -> None:
        try:
            check_vllm()
        except VLLMVersionError as err:
            raise ValueError(str(err)) from err

    @classmethod
    def check_settings(cls, settings: dict, prefix: str) -> None:
        super().check_settings(settings, prefix)
        sleep = settings.get("sleep", True)
        if not isinstance(sleep, int) or int(sleep) not in (0, 1, 2):  # bools are ints: false = 0, true = 1
            raise ValueError(f"{prefix}.sleep={sleep!r} is out of range: allowed false, true (= 1), 1, 2")

    @classmethod
    def check_model(cls, model: torch.nn.Module) -> None:
        """vLLM's CPU attention takes a few head sizes only: refused here, before vLLM loads the model again."""
        if torch.cuda.is_available():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        config = model.config
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head not in sizes:
            raise ValueError(
                f"vLLM's CPU attention takes head sizes {sizes}; this model's is {head} (the packaged "
                "model's is 64): decode it with the hf engine, or use another model"
            )

    @classmethod
    def from_policy(
        cls,
        policy: torch.nn.Module,
        tokenizer,
        *,
        max_new_tokens: int,
        seed: int,
        ignore_eos: bool = False,
        max_prompt_tokens: int | None = None,
        sharded_root: torch.nn.Module | None = None,
        backend=None,
        **settings,
    ) -> VLLMEngine:
        """An engine for a live policy: vLLM loads the policy's directory (or ``settings["model"]``) in its dtype, with
        room for ``max_prompt_tokens + max_new_tokens``, unless ``settings`` (the other constructor arguments,
        ``rollout.vllm.*``; nulls take the defaults) say otherwise; the weights arrive with :meth:`sync_weights`."""
        settings = {k: v for k, v in settings.items() if v is not None}
        path = settings.pop("model", None) or resolve_model_path(policy.name_or_path)
        dtype = settings.pop("dtype", None) or str(next(policy.parameters()).dtype).removeprefix("torch.")
        if max_prompt_tokens is not None:
            settings.setdefault("max_model_len", max_prompt_tokens + max_new_tokens)
        return cls(
            path,
            tokenizer,
            max_new_tokens=max_new_tokens,
            seed=seed,
            ignore_eos=ignore_eos,
            dtype=dtype,
            policy=policy,
            **settings,
        )

    def _runner(self):
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
        runner = getattr(worker, "model_runner", None)
        if runner is None:
            raise RuntimeError(
                "vLLM's model runner is not reachable in this process: the engine must run in-process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0, single worker: tensor_parallel_size=1)"
            )
        return runner

    def embedding(self) -> torch.Tensor:
        """vLLM's input embedding matrix E [V, d] (rows beyond the logits' vocabulary dropped)."""
        model = self.runner.get_model()
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.model.embed_tokens
        weight = embed.weight
        return weight[: self.llm.llm_engine.model_config.get_vocab_size()]

    # ------------------------------------------------------------- weights (order: see the module docstring)
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load the policy's weights (Hugging Face names; full tensors) into the storage vLLM's CUDA graphs read."""
        self._wake(tags=["weights"])
        # written in inference mode (the engine's tensors are inference tensors), each made outside it (FSDP2 gathers)
        with torch.inference_mode():
            self.runner.reload_weights(
                weights_iterator=_made_outside_inference(named_tensors), is_checkpoint_format=True
            )
        self.weights_version = version

    def _wake(self, tags=("weights", "kv_cache")) -> None:
        """Wake the parts of a sleeping engine that are asleep among ``tags`` (each only once)."""
        waking = [t for t in tags if t in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def _sleep(self) -> None:
        """After a rollout, on GPU: give the memory back to training (see ``sleep``)."""
        if not self.sleep_level:
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        if self.sleep_level == 2:  # vLLM dropped the weights: the next rollout needs a sync first
            self.weights_version = WEIGHTS_DISCARDED

    def _ensure_weights(self) -> None:
        """Before a rollout: weights a level-2 sleep dropped, not synced since, come from the live policy, or refuse."""
        if self.weights_version != WEIGHTS_DISCARDED:
            return
        if self.policy is None:
            raise RuntimeError(
                "VLLMEngine: sleep level 2 dropped vLLM's weights and no sync_weights(...) followed; "
                "sync the policy's weights before this rollout, or use sleep=1"
            )
        self.sync_weights(full_named_tensors(self.policy), version=None)

    # ------------------------------------------------------------ rollouts
    def generate(self, prompts, explorer: Explorer, n: int = 1, max_new_tokens: int | None = None) -> RolloutBatch:
        from vllm import SamplingParams

        self._ensure_weights()
        self._wake()
        max_new = max_new_tokens or self.max_new_tokens
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        native = type(explorer) is TemperatureExplorer  # plain sampling: vLLM's own sampler
        E = self.embedding()
        start = self.start(explorer, E, native=native)  # the explorer draws on the logits' device
        seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=start.generator).tolist()
        # eos_ids = [] (ignore_eos) decodes exactly max_new tokens per row
        params = [
            SamplingParams(
                max_tokens=max_new,
                stop_token_ids=self.eos_ids,
                ignore_eos=not self.eos_ids,
                detokenize=False,
                seed=s,
                **(_sampling_kwargs(explorer) if native else {"temperature": 1.0}),
            )
            for s in seeds
        ]
        session = RolloutSession(
            embedding=E,
            temperature=start.temperature,
            explorer=None if native else explorer,
            generator=start.generator,
            marker=start.marker,
        )
        self.runner.ngrpo_session = session
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(self.serving_threads)
            outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        finally:
            self.runner.ngrpo_session = None
            torch.set_num_threads(threads)
        elapsed = time.perf_counter() - t0
        batch = self._batch(rows, outputs, session, n, elapsed)
        self._sleep()
        return batch

    def _batch(self, rows, outputs, session: RolloutSession, n: int, elapsed: float) -> RolloutBatch:
        pad_id = self.tokenizer.pad_token_id
        internal = {rid.rsplit("-", 1)[0]: rid for rid in session.request_ids()}  # vLLM suffixes the ids we gave
        row_of = {internal[o.request_id]: i for i, o in enumerate(outputs) if o.request_id in internal}
        responses = [list(o.outputs[0].token_ids) for o in outputs]
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.long)
        width = max([1, *map(len, responses)])
        response_ids, response_mask = pad_rows(responses, pad_id, width=width)
        prompt_ids, prompt_mask = pad_rows(rows, pad_id, left=True)
        truncated = torch.tensor([o.outputs[0].finish_reason == "length" for o in outputs])
        texts = self.tokenizer.batch_decode(
            response_ids.masked_fill(response_mask == 0, pad_id), skip_special_tokens=True
        )
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=session.logprob_table(row_of, lengths, width),
            records=session.input_records(row_of, lengths),
            group_size=n,
            response_text=texts,
            truncated=truncated,
            stats=self.rollout_stats(elapsed, int(lengths.sum())),
        )

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _sampling_kwargs(explorer: TemperatureExplorer) -> dict:
    """vLLM sampling parameters equal to a :class:`TemperatureExplorer` (T = 0: greedy)."""
    return {
        "temperature": explorer.temperature,
        "top_p": explorer.top_p,
        "top_k": explorer.top_k or -1,
        "min_p": explorer.min_p,
    }
