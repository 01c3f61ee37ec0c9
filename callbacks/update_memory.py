"""UpdateMemoryCheck: a warning at the start of training when the update cannot fit in memory.

Autograd keeps tensors in proportion to a micro-batch's tokens, so long responses can exhaust memory
after the first rollout, with nothing saved. At the start of fit this callback measures what the
training forward keeps per token (one short probe row, weights not counted), adds 40% for
backward's own tensors, multiplies by the response tokens of the largest micro-batch the settings
allow, adds the kept LM-head softmax, the gradients and the AdamW moments not yet allocated, and
compares with 90% of the memory available (docs/performance.md, "Long responses: micro-batches and
a token budget"). When it does not fit, it warns with a token budget that would
(``optim.max_tokens_per_micro_batch``, or ``optim.micro_batch_size``). One process only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from ngrpo_lightning.backends.recompute import tallying_kept
from ngrpo_lightning.rollout.batch import RolloutBatch
from ngrpo_lightning.rollout.context import RunContext, run_context
from ngrpo_lightning.training.forward import response_logprobs

GIB = 1024**3


@dataclass(frozen=True)
class UpdateMemory:
    """The estimate, in bytes: ``needed`` (at least) against ``available``."""

    kept_per_token: float  # activations the training forward keeps per token
    tokens: int  # response tokens of the largest micro-batch
    softmax: int  # LM-head softmax kept for backward (0 when above the backend's keep_softmax_mib)
    optimizer: int  # gradients + AdamW moments not yet allocated
    available: int
    # backward's own tensors (recomputed activations, gradients, LM-head chunks) on top of what the
    # forward kept, chosen to cover the packaged model's measured peaks (docs/performance.md)
    margin: float = 1.4

    @property
    def per_token(self) -> float:
        """Bytes one token of a micro-batch costs during the update."""
        return self.margin * self.kept_per_token

    @property
    def needed(self) -> int:
        return int(self.per_token * self.tokens) + self.softmax + self.optimizer

    @property
    def fits(self) -> bool:
        """Within 90% of what is available: the rest for the rollout's and the allocator's own."""
        return self.needed <= 0.9 * self.available

    def budget_that_fits(self, share: float = 0.75) -> int:
        """Tokens per micro-batch whose activations take ``share`` of what remains after the optimizer's
        tensors (rounded down to 256)."""
        room = share * self.available - self.optimizer
        return max(0, int(room / self.per_token) // 256 * 256)


def kept_bytes_per_token(context: RunContext, probe_tokens: int = 128) -> float:
    """Bytes the training forward keeps for backward per token, from one probe row of ``probe_tokens``."""
    policy, backend = context.policy, context.backend
    vocab = policy.get_input_embeddings().weight.shape[0]
    device = next(policy.parameters()).device
    ids = (torch.arange(probe_tokens, device=device) % (vocab - 3) + 3).unsqueeze(0)
    ones = torch.ones_like(ids)
    probe = RolloutBatch(
        prompt_ids=ids[:, :-1],
        prompt_mask=ones[:, :-1],
        response_ids=ids[:, -1:],
        response_mask=ones[:, -1:],
        rollout_logprobs=torch.zeros(1, 1, device=device),
    )
    skip = frozenset(t.untyped_storage().data_ptr() for t in [*policy.parameters(), *policy.buffers()])
    kept: dict[int, int] = {}
    with tallying_kept(kept, skip):
        logp, _ = response_logprobs(
            policy,
            probe,
            with_entropy=True,
            chunk_size=backend.logprob_chunk_size,
            keep_softmax_mib=0,  # the kept softmax is counted apart (UpdateMemory.softmax)
        )
    del logp  # the probe's graph goes with it: no backward
    return sum(kept.values()) / probe_tokens


class UpdateMemoryCheck(L.Callback):
    """Warn at the start of fit when the update's largest micro-batch cannot fit in memory.

    Args:
        rows_per_step: rollouts per step (``data.prompts_per_step x rollout.group_size``).
        max_new_tokens: the longest response (``rollout.max_new_tokens``).
        longest_sequence: the smallest token budget allowed (prompt limit + ``max_new_tokens``).
        available_bytes: the memory to compare with (default: what the device has available now).
    """

    def __init__(
        self, rows_per_step: int, max_new_tokens: int, longest_sequence: int, available_bytes: int | None = None
    ):
        self.rows_per_step, self.max_new_tokens = rows_per_step, max_new_tokens
        self.longest_sequence, self.available_bytes = longest_sequence, available_bytes
        self.estimate: UpdateMemory | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        context = run_context(trainer)
        if trainer.world_size > 1 or context.sharded:
            return
        self.estimate = self.measure(trainer, context)
        if not self.estimate.fits:
            rank_zero_warn(self.advice(self.estimate))

    def measure(self, trainer: L.Trainer, context: RunContext) -> UpdateMemory:
        plan, backend, policy = context.update, context.backend, context.policy
        rows = math.ceil(self.rows_per_step / plan.num_mini_batches)
        rows = min(plan.micro_batch_size or rows, rows)
        tokens = rows * self.max_new_tokens
        if plan.max_tokens is not None:
            tokens = min(tokens, plan.max_tokens)
        vocab = policy.get_input_embeddings().weight.shape[0]
        softmax = tokens * vocab * 4  # float32 probabilities
        if backend.logprob_chunk_size is not None and softmax > backend.keep_softmax_mib * 2**20:
            softmax = 0  # recomputed chunk by chunk in backward instead
        trainable = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
        allocated = sum(
            t.numel() * t.element_size()
            for opt in trainer.optimizers
            for state in opt.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        with torch.enable_grad():  # the probe keeps what a training forward keeps
            per_token = kept_bytes_per_token(context)
        return UpdateMemory(
            kept_per_token=per_token,
            tokens=tokens,
            softmax=softmax,
            optimizer=trainable + max(0, 2 * trainable - allocated),
            available=self.available_bytes if self.available_bytes is not None else available_memory(context.device),
        )

    def advice(self, est: UpdateMemory) -> str:
        head = (
            f"the update needs about {est.needed / GIB:.1f} GiB ({est.per_token / 2**10:.0f} KiB per token x "
            f"{est.tokens} response tokens in its largest micro-batch, plus gradients and optimizer state), "
            f"more than 90% of the {est.available / GIB:.1f} GiB available: the run would be killed when it "
            "first trains."
        )
        budget = est.budget_that_fits()
        if budget >= self.longest_sequence:
            return f"{head} Split it into micro-batches: optim.max_tokens_per_micro_batch={budget}"
        rows = budget // self.max_new_tokens  # a token budget must hold the longest possible prompt too
        if rows >= 1:
            return f"{head} Split it into micro-batches: optim.micro_batch_size={rows}"
        return (
            f"{head} Even one response of {self.max_new_tokens} tokens does not fit a micro-batch: "
            "set model.gradient_checkpointing=true, or lower rollout.max_new_tokens"
        )


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the GPU's free memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
