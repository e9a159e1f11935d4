"""Bad env output is an error naming the env, its index, its step and the field, where it
enters the framework (`Config.check_env_output`, `sebulba.envs.output_checks`)."""

from __future__ import annotations

import functools
import importlib.util
import re

import gymnasium as gym
import numpy as np
import pytest

import sebulba
from agents.spg import SPG, SPGConfig
from sebulba.envs import registry
from sebulba.envs.output_checks import BadEnvOutput, BatchCheck, CheckedEnv
from sebulba.types import EnvStep
from tests.envs import BadOutputEnv, FloatFramesEnv

# What each kind of bad output is called, after "env made by BadOutputEnv (env 2 of the 4
# in its group), step 3: ".
NAMED = {
    "four_values": ("step's result", "is 4 values, (array([2., 0., 3.], dtype=float32), "
                    "1.0, False, {}) (tuple): the old gym API's (observation, reward, done, "
                    "info)"),
    "reward_none": ("reward", "is None; expected a real number"),
    "terminated_none": ("terminated", "is None (NoneType); expected a bool"),
    "wrong_shape": ("observation", "has shape (2,), expected (3,) (the observation space's)"),
    "nan_observation": ("observation", "holds nan at index [1]; expected finite values"),
    "inf_reward": ("reward", "is -inf; expected a finite number"),
    # Finite, but inf in the rows' float32.
    "huge_reward": ("reward", "is 1e+39, beyond float32's range"),
    "complex_observation": ("observation", "has dtype complex64, which the observation "
                            "space's float32 cannot hold without changing values"),
    "observation_alone": ("reset's result", "is array([2., 0., 0.], dtype=float32) "
                          "(ndarray); expected gymnasium's pair (observation, info dict)"),
}
BAD_AT = {"observation_alone": 0}  # a reset's output is step 0; the others fail at step 3


def source(vectorization, env, num_envs=4, check=True, env_kwargs=None):
    request = registry.SourceRequest(env, env_kwargs or {}, num_envs, check_env_output=check)
    (made,) = registry.get(vectorization).make_sources(request)
    return made


def step_until_error(made, steps=12, action=None):
    """Steps `made` from a reset; returns the last EnvStep (an error propagates)."""
    try:
        made.reset(seed=0)
        for _ in range(steps):
            ids, env_step, _ = made.recv()
            made.send(np.zeros(len(ids), np.int64) if action is None else action(len(ids)),
                      ids)
        return env_step
    finally:
        made.close()


def expected_message(kind: str, step: int) -> str:
    field, problem = NAMED[kind]
    return (f"env made by BadOutputEnv (env 2 of the 4 in its group), step {step}: "
            f"{field} {problem}")


@pytest.mark.parametrize("kind", sorted(NAMED))
def test_each_bad_output_of_a_sync_env_is_named_where_it_enters(kind):
    step = BAD_AT.get(kind, 3)
    made = source("sync", functools.partial(BadOutputEnv, kind, step, bad_env=2))
    with pytest.raises(BadEnvOutput, match="^" + re.escape(expected_message(kind, step))) as e:
        step_until_error(made)
    assert (e.value.step, e.value.field) == (step, NAMED[kind][0])
    assert e.value.place == "env 2 of the 4 in its group"


@pytest.mark.parametrize("kind", ["four_values", "wrong_shape", "complex_observation"])
@pytest.mark.timeout(120)
def test_async_workers_check_their_env_and_the_error_reaches_the_parent(kind, no_leftovers):
    made = source("async", functools.partial(BadOutputEnv, kind, 3, bad_env=2))
    with pytest.raises(BadEnvOutput, match="^" + re.escape(expected_message(kind, 3))) as e:
        step_until_error(made)
    assert (e.value.step, e.value.field) == (3, NAMED[kind][0])  # attributes survive pickling


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.timeout(120)
def test_floats_for_uint8_frames_are_an_error_checked_or_not_never_zeros(vectorization,
                                                                          no_leftovers):
    """Floats in [0, 1) for a uint8 space: a write that cast them would give zeros."""
    made = source(vectorization, FloatFramesEnv, num_envs=2)
    with pytest.raises(BadEnvOutput, match=re.escape(
            "env 0 of the 2 in its group), step 0: observation has dtype float64, which the "
            "observation space's uint8 cannot hold")):
        step_until_error(made)
    # Unchecked, as gymnasium's sync vector env refuses them, so does an async worker (it
    # wrote zeros), and a single value is no longer broadcast over the space's four.
    for env, error in [(FloatFramesEnv, "Cannot cast"),
                       (functools.partial(FloatFramesEnv, size_one=True),
                        "has 1 values|wrong shape")]:
        with pytest.raises((TypeError, ValueError), match=error):
            step_until_error(source(vectorization, env, num_envs=2, check=False))


def test_float64_observations_of_a_float32_space_pass_the_checks():
    env = gym.make("Pendulum-v1")  # a float32 Box
    float64 = gym.wrappers.TransformObservation(env, lambda o: o.astype(np.float64),
                                                env.observation_space)
    checked = CheckedEnv(float64, "'Pendulum-v1'", 0, 1)
    assert checked.reset(seed=0)[0].dtype == np.float64
    for _ in range(3):
        assert checked.step(np.zeros(1, np.float32))[0].dtype == np.float64


def test_the_reset_after_an_episode_counts_as_a_step():
    # Episodes of 5 steps: steps 1-5, the reset at step 6, the env's 7th step call is step 8.
    made = source("sync", functools.partial(BadOutputEnv, "reward_none", 7, bad_env=2,
                                            episode_length=5))
    with pytest.raises(BadEnvOutput, match=re.escape("in its group), step 8: reward is None")):
        step_until_error(made)


def test_with_the_checks_off_bad_output_passes_silently_and_nothing_checks():
    # What the checks prevent: None becomes a NaN reward, and a False flag.
    for kind, field, silently in [("reward_none", "reward", np.nan),
                                  ("terminated_none", "terminated", False)]:
        made = source("sync", functools.partial(BadOutputEnv, kind, 3, bad_env=2), check=False)
        assert not any(isinstance(env, CheckedEnv) for env in made.vec.envs)
        assert made._check is None
        env_step = step_until_error(made, steps=4)
        np.testing.assert_array_equal(getattr(env_step, field)[2], silently)
    checked = source("sync", functools.partial(BadOutputEnv, "reward_none", 3))
    checked.close()
    assert all(isinstance(env, CheckedEnv) for env in checked.vec.envs)


@pytest.mark.filterwarnings("ignore:.*not within the observation space")
def test_a_real_env_s_nan_observations_are_named():
    # Pendulum with a NaN gravity: its angular velocity is NaN from the first step on.
    made = source("sync", "Pendulum-v1", env_kwargs={"g": float("nan")})
    with pytest.raises(BadEnvOutput, match=re.escape(
            "env 'Pendulum-v1' (env 0 of the 4 in its group), step 1: observation holds nan "
            "at index [")):
        step_until_error(made, action=lambda n: np.zeros((n, 1), np.float32))


@pytest.mark.skipif(importlib.util.find_spec("envpool") is None,
                    reason="vectorization 'envpool' needs the envpool extra")
@pytest.mark.parametrize("env_kwargs,step,problem", [
    # A control cost of infinite weight: the reward is -inf from the first step on.
    ({"ctrl_cost_weight": float("inf")}, 1, "reward is -inf; expected a finite number"),
    # A NaN reset noise: the first observation is NaN.
    ({"reset_noise_scale": float("nan")}, 0,
     "observation holds nan at index [0]; expected finite values"),
])
def test_envpool_s_nan_and_inf_are_named_by_env_and_group(env_kwargs, step, problem):
    request = registry.SourceRequest("HalfCheetah-v4", env_kwargs, group_size=4,
                                     num_groups=2)
    # A pool per group, in turn: group 0 is received first, and its env 0 named.
    (made,) = registry.get("envpool").make_sources(request)
    with pytest.raises(BadEnvOutput, match=re.escape(
            f"env 'HalfCheetah-v4' (env 0 of the 4 in group 0's EnvPool), step {step}: "
            f"{problem}")):
        step_until_error(made, action=lambda n: np.full((n, 6), 0.5, np.float32))
    # One pool of both groups, by id: it returns whichever 4 of its 8 envs are ready
    # first, and of those the one of lowest id is named, by its place in the pool and
    # in its group.
    (made,) = registry.get("envpool_async").make_sources(request)
    with pytest.raises(BadEnvOutput) as raised:
        step_until_error(made, action=lambda n: np.full((n, 6), 0.5, np.float32))
    named = re.fullmatch(
        r"env 'HalfCheetah-v4' \(env (\d) of the 8 in its EnvPool: env (\d) of the pool's "
        r"group (\d)\), step (\d+): (.*)", str(raised.value))
    assert named, str(raised.value)
    env, in_group, group, named_step, named_problem = named.groups()
    assert (int(in_group), int(group)) == (int(env) % 4, int(env) // 4)
    assert (int(named_step), named_problem) == (step, problem)


def test_envs_addressed_by_id_are_counted_one_by_one(monkeypatch):
    """The step of an env whose source returns any of its envs (EnvPool) is its own
    count of outputs, over the folds of the kept ids."""
    monkeypatch.setattr(BatchCheck, "_FOLD", 4)
    space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    check = BatchCheck("'Task-v0'", space, 8, lambda i: f"env {i} of 8")
    rng = np.random.default_rng(0)
    counts = np.zeros(8, int)
    for _ in range(23):  # batches of 3 of the 8 envs, in any order
        ids = rng.choice(8, 3, replace=False)
        check(EnvStep(np.zeros((3, 2), np.float32), np.zeros(3, np.float32), *[None] * 3),
              ids)
        counts[ids] += 1
    ids = np.array([5, 1, 6])
    obs = np.zeros((3, 2), np.float32)
    obs[1, 1] = np.inf
    with pytest.raises(BadEnvOutput, match=re.escape(
            f"env 'Task-v0' (env 1 of 8), step {counts[1]}: observation holds inf at index "
            "[1]; expected finite values")):
        check(EnvStep(obs, np.zeros(3, np.float32), *[None] * 3), ids)
    # Finite values whose sum overflows are no error.
    big = np.full((3, 2), 3e38, np.float32)
    with np.errstate(over="ignore"):
        check(EnvStep(big, np.full(3, 3e38, np.float32), *[None] * 3), ids)


@pytest.mark.parametrize("kind,named", [
    ("reward_none", "agent 'agent_1' of env 1 of the 2 in its group, row 4), step 2: reward "
                    "is None"),
    ("nan_observation", "agent 'agent_1' of env 1 of the 2 in its group, row 4), step 2: "
                        "observation holds nan at index [0]"),
    ("four_values", "env 1 of the 2 in its group), step 2: step's result is 4 values"),
    # The joining agent's reward goes to the team's return only, where no batch check
    # sees it.
    ("joins_with_nan_reward", "agent 'agent_1' of env 1 of the 2 in its group, row 4), "
                              "step 2: reward is nan"),
    ("complex_observation", "agent 'agent_1' of env 1 of the 2 in its group, row 4), step "
                            "2: observation has dtype complex64"),
])
def test_pettingzoo_names_the_agent_and_its_env(kind, named):
    pytest.importorskip("pettingzoo", reason="multi-agent envs need the 'multiagent' extra")
    from sebulba.envs.suite.role_call import RoleCall

    class BadRoleCall(RoleCall):
        """RoleCall whose 2nd step goes wrong for agent_1 of the env seeded 1."""

        def reset(self, seed=None, options=None):
            self.seed_, self.steps = seed if seed is not None else self.seed_, 0
            return super().reset(seed, options)

        def step(self, actions):
            obs, rewards, terms, truncs, infos = super().step(actions)
            self.steps += 1
            if self.steps == 1 and self.seed_ == 1 and kind == "joins_with_nan_reward":
                # agent_1 leaves (truncated) to join again at the next step
                truncs["agent_1"] = True
                self.agents = [a for a in self.agents if a != "agent_1"]
                obs.pop("agent_1", None)
            if self.steps == 2 and self.seed_ == 1:
                if kind == "four_values":
                    return obs, rewards, terms, infos
                if kind == "joins_with_nan_reward":
                    self.agents = sorted([*self.agents, "agent_1"])
                    obs["agent_1"] = np.zeros_like(obs["agent_0"])
                    rewards["agent_1"] = float("nan")
                    return obs, rewards, terms, truncs, infos
                if kind == "reward_none":
                    rewards["agent_1"] = None
                elif kind == "complex_observation":
                    obs["agent_1"] = obs["agent_1"].astype(np.complex64)
                else:
                    obs["agent_1"] = np.full_like(obs["agent_1"], np.nan)
            return obs, rewards, terms, truncs, infos

    made = source("pettingzoo", BadRoleCall, num_envs=2)
    with pytest.raises(BadEnvOutput, match=re.escape(f"env made by {BadRoleCall.__qualname__}"
                                                     f" ({named}")):
        step_until_error(made)


def spg_loop(env, vectorization, **config):
    # Async: one group of 4 worker processes, which start in seconds each on 2 cores.
    groups = 1 if vectorization == "async" else 2
    cfg = sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=8, async_factor=groups,
                         vectorization=vectorization, shutdown_timeout_s=5.0, **config)
    return sebulba.Sebulba(SPG(sebulba.env_spec(env), SPGConfig(hidden_sizes=(16,))), cfg)


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.timeout(180)
def test_a_run_stops_with_the_env_s_bad_output_named(vectorization, no_leftovers):
    # Env 1 of each group returns a reward of None at its step 20 (the third cycle).
    env = functools.partial(BadOutputEnv, "reward_none", 20, bad_env=1)
    with pytest.raises(BadEnvOutput, match="^" + re.escape(
            "env made by BadOutputEnv (env 1 of the 4 in its group), step 20: reward is None")):
        spg_loop(env, vectorization).run(10**9)


@pytest.mark.timeout(180)
def test_without_the_checks_a_nan_observation_is_the_learner_s_nan_loss(no_leftovers):
    env = functools.partial(BadOutputEnv, "nan_observation", 20, bad_env=1)
    with pytest.raises(BadEnvOutput, match=re.escape("step 20: observation holds nan")):
        spg_loop(env, "sync").run(10**9)
    with pytest.raises(FloatingPointError, match="loss is nan"):
        spg_loop(env, "sync", check_env_output=False).run(10**9)


def test_check_env_output_is_a_bool_and_a_launcher_flag():
    with pytest.raises(ValueError, match="check_env_output must be a bool, got 'no'"):
        sebulba.Config(check_env_output="no")
    from absl import flags

    from examples.config_flags import define_run_flags

    flag_values = flags.FlagValues()
    run_flags = define_run_flags(flag_values)
    flag_values(["prog", "--nocheck_env_output"])
    config = sebulba.Config(**run_flags.values())
    assert config.check_env_output is False
    assert config.source_request(1, 0).check_env_output is False
