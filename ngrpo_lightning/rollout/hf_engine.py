"""HFEngine: batched decoding of a transformers model, driven by ``inputs_embeds``.

Feeding embeddings lets any explorer replace the next input by a mixture. The loop is the plain KV-cache loop: one
prefill of the left-padded prompts, then one position per step, position ids continuing from each row's prompt
length (as ``model.generate``, so greedy outputs agree). A row that ends leaves the decoding batch.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ngrpo_lightning.backends import Backend, backend_for
from ngrpo_lightning.backends.passes import packed_for_pass
from ngrpo_lightning.checks import check_bool, check_number
from ngrpo_lightning.explorers import Explorer
from ngrpo_lightning.models.walks import modules_of, set_training
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.decode_state import DecodeState
from ngrpo_lightning.rollout.decoding import GrowingCacheDecoding, StaticCacheDecoding, decoding_mode
from ngrpo_lightning.rollout.engine import RolloutEngine, eos_token_ids, register_engine
from ngrpo_lightning.rollout.padding import pad_rows
from ngrpo_lightning.rollout.sharded_decoding import DecodeCopy, unsharded
from ngrpo_lightning.rollout.step_graphs import Batch, StepGraphs

log = logging.getLogger(__name__)


@register_engine("hf")
class HFEngine(RolloutEngine):
    """Rollouts with the policy module itself (no weight copy, no sync).

    Rows are the ``n`` samples of each prompt, grouped by prompt, and keep that index in every output. Step ``t`` runs
    the model on the *live* rows, asks the explorer for the emitted tokens and next inputs, and writes token ``t`` and
    its log-prob. Rows that end with EOS leave the batch; a row reaching ``max_new_tokens`` without EOS is
    ``truncated``. The explorer sees every row, always ([rows, V] logits in the original order, ended rows giving
    their last logits, their choices discarded), so row-keyed explorers and the generator see a batch that never
    shrinks. The same seed and settings give the same rollouts; a row's logits can differ in their last bits with the
    batch's size, enough to flip a sampled token on a sampler's boundary: greedy decoding agrees with ``generate``,
    long sampled rollouts agree in distribution.

    Args:
        model: a causal LM (the policy being trained).
        tokenizer: its tokenizer (pad token required).
        max_new_tokens: default response length limit.
        seed: seed of the sampling generator (reproducible rollouts).
        ignore_eos: no id ends a response: every row is ``max_new_tokens`` long (``rollout.ignore_eos``).
        drop_finished_rows: rows that end leave the decoding batch (default; ``False`` keeps them decoding padding).
        drop_min_frac: ended rows leave together once at least this fraction of the batch (0: at once), else pad.
        backend: the backend that prepared the model (:mod:`ngrpo_lightning.backends`), giving the KV cache's dtype
            (``Backend.kv_cache_dtype``; None: the model's).
        checks_every: decoding steps between the host's looks at which rows ended (default: the backend's
            ``decode_checks_every``; 1 without one); the same rollout, ended rows only leave later.
        static_cache: decode on a static KV cache with a full-width mask (:mod:`.static_cache`) a CUDA graph can
            replay (default: the backend's ``static_decoding``; off without one).
        graphs: with the static cache, replay each step from a CUDA graph per batch bucket (``"cuda"``: the whole step,
            :mod:`.step_graphs`, where the explorer is ``capturable``, else the model's, :mod:`.decode_graphs`;
            ``"compile"``: ``torch.compile``; ``"rerun"``: the step on the graphs' buffers, the CPU's check); default:
            the backend's ``decode_graphs``; ``False``: none.
        sharded_root: under FSDP2, the policy's root module (:mod:`ngrpo_lightning.training.parallel`): a rollout
            decodes on a copy of the gathered weights, or unshards the policy once (:mod:`.sharded_decoding`).
    """

    settings_key = "hf"  # rollout.hf.*

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int = 256,
        seed: int = 0,
        ignore_eos: bool = False,
        drop_finished_rows: bool = True,
        drop_min_frac: float = 0.0,
        sharded_root: torch.nn.Module | None = None,
        backend: Backend | None = None,
        checks_every: int | None = None,
        static_cache: bool | None = None,
        graphs: str | bool | None = None,
    ):
        settings = {"drop_finished_rows": drop_finished_rows, "drop_min_frac": drop_min_frac}
        check_number("checks_every", checks_every, 1, integer=True, optional=True)
        self.check_settings(settings, "rollout.hf")
        if tokenizer.pad_token_id is None:
            raise ValueError("HFEngine needs a tokenizer with a pad token")
        self.model, self.tokenizer, self.sharded_root = model, tokenizer, sharded_root
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.drop_finished_rows, self.drop_min_frac = drop_finished_rows, float(drop_min_frac)
        self.checks_every = checks_every
        self.backend = backend
        self.decoding = decoding_mode(backend, static_cache, graphs)  # kept: it keeps static caches and graphs
        self._told: set[type] = set()  # explorer classes said not to be sync_free
        self._copy: DecodeCopy | None = None  # under FSDP2: the weights decoded, or the backend's refusal
        generation = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.set_eos_ids(eos_token_ids(generation, tokenizer), ignore_eos)

    @classmethod
    def check_settings(cls, settings: dict, prefix: str) -> None:
        super().check_settings(settings, prefix)
        check_number(f"{prefix}.drop_min_frac", settings.get("drop_min_frac", 0.0), 0.0, 1.0)
        check_bool(f"{prefix}.drop_finished_rows", settings.get("drop_finished_rows", True))

    @classmethod
    def from_policy(
        cls, policy, tokenizer, *, max_new_tokens, seed, ignore_eos=False, sharded_root=None, backend=None, **settings
    ):
        """The engine decodes with ``policy`` itself; ``max_prompt_tokens`` is not needed."""
        settings.pop("max_prompt_tokens", None)
        return cls(
            policy,
            tokenizer,
            max_new_tokens=max_new_tokens,
            seed=seed,
            ignore_eos=ignore_eos,
            sharded_root=sharded_root,
            backend=backend,
            **settings,
        )

    # ------------------------------------------------------------ rollouts
    def _fsdp_modules(self) -> list:
        """The model's FSDP2 modules, the root first (empty when it is not sharded)."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return []
        modules = [m for m in modules_of(self.model) if isinstance(m, FSDPModule)]
        if isinstance(self.sharded_root, FSDPModule) and self.sharded_root not in modules:
            modules.insert(0, self.sharded_root)
        return modules

    def generate(self, prompts, explorer: Explorer, n: int = 1, max_new_tokens: int | None = None) -> RolloutBatch:
        # inference_mode is faster than no_grad per decoding step; its (small) outputs are cloned out of it
        model, sharded = self.model, self._fsdp_modules()
        if sharded:  # FSDP2: on a copy of the gathered weights, or through the policy unsharded
            if self._copy is None:
                self._copy = DecodeCopy.of(self.model, self.backend or backend_for(self.model))
            model = self._copy.refresh(sharded, self.policy_version)
            if model is None:  # the policy's modules decode eagerly, FSDP2's hooks at every step: a growing cache
                with unsharded(sharded):
                    batch = self._generate(
                        prompts, explorer, n, max_new_tokens, self.model, GrowingCacheDecoding(self.backend)
                    )
                batch.stats["rollout/sharded_on_copy"] = 0.0
                return batch
        with torch.inference_mode():
            batch = self._generate(prompts, explorer, n, max_new_tokens, model, self.decoding)
        if sharded:
            batch.stats["rollout/sharded_on_copy"] = 1.0
        return batch.clone()

    def _generate(self, prompts, explorer: Explorer, n: int, max_new_tokens: int | None, model, mode):
        t0 = time.perf_counter()  # the packing counts in the rollout's time
        # graphs read LoRA's merged copies where they were recorded: those keep their storage
        keep = isinstance(mode, StaticCacheDecoding) and mode.replay is not None
        with packed_for_pass(model, rows=len(prompts) * n, decoding=True, keep=keep):
            return self._decode(model, mode, prompts, explorer, n, max_new_tokens, t0)

    def new_state(self, rows: int, capacity: int, device, start) -> DecodeState:
        """A fresh decoding state of ``rows`` rows for up to ``capacity`` tokens (a decoding mode asks)."""
        eos = torch.tensor(self.eos_ids, device=device, dtype=torch.long)
        marker = start.marker.rows(rows, device) if start.marker is not None else None  # on the device
        return DecodeState(rows, capacity, device, self.tokenizer.pad_token_id, eos, start.temperature, marker)

    def _decode(
        self, model, mode, prompts, explorer: Explorer, n: int, max_new_tokens: int | None, t0: float
    ) -> RolloutBatch:
        """One rollout with ``model`` (the policy, or a copy of its weights), its steps as ``mode`` runs them."""
        pad_id = self.tokenizer.pad_token_id
        max_new = max_new_tokens or self.max_new_tokens
        was_training = model.training
        set_training(model, False)  # model.eval(), one loop over a peft model's thousands of modules
        embedding = model.get_input_embeddings().weight
        device = embedding.device
        start = self.start(explorer, embedding)

        prompt_ids, prompt_mask = pad_rows([p for p in prompts for _ in range(n)], pad_id, left=True)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        rows, width = prompt_ids.shape
        steps_of = mode.start(self, model, rows, width, max_new, explorer, start)
        state, cache = steps_of.state, steps_of.cache
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, max_new)], dim=1)  # step t reads width + t columns
        if steps_of.static:
            mask = steps_of.full_width(mask)
        position = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        state.restart(max_new, width)
        checks_every = self.checks_every or (self.backend.decode_checks_every if self.backend is not None else 1)
        if checks_every > 1 and not explorer.sync_free and type(explorer) not in self._told:
            self._told.add(type(explorer))  # one line per engine and explorer class
            log.info(
                "explorer %s does not declare sync_free: its steps may make the host wait for the device at "
                "every token (docs/explorers.md, 'On a GPU, never wait for the host')",
                type(explorer).__name__,
            )
        # The first step: the prompts' prefill, each prompt once, its cache rows repeated for its n samples
        first = slice(None, None, n) if n > 1 else slice(None)
        prefill = steps_of.prefill(mask[first])
        out = model(
            inputs_embeds=embedding[prompt_ids[first]],
            position_ids=position[first],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **prefill,
        )
        logits = out.logits[:, -1].float()
        if n > 1:
            logits = logits.repeat_interleave(n, 0)
            cache.reorder_cache(torch.arange(rows, device=device) // n)
        inputs = state.advance(logits, explorer, start.generator, embedding)[:, None]
        batch = steps_of.first_batch(Batch(inputs, position[:, -1:] + 1, mask, None))
        steps = 1
        for t in range(max_new):
            if t > 0:
                steps = t + 1
                logits, batch = steps_of(batch, t)
            # the ended rows' bookkeeping stays on the device; the host looks every checks_every steps
            if (t + 1) % checks_every == 0:
                if bool(state.finished.all()):
                    break
                stale = state.finished if batch.live is None else state.finished[batch.live]
                if self.drop_finished_rows and int(stale.sum()) >= max(1, self.drop_min_frac * len(stale)):
                    keep = steps_of.fit((~stale).nonzero().squeeze(-1), stale)
                    if len(keep) < len(stale):
                        if batch.live is None:  # the batch still had every row: the explorer keeps seeing them
                            if state.explorer_logits is None:
                                state.explorer_logits = torch.empty_like(logits)
                            state.explorer_logits.copy_(logits)
                        batch = steps_of.select(batch, keep)

        if was_training:
            set_training(model, True)
        if bool(state.finished.all()):  # the loop may have run up to checks_every - 1 steps past the last end
            steps = int(state.lengths.max())
        lengths = state.lengths.clamp(max=steps)
        response_mask = (torch.arange(steps, device=device)[None] < lengths[:, None]).long()
        elapsed = time.perf_counter() - t0
        response_ids = state.tokens[:, :steps].clone()  # a kept state is refilled by the next rollout
        texts = self.tokenizer.batch_decode(response_ids.cpu(), skip_special_tokens=True)
        graphs = steps_of.graphs
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=state.logprobs[:, :steps].clone(),
            records=state.records(steps),
            group_size=n,
            response_text=texts,
            truncated=~state.finished,
            stats={
                **self.rollout_stats(elapsed, int(lengths.sum())),
                **({"rollout/graph_warmup_s": graphs.warmup_s - steps_of.warmup_s} if graphs is not None else {}),
                # 1 where the graphs hold whole steps, 0 the model's only
                **({"rollout/graphs_whole_step": float(isinstance(graphs, StepGraphs))} if graphs is not None else {}),
            },
        )
