"""HFEngine: batched decoding of a transformers model, driven by ``inputs_embeds``.

Feeding embeddings rather than token ids is what lets any explorer replace the next
input by a mixture. The loop is the plain KV-cache loop: one prefill of the left-padded
prompts, then one forward of one position per step, the attention mask growing by one
column and position ids continuing from each row's prompt length (exactly what
``model.generate`` does, so greedy outputs agree).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..explorers import Explorer
from .batch import RolloutBatch
from .engine import SeededEngine
from .reconstruction import mixture_embeddings
from .records import InputRecords


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ids and attention mask tensors."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """All ids that end a response: the generation config's EOS ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def special_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
    """Ids an explorer should never pick by itself: the tokenizer's special tokens and the
    embedding rows no token maps to (vocabularies padded beyond the tokenizer)."""
    return sorted(set(tokenizer.all_special_ids) | set(range(len(tokenizer), vocab_size)))


class HFEngine(SeededEngine):
    """Rollouts with the policy module itself (no weight copy, no sync).

    Args:
        model: a causal LM (the policy being trained).
        tokenizer: its tokenizer (pad token required).
        max_new_tokens: default response length limit.
        seed: seed of the sampling generator (reproducible rollouts).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 256, seed: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.eos_ids = eos_token_ids(model, tokenizer)
        if tokenizer.pad_token_id is None:
            raise ValueError("HFEngine needs a tokenizer with a pad token")

    # ------------------------------------------------------------ rollouts
    def _fsdp_modules(self) -> list:
        """The model's FSDP2 modules (empty when it is not sharded)."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return []
        owner = getattr(self.model, "_ngrpo_fsdp_root", None)
        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        if isinstance(owner, FSDPModule) and owner not in modules:
            modules.insert(0, owner)
        return modules

    def generate(self, prompts, explorer: Explorer, n: int = 1, max_new_tokens: int | None = None) -> RolloutBatch:
        # inference_mode is measurably faster than no_grad per decoding step; its tensors
        # cannot enter autograd, so the (small) outputs are cloned out of it.
        sharded = self._fsdp_modules()
        if sharded:  # FSDP2: gather the full weights once per rollout, not once per decoding step
            return self._generate_unsharded(sharded, prompts, explorer, n, max_new_tokens)
        with torch.inference_mode():
            batch = self._generate(prompts, explorer, n, max_new_tokens)
        return batch.clone()

    def _generate_unsharded(self, modules: list, prompts, explorer: Explorer, n: int, max_new_tokens: int | None) -> RolloutBatch:
        # All-gathers are collectives: every rank enters here the same number of times (the
        # datamodule gives every rank the same number of prompt batches); the decoding loop
        # itself has none, so ranks may stop after different numbers of steps.
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.unshard()
        try:
            with torch.no_grad():  # not inference_mode: FSDP2's unsharded parameters are autograd-visible tensors
                batch = self._generate(prompts, explorer, n, max_new_tokens)
        finally:
            for m in modules:
                m.reshard()
                m.set_reshard_after_forward(m is not modules[0], recurse=False)  # the root keeps its weights (FSDP2's default)
        return batch

    def _generate(self, prompts, explorer: Explorer, n: int, max_new_tokens: int | None) -> RolloutBatch:
        model, pad_id = self.model, self.tokenizer.pad_token_id
        max_new = max_new_tokens or self.max_new_tokens
        was_training = model.training
        model.eval()
        t0 = time.perf_counter()
        embedding = model.get_input_embeddings().weight
        device = embedding.device
        explorer.set_special_ids(special_token_ids(self.tokenizer, embedding.shape[0]))
        explorer.prepare(embedding.detach())
        gen = self.generator(device)
        temperature = explorer.temperature or 1.0  # log-probs of a greedy policy are taken at T=1

        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], pad_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        rows = prompt_ids.shape[0]
        eos = torch.tensor(self.eos_ids, device=device)
        tokens, logprobs, alive_cols, step_records = [], [], [], []
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        mask = prompt_mask
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        inputs = embedding[prompt_ids]
        for t in range(max_new):
            out = model(inputs_embeds=inputs, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1].float()
            step = explorer.step(logits, generator=gen)
            alive = ~done
            token = torch.where(alive, step.tokens, pad_id)
            scaled = logits if temperature == 1.0 else logits / temperature
            logprob = scaled.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)  # no B x V output
            tokens.append(token)
            logprobs.append(torch.where(alive, logprob, 0.0))
            alive_cols.append(alive)
            inputs = embedding[token]
            if step.mixed is not None and (m := step.mixed & alive).any():
                rec = InputRecords.from_step(step, m, t)
                inputs = inputs.index_put((rec.row,), mixture_embeddings(embedding, rec))
                step_records.append(rec)
            done = done | torch.isin(token, eos)
            if bool(done.all()):
                break
            inputs = inputs[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = position[:, -1:] + 1

        if was_training:
            model.train()
        response_mask = torch.stack(alive_cols, 1).long()
        response_ids = torch.stack(tokens, 1)
        n_tokens = int(response_mask.sum())
        elapsed = time.perf_counter() - t0
        texts = self.tokenizer.batch_decode(response_ids.masked_fill(response_mask == 0, pad_id).cpu(), skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=torch.stack(logprobs, 1),
            records=InputRecords.concat(step_records),
            group_size=n,
            response_text=texts,
            truncated=~done,
            stats={"rollout/time_s": elapsed, "rollout/tokens": n_tokens, "rollout/tokens_per_s": n_tokens / max(elapsed, 1e-9)},
        )
