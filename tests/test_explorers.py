"""The exploring explorers, step by step (pure torch, no model): neighbor mixing and its
index, Gaussian noise, Gumbel soft thinking, their configs and their errors."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from ngrpo_lightning.build.components import build_explorer
from ngrpo_lightning.config import ConfigError
from ngrpo_lightning.explorers import (
    EXPLORERS,
    GaussianEmbedNoiseExplorer,
    GaussianNoiseExplorer,
    GumbelSoftExplorer,
    NeighborIndex,
    NeighborMixingExplorer,
    OrthogonalNoiseExplorer,
    TemperatureExplorer,
    TopKGumbelMixExplorer,
    TopKMixExplorer,
)
from ngrpo_lightning.rollout import InputRecords, mixture_embeddings

V, D = 600, 16


@pytest.fixture
def emb():
    """Random embeddings with exact duplicates of row 3 (ties) and a near-zero row."""
    e = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    e[[500, 200, 201]] = e[3].clone()
    e[7] *= 1e-3
    return e


def brute_force(e, metric, n, exclude=()):
    """Reference search: full V x V scores, self and excluded ids out, ties to the lowest id."""
    if metric == "cosine":
        en = torch.nn.functional.normalize(e, dim=-1)
        s = en @ en.T
    elif metric == "dot":
        s = e @ e.T
    else:
        s = -torch.cdist(e, e, p=2 if metric == "l2" else 1)
    s.fill_diagonal_(float("-inf"))
    s[:, list(exclude)] = float("-inf")
    return s.sort(dim=-1, descending=True, stable=True).indices[:, :n]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ the index
@pytest.mark.parametrize("metric", ["cosine", "l2", "l1"])
def test_index_equals_brute_force(emb, metric):
    exclude = [5, 9, 201]
    index = NeighborIndex(emb, 4, metric, exclude_ids=exclude, chunk_size=97, anchor_block=50)  # many chunks
    got = index.query(torch.arange(V))
    assert torch.equal(got, brute_force(emb, metric, 4, exclude))
    assert got[3].tolist()[:2] == [200, 500]  # exact ties: lowest id first; 201 excluded
    assert not (got == torch.arange(V)[:, None]).any()  # never the anchor itself


def test_index_caches_per_anchor_and_precompute_agrees(emb, monkeypatch):
    index = NeighborIndex(emb, 2)
    first = index.query(torch.tensor([4, 4, 8]))
    assert (index.table[:, 0] >= 0).sum() == 2  # two distinct anchors searched
    monkeypatch.setattr(index, "search", lambda a: pytest.fail("cached anchors must not be searched again"))
    assert torch.equal(index.query(torch.tensor([8, 4])), first[[2, 0]])
    full = NeighborIndex(emb, 2)
    full.precompute()
    assert torch.equal(full.table, brute_force(emb, "cosine", 2))


def test_index_is_static_unless_refreshed(emb):
    static, fresh = NeighborMixingExplorer(k=3), NeighborMixingExplorer(k=3, refresh_every=1)
    live = emb.clone()  # like E.detach(): the explorer sees in-place training updates
    for ex in (static, fresh):
        ex.prepare(live)
    before = static.index.query(torch.arange(V)).clone()
    live.copy_(torch.randn(V, D, generator=gen(1)))
    for ex in (static, fresh):
        ex.prepare(live)
    assert torch.equal(static.index.query(torch.arange(V)), before)  # the paper's static index
    assert torch.equal(fresh.index.query(torch.arange(V)), brute_force(live, "cosine", 2))
    assert fresh.state_dict() == {"prepare_calls": 2}
    resumed = NeighborMixingExplorer(k=3, refresh_every=1)
    resumed.load_state_dict(fresh.state_dict())
    assert resumed.state_dict() == {"prepare_calls": 2}


def test_special_ids_are_never_neighbors(emb):
    ex = NeighborMixingExplorer(k=3, rho=1.0)
    special = brute_force(emb, "cosine", 2)[10].tolist()  # make the true neighbors of token 10 special
    ex.set_special_ids(special)
    ex.prepare(emb)
    assert not set(ex.index.query(torch.tensor([10]))[0].tolist()) & set(special)
    assert torch.equal(ex.index.query(torch.tensor([10])), brute_force(emb, "cosine", 2, special)[[10]])
    keep = NeighborMixingExplorer(k=3, rho=1.0, exclude_special=False)
    keep.set_special_ids(special)
    keep.prepare(emb)
    assert keep.index.query(torch.tensor([10]))[0].tolist() == special


# ------------------------------------------------------------ neighbor mixing
@pytest.mark.parametrize("metric", ["cosine", "dot", "l2", "l1"])
def test_mixed_step_anchor_neighbors_and_weights(emb, metric):
    ex = NeighborMixingExplorer(k=3, rho=1.0, metric=metric, temperature=0.7)
    ex.prepare(emb)
    logits = torch.randn(64, V, generator=gen())
    step = ex.step(logits, gen())
    anchor = logits.argmax(-1)
    assert step.mixed.all() and torch.equal(step.tokens, anchor)  # emitted token = anchor
    assert torch.equal(step.ids[:, 0], anchor)
    assert torch.equal(step.ids[:, 1:], brute_force(emb, metric, 2)[anchor])
    expected = (logits / 0.7).gather(-1, step.ids).softmax(-1)  # softmax over the set only
    assert torch.allclose(step.weights, expected) and torch.allclose(step.weights.sum(-1), torch.ones(64))


def test_gate_frequency_matches_rho_and_unmixed_rows_sample_plainly(emb):
    ex = NeighborMixingExplorer(k=3, rho=0.1, top_k=5)
    ex.prepare(emb)
    logits = torch.randn(20000, V, generator=gen())
    step = ex.step(logits, gen(3))
    n, frac = len(logits), step.mixed.float().mean().item()
    assert abs(frac - 0.1) < 5 * math.sqrt(0.1 * 0.9 / n)  # binomial, 5 sigma
    # the same generator stream reproduces it: gate draw, then TemperatureExplorer's sampling
    g = gen(3)
    mixed = torch.rand(n, generator=g) < 0.1
    plain = TemperatureExplorer(top_k=5).step(logits, g).tokens
    assert torch.equal(step.mixed, mixed)
    assert torch.equal(step.tokens, torch.where(mixed, logits.argmax(-1), plain))


# ---------------------------------------------- the released code's behaviour (ZJUSCL/N-GRPO)
def test_emit_sampled_keeps_the_sampled_token_and_mixes_the_anchor_set(emb):
    ex = NeighborMixingExplorer(k=2, rho=0.3, emit="sampled")
    ex.prepare(emb)
    logits = torch.randn(512, V, generator=gen())
    step = ex.step(logits, gen(5))
    g = gen(5)  # re-derived: the gate draw, then plain sampling for every row
    mixed = torch.rand(512, generator=g) < 0.3
    sampled = TemperatureExplorer().step(logits, g).tokens
    assert torch.equal(step.mixed, mixed) and torch.equal(step.tokens, sampled)
    anchor = logits.argmax(-1)
    assert torch.equal(step.ids[mixed, 0], anchor[mixed])  # the set is still the anchor's
    assert torch.equal(step.ids[mixed, 1:], brute_force(emb, "cosine", 1)[anchor[mixed]])
    assert (step.tokens[mixed] != anchor[mixed]).any()  # the text is not the anchor's


def test_entropy_gate_mixes_the_uncertain_steps(emb):
    ex = NeighborMixingExplorer(k=3, gate="entropy", entropy_threshold=2.0, temperature=0.8, top_k=20)
    ex.prepare(emb)
    scale = torch.linspace(0.1, 10.0, 256)[:, None]  # from flat to peaked rows
    logits = torch.randn(256, V, generator=gen()) * scale
    step = ex.step(logits, gen(2))
    z = logits / 0.8  # independent: entropy of softmax over the top-20 of z / T
    top = z.topk(20, dim=-1).values
    p = top.softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    assert torch.equal(step.mixed, entropy >= 2.0) and 0 < step.mixed.sum() < 256
    assert torch.equal(
        step.tokens[~step.mixed], TemperatureExplorer(0.8, top_k=20).step(logits, gen(2)).tokens[~step.mixed]
    )


def test_weights_are_the_warped_probabilities_renormalised_over_the_set(emb):
    ex = NeighborMixingExplorer(k=3, rho=1.0, top_p=0.5)
    ex.prepare(emb)
    logits = torch.randn(64, V, generator=gen()) * 3
    step = ex.step(logits, gen())
    probs = logits.softmax(-1)  # independent nucleus: the smallest prefix of sorted probs reaching 0.5
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < 0.5
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    member_p = (probs * keep).gather(-1, step.ids)
    assert torch.allclose(step.weights, member_p / member_p.sum(-1, keepdim=True), atol=1e-6)
    outside = ~keep.gather(-1, step.ids)
    assert outside.any() and (step.weights[outside] == 0).all()  # a member outside the nucleus: weight 0


def test_bad_release_options_name_the_key():
    with pytest.raises(ValueError, match=r"explorer\.emit='text' is unknown: allowed \['anchor', 'sampled'\]"):
        NeighborMixingExplorer(emit="text")
    with pytest.raises(ValueError, match=r"explorer\.gate"):
        NeighborMixingExplorer(gate="always")


def test_rho_zero_is_plain_sampling_and_rho_one_mixes_every_row(emb):
    logits = torch.randn(32, V, generator=gen())
    ex = NeighborMixingExplorer(rho=0.0)
    ex.prepare(emb)
    assert torch.equal(ex.step(logits, gen(1)).tokens, TemperatureExplorer().step(logits, gen(1)).tokens)
    ex = NeighborMixingExplorer(rho=1.0)
    ex.prepare(emb)
    assert ex.step(logits, gen(1)).mixed.all()


# --------------------------------------------------------------------- Gaussian
def test_gaussian_noise_scale_is_relative_to_the_embedding_norm():
    d = 4096
    e = torch.randn(50, d, generator=gen()) * torch.linspace(0.5, 3.0, 50)[:, None]
    ex = GaussianNoiseExplorer(sigma=0.3)
    ex.prepare(e)
    step = ex.step(torch.randn(16, 50, generator=gen()), gen(1))
    norms = e[step.tokens].norm(dim=-1)
    assert step.mixed.all() and torch.equal(step.ids[:, 0], step.tokens)
    assert torch.allclose(step.noise_scale, 0.3 * norms / math.sqrt(d))
    assert len(set(step.noise_seed.tolist())) == 16 and (step.noise_seed >= 0).all()
    rec = InputRecords(
        row=torch.arange(16),
        pos=torch.zeros(16, dtype=torch.long),
        ids=step.ids,
        weights=step.weights,
        noise_seed=step.noise_seed,
        noise_scale=step.noise_scale,
    )
    noise_norm = (mixture_embeddings(e, rec) - e[step.tokens]).norm(dim=-1)
    assert torch.allclose(noise_norm, 0.3 * norms, rtol=0.05)  # ||noise|| ~ sigma * ||E[y]||


def test_gaussian_gate_and_zero_sigma():
    e = torch.randn(50, 8)
    ex = GaussianNoiseExplorer(sigma=1.0, rho=0.25)
    ex.prepare(e)
    frac = ex.step(torch.randn(20000, 50), gen()).mixed.float().mean().item()
    assert abs(frac - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 20000)
    quiet = GaussianNoiseExplorer(sigma=0.0)
    quiet.prepare(e)
    assert quiet.step(torch.randn(4, 50)).mixed is None


# ----------------------------------------------------------------------- Gumbel
def test_gumbel_weights_and_emitted_token():
    logits = torch.randn(8, 100, generator=gen())
    step = GumbelSoftExplorer(top_k=4, tau=0.5, temperature=0.8).step(logits, gen(2))
    vals, ids = (logits / 0.8).topk(4, dim=-1)
    g = -torch.log(-torch.log(torch.rand(8, 4, generator=gen(2))))
    assert torch.equal(step.ids, ids) and step.mixed.all()
    assert torch.allclose(step.weights, ((vals + g) / 0.5).softmax(-1))
    assert torch.equal(step.tokens, ids.gather(-1, (vals + g).argmax(-1, keepdim=True)).squeeze(-1))


def test_gumbel_emitted_tokens_sample_the_top_k_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]])).repeat(20000, 1)
    tokens = GumbelSoftExplorer(top_k=3, tau=1.0).step(logits, gen()).tokens
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9, atol=0.015)  # Gumbel-max trick


# ------------------------------------------------------------ configs, errors
@pytest.mark.parametrize(
    "name, key, value",
    [
        ("neighbor", "k", 0),
        ("neighbor", "rho", 1.5),
        ("neighbor", "rho", -0.1),
        ("neighbor", "refresh_every", -1),
        ("neighbor", "temperature", -1.0),
        ("gaussian", "sigma", -0.1),
        ("gaussian", "rho", 2.0),
        ("gumbel", "top_k", 0),
        ("gumbel", "tau", 0.0),
    ],
)
def test_bad_values_name_the_key(name, key, value):
    with pytest.raises(ConfigError, match=rf"explorer\.{key}={value!r} is out of range"):
        build_explorer(OmegaConf.create({"name": name, key: value}))


def test_unknown_metric_lists_the_choices():
    with pytest.raises(
        ConfigError, match=r"explorer\.metric='cos' is unknown: allowed \['cosine', 'dot', 'l1', 'l2'\]"
    ):
        build_explorer(OmegaConf.create({"name": "neighbor", "metric": "cos"}))


def test_sizes_beyond_the_vocabulary_name_the_key():
    ex = build_explorer(OmegaConf.create({"name": "neighbor", "k": 5}))
    ex.set_special_ids([0])
    with pytest.raises(ValueError, match=r"explorer\.k=5 is out of range: allowed \[1, 3\]"):
        ex.prepare(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"explorer\.exclude_ids contains 9"):
        NeighborMixingExplorer(exclude_ids=[9]).prepare(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"explorer\.top_k=5 is out of range: allowed \[1, 4\]"):
        GumbelSoftExplorer(top_k=5).prepare(torch.randn(4, 8))


def test_registry_and_shipped_configs():
    from ngrpo_lightning.config import config_dir

    assert {"temperature", "neighbor", "gaussian", "gumbel"} <= set(EXPLORERS)
    expected = {"neighbor": NeighborMixingExplorer, "gaussian": GaussianNoiseExplorer, "gumbel": GumbelSoftExplorer}
    for name, cls in expected.items():
        ex = build_explorer(OmegaConf.load(config_dir() / "explorer" / f"{name}.yaml"))
        assert type(ex) is cls
    ex = build_explorer(OmegaConf.load(config_dir() / "explorer" / "neighbor.yaml"))
    assert (ex.k, ex.rho, ex.metric, ex.refresh_every) == (3, 0.1, "cosine", 0)  # the paper's defaults


def test_every_shipped_explorer_config_builds_its_registered_explorer():
    from ngrpo_lightning.config import config_dir

    files = sorted((config_dir() / "explorer").glob("*.yaml"))
    built = set()
    for path in files:
        cfg = OmegaConf.load(path)  # a duplicate key or an unknown argument fails here or below
        if "name" not in cfg:
            continue  # custom.yaml names a class path
        ex = build_explorer(cfg)
        assert type(ex) is EXPLORERS[cfg.name], path.name
        for key, value in cfg.items():  # every key of the file reaches the explorer
            if key != "name":
                assert getattr(ex, key) == value, f"{path.name}: {key}"
        built.add(cfg.name)
    assert built == set(EXPLORERS)  # every registered explorer ships a config


# ------------------------------------------------------- the release's baselines
@pytest.mark.parametrize("gumbel", [False, True])
def test_topk_mixtures_re_derived(emb, gumbel):
    cls = TopKGumbelMixExplorer if gumbel else TopKMixExplorer
    ex = cls(k=3, rho=0.4, mix_temperature=0.5, temperature=0.8)
    logits = torch.randn(256, V, generator=gen())
    step = ex.step(logits, gen(4))
    g = gen(4)  # the stream: gate draw, plain sampling, then (topk_gumbel) one uniform per logit
    mixed = torch.rand(256, generator=g) < 0.4
    tokens = TemperatureExplorer(0.8).step(logits, g).tokens
    scores = logits / 0.8 / 0.5
    select = scores
    if gumbel:
        u = torch.rand(scores.shape, generator=g).clamp(1e-6, 1 - 1e-6)
        select = scores - torch.log(-torch.log(u))
    ids = select.topk(3, dim=-1).indices
    assert torch.equal(step.mixed, mixed) and torch.equal(step.tokens, tokens)  # the sampled token is the text
    assert torch.equal(step.ids, ids)
    assert torch.allclose(step.weights, scores.gather(-1, ids).softmax(-1), atol=1e-6)  # no noise in the weights
    if gumbel:
        assert not torch.equal(ids, scores.topk(3, dim=-1).indices)


def test_orthogonal_noise_re_derived(emb):
    """The anchor is the top-1 of z~/tau; the noise std is the norm of (w_j * |E[t_j] projected
    off E[t_1]|) over the other top-k tokens, w = softmax(z~/tau^2) over them (the release's
    SGLang path); the noise is seeded per row and recorded with the anchor alone."""
    ex = OrthogonalNoiseExplorer(k=3, rho=0.5, mix_temperature=0.7, temperature=0.9, top_p=0.95)
    ex.prepare(emb)
    logits = torch.randn(64, V, generator=gen(2))
    step = ex.step(logits, gen(5))
    g = gen(5)  # the stream: gate, plain sampling, then the noise seeds
    mixed = torch.rand(64, generator=g) < 0.5
    tokens = TemperatureExplorer(0.9, top_p=0.95).step(logits, g).tokens
    assert torch.equal(step.mixed, mixed) and torch.equal(step.tokens, tokens)
    for b in range(64):
        z = logits[b] / 0.9
        order = z.argsort(descending=True)
        a, others = emb[order[0]], emb[order[1:3]]
        project_off = torch.eye(D) - torch.outer(a, a) / a.dot(a)  # onto the complement of a
        residuals = (others @ project_off).norm(dim=-1)
        w = (z[order[1:3]] / 0.7**2).softmax(-1)  # in the nucleus: both are among the likeliest
        assert step.ids[b].tolist() == [order[0].item()] and step.weights[b].item() == 1.0
        assert torch.allclose(step.noise_scale[b], (w * residuals).norm(), rtol=1e-4)
    assert step.noise_seed.unique().numel() == 64
    # The recorded input is the anchor plus noise of that std, in every direction
    rec = InputRecords.from_step(step, torch.ones(64, dtype=torch.bool), pos=0)
    noise = mixture_embeddings(emb, rec) - emb[step.ids[:, 0]]
    assert torch.allclose(noise.std(-1) / step.noise_scale, torch.ones(64), atol=0.6)


def test_orthogonal_noise_with_k_1_feeds_the_top_token_alone(emb):
    ex = OrthogonalNoiseExplorer(k=1, rho=1.0)
    ex.prepare(emb)
    step = ex.step(torch.randn(8, V, generator=gen()), gen(1))
    assert torch.all(step.noise_scale == 0)


def test_gaussian_embed_noise_scale_is_a_fraction_of_the_mixtures_rms(emb):
    ex = GaussianEmbedNoiseExplorer(k=2, rho=1.0, noise_rms_scale=0.33)
    ex.prepare(emb)
    step = ex.step(torch.randn(32, V, generator=gen()), gen(1))
    mixture = (step.weights[..., None] * emb[step.ids]).sum(1)
    expected = 0.33 * torch.sqrt((mixture**2).mean(-1))
    assert step.mixed.all() and torch.allclose(step.noise_scale, expected, atol=1e-6)
    assert step.noise_seed.unique().numel() == 32  # every row its own recorded noise
