"""PPO's construction checks, acting outputs, segments, minibatches and the LSTM's stored
states (no learning run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.ppo import PPO, PPOConfig
from sebulba.envs import example_env_step, suite
from sebulba.types import EnvStep, Trajectory

SPEC = sebulba.env_spec("CartPole-v1")


@pytest.mark.timeout(60)
def test_minibatches_must_divide_the_segments_of_a_learner_shard(no_leftovers):
    agent = PPO(SPEC, PPOConfig(num_minibatches=3))
    loop = sebulba.Sebulba(agent, sebulba.Config(envs_per_group=8, learner_devices=[0, 1]))
    with pytest.raises(ValueError, match=r"num_minibatches=3 must divide the 4 segments of each "
                                         r"learner device \(4 envs x 32 steps"):
        loop.initial_state()


@pytest.mark.timeout(60)
def test_a_buffer_size_the_envs_do_not_fill_is_rejected(no_leftovers):
    # One update is one trajectory: 8 envs x 32 steps in 8-step segments = 32 segments.
    agent = PPO(SPEC, PPOConfig(bptt_horizon=8, num_segments=40))
    loop = sebulba.Sebulba(agent, sebulba.Config(envs_per_group=8, learner_devices=[0, 1]))
    with pytest.raises(ValueError, match=r"sized for 40 segments, but the envs fill 32 per update"):
        loop.initial_state()
    exact = PPO(SPEC, PPOConfig(bptt_horizon=8, num_segments=32))
    sebulba.Sebulba(exact, sebulba.Config(envs_per_group=8, learner_devices=[0, 1])).initial_state()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field,value", [
    ("num_epochs", -1), ("num_minibatches", -2), ("gae_lambda", 1.5), ("clip_epsilon", 0.0),
    ("bptt_horizon", -1), ("num_segments", 2.5), ("prio_alpha", -0.1), ("prio_beta0", 1.5),
    ("lstm_size", 0), ("prio_beta_anneal_updates", -3), ("learning_rate", float("nan")),
    ("learning_rate", -1e-3), ("adam_eps", 0.0), ("max_grad_norm", 0.0),
    ("entropy_cost", -0.01), ("value_cost", float("inf")), ("prio_alpha", float("inf")),
    ("gaussian_entropy_cost", float("inf")), ("hidden_sizes", (0,)), ("hidden_sizes", 64)])
def test_bad_config_is_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        PPOConfig(**{field: value})


@pytest.mark.timeout(60)
def test_step_records_the_log_prob_and_greedy_step_takes_the_argmax():
    agent = PPO(SPEC)
    nets = agent.new_networks(jax.random.key(0))
    env_step = example_env_step(SPEC, 5)._replace(obs=jax.random.normal(jax.random.key(1), (5, 4)))
    state = agent.new_step_state(nets, jax.random.key(2), 5)
    _, out = agent.network.apply(nets, (), env_step.obs[:, None], env_step.first[:, None])
    log_probs = np.asarray(jax.nn.log_softmax(out.policy.logits[:, 0]))

    out, _ = jax.jit(agent.step)(state, nets, env_step)
    chosen = log_probs[np.arange(5), np.asarray(out.action)]
    np.testing.assert_allclose(np.asarray(out.extras["log_prob"]), chosen, rtol=1e-5)

    greedy, _ = jax.jit(agent.greedy_step)(state, nets, env_step)
    np.testing.assert_array_equal(np.asarray(greedy.action), log_probs.argmax(-1))


def prepared(agent: PPO, trajectory: Trajectory, nets, num_envs: int, steps: int):
    layout = sebulba.Layout(envs_per_group=num_envs, num_groups=1, steps_per_cycle=steps,
                            num_learner_devices=1)
    experience = agent.new_experience_state(nets, jax.random.key(1), layout)
    return jax.jit(agent.update_experience)(experience, None, None, trajectory, nets)


@pytest.mark.timeout(120)
def test_each_epoch_visits_every_segment_once():
    cfg = PPOConfig(num_epochs=3, num_minibatches=4, bptt_horizon=2)
    agent = PPO(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    e, t = 4, 4  # 4 envs x 2 segments of 2 steps = 8 segments, 2 per minibatch
    trajectory = sebulba.zeros_trajectory(agent, nets, e, t)
    # Tag each observation with env * 10 + step, to see which segments a minibatch takes.
    tags = 10.0 * jnp.arange(e)[:, None] + jnp.arange(t + 1)[None]
    obs = jnp.broadcast_to(tags[..., None], trajectory.env_steps.obs.shape)
    trajectory = trajectory._replace(env_steps=trajectory.env_steps._replace(obs=obs))
    experience = prepared(agent, trajectory, nets, e, t)
    assert agent.num_off_policy_optims_per_cycle() == 12
    np.testing.assert_array_equal(experience.weights, np.ones(8))

    @jax.jit
    def next_minibatch(experience):
        minibatch, _ = agent._minibatch(experience)
        _, (experience, _) = agent.loss(nets, (), experience)  # advances the cursor
        return minibatch.obs[..., 0], experience

    for _ in range(cfg.num_epochs):
        seen = []
        for _ in range(cfg.num_minibatches):
            segs, experience = next_minibatch(experience)
            assert segs.shape == (2, 2)
            for seg in np.asarray(segs).astype(int):
                env, start = divmod(int(seg[0]), 10)
                assert start % 2 == 0 and seg.tolist() == [seg[0], seg[0] + 1]  # one env, in order
                seen.append((env, start))
        assert sorted(seen) == [(env, s) for env in range(e) for s in (0, 2)]
    assert int(experience.cursor) == 12


def act(agent: PPO, nets, state, obs: jax.Array, first: jax.Array) -> Trajectory:
    """Acts like an inferencer over obs [E, T + 1, D] / first [E, T + 1]: one `step` per
    env step, recording its outputs."""
    step = jax.jit(agent.step)
    e, t1 = first.shape
    outputs = []
    for t in range(t1 - 1):
        env_step = EnvStep(obs[:, t], jnp.zeros(e), jnp.zeros(e, bool), jnp.zeros(e, bool),
                           first[:, t])
        out, state = step(state, nets, env_step)
        outputs.append(out)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *outputs)
    zeros = jnp.zeros((e, t1))
    return Trajectory(EnvStep(obs, zeros, zeros.astype(bool), zeros.astype(bool), first), stacked)


@pytest.mark.timeout(120)
def test_lstm_training_unrolls_each_segment_from_the_actors_state():
    agent = PPO(SPEC, PPOConfig(use_lstm=True, lstm_size=16, hidden_sizes=(16,),
                                bptt_horizon=3, num_minibatches=2))
    nets = agent.new_networks(jax.random.key(0))
    e, t = 4, 6
    state = agent.new_step_state(nets, jax.random.key(1), e)
    # Mid-episode, as a trajectory that continues one: a non-zero state and no first flag.
    state = state._replace(core=jax.tree.map(
        lambda c: jax.random.normal(jax.random.key(2), c.shape), state.core))
    obs = jax.random.normal(jax.random.key(3), (e, t + 1, 4))
    first = jnp.zeros((e, t + 1), bool).at[1, 3].set(True).at[2, 4].set(True)
    trajectory = act(agent, nets, state, obs, first)
    batch = prepared(agent, trajectory, nets, e, t).batch  # 8 segments of 3 steps

    # Segments that start a trajectory start from the initial StepState.
    for leaf, init in zip(jax.tree.leaves(batch.core), jax.tree.leaves(state.core),
                          strict=True):
        np.testing.assert_allclose(leaf[0::2], init, rtol=1e-6)
    # Unrolling each segment from its stored state reproduces the actor's policy exactly,
    # resets inside a segment (env 2 at step 4) included.
    _, out = agent.network.apply(nets, batch.core, batch.obs, batch.first)
    logits = out.policy.logits
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), batch.action[..., None], -1)[..., 0]
    np.testing.assert_allclose(log_prob, batch.behaviour_log_prob, atol=1e-5)
    # The stored state matters: from zeros, segments continuing an episode act differently ...
    zeros = jax.tree.map(jnp.zeros_like, batch.core)
    from_zeros = agent.network.apply(nets, zeros, batch.obs, batch.first)[1].policy.logits
    assert not np.allclose(from_zeros[1], logits[1], atol=1e-4)
    # ... except where an episode starts at the segment's first step (env 1, step 3).
    np.testing.assert_allclose(from_zeros[3], logits[3], atol=1e-6)
    assert bool(batch.first[3, 0])


@pytest.mark.timeout(120)
def test_the_value_clip_is_centred_on_what_the_first_optimizer_step_sees():
    """Before any optimizer step nothing has moved, so the clipped value loss is the plain
    one, also for an LSTM cut into segments that the actor acted on with older networks
    (each segment unrolls from the actor's state, not from the whole unroll's)."""
    losses = {}
    for clip in (True, False):
        agent = PPO(SPEC, PPOConfig(use_lstm=True, lstm_size=16, hidden_sizes=(16,),
                                    bptt_horizon=3, num_minibatches=2, clip_epsilon=1e-6,
                                    clip_value_loss=clip))
        nets = agent.new_networks(jax.random.key(0))
        older = agent.new_networks(jax.random.key(5))  # the networks the actor acted with
        e, t = 4, 6
        state = agent.new_step_state(older, jax.random.key(1), e)
        obs = jax.random.normal(jax.random.key(3), (e, t + 1, 4))
        trajectory = act(agent, older, state, obs, jnp.zeros((e, t + 1), bool))
        experience = prepared(agent, trajectory, nets, e, t)
        _, (_, metrics) = jax.jit(agent.loss)(nets, (), experience)
        losses[clip] = float(metrics["value_loss"])
    assert losses[True] > 0
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)

@pytest.mark.timeout(120)
def test_importance_weights_multiply_the_policy_loss():
    agent = PPO(SPEC, PPOConfig(prio_alpha=0.8, prio_beta0=0.5, bptt_horizon=4,
                                num_minibatches=2))
    nets = agent.new_networks(jax.random.key(0))
    e, t = 4, 8
    obs = jax.random.normal(jax.random.key(1), (e, t + 1, 4))
    trajectory = act(agent, nets, agent.new_step_state(nets, jax.random.key(2), e), obs,
                     jnp.zeros((e, t + 1), bool).at[:, 0].set(True))
    # Rewards give the segments different advantages, so different priorities.
    reward = jax.random.uniform(jax.random.key(3), (e, t + 1)) * jnp.arange(1.0, e + 1)[:, None]
    trajectory = trajectory._replace(env_steps=trajectory.env_steps._replace(reward=reward))
    experience = prepared(agent, trajectory, nets, e, t)
    weights = np.asarray(experience.weights)
    assert weights.max() == 1.0 and weights.min() < 0.99  # prioritized: not all equal

    loss = jax.jit(agent.loss)
    _, (_, metrics) = loss(nets, (), experience)
    _, (_, halved) = loss(nets, (), experience._replace(weights=experience.weights * 0.5))
    np.testing.assert_allclose(halved["pg_loss"], 0.5 * metrics["pg_loss"], rtol=1e-5)
    np.testing.assert_allclose(halved["value_loss"], metrics["value_loss"], rtol=1e-6)
    assert abs(float(metrics["pg_loss"])) > 1e-4


@pytest.mark.timeout(180)
def test_lstm_ppo_runs_on_segments_across_two_learner_devices(no_leftovers):
    env, kwargs = suite.CUE_RECALL, {"num_cues": 2, "delay": 3}
    agent = PPO(sebulba.env_spec(env, kwargs),
                PPOConfig(use_lstm=True, hidden_sizes=(16,), lstm_size=16, bptt_horizon=4,
                          num_minibatches=2, num_epochs=1, prio_alpha=0.5, num_segments=16))
    config = sebulba.Config(env=env, env_kwargs=kwargs, envs_per_group=4, steps_per_cycle=16,
                            async_factor=2, inference_devices=[0], learner_devices=[1, 2])
    result = sebulba.Sebulba(agent, config).run(4 * 16 * 6)
    # One learner update per trajectory, 2 optimizer steps (2 minibatches) each.
    assert result.learner_updates == result.consumed // (4 * 16)
    assert result.optimizer_steps == 2 * result.learner_updates
    assert np.isfinite(result.metrics["loss"]) and 0 < result.metrics["importance_weight"] <= 1
    # Each learner device holds its 2 envs' 8 segments, with the actor's state at their starts.
    batch = result.state.experience.batch
    assert batch.obs.shape[:2] == (8, 4)
    # The policy's and the value's LSTM (the default: a core each), cell and hidden.
    assert [x.shape for x in jax.tree.leaves(batch.core)] == [(8, 16)] * 4
