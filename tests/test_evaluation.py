"""Evaluation reports complete episodes, a fixed number per env."""

import dataclasses

import gymnasium as gym
import jax
import numpy as np
import pytest

import sebulba
from agents.spg import SPG
from sebulba.evaluation import evaluate


class ShortOrLong(gym.Env):
    """Episodes of 2 steps in envs reset first with an even seed, of 20 with an odd one;
    the return is the length (reward 1 per step)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.length = 2 if seed % 2 == 0 else 20
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), 1.0, self.t == self.length, False, {}


@pytest.mark.timeout(60)
def test_each_env_runs_its_share_of_episodes_so_short_ones_are_not_favoured():
    agent = SPG(sebulba.env_spec(ShortOrLong))
    nets = agent.new_networks(jax.random.key(0))
    result = evaluate(agent, nets, ShortOrLong, 6, num_envs=2, seed=0)
    # env 0 (seed 0) ends every 2 steps, env 1 every 20: the first six episodes to end
    # would all be short ones; three of each is what the policy's return is
    assert result.returns == [2.0] * 3 + [20.0] * 3
    assert result.lengths == [2] * 3 + [20] * 3
    # more envs than episodes: only as many envs as episodes run
    assert evaluate(agent, nets, ShortOrLong, 1, num_envs=8, seed=1).returns == [20.0]


@pytest.mark.timeout(60)
def test_a_multi_agent_env_is_evaluated_by_its_env_episodes_per_agent_and_team():
    role_call = "sebulba.envs.suite.role_call"
    agent = SPG(sebulba.env_spec(role_call, vectorization="pettingzoo", agent_ids=True))
    nets = agent.new_networks(jax.random.key(0))
    result = evaluate(agent, nets, role_call, 5, num_envs=2, vectorization="pettingzoo",
                      agent_ids=True, env_kwargs={"episode_length": 4})
    assert result.lengths == [4] * 5  # env episodes, 3 on env 0 and 2 on env 1
    assert sorted(result.agent_returns) == ["agent_0", "agent_1", "agent_2"]
    team = np.sum(list(result.agent_returns.values()), axis=0)
    np.testing.assert_allclose(result.returns, team, rtol=1e-5)
    # each agent's return is a share of its right answers: in [0, 1], not all equal
    every = np.concatenate(list(result.agent_returns.values()))
    assert every.min() >= 0 and every.max() <= 1 and len(set(every.tolist())) > 1
    summary = result.as_dict()
    assert summary["mean_agent_return"] == pytest.approx(every.mean())


@pytest.mark.timeout(60)
def test_sources_of_several_groups_are_refused():
    from sebulba.envs import registry
    from tests.test_env_registry import SIGN, SignSource

    made = []

    def two_groups(request):  # a source that ignores the request's one group
        made.append(SignSource(2, request.group_size, request.seed))
        return [made[-1]]

    def two_sources(request):
        made.extend(SignSource(1, request.group_size, request.seed) for _ in range(2))
        return made[-2:]

    for name, make, what in [("test_two_groups", two_groups, r"1 source\(s\) of 2 group\(s\)"),
                             ("test_two_sources", two_sources, r"2 source\(s\) of 2 group\(s\)")]:
        registry.register(dataclasses.replace(SIGN, name=name, make_sources=make,
                                              evaluate_as=name))
        try:
            agent = SPG(sebulba.env_spec("sign", vectorization=name))
            with pytest.raises(ValueError, match=f"one source of one group of 4 envs, but "
                                                 f"vectorization '{name}' made {what}"):
                evaluate(agent, agent.new_networks(jax.random.key(0)), "sign", 4, num_envs=4,
                         vectorization=name)
        finally:
            registry.unregister(name)
    assert made and all(source.closed for source in made)


@pytest.mark.timeout(120)
def test_a_video_of_a_wrapped_env_shows_the_policy_what_it_was_trained_on(tmp_path):
    """record_video applies the run's env_wrappers: an agent built for CartPole's
    observations stacked two deep acts on the wrapped env and the video holds the env's
    own frames; without the wrappers its network would read the wrong shape."""
    from sebulba.evaluation import record_video

    wrappers = ("FrameStackObservation(stack_size=2)",)
    agent = SPG(sebulba.Config(env="CartPole-v1", env_wrappers=wrappers).env_spec())
    assert agent.env_spec.obs_shape == (2, 4)
    nets = agent.new_networks(jax.random.key(0))
    episode_return = record_video(agent, nets, "CartPole-v1", str(tmp_path), seed=3,
                                  env_wrappers=wrappers, name="stacked")
    assert 1 <= episode_return <= 500
    video = tmp_path / "stacked.mp4"
    assert video.exists() and video.stat().st_size > 1000
    # The unwrapped env's (4,) observations do not fit: named before any step.
    with pytest.raises(ValueError, match=r"(?s)the agent was built for .*\(2, 4\).* but env "
                                         r"'CartPole-v1' has .*\(4,\)"):
        record_video(agent, nets, "CartPole-v1", str(tmp_path), seed=3, name="unwrapped")
    assert not (tmp_path / "unwrapped.mp4").exists()
    # evaluate() takes the wrappers too, and checks the same.
    result = evaluate(agent, nets, "CartPole-v1", 2, num_envs=2, env_wrappers=wrappers)
    assert len(result.returns) == 2 and min(result.returns) >= 1
    with pytest.raises(ValueError, match="the agent was built for"):
        evaluate(agent, nets, "CartPole-v1", 2, num_envs=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vectorization", ["sync", "envpool"])
def test_a_recorded_episode_has_a_frame_per_step_and_the_first(vectorization):
    """CartPole's return is its length: T steps, T + 1 frames. The recorder's render
    check must leave no EnvPool batch in flight, or each recording runs a step behind."""
    from sebulba.envs import registry
    from sebulba.evaluation import VideoRecorder

    agent = SPG(sebulba.env_spec("CartPole-v1", vectorization=vectorization))
    nets = agent.acting_nets(agent.new_networks(jax.random.key(0)), 0)
    recorder = VideoRecorder(agent, vectorization,
                             registry.SourceRequest("CartPole-v1", {}, 1, seed=7))
    try:
        for seed in (1, 2):
            frames, episode_return = recorder.record(nets, seed)
            assert len(frames) == episode_return + 1
        assert recorder.fps == 50  # CartPole's render_fps, EnvPool's source holds no env
    finally:
        recorder.close()


@pytest.mark.timeout(60)
def test_settings_a_vectorization_cannot_honour_are_refused_as_a_run_refuses_them():
    """Wrappers of envs EnvPool makes itself, agent ids of a single-agent env: ignored
    silently, the evaluation would report another env than the run's."""
    agent = SPG(sebulba.env_spec("CartPole-v1"))
    nets = agent.new_networks(jax.random.key(0))
    with pytest.raises(ValueError, match="env_wrappers wrap each env, so they need"):
        evaluate(agent, nets, "CartPole-v1", 2, num_envs=2, vectorization="envpool",
                 env_wrappers=("ClipReward(max_reward=0.5)",))
    with pytest.raises(ValueError, match="agent_ids is for multi-agent envs"):
        evaluate(agent, nets, "CartPole-v1", 2, num_envs=2, agent_ids=True)


class PaysForOne(gym.Env):
    """Episodes of 3 steps; reward 1 for action 1, 0 for action 0."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), float(action), self.t == 3, False, {}


class ExploresUntilFiveUpdates(SPG):
    """Acting networks that follow the learner's progress (as an exploration schedule
    does): action 0 before 5 learner updates, 1 from then on."""

    def acting_nets(self, nets, learner_updates):
        return {"nets": nets, "late": learner_updates >= 5}

    def greedy_step(self, step_state, nets, env_step):
        output, state = super().greedy_step(step_state, nets["nets"], env_step)
        action = jax.numpy.broadcast_to(nets["late"], output.action.shape)
        return output._replace(action=action.astype(output.action.dtype)), state


@pytest.mark.timeout(60)
def test_evaluation_acts_with_the_networks_published_after_the_checkpoints_updates():
    agent = ExploresUntilFiveUpdates(sebulba.env_spec(PaysForOne))
    nets = agent.new_networks(jax.random.key(0))
    assert evaluate(agent, nets, PaysForOne, 2, num_envs=2).returns == [0.0, 0.0]
    late = evaluate(agent, nets, PaysForOne, 2, num_envs=2, learner_updates=7)
    assert late.returns == [3.0, 3.0]


class StopAfter:
    """A stop flag that is set from its n+1-th look on."""

    def __init__(self, looks: int):
        self.looks = looks

    def is_set(self) -> bool:
        self.looks -= 1
        return self.looks < 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("vectorization", ["envpool", "pettingzoo"])
def test_a_stopped_evaluation_leaves_its_source_clean_for_the_next(vectorization,
                                                                  no_leftovers):
    # The evaluator gives up an evaluation that runs past its share and starts the next
    # on the same source: no step of the last may still be in flight (EnvPool would be
    # one batch behind from then on), no episode of it left to pop (counted against the
    # next one's quota).
    from sebulba.envs import registry
    from sebulba.evaluation import EpisodeRunner

    pytest.importorskip("envpool" if vectorization == "envpool" else "pettingzoo")
    env, kwargs, ids = (("CartPole-v1", {}, False) if vectorization == "envpool" else
                        ("sebulba.envs.suite.role_call", {"episode_length": 3}, True))
    agent = SPG(sebulba.env_spec(env, vectorization=vectorization, agent_ids=ids,
                                 env_kwargs=kwargs))
    acting = agent.acting_nets(agent.new_networks(jax.random.key(0)), 0)
    request = registry.SourceRequest(env, kwargs, 2, seed=0, agent_ids=ids)
    [source] = registry.get(vectorization).make_sources(request)
    try:
        runner = EpisodeRunner(agent, source)
        # 3 steps sent, the episodes of the last ended (role_call's after 3 steps)
        assert runner.run(acting, 8, seed=0, stop=StopAfter(3)) is None
        source.reset(1)
        _, env_step, _ = source.recv()
        assert env_step.first.all()
        if vectorization == "envpool":  # reset observations, not those of a 4th step
            assert np.abs(env_step.obs).max() <= 0.05, env_step.obs
        else:
            assert source.pop_env_episodes() == []
    finally:
        source.close()
