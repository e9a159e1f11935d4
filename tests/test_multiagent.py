"""Multi-agent envs: PettingZoo Parallel envs as rows of agents (`envs.pettingzoo_source`)."""

import dataclasses

import gymnasium as gym
import jax
import numpy as np
import pytest

pytest.importorskip("pettingzoo", reason="multi-agent envs need the 'multiagent' extra")

from pettingzoo import ParallelEnv  # noqa: E402

import sebulba  # noqa: E402
from agents.common.returns import action_mask  # noqa: E402
from agents.impala import IMPALA, IMPALAConfig  # noqa: E402
from agents.ppo import PPO, PPOConfig  # noqa: E402
from sebulba.envs.pettingzoo_source import ParallelEnvSource, make_parallel_env  # noqa: E402
from sebulba.envs.suite.role_call import RoleCall  # noqa: E402

ROLE_CALL = "sebulba.envs.suite.role_call"


def role_call_source(num_envs=2, agent_ids=False, **kwargs) -> ParallelEnvSource:
    return ParallelEnvSource([RoleCall(**kwargs) for _ in range(num_envs)], agent_ids)


def right_answers(symbols: np.ndarray, num_agents: int) -> np.ndarray:
    """[N x K] each row's right answer given its env's symbol (rows env-major)."""
    return (np.repeat(symbols, num_agents) + np.tile(np.arange(num_agents), len(symbols))
            ) % num_agents


@pytest.mark.timeout(60)
def test_rows_are_env_major_agents_and_episodes_follow_next_step_autoreset():
    k, n, length = 3, 2, 4
    source = role_call_source(n, num_agents=k, episode_length=length)
    assert (source.num_envs, source.agents_per_env) == (n * k, k)
    source.reset(seed=0)
    ids, step, steps = source.recv()
    np.testing.assert_array_equal(ids, np.arange(n * k))
    assert step.first.all() and steps == 0 and source.pop_episodes() == []
    for t in range(1, length + 2):
        # every agent of an env sees its env's symbol
        symbols = step.obs.reshape(n, k, k).argmax(-1)
        assert (symbols == symbols[:, :1]).all()
        # env 0 answers right, env 1 wrong: rewards differ by env, not by agent
        answers = right_answers(symbols[:, 0], k)
        answers[k:] = (answers[k:] + 1) % k
        source.send(answers, ids)
        ids, step, steps = source.recv()
        ended = source.pop_episodes()
        assert steps == n * k
        if t <= length:
            np.testing.assert_allclose(step.reward, [1 / length] * k + [0.0] * k)
            assert not step.first.any() and not step.terminated.any()
            assert step.truncated.all() == (t == length)
        else:  # the step after the last: every env was reset
            assert step.first.all() and (step.reward == 0).all()
        if t == length:
            assert sorted(ended) == [(0.0, length)] * k + [(1.0, length)] * k
            assert sorted(source.pop_team_episodes()) == [(0.0, length), (float(k), length)]
    assert source.padding_steps == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("local_ratio", [0.0, 0.5, 1.0])
def test_role_call_mixes_each_agents_own_success_with_the_teams(local_ratio):
    k, length = 3, 4
    env = RoleCall(num_agents=k, episode_length=length, local_ratio=local_ratio)
    obs, _ = env.reset(seed=0)
    symbol = int(obs["agent_0"].argmax())
    # agent 0 answers right, the other two wrong: the team is right 1/3 of the time
    actions = {a: (symbol + i + (i > 0)) % k for i, a in enumerate(env.possible_agents)}
    _, rewards, _, _, _ = env.step(actions)
    team = (1 - local_ratio) / k
    np.testing.assert_allclose(
        [rewards[a] for a in env.possible_agents],
        [(local_ratio + team) / length, team / length, team / length], rtol=1e-6)


@pytest.mark.timeout(60)
def test_an_agent_that_leaves_early_is_padding_masked_from_learning():
    k, length, leave = 3, 6, 2
    source = role_call_source(1, num_agents=k, episode_length=length, leave_after=leave)
    source.reset(seed=0)
    rows = []
    for _ in range(2 * (length + 1)):
        ids, step, _ = source.recv()
        rows.append(step)
        source.send(np.zeros(k, np.int64), ids)
    last = k - 1
    steps = jax.tree.map(lambda *x: np.stack(x, 1), *rows)  # [rows, T]
    terminated, first = steps.terminated[last], steps.first[last]
    # the agent terminates after `leave` steps, then is padding until its env resets
    assert terminated[leave] and not first[leave]
    padding = np.arange(leave + 1, length + 1)
    assert terminated[padding].all() and first[padding].all()
    assert (steps.obs[last, padding] == 0).all() and (steps.reward[last, padding] == 0).all()
    assert first[length + 1] and not terminated[length + 1]  # the next episode
    # no loss sees an action taken at a padding row, nor at the agent's last real step
    mask = np.asarray(action_mask(steps.terminated[last], steps.truncated[last]))
    assert (mask[leave:length + 1] == 0).all() and (mask[:leave] == 1).all()
    # the others play on, unmasked
    assert not steps.terminated[0, :length + 1].any()
    assert source.padding_steps == 2 * (length - leave)  # two episodes


@pytest.mark.timeout(60)
def test_agent_ids_append_a_one_hot_per_agent():
    k = 3
    spec = sebulba.Config(env=ROLE_CALL, vectorization="pettingzoo", agent_ids=True).env_spec()
    assert spec.agents_per_env == k and spec.obs_shape == (2 * k,)
    source = role_call_source(2, agent_ids=True, num_agents=k)
    source.reset(seed=0)
    _, step, _ = source.recv()
    assert step.obs.shape == (2 * k, 2 * k)
    np.testing.assert_array_equal(step.obs[:, k:], np.tile(np.eye(k), (2, 1)))


class _TwoSpaces(ParallelEnv):
    """Agents with different observation spaces, which one shared policy cannot serve."""

    possible_agents = ["scout", "tank"]

    def observation_space(self, agent):
        return gym.spaces.Box(-1, 1, (3 if agent == "scout" else 5,), np.float32)

    def action_space(self, agent):
        return gym.spaces.Discrete(2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env,kwargs,error,match", [
    (_TwoSpaces, {}, ValueError, r"agent 'tank' has observation space .*\(5,\).* but 'scout'"),
    (lambda: gym.make("CartPole-v1"), {}, TypeError, r"made a \w+, not a PettingZoo ParallelEnv"),
    ("json", {}, ValueError, r"module 'json' has no parallel_env\(\) function"),
    ("no_such_module_here", {}, ValueError, r"importing 'no_such_module_here' failed"),
    (ROLE_CALL, {"num_agents": 1}, ValueError, r"num_agents >= 2, got 1"),
])
def test_bad_multiagent_envs_are_refused_before_anything_starts(env, kwargs, error, match):
    with pytest.raises(error, match=match):
        sebulba.env_spec(env, kwargs, "pettingzoo")


@pytest.mark.timeout(60)
def test_an_aec_env_is_refused_with_the_conversion_to_use_and_closed():
    from pettingzoo.utils import parallel_to_aec

    made = []

    def aec():
        env = parallel_to_aec(RoleCall())
        closed = env.close
        env.close = lambda: (made.append("closed"), closed())
        made.append("made")
        return env

    with pytest.raises(TypeError, match="aec_to_parallel"):
        make_parallel_env(aec)
    assert made == ["made", "closed"]  # a refused env may hold a process: closed


@pytest.mark.timeout(60)
def test_agent_ids_need_a_multiagent_env():
    with pytest.raises(ValueError, match="agent_ids is for multi-agent envs"):
        sebulba.Config(env="CartPole-v1", agent_ids=True)


@pytest.mark.timeout(60)
def test_seed_001_layout_that_leaves_slots_empty_is_an_error_naming_agents_and_slots():
    spec = sebulba.env_spec(ROLE_CALL, {}, "pettingzoo")
    agent = PPO(spec, PPOConfig(num_segments=8192, num_minibatches=1))
    layout = sebulba.Layout(envs_per_group=1360 * 3, num_groups=2, steps_per_cycle=64,
                            num_learner_devices=1, trajectories_per_update=2,
                            agents_per_env=3)
    with pytest.raises(ValueError, match=r"2,720 envs x 3 agents = 8,160 agents .* 32 slots "
                                         r"would stay empty"):
        agent.new_experience_state(None, jax.random.key(0), layout)
    # the exact size (slots = agents x segments per agent) is accepted
    exact = PPO(spec, PPOConfig(num_segments=8160, num_minibatches=1))
    exact._segment_layout(layout.envs_per_update_shard, 64, 1, 3)


def run_role_call(agent_cls, agent_config, steps, **config):
    config = sebulba.Config(env=ROLE_CALL, vectorization="pettingzoo", **config)
    agent = agent_cls(config.env_spec(), agent_config)
    return sebulba.Sebulba(agent, config).run(steps)


@pytest.mark.timeout(120)
def test_every_agent_step_is_accounted_for_padding_and_team_episodes_reported(no_leftovers):
    result = run_role_call(PPO, PPOConfig(), 6000, env_kwargs={"leave_after": 8},
                           envs_per_group=8, steps_per_cycle=16)
    k = 3
    assert result.agents_per_env == k
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.team_steps == result.env_steps // k
    # one agent of three leaves after 8 of 16 steps: about 8 padding steps per episode
    episodes = len(result.team_episodes)
    assert 7 * episodes <= result.padding_steps <= 8 * (episodes + 2 * 8)
    # agents' episodes: two of 16 steps and one of 8 per env episode
    lengths = sorted({length for _, _, length in result.episodes})
    assert lengths == [8, 16]
    assert all(length == 16 for _, _, length in result.team_episodes)
    # Env episodes are stamped with the episodes of the agents that end with them
    # (counted at the same cycle ends), so a window of the run holds both or neither: an
    # env episode counted a cycle before its agents' once left the last 10%'s team mean
    # empty.
    assert {steps for steps, _, _ in result.team_episodes} <= \
        {steps for steps, _, _ in result.episodes}
    summary = result.as_dict()
    assert summary["team_steps"] == result.team_steps and summary["padding_steps"] > 0


def role_call_return(agent_cls, config, steps, agent_ids, seed=0) -> float:
    result = run_role_call(agent_cls, config, steps, agent_ids=agent_ids, seed=seed)
    return result.mean_return(0.9, 1.0)


# RoleCall's reward is half the team's (local_ratio 0.5), so an agent's advantage also
# carries the other agents' answers. With PPO's defaults a shared policy then sometimes
# settles one (symbol, agent) pair on a wrong answer and never samples the right one
# again, ending near 0.8-0.9 at 500k agent steps. A larger step size learns the roles
# before any pair settles: >= 0.99 by 300k with entropy 0.05 and learning rate 1e-3
# (benchmarks/RESULTS.md, "Multi-agent").
ROLE_PPO = PPOConfig(entropy_cost=0.05, learning_rate=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_shared_policy_ppo_learns_distinct_roles_only_when_it_sees_agent_ids(no_leftovers):
    """One policy for three cooperating agents that must answer differently (RoleCall:
    optimum 1.0, chance 1/3). With agent ids >= 0.9 within 300k agent steps; without, the
    shared policy cannot tell the agents apart, and whatever it answers for a symbol the
    three agents are right 1/3 of the time together (about 0.337 at 300k)."""
    with_ids = role_call_return(PPO, ROLE_PPO, 300_000, agent_ids=True)
    without = role_call_return(PPO, ROLE_PPO, 150_000, agent_ids=False)
    assert with_ids >= 0.9, with_ids
    assert without <= 0.45, without


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [1, 2])
def test_shared_policy_lstm_ppo_and_impala_learn_role_call(seed):
    """With agent ids, >= 0.9 of the optimum: PPO and IMPALA, feed-forward and LSTM.
    IMPALA's LSTM with a shared core and raw rewards stays at chance here (0.335), as on
    the memory suite's RepeatFirst; its defaults (a value core of its own, scaled rewards,
    4 x 4 steps per shard) reach about 0.98 at 1M, a task they were not tuned on. Figures:
    benchmarks/RESULTS.md, "Multi-agent"."""
    for use_lstm in (False, True):
        cfg = dataclasses.replace(ROLE_PPO, use_lstm=use_lstm)
        ret = role_call_return(PPO, cfg, 600_000, agent_ids=True, seed=seed)
        assert ret >= 0.9, ("ppo", use_lstm, ret)
        ret = role_call_return(IMPALA, IMPALAConfig(use_lstm=use_lstm), 1_000_000,
                               agent_ids=True, seed=seed)
        assert ret >= 0.9, ("impala", use_lstm, ret)


SIMPLE_SPREAD = "mpe2.simple_spread_v3"


@pytest.mark.timeout(120)
def test_simple_spread_runs_three_agents_per_env_through_the_loop(no_leftovers):
    pytest.importorskip("mpe2", reason="simple_spread needs the 'multiagent' extra (mpe2)")
    config = sebulba.Config(env=SIMPLE_SPREAD, vectorization="pettingzoo", envs_per_group=4,
                            steps_per_cycle=25, env_kwargs={"max_cycles": 25})
    spec = config.env_spec()
    assert spec.agents_per_env == 3 and spec.obs_shape == (18,) and spec.action_space.n == 5
    result = sebulba.Sebulba(PPO(spec), config).run(3 * 25 * 4 * 8)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert {length for _, _, length in result.team_episodes} == {25}
    assert {length for _, _, length in result.episodes} == {25}
    # simple_spread's rewards are negative distances: every episode's return is below 0
    assert result.team_episodes and all(ret < 0 for _, ret, _ in result.team_episodes)
    assert result.padding_steps == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls,config_cls", [(PPO, PPOConfig), (IMPALA, IMPALAConfig)])
@pytest.mark.parametrize("use_lstm", [False, True])
def test_a_central_value_sees_the_env_s_other_agents_and_the_policy_does_not(
        agent_cls, config_cls, use_lstm):
    spec = sebulba.env_spec(ROLE_CALL, {}, "pettingzoo", agent_ids=True)
    agent = agent_cls(spec, config_cls(central_value=True, use_lstm=use_lstm))
    nets = agent.new_networks(jax.random.key(0))
    k, n = 3, 2
    obs = np.random.default_rng(0).normal(size=(n * k, 1) + spec.obs_shape).astype(np.float32)
    changed = obs.copy()
    changed[1] += 1.0  # env 0's agent 1 sees something else

    def outputs(o):
        state = agent.network.initial_state(n * k)
        _, out = agent.network.apply(nets, state, o, np.zeros((n * k, 1), bool))
        return np.asarray(out.policy.logits[:, 0]), np.asarray(out.value[:, 0])

    (logits, value), (logits2, value2) = outputs(obs), outputs(changed)
    # the policy of agent 0 is its own; its value now depends on agent 1's observation
    np.testing.assert_array_equal(logits[0], logits2[0])
    assert not np.allclose(logits[1], logits2[1])
    assert not np.allclose(value[[0, 2]], value2[[0, 2]])
    # env 1's agents are another env: nothing of theirs changed
    np.testing.assert_array_equal(value[k:], value2[k:])


@pytest.mark.timeout(60)
def test_a_central_value_needs_a_multiagent_env():
    with pytest.raises(ValueError, match="central_value needs a multi-agent env"):
        PPO(sebulba.env_spec("CartPole-v1"), PPOConfig(central_value=True))


@pytest.mark.timeout(60)
def test_minibatches_keep_each_env_s_agents_together():
    from sebulba.experience import segments

    rows, chunks, k = 6, 4, 3  # 2 envs of 3 agents, 4 segments per row
    seg = np.arange(rows * chunks)  # to_segments order: row * chunks + chunk
    grouped = np.asarray(segments.group_by_env(jax.numpy.asarray(seg), k, rows))
    row, chunk = grouped // chunks, grouped % chunks
    groups = row.reshape(-1, k), chunk.reshape(-1, k)
    # each run of K segments: one env's K agents at one chunk
    assert (groups[0] // k == groups[0][:, :1] // k).all() and (groups[1] == groups[1][:, :1]).all()
    np.testing.assert_array_equal(groups[0] % k, np.tile(np.arange(k), (rows * chunks // k, 1)))
    adv = jax.numpy.ones((rows * chunks, 5))
    for alpha in (0.0, 0.6):
        plan = segments.plan_minibatches(jax.random.key(0), adv, 2, 2, alpha, 0.4, group_size=k)
        idx = np.asarray(plan.indices)
        assert idx.shape == (4, rows * chunks // 2) if alpha == 0 else idx.shape[0] == 4
        np.testing.assert_array_equal(idx.reshape(4, -1, k) % k, np.broadcast_to(
            np.arange(k), idx.reshape(4, -1, k).shape))
        assert (idx.reshape(4, -1, k)[..., 0] % k == 0).all()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_ppo_learns_simple_spread_and_a_central_value_is_no_worse():
    """simple_spread_v3 (3 agents, 25 steps), 2M env steps (6M agent steps) each, seed 0.
    Mean team return over the last 10%: a uniformly random policy scores -80.9 (300
    episodes, standard error 1.4); independent values reach about -50 (from -67 in the
    first tenth), and so does a centralized value (from -69); 13 to 14 min per run at 7k
    to 8k agent steps/s on 2 cores (the MPE envs step in Python)."""
    pytest.importorskip("mpe2", reason="simple_spread needs the 'multiagent' extra (mpe2)")
    returns = {}
    for central in (False, True):
        config = sebulba.Config(env=SIMPLE_SPREAD, vectorization="pettingzoo", seed=0)
        agent = PPO(config.env_spec(), PPOConfig(central_value=central))
        result = sebulba.Sebulba(agent, config).run(6_000_000)
        returns[central] = result.mean_team_return(0.9, 1.0)
    random_policy = -80.9
    assert returns[False] >= random_policy + 20, returns
    assert returns[True] >= returns[False] - 5, returns


class ComingsAndGoings(ParallelEnv):
    """Agent "b" is absent at the reset, joins after step 1, leaves (terminated) at step 2,
    re-joins after step 3; everyone is truncated at step 4. Reward 1 per acting agent."""

    possible_agents = ["a", "b"]
    metadata = {"name": "comings_and_goings"}
    render_mode = None

    def observation_space(self, agent):
        return gym.spaces.Box(0.0, 10.0, (1,), np.float32)

    def action_space(self, agent):
        return gym.spaces.Discrete(2)

    def _obs(self):
        return {a: np.array([self.t + 1], np.float32) for a in self.agents}

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, ["a"]
        return self._obs(), {}

    def step(self, actions):
        acting = list(self.agents)
        assert set(actions) == set(acting)
        self.t += 1
        rewards = {a: 1.0 for a in acting}
        term = {a: (a == "b" and self.t == 2) for a in acting}
        trunc = {a: self.t == 4 for a in acting}
        obs = {a: np.array([self.t + 1], np.float32) for a in acting}
        self.agents = [a for a in acting if not (term[a] or trunc[a])]
        if self.t in (1, 3):
            self.agents.append("b")
            obs["b"] = np.array([self.t + 1], np.float32)
        return obs, rewards, term, trunc, {a: {} for a in acting}


@pytest.mark.timeout(60)
def test_agents_absent_at_the_reset_or_rejoining_are_padding_until_they_start():
    source = ParallelEnvSource([ComingsAndGoings()])
    source.reset(seed=0)
    rows = []
    for _ in range(6):
        ids, step, _ = source.recv()
        rows.append((step, source.pop_episodes()))
        source.send(np.zeros(2, np.int64), ids)
    b = [(bool(s.first[1]), bool(s.terminated[1]), bool(s.truncated[1]), float(s.reward[1]))
         for s, _ in rows]
    assert b == [
        (True, True, False, 0.0),    # absent at the reset: padding, masked
        (True, False, False, 0.0),   # joins: a first step
        (False, True, False, 1.0),   # leaves, terminated, after one action
        (True, False, False, 0.0),   # re-joins
        (False, False, True, 1.0),   # truncated with everyone
        (True, True, False, 0.0),    # the next episode: absent again
    ]
    assert rows[0][0].obs[1, 0] == 0.0 and rows[1][0].obs[1, 0] == 2.0
    assert sorted(e for _, ended in rows for e in ended) == [(1.0, 1), (1.0, 1), (4.0, 4)]
    # the team return keeps b's reward from before it left: a's 4 + b's 2
    assert source.pop_team_episodes() == [(6.0, 4)]
    assert source.padding_steps == 1  # the second reset's (the first precedes acting)


@pytest.mark.timeout(60)
def test_impala_minibatches_of_a_central_value_hold_whole_envs():
    spec = sebulba.env_spec(ROLE_CALL, {}, "pettingzoo", agent_ids=True)
    agent = IMPALA(spec, IMPALAConfig(central_value=True, num_minibatches=2, num_epochs=2))
    nets = agent.new_networks(jax.random.key(0))
    k = spec.agents_per_env
    layout = sebulba.Layout(envs_per_group=4 * k, num_groups=1, steps_per_cycle=3,
                            num_learner_devices=1, agents_per_env=k)
    rows = np.asarray(agent.new_experience_state(nets, jax.random.key(1), layout).rows)
    assert rows.shape == (4, 2 * k)
    for step_rows in rows:  # 2 whole envs per step, each env's agents adjacent, in order
        envs = step_rows.reshape(2, k)
        assert (envs == envs[:, :1] + np.arange(k)).all() and (envs[:, 0] % k == 0).all()
    odd = sebulba.Layout(envs_per_group=3 * k, num_groups=1, steps_per_cycle=3,
                         num_learner_devices=1, agents_per_env=k)
    with pytest.raises(ValueError, match=f"num_minibatches=2 must divide the 3 envs \\(of {k} "
                                         "agent rows each"):
        agent.new_experience_state(nets, jax.random.key(1), odd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agent_cls,config_cls", [(PPO, PPOConfig), (IMPALA, IMPALAConfig)])
def test_a_central_value_trains_on_learner_shards_of_whole_envs(agent_cls, config_cls,
                                                                 no_leftovers):
    # 4 envs x 3 agents per group over 2 learner devices: 6 rows, 2 whole envs, per shard,
    # and 2 minibatches of one env each: the learner's shapes fit a central value end to
    # end (that PPO's minibatches hold whole envs in order is
    # test_minibatches_keep_each_env_s_agents_together's).
    config = sebulba.Config(env=ROLE_CALL, vectorization="pettingzoo", agent_ids=True,
                            envs_per_group=4, steps_per_cycle=8, learner_devices=[0, 1])
    agent = agent_cls(config.env_spec(), config_cls(central_value=True, num_minibatches=2))
    result = sebulba.Sebulba(agent, config).run(3 * 4 * 8 * 2 * 6)
    assert result.learner_updates >= 6
    assert all(np.isfinite(v) for v in result.metrics.values())
    assert result.env_steps == result.consumed + result.dropped + result.in_flight


class Scripted(ParallelEnv):
    """Agents "a" and "b", whose outputs break (or bend) PettingZoo's Parallel API as
    `fault` says: "flagged_stays" (both are terminated at step 2 but stay in `agents`),
    "no_obs_at_reset", "no_obs_as_b_joins", "no_obs_after_a_step" (b's observation left
    out while it stays), "stale_none" (b ends at step 1, then None entries for it), and
    "reward_as_b_joins" (b, absent at the reset, joins at step 1 with a reward of 1)."""

    possible_agents = ["a", "b"]
    metadata = {"name": "scripted"}
    render_mode = None

    def __init__(self, fault: str):
        self.fault, self.agents, self.t = fault, [], 0

    def observation_space(self, agent):
        return gym.spaces.Box(-10.0, 10.0, (1,), np.float32)

    def action_space(self, agent):
        return gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        self.t = 0
        joins = self.fault in ("no_obs_as_b_joins", "reward_as_b_joins")
        self.agents = ["a"] if joins else ["a", "b"]
        obs = {a: np.zeros(1, np.float32) for a in self.agents}
        if self.fault == "no_obs_at_reset":
            del obs["b"]
        return obs, {}

    def step(self, actions):
        self.t += 1
        acting = list(self.agents)
        if self.fault in ("no_obs_as_b_joins", "reward_as_b_joins") and self.t == 1:
            self.agents = ["a", "b"]
        obs = {a: np.full(1, self.t, np.float32) for a in set(acting) | set(self.agents)}
        rewards = {a: 1.0 for a in obs}
        term = {a: self.fault == "flagged_stays" and self.t == 2 for a in obs}
        trunc = {a: self.t == 4 for a in obs}
        if self.fault == "no_obs_as_b_joins" and self.t == 1:
            del obs["b"]
        if self.fault == "no_obs_after_a_step":
            del obs["b"]
        if self.fault == "stale_none" and self.t >= 1:
            if self.t == 1:
                term["b"], self.agents = True, ["a"]
            else:
                obs["b"], rewards["b"], term["b"], trunc["b"] = None, None, None, None
        if self.fault != "flagged_stays":
            self.agents = [a for a in self.agents if not (term.get(a) or trunc.get(a))]
        return obs, rewards, term, trunc, {}


def _steps(source, n: int) -> None:
    source.reset(seed=0)
    for _ in range(n):
        ids, _, _ = source.recv()
        source.send(np.zeros(len(ids), np.int64), ids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check_output", [False, True])
@pytest.mark.parametrize("fault,match", [
    ("flagged_stays", r"agent 'a' of env 0 .*, step 2: agents still hold 'a', whose "
                      r"episode the step ended"),
    ("no_obs_at_reset", r"agent 'b' .*step 0: observation is missing at the reset"),
    ("no_obs_as_b_joins", r"agent 'b' .*step 1: observation is missing as it joins"),
    ("no_obs_after_a_step", r"agent 'b' .*step 1: observation is missing after the step"),
])
def test_outputs_the_parallel_api_rules_out_are_errors_naming_agent_and_step(
        fault, match, check_output):
    """Left alone, each went wrong quietly or as a bare KeyError: an agent flagged ended
    but kept in `agents` re-joined at once and its env never reset; a missing observation
    was a KeyError, or zeros for an agent that goes on acting. With the checks off too."""
    source = ParallelEnvSource([Scripted(fault)], check_output=check_output, env="scripted")
    with pytest.raises(sebulba.envs.BadEnvOutput, match=match):
        _steps(source, 4)


@pytest.mark.timeout(60)
def test_the_checks_read_only_the_fields_of_agents_in_the_episode():
    """Entries an env keeps for an agent that left (None here) are never read, so the
    output checks pass them over; the agent is padding until the reset."""
    source = ParallelEnvSource([Scripted("stale_none")], check_output=True, env="scripted")
    source.reset(seed=0)
    for t in range(4):
        ids, step, _ = source.recv()
        if t >= 2:  # b ended at step 1: padding since
            assert step.first[1] and step.terminated[1] and step.reward[1] == 0.0
        source.send(np.zeros(2, np.int64), ids)


@pytest.mark.timeout(60)
def test_a_reward_at_an_agent_s_joining_step_counts_in_the_team_return():
    source = ParallelEnvSource([Scripted("reward_as_b_joins")])
    _steps(source, 5)
    # a: 1 a step for 4 steps; b: 1 as it joins (its row's first step: 0 there) + 3.
    (team_return, length), = source.pop_team_episodes()
    assert (team_return, length) == (8.0, 4)
    assert sorted(source.pop_episodes()) == [(3.0, 3), (4.0, 4)]
