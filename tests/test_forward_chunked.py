"""Chunked log-probs (``response_logprobs(..., chunk_size=c)``) against the full-logits path.

The chunked path applies the LM head to ``c`` tokens at a time and recomputes each chunk in
backward. It must give the full path's values, entropies and gradients (every parameter:
decoder, head, tied embeddings through both the head and the rebuilt inputs), and must never
hold an [N, L, V] tensor.

Tolerances. In float64 the two formulations agree to 1e-10: that is the exactness check. In
float32 they sum the same terms in a different order (per chunk, and the softmax gradient as
``onehot - exp(z - lse)`` rather than through ``log_softmax``'s output); gradients of a random
model are sums of many cancelling terms, so their float32 noise is a few 1e-6 of each tensor's
largest entry (measured: at most 8e-6), hence 2e-5 of the largest entry.
"""

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from ngrpo_lightning.rollout import InputRecords, RolloutBatch
from ngrpo_lightning.training.forward import ChunkedTokenLogprobs, response_logprobs, split_lm_head

N, P, L = 4, 6, 11


def make_batch(vocab: int, n: int = N, p: int = P, length: int = L, seed: int = 0) -> RolloutBatch:
    """Left-padded prompts, right-padded responses of different lengths (one row with a single
    token, one empty padding row), and mixed-step records in several rows, with noise in some."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, vocab, (n, p), generator=g)
    prompt_mask = torch.ones(n, p, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[2:3, :4] = 0
    response_ids = torch.randint(0, vocab, (n, length), generator=g)
    lengths = ([length, length - 4, 1, 0] + [length] * n)[:n]
    response_mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    records = InputRecords(
        row=torch.tensor([0, 0, 1, 1]),
        pos=torch.tensor([0, 5, 2, 6]),
        ids=torch.randint(0, vocab, (4, 3), generator=g),
        weights=torch.rand(4, 3, generator=g).softmax(-1),
        noise_seed=torch.tensor([11, -1, 12, -1]),
        noise_scale=torch.tensor([0.3, 0.0, 0.2, 0.0]),
    )
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(n, length), records)


def small_llama(vocab: int = 512, hidden: int = 32, tied: bool = True, bias: bool = False, seed: int = 0):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if bias:  # Llama has no head bias: give it one, the full path then adds it too
            head = torch.nn.Linear(hidden, vocab, bias=True)
            torch.nn.init.normal_(head.bias, std=0.5)
            head.weight = model.lm_head.weight if tied else head.weight
            model.lm_head = head
    return model.train()


def run(model, batch, chunk_size, temperature=1.0, with_entropy=True, keep_softmax_mib=0):
    """(log-probs, entropy, {name: grad}) of a weighted sum of the log-probs. ``keep_softmax_mib``:
    0 recomputes the logits in backward, a large budget keeps the forward's softmax."""
    model.zero_grad(set_to_none=True)
    logp, entropy = response_logprobs(
        model, batch, temperature, with_entropy=with_entropy, chunk_size=chunk_size, keep_softmax_mib=keep_softmax_mib
    )
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1), dtype=logp.dtype)
    (logp * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy, grads


def full_float64_reference(model, batch, temperature):
    """The full-logits log-probs computed in float64 throughout (the library's full path takes
    its softmax in float32 whatever the model's dtype)."""
    from ngrpo_lightning.rollout import build_inputs_embeds
    from ngrpo_lightning.training.forward import position_ids_from_mask

    mask = batch.attention_mask
    embedding = model.get_input_embeddings().weight
    embeds = build_inputs_embeds(embedding, batch.input_ids, batch.records, batch.response_offset)
    length = batch.response_ids.shape[1]
    logits = (
        model(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=False,
            logits_to_keep=length + 1,
        ).logits[:, :-1]
        / temperature
    )
    return torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask


def assert_grads_close(got, ref, rel):
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        err = (got[name] - r).abs().max().item()
        assert err <= rel * r.abs().max().item() + 1e-30, f"{name}: {err:.3g} vs max {r.abs().max().item():.3g}"


@pytest.fixture(scope="module")
def tiny_copy(tiny):
    """A private copy of the tiny model (tied embeddings), so that gradients stay here."""
    return copy.deepcopy(tiny[0]).train()


KEEP = pytest.mark.parametrize("keep", [0, 512], ids=["recompute", "keep-softmax"])


@KEEP
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 512])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tiny_model_values_entropy_and_gradients_equal_the_full_path(tiny_copy, chunk_size, temperature, keep):
    model = tiny_copy
    assert model.config.tie_word_embeddings and split_lm_head(model) is not None
    batch = make_batch(model.config.vocab_size)
    ref_logp, ref_entropy, ref_grads = run(model, batch, None, temperature)
    logp, entropy, grads = run(model, batch, chunk_size, temperature, keep_softmax_mib=keep)
    mask = batch.response_mask.bool()
    assert (logp - ref_logp).abs().max() <= 1e-5
    assert (logp[~mask] == 0).all()
    assert (entropy - ref_entropy)[mask].abs().max() <= 1e-5 * ref_entropy[mask].abs().max()
    assert not entropy.requires_grad
    assert "model.embed_tokens.weight" in grads  # tied: the head's and the inputs' gradients, summed
    assert_grads_close(grads, ref_grads, 2e-5)


@pytest.mark.parametrize("tied,bias", [(True, False), (False, False), (False, True), (True, True)])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
@KEEP
def test_float64_chunked_path_is_exact(tied, bias, chunk_size, keep):
    model = small_llama(tied=tied, bias=bias).double()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batch = make_batch(model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    ref = full_float64_reference(model, batch, 0.8)
    (ref * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)).sum().backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    logp, _, grads = run(model, batch, chunk_size, 0.8, with_entropy=False, keep_softmax_mib=keep)
    assert logp.dtype == torch.float64
    assert (logp - ref.detach()).abs().max() <= 1e-10
    if bias:
        assert grads["lm_head.bias"].abs().max() > 0
    assert_grads_close(grads, ref_grads, 1e-10)


@KEEP
def test_untied_head_with_bias_in_float32(keep):
    model = small_llama(tied=False, bias=True)
    batch = make_batch(model.config.vocab_size)
    ref_logp, ref_entropy, ref_grads = run(model, batch, None, 1.3)
    logp, entropy, grads = run(model, batch, 5, 1.3, keep_softmax_mib=keep)
    mask = batch.response_mask.bool()
    assert (logp - ref_logp).abs().max() <= 1e-5
    assert (entropy - ref_entropy)[mask].abs().max() <= 1e-5 * ref_entropy[mask].abs().max()
    assert_grads_close(grads, ref_grads, 2e-5)


@KEEP
@pytest.mark.parametrize("tied,bias,grad_slice", [(True, False, None), (False, True, None), (True, False, 7)])
def test_the_head_s_packed_log_prob_chunks_give_the_full_path_s_values_and_gradients(
    tied, bias, grad_slice, keep, monkeypatch
):
    """``pack_logits`` (the CPU backend's ``packed_logits``): each chunk's logits and backward's
    products on oneDNN, the weight's gradient summed a slice of V's rows at a time (``grad_slice``: a
    few rows, the last slice short); the same values, entropies and gradients as the full path to
    float32's rounding."""
    from ngrpo_lightning.backends import packing
    from ngrpo_lightning.backends.packing import BackendLinear, packing_available

    if not packing_available(torch.float32):
        pytest.skip("this CPU build has no oneDNN packing")
    if grad_slice is not None:
        monkeypatch.setattr(packing, "WEIGHT_GRAD_SLICE", grad_slice)
    model = small_llama(tied=tied, bias=bias)
    batch = make_batch(model.config.vocab_size)
    ref_logp, ref_entropy, ref_grads = run(model, batch, None, 0.7)
    head = BackendLinear.swap_in(
        model.get_output_embeddings(), False, False, "test", decode_only=True, pack_logits=True
    )
    assert head.pack_logits and split_lm_head(model)[1] is head
    logp, entropy, grads = run(model, batch, 5, 0.7, keep_softmax_mib=keep)
    mask = batch.response_mask.bool()
    assert (logp - ref_logp).abs().max() <= 1e-5
    assert (entropy - ref_entropy)[mask].abs().max() <= 1e-5 * ref_entropy[mask].abs().max()
    assert_grads_close(grads, ref_grads, 2e-5)


def test_a_bfloat16_head_s_packed_chunks_match_its_plain_chunks():
    """``pack_logits`` on a bfloat16 head: oneDNN's products in bfloat16, the weight's gradient summed
    in float32, as the plain chunks do; the two agree to bfloat16's rounding."""
    from ngrpo_lightning.backends.packing import BackendLinear, packing_available

    if not packing_available(torch.bfloat16):
        pytest.skip("this CPU build has no oneDNN bfloat16 products")
    model = small_llama(tied=False).to(torch.bfloat16)
    batch = make_batch(model.config.vocab_size)
    ref_logp, _, ref_grads = run(model, batch, 5)
    BackendLinear.swap_in(model.get_output_embeddings(), False, False, "test", decode_only=True, pack_logits=True)
    logp, _, grads = run(model, batch, 5)
    assert logp.dtype == torch.float32 and (logp - ref_logp).abs().max() <= 0.05
    assert grads["lm_head.weight"].dtype == torch.bfloat16
    assert_grads_close(grads, ref_grads, 0.03)


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep-softmax"])
def test_autograd_function_passes_gradcheck(keep):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(13, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 13, (7,), generator=g)
    fn = lambda h, w, b: ChunkedTokenLogprobs.apply(h, w, b, targets, 0.7, 3, False, keep)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@KEEP
def test_bfloat16_model_matches_the_full_path(tiny_copy, keep):
    model = copy.deepcopy(tiny_copy).to(torch.bfloat16)
    batch = make_batch(model.config.vocab_size)
    ref_logp, _, ref_grads = run(model, batch, None)
    logp, _, grads = run(model, batch, 4, keep_softmax_mib=keep)
    assert logp.dtype == torch.float32
    assert (logp - ref_logp).abs().max() <= 1e-5  # the same bf16 logits, both softmaxes in float32
    assert_grads_close(grads, ref_grads, 2e-2)  # bf16 gradients, rounded at different places


def test_chunk_size_must_be_positive(tiny_copy):
    batch = make_batch(tiny_copy.config.vocab_size)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"chunk_size={bad}.*positive"):
            response_logprobs(tiny_copy, batch, chunk_size=bad)


def test_models_with_a_logit_transform_take_the_full_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).train()
    assert split_lm_head(model) is None
    batch = make_batch(256)
    ref, _, ref_grads = run(model, batch, None)
    got, _, grads = run(model, batch, 4)
    assert torch.equal(got, ref)  # same path, soft-capping included
    assert_grads_close(grads, ref_grads, 1e-6)
    config.final_logit_softcapping = None
    assert split_lm_head(model) is not None


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op outputs while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_n_x_l_x_vocab_is_saved_or_created():
    """Every tensor saved for backward and every op output, forward and backward, stays far below
    N x L x V with the chunked path; the full path (checked too, so the probe is known to bite)
    creates several."""
    vocab, n, length, chunk = 4096, 2, 64, 8
    model = small_llama(vocab=vocab, hidden=16, tied=True)
    batch = make_batch(vocab, n=n, length=length)
    batch.response_mask.fill_(1)
    budget = n * length * vocab

    def largest(chunk_size, keep_softmax_mib=0):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            with LargestOutput() as probe:
                logp, entropy = response_logprobs(
                    model, batch, 0.9, with_entropy=True, chunk_size=chunk_size, keep_softmax_mib=keep_softmax_mib
                )
                logp.sum().backward()
        model.zero_grad(set_to_none=True)
        return max(saved), probe.largest

    saved, created = largest(chunk)
    assert saved < budget / 4 and created < budget / 4, (saved, created, budget)  # E [V, d], [chunk, V] logits
    saved_full, created_full = largest(None)
    assert saved_full >= budget and created_full >= budget
    # a softmax budget bounds what is kept: 1 MiB is below this batch's 2 MiB, 2 MiB holds it exactly
    assert budget * 4 == 2 * 2**20
    assert max(largest(chunk, keep_softmax_mib=1)) < budget / 4
    saved_kept, created_kept = largest(chunk, keep_softmax_mib=2)
    assert saved_kept == budget and created_kept == budget


def test_kept_softmax_only_when_a_backward_follows():
    """No-grad passes (reference, old log-probs) never allocate the [M, V] softmax; a retained
    graph runs backward twice with the same gradients (the kept softmax is left as it is)."""
    model = small_llama(vocab=512, hidden=16, tied=True)
    batch = make_batch(512)
    batch.response_mask.fill_(1)
    with torch.no_grad(), LargestOutput() as probe:
        response_logprobs(model, batch, chunk_size=4, keep_softmax_mib=512)
    assert probe.largest < batch.response_mask.numel() * 512
    logp, _ = response_logprobs(model, batch, chunk_size=4, keep_softmax_mib=512)
    logp.sum().backward(retain_graph=True)
    first = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    logp.sum().backward()
    assert torch.equal(model.lm_head.weight.grad, first) and first.abs().max() > 0


class LiveChunkBuffers(TorchDispatchMode):
    """Counts, as each new [rows, V] tensor is made (not a view), how many of those made before are still alive."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.made, self.count, self.most_alive = vocab, [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [
            t.untyped_storage().data_ptr() for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)
        ]
        fresh = isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == self.vocab
        fresh = fresh and out.untyped_storage().data_ptr() not in inputs  # not a view, not an in-place op's tensor
        if fresh:
            alive = [ref for ref in self.made if ref() is not None]
            self.most_alive = max(self.most_alive, len(alive) + 1)
            self.made, self.count = [*alive, weakref.ref(out)], self.count + 1
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_forward_holds_one_chunk_of_logits_at_a_time(with_entropy):
    """Forward and backward, each chunk's [chunk, V] logits are freed before the next chunk's are made, so the
    allocator hands the next chunk the same memory (a fresh [chunk, V] buffer at a real vocabulary is about 100 MiB
    of first-touch pages)."""
    vocab, chunk = 4096, 8
    weight = torch.randn(vocab, 16, requires_grad=True)
    hidden, targets = torch.randn(5 * chunk, 16, requires_grad=True), torch.randint(vocab, (5 * chunk,))
    with LiveChunkBuffers(vocab) as probe:
        logp, _ = ChunkedTokenLogprobs.apply(hidden, weight, None, targets, 1.0, chunk, with_entropy, False, False)
        made_in_forward = probe.count
        logp.sum().backward()  # backward recomputes each chunk's logits in turn
    assert made_in_forward == 5 and probe.count == 10 and probe.most_alive == 1
