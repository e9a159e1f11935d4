"""PPO's construction checks, acting outputs and minibatch cursor (no learning run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.ppo import PPO, PPOConfig
from sebulba.envs import example_env_step

SPEC = sebulba.env_spec("CartPole-v1")


@pytest.mark.timeout(60)
def test_minibatches_must_divide_the_envs_of_a_learner_shard(no_leftovers):
    agent = PPO(SPEC, PPOConfig(num_minibatches=3))
    loop = sebulba.Sebulba(agent, sebulba.Config(envs_per_group=8, learner_devices=[0, 1]))
    with pytest.raises(ValueError, match=r"num_minibatches=3 must divide .* 4 \(envs_per_group=8 "
                                         r"/ 2 learner devices\)"):
        loop.initial_state()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,value", [("num_epochs", 0), ("num_minibatches", 0),
                                         ("gae_lambda", 1.5), ("clip_epsilon", 0.0)])
def test_bad_config_is_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        PPOConfig(**{field: value})


@pytest.mark.timeout(60)
def test_step_records_the_log_prob_and_greedy_step_takes_the_argmax():
    agent = PPO(SPEC)
    nets = agent.new_networks(jax.random.key(0))
    env_step = example_env_step(SPEC, 5)._replace(obs=jax.random.normal(jax.random.key(1), (5, 4)))
    state = agent._new_step_state(nets, jax.random.key(2), 5)
    logits, _ = agent.network.apply(nets, env_step.obs)
    log_probs = np.asarray(jax.nn.log_softmax(logits))

    out, _ = jax.jit(agent.step)(state, nets, env_step)
    chosen = log_probs[np.arange(5), np.asarray(out.action)]
    np.testing.assert_allclose(np.asarray(out.extras["log_prob"]), chosen, rtol=1e-5)

    greedy, _ = jax.jit(agent.greedy_step)(state, nets, env_step)
    np.testing.assert_array_equal(np.asarray(greedy.action), log_probs.argmax(-1))


@pytest.mark.timeout(120)
def test_each_epoch_visits_every_env_once():
    cfg = PPOConfig(num_epochs=3, num_minibatches=4)
    agent = PPO(SPEC, cfg)
    layout = sebulba.Layout(envs_per_group=8, num_groups=1, steps_per_cycle=5,
                            num_learner_devices=1)
    nets = agent.new_networks(jax.random.key(0))
    experience = agent._new_experience_state(nets, jax.random.key(1), layout)
    trajectory = sebulba.zeros_trajectory(agent, nets, 8, 5)
    # Tag each env's observations with its index, to see which rows a minibatch takes.
    obs = jnp.broadcast_to(jnp.arange(8.0)[:, None, None], trajectory.env_steps.obs.shape)
    trajectory = trajectory._replace(env_steps=trajectory.env_steps._replace(obs=obs))
    experience = jax.jit(agent.update_experience)(experience, None, None, trajectory, nets)
    assert agent.num_off_policy_optims_per_cycle() == 12

    @jax.jit
    def next_minibatch(experience):
        minibatch = agent._minibatch(experience)
        _, (experience, _) = agent.loss(nets, (), experience)  # advances the cursor
        return minibatch.obs[:, 0, 0], experience

    for _ in range(cfg.num_epochs):
        rows = []
        for _ in range(cfg.num_minibatches):
            tags, experience = next_minibatch(experience)
            assert tags.shape == (2,)
            rows += np.asarray(tags).astype(int).tolist()
        assert sorted(rows) == list(range(8))
    assert int(experience.cursor) == 12
