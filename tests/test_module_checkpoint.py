"""The module saves and restores its explorer's state (counters, schedules) in checkpoints."""

from ngrpo_lightning.explorers import NeighborMixingExplorer
from ngrpo_lightning.objectives import GRPO
from ngrpo_lightning.rewards import MathReward
from ngrpo_lightning.training.module import RLModule


def make_module(tiny, explorer):
    model, tok = tiny
    return RLModule(model, tok, explorer, GRPO(kl_coef=0.0), MathReward(num_workers=1))


def test_explorer_state_round_trips_through_checkpoint(tiny):
    trained = NeighborMixingExplorer(refresh_every=3)
    trained.load_state_dict({"prepare_calls": 7})
    checkpoint = {}
    make_module(tiny, trained).on_save_checkpoint(checkpoint)
    assert checkpoint["explorer"] == {"prepare_calls": 7}
    restored = NeighborMixingExplorer(refresh_every=3)
    make_module(tiny, restored).on_load_checkpoint(checkpoint)
    assert restored.state_dict() == {"prepare_calls": 7}
