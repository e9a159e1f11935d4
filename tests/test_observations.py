"""Every agent learns from every observation kind: frames (RGB and stacks) and discrete
observations reach the first layer of its network, through a real loop and a learner update."""

from __future__ import annotations

import functools

import gymnasium as gym
import jax
import numpy as np
import pytest

import sebulba
from agents.r2d2 import R2D2Config
from agents.registry import AGENTS
from tests.envs import RandomObservationEnv

SPACES = {
    "rgb_frames": gym.spaces.Box(0, 255, (60, 80, 3), np.uint8),
    "stacked_frames": gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
    "discrete": gym.spaces.Discrete(7),
}
T = 4


def agent_config(name: str):
    if name == "r2d2":  # sequences of 2 cycles, learning from the first ones on
        return R2D2Config(torso_sizes=(16,), lstm_size=16, head_sizes=(16,),
                          sequence_length=2 * T, sequence_overlap=T, burn_in=1,
                          batch_size=4, replay_capacity=16, min_replay_size=2)
    cls = AGENTS[name].config_class
    return cls(num_minibatches=1) if name == "ppo" else cls()


def first_layer(nets, name: str, kind: str):
    """The kernel that reads the (encoded) observation: the first convolution for frames,
    the Dense kernel over the 7 one-hot inputs for discrete observations."""
    params = nets.online if name == "r2d2" else nets
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if kind == "discrete":
        found = [x for path, x in flat if "kernel" in jax.tree_util.keystr(path)
                 and x.ndim == 2 and x.shape[0] == 7]
    else:
        found = [x for path, x in flat if "Conv_0" in jax.tree_util.keystr(path)
                 and "kernel" in jax.tree_util.keystr(path)]
    assert found, f"no first layer in {[jax.tree_util.keystr(p) for p, _ in flat]}"
    return [np.asarray(x) for x in found]


@pytest.mark.timeout(300)
# SAC reads vector observations only, and refuses these by name (tests/test_networks.py).
@pytest.mark.parametrize("name", sorted(set(AGENTS) - {"sac"}))
@pytest.mark.parametrize("kind", sorted(SPACES))
def test_a_learner_update_changes_the_first_layer(name, kind, no_leftovers):
    env = functools.partial(RandomObservationEnv, SPACES[kind])
    agent = AGENTS[name].build(sebulba.env_spec(env), agent_config(name))
    config = sebulba.Config(env=env, envs_per_group=2, steps_per_cycle=T, async_factor=1)
    loop = sebulba.Sebulba(agent, config)
    initial = loop.initial_state()
    result = loop.run(2 * T * 6, initial)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    before = first_layer(initial.nets, name, kind)
    after = first_layer(result.state.nets, name, kind)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(before, after, strict=True))
    if kind != "discrete":  # frames stay uint8 from the env to the learner
        experience_obs = [x for x in jax.tree.leaves(result.state.experience)
                          if x.shape[-3:] == SPACES[kind].shape[-3:]]
        assert experience_obs and all(x.dtype == np.uint8 for x in experience_obs)
