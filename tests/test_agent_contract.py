"""The agent contract's checks: a hook that breaks it is one clear error when the run starts
(or where the hook is first traced), naming the hook, the leaf and what was expected of
it, not a failure far from it (an empty slice of a StepState, the env's assertion in its
thread, a sharding error, a metric that fails one update late) or a run that goes on
silently wrong (bfloat16 networks published, a counter sized for another number of envs).

Each test runs a small real agent (REINFORCE with a linear policy, as in
docs/writing-an-agent.md) on CartPole-v1, its learner over two simulated CPU devices.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sebulba
from sebulba.agent import check_actor_output
from sebulba.envs import example_env_step
from sebulba.runtime import sharding
from sebulba.runtime.inferencer import ActingFunctions

ENVS, STEPS = 4, 4  # per group; two groups, two learner devices: 2 envs each


class StepState(NamedTuple):
    key: jax.Array  # [E] typed keys
    count: jax.Array  # [E] int32, actions taken


class Params(NamedTuple):
    w: jax.Array  # [4, 2]
    b: jax.Array  # [2]


class Opt(NamedTuple):
    sgd: optax.OptState
    steps: jax.Array  # int32 scalar


class Linear(sebulba.Agent):
    """REINFORCE with a linear softmax policy on each trajectory shard once."""

    def __init__(self, env_spec):
        super().__init__(env_spec)
        self.optimizer = optax.sgd(0.01)

    def new_networks(self, key):
        return Params(jnp.zeros((4, 2)), jnp.zeros(2))

    def new_step_state(self, nets, key, num_envs):
        return StepState(jax.random.split(key, num_envs), jnp.zeros(num_envs, jnp.int32))

    def new_opt_state(self, nets, key):
        return Opt(self.optimizer.init(nets), jnp.zeros((), jnp.int32))

    def new_experience_state(self, nets, key, layout):
        return sebulba.zeros_trajectory(self, nets, layout.envs_per_update_shard,
                                        layout.steps_per_cycle)

    def step(self, step_state, nets, env_step):
        keys = jax.vmap(jax.random.split)(step_state.key)
        logits = env_step.obs @ nets.w + nets.b
        action = jax.vmap(jax.random.categorical)(keys[:, 0], logits)
        return (sebulba.ActorOutput(action, {"count": step_state.count}),
                StepState(keys[:, 1], step_state.count + 1))

    def update_experience(self, experience, initial_step_state, final_step_state,
                          trajectory, nets):
        return trajectory

    def loss(self, nets, opt, trajectory):
        steps, action = trajectory.env_steps, trajectory.actor_outputs.action
        logits = steps.obs[:, :-1] @ nets.w + nets.b
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], -1)
        loss = -jnp.mean(log_prob[..., 0] * steps.reward[:, 1:])
        return loss, (trajectory, {"reward": jnp.mean(steps.reward)})

    def optimize_from_grads(self, nets, opt, grads):
        updates, sgd = self.optimizer.update(grads, opt.sgd, nets)
        return optax.apply_updates(nets, updates), Opt(sgd, opt.steps + 1)


def loop(agent_cls, **config) -> sebulba.Sebulba:
    cfg = sebulba.Config(env="CartPole-v1", envs_per_group=ENVS, steps_per_cycle=STEPS,
                         async_factor=2, inference_devices=[0], learner_devices=[0, 1],
                         **config)
    return sebulba.Sebulba(agent_cls(cfg.env_spec()), cfg)


def refused(agent_cls, message: str) -> None:
    """The run of `agent_cls` fails at its start with a ValueError holding `message`."""
    with pytest.raises(ValueError, match=re.escape(message)):
        loop(agent_cls).run(4 * ENVS * STEPS, progress_timeout_s=30)


# 1. new_step_state: per-env leaves have a row for every env; 0-d leaves are shared.

class CounterOfFixedRows(Linear):  # sized for one group: 4 rows for the run's 8 envs
    def new_step_state(self, nets, key, num_envs):
        return super().new_step_state(nets, key, num_envs)._replace(
            count=jnp.zeros(ENVS, jnp.int32))


class PerActionCounts(Linear):  # a vector [num_actions] that is not per env
    def new_step_state(self, nets, key, num_envs):
        return (super().new_step_state(nets, key, num_envs),
                jnp.zeros(self.env_spec.num_actions, jnp.int32))

    def step(self, step_state, nets, env_step):
        output, state = super().step(step_state[0], nets, env_step)
        return output, (state, step_state[1])

    def update_experience(self, experience, initial, final, trajectory, nets):
        return trajectory


class SharedCounter(PerActionCounts):  # a 0-d leaf: shared by all envs, allowed
    def new_step_state(self, nets, key, num_envs):
        state, _ = super().new_step_state(nets, key, num_envs)
        return state, jnp.zeros((), jnp.int32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls,leaf,shape", [
    (CounterOfFixedRows, "step_state.count", (4,)),
    (PerActionCounts, "step_state[1]", (2,)),
])
def test_a_step_state_leaf_that_is_not_per_env_is_refused(agent_cls, leaf, shape,
                                                          no_leftovers):
    refused(agent_cls, f"{agent_cls.__name__}.new_step_state(nets, key, num_envs=8) "
                       f"returned {leaf} of shape {shape}; a StepState leaf with axes is per "
                       "env, its first axis the 8 envs (shape (8, ...))")


class InitializedOnTheHost(CounterOfFixedRows):
    """Networks drawn with NumPy from the key's draw: nothing the loop can trace
    beforehand (`jax.eval_shape`), so the check is on the state the loop makes."""

    def new_networks(self, key):
        w = np.asarray(jax.random.normal(key, (4, 2))) * 0.01
        return Params(jnp.asarray(w), jnp.zeros(2))

    def new_experience_state(self, nets, key, layout):
        return jnp.zeros(())


@pytest.mark.timeout(60)
def test_the_initial_state_the_loop_makes_is_checked_too(no_leftovers):
    with pytest.raises(ValueError, match=re.escape(
            "InitializedOnTheHost.new_step_state(nets, key, num_envs=8) returned "
            "step_state.count of shape (4,)")):
        loop(InitializedOnTheHost).initial_state()


@pytest.mark.timeout(60)
def test_a_0d_step_state_leaf_is_shared_by_all_envs(no_leftovers):
    result = loop(SharedCounter).run(2 * ENVS * STEPS)
    assert result.learner_updates >= 1 and result.state.step_state[1].shape == ()


class Stateless(Linear):  # no StepState at all: a fixed policy's acting needs none
    def new_step_state(self, nets, key, num_envs):
        return ()

    def step(self, step_state, nets, env_step):
        action = jnp.argmax(env_step.obs @ nets.w + nets.b, axis=-1)
        return sebulba.ActorOutput(action, {"count": jnp.zeros_like(action)}), ()


@pytest.mark.timeout(60)
def test_an_agent_without_a_step_state_runs_to_its_end(no_leftovers):
    # Its end once failed, where the run's StepState is joined from its groups' cut.
    result = loop(Stateless).run(2 * ENVS * STEPS)
    assert result.learner_updates >= 1 and result.state.step_state == ()


# 2. step's ActorOutput: actions the env's space takes, per-env extras.

def changes_output(change):
    class ChangesOutput(Linear):
        def step(self, step_state, nets, env_step):
            output, state = super().step(step_state, nets, env_step)
            return change(output, step_state, nets), state

    return ChangesOutput


FLOAT_ACTION = changes_output(lambda o, s, n: o._replace(action=o.action.astype(jnp.float32)))
ACTION_AXIS = changes_output(lambda o, s, n: o._replace(action=o.action[:, None]))
SCALAR_EXTRA = changes_output(lambda o, s, n: o._replace(extras={"lr": n.b[0]}))
EXTRA_ROWS = changes_output(lambda o, s, n: o._replace(extras={"count": s.count[1:]}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls,message", [
    (FLOAT_ACTION, "Agent.step returned action float32[4]; the env's action space "
                   "Discrete(2) takes [4 envs, *()] = [4] of an integer dtype"),
    (ACTION_AXIS, "Agent.step returned action int32[4, 1]; the env's action space "
                  "Discrete(2) takes [4 envs, *()] = [4] of an integer dtype"),
    (SCALAR_EXTRA, "Agent.step returned extras['lr'] float32[]; extras are per env: each "
                   "leaf's first axis is the 4 envs the step acted for ([4, ...])"),
    (EXTRA_ROWS, "Agent.step returned extras['count'] int32[3]; extras are per env: each "
                 "leaf's first axis is the 4 envs the step acted for ([4, ...])"),
], ids=["float-action", "action-axis", "scalar-extra", "extra-rows"])
def test_an_actor_output_the_env_or_trajectory_cannot_take_is_refused(
        agent_cls, message, no_leftovers):
    refused(agent_cls, message)


@pytest.mark.timeout(60)
def test_the_acting_call_checks_the_actor_output_where_it_is_traced():
    agent = FLOAT_ACTION(sebulba.env_spec("CartPole-v1"))
    acting = ActingFunctions(agent, STEPS)
    nets = agent.new_networks(jax.random.key(0))
    state = acting.new_state(agent.new_step_state(nets, jax.random.key(1), ENVS),
                             jax.devices()[0], snapshots=False)
    with pytest.raises(ValueError, match=re.escape("Agent.step returned action float32[4]")):
        acting.act_all(acting.networks(nets), state.step_state, None,
                       example_env_step(agent.env_spec, ENVS))


def test_box_actions_are_numbers_of_the_space_shape():
    box = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    check_actor_output(sebulba.ActorOutput(jnp.zeros((5, 3))), 5, box)
    # integers too (a bang-bang controller's -1 and +1): the env's boundary casts them
    check_actor_output(sebulba.ActorOutput(jnp.zeros((5, 3), jnp.int32)), 5, box)
    with pytest.raises(ValueError, match=re.escape(
            "Agent.step returned action bool[5, 3]; the env's action space "
            f"{box!r} takes [5 envs, *(3,)] = [5, 3] of a numeric dtype")):
        check_actor_output(sebulba.ActorOutput(jnp.zeros((5, 3), bool)), 5, box)
    with pytest.raises(ValueError, match=re.escape("takes [5 envs, *(3,)] = [5, 3]")):
        check_actor_output(sebulba.ActorOutput(jnp.zeros((5, 1))), 5, box)


# 3. Learner hooks return what they were given.

class ExperienceOfAnotherDtype(Linear):
    def update_experience(self, experience, initial, final, trajectory, nets):
        return trajectory._replace(env_steps=trajectory.env_steps._replace(
            reward=trajectory.env_steps.reward.astype(jnp.bfloat16)))


class Bfloat16Params(Linear):
    def optimize_from_grads(self, nets, opt, grads):
        nets, opt = super().optimize_from_grads(nets, opt, grads)
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), nets), opt


class GainsALeaf(Linear):
    def optimize_from_grads(self, nets, opt, grads):
        nets, opt = super().optimize_from_grads(nets, opt, grads)
        return nets, opt._replace(steps={"steps": opt.steps, "lr": jnp.zeros(())})


class ATupleForTheNets(Linear):
    def optimize_from_grads(self, nets, opt, grads):
        nets, opt = super().optimize_from_grads(nets, opt, grads)
        return tuple(nets), opt


class OptOfAnotherShape(Linear):
    def optimize_from_grads(self, nets, opt, grads):
        nets, opt = super().optimize_from_grads(nets, opt, grads)
        return nets, opt._replace(steps=opt.steps[None])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls,message", [
    (ExperienceOfAnotherDtype, "Agent.update_experience returned "
                               "experience.env_steps.reward bfloat16[2, 5]; it was given "
                               "float32[2, 5]"),
    (Bfloat16Params, "Agent.optimize_from_grads returned nets.w bfloat16[4, 2]; it was given "
                     "float32[4, 2]"),
    (GainsALeaf, "Agent.optimize_from_grads returned opt.steps as a dict of keys ['lr', "
                 "'steps']; it was given a leaf"),
    (ATupleForTheNets, "Agent.optimize_from_grads returned nets as a tuple of 2; it was "
                       "given a Params of 2"),
    (OptOfAnotherShape, "Agent.optimize_from_grads returned opt.steps int32[1]; it was given "
                        "int32[]"),
], ids=["experience-dtype", "bf16-params", "leaf-gained", "tuple-nets", "opt-shape"])
def test_a_learner_hook_that_changes_what_it_was_given_is_refused_at_the_start(
        agent_cls, message, no_leftovers):
    # initial_state: before anything runs, from the loop's trace of the learner alone.
    with pytest.raises(ValueError, match=re.escape(message)):
        loop(agent_cls).initial_state()


# 4. Metrics: scalars, Python numbers accepted.

class VectorMetric(Linear):
    def loss(self, nets, opt, trajectory):
        loss, (trajectory, metrics) = super().loss(nets, opt, trajectory)
        return loss, (trajectory, {**metrics, "logits": nets.b})


class WarmsUp(Linear):
    """Overrides ready_to_learn (always ready, but traced): the learner's other path."""

    def ready_to_learn(self, experience):
        return jnp.all(experience.env_steps.reward >= 0.0)


class VectorMetricWarmingUp(VectorMetric, WarmsUp):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls", [VectorMetric, VectorMetricWarmingUp])
def test_a_metric_that_is_not_a_scalar_is_refused_naming_it(agent_cls, no_leftovers):
    refused(agent_cls, "Agent.loss returned metric 'logits' float32[2]; a metric is a "
                       "scalar (shape ())")


class VectorLoss(Linear):
    def loss(self, nets, opt, trajectory):
        loss, aux = super().loss(nets, opt, trajectory)
        return jnp.stack([loss, loss]), aux


@pytest.mark.timeout(60)
def test_a_loss_that_is_not_a_scalar_is_refused(no_leftovers):
    refused(VectorLoss, "Agent.loss returned a loss float32[2]; the loss is a floating "
                        "scalar (shape ())")


class PythonNumbers(Linear):
    """A learning rate reported as a Python float, an epsilon published as one."""

    def loss(self, nets, opt, trajectory):
        loss, (trajectory, metrics) = super().loss(nets, opt, trajectory)
        return loss, (trajectory, {**metrics, "lr": 0.01, "epochs": 1})

    def acting_nets(self, nets, learner_updates):
        return {"nets": nets, "epsilon": 0.25}

    def step(self, step_state, nets, env_step):
        assert nets["epsilon"].dtype == jnp.float32
        return super().step(step_state, nets["nets"], env_step)


class PythonNumbersWarmingUp(PythonNumbers, WarmsUp):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls", [PythonNumbers, PythonNumbersWarmingUp])
def test_python_numbers_are_metrics_and_acting_nets(agent_cls, no_leftovers):
    result = loop(agent_cls).run(3 * 2 * ENVS * STEPS)
    assert result.learner_updates >= 3
    assert result.metrics["lr"] == pytest.approx(0.01) and result.metrics["epochs"] == 1.0


# 5. shard_step_state keeps its layout.

class Replicates(Linear):
    def shard_step_state(self, step_state, learner_devices):
        return sharding.replicate(step_state, learner_devices)


class OnOneDevice(Linear):
    def shard_step_state(self, step_state, learner_devices):
        return jax.device_put(step_state, learner_devices[0])


class ToNumpy(Linear):
    def shard_step_state(self, step_state, learner_devices):
        placed = sharding.shard_env_axis(step_state, learner_devices)
        return placed._replace(count=np.asarray(placed.count))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("agent_cls,message", [
    (Replicates, "Replicates.shard_step_state returned step_state.key key<fry>[2, 4] on 2 "
                 "device(s); expected a jax.Array key<fry>[2, 2] split along its first axis "
                 "over the 2 learner devices, one entry each (4 envs, 2 on each device, in "
                 "order)"),
    (OnOneDevice, "OnOneDevice.shard_step_state returned step_state.key key<fry>[4] on 1 "
                  "device(s), not split over the learner devices (SingleDeviceSharding); "
                  "expected a jax.Array key<fry>[2, 2]"),
    (ToNumpy, "ToNumpy.shard_step_state returned step_state.count as a ndarray; expected a "
              "jax.Array int32[2, 2]"),
], ids=["replicated", "one-device", "numpy"])
def test_a_step_state_placed_in_another_layout_is_refused(agent_cls, message, no_leftovers):
    refused(agent_cls, message)
