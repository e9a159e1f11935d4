"""Bad configuration is a clear error at construction, naming the value."""

from __future__ import annotations

import functools
import re
import sys

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from agents.spg import SPG
from sebulba.envs import example_env_step
from sebulba.evaluation import save_video
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv

COUNTING = functools.partial(CountingEnv, 5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"envs_per_group": 6, "learner_devices": [0, 1, 2, 3]},
         r"envs_per_group=6 must be divisible by the number of learner devices \(4\)"),
        ({"async_factor": 0}, r"async_factor must be an int >= 1, got 0"),
        ({"steps_per_cycle": 0}, r"steps_per_cycle must be an int >= 1, got 0"),
        ({"envs_per_group": 2.5}, r"envs_per_group must be an int >= 1, got 2.5"),
        ({"shutdown_timeout_s": float("nan")},
         r"shutdown_timeout_s must be finite seconds > 0, got nan"),
        ({"shutdown_timeout_s": True}, r"shutdown_timeout_s must be finite seconds > 0"),
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*63\) \(JAX's PRNG keys and the "
                       r"envs are seeded from it\), got -1"),
        ({"seed": 1.5}, r"seed must be an int in \[0, 2\*\*63\) .* got 1.5"),
        ({"seed": 2**63}, r"seed must be an int in \[0, 2\*\*63\) .* got 9223372036854775808"),
        ({"env_kwargs": {"episode_length": 2}},
         r"env_kwargs \{'episode_length': 2\} given with the factory .*CountingEnv.*, which "
         r"is called without arguments"),
        ({"check_finite": 1}, r"check_finite must be a bool, got 1"),
        ({"drop_when_full": "yes"}, r"drop_when_full must be a bool, got 'yes'"),
        ({"queue_capacity": True}, r"queue_capacity must be an int >= 0, got True"),
        ({"async_context": "bogus"}, r"async_context must be one of \(.*'spawn'.*\), got 'bogus'"),
        ({"env_kwargs": [1, 2]}, r"env_kwargs must be a mapping of keyword arguments"),
        ({"eval_video_dir": 3}, r"eval_video_dir must be a path \(str\) or None, got 3"),
        ({"eval_video_dir": "videos"}, r"eval_video_dir='videos' records episodes of "
                                       r"evaluations during training: it needs "
                                       r"eval_every_updates > 0"),
        ({"eval_video_dir": "", "eval_every_updates": 1},
         r"eval_video_dir='' is an empty path: name the directory the videos go to, or None"),
        ({"eval_every_updates": 1, "eval_device": 4},
         r"eval_device has device index 4, but this process has 4 local devices "
         r"\(indices 0..3\)"),
        ({"inference_devices": [7]}, r"inference_devices has device index 7, but this process "
                                     r"has 4 local devices"),
        ({"learner_devices": []}, r"learner_devices must be a non-empty list"),
        ({"learner_devices": jax.devices()[0]},
         r"learner_devices must be a non-empty list of devices or indices, got CpuDevice"),
        ({"inference_devices": ["gpu"]},
         r"inference_devices entries must be device indices or jax.Device, got 'gpu'"),
        ({"inference_devices": [0.0]},
         r"inference_devices entries must be device indices or jax.Device, got 0.0"),
        ({"learner_devices": [1, 1]}, r"learner_devices lists a device twice"),
        ({"vectorization": "threads"}, r"vectorization must be one of .* got 'threads'"),
        ({"queue_capacity": -1}, r"queue_capacity must be an int >= 0, got -1"),
        ({"action_poll_s": -0.001},
         r"action_poll_s must be seconds in \[0, 1\] or None, got -0.001"),
        ({"action_poll_s": "1ms"}, r"action_poll_s must be seconds in \[0, 1\] or None, got '1ms'"),
        ({"desync_episodes": 1}, r"desync_episodes must be a bool, got 1"),
        ({"env": "CartPole-v1", "vectorization": "vector_entry_point", "desync_episodes": True},
         r"desync_episodes wraps each env, so it needs vectorization 'sync' or 'async'"),
    ],
)
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sebulba.Config(**{"env": COUNTING, **kwargs})


@pytest.mark.timeout(60)
def test_numpy_integers_are_device_indices():
    config = sebulba.Config(env=COUNTING, learner_devices=[np.int64(1)],
                            inference_devices=(np.int32(0),))
    assert config.resolved_local_learner_devices() == [jax.local_devices()[1]]
    assert config.resolved_inference_devices() == [jax.local_devices()[0]]


def test_videos_without_moviepy_are_refused_at_construction_naming_the_extra(
        monkeypatch, tmp_path):
    # As if moviepy were not installed: gymnasium's save_video imports it again and fails.
    monkeypatch.delitem(sys.modules, "gymnasium.utils.save_video", raising=False)
    for name in ("moviepy", "moviepy.video.io.ImageSequenceClip"):
        monkeypatch.setitem(sys.modules, name, None)
    hint = (r"which needs moviepy \(.*moviepy.*\): pip install -e '\.\[video\]' in "
            r"sebulba's checkout")
    directory = re.escape(repr(str(tmp_path)))
    with pytest.raises(ValueError, match=rf"eval_video_dir={directory} records videos, {hint}"):
        sebulba.Config(env=COUNTING, eval_every_updates=1, eval_video_dir=str(tmp_path))
    sebulba.Config(env=COUNTING, eval_every_updates=1)  # no videos: moviepy is not needed
    # examples.evaluate's --video_dir writes through save_video: the same hint.
    with pytest.raises(ValueError, match=rf"saving 'episode' records videos, {hint}"):
        save_video(np.zeros((2, 8, 8, 3), np.uint8), str(tmp_path), "episode")
    assert not list(tmp_path.iterdir())


def test_lockstep_refuses_drops_that_would_leave_an_update_short():
    # Lockstep's next cycle waits for the update that learns from this one: a trajectory
    # dropped from a full queue would leave an update of two one short for ever.
    lockstep = {"env": COUNTING, "lockstep": True, "async_factor": 1, "drop_when_full": True}
    with pytest.raises(ValueError, match=r"lockstep with drop_when_full needs "
                                         r"trajectories_per_update=1, got 2"):
        sebulba.Config(**lockstep, trajectories_per_update=2)
    sebulba.Config(**lockstep)  # one trajectory per update: nothing can be left short
    sebulba.Config(**{**lockstep, "drop_when_full": False}, trajectories_per_update=2)


class DictObsEnv(CountingEnv):
    observation_space = gym.spaces.Dict({"x": gym.spaces.Box(0, 1, (2,), np.float32)})


class MultiBinaryActionEnv(CountingEnv):
    action_space = gym.spaces.MultiBinary(3)


@pytest.mark.parametrize("env,message", [
    (DictObsEnv, r"unsupported observation space Dict\(.*FlattenObservation"),
    (MultiBinaryActionEnv, r"unsupported action space MultiBinary\(3\).*expected"),
])
def test_unsupported_spaces_are_rejected(env, message):
    with pytest.raises(ValueError, match=message):
        sebulba.env_spec(env)


def test_action_polling_defaults_to_off_only_where_env_workers_need_the_cores():
    assert sebulba.Config(env="CartPole-v1").action_poll_seconds == 0.0005
    assert sebulba.Config(env="CartPole-v1", vectorization="async").action_poll_seconds == 0
    given = sebulba.Config(env="CartPole-v1", vectorization="async", action_poll_s=0.002)
    assert given.action_poll_seconds == 0.002  # a value given is kept


def test_agent_built_for_another_env_is_rejected():
    agent = CountingAgent(sebulba.env_spec("CartPole-v1"))
    with pytest.raises(ValueError, match="the agent was built for .* but env"):
        sebulba.Sebulba(agent, sebulba.Config(env=COUNTING, envs_per_group=2))


def test_spg_acts_in_box_actions_with_a_gaussian_policy():
    agent = SPG(sebulba.env_spec("Pendulum-v1"))  # a torque in [-2, 2]
    nets = agent.new_networks(jax.random.key(0))
    state = agent.new_step_state(nets, jax.random.key(1), 3)
    env_step = example_env_step(agent.env_spec, 3)
    output, _ = jax.jit(agent.step)(state, nets, env_step)
    assert output.action.shape == (3, 1) and output.action.dtype == jnp.float32
    assert len(set(np.asarray(output.action)[:, 0].tolist())) == 3  # sampled per env


def test_bad_total_env_steps_is_rejected():
    loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(COUNTING)),
                           sebulba.Config(env=COUNTING, envs_per_group=2))
    with pytest.raises(ValueError, match="total_env_steps must be an int >= 1, got 0"):
        loop.run(0)


@pytest.mark.timeout(60)
def test_a_step_state_of_another_layout_is_refused_before_anything_starts(no_leftovers):
    """The groups' slices of a state with too few rows were empty (an agent that
    broadcasts acted on nothing, the run ended without an error), extra rows were left
    out."""
    agent = CountingAgent(sebulba.env_spec(COUNTING))
    small = sebulba.Sebulba(agent, sebulba.Config(env=COUNTING, envs_per_group=2,
                                                  async_factor=1))
    big = sebulba.Sebulba(agent, sebulba.Config(env=COUNTING, envs_per_group=2,
                                                async_factor=3))
    for loop, state, rows in [(big, small.initial_state(), 2),
                              (small, big.initial_state(), 6)]:
        with pytest.raises(ValueError, match=re.escape(
                f"state.step_state has per-env leaves of [{rows}] rows; this process's envs "
                f"need {8 - rows}")):
            loop.run(100, state)


@pytest.mark.timeout(120)
def test_an_experience_of_another_layout_is_refused_before_anything_starts(no_leftovers):
    """R2D2's pending sequences are per env: given a 4-env loop's experience, an 8-env
    loop spliced envs 0 and 4's steps into one sequence, and ran without an error."""
    from agents.r2d2 import R2D2, R2D2Config

    agent = R2D2(sebulba.env_spec("CartPole-v1"),
                 R2D2Config(torso_sizes=(8,), lstm_size=8, head_sizes=(8,),
                            sequence_length=8, sequence_overlap=4, burn_in=2, batch_size=4,
                            replay_capacity=16, min_replay_size=4))
    small, big = (sebulba.Sebulba(agent, sebulba.Config(
        env="CartPole-v1", envs_per_group=e, steps_per_cycle=4, async_factor=1))
        for e in (4, 8))
    result = small.run(small.env_steps_per_update)
    expected = re.escape("this loop's layout (1 env groups x 8 rows, 4 steps per cycle) "
                         "makes float32[8, 4, 4]: an experience made for another layout")
    with pytest.raises(ValueError, match=r"local_experience\.pending\.env_steps\.obs is "
                                         r"float32\[4, 4, 4\] per learner device; " + expected):
        big.run(100, big.initial_state(), local_experience=result.learner_experience)
    with pytest.raises(ValueError, match=r"state\.experience\.pending\.env_steps\.obs is "
                                         r"float32\[4, 4, 4\]; " + expected):
        big.run(100, big.initial_state()._replace(experience=small.initial_state().experience))
    # Its own layout's experience runs.
    assert big.run(big.env_steps_per_update, result.state._replace(
        step_state=big.initial_state().step_state,
        experience=big.initial_state().experience)).learner_updates == 1


@pytest.mark.parametrize("env,message", [
    ("NoSuchEnv-v0", r"env 'NoSuchEnv-v0' is not a registered gymnasium id: Environment "
                     r"`NoSuchEnv` doesn't exist \(an id that a module registers takes the form"),
    ("Cartpole-v1", r"env 'Cartpole-v1' is not a registered .* Did you mean: `CartPole`"),
    ("CartPole-v9", r"env 'CartPole-v9' is not a registered .* `v0`, `v1`"),
    # A deprecated version: gymnasium names the one to use, and no `module:Id` hint.
    ("Taxi-v3", r"env 'Taxi-v3' is not a registered gymnasium id: Environment version v3 "
                r"for `Taxi` is deprecated. Please use `Taxi-v4` instead$"),
    ("no_such_module:Foo-v0", r"env 'no_such_module:Foo-v0': importing 'no_such_module', "
                              r"which the `module:Id` form imports to register 'Foo-v0', "
                              r"failed: No module named 'no_such_module'"),
    # The suite's ids without the module that registers them: the hint names it.
    ("sebulba/Nope-v0", r"env 'sebulba/Nope-v0' is not a registered gymnasium id: .* \(the "
                        r"module that registers the suite's envs comes first: "
                        r"'sebulba.envs.suite:sebulba/Nope-v0'\)$"),
    ("sebulba.envs.suite:sebulba/Nope-v0", r"env 'sebulba.envs.suite:sebulba/Nope-v0' is not "
                                            r"a registered gymnasium id"),
])
def test_unknown_env_id_is_a_value_error_naming_it_at_construction(env, message):
    with pytest.raises(ValueError, match=message):
        sebulba.env_spec(env)
    # Config checks it before it resolves devices: a bad device index is not reached.
    with pytest.raises(ValueError, match=message):
        sebulba.Config(env=env, inference_devices=[99])


@pytest.mark.filterwarnings("ignore:.*unversioned environment")
def test_an_unversioned_id_means_its_latest_version_as_gym_make_has_it():
    assert sebulba.Config(env="CartPole").env_spec() == sebulba.env_spec("CartPole-v1")


@pytest.mark.parametrize("kwargs,message", [
    ({"vectorization": "vector_entry_point", "env": "Pendulum-v1"},
     r"env 'Pendulum-v1' has no vectorized version of its own"),
    ({"vectorization": "envpool", "env": "CartPole-v9"},
     r"env 'CartPole-v9': 'CartPole-v9' is not an EnvPool task id \(did you mean CartPole-v1"),
    ({"vectorization": "pettingzoo", "env": "no_such_module"},
     r"env 'no_such_module' is not an importable PettingZoo env module"),
])
def test_env_ids_are_checked_for_their_vectorization(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sebulba.Config(**kwargs)


def test_env_kwargs_the_env_does_not_take_are_an_error_naming_them():
    with pytest.raises(ValueError, match=r"env_kwargs \{'foo': 1\} do not fit env "
                                         r"'CartPole-v1': .*unexpected keyword argument 'foo'"):
        sebulba.Config(env_kwargs={"foo": 1}).env_spec()
