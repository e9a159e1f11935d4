"""The launcher's flags come from the config dataclasses: one per field, with its default.

A field of `sebulba.Config` or of a registered agent's config without a launcher flag, or
with a flag whose default is not the field's, fails here.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re

import pytest
from absl import flags

import sebulba
from agents.registry import AGENTS
from examples import train  # defines the launcher's flags in absl's FLAGS
from examples.config_flags import (
    FlagConversion,
    attribute_docs,
    define_config_flags,
    define_run_flags,
    field_default,
)
from sebulba.envs import registry


def test_every_config_field_is_a_launcher_flag_with_configs_default_and_doc():
    docs = attribute_docs(sebulba.Config)
    fields = dataclasses.fields(sebulba.Config)
    missing = [f.name for f in fields if f.name not in flags.FLAGS]
    assert not missing, f"Config fields without a launcher flag: {missing}"
    assert set(train._RUN_FLAGS.holders) == {f.name for f in fields}
    defaults = train._RUN_FLAGS.defaults()
    for field in fields:
        assert train._RUN_FLAGS.flag_name(field.name) == field.name  # no prefix
        assert defaults[field.name] == field_default(sebulba.Config, field), field.name
        assert docs[field.name] and docs[field.name] in flags.FLAGS[field.name].help
    assert sebulba.Config(**defaults) == sebulba.Config()


def test_every_agent_config_field_is_a_launcher_flag_with_its_default():
    for agent, entry in AGENTS.items():
        docs = attribute_docs(entry.config_class)
        agent_flags = train._AGENT_FLAGS[agent]
        defaults = agent_flags.defaults()
        for field in dataclasses.fields(entry.config_class):
            name = f"{agent}_{field.name}"
            assert name in flags.FLAGS, f"{entry.config_class.__name__}.{field.name}: no --{name}"
            assert agent_flags.flag_name(field.name) == name
            assert defaults[field.name] == field_default(entry.config_class, field), name
            assert field.name in docs, f"{entry.config_class.__name__}.{field.name}: no doc"
        assert entry.config_class(**defaults) == entry.config_class()


def test_the_old_hand_written_flags_are_gone():
    assert "num_envs" not in flags.FLAGS  # it is --envs_per_group


def _run_flags(*argv: str):
    flag_values = flags.FlagValues()
    run_flags = define_run_flags(flag_values)
    flag_values(["prog", *argv])
    return run_flags


def test_flags_set_every_kind_of_config_field():
    values = _run_flags(
        "--env=Acrobot-v1", '--env_kwargs={"max_episode_steps": 50}', "--envs_per_group=4",
        "--vectorization=async", "--async_factor=1", "--steps_per_cycle=8",
        "--inference_devices=1", "--learner_devices=0,1", "--queue_capacity=3",
        "--drop_when_full", "--nocheck_finite", "--async_context=forkserver",
        "--shutdown_timeout_s=2.5", "--seed=7", "--desync_episodes",
        "--trajectories_per_update=2", "--lockstep", "--action_poll_s=0.001",
        "--transfer_guard", "--nostack_frames_on_device", "--nocheck_env_output",
        "--eval_every_updates=5",
        "--eval_episodes=3", "--noeval_greedy", "--eval_device=1", "--eval_max_share=0.1",
        "--eval_video_dir=/tmp/videos", "--eval_video_every=4",
        "--env_wrappers=ClipReward(max_reward=0.5), TimeAwareObservation").values()
    assert values == {
        "env": "Acrobot-v1", "env_kwargs": {"max_episode_steps": 50}, "envs_per_group": 4,
        "vectorization": "async", "async_factor": 1, "steps_per_cycle": 8,
        "inference_devices": [1], "learner_devices": [0, 1], "queue_capacity": 3,
        "drop_when_full": True, "check_finite": False, "async_context": "forkserver",
        "shutdown_timeout_s": 2.5, "seed": 7, "desync_episodes": True,
        "trajectories_per_update": 2, "agent_ids": False, "lockstep": True,
        "action_poll_s": 0.001, "transfer_guard": True, "stack_frames_on_device": False,
        "check_env_output": False,
        "eval_every_updates": 5, "eval_episodes": 3, "eval_greedy": False, "eval_device": 1,
        "eval_max_share": 0.1, "eval_video_dir": "/tmp/videos", "eval_video_every": 4,
        "env_wrappers": ("ClipReward(max_reward=0.5)", "TimeAwareObservation")}
    assert {f.name for f in dataclasses.fields(sebulba.Config)} == set(values)
    # Every value as parsed, but one learner update per trajectory: lockstep refuses drops
    # when an update waits for several.
    config = sebulba.Config(**{**values, "trajectories_per_update": 1})
    assert config.resolved_global_learner_devices()[1] == config.resolved_inference_devices()[0]


@pytest.mark.parametrize("argv,message", [
    (["--env_kwargs={bad"], "--env_kwargs must be a JSON object, got '{bad'"),
    (["--env_kwargs=[1, 2]"], "--env_kwargs must be a JSON object, got '[1, 2]'"),
    (["--inference_devices=0,x"], "--inference_devices must be comma-separated local device"),
    (["--learner_devices="], "--learner_devices must name at least one local device index"),
    (["--env_wrappers=FrameStack(4)"], "--env_wrappers: 'FrameStack' is not a wrapper in "
                                       "gymnasium.wrappers; did you mean FrameStackObservation?"),
    (["--env_wrappers=FrameStackObservation(size=4)"],
     "--env_wrappers: 'FrameStackObservation(size=4)' does not fit "
     "FrameStackObservation(stack_size, *, padding_type='reset'): "),
    (["--env_wrappers=FlattenObservation;ClipReward"],
     "--env_wrappers 'FlattenObservation;ClipReward' is not a comma-separated list"),
])
def test_bad_values_are_errors_naming_the_flag(argv, message):
    run_flags = _run_flags(*argv)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        run_flags.values()


@pytest.mark.parametrize("argv", [["--vectorization=threads"], ["--async_context=nope"],
                                  ["--envs_per_group=many"], ["--drop_when_full=maybe"]])
def test_bad_enum_and_typed_values_fail_when_flags_are_parsed(argv):
    with pytest.raises(flags.IllegalFlagValueError):
        _run_flags(*argv)


def test_enums_offer_the_configs_choices():
    flag_values = flags.FlagValues()
    define_run_flags(flag_values)
    assert tuple(flag_values["vectorization"].parser.enum_values) == registry.names()
    assert set(flag_values["async_context"].parser.enum_values) == set(
        multiprocessing.get_all_start_methods())


def test_a_field_with_no_flag_type_is_an_error_unless_given_a_conversion():
    @dataclasses.dataclass(frozen=True)
    class WithCallable:
        """A config with a callable.

        Attributes:
          size: how many.
          reward_fn: maps a reward, e.g. to its sign;
            from the command line one of a few names.
        """

        size: int = 3
        reward_fn: object = abs

    with pytest.raises(TypeError, match="WithCallable.reward_fn: no flag type"):
        define_config_flags("x", WithCallable, flag_values=flags.FlagValues())
    by_name = {"abs": abs, "round": round}
    conversion = FlagConversion(
        define=lambda name, default, help, **kw: flags.DEFINE_enum(
            name, default.__name__, sorted(by_name), help, **kw),
        parse=lambda flag_name, value: by_name[value])
    flag_values = flags.FlagValues()
    x_flags = define_config_flags("x", WithCallable, conversions={"reward_fn": conversion},
                                  flag_values=flag_values)
    flag_values(["prog", "--x_reward_fn=round", "--x_size=5"])
    assert x_flags.config() == WithCallable(size=5, reward_fn=round)
    assert x_flags.defaults() == {"size": 3, "reward_fn": abs}
    assert flag_values["x_reward_fn"].help == (
        "<abs|round>: X: maps a reward, e.g. to its sign; "
        "from the command line one of a few names.")
