"""VLLMEngine: rollouts with vLLM, every explorer running inside its decoding loop.

vLLM keeps its own copy of the weights, loaded from the directory the policy was loaded
from; :meth:`VLLMEngine.sync_weights` replaces them with the policy's current ones (the
DataModule calls it before a rollout whenever the policy took optimizer steps since the
last sync). Plain sampling (``TemperatureExplorer``) is vLLM's own sampler; any other
explorer decides each step in place of it through the runner patch of
:mod:`.vllm_runner_patch`, and its non-discrete steps come back as records that training
replays exactly as with :class:`~.hf_engine.HFEngine`.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the explorer, its
generator and the records live next to the trainer, and each training process drives its
own colocated engine. On GPU the engine sleeps between rollouts (``sleep=True``), giving
its weights and KV cache memory back to training.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch

from ..explorers import Explorer, TemperatureExplorer
from .batch import RolloutBatch
from .engine import SeededEngine
from .hf_engine import left_pad, special_token_ids
from .records import InputRecords
from .vllm_runner_patch import RolloutSession, install
from .vllm_support import check_vllm


def _start_in_process() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the runner is reachable
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # never pin the trainer's threads


class VLLMEngine(SeededEngine):
    """Rollouts with vLLM (its own copy of the weights: ``needs_sync``).

    Args:
        model: a local model directory in Hugging Face format (safetensors).
        tokenizer: the policy's tokenizer (pad token required).
        max_new_tokens: default response length limit.
        seed: seed of the engine's sampling (explorer generator and per-request seeds).
        dtype: vLLM's compute dtype (use the policy's: ``float32`` for exact agreement).
        max_model_len: longest prompt + response.
        gpu_memory_utilization: share of GPU memory vLLM may take (colocated with training).
        kv_cache_gib: KV cache size on CPU.
        sleep: on GPU, release vLLM's memory between rollouts (``LLM.sleep``/``wake_up``).
        engine_kwargs: further ``vllm.LLM`` arguments.
    """

    def __init__(self, model: str, tokenizer, max_new_tokens: int = 256, seed: int = 0, dtype: str = "float32",
                 max_model_len: int = 2048, gpu_memory_utilization: float = 0.3, kv_cache_gib: float = 1.0,
                 sleep: bool = True, enforce_eager: bool | None = None, engine_kwargs: dict | None = None):
        check_vllm()
        _start_in_process()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        from vllm import LLM

        self.tokenizer, self.max_new_tokens, self.seed = tokenizer, max_new_tokens, seed
        if tokenizer.pad_token_id is None:
            raise ValueError("VLLMEngine needs a tokenizer with a pad token")
        self.on_gpu = torch.cuda.is_available()
        self.sleep_enabled = bool(sleep and self.on_gpu)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm = LLM(model=model, tokenizer=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       enable_prompt_embeds=True, enable_prefix_caching=False, async_scheduling=False,
                       enforce_eager=(not self.on_gpu) if enforce_eager is None else enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled,
                       **(engine_kwargs or {}))
        # vLLM's CPU worker picks its own thread count for decoding (1: more threads spin-wait against
        # each other) and disables torch.set_num_threads process-wide; the trainer gets its threads
        # back, and decoding runs with vLLM's count (see _decoding_threads).
        self.serving_threads = torch.get_num_threads()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        self.runner = self._runner()
        install(self.runner)
        gen_cfg = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        eos = gen_cfg.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_ids = sorted(set(eos) | ({tokenizer.eos_token_id} - {None}))
        self.asleep: set[str] = set()  # parts released by LLM.sleep (GPU): "weights", "kv_cache"
        self.needs_sync = True
        self.weights_version = None  # policy version of the weights vLLM holds (None: the files on disk)

    @classmethod
    def for_module(cls, module, max_new_tokens: int, seed: int, **kwargs) -> "VLLMEngine":
        """An engine for an :class:`~ngrpo_lightning.module.RLModule`'s policy, loaded from the
        same directory (its weights are synced before the first rollout)."""
        from ..models import resolve_model_path

        policy = module.policy
        path = kwargs.pop("model", None) or resolve_model_path(policy.name_or_path)
        dtype = kwargs.pop("dtype", None) or str(next(policy.parameters()).dtype).removeprefix("torch.")
        return cls(path, module.tokenizer, max_new_tokens=max_new_tokens, seed=seed, dtype=dtype, **kwargs)

    def _runner(self):
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
        runner = getattr(worker, "model_runner", None)
        if runner is None:
            raise RuntimeError("vLLM's model runner is not reachable in this process: the engine must run in-process "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0, single worker: tensor_parallel_size=1)")
        return runner

    def embedding(self) -> torch.Tensor:
        """vLLM's input embedding matrix E [V, d] (rows beyond the logits' vocabulary dropped)."""
        model = self.runner.get_model()
        weight = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else model.model.embed_tokens.weight
        return weight[: self.llm.llm_engine.model_config.get_vocab_size()]

    # ------------------------------------------------------------- weights
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Load the policy's current weights (Hugging Face names; full, unsharded tensors)
        into vLLM, converting them to vLLM's layout (fused projections, packed kernels)."""
        self._wake(tags=["weights"])
        self.runner.reload_weights(weights_iterator=((n, t.detach()) for n, t in named_tensors), is_checkpoint_format=True)
        self.weights_version = version

    def _wake(self, tags=("weights", "kv_cache")) -> None:
        """Wake the parts of a sleeping engine that are asleep among ``tags`` (each only once)."""
        waking = [t for t in tags if t in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    # ------------------------------------------------------------ rollouts
    def generate(self, prompts, explorer: Explorer, n: int = 1, max_new_tokens: int | None = None) -> RolloutBatch:
        from vllm import SamplingParams

        self._wake()
        max_new = max_new_tokens or self.max_new_tokens
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        native = type(explorer) is TemperatureExplorer  # plain sampling: vLLM's own sampler
        E = self.embedding()
        gen = self.generator(E.device)  # the explorer draws on the logits' device
        if not native:
            explorer.set_special_ids(special_token_ids(self.tokenizer, E.shape[0]))
            explorer.prepare(E)
        temperature = explorer.temperature or 1.0
        seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=gen).tolist()
        # eos_ids = [] decodes exactly max_new tokens per row (as HFEngine does; benchmarks use it)
        params = [SamplingParams(max_tokens=max_new, stop_token_ids=self.eos_ids, ignore_eos=not self.eos_ids,
                                 detokenize=False, seed=s,
                                 **(_sampling_kwargs(explorer) if native else {"temperature": 1.0}))
                  for s in seeds]
        session = RolloutSession(embedding=E, temperature=temperature, explorer=None if native else explorer, generator=gen)
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
        if self.sleep_enabled:
            self.llm.sleep(level=1)  # weights to CPU, KV cache freed: training gets the memory back
            self.asleep = {"weights", "kv_cache"}
        return self._batch(rows, outputs, session, n, elapsed)

    def _batch(self, rows, outputs, session: RolloutSession, n: int, elapsed: float) -> RolloutBatch:
        pad_id = self.tokenizer.pad_token_id
        internal = {rid.rsplit("-", 1)[0]: rid for rid in set(session.logprobs) | set(session.records)}
        responses = [list(o.outputs[0].token_ids) for o in outputs]
        width = max(1, max(len(r) for r in responses))
        response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width))
        parts = []
        for i, (out, resp) in enumerate(zip(outputs, responses)):
            response_ids[i, :len(resp)] = torch.tensor(resp, dtype=torch.long)
            response_mask[i, :len(resp)] = 1
            rid = internal.get(out.request_id)
            lp = session.logprobs.get(rid, {})
            logprobs[i, :len(resp)] = torch.tensor([lp.get(p, 0.0) for p in range(len(resp))])
            recs = [r for r in session.records.get(rid, []) if r[0] < len(resp)]
            if recs:
                parts.append(InputRecords(
                    row=torch.full((len(recs),), i, dtype=torch.long), pos=torch.tensor([r[0] for r in recs]),
                    ids=torch.stack([r[1] for r in recs]), weights=torch.stack([r[2] for r in recs]),
                    noise_seed=torch.tensor([r[3] for r in recs], dtype=torch.long),
                    noise_scale=torch.tensor([r[4] for r in recs], dtype=torch.float32)))
        prompt_ids, prompt_mask = left_pad(rows, pad_id)
        n_tokens = int(response_mask.sum())
        truncated = torch.tensor([o.outputs[0].finish_reason == "length" for o in outputs])
        texts = self.tokenizer.batch_decode(response_ids.masked_fill(response_mask == 0, pad_id), skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
            rollout_logprobs=logprobs, records=InputRecords.concat(parts), group_size=n, response_text=texts,
            truncated=truncated,
            stats={"rollout/time_s": elapsed, "rollout/tokens": n_tokens, "rollout/tokens_per_s": n_tokens / max(elapsed, 1e-9)},
        )

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _sampling_kwargs(explorer: TemperatureExplorer) -> dict:
    """vLLM sampling parameters equal to a :class:`TemperatureExplorer` (T = 0: greedy)."""
    return {"temperature": explorer.temperature, "top_p": explorer.top_p, "top_k": explorer.top_k or -1,
            "min_p": explorer.min_p}
