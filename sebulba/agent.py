"""The Agent contract: what a researcher implements to run in the Sebulba loop."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

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

        Every leaf is per env, [num_envs, ...], or 0-d (shared by all envs); the loop
        refuses another (a vector of per-action counts is not per env), naming the leaf.

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
          (ActorOutput with leaves [E, ...], the next StepState): `action` [E,
          *action_space.shape], integers for a Discrete or MultiDiscrete action space,
          numbers (floats, or integers) for a Box; every `extras` leaf [E, ...] (none
          0-d); the StepState of the structure, shapes and dtypes it was given. The run
          checks these where it first traces `step`.
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
        The initial state is the one from before step 0's `first` reset: a learner that
        unrolls a recurrent core from it resets where `first` is set, step 0 included,
        as `step` did (docs/writing-an-agent.md, "Recurrent state and resets").

        Returns an experience of the structure, shapes and dtypes it was given (checked
        when the learner's functions are first traced, naming the leaf).
        """

    @abc.abstractmethod
    def loss(
        self, nets: Nets, opt: OptState, experience: Experience
    ) -> tuple[jax.Array, tuple[Experience, Metrics]]:
        """Scalar loss to differentiate, with the updated experience and scalar metrics.

        The experience keeps its structure, shapes and dtypes; metrics are a dict of name
        -> scalar (a 0-d array or a Python number), averaged over the learner devices
        and reported as floats. Both are checked where the loss is first traced.

        Runs on each learner device on its own experience; every device starts from the
        same experience and key, so an agent that samples folds in the device's index
        (`sebulba.runtime.sharding.own_key`) to draw its own batch.
        """

    @abc.abstractmethod
    def optimize_from_grads(
        self, nets: Nets, opt: OptState, grads: PyTree
    ) -> tuple[Nets, OptState]:
        """Applies gradients (already averaged over learner devices).

        Returns `(nets, opt)` of the structure, shapes and dtypes it was given (a leaf
        gained, a tuple for a NamedTuple or bfloat16 parameters for float32 ones are
        refused where the learner is first traced, naming the leaf)."""

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

        Called by the inferencer threads on each trajectory's initial and final StepState
        (leaves [E, ...] for a group's E envs, or 0-d); each learner device must then get
        the rows of the envs whose trajectory rows it gets, so it must return, for every
        leaf, a global `jax.Array` on `learner_devices` (L of them, L_local in this
        process) split along its first axis over them
        (`sebulba.runtime.sharding.learner_sharding(learner_devices)`):

        - a per-env leaf [E, ...] as [L, E / L_local, ...]: the env axis split in order,
          this process's d-th learner device holding envs [d E / L_local, (d + 1) E /
          L_local), as the trajectory's rows are split (`sharding.shard_env_axis`);
        - a 0-d leaf as [L], the same value on every device;
        - dtypes unchanged, typed PRNG keys kept typed.

        The learner's functions see one device's entry: leaves [E / L_local, ...] (and
        0-d ones) lined up row for row with its trajectory shard. The run checks the
        layout of the first result (type, sharding, shapes) when it starts, but cannot
        check the order: envs split in another order (interleaved, say) would pair each
        trajectory row with another env's StepState, silently.

        Default: `sharding.shard_env_axis`, which does all this. An override may place
        them otherwise (another transfer path) but must return the same layout.
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
    check_step_state_rows(agent, step_state, num_envs)
    acting = jax.eval_shape(agent.acting_nets, nets, jnp.zeros((), jnp.int32))
    actor_output, _ = jax.eval_shape(agent.step, step_state, acting, env_step)
    check_actor_output(actor_output, num_envs, agent.env_spec.action_space)

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
    check_unchanged("step", "step_state", given, returned,
                    "a StepState keeps its structure, shapes and dtypes from step to step")
    return strongly_typed(returned)


# The agent contract's checks: each runs once, where a hook is traced (at the loop's start
# or a function's first compile), never per step, and names the hook, the leaf and what
# was expected of it.


def _leaf(x) -> str:
    """A leaf as the contract's messages show it: dtype[shape] (a Python scalar's too)."""
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def check_step_state_rows(agent: Agent, step_state: StepState, num_envs: int) -> None:
    """ValueError unless every leaf of `step_state`, which `agent.new_step_state` made for
    `num_envs` envs, is per env ([num_envs, ...]) or 0-d (shared by all envs): the loop
    slices a StepState along its first axis into its env groups' rows, so a leaf of
    other rows would run on empty or other envs' rows (a counter of 8 rows for 16 envs),
    and a vector that is not per env (per-action counts) would be cut apart."""
    for path, x in jax.tree_util.tree_leaves_with_path(step_state):
        if jnp.ndim(x) > 0 and jnp.shape(x)[0] != num_envs:
            raise ValueError(
                f"{type(agent).__name__}.new_step_state(nets, key, num_envs={num_envs}) "
                f"returned step_state{jax.tree_util.keystr(path)} of shape "
                f"{tuple(jnp.shape(x))}; a StepState leaf with axes is per env, its first "
                f"axis the {num_envs} envs (shape ({num_envs}, ...)): the loop splits it "
                "among the env groups and the learner devices by rows. Only 0-d leaves are "
                "shared by all envs")


def check_actor_output(output: ActorOutput, num_envs: int, action_space: gym.Space,
                       hook: str = "step") -> None:
    """ValueError unless `output` (what `Agent.<hook>` returned for `num_envs` envs,
    traced or abstract) holds actions [num_envs, *action_space.shape] of a dtype the
    action space takes (integers for Discrete and MultiDiscrete, numbers for Box) and
    extras whose every leaf is per env ([num_envs, ...]): the env would otherwise
    refuse the actions deep in its thread, and the trajectory's rows be split wrongly
    over the learner devices."""
    if not isinstance(output, ActorOutput):
        raise TypeError(f"Agent.{hook} must return (sebulba.ActorOutput(action, extras), "
                        f"step_state); its first element is a {type(output).__name__}")
    action = output.action
    want = (num_envs, *action_space.shape)
    # A Box takes any number (integers too: a bang-bang controller's), the others
    # integers; never bools, whose meaning as an action no space says.
    box = isinstance(action_space, gym.spaces.Box)
    kinds = (jnp.integer, jnp.floating) if box else (jnp.integer,)
    dtype = jnp.result_type(action)
    if tuple(jnp.shape(action)) != want or not any(jnp.issubdtype(dtype, k) for k in kinds):
        raise ValueError(
            f"Agent.{hook} returned action {_leaf(action)}; the env's action space "
            f"{action_space!r} takes [{num_envs} envs, *{tuple(action_space.shape)}] = "
            f"{list(want)} of {'a numeric' if box else 'an integer'} dtype")
    for path, x in jax.tree_util.tree_leaves_with_path(output.extras):
        if jnp.ndim(x) == 0 or jnp.shape(x)[0] != num_envs:
            raise ValueError(
                f"Agent.{hook} returned extras{jax.tree_util.keystr(path)} {_leaf(x)}; "
                f"extras are per env: each leaf's first axis is the {num_envs} envs the "
                f"step acted for ([{num_envs}, ...]), recorded as [envs, T, ...] in the "
                "trajectory (a value shared by all envs goes in every row, e.g. "
                "jnp.broadcast_to(x, (E,)), or in acting_nets)")


def _node(treedef: jax.tree_util.PyTreeDef) -> str:
    """A pytree node in words: a leaf, None, or its container and what it holds."""
    data = treedef.node_data()
    if data is None:
        return "a leaf"
    kind, aux = data
    if kind is type(None):
        return "None"
    if isinstance(kind, type) and issubclass(kind, Mapping):
        return f"a {kind.__name__} of keys {list(aux)}"
    return f"a {kind.__name__} of {len(treedef.children())}"


def _child_key(treedef: jax.tree_util.PyTreeDef, i: int) -> str:
    kind, aux = treedef.node_data()
    if isinstance(kind, type) and issubclass(kind, Mapping):
        return f"[{list(aux)[i]!r}]"
    if hasattr(kind, "_fields"):
        return f".{kind._fields[i]}"
    return f"[{i}]"


def _structure_difference(given: PyTree, returned: PyTree) -> tuple[str, str, str]:
    """Where `returned`'s structure first departs from `given`'s: the path of the first
    node (depth first) whose container, keys or number of children differ, and that
    node of `returned` and of `given` in words."""

    def first(g: jax.tree_util.PyTreeDef, r: jax.tree_util.PyTreeDef, path: str
              ) -> tuple[str, str, str] | None:
        if g == r:
            return None
        if g.node_data() != r.node_data() or len(g.children()) != len(r.children()):
            return path, _node(r), _node(g)
        for i, (gc, rc) in enumerate(zip(g.children(), r.children(), strict=True)):
            found = first(gc, rc, path + _child_key(g, i))
            if found is not None:
                return found
        return None

    given_def, returned_def = jax.tree.structure(given), jax.tree.structure(returned)
    return first(given_def, returned_def, "") or ("", str(returned_def), str(given_def))


def check_unchanged(hook: str, name: str, given: PyTree, returned: PyTree, why: str) -> None:
    """ValueError unless `returned`, the `name` that `Agent.<hook>` returned for the one
    it was `given` (traced or abstract), has `given`'s structure, shapes and dtypes;
    it names the first leaf that differs and `why` the hook must keep them."""
    if jax.tree.structure(returned) != jax.tree.structure(given):
        path, got, want = _structure_difference(given, returned)
        raise ValueError(f"Agent.{hook} returned {name}{path} as {got}; it was given "
                         f"{want} ({why})")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(given),
                            jax.tree.leaves(returned), strict=True):
        if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
            raise ValueError(
                f"Agent.{hook} returned {name}{jax.tree_util.keystr(path)} {_leaf(y)}; it "
                f"was given {_leaf(x)} ({why})")


def checked_metrics(metrics: Metrics, hook: str = "loss") -> Metrics:
    """`metrics` (name -> scalar, traced) with Python and NumPy scalars made float32
    arrays; a ValueError naming a metric that is not a scalar (reported as one float,
    averaged over the learner devices)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"Agent.{hook} returns (loss, (experience, metrics)) with metrics a "
                        f"dict of name -> scalar; got a {type(metrics).__name__}")
    checked = {}
    for name, x in metrics.items():
        if isinstance(x, bool | int | float | np.number | np.bool_):
            x = jnp.asarray(x, jnp.float32)
        elif not isinstance(x, jax.Array | np.ndarray):
            raise TypeError(f"Agent.{hook} returned metric {name!r} as a "
                            f"{type(x).__name__}; a metric is a scalar (an array of shape "
                            "(), or a Python number)")
        if jnp.ndim(x) != 0:
            raise ValueError(
                f"Agent.{hook} returned metric {name!r} {_leaf(x)}; a metric is a scalar "
                "(shape ()), reported as one float: reduce it (jnp.mean, jnp.max) or "
                "report each entry as a metric of its own")
        checked[name] = x
    return checked


def check_sharded_step_state(agent: Agent, step_state: StepState, sharded: StepState,
                             learner_devices: Sequence[jax.Device]) -> None:
    """ValueError unless `sharded`, `agent.shard_step_state(step_state, learner_devices)`,
    keeps to that hook's contract: every leaf a global jax.Array split along its first
    axis over `learner_devices` (their mesh, `sharding.learner_sharding`), of shape
    [L, E / L_local, ...] for a per-env leaf [E, ...] and [L] for a 0-d one, of its
    dtype (L the learner devices, L_local this process's). The envs' order over the
    devices cannot be checked here (see `Agent.shard_step_state`)."""
    name = f"{type(agent).__name__}.shard_step_state"
    if jax.tree.structure(sharded) != jax.tree.structure(step_state):
        path, got, want = _structure_difference(step_state, sharded)
        raise ValueError(f"{name} returned step_state{path} as {got}; it was given {want}")
    want_sharding = sharding.learner_sharding(learner_devices)
    num, local = len(learner_devices), len(sharding.local_devices_of(learner_devices))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(step_state),
                            jax.tree.leaves(sharded), strict=True):
        leaf = f"step_state{jax.tree_util.keystr(path)}"
        shape = jnp.shape(x)
        want = (num,) if not shape else (num, shape[0] // local, *shape[1:])
        expected = (f"a jax.Array {jnp.result_type(x)}{list(want)} split along its first "
                    f"axis over the {num} learner devices, one entry each ("
                    + ("replicated: a 0-d leaf is shared" if not shape else
                       f"{shape[0]} envs, {shape[0] // local} on each device, in order")
                    + ")")
        if not isinstance(y, jax.Array):
            raise ValueError(f"{name} returned {leaf} as a {type(y).__name__}; expected "
                             f"{expected}")
        split = y.sharding.is_equivalent_to(want_sharding, y.ndim)
        if y.shape != want or y.dtype != jnp.result_type(x) or not split:
            where = (f"on {len(y.sharding.device_set)} device(s)"
                     + ("" if split else f", not split over the learner devices "
                        f"({type(y.sharding).__name__})"))
            raise ValueError(
                f"{name} returned {leaf} {_leaf(y)} {where}; expected {expected}: each "
                "learner device gets its own envs' rows, as it does of the trajectory")
