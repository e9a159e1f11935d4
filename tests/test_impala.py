"""IMPALA's construction checks, acting outputs and the LSTM's acting/training agreement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sebulba
from agents.common import normalization
from agents.impala import IMPALA, IMPALAConfig
from sebulba.envs import example_env_step

SPEC = sebulba.env_spec("CartPole-v1")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs,message", [
    ({"optimizer": "sgd"}, r"optimizer must be one of \('adam', 'rmsprop'\), got 'sgd'"),
    ({"hidden_sizes": (64, 0)}, r"hidden_sizes must be a tuple of ints >= 1, got \(64, 0\)"),
    ({"lstm_size": 0}, "lstm_size must be an int >= 1, got 0"),
    ({"learning_rate": -1e-3},
     r"learning_rate must be a finite number > 0 \(or 0: by network\), got -0.001"),
    ({"normalize_advantages": True},
     r"normalize_advantages must be one of \('auto', 'on', 'off'\), got True"),
    ({"rho_bar": -1.0}, "rho_bar must be > 0, got -1.0"),
    ({"c_bar": 0.0}, "c_bar must be > 0, got 0.0"),
    ({"pg_rho_bar": 0.0}, "pg_rho_bar must be > 0, got 0.0"),
    ({"discount": 1.5}, r"discount must be in \[0, 1\], got 1.5"),
    ({"vtrace_lambda": -0.1}, r"vtrace_lambda must be in \[0, 1\], got -0.1"),
    ({"entropy_cost": -0.01}, "entropy_cost must be a finite number >= 0, got -0.01"),
    # An infinite step size or cost fails at the first update; an infinite eps learns
    # nothing, silently.
    ({"entropy_cost": float("inf")}, "entropy_cost must be a finite number >= 0, got inf"),
    ({"baseline_cost": float("inf")}, "baseline_cost must be a finite number >= 0, got inf"),
    ({"learning_rate": float("inf")},
     r"learning_rate must be a finite number > 0 \(or 0: by network\), got inf"),
    ({"optimizer_eps": float("inf")}, "optimizer_eps must be a finite number > 0, got inf"),
    ({"reward_clip": -1.0}, "reward_clip must be >= 0, got -1.0"),
    ({"c_bar": 2.0}, "c_bar must be <= rho_bar, got c_bar=2.0 > rho_bar=1.0"),
    ({"num_minibatches": -1}, r"num_minibatches must be an int >= 1 \(or 0: by network\), got -1"),
    ({"num_epochs": 2.0}, r"num_epochs must be an int >= 1 \(or 0: by network\), got 2.0"),
    ({"ratio_clip": 0.0}, "ratio_clip must be > 0, got 0.0"),
])
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IMPALAConfig(**kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_lstm", [False, True])
def test_step_records_the_behaviour_log_prob(use_lstm):
    agent = IMPALA(SPEC, IMPALAConfig(use_lstm=use_lstm))
    nets = agent.new_networks(jax.random.key(0))
    env_step = example_env_step(SPEC, 5)._replace(
        obs=jax.random.normal(jax.random.key(1), (5, 4)), first=jnp.ones(5, bool))
    state = agent.new_step_state(nets, jax.random.key(2), 5)
    _, out = agent.network.apply(nets, state.core, env_step.obs[:, None],
                                 env_step.first[:, None])
    log_probs = np.asarray(jax.nn.log_softmax(out.policy.logits[:, 0]))

    out, _ = jax.jit(agent.step)(state, nets, env_step)
    chosen = log_probs[np.arange(5), np.asarray(out.action)]
    np.testing.assert_allclose(np.asarray(out.extras["log_prob"]), chosen, rtol=1e-5)
    greedy, _ = jax.jit(agent.greedy_step)(state, nets, env_step)
    np.testing.assert_array_equal(np.asarray(greedy.action), log_probs.argmax(-1))


@pytest.mark.timeout(120)
def test_lstm_training_unroll_reproduces_the_acting_policy():
    # The actor steps one observation at a time, resetting where `first` is set; the
    # learner unrolls the trajectory from the initial StepState's LSTM state. Both must
    # give the same logits, so that on-policy ratios are exactly 1.
    # One minibatch: the loss sees every env row (the LSTM default splits them in 4).
    agent = IMPALA(SPEC, IMPALAConfig(use_lstm=True, lstm_size=8, hidden_sizes=(8,),
                                      num_minibatches=1))
    nets = agent.new_networks(jax.random.key(0))
    num_envs, t_len = 3, 6
    obs = jax.random.normal(jax.random.key(1), (num_envs, t_len + 1, 4))
    first = np.zeros((num_envs, t_len + 1), bool)
    first[0, 3] = first[1, 0] = first[2, 5] = True  # episodes start mid-trajectory
    terminated = np.roll(first, -1, axis=1) & ~np.eye(1, t_len + 1, t_len, dtype=bool)
    state = agent.new_step_state(nets, jax.random.key(2), num_envs)
    # A non-zero state to start from, as after earlier cycles.
    state = state._replace(core=jax.tree.map(lambda x: x + 0.5, state.core))
    initial = state

    step = jax.jit(agent.step)
    log_probs, actions = [], []
    for t in range(t_len):
        env_step = example_env_step(SPEC, num_envs)._replace(
            obs=obs[:, t], first=jnp.asarray(first[:, t]))
        out, state = step(state, nets, env_step)
        log_probs.append(out.extras["log_prob"])
        actions.append(out.action)
    trajectory = sebulba.Trajectory(
        env_steps=example_env_step(SPEC, num_envs)._replace(
            obs=obs, reward=jnp.zeros((num_envs, t_len + 1)),
            terminated=jnp.asarray(terminated), truncated=jnp.zeros((num_envs, t_len + 1), bool),
            first=jnp.asarray(first)),
        actor_outputs=sebulba.ActorOutput(
            action=jnp.stack(actions, 1), extras={"log_prob": jnp.stack(log_probs, 1)}))
    layout = sebulba.Layout(envs_per_group=num_envs, num_groups=1, steps_per_cycle=t_len,
                            num_learner_devices=1)
    experience = agent.new_experience_state(nets, jax.random.key(3), layout)
    experience = jax.jit(agent.update_experience)(experience, initial, state, trajectory, nets)
    _, (_, metrics) = jax.jit(agent.loss)(nets, agent.new_opt_state(nets, None), experience)
    np.testing.assert_allclose(float(metrics["rho_mean"]), 1.0, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["approx_kl"]), 0.0, atol=1e-6)

    # Without the reset, or from a zero state, the unroll would differ.
    _, out = agent.network.apply(nets, initial.core, obs, jnp.zeros_like(first))
    _, out_reset = agent.network.apply(nets, initial.core, obs, jnp.asarray(first))
    assert not np.allclose(np.asarray(out.policy.logits[0, 3:]),
                           np.asarray(out_reset.policy.logits[0, 3:]))


@pytest.mark.timeout(120)
def test_a_trajectory_from_older_networks_is_corrected(no_leftovers):
    # Real loop, two learner devices, lag >= 1: the ratios differ from 1 but stay finite.
    config = sebulba.Config(envs_per_group=8, steps_per_cycle=8, learner_devices=[0, 1],
                            inference_devices=[2], seed=3)
    agent = IMPALA(SPEC, IMPALAConfig(use_lstm=True, lstm_size=16, hidden_sizes=(16,)))
    result = sebulba.Sebulba(agent, config).run(8 * 8 * 40)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert max(result.policy_lags) >= 1
    assert result.metrics["rho_mean"] != 1.0 and np.isfinite(result.metrics["loss"])


def _experience(agent, nets, reward):
    """A zero trajectory of 4 envs x 5 steps with rewards `reward` (broadcast to [4, 6]),
    actions of the learner's own policy (ratio 1)."""
    trajectory = sebulba.zeros_trajectory(agent, nets, 4, 5)
    steps = trajectory.env_steps._replace(
        obs=jax.random.normal(jax.random.key(1), trajectory.env_steps.obs.shape),
        reward=jnp.full((4, 6), reward, jnp.float32))
    state = agent.new_step_state(nets, jax.random.key(0), 4)
    _, out = agent.network.apply(nets, state.core, steps.obs[:, :-1], steps.first[:, :-1])
    outputs = sebulba.ActorOutput(
        action=trajectory.actor_outputs.action,
        extras={"log_prob": jax.nn.log_softmax(out.policy.logits)[..., 0]})
    layout = sebulba.Layout(envs_per_group=4, num_groups=1, steps_per_cycle=5,
                            num_learner_devices=1)
    experience = agent.new_experience_state(nets, jax.random.key(2), layout)
    return agent.update_experience(experience, state, None,
                                   sebulba.Trajectory(steps, outputs), nets)


@pytest.mark.timeout(60)
def test_reward_clipping_bounds_the_rewards_learnt_from():
    clipped = IMPALA(SPEC, IMPALAConfig(reward_clip=1.0))
    plain = IMPALA(SPEC, IMPALAConfig())
    nets = plain.new_networks(jax.random.key(0))

    def loss(agent, reward):
        return float(agent.loss(nets, (), _experience(agent, nets, reward))[0])

    assert loss(clipped, 100.0) == pytest.approx(loss(plain, 1.0), rel=1e-5)
    assert loss(plain, 100.0) != pytest.approx(loss(plain, 1.0), rel=1e-2)


@pytest.mark.timeout(60)
def test_the_loss_scales_large_returns_down_and_leaves_small_ones():
    # The default ("down") divides by the std of the return only where it exceeds 1.
    down, on = IMPALA(SPEC, IMPALAConfig()), IMPALA(SPEC, IMPALAConfig(normalize_rewards="on"))
    off = IMPALA(SPEC, IMPALAConfig(normalize_rewards="off"))
    nets = down.new_networks(jax.random.key(0))
    raw = {k: v for k, v in nets.items() if k != normalization.COLLECTION}  # no moments

    def with_std(std):
        stats = nets[normalization.COLLECTION]
        return {**nets, normalization.COLLECTION: {
            **stats, "reward": {**stats["reward"], "var": jnp.float32(std ** 2)}}}

    def loss(agent, nets, reward):
        return float(agent.loss(nets, (), _experience(agent, nets, reward))[0])

    small, large = with_std(0.1), with_std(30.0)
    assert loss(down, small, 1.0) == pytest.approx(loss(off, raw, 1.0), rel=1e-5)
    assert loss(on, small, 1.0) == pytest.approx(loss(off, raw, 10.0), rel=1e-5)
    assert loss(down, large, 30.0) == pytest.approx(loss(on, large, 30.0), rel=1e-5)
    assert loss(down, large, 30.0) == pytest.approx(loss(off, raw, 1.0), rel=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_an_optimizer_step_lowers_the_loss(optimizer):
    agent = IMPALA(SPEC, IMPALAConfig(optimizer=optimizer, learning_rate=1e-4,
                                      optimizer_eps=1e-8))
    nets = agent.new_networks(jax.random.key(0))
    experience = _experience(agent, nets, 1.0)
    opt = agent.new_opt_state(nets, None)
    loss_and_grad = jax.value_and_grad(lambda n: agent.loss(n, opt, experience)[0])
    before, grads = loss_and_grad(nets)
    nets, _ = agent.optimize_from_grads(nets, opt, grads)
    after, _ = loss_and_grad(nets)
    assert float(after) < float(before)


@pytest.mark.timeout(60)
def test_minibatches_split_the_rows_afresh_and_each_pass_visits_every_row_once():
    agent = IMPALA(SPEC, IMPALAConfig(num_minibatches=2, num_epochs=3))
    assert agent.num_off_policy_optims_per_cycle() == 6
    nets = agent.new_networks(jax.random.key(0))
    experience = _experience(agent, nets, 1.0)
    rows = np.asarray(experience.rows)
    assert rows.shape == (6, 2)
    for epoch in rows.reshape(3, 4):  # each pass: a split of all 4 rows
        assert sorted(epoch) == [0, 1, 2, 3]
    # Each step learns from its own rows alone: other rewards elsewhere leave it unchanged
    # (`_experience` splits every shard with the same key, so the rows are the same).
    loss = jax.jit(agent.loss)
    for step in range(6):
        others = sorted(set(range(4)) - set(rows[step]))
        changed = _experience(agent, nets, np.where(np.isin(np.arange(4), others), 5.0,
                                                    1.0)[:, None])
        mine = _experience(agent, nets, np.where(np.isin(np.arange(4), rows[step]), 5.0,
                                                 1.0)[:, None])
        at = experience._replace(step=jnp.int32(step))
        base = float(loss(nets, (), at)[0])
        assert float(loss(nets, (), changed._replace(step=jnp.int32(step)))[0]) == base
        assert float(loss(nets, (), mine._replace(step=jnp.int32(step)))[0]) != \
            pytest.approx(base, rel=1e-3)
    # A new shard gets a new split (the key moves on).
    layout = sebulba.Layout(envs_per_group=64, num_groups=1, steps_per_cycle=2,
                            num_learner_devices=1)
    first = agent.new_experience_state(nets, jax.random.key(3), layout)
    second = agent._experience(first.latest, first.targets, first.key)
    assert not np.array_equal(np.asarray(first.rows), np.asarray(second.rows))


@pytest.mark.timeout(60)
def test_targets_fixed_as_the_shard_arrives_are_those_one_step_computes():
    # Several steps per shard learn towards targets computed once, from the networks the
    # shard met; from the same networks they are exactly what a single step computes.
    small = {"use_lstm": True, "lstm_size": 8, "hidden_sizes": (8,),
             "normalize_advantages": "off"}
    one_step = IMPALA(SPEC, IMPALAConfig(**small, num_minibatches=1, num_epochs=1))
    two_epochs = IMPALA(SPEC, IMPALAConfig(**small, num_minibatches=1, num_epochs=2))
    nets = one_step.new_networks(jax.random.key(0))
    rewards = np.arange(4.0)[:, None]
    single, (_, metrics) = one_step.loss(nets, (), _experience(one_step, nets, rewards))
    fixed_experience = _experience(two_epochs, nets, rewards)
    fixed, (_, fixed_metrics) = two_epochs.loss(nets, (), fixed_experience)
    assert float(fixed) == pytest.approx(float(single), rel=1e-5)
    assert float(fixed_metrics["pg_loss"]) == pytest.approx(float(metrics["pg_loss"]), rel=1e-5)
    assert np.abs(np.asarray(fixed_experience.targets.advantage)).max() > 0


@pytest.mark.timeout(60)
def test_minibatches_that_do_not_divide_the_rows_are_refused():
    agent = IMPALA(SPEC, IMPALAConfig(num_minibatches=3))
    nets = agent.new_networks(jax.random.key(0))
    layout = sebulba.Layout(envs_per_group=8, num_groups=1, steps_per_cycle=4,
                            num_learner_devices=2)
    with pytest.raises(ValueError, match="num_minibatches=3 must divide the 4 env rows"):
        agent.new_experience_state(nets, jax.random.key(1), layout)


@pytest.mark.timeout(60)
def test_several_steps_clip_the_policys_drift_from_the_policy_that_acted():
    # Past 1 + ratio_clip a positive advantage no longer pulls the policy further, however
    # the drift from the behaviour policy mu arose (lag or earlier steps on the shard).
    # Raw advantages: standardized, some would turn negative, which the clip leaves be.
    agent = IMPALA(SPEC, IMPALAConfig(num_epochs=2, ratio_clip=0.2, entropy_cost=0.0,
                                      baseline_cost=0.0, normalize_advantages="off"))
    nets = agent.new_networks(jax.random.key(0))
    experience = _experience(agent, nets, 1.0)
    advantage = np.asarray(experience.targets.advantage)
    assert (advantage > 0).all()

    def pg_grad_norm(log_prob_shift):
        # As if mu had given the actions exp(-shift) times pi's probability: pi / mu =
        # exp(shift).
        outputs = experience.latest.trajectory.actor_outputs
        behaviour = {"log_prob": outputs.extras["log_prob"] - log_prob_shift}
        moved = experience._replace(latest=experience.latest._replace(
            trajectory=experience.latest.trajectory._replace(
                actor_outputs=outputs._replace(extras=behaviour))))
        grads = jax.grad(lambda n: agent.loss(n, (), moved)[0])(nets)
        return float(optax.tree.norm(grads))

    assert pg_grad_norm(0.0) > 0 and pg_grad_norm(0.1) > 0  # ratio 1.1: inside the clip
    assert pg_grad_norm(0.5) == 0.0  # ratio 1.65: clipped
