"""R2D2 units: sequences hold the actor's states, burn-in, resets, IS weights, priorities,
target copies, warm-up, exploration rates, and a real loop's replay on two learner devices."""

from __future__ import annotations

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.common.value_rescaling import rescale
from agents.r2d2 import R2D2, R2D2Config, Sequence, n_step_returns, q_network
from sebulba.envs import suite
from sebulba.experience import replay as rp
from sebulba.runtime import sharding
from sebulba.runtime.learner import optimizer_step, per_learner_device
from sebulba.types import EnvStep, Trajectory

OBS_DIM, NUM_ACTIONS, H = 3, 2, 8
SPEC = sebulba.EnvSpec(gym.spaces.Box(-5.0, 5.0, (OBS_DIM,), np.float32),
                       gym.spaces.Discrete(NUM_ACTIONS))


def small_config(**kwargs) -> R2D2Config:
    defaults = dict(torso_sizes=(16,), lstm_size=H, head_sizes=(16,), sequence_length=8,
                    sequence_overlap=4, burn_in=3, n_step=2, discount=0.9, batch_size=8,
                    replay_capacity=32, min_replay_size=1, target_update_period=3,
                    learning_rate=1e-2)
    return R2D2Config(**{**defaults, **kwargs})


def random_sequences(key, num: int, cfg: R2D2Config, first_rate: float = 0.1) -> Sequence:
    L = cfg.sequence_length
    k = jax.random.split(key, 6)
    last = jax.random.uniform(k[0], (num, L + 1)) < first_rate
    terminated = last & (jax.random.uniform(k[1], (num, L + 1)) < 0.5)
    first = jnp.zeros_like(last).at[:, 1:].set(last[:, :-1])
    steps = EnvStep(
        obs=jax.random.normal(k[2], (num, L + 1, OBS_DIM)),
        reward=jnp.where(first, 0.0, jax.random.normal(k[3], (num, L + 1))),
        terminated=terminated, truncated=last & ~terminated, first=first)
    network = q_network(NUM_ACTIONS, SPEC.observation_space,
                        cfg.resolved(SPEC.observation_space))
    lstm = jax.tree.map(lambda x: 0.5 * jax.random.normal(k[4], x.shape),
                        network.initial_state(num))
    return Sequence(steps, jax.random.randint(k[5], (num, L), 0, NUM_ACTIONS), lstm,
                    jnp.zeros((num,), jnp.int32))


def experience_with(agent: R2D2, nets, sequences: Sequence, priorities) -> object:
    layout = sebulba.Layout(envs_per_group=4, num_groups=1,
                            steps_per_cycle=agent.config.sequence_period, num_learner_devices=1)
    exp = agent.new_experience_state(nets, jax.random.key(7), layout)
    n = len(priorities)
    replay = rp.insert(exp.replay, sequences)
    replay = rp.update_priorities(replay, jnp.arange(n), jnp.asarray(priorities, jnp.float32))
    return exp._replace(replay=replay)


@pytest.mark.timeout(240)
def test_config_errors_name_the_value_and_the_expectation():
    with pytest.raises(ValueError, match="n_step must be an int >= 1, got 0"):
        R2D2Config(n_step=0)
    with pytest.raises(ValueError, match="burn_in=80 must be < sequence_length=80"):
        R2D2Config(burn_in=80)
    # no overlap with a burn-in: half of the steps would never be learnt from
    with pytest.raises(ValueError, match=r"burn_in=40 must be <= sequence_overlap=0: else "
                                         r"40 of every 80 env steps fall in a burn-in"):
        R2D2Config(sequence_length=80, sequence_overlap=0)
    with pytest.raises(ValueError, match=r"sequence_length=80 must be a multiple of its "
                                         r"period, sequence_length - sequence_overlap = 30"):
        R2D2Config(sequence_overlap=50)
    with pytest.raises(ValueError, match="min_replay_size=10 must be <= replay_capacity=5"):
        R2D2Config(min_replay_size=10, replay_capacity=5)
    with pytest.raises(ValueError, match="discount must be in \\[0, 1\\], got 1.5"):
        R2D2Config(discount=1.5)
    with pytest.raises(ValueError, match="priority_exponent must be a finite number >= 0, "
                                         "got inf"):
        R2D2Config(priority_exponent=float("inf"))
    for field in ("learning_rate", "adam_eps"):  # inf: no learning at all, silently
        with pytest.raises(ValueError, match=f"{field} must be a finite number > 0, got inf"):
            R2D2Config(**{field: float("inf")})
    agent = R2D2(SPEC, small_config())
    layout = sebulba.Layout(envs_per_group=4, num_groups=2, steps_per_cycle=5,
                            num_learner_devices=1)
    with pytest.raises(ValueError, match=r"steps_per_cycle=5 must equal the sequence period "
                                         r"sequence_length - sequence_overlap = 8 - 4 = 4"):
        agent.new_state(agent.new_networks(jax.random.key(0)), jax.random.key(1), layout)


@pytest.mark.timeout(60)
def test_dropping_trajectories_is_refused_because_sequences_span_them():
    # A sequence joins an env's consecutive trajectories: with drop_when_full the ones on
    # either side of a dropped trajectory would become one sequence that never happened.
    agent = R2D2(sebulba.env_spec("CartPole-v1"), R2D2Config())
    with pytest.raises(ValueError, match=r"R2D2 joins each env's consecutive trajectories.*"
                                         r"drop_when_full=False"):
        sebulba.Sebulba(agent, sebulba.Config(env="CartPole-v1", drop_when_full=True))
    sebulba.Sebulba(agent, sebulba.Config(env="CartPole-v1"))  # backpressure is fine


@pytest.mark.timeout(240)
def test_exploration_rates_spread_over_all_envs():
    agent = R2D2(SPEC, small_config())
    state = agent.new_step_state(None, jax.random.key(0), 8)
    expected = 0.4 ** (1 + 7 * np.arange(8) / 7)
    np.testing.assert_allclose(state.epsilon, expected, rtol=1e-6)
    np.testing.assert_array_equal(state.env_index, np.arange(8))


@pytest.mark.timeout(240)
def test_n_step_returns_stop_at_episode_ends_and_the_sequence_end():
    # Steps 0..6; step 3 terminates (step 4 is a reset), step 6 is the sequence's end.
    reward = jnp.array([0.0, 1.0, 2.0, 4.0, 0.0, 8.0, 16.0])
    value = jnp.array([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0])
    terminated = jnp.zeros(7, bool).at[3].set(True)
    got = n_step_returns(reward, value, terminated, jnp.zeros(7, bool), 0.5, 2)
    expected = [1 + 0.5 * 2 + 0.25 * 30,  # two rewards, bootstrap step 2
                2 + 0.5 * 4 + 0.25 * 0,  # step 3 terminated: no bootstrap
                4 + 0.5 * 0,  # one step to the terminal step
                0.0,  # ignored action (masked in the loss); nothing flows back over the end
                8 + 0.5 * 16 + 0.25 * 70,
                16 + 0.5 * 70]  # the sequence's end bootstraps after one step
    kept = np.array([0, 1, 2, 4, 5])
    np.testing.assert_allclose(np.asarray(got)[kept], np.array(expected)[kept])
    truncated = jnp.zeros(7, bool).at[3].set(True)
    got = n_step_returns(reward, value, jnp.zeros(7, bool), truncated, 0.5, 2)
    assert float(got[2]) == pytest.approx(4 + 0.5 * 40)  # truncation bootstraps


def act_two_groups(agent, nets, step_state, envs, T, cycles) -> list:
    """`act_and_record` for each of two groups of `envs` envs (their slices of
    `step_state`), with their own random observations."""
    return [act_and_record(agent, nets,
                           jax.tree.map(lambda x, g=g: x[g * envs:(g + 1) * envs], step_state),
                           envs, np.random.default_rng(g), cycles, T) for g in range(2)]


def act_and_record(agent, nets, step_state, envs, rng, cycles, T):
    """Runs `cycles` inference cycles of one group on random observations.

    Returns the per-cycle (initial step state, trajectory) and, per env, the stream of
    env steps, actions and the actor's LSTM state before each step.
    """
    step = jax.jit(agent.step)
    nets = agent.acting_nets(nets, 0)
    env_step = EnvStep(obs=jnp.asarray(rng.normal(size=(envs, OBS_DIM)), jnp.float32),
                       reward=jnp.zeros(envs), terminated=jnp.zeros(envs, bool),
                       truncated=jnp.zeros(envs, bool), first=jnp.ones(envs, bool))
    items, stream = [], {"steps": [], "actions": [], "core": []}
    for _ in range(cycles):
        initial, steps, actions = step_state, [], []
        for _ in range(T):
            stream["core"].append(step_state.core)
            out, step_state = step(step_state, nets, env_step)
            steps.append(env_step)
            actions.append(out.action)
            last = rng.uniform(size=envs) < 0.15  # episodes end at random
            was_last = np.asarray(env_step.terminated | env_step.truncated)
            env_step = EnvStep(
                obs=jnp.asarray(rng.normal(size=(envs, OBS_DIM)), jnp.float32),
                reward=jnp.asarray(np.where(was_last, 0.0, rng.normal(size=envs)), jnp.float32),
                terminated=jnp.asarray(last & ~was_last), truncated=jnp.zeros(envs, bool),
                first=jnp.asarray(was_last))
        steps.append(env_step)
        stream["steps"].extend(steps[:-1])
        stream["actions"].extend(actions)
        traj = Trajectory(jax.tree.map(lambda *x: jnp.stack(x, 1), *steps),
                          sebulba.ActorOutput(jnp.stack(actions, 1)))
        items.append((initial, traj))
    return items, stream


@pytest.mark.timeout(240)
@pytest.mark.parametrize("length", [8, 12])  # K = 2 and 3 trajectories per sequence
def test_sequences_hold_the_actors_states_and_steps(length):
    T, E, D = 4, 4, 2  # envs per group, learner devices: this shard gets rows 2 and 3
    agent = R2D2(SPEC, small_config(sequence_length=length, sequence_overlap=length - T,
                                    replay_capacity=64))
    nets = agent.new_networks(jax.random.key(0))
    layout = sebulba.Layout(envs_per_group=E, num_groups=2, steps_per_cycle=T,
                            num_learner_devices=D)
    state = agent.new_state(nets, jax.random.key(1), layout)
    experience = state.experience
    cycles = 5
    groups = act_two_groups(agent, nets, state.step_state, E, T, cycles)
    update = jax.jit(agent.update_experience)
    rows = slice(2, 4)
    for c in range(cycles):
        for g in range(2):  # the groups' trajectories arrive interleaved
            initial, traj = groups[g][0][c]
            experience = update(experience, jax.tree.map(lambda x: x[rows], initial), None,
                                jax.tree.map(lambda x: x[rows], traj), nets)
    replay = experience.replay
    k = length // T
    per_env = cycles - k + 1
    assert int(replay.size) == 2 * 2 * per_env
    seen = 0
    for i in range(int(replay.size)):
        item = jax.tree.map(lambda x, i=i: np.asarray(x[i]), replay.items)
        env = int(item.env_index)
        g, row = divmod(env, E)
        assert row in (2, 3)  # only this shard's envs
        stream = groups[g][1]
        # Which sequence of this env: rows of the same env are inserted in time order.
        j = sum(int(replay.items.env_index[p]) == env for p in range(i))
        start = j * T
        jax.tree.map(lambda got, want, r=row: np.testing.assert_array_equal(got, want[r]),
                     item.core, stream["core"][start])
        obs = np.stack([s.obs[row] for s in stream["steps"][start:start + length]])
        np.testing.assert_array_equal(item.env_steps.obs[:length], obs)
        first = np.array([s.first[row] for s in stream["steps"][start:start + length]])
        np.testing.assert_array_equal(item.env_steps.first[:length], first)
        actions = np.array([a[row] for a in stream["actions"][start:start + length]])
        np.testing.assert_array_equal(item.action, actions)
        seen += 1
    assert seen == 4 * per_env


@pytest.mark.timeout(240)
def test_burn_in_steps_contribute_zero_gradient():
    # Observation entry 0 is non-zero only during the burn-in. The torso's first kernel
    # row for that entry gets gradient only through burn-in steps, so it must be zero.
    def grads(burn_in):
        cfg = small_config(burn_in=burn_in)
        agent = R2D2(SPEC, cfg)
        nets = agent.new_networks(jax.random.key(0))
        seqs = random_sequences(jax.random.key(1), 4, cfg, first_rate=0.0)
        obs = seqs.env_steps.obs.at[:, 3:, 0].set(0.0)  # 3 = the burn-in below
        seqs = seqs._replace(env_steps=seqs.env_steps._replace(obs=obs))

        def loss(online):
            losses, _, _ = agent.sequence_losses(nets._replace(online=online), seqs)
            return jnp.mean(losses)

        g = jax.jit(jax.grad(loss))(nets.online)
        # The first layer of each torso (the advantage's and the value's), side by side.
        kernels = [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(g)
                   if "torso" in jax.tree_util.keystr(path)
                   and jax.tree_util.keystr(path).endswith("['Dense_0']['kernel']")]
        assert len(kernels) == 2
        return np.concatenate(kernels, axis=1)

    kernel_grad = grads(burn_in=3)
    np.testing.assert_array_equal(kernel_grad[0], 0.0)
    assert np.abs(kernel_grad[1:]).max() > 0
    # Learning from those steps (no burn-in) does reach the row: the test can fail.
    assert np.abs(grads(burn_in=0)[0]).max() > 1e-6


@pytest.mark.timeout(240)
def test_state_resets_where_an_episode_starts_inside_a_sequence():
    cfg = small_config(burn_in=3)
    agent = R2D2(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    seqs = random_sequences(jax.random.key(1), 2, cfg, first_rate=0.0)
    # An episode starts at step 3 (the first learnt step) in both sequences, which
    # differ only before it: their stored states and burn-in observations.
    steps = seqs.env_steps
    steps = steps._replace(
        first=steps.first.at[:, 3].set(True),
        terminated=steps.terminated.at[:, 2].set(True),
        obs=steps.obs.at[1, 3:].set(steps.obs[0, 3:]),
        reward=steps.reward.at[1, 3:].set(steps.reward[0, 3:]).at[:, 3].set(0.0))
    seqs = seqs._replace(
        env_steps=steps, action=seqs.action.at[1].set(seqs.action[0]),
        core=jax.tree.map(lambda x: x.at[1].set(-3.0 * x[0] + 1.0), seqs.core))
    sequence_losses = jax.jit(agent.sequence_losses)
    losses, priorities, _ = sequence_losses(nets, seqs)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    np.testing.assert_allclose(priorities[0], priorities[1], rtol=1e-5)
    # Without the reset the stored states would matter.
    no_reset = seqs._replace(env_steps=steps._replace(first=steps.first.at[:, 3].set(False)))
    losses, _, _ = sequence_losses(nets, no_reset)
    assert abs(float(losses[0] - losses[1])) > 1e-6
    # Acting resets too: a `first` step from any state acts as from the zero state.
    env_step = EnvStep(steps.obs[:, 3], steps.reward[:, 3], jnp.zeros(2, bool),
                       jnp.zeros(2, bool), jnp.ones(2, bool))
    state = agent.new_step_state(nets, jax.random.key(2), 2)
    carried = state._replace(core=jax.tree.map(lambda x: x + 2.0, state.core))
    a, s_a = agent.greedy_step(state, nets.online, env_step)
    b, s_b = agent.greedy_step(carried, nets.online, env_step)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), s_a.core, s_b.core)


@pytest.mark.timeout(240)
def test_importance_weights_scale_the_loss():
    cfg = small_config(importance_exponent=1.0)
    agent = R2D2(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    seqs = random_sequences(jax.random.key(1), 16, cfg)
    experience = experience_with(agent, nets, seqs, np.linspace(0.05, 5.0, 16))
    loss, _ = jax.jit(agent.loss)(nets, None, experience)
    _, sample_key = jax.random.split(experience.key)
    batch = rp.sample(experience.replay, sample_key, cfg.batch_size, cfg.importance_exponent)
    losses, _, _ = jax.jit(agent.sequence_losses)(nets, batch.items)
    assert np.min(batch.weights) < 0.5  # the weights differ
    np.testing.assert_allclose(loss, jnp.mean(batch.weights * losses), rtol=1e-5)
    assert abs(float(loss - jnp.mean(losses))) > 1e-3 * float(jnp.mean(losses))
    unweighted = R2D2(SPEC, small_config(importance_exponent=0.0))
    loss0, _ = jax.jit(unweighted.loss)(nets, None, experience)
    np.testing.assert_allclose(loss0, jnp.mean(losses), rtol=1e-5)


def one_learner_step(agent, nets, opt, experience):
    optimize = per_learner_device(lambda n, o, e: optimizer_step(agent, n, o, e),
                                  jax.devices()[:1], donate_argnums=())
    lead = jax.tree.map(lambda x: x[None], (nets, opt, experience))
    out = optimize(*lead)
    return jax.tree.map(lambda x: x[0], out)


@pytest.mark.timeout(240)
def test_a_learner_step_writes_back_priorities_and_trains_the_online_net_only():
    cfg = small_config(target_update_period=2)
    agent = R2D2(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    opt = agent.new_opt_state(nets, jax.random.key(0))
    seqs = random_sequences(jax.random.key(1), 16, cfg)
    experience = experience_with(agent, nets, seqs, np.full(16, 0.5))
    _, sample_key = jax.random.split(experience.key)
    sample_key = jax.random.fold_in(sample_key, 0)  # learner device 0's draw
    batch = rp.sample(experience.replay, sample_key, cfg.batch_size, cfg.importance_exponent)
    _, expected, _ = jax.jit(agent.sequence_losses)(nets, batch.items)

    new_nets, new_opt, new_exp, metrics = one_learner_step(agent, nets, opt, experience)
    drawn = np.asarray(batch.indices)
    np.testing.assert_allclose(new_exp.replay.priorities[drawn], expected, rtol=1e-5)
    untouched = np.setdiff1d(np.arange(16), drawn)
    np.testing.assert_array_equal(new_exp.replay.priorities[untouched], 0.5)
    # max_priority is the largest ever held: 1 initially, then the written-back ones.
    assert float(new_exp.replay.max_priority) == pytest.approx(max(1.0, float(expected.max())))
    assert int(new_opt.steps) == 1 and float(metrics["learning"]) == 1.0
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new_nets.online, nets.online)
    assert all(jax.tree.leaves(changed))
    jax.tree.map(np.testing.assert_array_equal, new_nets.target, nets.target)
    # The second step (target_update_period=2) copies the online net to the target.
    nets2, opt2, _, _ = one_learner_step(agent, new_nets, new_opt, new_exp)
    assert int(opt2.steps) == 2
    jax.tree.map(np.testing.assert_array_equal, nets2.target, nets2.online)


@pytest.mark.timeout(240)
def test_warm_up_changes_nothing_until_the_replay_holds_min_replay_size():
    cfg = small_config(min_replay_size=17)
    agent = R2D2(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    opt = agent.new_opt_state(nets, jax.random.key(0))
    experience = experience_with(agent, nets, random_sequences(jax.random.key(1), 16, cfg),
                                 np.full(16, 0.5))
    new_nets, new_opt, new_exp, metrics = one_learner_step(agent, nets, opt, experience)
    assert float(metrics["loss"]) == 0.0 and float(metrics["learning"]) == 0.0
    for before, after in [(nets, new_nets), (opt, new_opt)]:
        jax.tree.map(np.testing.assert_array_equal, after, before)
    np.testing.assert_array_equal(new_exp.replay.priorities, experience.replay.priorities)


@pytest.mark.timeout(600)
def test_a_real_run_stores_the_actors_states_on_each_learner_device(no_leftovers):
    # Learning never starts (min_replay_size = capacity), so the networks stay the
    # initial ones and the learner can recompute what the actors did: a sequence's
    # stored state, unrolled over its first T steps, is the next sequence's stored state.
    env, kwargs, T, E = suite.CUE_RECALL, {"num_cues": 2, "delay": 3}, 4, 4
    cfg = R2D2Config(torso_sizes=(8,), lstm_size=H, head_sizes=(8,), sequence_length=2 * T,
                     sequence_overlap=T, burn_in=2, batch_size=4, replay_capacity=200,
                     min_replay_size=200)
    agent = R2D2(sebulba.env_spec(env, kwargs), cfg)
    config = sebulba.Config(env=env, env_kwargs=kwargs, envs_per_group=E, steps_per_cycle=T,
                            async_factor=2, learner_devices=[0, 1], seed=3)
    result = sebulba.Sebulba(agent, config).run(2 * E * T * 12)
    assert result.learner_updates == 0 or result.metrics["learning"] == 0.0
    for size, checked in check_stored_sequences(agent, result, E, T):
        assert size >= 8 and checked >= 4


def check_stored_sequences(agent: R2D2, result, E: int, T: int) -> list[tuple[int, int]]:
    """Checks each of 2 learner devices' replay after a run in which learning never
    started: it holds only its own envs (env i on device (i % E) // (E / 2)), an env's
    consecutive sequences overlap by T steps, and each stored state is the actors' state
    at the sequence's start (unrolling a sequence's first T steps from its stored state
    gives the next one's). Returns (replay size, pairs checked) per device."""
    nets = result.state.nets
    unroll = jax.jit(agent.network.apply)
    checks = []
    for device in range(2):
        exp = jax.tree.map(lambda x, d=device: x[d], result.learner_experience)
        size = int(exp.replay.size)
        items = jax.tree.map(lambda x, n=size: np.asarray(x[:n]), exp.replay.items)
        index = items.env_index
        np.testing.assert_array_equal((index % E) // (E // 2), device)
        checked = 0
        for env_id in np.unique(index):
            rows = np.flatnonzero(index == env_id)
            for a, b in zip(rows[:-1], rows[1:], strict=True):
                seq_a = jax.tree.map(lambda x, a=a: x[a], items)
                seq_b = jax.tree.map(lambda x, b=b: x[b], items)
                np.testing.assert_array_equal(seq_a.env_steps.obs[T:], seq_b.env_steps.obs[:T + 1])
                np.testing.assert_array_equal(seq_a.action[T:], seq_b.action[:T])
                state, _ = unroll(nets.online,
                                  jax.tree.map(lambda x: x[None], seq_a.core),
                                  seq_a.env_steps.obs[None, :T],
                                  seq_a.env_steps.first[None, :T])
                jax.tree.map(lambda x, y: np.testing.assert_allclose(x[0], y, atol=1e-5),
                             state, seq_b.core)
                checked += 1
        checks.append((size, checked))
    return checks


@pytest.mark.timeout(240)
def test_value_rescaling_is_applied_to_targets():
    # With rewards of 100 the rescaled target is h(100 + ...) ~ 9, not ~100.
    cfg = small_config(burn_in=0, n_step=1, discount=0.0)
    seqs = random_sequences(jax.random.key(1), 2, cfg, first_rate=0.0)
    seqs = seqs._replace(env_steps=seqs.env_steps._replace(
        reward=jnp.full_like(seqs.env_steps.reward, 100.0)))
    for rescaled, target in [(True, float(rescale(jnp.float32(100.0)))), (False, 100.0)]:
        agent = R2D2(SPEC, small_config(burn_in=0, n_step=1, discount=0.0,
                                        value_rescaling=rescaled))
        nets = agent.new_networks(jax.random.key(0))
        _, _, metrics = jax.jit(agent.sequence_losses)(nets, seqs)
        assert float(metrics["abs_td"]) == pytest.approx(target, abs=2.0)


@pytest.mark.timeout(240)
def test_rewards_are_learnt_in_units_of_their_running_rms():
    """With `normalize_rewards` the targets do not depend on the rewards' scale: a task
    paying 1/46 a step is learnt as one paying 1 (with raw rewards of 1/46 a step R2D2
    stays at half the optimum of RepeatPrevious-v0; benchmarks/RESULTS.md, "The memory
    suite")."""
    E, T = 4, 4
    layout = sebulba.Layout(envs_per_group=E, num_groups=1, steps_per_cycle=T,
                            num_learner_devices=1)
    reward = jax.random.uniform(jax.random.key(3), (E, T + 1), minval=-1.0, maxval=2.0)
    first = jnp.zeros((E, T + 1), bool).at[1, 2].set(True)  # a reset step: not counted

    def received(agent, scale):
        nets = agent.new_networks(jax.random.key(0))
        state = agent.new_state(nets, jax.random.key(1), layout)
        traj = sebulba.zeros_trajectory(agent, nets, E, T)
        traj = traj._replace(env_steps=traj.env_steps._replace(
            reward=jnp.where(first, 0.0, scale * reward), first=first))
        experience = jax.jit(agent.update_experience)(state.experience, state.step_state,
                                                      None, traj, nets)
        return float(agent.reward_scale(experience))

    agent = R2D2(SPEC, small_config(sequence_length=8, sequence_overlap=4))
    counted = np.asarray(reward)[:, 1:][~np.asarray(first)[:, 1:]]  # entry 0: the last cycle's
    rms = np.sqrt(np.mean(counted**2))
    np.testing.assert_allclose(received(agent, 1.0), 1.0 / rms, rtol=1e-5)
    np.testing.assert_allclose(received(agent, 1 / 46), 46.0 / rms, rtol=1e-5)
    off = R2D2(SPEC, small_config(sequence_length=8, sequence_overlap=4,
                                  normalize_rewards=False))
    assert received(off, 1 / 46) == 1.0

    # The same sequences with rewards c times larger give the same losses at 1/c the scale.
    cfg = small_config(value_rescaling=False)
    agent = R2D2(SPEC, cfg)
    nets = agent.new_networks(jax.random.key(0))
    seqs = random_sequences(jax.random.key(1), 4, cfg)
    big = seqs._replace(env_steps=seqs.env_steps._replace(reward=46.0 * seqs.env_steps.reward))
    nets = nets._replace(target=jax.tree.map(jnp.zeros_like, nets.target))  # bootstrap 0
    small_losses, _, _ = agent.sequence_losses(nets, seqs, 1.0)
    big_losses, _, _ = agent.sequence_losses(nets, big, 1 / 46)
    np.testing.assert_allclose(small_losses, big_losses, rtol=1e-4)
    assert not np.allclose(small_losses, agent.sequence_losses(nets, big, 1.0)[0])


def _perturbed(params, key: jax.Array, where) -> object:
    """`params` with noise added to the leaves whose path satisfies `where`."""
    def leaf(path, x):
        if not where(jax.tree_util.keystr(path)):
            return x
        return x + 0.5 * jax.random.normal(key, x.shape)
    return jax.tree_util.tree_map_with_path(leaf, params)


@pytest.mark.timeout(240)
def test_the_value_stream_has_its_own_torso_and_lstm():
    """V (the mean of Q over actions) reads only the value's torso, LSTM and head; the
    advantages (Q less its mean) only their own: the value's fit to the return-to-go does
    not reshape the memory the advantages need. Frames keep one Nature CNN and LSTM."""
    agent = R2D2(SPEC, small_config())
    params = agent.new_networks(jax.random.key(0)).online
    obs = jax.random.normal(jax.random.key(1), (3, 6, OBS_DIM))
    first = jnp.zeros((3, 6), bool).at[:, 0].set(True)

    def split_q(p):
        _, q = agent.network.apply(p, agent.network.initial_state(3), obs, first)
        value = jnp.mean(q, axis=-1)
        return np.asarray(value), np.asarray(q - value[..., None])

    value, advantage = split_q(params)

    def is_value(path):
        return "'value" in path  # the value torso, value_lstm, the head's value MLP

    value_moved, advantage_kept = split_q(_perturbed(params, jax.random.key(2), is_value))
    np.testing.assert_allclose(advantage_kept, advantage, atol=1e-6)
    assert np.abs(value_moved - value).max() > 1e-3
    value_kept, advantage_moved = split_q(
        _perturbed(params, jax.random.key(3), lambda path: not is_value(path)))
    np.testing.assert_allclose(value_kept, value, atol=1e-6)
    assert np.abs(advantage_moved - advantage).max() > 1e-3
    # Memory reaches both streams: an earlier observation changes each.
    later = obs.at[:, 0].add(1.0)
    _, q_later = agent.network.apply(params, agent.network.initial_state(3), later, first)
    q_now = agent.network.apply(params, agent.network.initial_state(3), obs, first)[1]
    assert np.abs(np.asarray(jnp.mean(q_later - q_now, -1))[:, -1]).max() > 1e-6

    def paths(spec, config):
        params = jax.eval_shape(R2D2(spec, config).new_networks, jax.random.key(0)).online
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]

    assert any("value_lstm" in p for p in paths(SPEC, small_config()))
    shared = paths(SPEC, small_config(shared_core=True))
    assert not any("value_lstm" in p for p in shared) and any("lstm" in p for p in shared)
    frames = sebulba.EnvSpec(gym.spaces.Box(0, 255, (84, 84, 4), np.uint8),
                             gym.spaces.Discrete(NUM_ACTIONS))
    frame_paths = paths(frames, small_config())
    assert not any("value_lstm" in p for p in frame_paths)
    assert any("lstm" in p for p in frame_paths)


@pytest.mark.parametrize("process", [0, 1])
def test_each_process_of_a_run_explores_at_its_rates_and_fills_its_replay(process):
    # Two processes of 2 groups x 4 envs: the loop asks for the run's 16 envs' step state
    # and keeps this process's 8 rows, whose slots must be this process's.
    E, groups, n = 4, 2, 8
    agent = R2D2(SPEC, small_config())
    nets = agent.new_networks(jax.random.key(0))
    every = agent.new_step_state(nets, jax.random.key(1), 2 * n)
    state = sharding.slice_env_axis(every, process * n, n)
    index = process * n + np.arange(n)
    np.testing.assert_allclose(state.epsilon, 0.4 ** (1 + 7 * index / 15), rtol=1e-6)
    layout = sebulba.Layout(envs_per_group=E, num_groups=groups,
                            steps_per_cycle=agent.config.sequence_period,
                            num_learner_devices=1, num_processes=2)
    experience = agent.new_experience_state(nets, jax.random.key(2), layout)
    trajectory = sebulba.zeros_trajectory(agent, nets, E, agent.config.sequence_period)
    update = jax.jit(agent.update_experience)
    for _ in range(3):
        for g in range(groups):
            initial = sharding.slice_env_axis(state, g * E, E)
            experience = update(experience, initial, initial, trajectory, nets)
    # sequences of 8 steps from cycles of 4: each env's 2nd and 3rd cycles end one
    assert int(experience.replay.size) == groups * E * 2
