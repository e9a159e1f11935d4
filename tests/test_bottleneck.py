"""The bottleneck named from stage times: the rules on hand-made stage seconds, then
real runs built to be bound each way (a slow env, a slow learner, a heavy acting
network)."""

from __future__ import annotations

import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import pytest

import sebulba
from sebulba.runtime.accounting import RunResult
from sebulba.runtime.bottleneck import ADVICE, LEARNER_SATURATED, Tracker, diagnose
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv

# A run whose learner waits 80% of the wall and whose 2 inferencer threads spend 80% of
# theirs stepping envs: each test below changes what it is about.
ENV_BOUND = {"env_step": 1.6, "inference": 0.1, "record": 0.1, "shard": 0.1,
             "queue_put": 0.1, "queue_get": 0.8, "update_experience": 0.05, "optimize": 0.15}


# The rules, on hand-made stage seconds.

def test_threads_that_mostly_step_envs_while_the_learner_waits_are_env_bound():
    b = diagnose(ENV_BOUND, 1.0, 2)
    assert b.kind == "env"
    assert b.share == pytest.approx(0.8)  # 1.6 s over 2 threads x 1 s
    assert b.advice == ADVICE["env"] and "async_factor" in b.advice
    assert b.line().startswith("bound by the envs: the inferencer threads spent 80% of their")
    assert "the learner waited for trajectories 80%" in b.line()


def test_the_share_is_per_inferencer_thread():
    # The same seconds from one thread over 2 s of wall are the same 80% of its time.
    assert diagnose(ENV_BOUND, 2.0, 1).share == pytest.approx(0.8)
    # Unknown thread count: the threads' time is what their stages account for (2 s).
    assert diagnose(ENV_BOUND, 1.0).share == pytest.approx(1.6 / 2.0)


def test_acting_and_recording_together_are_inference():
    # None of dispatch (0.3), inference (0.4) and record (0.4) beats env_step (0.7) alone;
    # together they do.
    stages = {**ENV_BOUND, "env_step": 0.7, "dispatch": 0.3, "inference": 0.4,
              "record": 0.4}
    b = diagnose(stages, 1.0, 2)
    assert b.kind == "inference" and b.share == pytest.approx(0.55)
    assert "envs_per_group" in b.advice
    assert diagnose({**stages, "env_step": 1.2}, 1.0, 2).kind == "env"


def test_moving_trajectories_to_the_learner_most_is_queue_bound():
    b = diagnose({**ENV_BOUND, "env_step": 0.3, "shard": 1.4}, 1.0, 2)
    assert b.kind == "queue" and b.share == pytest.approx(0.7)
    assert "steps_per_cycle" in b.advice and "hand-off" in b.line()


def test_threads_waiting_for_the_learner_more_than_it_waits_for_them_is_learner_bound():
    stages = {**ENV_BOUND, "env_step": 0.4, "queue_put": 1.2, "queue_get": 0.3}
    b = diagnose(stages, 1.0, 2)
    assert b.kind == "learner"
    assert b.share == pytest.approx(0.7)  # busy: all but its 30% waiting
    assert "trajectories_per_update" in b.advice
    assert "waited for it 60% of theirs" in b.line()
    # lockstep's waits for the networks are waits for the learner as well
    stages = {**stages, "queue_put": 0.0, "wait_for_networks": 1.2}
    assert diagnose(stages, 1.0, 2).kind == "learner"


def test_the_boundary_between_learner_and_threads_is_where_their_waits_are_equal():
    # threads wait 0.4 s of their 2 s (20%); the learner 20% of its 1 s, then just over.
    at = {**ENV_BOUND, "queue_put": 0.4, "queue_get": 0.2}
    assert diagnose(at, 1.0, 2).kind == "learner"
    assert diagnose({**at, "queue_get": 0.2001}, 1.0, 2).kind == "env"


def test_a_learner_that_almost_never_waits_bounds_the_run_though_no_thread_waits():
    # drop_when_full: the threads never wait for room; the learner's not waiting is the sign
    stages = {**ENV_BOUND, "queue_put": 0.0}
    just_under = diagnose({**stages, "queue_get": LEARNER_SATURATED * 0.99}, 1.0, 2)
    assert just_under.kind == "learner"
    assert just_under.share == pytest.approx(1 - LEARNER_SATURATED * 0.99)
    assert diagnose({**stages, "queue_get": LEARNER_SATURATED * 1.01}, 1.0, 2).kind == "env"


def test_a_run_without_learning_is_judged_by_its_threads():
    # learn=False: the learner only takes trajectories (no update stages)
    stages = {"env_step": 0.3, "inference": 1.2, "record": 0.2, "shard": 0.1,
              "queue_get": 0.9}
    b = diagnose(stages, 1.0, 2)
    assert b.kind == "inference" and b.share == pytest.approx(0.7)


@pytest.mark.parametrize("stages,wall,why", [
    (ENV_BOUND, 0.0, "no wall time"),
    ({}, 1.0, "no stage"),
    ({"queue_get": 1.0, "optimize": 0.5}, 1.0, "no stage"),  # no cycle flushed yet
    ({"env_step": 1.0, "shard": 0.1}, 1.0, "no trajectory"),  # the learner took none
    ({"env_step": 0.0, "queue_get": 0.0, "rendering": 3.0}, 1.0, "no stage"),
])
def test_without_seconds_from_both_sides_there_is_no_verdict(stages, wall, why):
    b = diagnose(stages, wall, 1)
    assert b.kind == "undetermined" and b.share == 0.0 and b.advice == ""
    assert why in b.line() and b.short() == "?"


def test_shares_stay_fractions_and_unknown_stages_are_left_out():
    # a thread's last cycle is flushed after the wall is read: seconds over the wall
    b = diagnose({**ENV_BOUND, "env_step": 2.5, "evaluate": 100.0}, 1.0, 2)
    assert b.kind == "env" and b.share == 1.0
    assert diagnose({**ENV_BOUND, "evaluate": 100.0}, 1.0, 2) == diagnose(ENV_BOUND, 1.0, 2)


@pytest.mark.parametrize("stages,wall,threads,named", [
    (ENV_BOUND, -1.0, 2, "wall_seconds"),
    (ENV_BOUND, math.nan, 2, "wall_seconds"),
    (ENV_BOUND, math.inf, 2, "wall_seconds"),
    (ENV_BOUND, 1.0, 0, "inferencer_threads"),
    (ENV_BOUND, 1.0, True, "inferencer_threads"),
    (ENV_BOUND, 1.0, 1.5, "inferencer_threads"),
    ({**ENV_BOUND, "shard": -0.1}, 1.0, 2, "stage_seconds['shard']"),
    ({**ENV_BOUND, "optimize": math.nan}, 1.0, 2, "stage_seconds['optimize']"),
])
def test_bad_input_is_an_error_naming_it(stages, wall, threads, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        diagnose(stages, wall, threads)


def test_the_summary_and_the_figures_carry_the_verdict():
    result = RunResult(
        env_steps=100, consumed=100, dropped=0, in_flight=0, wall_seconds=1.0, episodes=[],
        policy_lags=[], stage_seconds=ENV_BOUND, learner_updates=1, metrics={},
        inferencer_threads=2)
    d = result.as_dict()
    assert d["bottleneck"] == {"kind": "env", "share": 0.8, "advice": ADVICE["env"]}
    json.dumps(d)
    assert diagnose(ENV_BOUND, 1.0, 2).line() in result.summary().splitlines()
    empty = RunResult(
        env_steps=0, consumed=0, dropped=0, in_flight=0, wall_seconds=0.0, episodes=[],
        policy_lags=[], stage_seconds={}, learner_updates=0, metrics={})
    assert empty.as_dict()["bottleneck"]["kind"] == "undetermined"
    assert "bottleneck undetermined: no wall time" in empty.summary()


def test_the_tracker_judges_the_seconds_since_its_first_call():
    now = [10.0]
    tracker = Tracker(clock=lambda: now[0])
    # Before its first call the learner waited 5 s for the first trajectory (compiling):
    # left out, or the run would look bound by its threads.
    seconds = {"env_step": 0.5, "queue_get": 5.0, "optimize": 0.1}
    assert tracker(seconds).kind == "undetermined"
    now[0] = 12.0  # 2 s later: the learner busy all along, the thread waiting for it
    seconds.update(env_step=0.9, queue_put=1.2, record=0.1, optimize=2.0, queue_get=5.04)
    b = tracker(seconds)
    assert b.kind == "learner" and b.share == pytest.approx(0.98)  # 1 - 0.04 s / 2 s
    assert b.short() == "learner 98%"
    # the thread's time is what its stages account for: 1.2 s waiting of its 1.7 s
    assert "waited for it 71% of theirs" in b.line()
    # The figures of a next run (a fresh Accounting: its stages behind these) start it
    # again, as the first call did, rather than fail on negative seconds.
    now[0] = 20.0
    assert tracker({"env_step": 0.2, "queue_get": 1.0}).kind == "undetermined"
    now[0] = 21.0
    again = tracker({"env_step": 0.25, "queue_put": 0.8, "queue_get": 1.02, "optimize": 0.9})
    assert again.kind == "learner" and again.share == pytest.approx(0.98)


# Real runs on the CPU, each built to be bound one way. Each loop runs once to compile,
# then the run judged.

STEP_SECONDS = 0.003


class SlowCountingEnv(CountingEnv):
    """A counting env whose every step takes `STEP_SECONDS` (the sleep frees the GIL, as
    an env in a worker process or EnvPool does)."""

    def step(self, action):
        time.sleep(STEP_SECONDS)
        return super().step(action)


WIDTH, LAYERS = 512, 6


def mlp(layers: jax.Array, h: jax.Array) -> jax.Array:
    for i in range(LAYERS):
        h = jnp.tanh(h @ layers[i])
    return h


def mlp_networks(key) -> dict[str, jax.Array]:
    return {"w": jnp.ones(()),
            "layers": jax.random.normal(key, (LAYERS, WIDTH, WIDTH)) / math.sqrt(WIDTH)}


class SlowLearnerAgent(CountingAgent):
    """Learns a deep, wide MLP on a batch of 64 rows, 4 optimizer steps an update, while
    it acts as the counting agent does: its learner takes far longer than a cycle."""

    def new_networks(self, key):
        return mlp_networks(key)

    def num_off_policy_optims_per_cycle(self) -> int:
        return 4

    def loss(self, nets, opt, experience):
        loss, aux = super().loss(nets, opt, experience)
        return loss + jnp.mean(jnp.square(mlp(nets["layers"], jnp.ones((64, WIDTH))))), aux


class HeavyActingAgent(CountingAgent):
    """Acts through a deep, wide MLP (the action depends on it, so none of it is left
    out), while its learner stays the counting agent's: a large acting network on a fast
    env."""

    def new_networks(self, key):
        return mlp_networks(key)

    def step(self, step_state, nets, env_step):
        output, new_state = super().step(step_state, nets, env_step)
        h = mlp(nets["layers"], jnp.tile(env_step.obs, (1, WIDTH // 3 + 1))[:, :WIDTH])
        action = (h[:, 0] > 2.0).astype(jnp.int32)  # tanh never exceeds 1: always 0
        return output._replace(action=action), new_state


def judged_run(agent_cls, env, cycles_per_group, **config):
    """The result of a run of `cycles_per_group` cycles per group after one that compiles,
    and the tracker's verdict at its last update."""
    cfg = sebulba.Config(env=env, **{"envs_per_group": 4, "steps_per_cycle": 4, **config})
    loop = sebulba.Sebulba(agent_cls(sebulba.env_spec(env)), cfg)
    per_cycle = cfg.num_groups * cfg.envs_per_group * cfg.steps_per_cycle
    loop.run(2 * per_cycle)
    tracker, live = Tracker(), []
    result = loop.run(cycles_per_group * per_cycle,
                      on_update=lambda info: live.append(tracker(info.accounting.stage_seconds)))
    return result, live[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("agent,env,run,kind,words", [
    # a slow env: 5 ms a step, two groups stepping
    (CountingAgent, functools.partial(SlowCountingEnv, 5),
     {"cycles_per_group": 25, "envs_per_group": 2, "async_factor": 2}, "env",
     ["bound by the envs", "async_factor"]),
    (SlowLearnerAgent, functools.partial(CountingEnv, 5),
     {"cycles_per_group": 12, "async_factor": 1}, "learner", ["bound by the learner"]),
    (HeavyActingAgent, functools.partial(CountingEnv, 5),
     {"cycles_per_group": 30, "async_factor": 1}, "inference", []),
], ids=["slow_env", "slow_learner", "heavy_acting_network"])
def test_runs_built_to_be_bound_each_way_are_named(agent, env, run, kind, words,
                                                   no_leftovers):
    result, live = judged_run(agent, env, **run)
    # Each part of an env step's path is timed on its own.
    assert all(result.stage_seconds[s] > 0 for s in
               ("env_step", "dispatch", "inference", "record", "shard")), result.stage_seconds
    d = result.as_dict()["bottleneck"]
    assert d["kind"] == kind, result.summary()
    assert d["share"] > 0.5, result.summary()
    for word in words:
        assert word in result.summary()
    assert live.kind == kind, (live, result.summary())
