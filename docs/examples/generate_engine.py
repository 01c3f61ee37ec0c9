"""A user-written rollout engine: transformers' own ``generate``, for plain sampling."""

import time

import torch
from transformers import GenerationConfig

from ngrpo_lightning.explorers import TemperatureExplorer
from ngrpo_lightning.rollout import RolloutBatch, RolloutEngine, register_engine
from ngrpo_lightning.rollout.engine import eos_token_ids
from ngrpo_lightning.rollout.padding import pad_rows


@register_engine("hf_generate")
class GenerateEngine(RolloutEngine):
    """``model.generate`` feeds tokens, not embeddings: plain sampling only, no mixing."""

    def __init__(self, model, tokenizer, max_new_tokens=256, seed=0, ignore_eos=False):
        self.model, self.tokenizer, self.max_new_tokens, self.seed = model, tokenizer, max_new_tokens, seed
        self.set_eos_ids(eos_token_ids(model.generation_config.eos_token_id, tokenizer), ignore_eos)

    @classmethod
    def check_explorer(cls, explorer):  # called before any model loads, and before each rollout
        if type(explorer) is not TemperatureExplorer:
            raise ValueError(f"rollout.engine: {cls.__name__} cannot run {type(explorer).__name__}: use hf")

    def generate(self, prompts, explorer, n=1, max_new_tokens=None):
        self.check_explorer(explorer)
        start = self.start(explorer, self.model.get_input_embeddings().weight, native=True)
        pad_id, device = self.tokenizer.pad_token_id, self.model.device
        prompt_ids, prompt_mask = pad_rows([p for p in prompts for _ in range(n)], pad_id, left=True)
        greedy = not explorer.temperature
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else explorer.temperature,
            top_k=explorer.top_k or None,
            top_p=explorer.top_p,
            min_p=explorer.min_p or None,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            eos_token_id=self.eos_ids or None,
            pad_token_id=pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # sampling draws from the engine's seed
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=start.generator)))
            out = self.model.generate(
                input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device), generation_config=config
            )
        response = out.sequences[:, prompt_ids.shape[1] :].cpu()
        ended = torch.isin(response, torch.tensor(self.eos_ids, dtype=torch.long)).long()
        response_mask = (ended.cumsum(-1) - ended == 0).long()  # up to and including the first EOS
        logits = torch.stack(out.logits, 1).float().cpu() / start.temperature
        logprobs = logits.log_softmax(-1).gather(-1, response[..., None]).squeeze(-1) * response_mask
        response_ids = response.masked_fill(response_mask == 0, pad_id)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            group_size=n,
            response_text=self.tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            truncated=ended.sum(-1) == 0,
            stats=self.rollout_stats(time.perf_counter() - t0, int(response_mask.sum())),
        )
