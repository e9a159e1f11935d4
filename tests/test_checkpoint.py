"""Checkpoints on disk: resume matches an uninterrupted run; mismatches are refused."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sebulba
from sebulba.checkpoint import Checkpointer, env_differences
from tests.counting_agent import CountingAgent
from tests.envs import CountingEnv

COUNTING = functools.partial(CountingEnv, 5)
STEPS_PER_UPDATE = 4 * 3  # envs_per_group x steps_per_cycle


class AdamCounting(CountingAgent):
    """Its update ignores the data, so the learner state after K updates is reproducible
    whatever the order in which trajectories arrive; Adam's state makes it depend on the
    optimizer state being restored too."""

    optimizer = optax.adam(0.05)

    def new_networks(self, key):
        return {"w": jnp.ones(()), "v": jnp.full((3,), 2.0)}

    def new_opt_state(self, nets, key):
        return self.optimizer.init(nets)

    def loss(self, nets, opt, experience):
        loss = jnp.square(nets["w"] - 3.0) + jnp.sum(jnp.square(nets["v"]))
        return loss, (experience, {})

    def optimize_from_grads(self, nets, opt, grads):
        updates, opt = self.optimizer.update(grads, opt, nets)
        return optax.apply_updates(nets, updates), opt


def make_loop(agent_cls=AdamCounting, learner_devices=(0,)):
    cfg = sebulba.Config(env=COUNTING, envs_per_group=4, steps_per_cycle=3, async_factor=2,
                         learner_devices=list(learner_devices))
    return sebulba.Sebulba(agent_cls(sebulba.env_spec(COUNTING)), cfg)


def save_at_end(checkpointer, with_experience=False):
    def on_update(info):
        nets, opt, experience = info.learner_state()
        checkpointer.save(info.version, nets=nets, opt=opt, metadata={"agent": "counting"},
                          counters={"consumed": info.accounting.consumed},
                          local_experience=experience if with_experience else None)
    return on_update


@pytest.mark.timeout(120)
def test_resumed_run_matches_uninterrupted_run(tmp_path, no_leftovers):
    updates = 12
    whole = make_loop().run(updates * STEPS_PER_UPDATE)

    checkpointer = Checkpointer(str(tmp_path), max_to_keep=2)
    first = make_loop().run(updates // 2 * STEPS_PER_UPDATE,
                            on_update=save_at_end(checkpointer))
    assert checkpointer.all_steps() == [updates // 2 - 1, updates // 2]  # kept the last 2

    loop = make_loop()  # a fresh loop, as after a restart
    fresh = loop.initial_state()
    restored = checkpointer.restore(nets=fresh.nets, opt=fresh.opt,
                                    metadata={"agent": "counting"})
    assert restored.counters == {"consumed": updates // 2 * STEPS_PER_UPDATE}
    second = loop.run(updates // 2 * STEPS_PER_UPDATE,
                      fresh._replace(nets=restored.nets, opt=restored.opt))

    assert first.consumed + second.consumed == whole.consumed
    assert first.learner_updates + second.learner_updates == whole.learner_updates
    for a, b in zip(jax.tree.leaves(second.state.nets), jax.tree.leaves(whole.state.nets),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(second.state.opt), jax.tree.leaves(whole.state.opt),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # Resuming the networks without their optimizer state would not reproduce it.
    third = make_loop().run(updates // 2 * STEPS_PER_UPDATE, fresh._replace(nets=restored.nets))
    assert not np.array_equal(third.state.nets["w"], whole.state.nets["w"])
    checkpointer.close()


@pytest.mark.timeout(120)
def test_experience_of_every_learner_device_is_restored(tmp_path, no_leftovers):
    checkpointer = Checkpointer(str(tmp_path))
    first = make_loop(CountingAgent, learner_devices=(0, 1)).run(
        5 * STEPS_PER_UPDATE, on_update=save_at_end(checkpointer, with_experience=True))
    loop = make_loop(CountingAgent, learner_devices=(0, 1))
    fresh = loop.initial_state()
    like = jax.tree.map(lambda x: jnp.stack([x, x]), fresh.experience)
    restored = checkpointer.restore(nets=fresh.nets, opt=fresh.opt,
                                    metadata={"agent": "counting"}, local_experience=like)
    saved_log = jax.tree.map(np.asarray, first.learner_experience)
    for a, b in zip(jax.tree.leaves(restored.local_experience), jax.tree.leaves(saved_log),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    second = loop.run(3 * STEPS_PER_UPDATE, fresh._replace(nets=restored.nets),
                      local_experience=restored.local_experience)
    log = jax.tree.map(np.asarray, second.learner_experience)
    np.testing.assert_array_equal(log.size, [5 + 3, 5 + 3])  # each device kept its log
    np.testing.assert_array_equal(log.obs[:, :5], saved_log.obs[:, :5])
    checkpointer.close()


def test_checkpoint_of_another_agent_or_shape_is_refused(tmp_path):
    checkpointer = Checkpointer(str(tmp_path))
    nets = {"w": jnp.ones((2, 3))}
    checkpointer.save(1, nets=nets, opt=(), counters={"consumed": 10},
                      metadata={"agent": "ppo"})
    with pytest.raises(ValueError, match="written by agent 'ppo'; this run's agent is 'spg'"):
        checkpointer.restore(nets=nets, opt=(), metadata={"agent": "spg"})
    with pytest.raises(ValueError, match=r"networks of another shape.*float32\[2, 3\].*"
                                         r"float32\[2, 4\]"):
        checkpointer.restore(nets={"w": jnp.ones((2, 4))}, opt=(), metadata={"agent": "ppo"})
    with pytest.raises(FileNotFoundError, match="no checkpoint 7"):
        checkpointer.restore(nets=nets, opt=(), metadata={"agent": "ppo"}, step=7)
    restored = checkpointer.restore(nets=nets, opt=(), metadata={"agent": "ppo"})
    np.testing.assert_array_equal(restored.nets["w"], np.ones((2, 3)))
    checkpointer.close()


CARTPOLE = {"agent": "ppo", "env": "CartPole-v1", "env_kwargs": {}, "env_wrappers": [],
            "vectorization": "sync", "agent_ids": False}


@pytest.mark.parametrize("run,message", [
    # CartPole-v0 has CartPole-v1's spaces: every network shape matches.
    ({"env": "CartPole-v0"}, r"env 'CartPole-v1' \(this run: 'CartPole-v0'\)"),
    ({"env_kwargs": {"max_episode_steps": 50}}, r"env_kwargs \{\} \(this run: "
                                                r"\{'max_episode_steps': 50\}\)"),
    ({"env_wrappers": ("ClipReward(max_reward=1)",)},
     r"env_wrappers \[\] \(this run: \('ClipReward\(max_reward=1\)',\)\)"),
    ({"vectorization": "envpool"}, r"vectorization 'sync' \(this run: 'envpool'\)"),
])
def test_checkpoint_of_another_env_with_the_same_shapes_is_refused(tmp_path, run, message):
    checkpointer = Checkpointer(str(tmp_path))
    nets = {"w": jnp.ones((2, 3))}
    checkpointer.save(1, nets=nets, opt=(), counters={"consumed": 10}, metadata=CARTPOLE)
    with pytest.raises(ValueError, match=r"checkpoint 1 in .* was trained on another env: "
                                         + message + ". Its networks restore only into a run "
                                         "of the env they were trained on"):
        checkpointer.restore(nets=nets, opt=(), metadata={**CARTPOLE, **run})
    with pytest.raises(ValueError, match=message):  # checked without reading any array
        checkpointer.check_metadata({**CARTPOLE, **run})
    # Stepping the same envs in worker processes is the same env; tuples read as lists.
    same = {**CARTPOLE, "vectorization": "async", "env_wrappers": ()}
    assert checkpointer.restore(nets=nets, opt=(), metadata=same).counters == {"consumed": 10}
    # So are EnvPool's envs, in a pool per group or in one pool of all the groups.
    assert not env_differences({**CARTPOLE, "vectorization": "envpool"},
                               {**CARTPOLE, "vectorization": "envpool_async"})
    # A checkpoint without the env entries of the launcher's metadata restores as before.
    checkpointer.save(2, nets=nets, opt=(), counters={"consumed": 20}, metadata={"agent": "ppo"})
    assert checkpointer.restore(nets=nets, opt=(), metadata={**CARTPOLE, **run}).counters == {
        "consumed": 20}
    checkpointer.close()


@pytest.mark.timeout(60)
def test_a_process_s_own_part_round_trips_with_its_keys_and_keeps_the_last_k(tmp_path):
    """What process i > 0 of a multi-process run saves of its own: its envs' step states
    (typed keys among them) and its learner devices' experience."""
    from sebulba.checkpoint import ProcessCheckpointer, process_directory

    directory = process_directory(str(tmp_path / "checkpoints"), 1)
    assert directory.endswith("checkpoints_process_1")
    assert process_directory(str(tmp_path / "checkpoints"), 0).endswith("checkpoints")
    part = ProcessCheckpointer(directory, max_to_keep=2)
    step_state = {"key": jax.random.split(jax.random.key(3), 4), "h": jnp.arange(8.0)}
    experience = {"log": jnp.ones((2, 5), jnp.int32), "cursor": jnp.array([1, 2])}
    for step in (10, 20, 30):
        part.save(step, counters={"learner_updates": step}, metadata={"agent": "counting"},
                  local_experience=jax.tree.map(lambda x, s=step: x * s, experience),
                  step_state=step_state)
    assert part.all_steps() == [20, 30]
    like_state = {"key": jax.random.split(jax.random.key(0), 4), "h": jnp.zeros(8)}
    like_experience = jax.tree.map(jnp.zeros_like, experience)
    restored = part.restore(metadata={"agent": "counting"}, step=20, step_state=like_state,
                            local_experience=like_experience)
    assert restored.counters == {"learner_updates": 20}
    np.testing.assert_array_equal(jax.random.key_data(restored.step_state["key"]),
                                  jax.random.key_data(step_state["key"]))
    np.testing.assert_array_equal(restored.step_state["h"], step_state["h"])
    np.testing.assert_array_equal(restored.local_experience["log"], 20 * experience["log"])
    with pytest.raises(ValueError, match="written by agent 'counting'"):
        part.restore(metadata={"agent": "ppo"}, step_state=like_state)
    with pytest.raises(FileNotFoundError, match="no checkpoint 10"):
        part.restore(metadata={"agent": "counting"}, step=10, step_state=like_state)
    # What saves killed midway leave (an .npz whose JSON never came, temporary files) is
    # gone after the next save; the kept steps stay whole.
    for leftover in ("35.npz", "36.npz.tmp", "36.json.tmp"):
        (tmp_path / "checkpoints_process_1" / leftover).write_bytes(b"partial")
    part.save(40, counters={"learner_updates": 40}, metadata={"agent": "counting"},
              step_state=step_state)
    assert sorted(os.listdir(directory)) == ["30.json", "30.npz", "40.json", "40.npz"]
    assert part.restore(metadata={"agent": "counting"}, step_state=like_state).counters == {
        "learner_updates": 40}
    # A run resumed from 30 (process 0's save of 40 was cut short) drops its part of 40:
    # a save at 40 later must not find it there, nor a later prune keep it as the newest.
    assert part.discard_after(30) == [40]
    assert sorted(os.listdir(directory)) == ["30.json", "30.npz"]
    assert part.discard_after(30) == []


@pytest.mark.timeout(60)
def test_a_process_s_save_never_prunes_its_new_part_for_leftovers_with_higher_steps(
        tmp_path):
    """Parts an earlier run left in checkpoints_process_N at higher steps: the new run's
    saves must stay (keeping the last K by step number alone pruned each one as soon as
    it was written, and --resume then found no part of the run's checkpoints)."""
    from sebulba.checkpoint import ProcessCheckpointer

    directory = str(tmp_path / "checkpoints_process_1")
    part = ProcessCheckpointer(directory, max_to_keep=2)
    state = {"h": jnp.arange(4.0)}
    for step in (5000, 6000):  # the earlier run's
        part.save(step, counters={"consumed": step}, metadata={"agent": "counting"},
                  step_state=state)
    for step in (100, 200, 300):  # the new run's
        part.save(step, counters={"consumed": step}, metadata={"agent": "counting"},
                  step_state=state)
        assert step in part.all_steps()
    assert part.all_steps() == [200, 300]
    assert sorted(os.listdir(directory)) == ["200.json", "200.npz", "300.json", "300.npz"]
    restored = part.restore(metadata={"agent": "counting"}, step_state=state)
    assert restored.counters == {"consumed": 300}


@pytest.mark.timeout(60)
def test_a_fresh_start_refuses_a_process_s_leftover_parts_naming_the_directory(
        tmp_path, monkeypatch):
    """As it refuses process 0's checkpoints of an earlier run: every process checks every
    process's directory, so all refuse alike."""
    import types

    from examples import train
    from sebulba.checkpoint import ProcessCheckpointer

    class NoCheckpoints:  # process 0's directory, empty
        directory = str(tmp_path / "checkpoints")

        def all_steps(self):
            return []

    for name, value in (("_RESUME", False), ("_RESUME_IF_PRESENT", False),
                        ("_LOGDIR", str(tmp_path))):
        monkeypatch.setattr(train, name, types.SimpleNamespace(value=value))
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    train.check_fresh_start(NoCheckpoints())  # nothing left: starts
    leftover = tmp_path / "checkpoints_process_2"
    ProcessCheckpointer(str(leftover)).save(
        4000, counters={"consumed": 4000}, metadata={"agent": "ppo"})
    with pytest.raises(ValueError) as refused:
        train.check_fresh_start(NoCheckpoints())
    message = str(refused.value)
    assert f"--logdir={tmp_path} holds process 2's parts of an earlier run's" in message
    assert f"(steps 4,000 to 4,000 in {leftover})" in message
    assert f"remove {leftover}, or pass another --logdir" in message
    # --resume_if_present (a requeued job) is no fresh start: its saves drop such parts.
    monkeypatch.setattr(train, "_RESUME_IF_PRESENT", types.SimpleNamespace(value=True))
    train.check_fresh_start(NoCheckpoints())
