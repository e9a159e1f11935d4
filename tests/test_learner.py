"""The learner: compiles once, publishes networks that inferencers use, reports its figures."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch

import sebulba
from sebulba.runtime import learner, sharding, transfers
from sebulba.runtime.preemption import StopEvent
from tests.counting_agent import CountingAgent, CountingStepState
from tests.envs import CountingEnv, HangingEnv

COUNTING = functools.partial(CountingEnv, 5)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counting_loop(agent_cls=CountingAgent, **config):
    cfg = sebulba.Config(env=COUNTING, **{"envs_per_group": 4, "steps_per_cycle": 3, **config})
    return sebulba.Sebulba(agent_cls(sebulba.env_spec(COUNTING)), cfg)


@pytest.mark.timeout(120)
def test_nothing_recompiles_after_the_first_cycles(no_leftovers):
    compiles = []

    def listener(event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(kwargs.get("fun_name", event))  # names it in a failure

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        loop = counting_loop(inference_devices=[0, 1], learner_devices=[2, 3])
        loop.run(2 * 4 * 3 * 4)  # a few cycles of each of the 4 groups
        # Once per inference device, although the agent's first step state is weakly
        # typed (jnp.full(n, -1.0)) and the ones its step returns are not.
        assert compiles.count("jit(_act_all)") == 2, compiles
        compiles.clear()
        result = loop.run(30 * 4 * 3 * 4)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert result.learner_updates >= 30
    assert compiles == []


class RecordsNets(CountingAgent):
    """Keeps in its step state the network weight it last acted with."""

    def step(self, step_state, nets, env_step):
        output, state = super().step(step_state, nets, env_step)
        return output, state._replace(last_id=jnp.broadcast_to(nets["w"], state.last_id.shape))


@pytest.mark.timeout(120)
def test_inferencers_act_with_published_networks(no_leftovers):
    result = counting_loop(RecordsNets, async_factor=2).run(40 * 4 * 3)
    w_learner = float(result.state.nets["w"])
    w_acting = np.asarray(result.state.step_state.last_id)
    assert w_learner < 0.7  # 40 sgd steps on w**2 from 1.0: 0.98**40 = 0.45
    # The acting weights come from publications: below the initial 1.0, not behind the
    # learner by more than the updates a full queue and the cycles in progress account for.
    assert (w_acting < 0.99).all()
    assert (w_acting >= w_learner - 1e-6).all()
    # Lags are in learner updates: a full queue (2 items) and the other group's cycles
    # while this one acts account for a few; a thread starved under load (other tests,
    # other processes on the cores) sees more now and then (26 once), so the typical lag
    # is what is bounded.
    lags = np.asarray(result.policy_lags)
    assert lags.min() >= 0 and np.median(lags) <= 2 * 2 + 2 and lags.mean() <= 2 * 2 + 2


class PublishesItsProgress(CountingAgent):
    """Publishes the learner's update count with the networks; acts by recording it."""

    def acting_nets(self, nets, learner_updates):
        return {"w": nets["w"], "updates": learner_updates}

    def step(self, step_state, nets, env_step):
        output, state = super().step(step_state, {"w": nets["w"]}, env_step)
        seen = jnp.broadcast_to(nets["updates"].astype(jnp.float32), state.last_id.shape)
        return output, state._replace(last_id=seen)


@pytest.mark.timeout(120)
def test_actors_see_what_acting_nets_publishes_with_the_learner_updates(no_leftovers):
    published = []

    def on_update(info):
        published.append((info.version, int(info.nets["updates"]), set(info.nets)))

    result = counting_loop(PublishesItsProgress, async_factor=2).run(30 * 4 * 3,
                                                                     on_update=on_update)
    assert [(v, u) for v, u, _ in published] == [(v, v) for v in range(1, 31)]
    assert all(keys == {"w", "updates"} for _, _, keys in published)
    # The env groups acted last with published update counts (whole numbers the learner
    # reached), a few updates behind. A thread starved by a loaded machine can fall
    # further behind (CI saw 8), or never have a trajectory consumed in so short a run
    # (its group still at the initial 0; seen once beside other tests' processes), so
    # the lag bound is on the typical env and the typical lag.
    seen = np.asarray(result.state.step_state.last_id)
    assert (seen == np.round(seen)).all() and seen.max() <= 30
    assert np.median(seen) >= 30 - 4 * (2 * 2 + 2)
    assert np.median(result.policy_lags) <= 2 * 2 + 2


class LearnsWithoutOptimizerSteps(PublishesItsProgress):
    def optimizer_steps_per_update(self, layout):
        return 0


@pytest.mark.timeout(120)
def test_an_agent_without_optimizer_steps_still_publishes_each_update(no_leftovers):
    # (one that learns in its statistics or experience alone): its actors must not act
    # with the first networks for the whole run.
    result = counting_loop(LearnsWithoutOptimizerSteps).run(30 * 4 * 3)
    assert result.learner_updates == 30 and result.optimizer_steps == 0
    assert np.asarray(result.state.step_state.last_id).min() > 0


class NeverReady(CountingAgent):
    def ready_to_learn(self, experience):
        return experience.size > 10**6


@pytest.mark.timeout(120)
def test_updates_are_skipped_until_the_agent_is_ready(no_leftovers):
    result = counting_loop(NeverReady).run(10 * 4 * 3)
    assert result.learner_updates == 10 and result.optimizer_steps == 10
    assert float(result.state.nets["w"]) == 1.0  # no optimizer step ran
    assert result.metrics["learning"] == 0.0 and result.metrics["loss"] == 0.0
    assert int(result.state.experience.size) == 10  # the trajectories still arrived


class ReportsAConstant(CountingAgent):
    """Learns from its third update on; one metric is a constant, the same on every
    learner device, beside the loss's per-device values."""

    def ready_to_learn(self, experience):
        return experience.size >= 3

    def loss(self, nets, opt, experience):
        loss, (experience, metrics) = super().loss(nets, opt, experience)
        return loss, (experience, {**metrics, "constant": jnp.float32(2.0)})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("learner_devices", [[0], [0, 1]])
def test_a_metric_that_is_a_constant_is_reported_where_learning_waits(
        learner_devices, no_leftovers):
    # The skipped updates' zeros and the learning updates' metrics are one type per
    # device mesh (R2D2 with normalize_rewards=False reports a reward scale of 1.0).
    result = counting_loop(ReportsAConstant, learner_devices=learner_devices,
                           envs_per_group=4 * len(learner_devices)).run(
        6 * 4 * len(learner_devices) * 3)
    assert result.learner_updates == 6 and result.optimizer_steps == 6
    assert result.metrics["learning"] == 1.0 and result.metrics["constant"] == 2.0
    assert float(result.state.nets["w"]) < 1.0  # four optimizer steps ran


@pytest.mark.timeout(120)
def test_a_set_stop_event_ends_the_run_after_the_update_under_way(no_leftovers):
    stop = threading.Event()

    def on_update(info):
        if info.version == 3:
            stop.set()

    loop = counting_loop(async_factor=2)
    result = loop.run(10**9, on_update=on_update, stop=stop)
    assert result.stopped_early and result.as_dict()["stopped_early"]
    assert result.learner_updates == 3 and result.consumed == 3 * 4 * 3
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    # the loop runs again afterwards, to its step count, when the event is clear
    stop.clear()
    again = loop.run(2 * 4 * 3, result.state, stop=stop)
    assert not again.stopped_early and again.learner_updates == 2


@pytest.mark.timeout(120)
def test_a_stop_in_the_last_update_ends_nothing_early(no_leftovers):
    """Every step consumed: not stopped early (a launcher would exit as preempted, and
    its requeued run find nothing to do); on_stop (a preempted run's save) still runs
    before the shutdown, within the grace, as for any stop the learner saw."""
    stop, stops = threading.Event(), []

    def on_update(info):
        if info.version == 4:
            stop.set()

    result = counting_loop().run(4 * 4 * 3, on_update=on_update, stop=stop,
                                 on_stop=lambda: stops.append(1))
    assert result.learner_updates == 4 and result.consumed == 4 * 4 * 3
    assert not result.stopped_early and stops == [1]
    # Without a stop, no on_stop.
    again = counting_loop().run(4 * 4 * 3, on_stop=lambda: stops.append(2))
    assert not again.stopped_early and stops == [1]


@pytest.mark.timeout(120)
def test_the_runs_wall_time_ends_with_its_last_update(no_leftovers):
    """Not with on_stop (a preempted run's save) or the shutdown: throughput and the
    bottleneck verdict divide by it."""
    stop, seen = threading.Event(), {}

    def on_update(info):
        if info.version == 2:
            stop.set()

    def on_stop():
        seen["on_stop"] = time.perf_counter()
        time.sleep(1.0)

    start = time.perf_counter()
    result = counting_loop().run(10**9, on_update=on_update, stop=stop, on_stop=on_stop)
    assert result.stopped_early and result.learner_updates == 2
    assert 0 < result.wall_seconds < seen["on_stop"] - start
    # The rate counts the steps within that time, not those taken during on_stop.
    assert 0 < result.timed_env_steps <= result.env_steps
    assert result.steps_per_second == pytest.approx(
        result.timed_env_steps / result.wall_seconds)


@pytest.mark.timeout(120)
def test_a_stop_while_the_learner_waits_calls_on_stop_before_the_shutdown(no_leftovers):
    """A preempted run saves in on_stop: when the stop comes while the learner waits for
    a trajectory (here: its env's step hangs), on_stop runs while the inferencer thread
    is still there, not after the shutdown's waits."""
    HangingEnv.release.clear()
    HangingEnv.hanging.clear()
    stop, seen = threading.Event(), {}

    def stop_once_hanging():
        if HangingEnv.hanging.wait(60):
            time.sleep(0.2)  # the learner is waiting for the trajectory by now
            stop.set()

    def on_stop():
        seen["alive"] = [t.name for t in threading.enumerate()
                         if t.name.startswith("sebulba-inferencer")]
        seen["updates"] = seen.get("last")
        HangingEnv.release.set()  # lets the thread reach the stop

    def on_update(info):
        seen["last"] = info.version

    watcher = threading.Thread(target=stop_once_hanging)
    watcher.start()
    try:
        env = functools.partial(HangingEnv, 20)
        loop = sebulba.Sebulba(CountingAgent(sebulba.env_spec(env)), sebulba.Config(
            env=env, envs_per_group=4, steps_per_cycle=3, async_factor=1,
            shutdown_timeout_s=5.0))
        result = loop.run(10**9, on_update=on_update, stop=stop, on_stop=on_stop)
    finally:
        HangingEnv.release.set()
        watcher.join()
        HangingEnv.release.clear()
    assert result.stopped_early
    assert seen["alive"] == ["sebulba-inferencer-0"]
    # on_stop came after the last update (its env hung in its 20th step: a few updates)
    assert seen["updates"] == result.learner_updates >= 3


@pytest.mark.timeout(120)
def test_run_reports_accounting_and_stage_times(no_leftovers):
    result = counting_loop(async_factor=2).run(20 * 4 * 3)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    assert result.consumed == 20 * 4 * 3
    assert result.learner_updates == 20
    d = result.as_dict()
    json.dumps(d)
    for stage in ("env_step", "inference", "shard", "queue_get", "update_experience",
                  "optimize"):
        # Unrounded: as_dict's milliseconds can round a fast stage (the counting agent's
        # inference, ~1 us a step) down to 0.
        assert result.stage_seconds[stage] > 0, stage
        assert stage in d["stage_seconds"], stage
    assert d["episodes"] == len(result.episodes) > 0
    assert all(length == 5 and ret == 5.0 for _, ret, length in result.episodes)
    assert "env steps" in result.summary() and "policy lag" in result.summary()


def test_shard_env_axis_splits_per_env_leaves_and_replicates_scalars():
    devices = jax.devices()[1:3]
    tree = {"x": jnp.arange(8.0).reshape(4, 2), "key": jax.random.key(3), "n": jnp.int32(7)}
    sharded = sharding.shard_env_axis(tree, devices)
    assert sharded["x"].shape == (2, 2, 2)
    assert sharded["n"].shape == (2,)
    assert {s.device for s in sharded["x"].addressable_shards} == set(devices)
    np.testing.assert_array_equal(sharded["x"][1], [[4.0, 5.0], [6.0, 7.0]])
    np.testing.assert_array_equal(sharded["n"], [7, 7])
    assert jax.random.key_data(sharded["key"]).shape == (2, 2)
    back = sharding.unshard_env_axis(sharded)
    np.testing.assert_array_equal(back["x"], tree["x"])
    assert int(back["n"]) == 7


@pytest.mark.parametrize("device", [0, 1])
def test_a_one_device_mesh_gets_what_a_transfer_per_device_gives(device):
    """The one-call placements (the learner mesh one device of one process) match the
    general path's arrays: shapes, values, sharding, keys; from the mesh's own device and
    from another (the general path then), and from host arrays with and without the
    transfer guard (which disallows the one call's implicit transfer)."""
    mesh = jax.devices()[device:device + 1]
    tree = {"x": jax.device_put(jnp.arange(8.0).reshape(4, 2), jax.devices()[0]),
            "key": jax.device_put(jax.random.key(3), jax.devices()[0]),
            "n": jax.device_put(jnp.int32(7), jax.devices()[0])}
    host = {"obs": np.arange(24, dtype=np.float32).reshape(4, 3, 2),
            "done": np.array([[True], [False], [True], [False]])}
    expected_sharding = sharding.learner_sharding(mesh)
    placed = [sharding.shard_env_axis(tree, mesh), sharding.shard_host_env_axis(host, mesh)]
    with transfers.guarded("test"):
        placed.append(sharding.shard_host_env_axis(host, mesh))
    for out, source in zip(placed, [tree, host, host], strict=True):
        for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(source), strict=True):
            assert x.sharding.is_equivalent_to(expected_sharding, x.ndim)
            assert x.shape == (1,) + y.shape
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y))
    back = sharding.unshard_env_axis(placed[0])
    np.testing.assert_array_equal(back["x"], tree["x"])
    assert int(back["n"]) == 7


def test_default_shard_step_state_rejects_indivisible_env_axis():
    agent = CountingAgent(sebulba.env_spec(COUNTING))
    state = CountingStepState(jnp.zeros(3, jnp.int32), jnp.zeros(3))
    with pytest.raises(ValueError, match="has 3 envs, not divisible by 2"):
        agent.shard_step_state(state, jax.devices()[:2])


@pytest.mark.timeout(60)
def test_combine_partitions_takes_none_leaves_and_subtrees_from_the_other_part():
    online = {"w": jnp.ones(2), "b": jnp.zeros(1)}
    target = {"w": 2 * jnp.ones(2), "b": jnp.ones(1)}
    diff = {"online": online, "target": None}
    fixed = {"online": None, "target": target}
    nets = sebulba.combine_partitions(diff, fixed)
    assert nets["online"] is online and nets["target"] is target
    leafwise = sebulba.combine_partitions({"a": jnp.ones(1), "b": None},
                                          {"a": None, "b": jnp.zeros(1)})
    assert float(leafwise["a"][0]) == 1.0 and float(leafwise["b"][0]) == 0.0
    with pytest.raises(ValueError, match="both partitions hold a value"):
        sebulba.combine_partitions({"a": jnp.ones(1)}, {"a": jnp.ones(1)})


class ManySteps(CountingAgent):
    """64 optimizer steps per update, each a conditional with collectives inside."""

    def num_off_policy_optims_per_cycle(self):
        return 64

    def ready_to_learn(self, experience):
        return experience.size >= 0

    def new_networks(self, key):
        return {"w": jnp.full((128, 128), 0.01)}

    def step(self, step_state, nets, env_step):
        return super().step(step_state, {"w": nets["w"][0, 0]}, env_step)

    def loss(self, nets, opt, experience):
        # Big enough that the device runs behind the host's dispatching.
        x = jnp.ones((512, 128))
        return jnp.mean(jnp.tanh(x @ nets["w"] @ nets["w"]) ** 2), (experience, {})


MANY_STEPS_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import functools, sebulba
from tests.envs import CountingEnv
from tests.test_learner import ManySteps
env = functools.partial(CountingEnv, 5)
cfg = sebulba.Config(env=env, envs_per_group=4, steps_per_cycle=3, learner_devices=[0, 1])
result = sebulba.Sebulba(ManySteps(sebulba.env_spec(env)), cfg).run(6 * 4 * 3)
print("optimizer steps", result.optimizer_steps, float(result.state.nets["w"][0, 0]))
"""


@pytest.mark.timeout(120)
def test_many_optimizer_steps_per_update_across_devices_do_not_hang():
    # With exactly 2 simulated devices (the notebooks' setting), XLA:CPU hangs, then
    # aborts on an all-reduce timeout, once ~37 programs with collectives inside a
    # conditional are queued. The learner bounds its queue (MAX_QUEUED_STEPS), so 64
    # such steps per update run through. A subprocess: the suite's JAX has 4 devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", MANY_STEPS_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    steps, w = done.stdout.split()[-2:]
    assert int(steps) == 6 * 64 and float(w) < 0.01  # the steps ran


@pytest.mark.parametrize("learners", [1, 2])
def test_the_learner_state_for_a_checkpoint_outlives_the_next_updates_donation(learners):
    # `UpdateInfo.learner_state()` hands the local experience over (to a save that may
    # run later); the learner's next update donates the buffers it was taken from.
    devices = jax.devices()[:learners]
    mesh = jax.sharding.Mesh(np.array(devices), ("learners",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("learners"))
    experience = jax.device_put(jnp.arange(learners * 3.0).reshape(learners, 3), spec)
    copied = sharding.local_entries(experience)
    jax.jit(lambda x: x + 1, donate_argnums=0)(experience)
    assert experience.is_deleted()
    np.testing.assert_array_equal(copied, np.arange(learners * 3.0).reshape(learners, 3))


@pytest.mark.timeout(60)
def test_a_learner_that_fails_to_start_leaves_no_watchdog_behind(monkeypatch, no_leftovers):
    # The watchdog of a run of several processes starts before the learner (whose start
    # is collective); were it left running after the start failed, it would end the
    # process minutes later, whatever the caller did with the error.
    loop = counting_loop()
    loop.num_processes = 2  # as in a cluster: the watchdog is started

    def fail(*args, **kwargs):
        raise RuntimeError("the learner could not start")

    monkeypatch.setattr(loop.learner, "start", fail)
    with pytest.raises(RuntimeError, match="the learner could not start"):
        loop.run(64)


class CompilesSlowly(CountingAgent):
    """`steps` optimizer steps of `step_s` per update, but the run's first takes `first_s`
    (as the XLA compilation of a run's first update does) and, as it starts, sets `stop`
    with `deadline_s` to its deadline: a SIGTERM that comes during the compilation."""

    def __init__(self, env_spec, steps: int, step_s: float, first_s: float,
                 stop: StopEvent, deadline_s: float):
        super().__init__(env_spec)
        self.steps, self.step_s, self.first_s = steps, step_s, first_s
        self.stop, self.deadline_s, self.calls = stop, deadline_s, 0

    def num_off_policy_optims_per_cycle(self) -> int:
        return self.steps

    def loss(self, nets, opt, experience):
        def sleep(w):
            self.calls += 1
            if self.calls == 1:
                self.stop.deadline = time.monotonic() + self.deadline_s
                self.stop.set()
            time.sleep(self.first_s if self.calls == 1 else self.step_s)
            return w

        slept = jax.pure_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32),
                                  jax.lax.stop_gradient(nets["w"]))
        return jnp.square(nets["w"]) + 0.0 * slept, (experience, {"w": slept})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("deadline_s,cut", [(3.0, False), (0.5, True)])
def test_a_stop_during_the_first_update_cuts_it_only_if_it_would_not_end_in_time(
        deadline_s, cut, no_leftovers):
    # 20 steps: a 1 s "compilation", then 19 x 0.02 s. With 3 s to the deadline the update
    # ends 2.6 s early: averaged with the compilation its steps looked 1 s each, and it was
    # cut. With 0.5 s the compilation alone runs past the deadline: cut at its end.
    steps, stop = 20, StopEvent()
    agent = CompilesSlowly(sebulba.env_spec(COUNTING), steps, 0.02, 1.0, stop, deadline_s)
    cfg = sebulba.Config(env=COUNTING, envs_per_group=2, steps_per_cycle=8, async_factor=1,
                         shutdown_timeout_s=5.0)
    result = sebulba.Sebulba(agent, cfg).run(10**9, stop=stop)
    assert result.stopped_early and result.learner_updates == 1
    if cut:  # the steps queued behind the first ran
        assert result.optimizer_steps == learner.MAX_QUEUED_STEPS, result.optimizer_steps
        assert result.optimizer_steps_cut == steps - learner.MAX_QUEUED_STEPS
    else:
        assert result.optimizer_steps_cut == 0 and result.optimizer_steps == steps


@pytest.mark.timeout(60)
def test_an_update_info_kept_past_the_next_update_refuses_to_copy_state(no_leftovers):
    # The next update donates the learner's buffers and moves the actors' cut: a kept
    # UpdateInfo's copies would fail on deleted arrays or return another update's state.
    loop, infos = counting_loop(), []
    result = loop.run(3 * loop.env_steps_per_update, on_update=infos.append)
    assert result.learner_updates == len(infos) == 3
    for info in infos[:-1]:
        with pytest.raises(RuntimeError, match=rf"UpdateInfo.learner_state\(\) of update "
                                               rf"{info.version} was called after a later"):
            info.learner_state()
        with pytest.raises(RuntimeError, match=r"UpdateInfo.actor_state\(\) of update"):
            info.actor_state()
    # The last update's stays valid after the run (the launcher's final save copies it).
    nets, _, _ = infos[-1].learner_state()
    assert jax.tree.leaves(nets) and infos[-1].actor_state() is not None
    loop.run(loop.env_steps_per_update)  # a new run starts the learner anew
    with pytest.raises(RuntimeError, match="after a later update started"):
        infos[-1].learner_state()
