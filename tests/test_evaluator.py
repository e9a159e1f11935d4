"""Evaluation during training: an evaluator thread with its own envs, off the hot path."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time

import gymnasium as gym
import jax
import numpy as np
import pytest

import sebulba
from agents.ppo import PPO, PPOConfig
from agents.spg import SPG, SPGConfig
from sebulba.evaluation import evaluate
from sebulba.metrics import JsonLinesWriter, MultiWriter, Reporter, TensorBoardWriter
from sebulba.runtime.evaluator import Evaluation
from tests.conftest import sebulba_threads
from tests.envs import CountingEnv

ROLE_CALL = "sebulba.envs.suite.role_call"


def run_with_evaluation(steps: int, agent_cls=SPG, agent_config=None, on_update=None,
                        learn: bool = True, stop=None, **config) -> sebulba.RunResult:
    config = sebulba.Config(**{"envs_per_group": 8, "steps_per_cycle": 16, **config})
    agent = agent_cls(config.env_spec(), agent_config or SPGConfig())
    return sebulba.Sebulba(agent, config).run(steps, on_update=on_update, learn=learn,
                                              stop=stop)


@pytest.mark.timeout(120)
def test_evaluations_are_complete_episodes_of_published_networks_at_their_update(
        no_leftovers):
    seen: list[Evaluation] = []
    updates: list[int] = []

    def on_update(info):
        seen.extend(info.evaluations)
        updates.append(info.version)
        if not seen and info.version >= 3:
            # The run's end stops an evaluation under way: on a loaded machine the first
            # could outlast the run. The learner waits a little for it (the envs then
            # wait for room in the queue), so that at least the first finishes.
            time.sleep(0.25)

    result = run_with_evaluation(12_000, on_update=on_update, eval_every_updates=3,
                                 eval_episodes=5, eval_max_share=1.0)
    evaluations = result.evaluations
    # how many finish depends on the machine (an offer made while one runs is passed
    # over): at least the first
    assert evaluations
    # on_update saw each evaluation once, as it finished; the result keeps them all, with
    # the one that may finish after the last update's on_update (at most one runs at a
    # time; `Reporter.finish` writes it from the result)
    kept = [e.learner_update for e in evaluations]
    assert [e.learner_update for e in seen] == kept[:len(seen)]
    assert len(kept) - len(seen) <= 1
    for e in evaluations:
        assert e.learner_update % 3 == 0 and e.learner_update in updates
        # the step is the run's consumed env steps when those networks were published
        assert e.env_steps == e.learner_update * 8 * 16
        # CartPole's return is its length: each of the 5 is a complete episode
        assert e.result.returns == [float(n) for n in e.result.lengths]
        assert len(e.result.returns) == 5 and all(1 <= n <= 500 for n in e.result.lengths)
        assert e.seconds > 0
    steps = [e.env_steps for e in evaluations]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    # the evaluator's env steps are its own, counted apart from the training's
    assert result.evaluator_env_steps >= sum(sum(e.result.lengths) for e in evaluations)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    scalars = evaluations[-1].scalars()
    assert scalars["eval/return"] == pytest.approx(np.mean(evaluations[-1].result.returns))
    assert scalars["eval/learner_update"] == evaluations[-1].learner_update


@pytest.mark.timeout(120)
def test_evaluation_costs_at_most_its_share_of_the_env_steps(no_leftovers):
    # Episodes of 100 steps whatever the policy learns (on CartPole a policy that learns
    # fast makes the first evaluation's estimate, 4 x its longest episode, outgrow the
    # share): the share alone decides which evaluations are taken.
    result = run_with_evaluation(40_000, env=functools.partial(CountingEnv, 100),
                                 eval_every_updates=1, eval_episodes=4, eval_max_share=0.05)
    # The first is taken once the share covers its estimate, 4 x 100 steps, at about
    # 8,000 env steps (though the run may end, and stop it, before it ends).
    assert result.evaluator_env_steps > 0
    # An evaluation steps its 4 envs (one episode each) until the longest episode ends.
    one = 4 * (100 + 2)
    # every evaluation is taken only within the share (estimated as the last one's):
    # the share holds up to one evaluation's steps more (the last, which the run's end
    # may stop). Without the share: 4,000 to 4,500 here (10 or 11 evaluations, as many
    # as the run's 3 s leave time for), against 1,600 with it.
    assert result.evaluator_env_steps <= 0.05 * result.consumed + one, (
        result.evaluator_env_steps, result.consumed,
        [e.result.lengths for e in result.evaluations])
    assert result.evaluations_passed_over > 0
    # Episodes of a known length make the estimate exact: an offer over the share is
    # declined up front, never taken and then abandoned (which would bound the steps
    # too, with the evaluator's work thrown away).
    assert result.evaluations_abandoned == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("video", [False, True])
def test_an_evaluation_is_estimated_with_the_episode_it_records(tmp_path, video,
                                                                 no_leftovers):
    """Two envs and a longest training episode of 100 steps: 200 env steps, and 300
    where a video episode follows; within a share of 250 only the first is taken. The
    share is of this process's env steps (1,000), not the run's (4,000: 4 processes)."""
    from sebulba.runtime.channels import ErrorBox
    from sebulba.runtime.evaluator import Evaluator

    config = sebulba.Config(eval_every_updates=1, eval_episodes=2, eval_max_share=0.25,
                            eval_video_dir=str(tmp_path) if video else None)
    agent = SPG(config.env_spec())
    acting = agent.acting_nets(agent.new_networks(jax.random.key(0)), 0)
    halt = threading.Event()
    evaluator = Evaluator(agent, config, jax.devices()[0], ErrorBox(halt), halt)
    try:  # never started: offer only decides
        assert evaluator.offer(1, 4_000, acting, longest_episode=100,
                               own_env_steps=1_000) is not video
    finally:
        assert evaluator.close(timeout_s=1.0)


def _offering_evaluator(steps_before: int = 0, **config):
    from sebulba.runtime.channels import ErrorBox
    from sebulba.runtime.evaluator import Evaluator

    config = sebulba.Config(**{"eval_every_updates": 1, "eval_episodes": 10,
                               "eval_max_share": 0.02, **config})
    agent = SPG(config.env_spec())
    acting = agent.acting_nets(agent.new_networks(jax.random.key(0)), 0)
    halt = threading.Event()
    return Evaluator(agent, config, jax.devices()[0], ErrorBox(halt), halt,
                     steps_before=steps_before), acting


@pytest.mark.timeout(60)
def test_a_resumed_run_evaluates_within_the_share_of_the_training_before_it(
        no_leftovers):
    """10 envs x a longest episode of 500: 5,000 env steps an evaluation, which 2% of a
    segment of 200k steps never allows on its own. A run resumed after 10M steps takes
    one at once (the steps before it allow 200k), then only what its own share allows;
    a run after 100k steps (2,000 allowed) takes none."""
    for steps_before, taken in [(10_000_000, [True, False]), (100_000, [False, False]),
                                (0, [False, False])]:
        evaluator, acting = _offering_evaluator(steps_before)
        try:  # never started: offer only decides
            got = [evaluator.offer(1, 1_000, acting, longest_episode=500,
                                   own_env_steps=1_000)]
            if got[0]:  # as if that one had run its estimate
                evaluator._busy, evaluator.runner.env_steps = False, 5_000
            got.append(evaluator.offer(2, 2_000, acting, longest_episode=500,
                                       own_env_steps=2_000))
            assert got == taken, steps_before
            assert evaluator.passed_over == taken.count(False)
        finally:
            assert evaluator.close(timeout_s=1.0)


@pytest.mark.timeout(120)
def test_a_run_whose_evaluations_were_all_passed_over_says_so(no_leftovers):
    result = run_with_evaluation(2_048, eval_every_updates=2, eval_episodes=10,
                                 eval_max_share=0.001)
    assert not result.evaluations and result.evaluator_env_steps == 0
    # 16 updates, one due every 2: each passed over (before any episode ended, or over
    # the share)
    assert result.evaluations_passed_over == 8
    assert result.as_dict()["evaluations_passed_over"] == 8
    assert "8 were due and passed over" in result.summary()


@pytest.mark.timeout(60)
def test_an_error_closing_the_evaluators_envs_does_not_fail_the_run(no_leftovers, caplog):
    running = threading.Event()  # closes before the run (probing the env) succeed

    class FailingClose(gym.Wrapper):
        def close(self):
            super().close()
            if running.is_set():
                raise OSError("close failed")

    def make(**kwargs):
        return FailingClose(gym.make("CartPole-v1", **kwargs))

    config = sebulba.Config(env=make, envs_per_group=8, steps_per_cycle=16,
                            eval_every_updates=1, eval_episodes=2, eval_max_share=1.0)
    loop = sebulba.Sebulba(SPG(config.env_spec()), config)
    running.set()
    result = loop.run(2_048)  # the training envs' closes fail too: quietly, as before
    assert result.consumed >= 2_048
    assert "closing the evaluator's envs failed" in caplog.text


@pytest.mark.timeout(120)
def test_a_video_being_written_when_the_run_ends_is_waited_for(tmp_path, monkeypatch,
                                                                no_leftovers):
    """Encoding cannot be interrupted: a run that ends while the evaluator writes a video
    waits for it past shutdown_timeout_s, rather than fail as if a thread were stuck."""
    from sebulba.runtime import evaluator as evaluator_module

    writing, write = threading.Event(), evaluator_module.save_video

    def slow_save_video(frames, directory, name, fps=30):
        writing.set()
        time.sleep(2.0)  # > shutdown_timeout_s
        return write(frames, directory, name, fps)

    monkeypatch.setattr(evaluator_module, "save_video", slow_save_video)
    stop = threading.Event()
    result = run_with_evaluation(
        200_000, on_update=lambda info: writing.is_set() and stop.set(),
        eval_every_updates=1, eval_episodes=1, eval_max_share=1.0,
        eval_video_dir=str(tmp_path), shutdown_timeout_s=0.5, stop=stop)
    assert result.stopped_early
    written = os.listdir(tmp_path)
    assert len(written) == 1 and os.path.getsize(tmp_path / written[0]) > 1000


class EvaluatorThreadEnv(gym.Env):
    """CartPole that is slow, or fails, only where the evaluator steps it."""

    observation_space = gym.make("CartPole-v1").observation_space
    action_space = gym.spaces.Discrete(2)

    def __init__(self, sleep_s: float = 0.0, fail: bool = False, endless: bool = False,
                 stepped: threading.Event | None = None):
        self.env, self.sleep_s, self.fail = gym.make("CartPole-v1"), sleep_s, fail
        self.endless, self.steps, self.stepped = endless, 0, stepped

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return self.env.reset(seed=seed)

    def step(self, action):
        evaluator = threading.current_thread().name == "sebulba-evaluator"
        if evaluator:
            if self.fail:
                raise RuntimeError("the evaluation env broke")
            if self.stepped is not None:
                self.stepped.set()
            time.sleep(self.sleep_s)
        if self.endless:  # episodes of 20 steps, none where the evaluator steps it
            self.steps += 1
            return (np.zeros(4, np.float32), 1.0, False, self.steps >= 20 and not evaluator,
                    {})
        return self.env.step(action)


@pytest.mark.timeout(120)
def test_a_slow_evaluation_never_holds_up_training_and_is_cut_short_at_the_end(
        no_leftovers):
    # Each evaluation step takes 0.2 s, so an evaluation takes minutes: training must
    # go on through it, and the run must end without waiting for it. (The 30th update
    # waits until the evaluator steps, so that the run cannot end before it starts.)
    updates_during: list[int] = []
    stepped = threading.Event()

    def on_update(info):
        updates_during.append(info.version)
        if info.version == 30:
            assert stepped.wait(30)

    t0 = time.perf_counter()
    result = run_with_evaluation(
        6_000, on_update=on_update,
        env=lambda: EvaluatorThreadEnv(sleep_s=0.2, stepped=stepped), eval_every_updates=1,
        eval_max_share=1.0)
    assert result.learner_updates == len(updates_during) >= 40
    assert result.evaluations == []  # none finished: the run's end stopped the first
    assert result.evaluator_env_steps > 0  # but it was under way
    # and the summary says where it went (not abandoned: it stayed within the share)
    assert (result.evaluations_cut, result.evaluations_abandoned) == (1, 0)
    assert "0 evaluations during training" in result.summary()
    assert "1 more cut short by the run's end" in result.summary()
    # ended promptly: not after the evaluation's minutes (the thread polls the halt)
    assert time.perf_counter() - t0 < 60
    assert "sebulba-evaluator" not in sebulba_threads()


@pytest.mark.timeout(120)
def test_an_evaluation_that_outruns_the_share_is_abandoned_and_training_goes_on(
        no_leftovers):
    # Episodes that never end where the evaluator steps them (a policy that balances for
    # ever in an env without a time limit): each evaluation is given up once it passes the
    # share, the next waits for twice its steps, and the run ends as asked.
    # A share of 1%: the evaluator (whose envs step as fast as the training's) passes it
    # within a second of starting, well before the run ends.
    result = run_with_evaluation(60_000, env=lambda: EvaluatorThreadEnv(endless=True),
                                 eval_every_updates=1, eval_episodes=2, eval_max_share=0.01)
    assert result.consumed >= 60_000 and not result.stopped_early
    assert result.evaluations == [] and result.evaluations_abandoned >= 1
    # Checked once per learner update (128 env steps here): the share holds up to the
    # steps the evaluator takes in one, a few hundred.
    assert result.evaluator_env_steps <= 0.01 * result.consumed + 2_000, (
        result.evaluator_env_steps, result.consumed, result.evaluations_abandoned)
    # doubling: a handful of tries, not one every update (469 updates)
    assert result.evaluations_abandoned <= 10
    assert "abandoned for running past eval_max_share" in result.summary()


@pytest.mark.timeout(60)
def test_networks_that_did_not_change_are_evaluated_once(no_leftovers):
    # Without learning the published networks stay those of update 0: one evaluation
    # (none if the run ends before it does), not one after every trajectory.
    result = run_with_evaluation(30_000, learn=False, eval_every_updates=1,
                                 eval_episodes=2, eval_max_share=1.0)
    assert result.learner_updates == 0
    assert [e.learner_update for e in result.evaluations] in ([], [0])


class NoGreedySPG(SPG):
    greedy_step = sebulba.Agent.greedy_step  # as an agent that never defined it


def test_greedy_evaluation_of_an_agent_without_greedy_step_is_refused_at_construction():
    config = sebulba.Config(eval_every_updates=100)
    agent = NoGreedySPG(config.env_spec())
    with pytest.raises(ValueError, match="eval_greedy=True evaluates with Agent.greedy_step, "
                       "which NoGreedySPG does not define: define it, or set "
                       r"eval_greedy=False to evaluate with sampling \(Agent.step\)"):
        sebulba.Sebulba(agent, config)
    sebulba.Sebulba(agent, dataclasses.replace(config, eval_greedy=False))  # sampling is fine
    nets = agent.new_networks(jax.random.key(0))
    with pytest.raises(ValueError, match="greedy=True evaluates with Agent.greedy_step"):
        evaluate(agent, nets, "CartPole-v1", 1)


@pytest.mark.timeout(120)
def test_an_error_in_the_evaluator_stops_the_run_with_its_traceback(no_leftovers):
    with pytest.raises(RuntimeError, match="the evaluation env broke") as raised:
        run_with_evaluation(10_000_000, env=lambda: EvaluatorThreadEnv(fail=True),
                            eval_every_updates=1, eval_max_share=1.0)
    frames = [frame.name for frame in raised.traceback]
    assert "step" in frames and "_evaluate" in frames  # where it happened


@pytest.mark.timeout(120)
def test_multi_agent_envs_are_evaluated_per_agent_and_as_a_team(no_leftovers):
    # A learner with slack (on_update sleeps): on two cores the evaluator's first episodes
    # (and its compilation) would otherwise race a 6-second run.
    result = run_with_evaluation(6_000, PPO, PPOConfig(), env=ROLE_CALL,
                                 vectorization="pettingzoo", agent_ids=True,
                                 on_update=lambda info: time.sleep(0.05),
                                 eval_every_updates=2, eval_episodes=3, eval_max_share=1.0)
    assert result.evaluations
    e = result.evaluations[-1]
    agents = ["agent_0", "agent_1", "agent_2"]
    assert sorted(e.result.agent_returns) == agents
    # an env episode's team return is the sum of its agents' returns
    team = np.sum([e.result.agent_returns[a] for a in agents], axis=0)
    np.testing.assert_allclose(e.result.returns, team, rtol=1e-5)
    assert e.result.lengths == [16, 16, 16]  # RoleCall's episodes: env episodes
    scalars = e.scalars()
    assert scalars["eval/team_return"] == pytest.approx(np.mean(e.result.returns))
    assert scalars["eval/return"] == pytest.approx(np.mean(team) / 3)
    assert {f"eval/return/{a}" for a in agents} <= set(scalars)
    # The summary says what the sinks got: an agent's mean return, the team's beside it.
    assert (f"mean return {scalars['eval/return']:.4g} (team "
            f"{scalars['eval/team_return']:.4g})") in result.summary()


@pytest.mark.timeout(180)
def test_videos_are_recorded_every_m_evaluations_to_files_and_tensorboard(tmp_path,
                                                                          no_leftovers):
    videos = str(tmp_path / "videos")
    writer = MultiWriter([TensorBoardWriter(str(tmp_path)),
                          JsonLinesWriter(str(tmp_path / "metrics.jsonl"))])
    reporter = Reporter(8_000, writer, every_seconds=0.0, progress=False)
    frames_seen = []

    def on_update(info):
        frames_seen.extend(e.video_frames for e in info.evaluations
                           if e.video_frames is not None)
        reporter(info)
        time.sleep(0.05)  # slack for the evaluator on two cores (see the multi-agent test)

    try:
        result = run_with_evaluation(8_000, on_update=on_update, eval_every_updates=2,
                                     eval_episodes=2, eval_max_share=1.0,
                                     eval_video_dir=videos, eval_video_every=2)
        reporter.finish(result)  # those that finished after the last update
    finally:
        reporter.close()
    with_video = [e for e in result.evaluations if e.video]
    assert with_video
    # evaluations 0, 2, 4, ... record one more episode each, and no other does; a
    # recording that ran past the share (two cores under load) or that the run's end
    # stopped leaves its evaluation's episodes standing without it
    due = result.evaluations[::2]
    assert all(e in due for e in with_video)
    without = [e for e in due if e.video is None]
    # the last one, if due, may have been stopped by the run's end (not counted as cut)
    ended = 1 if len(result.evaluations) % 2 == 1 and due[-1].video is None else 0
    cut = result.evaluation_videos_cut
    assert cut <= len(without) <= cut + ended, ([e.video for e in result.evaluations], cut)
    assert all(e.video_frames is None for e in result.evaluations)  # not kept in the result
    assert sorted(os.listdir(videos)) == sorted(os.path.basename(e.video) for e in with_video)
    assert all(os.path.getsize(e.video) > 1000 for e in with_video)
    assert frames_seen and frames_seen[0].ndim == 4 and frames_seen[0].shape[-1] == 3
    # the frames show the episode: the cart and pole move between first and last
    assert np.abs(frames_seen[0][0].astype(int) - frames_seen[0][-1].astype(int)).sum() > 0
    events = [f for f in os.listdir(tmp_path) if f.startswith("events.out")]
    assert events and os.path.getsize(tmp_path / events[0]) > 10_000  # the GIFs
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    eval_rows = [r for r in rows if "eval/return" in r]
    assert [r["step"] for r in eval_rows] == [e.env_steps for e in result.evaluations]


class NoRender(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, True, False, {}


@pytest.mark.timeout(60)
def test_videos_of_an_env_that_cannot_render_are_refused_before_training(tmp_path,
                                                                         no_leftovers):
    with pytest.raises(ValueError, match="cannot record videos: it renders no rgb_array"):
        run_with_evaluation(1_000, env=NoRender, eval_every_updates=1,
                            eval_video_dir=str(tmp_path))


@pytest.mark.parametrize("field,value,match", [
    ("eval_every_updates", -1, "eval_every_updates must be an int >= 0"),
    ("eval_every_updates", True, "eval_every_updates must be an int >= 0"),
    ("eval_max_share", "0.1", r"eval_max_share must be a share .* got '0.1'"),
    ("eval_episodes", 0, "eval_episodes must be an int >= 1"),
    ("eval_max_share", 0.0, r"eval_max_share must be a share of the env steps in \(0, 1\]"),
    ("eval_device", 99, "eval_device has device index 99"),
])
def test_bad_evaluation_settings_are_refused_at_construction(field, value, match):
    with pytest.raises(ValueError, match=match):
        sebulba.Config(**{"eval_every_updates": 1, field: value})


def test_evaluation_is_off_unless_asked_for():
    config = sebulba.Config()
    assert config.eval_every_updates == 0
    assert dataclasses.replace(config, eval_every_updates=5).resolved_eval_device() == (
        config.resolved_inference_devices()[0])


class EndlessOnFilm(gym.Env):
    """Episodes of 5 steps, whatever the policy (so that the evaluation's own fit the
    share), except where it is filmed (made with render_mode "rgb_array", as the
    evaluator's video env is): there they never end."""

    observation_space = gym.spaces.Box(-10.0, 10.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)
    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, render_mode=None):
        self.render_mode, self.steps = render_mode, 0

    def reset(self, *, seed=None, options=None):
        self.steps = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.steps += 1
        ends = self.steps >= 5 and self.render_mode != "rgb_array"
        return np.full(4, self.steps % 3, np.float32), 1.0, False, ends, {}

    def render(self):
        return np.zeros((8, 8, 3), np.uint8)


# An id, so that the video env gets its render_mode (env_kwargs go to ids, not factories).
gym.register(id="SebulbaTest/EndlessOnFilm-v0", entry_point=EndlessOnFilm)


@pytest.mark.timeout(120)
def test_an_evaluation_whose_video_outruns_the_share_is_kept_and_the_cut_video_counted(
        tmp_path, no_leftovers):
    # The episodes end; the filmed one never does, and the share stops its recording: the
    # evaluation stands without its video, and the run says so (it said nothing).
    evaluated = []

    def on_update(info):  # slack until the first evaluation is in (its compiling too)
        evaluated.extend(info.evaluations)
        if not evaluated:
            time.sleep(0.05)

    result = run_with_evaluation(30_000, env="SebulbaTest/EndlessOnFilm-v0", eval_every_updates=1,
                                 eval_episodes=2, eval_max_share=0.05, on_update=on_update,
                                 eval_video_dir=str(tmp_path / "videos"), eval_video_every=1)
    assert result.evaluations and all(e.video is None for e in result.evaluations)
    assert result.evaluation_videos_cut >= 1
    assert result.as_dict()["evaluation_videos_cut"] == result.evaluation_videos_cut
    assert "kept without the video due then" in result.summary()
