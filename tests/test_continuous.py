"""Continuous and multi-discrete actions end to end: the distributions, the env boundary
(clipping, non-finite actions), the statistics kept in the networks, and learning."""

from __future__ import annotations

import functools
import importlib.util

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.common import distributions, normalization
from agents.impala import IMPALA, IMPALAConfig
from agents.ppo import PPO, PPOConfig
from agents.r2d2 import R2D2, R2D2Config
from sebulba.envs import action_to_env

HAS_MUJOCO = importlib.util.find_spec("mujoco") is not None


# The distributions.


@pytest.mark.timeout(60)
def test_gaussian_log_prob_entropy_and_samples_match_the_formulas():
    mean = jnp.array([[0.5, -1.0, 2.0]])
    log_std = jnp.log(jnp.array([[0.3, 1.0, 2.5]]))
    dist = distributions.DiagGaussian(mean, log_std)
    action = jnp.array([[0.1, 0.0, -1.0]])
    std = np.exp(np.asarray(log_std))
    expected = np.sum(-0.5 * ((action - mean) / std) ** 2 - np.log(std)
                      - 0.5 * np.log(2 * np.pi), axis=-1)
    np.testing.assert_allclose(dist.log_prob(action), expected, rtol=1e-5)
    np.testing.assert_allclose(dist.entropy(), np.sum(0.5 * np.log(2 * np.pi * np.e * std**2)),
                               rtol=1e-5)
    one = jax.tree.map(lambda x: x[0], dist)
    samples = jax.vmap(one.sample)(jax.random.split(jax.random.key(0), 20_000))
    np.testing.assert_allclose(samples.mean(0), mean[0], atol=0.05)
    np.testing.assert_allclose(samples.std(0), std[0], rtol=0.03)
    np.testing.assert_array_equal(dist.mode(), mean)


@pytest.mark.timeout(60)
def test_a_gaussian_policy_starts_spread_over_the_bounds_whatever_their_scale():
    def head_for(low, high, shape=(2,)):
        head = distributions.policy_head_for(gym.spaces.Box(low, high, shape, np.float32))
        params = head.init(jax.random.key(0), jnp.zeros((1, 3)))
        return head.apply(params, jnp.ones((5, 3)))

    unit = head_for(-1.0, 1.0)
    for low, high in ((-1000.0, 1000.0), (-0.01, 0.01), (0.0, 10.0)):
        middle, half = (low + high) / 2, (high - low) / 2
        dist = head_for(low, high)
        np.testing.assert_allclose(dist.mean, middle + half * unit.mean, rtol=1e-5)
        np.testing.assert_allclose(np.exp(dist.log_std), half * np.exp(unit.log_std),
                                   rtol=1e-5)
    # Without finite bounds (or with float32's max standing for none) the env's own units.
    for bound in (np.inf, np.finfo(np.float32).max):
        dist = head_for(-bound, bound)
        np.testing.assert_array_equal(dist.mean, unit.mean)
        np.testing.assert_array_equal(dist.log_std, unit.log_std)
    # Nor without width, or with one float32 cannot hold (a log-std of -inf on the device).
    for low, high in ((3.0, 3.0), (0.0, 1e-39)):
        dist = head_for(low, high)
        np.testing.assert_array_equal(dist.log_std, unit.log_std)
        assert np.isfinite(dist.log_prob(dist.mode())).all()
    mixed = head_for(np.array([-5.0, -np.inf]), np.array([5.0, np.inf]))
    np.testing.assert_allclose(np.exp(mixed.log_std[:, 0]), 5.0 * np.exp(unit.log_std[:, 0]),
                               rtol=1e-5)
    np.testing.assert_array_equal(mixed.log_std[:, 1], unit.log_std[:, 1])
    # Entries of a Box of rank 2 keep their own bounds' units, in the actions' order.
    grid = head_for(np.arange(6.0).reshape(2, 3) - 10.0, np.arange(6.0).reshape(2, 3) + 10.0,
                    shape=(2, 3))
    flat = head_for(-10.0, 10.0, shape=(2, 3))
    np.testing.assert_allclose(grid.mean - flat.mean,
                               np.broadcast_to(np.arange(6.0).reshape(2, 3), (5, 2, 3)),
                               atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agent_class", [PPO, IMPALA])
def test_a_gaussian_policy_learns_alike_at_any_scale_of_the_bounds(agent_class, no_leftovers):
    # One-step episodes, paid for acting at a target mapped onto the bounds: in raw units
    # a policy of std 1 acted near the middle of [-1000, 1000] (PPO -0.49 after 16k steps)
    # and at the bounds of [-0.01, 0.01] (-0.51), where [-1, 1] reached -0.22.
    from tests.envs import PointAtTargetEnv

    returns = []
    for bound in (1.0, 1000.0, 0.01):
        env = functools.partial(PointAtTargetEnv, -bound, bound)
        config = sebulba.Config(env=env, envs_per_group=16, steps_per_cycle=16,
                                async_factor=1, seed=0)
        result = sebulba.Sebulba(agent_class(sebulba.env_spec(env)), config).run(16_384)
        returns.append(result.mean_return(0.9, 1.0))
    # Acting at the middle earns about -0.5; the policy has learnt to point.
    assert returns[0] > -0.45, returns
    np.testing.assert_allclose(returns[1:], returns[0], atol=0.02)


@pytest.mark.timeout(60)
def test_multi_categorical_is_independent_categoricals():
    logits = jax.random.normal(jax.random.key(0), (4, 2 + 3))
    dist = distributions.MultiCategorical(logits, (2, 3))
    action = jnp.array([[0, 2], [1, 0], [1, 1], [0, 0]])
    first = distributions.Categorical(logits[:, :2])
    second = distributions.Categorical(logits[:, 2:])
    np.testing.assert_allclose(dist.log_prob(action),
                               first.log_prob(action[:, 0]) + second.log_prob(action[:, 1]),
                               rtol=1e-6)
    np.testing.assert_allclose(dist.entropy(), first.entropy() + second.entropy(), rtol=1e-6)
    assert dist.mode().shape == (4, 2)
    one = jax.tree.map(lambda x: x[0], dist)
    samples = jax.vmap(one.sample)(jax.random.split(jax.random.key(1), 5000))
    assert samples.shape == (5000, 2)
    frequencies = np.bincount(np.asarray(samples[:, 1]), minlength=3) / 5000
    np.testing.assert_allclose(frequencies, jax.nn.softmax(logits[0, 2:]), atol=0.03)


# The env boundary.


class RecordingBoxEnv(gym.Env):
    """Actions in [-1, 1]^2; remembers every action it receives (one process: sync)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    received: list[np.ndarray] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        RecordingBoxEnv.received.append(np.array(action))
        self.t += 1
        obs = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        return obs, -float(np.sum(np.square(action))), False, self.t == 20, {}


def recording_box_loop() -> sebulba.Sebulba:
    """PPO on 4 RecordingBoxEnvs (4 segments per update: one minibatch), record cleared."""
    RecordingBoxEnv.received.clear()
    config = sebulba.Config(env=RecordingBoxEnv, envs_per_group=4, steps_per_cycle=8,
                            async_factor=1, vectorization="sync", seed=0)
    agent = PPO(sebulba.env_spec(RecordingBoxEnv), PPOConfig(num_minibatches=1))
    return sebulba.Sebulba(agent, config)


@pytest.mark.timeout(120)
def test_the_env_gets_clipped_actions_and_the_agent_keeps_the_sampled_ones(no_leftovers):
    result = recording_box_loop().run(4 * 8 * 3)
    received = np.stack(RecordingBoxEnv.received)
    assert received.shape[1:] == (2,) and received.dtype == np.float32
    assert np.all(np.abs(received) <= 1.0)
    assert np.any(np.abs(received) == 1.0)  # some samples were clipped at the bounds
    # The agent learnt from its own samples (std 1 at the start), beyond the bounds.
    learnt = np.asarray(result.state.experience.batch.action)
    assert learnt.shape[-1] == 2 and np.any(np.abs(learnt) > 1.0)


@pytest.mark.timeout(60)
def test_non_finite_actions_are_an_error_naming_the_envs():
    to_env = action_to_env(gym.spaces.Box(-2.0, 2.0, (2,), np.float32))
    np.testing.assert_array_equal(to_env(np.array([[3.0, -0.5], [-9.0, 1.0]], np.float32)),
                                  [[2.0, -0.5], [-2.0, 1.0]])
    with pytest.raises(FloatingPointError, match=r"non-finite actions for envs \[1\]"):
        to_env(np.array([[0.0, 0.0], [np.nan, 0.0]], np.float32))


@pytest.mark.timeout(120)
def test_a_diverged_policy_stops_the_run_before_the_env_sees_nan(no_leftovers):
    loop = recording_box_loop()
    state = loop.initial_state()
    head = state.nets["params"]["head"]["policy_head"]
    nets = {**state.nets, "params": {**state.nets["params"], "head": {
        **state.nets["params"]["head"],
        "policy_head": {**head, "mean": {**head["mean"], "bias": jnp.full((2,), jnp.nan)}}}}}
    with pytest.raises(FloatingPointError, match="non-finite actions"):
        loop.run(1000, state._replace(nets=nets))
    assert RecordingBoxEnv.received == []


@pytest.mark.timeout(60)
def test_agents_refuse_action_spaces_they_cannot_act_in():
    box = sebulba.EnvSpec(gym.spaces.Box(-1, 1, (3,), np.float32),
                          gym.spaces.Box(-1, 1, (2,), np.float32))
    with pytest.raises(ValueError, match=r"R2D2 acts in Discrete action spaces only, got "
                                         r"Box.*PPO, IMPALA and SPG"):
        R2D2(box, R2D2Config())
    with pytest.raises(ValueError, match="MultiDiscrete must be one-dimensional and start at 0"):
        sebulba.envs.check_spaces(box.observation_space,
                                  gym.spaces.MultiDiscrete([2, 3], start=[1, 0]))
    with pytest.raises(ValueError, match="normalize_rewards must be one of"):
        PPOConfig(normalize_rewards="yes")
    # Integer Box actions: every real action the agents sample would be off the env's
    # grid (each of 1,144 steps a reviewer's run sent was outside the space).
    for dtype in (np.int64, np.int32, np.uint8, np.bool_):
        with pytest.raises(ValueError, match=r"a Box of actions must hold floats; integer "
                                             r"actions are a MultiDiscrete"):
            sebulba.envs.check_spaces(box.observation_space,
                                      gym.spaces.Box(0, 1, (2,), dtype))
    with pytest.raises(ValueError, match=r"Discrete must start at 0 \(a gymnasium."
                                         r"ActionWrapper"):
        sebulba.envs.check_spaces(box.observation_space, gym.spaces.Discrete(3, start=1))
    for dtype in (np.float16, np.float32, np.float64):  # real actions: accepted
        sebulba.envs.check_spaces(box.observation_space, gym.spaces.Box(-1, 1, (2,), dtype))


# Statistics kept in the networks.


@pytest.mark.timeout(60)
def test_rewards_scaled_down_are_never_made_larger():
    reward = jnp.array([0.5, -2.0, 30.0])
    for std, scaled_down in ((30.0, reward / 30.0), (0.1, reward)):
        nets = normalization.with_reward_scaling({})
        nets[normalization.COLLECTION]["reward"] = {
            **nets[normalization.COLLECTION]["reward"], "var": jnp.float32(std ** 2)}
        np.testing.assert_allclose(normalization.scale_rewards(nets, reward), reward / std,
                                   rtol=1e-5)
        np.testing.assert_allclose(normalization.scale_rewards(nets, reward, min_std=1.0),
                                   scaled_down, rtol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env,kwargs,expected", [
    ("CartPole-v1", {}, "down"),  # discrete, feed-forward: large returns scaled down
    ("CartPole-v1", {"use_lstm": True}, "auto"),  # both ways, as PPO's LSTM does
    ("Pendulum-v1", {}, "auto"),  # Box actions: scaled both ways
    ("CartPole-v1", {"reward_clip": 1.0}, "off"),  # clipped rewards keep their scale
])
def test_impala_scales_rewards_by_default(env, kwargs, expected):
    agent = IMPALA(sebulba.env_spec(env), IMPALAConfig(**kwargs))
    assert agent.config.normalize_rewards == expected
    # The actors accumulate returns where rewards are scaled.
    assert agent.return_discount == (None if expected == "off" else agent.config.discount)
    ppo = PPO(sebulba.env_spec("CartPole-v1"), PPOConfig())
    assert ppo.return_discount == ppo.config.discount  # PPO scales rewards whatever the
    off = PPO(sebulba.env_spec("CartPole-v1"), PPOConfig(normalize_rewards="off"))
    assert off.return_discount is None  # actions, unless told not to


@pytest.mark.timeout(60)
def test_moments_merge_batches_as_numpy_computes_them():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, (4, 5, 3)).astype(np.float32) for _ in range(3)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("learner",))
    spec = jax.sharding.PartitionSpec("learner")

    @jax.jit
    def merge(moments, x):  # x [2, E, T, 3]: each of 2 learner devices gets [E, T, 3]
        return jax.shard_map(lambda m, x: normalization.merged(m, x[0], 2), mesh=mesh,
                             in_specs=(jax.sharding.PartitionSpec(), spec),
                             out_specs=jax.sharding.PartitionSpec())(moments, x)

    moments = normalization.new_moments((3,))
    for x in batches:
        moments = merge(moments, np.stack([x, x + 1.0]))
    everything = np.concatenate([np.concatenate([x, x + 1.0]).reshape(-1, 3) for x in batches])
    assert float(moments["count"]) == len(everything)
    np.testing.assert_allclose(moments["mean"], everything.mean(0), rtol=1e-5)
    np.testing.assert_allclose(moments["var"], everything.var(0), rtol=1e-4)

    # Steps marked invalid (a multi-agent env's padding) leave the moments alone.
    valid = rng.random((2, 4, 5)) < 0.6

    @jax.jit
    def merge_valid(moments, x, valid):
        return jax.shard_map(lambda m, x, v: normalization.merged(m, x[0], 2, v[0]),
                             mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), spec, spec),
                             out_specs=jax.sharding.PartitionSpec())(moments, x, valid)

    x = np.stack([batches[0], batches[1]])
    masked = merge_valid(normalization.new_moments((3,)), x, valid)
    kept = x[valid]
    assert float(masked["count"]) == len(kept)
    np.testing.assert_allclose(masked["mean"], kept.mean(0), rtol=1e-5)
    np.testing.assert_allclose(masked["var"], kept.var(0), rtol=1e-4)
    unchanged = merge_valid(moments, x, np.zeros_like(valid))
    jax.tree.map(np.testing.assert_array_equal, unchanged, moments)


@pytest.mark.timeout(300)
def test_statistics_are_learnt_published_to_every_inference_device_and_checkpointed(
        tmp_path, no_leftovers):
    from sebulba.checkpoint import Checkpointer

    config = sebulba.Config(env="Pendulum-v1", envs_per_group=4, steps_per_cycle=16,
                            async_factor=1, vectorization="sync", seed=0,
                            inference_devices=[0, 1], learner_devices=[2, 3])
    agent = PPO(sebulba.env_spec("Pendulum-v1"), PPOConfig(num_minibatches=2))
    loop = sebulba.Sebulba(agent, config)
    published = []
    result = loop.run(4 * 16 * 8, on_update=lambda info: published.append(info.nets))
    stats = result.state.nets[normalization.COLLECTION]
    obs_moments = stats["torso"]["layers_0"]["observation"]
    # Learnt from the consumed observations: Pendulum's are cos, sin (in [-1, 1]) and the
    # angular velocity (in [-8, 8]), so the moments moved away from (0, 1).
    assert float(obs_moments["count"]) == result.consumed
    assert np.all(np.abs(np.asarray(obs_moments["mean"])[:2]) <= 1.0)
    assert not np.allclose(obs_moments["var"], 1.0)
    assert float(stats["reward"]["count"]) == result.consumed
    # Published to the actors (both inference devices' stagings get this tree) after every
    # update: the statistics changed from one publication to the next, and the last is
    # the learner's.
    counts = [float(p[normalization.COLLECTION]["reward"]["count"]) for p in published]
    assert counts == sorted(counts) and counts[0] < counts[-1]
    jax.tree.map(np.testing.assert_array_equal, published[-1][normalization.COLLECTION], stats)

    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(1, nets=result.state.nets, opt=result.state.opt, counters={},
                      metadata={"agent": "ppo"})
    fresh = loop.initial_state()
    restored = checkpointer.restore(nets=fresh.nets, opt=fresh.opt, metadata={"agent": "ppo"})
    checkpointer.close()
    jax.tree.map(np.testing.assert_array_equal, restored.nets[normalization.COLLECTION], stats)
    resumed = loop.run(4 * 16 * 2, fresh._replace(nets=restored.nets, opt=restored.opt))
    count = resumed.state.nets[normalization.COLLECTION]["reward"]["count"]
    assert float(count) == result.consumed + resumed.consumed


@pytest.mark.timeout(120)
def test_mountain_car_continuous_runs_with_one_dimensional_actions(no_leftovers):
    """MountainCarContinuous-v0: Box(1,) actions in [-1, 1], episodes of at most 999 steps
    (the initial Gaussian, std 1, sometimes reaches the goal: returns near 70), observations
    (position, velocity) on very different scales."""
    env = "MountainCarContinuous-v0"
    config = sebulba.Config(env=env, envs_per_group=8, steps_per_cycle=32, async_factor=1,
                            seed=0)
    agent = PPO(sebulba.env_spec(env))
    assert agent.env_spec.action_space.shape == (1,)
    result = sebulba.Sebulba(agent, config).run(8 * 32 * 40)
    assert result.episodes and all(0 < length <= 999 for _, _, length in result.episodes)
    moments = result.state.nets[normalization.COLLECTION]["torso"]["layers_0"]["observation"]
    mean, var = np.asarray(moments["mean"]), np.asarray(moments["var"])
    # positions start in [-0.6, -0.4] and stay in [-1.2, 0.6]; velocities within 0.07
    assert -1.2 <= mean[0] <= 0.6 and abs(mean[1]) <= 0.07 and var[1] < var[0]


# Learning.


class MatchPattern(gym.Env):
    """MultiDiscrete([3, 3, 3]) actions; reward 1/3 per entry equal to the pattern the
    observation shows (one-hot, 9 entries); episodes of 10 steps. Optimum 10, random 3.3."""

    observation_space = gym.spaces.Box(0.0, 1.0, (9,), np.float32)
    action_space = gym.spaces.MultiDiscrete([3, 3, 3])

    def _obs(self):
        obs = np.zeros(9, np.float32)
        obs[np.arange(3) * 3 + self.pattern] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.pattern = self.np_random.integers(0, 3, 3)
        return self._obs(), {}

    def step(self, action):
        reward = float(np.sum(np.asarray(action) == self.pattern)) / 3
        self.t += 1
        self.pattern = self.np_random.integers(0, 3, 3)
        return self._obs(), reward, self.t == 10, False, {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("agent_class", [PPO, IMPALA])
def test_multi_discrete_actions_are_learnt(agent_class, no_leftovers):
    # Last-10% means at 60k steps: PPO near 8.7-9.0, IMPALA near 7.9-8.3 (optimum 10,
    # uniformly random 3.3).
    config = sebulba.Config(env=MatchPattern, envs_per_group=16, steps_per_cycle=16,
                            async_factor=1, vectorization="sync", seed=0)
    agent_config = PPOConfig() if agent_class is PPO else IMPALAConfig()
    agent = agent_class(sebulba.env_spec(MatchPattern), agent_config)
    result = sebulba.Sebulba(agent, config).run(60_000)
    assert result.mean_return(0.9, 1.0) >= 7.0, result.summary()


@pytest.mark.slow  # the default suite learns the same task on EnvPool's MuJoCo in half the
# steps (tests/test_envpool.py)
@pytest.mark.skipif(not HAS_MUJOCO, reason="needs the mujoco extra (gymnasium[mujoco])")
@pytest.mark.timeout(600)
def test_ppo_balances_inverted_pendulum_with_its_defaults(no_leftovers):
    # With Config's and PPO's defaults the last-10% mean at 300k steps is 1000, the
    # maximum; 45 s on 2 cores.
    env = "InvertedPendulum-v5"
    config = sebulba.Config(env=env, seed=0)
    result = sebulba.Sebulba(PPO(sebulba.env_spec(env)), config).run(300_000)
    assert result.mean_return(0.9, 1.0) >= 800, result.summary()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lstm_ppo_swings_up_a_pendulum_it_sees_only_the_angle_of(no_leftovers):
    # Pendulum-v1 observing [cos, sin] of the angle only: the velocity must be remembered.
    # Last-10% means at 500k steps with PPO's Box defaults: feed-forward near -1,080, LSTM
    # between -410 and -280; with the velocity observed, feed-forward near -170.
    from sebulba.envs import suite

    env = suite.PENDULUM_NO_VELOCITY
    returns = {}
    for use_lstm in (False, True):
        agent = PPO(sebulba.env_spec(env), PPOConfig(use_lstm=use_lstm))
        result = sebulba.Sebulba(agent, sebulba.Config(env=env, seed=0)).run(500_000)
        returns[use_lstm] = result.mean_return(0.9, 1.0)
    assert returns[True] >= returns[False] + 400, returns


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MUJOCO, reason="needs the mujoco extra (gymnasium[mujoco])")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("agent_class,seed", [(PPO, 1), (PPO, 2), (IMPALA, 0)])
def test_inverted_pendulum_on_more_seeds_and_agents(agent_class, seed, no_leftovers):
    # With the defaults (for Box actions 10 x 8 epochs x minibatches, no Gaussian entropy
    # bonus) both agents reach 1000, the maximum, at 300k steps (PPO's seed 0 is the
    # default suite's test).
    env = "InvertedPendulum-v5"
    result = sebulba.Sebulba(agent_class(sebulba.env_spec(env)),
                             sebulba.Config(env=env, seed=seed)).run(300_000)
    assert result.mean_return(0.9, 1.0) >= 800, result.summary()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MUJOCO, reason="needs the mujoco extra (gymnasium[mujoco])")
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("agent_class,steps,bar", [(PPO, 1_000_000, 1500),
                                                   (IMPALA, 2_000_000, 1000)])
def test_half_cheetah_with_the_defaults_over_three_seeds(agent_class, steps, bar, no_leftovers):
    """The bars, on the mean over seeds 0, 1, 2 of the last-10% mean return: PPO >= 1,500
    within 1M steps, IMPALA >= 1,000 within 2M. On 2 cores alone the means are about 2,100
    (PPO, 5k steps/s) and 1,800 (IMPALA, 9k steps/s). HalfCheetah's seeds differ widely (a
    run that learns to run on its back scores twice the others), so each seed only has to
    reach half the bar.
    """
    env = "HalfCheetah-v5"
    returns = []
    for seed in range(3):
        result = sebulba.Sebulba(agent_class(sebulba.env_spec(env)),
                                 sebulba.Config(env=env, seed=seed)).run(steps)
        returns.append(result.mean_return(0.9, 1.0))
    assert np.mean(returns) >= bar and min(returns) >= bar / 2, returns
