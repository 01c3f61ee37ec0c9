"""Turn problems into tokenized prompts.

The user turn is ``question + "\\n" + instruction`` (by default DeepSeek-R1 / DeepScaleR's request for
a ``\\boxed{}`` answer), through the chat template with the generation prompt appended."""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import Dataset

from ngrpo_lightning.config import ConfigError

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer, question: str, instruction: str | None = DEFAULT_INSTRUCTION, system_prompt: str | None = None
) -> str:
    """The prompt text for ``question`` (None instruction = the default; "" = none); without a chat template (a base
    model), the plain ``question\\ninstruction\\n``."""
    if instruction is None:
        instruction = DEFAULT_INSTRUCTION
    content = f"{question}\n{instruction}" if instruction else question
    if not has_chat_template(tokenizer):
        prefix = f"{system_prompt}\n\n" if system_prompt else ""
        return f"{prefix}{content}\n"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset(Dataset):
    """Prompts tokenized up front; those over ``max_prompt_tokens`` are dropped (``num_dropped``) with a warning. Items:
    ``{"id", "prompt_ids", "prompt_text", "answer", "verifier"}`` (``verifier``: ``meta["verifier"]`` or None)."""

    def __init__(
        self,
        problems,
        tokenizer,
        max_prompt_tokens: int = 4096,
        instruction: str | None = DEFAULT_INSTRUCTION,
        system_prompt: str | None = None,
    ):
        if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be a positive integer, got {max_prompt_tokens!r}")
        self.max_prompt_tokens = max_prompt_tokens
        problems = list(problems)
        texts = [render_prompt(tokenizer, p["question"], instruction, system_prompt) for p in problems]
        # a chat template already contains BOS: only plain prompts need special tokens added
        encoded = tokenizer(texts, add_special_tokens=not has_chat_template(tokenizer))["input_ids"] if texts else []
        self.items: list[dict[str, Any]] = []
        for p, text, ids in zip(problems, texts, encoded):
            if len(ids) <= max_prompt_tokens:
                self.items.append(
                    {
                        "id": str(p["id"]),
                        "prompt_ids": list(ids),
                        "prompt_text": text,
                        "answer": str(p["answer"]),
                        "verifier": (p.get("meta") or {}).get("verifier"),
                    }
                )
        self.num_total = len(problems)
        self.num_dropped = self.num_total - len(self.items)
        if self.num_dropped:
            log.warning(
                "dropped %d of %d prompts longer than %d tokens", self.num_dropped, self.num_total, max_prompt_tokens
            )
            if not self.items:  # a setting to change, said before any step (a ConfigError reaches the command line)
                shortest = min(len(ids) for ids in encoded)
                raise ConfigError(
                    f"all {self.num_total} prompts are longer than data.max_prompt_tokens={max_prompt_tokens} tokens "
                    f"(the shortest has {shortest}): raise data.max_prompt_tokens"
                )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def collate_prompts(items: list[dict[str, Any]]) -> dict[str, list]:
    """A batch as a dict of lists; no padding (the rollout engine pads)."""
    keys = ("id", "prompt_ids", "prompt_text", "answer", "verifier")
    return {k: [item.get(k) for item in items] for k in keys}
