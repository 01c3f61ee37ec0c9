"""HFEngine: batched decoding of a transformers model, driven by ``inputs_embeds``.

Feeding embeddings rather than token ids is what lets any explorer replace the next
input by a mixture. The loop is the plain KV-cache loop: one prefill of the left-padded
prompts, then one forward of one position per step, position ids continuing from each
row's prompt length (what ``model.generate`` does, so greedy outputs agree). A row that
ends (EOS) leaves the decoding batch, so a rollout whose lengths vary costs the sum of its
lengths rather than its longest length times its rows.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ngrpo_lightning.backends import Backend, backend_for
from ngrpo_lightning.backends.passes import packed_for_pass
from ngrpo_lightning.checks import check_bool, check_number
from ngrpo_lightning.explorers import Explorer, declares_capturable
from ngrpo_lightning.models.walks import modules_of, set_training
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.decode_graphs import DecodeGraphs
from ngrpo_lightning.rollout.decode_state import DecodeState
from ngrpo_lightning.rollout.engine import RolloutEngine, eos_token_ids, register_engine
from ngrpo_lightning.rollout.kv_cache import reserved_cache
from ngrpo_lightning.rollout.padding import pad_rows
from ngrpo_lightning.rollout.sharded_decoding import DecodeCopy, unsharded
from ngrpo_lightning.rollout.static_cache import StaticCaches, batch_buckets
from ngrpo_lightning.rollout.step_graphs import Batch, StepGraphs

log = logging.getLogger(__name__)


@register_engine("hf")
class HFEngine(RolloutEngine):
    """Rollouts with the policy module itself (no weight copy, no sync).

    The decoding loop. Rows are the ``n`` samples of each prompt, grouped by prompt, and keep
    that index in every output. Step ``t`` runs the model on the rows still decoding (the
    *live* rows) for one position, asks the explorer for the emitted tokens and the next
    inputs, and writes token ``t`` and its log-prob into the live rows' outputs. When rows end
    with EOS they leave the batch: their rows are dropped from the KV cache, the attention
    mask, the positions and the next inputs, so later steps cost only what is still running.
    A row that reaches ``max_new_tokens`` without EOS is ``truncated``.

    The explorer sees every row, always. Its logits are [rows, V] in the original row order:
    the live rows' fresh logits, and for rows that have ended their last logits, whose choices
    are discarded. So an explorer that keys anything on the row index (per-row seeds, row
    schedules) gets the same rows at every step, and the sampling generator is consumed
    exactly as by a batch that never shrinks (``drop_finished_rows=False`` keeps ended rows
    decoding padding, the behaviour before rows could leave; kept for comparisons).

    Reproducibility: the same seed and settings give the same rollouts. With rows leaving or
    not, the generator draws the same numbers, but a row's logits can differ in their last bits
    with the batch's size (matmul kernels sum in a different order), which is enough to flip a
    sampled token that falls on a boundary of the sampler's cumulative distribution, and that
    row then continues differently. So the two agree exactly on the tiny test model and greedy
    decoding agrees with ``generate``, while long sampled rollouts of a real model agree only
    in distribution; the same holds against rollouts made before rows could leave.

    Args:
        model: a causal LM (the policy being trained).
        tokenizer: its tokenizer (pad token required).
        max_new_tokens: default response length limit.
        seed: seed of the sampling generator (reproducible rollouts).
        ignore_eos: no id ends a response: every row is ``max_new_tokens`` long (``rollout.ignore_eos``).
        drop_finished_rows: rows that end leave the decoding batch (default).
        drop_min_frac: ended rows leave together, once they make up at least this fraction of
            the decoding batch (0: each step's ended rows at once). Until then they decode
            padding: a small batch saves more by compacting less often.
        backend: the backend that prepared the model (:mod:`ngrpo_lightning.backends`): it states
            the KV cache's dtype (``Backend.kv_cache_dtype``). None: the cache keeps the model's
            dtype (a model no backend prepared).
        checks_every: decoding steps between the host's looks at which rows ended (default: the
            backend's ``decode_checks_every``; 1 without a backend). Ended rows' bookkeeping stays
            on the device in between; a row that ended keeps decoding padding until the next look,
            and the rollout is the same, only its leaving and the loop's end come later.
        static_cache: decode on a static KV cache with a full-width mask (:mod:`.static_cache`:
            fixed shapes, the batch in :func:`~.static_cache.batch_buckets`), the decoding step a
            CUDA graph can replay (default: the backend's ``static_decoding``; off without one).
        graphs: with the static cache, replay each decoding step from a CUDA graph per batch
            bucket (``"cuda"``: the whole step, :mod:`.step_graphs`, where the explorer declares
            ``capturable``, else the model's step, :mod:`.decode_graphs`; ``"compile"``: the step compiled by
            ``torch.compile``, with CUDA graphs on a GPU; ``"rerun"`` runs the step on the graphs'
            buffers, the CPU's check); default: the backend's ``decode_graphs``; ``False``: none,
            whatever the backend's (the static cache run eagerly, a measurement's baseline).
        sharded_root: under FSDP2, the policy's root module (see :mod:`ngrpo_lightning.training.parallel`):
            a rollout decodes on a copy of the gathered weights, or unshards the policy once, not once
            per decoding step (the backend's choice, :mod:`.sharded_decoding`).
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
        self.static_cache, self.graphs = static_cache, graphs
        self.backend = backend
        self._told: set[type] = set()  # explorer classes said not to be sync_free
        self._told_steps: set[type] = set()  # explorer classes said not to be capturable
        self._caches = StaticCaches()  # kept across rollouts with their graphs (static decoding)
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
        """The engine decodes with ``policy`` itself (under FSDP2, unsharding ``sharded_root`` and
        the policy's sharded layers once per rollout); ``max_prompt_tokens`` is not needed."""
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
        # inference_mode is measurably faster than no_grad per decoding step; its tensors
        # cannot enter autograd, so the (small) outputs are cloned out of it.
        model, sharded = self.model, self._fsdp_modules()
        if sharded:  # FSDP2: on a copy of the gathered weights, or through the policy unsharded (.sharded_decoding)
            if self._copy is None:
                self._copy = DecodeCopy.of(self.model, self.backend or backend_for(self.model))
            model = self._copy.refresh(sharded, self.policy_version)
            if model is None:  # the policy's modules decode, their FSDP2 hooks at every step: eagerly
                with unsharded(sharded):
                    batch = self._generate(prompts, explorer, n, max_new_tokens, self.model, static=False)
                batch.stats["rollout/sharded_on_copy"] = 0.0
                return batch
        with torch.inference_mode():
            batch = self._generate(prompts, explorer, n, max_new_tokens, model, self._static())
        if sharded:
            batch.stats["rollout/sharded_on_copy"] = 1.0
        return batch.clone()

    def _generate(self, prompts, explorer: Explorer, n: int, max_new_tokens: int | None, model, static: bool):
        t0 = time.perf_counter()  # the packing counts in the rollout's time
        # graphs read LoRA's merged copies where they were recorded: those keep their storage
        keep = static and self._replay() is not None
        with packed_for_pass(model, rows=len(prompts) * n, decoding=True, keep=keep):
            return self._decode(model, static, prompts, explorer, n, max_new_tokens, t0)

    def _static(self) -> bool:
        """Whether rollouts decode on the static cache (this engine's setting, else the backend's)."""
        if self.static_cache is not None:
            return self.static_cache
        return self.backend.static_decoding if self.backend is not None else False

    def _replay(self) -> str | None:
        """How a static-cache step is replayed (:mod:`.decode_graphs`), or ``None`` (run as it is)."""
        if not self._static() or self.graphs is False:
            return None
        return self.graphs if self.graphs is not None else getattr(self.backend, "decode_graphs", None)

    def _static_decoding(self, model, length: int, rows: int, explorer: Explorer, start, max_new: int):
        """The kept static cache for ``rows`` rows (restarted) and its graphs, recorded again only
        when the cache is new or what they were recorded with changed (:meth:`DecodeGraphs.current`,
        :meth:`StepGraphs.current`): whole steps where the explorer can be recorded, else the model's."""
        cache, kept = self._caches.get(model, length, rows)
        replay = self._replay()
        if not replay:
            return cache, None
        graphs = self._caches.graphs.get(rows)
        whole = self.backend is None or self.backend.decode_whole_steps  # the backend's choice
        if replay in ("cuda", "rerun") and whole and declares_capturable(explorer):
            gen = start.generator
            if not (
                kept
                and isinstance(graphs, StepGraphs)
                and graphs.replay == replay
                and graphs.current(model, cache, explorer, gen, max_new)
            ):
                state = self._new_state(rows, max_new, cache.layers[0].cumulative_length.device, start)
                embedding = model.get_input_embeddings().weight
                graphs = self._caches.graphs[rows] = StepGraphs(model, cache, replay, state, explorer, gen, embedding)
            return cache, graphs
        if replay == "cuda" and whole and type(explorer) not in self._told_steps:
            self._told_steps.add(type(explorer))
            log.info(
                "explorer %s does not declare capturable: its steps run between the model's replayed steps "
                "(docs/explorers.md, 'On a GPU, never wait for the host')",
                type(explorer).__name__,
            )
        if not (kept and type(graphs) is DecodeGraphs and graphs.replay == replay and graphs.current(model, cache)):
            graphs = self._caches.graphs[rows] = DecodeGraphs(model, cache, replay)
        return cache, graphs

    def _new_state(self, rows: int, capacity: int, device, start) -> DecodeState:
        eos = torch.tensor(self.eos_ids, device=device, dtype=torch.long)
        marker = start.marker.rows(rows, device) if start.marker is not None else None  # on the device
        return DecodeState(rows, capacity, device, self.tokenizer.pad_token_id, eos, start.temperature, marker)

    def _decode(
        self, model, static: bool, prompts, explorer: Explorer, n: int, max_new_tokens: int | None, t0: float
    ) -> RolloutBatch:
        """One rollout with ``model`` (the policy, or a copy of its weights), on the static cache or not."""
        pad_id = self.tokenizer.pad_token_id
        max_new = max_new_tokens or self.max_new_tokens
        was_training = model.training
        set_training(model, False)  # model.eval(), one loop over a peft model's thousands of modules
        embedding = model.get_input_embeddings().weight
        device = embedding.device
        start = self.start(explorer, embedding)
        gen = start.generator

        prompt_ids, prompt_mask = pad_rows([p for p in prompts for _ in range(n)], pad_id, left=True)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        rows, width = prompt_ids.shape
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(rows, max_new)], dim=1)  # step t reads width + t columns
        position = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        graphs, warmup_s = None, 0.0
        if static:  # fixed shapes: a kept cache at least as long as the rollout, the batch in buckets
            cache, graphs = self._static_decoding(model, width + max_new, rows, explorer, start, max_new)
            buckets, warmup_s = batch_buckets(rows), graphs.warmup_s if graphs is not None else 0.0
            length = cache.layers[0].max_cache_len
            mask = torch.nn.functional.pad(mask, (0, length - mask.shape[1]))  # columns past the rollout: masked
            columns = torch.arange(length, device=device)
        else:  # no per-step concatenation of the whole cache
            store = self.backend.kv_cache_dtype(model) if self.backend is not None else None
            reads = self.backend.kv_read_width(model) if self.backend is not None else None
            cache = reserved_cache(width + max_new, store, reads)
        whole_steps = isinstance(graphs, StepGraphs)  # the explorer and the bookkeeping replayed too
        state = graphs.state if whole_steps else self._new_state(rows, max_new, device, start)
        state.restart(max_new, width)
        checks_every = self.checks_every or (self.backend.decode_checks_every if self.backend is not None else 1)
        if checks_every > 1 and not explorer.sync_free and type(explorer) not in self._told:
            self._told.add(type(explorer))  # one line per engine and explorer class
            log.info(
                "explorer %s does not declare sync_free: its steps may make the host wait for the device at "
                "every token (docs/explorers.md, 'On a GPU, never wait for the host')",
                type(explorer).__name__,
            )
        # The first step: the prompts' prefill. The n samples of a prompt share it: each prompt runs
        # once, its cache rows repeated.
        first = slice(None, None, n) if n > 1 else slice(None)
        out = model(
            inputs_embeds=embedding[prompt_ids[first]],
            attention_mask=mask[first] if static else mask[first, :width],
            position_ids=position[first],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **({"cache_position": torch.arange(width, device=device)} if static else {}),
        )
        logits = out.logits[:, -1].float()
        if n > 1:
            logits = logits.repeat_interleave(n, 0)
            cache.reorder_cache(torch.arange(rows, device=device) // n)
        inputs = state.advance(logits, explorer, gen, embedding)[:, None]
        batch = Batch(inputs, position[:, -1:] + 1, mask, None)
        if whole_steps:
            batch = graphs.batch(rows).fill(batch)
        steps = 1
        for t in range(max_new):
            if t > 0:
                steps = t + 1
                if whole_steps:  # the step writes the state and the batch's next inputs itself
                    logits = graphs.step(batch)
                else:
                    at = state.start + (t - 1)  # the cache slot this step writes (static cache)
                    logits = self._model_step(model, cache, graphs, batch, at, width + t, columns if static else None)
                    inputs = state.advance(logits, explorer, gen, embedding, batch.live)
                    batch = Batch(inputs[:, None], batch.position + 1, batch.mask, batch.live)
            # the ended rows' bookkeeping stays on the device; the host looks every checks_every steps
            if (t + 1) % checks_every == 0:
                if bool(state.finished.all()):
                    break
                stale, keep = state.finished if batch.live is None else state.finished[batch.live], None
                if self.drop_finished_rows and int(stale.sum()) >= max(1, self.drop_min_frac * len(stale)):
                    keep = (~stale).nonzero().squeeze(-1)
                    if static:  # to the smallest bucket that holds the live rows, topped up with ended ones
                        size = next(b for b in buckets if b >= len(keep))
                        keep = torch.cat([keep, stale.nonzero().squeeze(-1)])[:size]
                if keep is not None and len(keep) < len(stale):
                    if batch.live is None:  # the batch still had every row: the explorer keeps seeing them
                        if state.explorer_logits is None:
                            state.explorer_logits = torch.empty_like(logits)
                        state.explorer_logits.copy_(logits)
                    batch = batch.select(keep)
                    if whole_steps:
                        batch = graphs.batch(len(keep)).fill(batch)
                    cache.batch_select_indices(keep)

        if was_training:
            set_training(model, True)
        if bool(state.finished.all()):  # the loop may have run up to checks_every - 1 steps past the last end
            steps = int(state.lengths.max())
        lengths = state.lengths.clamp(max=steps)
        response_mask = (torch.arange(steps, device=device)[None] < lengths[:, None]).long()
        elapsed = time.perf_counter() - t0
        response_ids = state.tokens[:, :steps].clone()  # a kept state is refilled by the next rollout
        texts = self.tokenizer.batch_decode(response_ids.cpu(), skip_special_tokens=True)
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
                **({"rollout/graph_warmup_s": graphs.warmup_s - warmup_s} if graphs is not None else {}),
                # 1 where the graphs hold whole steps (the explorer and bookkeeping too), 0 the model's only
                **({"rollout/graphs_whole_step": float(whole_steps)} if graphs is not None else {}),
            },
        )

    @staticmethod
    def _model_step(model, cache, graphs, batch: Batch, at: torch.Tensor, read: int, columns) -> torch.Tensor:
        """The logits [b, V] float32 of one decoding step that writes cache slot ``at`` and reads the
        first ``read`` columns of the mask: replayed from ``graphs`` (the model's step only), or run as
        it is on the static cache (``columns``: its column indices) or on the growing one (None)."""
        if graphs is not None:  # the mask built here, causal up to this step
            step_mask = (batch.mask.bool() & (columns < read))[:, None, None, :]
            logits = graphs(batch.inputs, batch.position, step_mask, at)
            # the graph's buffer is overwritten by the next step: a copy (a half model's cast is one)
            return logits.float() if logits.dtype != torch.float32 else logits.clone()
        if columns is not None:  # the mask's full width, and where this step writes
            fixed, step_mask = {"cache_position": at}, batch.mask
        else:  # a decoding step's 4D mask, built here: transformers' own would wait for the device
            fixed, step_mask = {}, batch.mask[:, :read].bool()[:, None, None, :]
        out = model(
            inputs_embeds=batch.inputs,
            attention_mask=step_mask,
            position_ids=batch.position,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **fixed,
        )
        return out.logits[:, -1].float()
