"""EnvPool as an env source: one pool of async_factor groups per inference device, recv
returning whichever envs are ready, and each env's steps assembled into its own row."""

from __future__ import annotations

import importlib.util
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.ppo import PPO
from agents.spg import SPG, SPGConfig

# Found, not imported: importing envpool changes process-wide environment variables
# (sebulba.envs.envpool_source puts them back when it imports it).
if importlib.util.find_spec("envpool") is None:
    pytest.skip("vectorization 'envpool' needs the envpool extra", allow_module_level=True)

T, E, EPISODE_LIMIT = 6, 4, 20
KWARGS = {"max_episode_steps": EPISODE_LIMIT}


class Tagged(NamedTuple):
    count: jax.Array  # [E] actions taken by each env
    env: jax.Array  # [E] the env's index in its process


class Log(NamedTuple):
    env: jax.Array  # [C, rows, T] env index each step was recorded for
    count: jax.Array  # [C, rows, T] that env's action count at the step
    initial: jax.Array  # [C, rows] count in the initial StepState
    final: jax.Array  # [C, rows] count in the final StepState
    obs: jax.Array  # [C, rows, T + 1, 4]
    terminated: jax.Array  # [C, rows, T + 1]
    truncated: jax.Array  # [C, rows, T + 1]
    size: jax.Array


class TaggingAgent(sebulba.Agent):
    """Records in each step which env it acted for and that env's action count."""

    capacity = 64

    def new_networks(self, key):
        return {"w": jnp.ones(())}

    def new_step_state(self, nets, key, num_envs):
        return Tagged(jnp.zeros(num_envs, jnp.int32), jnp.arange(num_envs, dtype=jnp.int32))

    def new_opt_state(self, nets, key):
        return ()

    def new_experience_state(self, nets, key, layout):
        c, rows = self.capacity, layout.envs_per_learner_shard
        return Log(*(jnp.zeros((c, rows, T), jnp.int32) for _ in range(2)),
                   *(jnp.zeros((c, rows), jnp.int32) for _ in range(2)),
                   jnp.zeros((c, rows, T + 1, 4)), *(jnp.zeros((c, rows, T + 1), bool)
                                                     for _ in range(2)),
                   jnp.zeros((), jnp.int32))

    def step(self, step_state, nets, env_step):
        # Even envs push one way (the pole falls: terminated), odd ones alternate (they
        # last until the episode limit: truncated).
        alternate = (step_state.count + step_state.env) % 2
        action = jnp.where(step_state.env % 2 == 0, 1, alternate)
        extras = {"env": step_state.env, "count": step_state.count}
        return (sebulba.ActorOutput(action.astype(jnp.int32), extras),
                step_state._replace(count=step_state.count + 1))

    def update_experience(self, experience, initial, final, trajectory, nets):
        i = experience.size
        steps, extras = trajectory.env_steps, trajectory.actor_outputs.extras

        def put(buf, x):
            return buf.at[i].set(x, mode="drop")

        return Log(put(experience.env, extras["env"]), put(experience.count, extras["count"]),
                   put(experience.initial, initial.count), put(experience.final, final.count),
                   put(experience.obs, steps.obs), put(experience.terminated, steps.terminated),
                   put(experience.truncated, steps.truncated), i + 1)

    def loss(self, nets, opt, experience):
        return jnp.square(nets["w"]), (experience, {})

    def optimize_from_grads(self, nets, opt, grads):
        return nets, opt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vectorization,async_factor,learner_devices", [
    ("envpool", 2, [0]), ("envpool", 2, [1, 2]), ("envpool", 1, [1, 2]),
    ("envpool_async", 2, [0]), ("envpool_async", 2, [1, 2])])
def test_each_env_fills_its_own_row_in_order(vectorization, async_factor, learner_devices,
                                             no_leftovers):
    # async_factor 2: the thread pipelines one group's inference with the other's env
    # steps ("envpool_async": recv batches may mix the two groups' envs); 1: one group,
    # no pipelining.
    config = sebulba.Config(env="CartPole-v1", env_kwargs=KWARGS, vectorization=vectorization,
                            envs_per_group=E, steps_per_cycle=T, async_factor=async_factor,
                            inference_devices=[0, 3], learner_devices=learner_devices)
    agent = TaggingAgent(sebulba.env_spec("CartPole-v1", KWARGS, vectorization))
    result = sebulba.Sebulba(agent, config).run(4 * E * T * 12)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    log = jax.tree.map(np.asarray, result.learner_experience)
    rows = E // len(learner_devices)
    cycles_seen: dict[int, list] = {}
    for shard in range(len(learner_devices)):
        for k in range(int(log.size[shard])):
            env = log.env[shard, k]  # [rows, T]
            assert (env == env[:, :1]).all()  # a row is one env's steps
            env = env[:, 0]
            group = env[0] // E  # the rows are their group's envs, this shard's block
            np.testing.assert_array_equal(env, group * E + shard * rows + np.arange(rows))
            count = log.count[shard, k]  # ... in order, from the initial to the final state
            np.testing.assert_array_equal(count, log.initial[shard, k][:, None] + np.arange(T))
            np.testing.assert_array_equal(log.final[shard, k], log.initial[shard, k] + T)
            for j, e in enumerate(env.tolist()):
                cycles_seen.setdefault(e, []).append(
                    (int(log.initial[shard, k, j]), log.obs[shard, k, j]))
    assert sorted(cycles_seen) == list(range(2 * async_factor * E))  # 2 devices' envs
    for cycles in cycles_seen.values():
        cycles.sort(key=lambda c: c[0])
        assert [c[0] for c in cycles] == [T * i for i in range(len(cycles))]
        for (_, a), (_, b) in zip(cycles, cycles[1:], strict=False):
            np.testing.assert_array_equal(a[T], b[0])  # consecutive cycles overlap by a step
    # Truncation at the episode limit stays apart from the pole falling.
    assert log.terminated.any() and log.truncated.any()
    assert not (log.terminated & log.truncated).any()


@pytest.mark.timeout(60)
def test_bad_envpool_input_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'CartPol-v1' is not an EnvPool task id.*CartPole-v1"):
        sebulba.env_spec("CartPol-v1", vectorization="envpool")
    with pytest.raises(ValueError, match="desync_episodes"):
        sebulba.Config(env="CartPole-v1", vectorization="envpool", desync_episodes=True)
    # Lockstep needs envs stepped in order: a pool per group does, one pool by id not.
    sebulba.Config(env="CartPole-v1", vectorization="envpool", lockstep=True, async_factor=1)
    with pytest.raises(ValueError, match="'envpool_async' returns whichever envs are ready"):
        sebulba.Config(env="CartPole-v1", vectorization="envpool_async", lockstep=True,
                       async_factor=1)


@pytest.mark.timeout(60)
def test_envpool_groups_share_the_cores_unless_told_otherwise():
    """A pool per group: where the acting calls run on the CPU they get a thread per
    core together, as one pool of all the groups would by EnvPool's default; on an
    accelerator each may use every core (one steps at a time); `num_threads` in
    env_kwargs is the user's."""
    import os

    from sebulba.envs.envpool_source import EnvPoolGroups

    cores = len(os.sched_getaffinity(0))
    for kwargs, share, threads in [({}, True, max(1, min(4, cores // 2))),
                                   ({}, False, min(4, cores)),
                                   ({"num_threads": 3}, True, 3)]:
        source = EnvPoolGroups("CartPole-v1", num_groups=2, group_size=4, seed=0,
                               env_kwargs=kwargs, share_cores=share)
        try:
            assert [p.pool.config["num_threads"] for p in source.pools] == [threads] * 2
        finally:
            source.close()


@pytest.mark.timeout(60)
def test_seeds_past_int32_make_pools_whose_envs_differ(no_leftovers):
    """A run's seed is any int >= 0 (a resumed run's grows with its updates); EnvPool
    takes int32 seeds only. Past 2**31 the seed folds into its range, the envs of a pool
    and the groups keeping distinct seeds."""
    from sebulba.envs.envpool_source import EnvPoolGroups

    for seed in (3_000_000_000, 2**31 - 2):  # the second wraps inside the first pool
        source = EnvPoolGroups("CartPole-v1", num_groups=2, group_size=3, seed=seed)
        try:
            source.reset(seed=seed)
            first = np.concatenate([source.recv()[1].obs for _ in range(2)])
            assert len(np.unique(first, axis=0)) == 6, (seed, first)
        finally:
            source.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("task_id, shape", [("CartPole-v1", (2,)), ("CartPole-v1", (3, 1)),
                                            ("Pendulum-v1", (2, 1)), ("Pendulum-v1", (3,))])
def test_actions_of_the_wrong_shape_are_refused_by_name(task_id, shape, no_leftovers):
    """Below EnvPool's wrapper nothing checked the actions' shape: too few rows aborted
    the process in C++ (no traceback, no save), a missing axis passed."""
    from sebulba.envs.envpool_source import EnvPoolGroups

    source = EnvPoolGroups(task_id, num_groups=1, group_size=3, seed=0)
    try:
        assert source.pools[0]._raw is not None  # the direct path is the one checked
        source.reset(seed=0)
        ids, _, _ = source.recv()
        with pytest.raises(ValueError, match=re.escape(f"actions of shape {shape} for 3 envs")):
            source.send(np.zeros(shape, np.float32), ids)
    finally:
        source.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("vectorization", ["envpool", "envpool_async"])
def test_non_finite_actions_name_the_sources_env(vectorization, no_leftovers):
    """Not the batch's row: EnvPool's groups and an asynchronous pool's batches hold
    envs other than 0..E-1."""
    from sebulba.envs.envpool_source import EnvPoolGroups, EnvPoolSource

    make = EnvPoolGroups if vectorization == "envpool" else EnvPoolSource
    source = make("Pendulum-v1", num_groups=2, group_size=2, seed=0)
    try:
        source.reset(seed=0)
        batches = [source.recv()[0] for _ in range(2)]
        ids = next(b for b in batches if b[1] != 1)  # row 1 is not env 1
        action = np.zeros((2, 1), np.float32)
        action[1] = np.nan
        with pytest.raises(FloatingPointError,
                           match=re.escape(f"non-finite actions for envs [{ids[1]}]")):
            source.send(action, ids)
    finally:
        source.close()


@pytest.mark.timeout(60)
def test_a_pool_that_returns_its_envs_out_of_order_is_caught(no_leftovers):
    """The rows of a group are taken to be in env order, as EnvPool's synchronous pools
    return them; the output checks hold a pool to it."""
    from sebulba.envs.envpool_source import EnvPoolGroups

    source = EnvPoolGroups("CartPole-v1", num_groups=1, group_size=4, seed=0,
                           check_output=True)
    try:
        source.reset(seed=0)
        ids, _, _ = source.recv()  # as sent
        source.send(np.zeros(4, np.int32), ids)
        recv = source.pools[0].recv

        def swapped():
            order, *rows = recv()
            return (order[[1, 0, 2, 3]], *rows)

        source.pools[0].recv = swapped
        with pytest.raises(RuntimeError, match=re.escape(
                "EnvPool returned group 0's envs in the order [1, 0, 2, 3], not in the "
                "order sent")):
            source.recv()
    finally:
        source.close()


@pytest.mark.timeout(60)
def test_envpool_groups_take_turns_each_whole_and_in_order(no_leftovers):
    """Pong's steps take uneven times (a frame skip of 4, resets that run the noop
    starts), so a pool of several groups returns whichever envs finish first; a pool per
    group returns its envs in the order they were sent, the groups in turn."""
    from sebulba.envs.envpool_source import EnvPoolGroups

    source = EnvPoolGroups("Pong-v5", num_groups=3, group_size=4, seed=0,
                           env_kwargs={"max_episode_steps": 30})
    try:
        source.reset(seed=0)
        rng = np.random.default_rng(0)
        ended, sent = [], None
        for i in range(120):
            ids, env_step, steps = source.recv()
            np.testing.assert_array_equal(ids, (i % 3) * 4 + np.arange(4))
            assert steps == (0 if i < 3 else 4)  # the first recv of each group: resets
            assert env_step.obs.shape == (4, 4, 84, 84)
            ended += source.pop_episodes()
            # Pipelined, as the acting loop does it: the group before is sent its actions
            # after this one is received.
            if sent is not None:
                source.send(rng.integers(0, 6, 4), sent)
            sent = ids
        # Each env stepped 38 or 39 times: one episode of 30 steps (or a point scored
        # before) at least.
        assert len(ended) >= 12 and all(0 < length <= 30 for _, length in ended), ended
    finally:
        source.close()


@pytest.mark.timeout(300)
def test_spg_learns_cartpole_on_envpool(no_leftovers):
    """SPG's CartPole test (tests/test_spg_learning.py) with the envs in an EnvPool.

    Last-10% means at 400k: between 270 and 453 over three seeds; 17-23 s on 2 cores."""
    config = sebulba.Config(env="CartPole-v1", vectorization="envpool", envs_per_group=16,
                            steps_per_cycle=64, async_factor=2, seed=0)
    agent = SPG(sebulba.env_spec("CartPole-v1", vectorization="envpool"), SPGConfig())
    result = sebulba.Sebulba(agent, config).run(400_000)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.mean_return(0.9, 1.0) >= 150


@pytest.mark.timeout(300)
def test_ppo_learns_cartpole_on_envpool(no_leftovers):
    """PPO's default CartPole test (tests/test_ppo_learning.py) with the envs in an EnvPool.

    Last-10% means at 100k: between 188 and 288 over three seeds, as with sync envs;
    8-9 s on 2 cores."""
    config = sebulba.Config(env="CartPole-v1", vectorization="envpool", envs_per_group=16,
                            steps_per_cycle=32, async_factor=2, seed=0)
    agent = PPO(sebulba.env_spec("CartPole-v1", vectorization="envpool"))
    result = sebulba.Sebulba(agent, config).run(100_000)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.mean_return(0.9, 1.0) >= 150, result.summary()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task_id", ["CartPole-v1", "Pong-v5"])
def test_direct_calls_give_what_envpools_wrapper_gives(task_id):
    """The source calls EnvPool's C++ recv/send below its Python wrapper where the layout
    is simple; both paths must give the same steps for the same seeds and actions."""
    from sebulba.envs.envpool_source import EnvPoolGroups

    # One group: recv returns every env, so the order of batches cannot depend on
    # thread timing and both runs see the same steps.
    direct = EnvPoolGroups(task_id, num_groups=1, group_size=3, seed=3,
                           env_kwargs={"max_episode_steps": 12})
    wrapped = EnvPoolGroups(task_id, num_groups=1, group_size=3, seed=3,
                            env_kwargs={"max_episode_steps": 12})
    assert direct.pools[0]._raw is not None
    wrapped.pools[0]._raw = None
    try:
        seen = {}
        for source in (direct, wrapped):
            source.reset(seed=3)
            steps, ended_all = [], []
            for i in range(60):
                ids, env_step, _ = source.recv()
                order = np.argsort(ids)
                steps.append((ids[order], jax.tree.map(lambda x, o=order: x[o], env_step)))
                ended_all += source.pop_episodes()
                actions = np.random.default_rng(i).integers(
                    0, source.pools[0].action_space.n, len(ids))
                source.send(actions[order.argsort()], ids)
            seen[source is direct] = (steps, ended_all)
        (a, ended_a), (b, ended_b) = seen[True], seen[False]
        assert ended_a == ended_b and ended_a  # episodes ended within 60 batches
        assert any(s.truncated.any() for _, s in a)
        for (ids_a, step_a), (ids_b, step_b) in zip(a, b, strict=True):
            np.testing.assert_array_equal(ids_a, ids_b)
            for x, y in zip(step_a, step_b, strict=True):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)
    finally:
        direct.close()
        wrapped.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ppo_balances_envpools_mujoco_inverted_pendulum(no_leftovers):
    # EnvPool's MuJoCo ids: float64 observations and actions (converted at the source),
    # a Gaussian policy. The last-10% mean at 150k steps is 1000, the maximum.
    env = "InvertedPendulum-v5"
    config = sebulba.Config(env=env, vectorization="envpool", seed=0)
    agent = PPO(sebulba.env_spec(env, vectorization="envpool"))
    result = sebulba.Sebulba(agent, config).run(150_000)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.mean_return(0.9, 1.0) >= 800, result.summary()


class ByEnv(NamedTuple):
    count: jax.Array  # [E] actions taken by each env
    env: jax.Array  # [E] the env's index


class ByEnvPolicy(sebulba.Agent):
    """A fixed policy that tells the envs apart: even envs push one way (the pole falls,
    terminated within 20 steps), odd ones push the way the pole leans (it stays up until
    the episode limit of 20: truncated). An odd env acting on another env's observation
    lets its pole fall."""

    def new_networks(self, key):
        return {}

    def new_step_state(self, nets, key, num_envs):
        return ByEnv(jnp.zeros(num_envs, jnp.int32), jnp.arange(num_envs, dtype=jnp.int32))

    def new_opt_state(self, nets, key):
        return ()

    def new_experience_state(self, nets, key, layout):
        return ()

    def step(self, step_state, nets, env_step):
        angle, angular_velocity = env_step.obs[:, 2], env_step.obs[:, 3]
        balance = (angle + 0.5 * angular_velocity > 0).astype(jnp.int32)
        action = jnp.where(step_state.env % 2 == 0, 1, balance)
        return (sebulba.ActorOutput(action.astype(jnp.int32)),
                step_state._replace(count=step_state.count + 1))

    greedy_step = step

    def update_experience(self, experience, initial, final, trajectory, nets):
        return experience

    def loss(self, nets, opt, experience):
        return jnp.zeros(()), (experience, {})

    def optimize_from_grads(self, nets, opt, grads):
        return nets, opt


@pytest.mark.timeout(120)
def test_a_policy_trained_on_envpool_is_evaluated_on_envpool(no_leftovers):
    from sebulba.envs import registry
    from sebulba.evaluation import evaluate, evaluation_vectorization

    assert evaluation_vectorization("envpool") == "envpool"  # its spaces, its env ids
    assert evaluation_vectorization("envpool_async") == "envpool"
    num_envs, per_env = 6, 3
    results = {}
    for vectorization in ("envpool", "sync"):
        agent = ByEnvPolicy(sebulba.env_spec("CartPole-v1", KWARGS, vectorization))
        kind = registry.get(vectorization)
        seen = []  # the order of each recv's ids
        make_sources = kind.make_sources

        def recording(request, make_sources=make_sources, seen=seen):
            sources = make_sources(request)
            recv = sources[0].recv

            def recv_and_record():
                ids, env_step, steps = recv()
                seen.append(tuple(ids.tolist()))
                return ids, env_step, steps

            sources[0].recv = recv_and_record
            return sources

        object.__setattr__(kind, "make_sources", recording)
        try:
            result = evaluate(agent, {}, "CartPole-v1", num_envs * per_env, num_envs=num_envs,
                              seed=3, env_kwargs=KWARGS, vectorization=vectorization)
        finally:
            object.__setattr__(kind, "make_sources", make_sources)
        assert seen and all(ids == tuple(range(num_envs)) for ids in seen)  # all, in order
        # Env by env, `per_env` complete episodes each; CartPole pays 1 a step.
        assert len(result.returns) == num_envs * per_env
        assert result.returns == [float(n) for n in result.lengths]
        lengths = np.reshape(result.lengths, (num_envs, per_env))
        assert (lengths[1::2] == EPISODE_LIMIT).all(), lengths  # odd envs: balanced
        assert (lengths[0::2] < EPISODE_LIMIT).all() and (lengths[0::2] >= 5).all(), lengths
        results[vectorization] = lengths
    # The same policy on the same task: the even envs fall as fast on either.
    assert abs(results["envpool"][0::2].mean() - results["sync"][0::2].mean()) <= 2.0, results


@pytest.mark.timeout(300)
def test_sac_learns_from_envpools_mujoco_transitions(no_leftovers):
    """SAC on EnvPool's InvertedPendulum-v5 (float64 observations and actions, converted
    at the source; the pole's fall terminates, EnvPool's done split into terminated and
    truncated): every env's transitions reach the replay, in the policy's (-1, 1) action
    units, a fall bootstraps nothing and other steps do, and the learner takes its
    gradient steps once the warm-up of random actions is over."""
    from agents.sac import SAC, SACConfig

    env = "InvertedPendulum-v5"
    E, T = 8, 8
    cfg = SACConfig(hidden_sizes=(16,), batch_size=32, replay_capacity=10_000,
                    learning_starts=256, replay_ratio=1 / (E * T))
    agent = SAC(sebulba.env_spec(env, vectorization="envpool"), cfg)
    config = sebulba.Config(env=env, vectorization="envpool", envs_per_group=E,
                            steps_per_cycle=T, async_factor=2, seed=0)
    result = sebulba.Sebulba(agent, config).run(E * T * 40)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    replay = result.state.experience.replay
    size = int(replay.size)
    # Each trajectory of E x T steps gives E x T transitions but those across an
    # episode's end (the action the env ignored on its last observation).
    ended = sum(1 for step, _, _ in result.episodes if step <= result.consumed)
    # (episodes are stamped with the env steps taken when they were counted: a few
    # rows' slack).
    assert abs(size - (result.consumed - ended)) <= E * 2, (size, ended, result.summary())
    items = jax.tree.map(lambda x: np.asarray(x[:size]), replay.items)
    assert items.obs.dtype == np.float32 and items.obs.shape[1:] == (4,)
    assert np.all(np.abs(items.action) <= 1.0)  # unit actions, not the env's [-3, 3]
    assert np.unique(items.action).size > size // 2  # random, then sampled: not constant
    terminal = items.discount == 0.0
    assert terminal.any() and (~terminal).any()  # falls (terminated) and the rest
    assert np.allclose(items.discount[~terminal], cfg.discount)
    # Learning began after the warm-up: one gradient step per update since then.
    warm_updates = -(-cfg.learning_starts // (E * T))
    steps = int(result.state.nets.gradient_steps)
    assert steps == result.learner_updates - warm_updates + 1 > 0, steps
    assert np.isfinite(result.metrics["critic_loss"]) and result.metrics["learning"] == 1.0
