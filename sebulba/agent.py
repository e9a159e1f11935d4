"""The Agent contract: what a researcher implements to run in the Sebulba loop."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from sebulba.envs import example_env_step
from sebulba.runtime import sharding
from sebulba.types import (
    ActorOutput,
    AgentState,
    EnvSpec,
    EnvStep,
    Experience,
    Metrics,
    Nets,
    OptState,
    PyTree,
    StepState,
    Trajectory,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How envs and devices are laid out in a run; agents size their state from it.

    Every count is of envs (one env = one acting stream, one row of a trajectory), per
    process unless it says otherwise (in a multi-agent run, `agents_per_env` K > 1, an
    "env" here is one agent, a row: a group of N envs is N x K rows, env-major);
    `steps_per_cycle` counts env steps of one env,
    `trajectories_per_update` queue items, `num_groups`, `num_learner_devices` and
    `num_processes` groups, devices and processes.

    Attributes:
      envs_per_group: envs in one env group (one inferencer thread's vector env); the
        `E` of a trajectory's leaves [E, T, ...]: the launcher's `--envs_per_group` times
        `agents_per_env`.
      num_groups: env groups of this process (async_factor x inference devices).
      steps_per_cycle: env steps per inference cycle (T), per env.
      num_learner_devices: this process's learner devices (L; one trajectory is split
        over them along the env axis).
      num_processes: processes in the run; each has `num_groups` groups and the same
        number of learner devices.
      trajectories_per_update: trajectories (K queue items, one group's inference cycle
        each, from any groups, possibly the same group twice) joined along the env axis
        for one learner update, per process. `Config.trajectories_per_update`.
      agents_per_env: K, the agents (rows) of each env of a multi-agent env, adjacent
        in every batch; 1 for single-agent envs.
    """

    envs_per_group: int
    num_groups: int
    steps_per_cycle: int
    num_learner_devices: int
    num_processes: int = 1
    trajectories_per_update: int = 1
    agents_per_env: int = 1

    @property
    def total_envs(self) -> int:
        """Envs of this process."""
        return self.envs_per_group * self.num_groups

    @property
    def envs_per_learner_shard(self) -> int:
        """Envs of one trajectory that one learner device receives (E / L)."""
        return self.envs_per_group // self.num_learner_devices

    @property
    def envs_per_update_shard(self) -> int:
        """Rows (envs) one learner device sees in one update: the `K x E / L` of the
        leaves [K x E / L, T(+1), ...] `update_experience` receives, item k's envs in
        rows [k x E / L, (k + 1) x E / L)."""
        return self.trajectories_per_update * self.envs_per_learner_shard


class Agent(abc.ABC):
    """Base class of agents: pure, jit-compatible functions on pytrees.

    The framework compiles `step` (once per inference device) and the learner
    functions (once, over the learner devices) and donates their state buffers, so
    implementations must not keep state on `self` after construction and must not
    depend on Python values that change between calls.

    Networks are Flax Linen modules held by the agent (static); `nets` is a pytree of
    their parameters, so applying them inside a compiled function is a traced call
    with no per-step Python graph traversal.

    Per-env leaves of a StepState carry the env axis first; 0-d leaves are shared by
    all envs. Use typed keys (`jax.random.key`) so that a key is one 0-d leaf.
    """

    #: bool, a class attribute: True for an agent that joins each env's consecutive
    #: trajectories (R2D2's sequences span cycles); the run then refuses
    #: `Config.drop_when_full`, which would silently join the trajectories on either side
    #: of a dropped one.
    needs_consecutive_trajectories: bool = False

    def __init__(self, env_spec: EnvSpec):
        self.env_spec = env_spec

    # Construction: called once, outside of jit.

    @abc.abstractmethod
    def new_networks(self, key: jax.Array) -> Nets:
        """Initial network parameters."""

    def new_state(self, nets: Nets, key: jax.Array, layout: Layout) -> AgentState:
        """The initial state; `step_state` covers all `layout.total_envs` envs."""
        opt_key, exp_key, step_key = jax.random.split(key, 3)
        return AgentState(
            nets=nets,
            opt=self.new_opt_state(nets, opt_key),
            experience=self.new_experience_state(nets, exp_key, layout),
            step_state=self.new_step_state(nets, step_key, layout.total_envs),
        )

    @abc.abstractmethod
    def new_step_state(self, nets: Nets, key: jax.Array, num_envs: int) -> StepState:
        """Per-env acting state (recurrent state, RNG, counters) for `num_envs` envs (rows).

        With several processes the loop asks for every env of the run and keeps each
        process's rows of it, so that a run acts alike however many processes share it:
        an agent that tells envs apart by their index sees the run's index."""

    @abc.abstractmethod
    def new_opt_state(self, nets: Nets, key: jax.Array) -> OptState:
        """Optimizer state for `nets`."""

    @abc.abstractmethod
    def new_experience_state(self, nets: Nets, key: jax.Array, layout: Layout) -> Experience:
        """Experience of one learner device (each update brings it
        `layout.envs_per_update_shard` rows: `layout.envs_per_learner_shard` envs of each
        of `layout.trajectories_per_update` trajectories, from `layout.num_groups`
        groups)."""

    # Acting: compiled on each inference device, called once per env step.

    @abc.abstractmethod
    def step(
        self, step_state: StepState, nets: Nets, env_step: EnvStep
    ) -> tuple[ActorOutput, StepState]:
        """Chooses actions for a batch of envs.

        Args:
          step_state: per-env leaves [E, ...].
          nets: what the learner published, `acting_nets(nets, learner_updates)`.
          env_step: leaves [E, ...]; `first` marks where recurrent state must reset.

        Returns:
          (ActorOutput with leaves [E, ...], the next StepState).
        """

    def greedy_step(
        self, step_state: StepState, nets: Nets, env_step: EnvStep
    ) -> tuple[ActorOutput, StepState]:
        """Like `step` without exploration, for evaluation. Optional."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement greedy_step; evaluate with sampling"
        )

    # Learning: compiled over the learner devices; arguments are one device's shard.

    def update_statistics(self, nets: Nets, trajectory: Trajectory) -> Nets:
        """The networks with statistics learnt from data rather than gradients updated
        from one update's trajectory shard (leaves [K x E / L, T(+1), ...]), e.g. running
        observation moments a normalizing torso reads. Runs before `update_experience`,
        which sees the new statistics, on each learner device: sum or average over
        `sebulba.runtime.sharding.LEARNER_AXIS` so that every replica stays identical. The result
        is published with the networks, so every actor uses the same statistics.
        Default: unchanged (and nothing compiled)."""
        return nets

    @abc.abstractmethod
    def update_experience(
        self,
        experience: Experience,
        initial_step_state: StepState,
        final_step_state: StepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> Experience:
        """Adds one update's trajectory shard (leaves [K x E / L, T(+1), ...]) to the
        experience: `layout.trajectories_per_update` (K) trajectories joined along the env
        axis in queue order, E / L envs of each (`layout.envs_per_update_shard` rows). With
        K > 1 the rows may come from different groups, or from several cycles of one
        group (earlier cycle first); the StepStates' per-env leaves are joined alike,
        their 0-d leaves are the first trajectory's.

        `initial_step_state` is the state the group acted from at the trajectory's first
        step (e.g. an LSTM's state to start training from); `final_step_state` the one
        after its last action. `nets` are the learner's current networks, for what is
        computed once per trajectory (PPO's advantages, initial replay priorities).
        """

    @abc.abstractmethod
    def loss(
        self, nets: Nets, opt: OptState, experience: Experience
    ) -> tuple[jax.Array, tuple[Experience, Metrics]]:
        """Scalar loss to differentiate, with the updated experience and scalar metrics.

        Runs on each learner device on its own experience; every device starts from the
        same experience and key, so an agent that samples folds in the device's index
        (`sebulba.runtime.sharding.own_key`) to draw its own batch.
        """

    @abc.abstractmethod
    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        """Applies gradients (already averaged over learner devices)."""

    def num_off_policy_optims_per_cycle(self) -> int:
        """Optimizer steps per learner update (one update per
        `Config.trajectories_per_update` received trajectories, 1 by default), whatever
        the number of trajectories it learns from; see `optimizer_steps_per_update`."""
        return 1

    def optimizer_steps_per_update(self, layout: Layout) -> int:
        """Optimizer steps of one learner update, which learns from
        `layout.trajectories_per_update` (K) trajectories joined; the learner asks once,
        when it is made. Default: `num_off_policy_optims_per_cycle()` whatever the layout
        (an on-policy agent's epochs x minibatches over the joined batch). A replay agent
        derives it from the layout so that its replay ratio does not depend on K: R2D2
        returns its steps per trajectory times K, SAC its gradient steps per env step
        times the env steps of an update of the run (K x envs_per_group x
        steps_per_cycle x num_processes)."""
        return self.num_off_policy_optims_per_cycle()

    def partition_for_grad(self, nets: Nets) -> tuple[Nets, Nets | None]:
        """Splits `nets` into (differentiated, held fixed), e.g. to exclude a target net.

        Both parts have the structure of `nets` with `None` where a subtree belongs to
        the other part; `grads` given to `optimize_from_grads` have the first part's
        structure. Default: differentiate everything.
        """
        return nets, None

    def ready_to_learn(self, experience: Experience) -> jax.Array | bool:
        """Whether the optimizer steps may run on `experience` (a bool scalar, traced).

        While it is False on any learner device the learner skips the update entirely:
        no loss, no gradient, no optimizer step, experience and networks unchanged (the
        trajectory is still added by `update_experience`). E.g. a replay's warm-up:
        `experience.replay.size >= min_replay_size`. Default: always.
        """
        return True

    def acting_nets(self, nets: Nets, learner_updates: jax.Array) -> PyTree:
        """What the learner publishes to the actors: `step` receives it as `nets`.

        Called once per publication, compiled, on the learner. `learner_updates` (int32
        scalar) counts the learner updates (each learns from `trajectories_per_update`
        trajectories; the unit of policy lag) so far, so a schedule (an exploration
        epsilon, say) can be published with the networks at no per-step cost. Return
        only what acting reads: a target network need not travel to the inference
        devices. Default: `nets`.
        """
        return nets

    def shard_step_state(
        self, step_state: StepState, learner_devices: Sequence[jax.Device]
    ) -> StepState:
        """Places a group's StepState on the learner devices for `update_experience`.

        Default: per-env leaves split along the env axis, 0-d leaves replicated. Override
        if the StepState holds leaves of another layout.
        """
        return sharding.shard_env_axis(step_state, learner_devices)


def combine_partitions(diff: Nets | None, fixed: Nets | None) -> Nets:
    """Inverse of `Agent.partition_for_grad`: where one part is None (a leaf or a whole
    subtree), the other part's entry is taken."""
    if diff is None:
        return fixed
    if fixed is None:
        return diff
    if isinstance(diff, Mapping):
        return type(diff)({k: combine_partitions(diff[k], fixed[k]) for k in diff})
    if isinstance(diff, tuple | list):
        merged = [combine_partitions(a, b) for a, b in zip(diff, fixed, strict=True)]
        return type(diff)(*merged) if hasattr(diff, "_fields") else type(diff)(merged)
    raise ValueError(f"both partitions hold a value here: {diff!r} and {fixed!r}")


def zeros_trajectory(agent: Agent, nets: Nets, num_envs: int, steps_per_cycle: int) -> Trajectory:
    """A zero Trajectory shaped like the ones `agent` produces (leaves [E, T(+1), ...]).

    Handy for sizing experience; the actor outputs' shapes come from tracing `step`.
    """
    env_step = example_env_step(agent.env_spec, num_envs)
    step_state = agent.new_step_state(nets, jax.random.key(0), num_envs)
    acting = jax.eval_shape(agent.acting_nets, nets, jnp.zeros((), jnp.int32))
    actor_output, _ = jax.eval_shape(agent.step, step_state, acting, env_step)

    def zeros(x, length):
        return jnp.zeros((x.shape[0], length) + tuple(x.shape[1:]), x.dtype)

    return Trajectory(
        env_steps=jax.tree.map(lambda x: zeros(x, steps_per_cycle + 1), env_step),
        actor_outputs=jax.tree.map(lambda x: zeros(x, steps_per_cycle), actor_output),
    )


def strongly_typed(tree: PyTree) -> PyTree:
    """`tree` with its weakly typed leaves (`jnp.full(n, -1.0)`, `x + 1.0` of a Python
    scalar) made strong: a StepState weak in one call and strong in the next (as
    `Agent.step` returns it) compiles the acting call twice."""
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.result_type(x))
                        if jax.typeof(x).weak_type else x, tree)


def checked_step_state(given: StepState, returned: StepState) -> StepState:
    """The StepState `Agent.step` `returned` for the one it was `given` (traced values),
    strongly typed; a ValueError naming the leaf where its structure, a shape or a dtype
    differs (the acting call would compile again, or the learner fail far from it)."""
    if jax.tree.structure(returned) != jax.tree.structure(given):
        raise ValueError(f"Agent.step returned a StepState of structure "
                         f"{jax.tree.structure(returned)}; it was given "
                         f"{jax.tree.structure(given)}")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(given),
                            jax.tree.leaves(returned), strict=True):
        if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
            raise ValueError(
                f"Agent.step returned step_state{jax.tree_util.keystr(path)} of shape "
                f"{jnp.shape(y)} and dtype {jnp.result_type(y)}; it was given "
                f"{jnp.shape(x)}, {jnp.result_type(x)} (a StepState keeps its shapes "
                "and dtypes from step to step)")
    return strongly_typed(returned)
