"""A resumed run continues the learner: N updates, a checkpoint on disk, N more in a fresh
loop give the learner state of one run of 2N updates, bit for bit.

What makes the two agree exactly: lockstep acting (each cycle acts with the networks
learnt from every earlier trajectory, so the actions do not depend on thread timing), a
deterministic env that ignores its seed, and episodes of T - 1 steps, so that every env
resets exactly at a cycle's end: an uninterrupted run starts cycle N from a reset as a
resumed one does. What the checkpoint must carry for the runs to agree: networks,
optimizer state, experience (PPO's minibatch key, R2D2's replay and pending steps), the
envs' step states (acting keys, recurrent state, R2D2's epsilons) and the learner's
update count.
"""

from __future__ import annotations

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.ppo import PPO, PPOConfig
from agents.r2d2 import R2D2, R2D2Config
from sebulba.checkpoint import Checkpointer

ENVS = 4
UPDATES = 3  # before the checkpoint, and after it


class PatternEnv(gym.Env):
    """Observation [t / n, previous action]; reward 1 when the action is t % 2; terminates
    after n steps. Deterministic and blind to its seed."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, n: int):
        self.n = n
        self.t = 0
        self.previous = 0

    def _obs(self):
        return np.array([self.t / self.n, self.previous], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.previous = 0, 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.t % 2)
        self.t += 1
        self.previous = int(action)
        return self._obs(), reward, self.t == self.n, False, {}


def ppo(steps_per_cycle):
    spec = sebulba.env_spec(lambda: PatternEnv(steps_per_cycle - 1))
    return PPO(spec, PPOConfig(hidden_sizes=(16,), use_lstm=True, lstm_size=8,
                               learning_rate=1e-2))


def r2d2(steps_per_cycle):
    spec = sebulba.env_spec(lambda: PatternEnv(steps_per_cycle - 1))
    return R2D2(spec, R2D2Config(
        torso_sizes=(16,), lstm_size=8, head_sizes=(16,), sequence_length=8,
        sequence_overlap=4, burn_in=2, n_step=2, batch_size=4, replay_capacity=64,
        min_replay_size=4, target_update_period=2, learning_rate=1e-2))


AGENTS = {"ppo": (ppo, 8), "r2d2": (r2d2, 4)}  # R2D2: T = sequence_length - overlap


def make_loop(name: str) -> sebulba.Sebulba:
    build, steps = AGENTS[name]
    config = sebulba.Config(env=lambda: PatternEnv(steps - 1), envs_per_group=ENVS,
                            async_factor=1, steps_per_cycle=steps, lockstep=True, seed=5)
    return sebulba.Sebulba(build(steps), config)


def assert_same(a, b, what):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b), what
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


def differs(a, b) -> bool:
    try:
        assert_same(a, b, "")
    except AssertionError:
        return True
    return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(AGENTS))
def test_a_resumed_run_continues_the_learner_bit_for_bit(name, tmp_path, no_leftovers):
    steps = ENVS * AGENTS[name][1]
    # One loop for every run (compiled once); each run starts its envs and threads anew
    # and the resumed one reads its state from disk only.
    loop = make_loop(name)
    whole = loop.run(2 * UPDATES * steps)
    assert whole.learner_updates == 2 * UPDATES
    assert whole.policy_lags == [0] * 2 * UPDATES  # lockstep

    checkpointer = Checkpointer(str(tmp_path))

    def save(info):
        nets, opt, experience = info.learner_state()
        checkpointer.save(info.version, nets=nets, opt=opt, metadata={"agent": name},
                          counters={"learner_updates": info.version},
                          local_experience=experience, step_state=info.actor_state())

    first = loop.run(UPDATES * steps, on_update=save)
    assert first.learner_updates == UPDATES

    fresh = loop.initial_state()
    like = jax.tree.map(lambda x: jnp.stack([x]), fresh.experience)
    restored = checkpointer.restore(nets=fresh.nets, opt=fresh.opt, metadata={"agent": name},
                                    local_experience=like, step_state=fresh.step_state)
    checkpointer.close()
    resumed_state = fresh._replace(nets=restored.nets, opt=restored.opt,
                                   step_state=restored.step_state)
    second = loop.run(UPDATES * steps, resumed_state, learner_updates=UPDATES,
                      local_experience=restored.local_experience)
    assert second.learner_updates == UPDATES
    assert_same(second.state.nets, whole.state.nets, "networks")
    assert_same(second.state.opt, whole.state.opt, "optimizer state")
    assert_same(second.state.experience, whole.state.experience, "experience")
    assert_same(second.state.step_state, whole.state.step_state, "step state")
    # The networks moved after the checkpoint: the agreement is not that of a frozen learner.
    assert differs(second.state.nets, first.state.nets)

    # Each part of the checkpoint matters: resuming without the envs' step states (their
    # acting keys start over) does not reproduce the run.
    without = loop.run(UPDATES * steps, resumed_state._replace(
        step_state=fresh.step_state), learner_updates=UPDATES,
        local_experience=restored.local_experience)
    assert differs(without.state.nets, whole.state.nets)


@pytest.mark.timeout(60)
def test_lockstep_is_refused_where_trajectory_order_depends_on_timing():
    with pytest.raises(ValueError, match="lockstep needs one env group per process, got 2"):
        sebulba.Config(env=lambda: PatternEnv(3), envs_per_group=2, async_factor=2,
                       lockstep=True)
    with pytest.raises(ValueError, match="lockstep must be a bool"):
        sebulba.Config(env=lambda: PatternEnv(3), async_factor=1, lockstep=1)
