"""The learner: its state on the learner devices, its compiled functions, one update.

One learner update takes K = `trajectories_per_update` queue items (K inference cycles
of any groups, in queue order, each sharded over the learner devices) and runs, on
every learner device at once:

    initial, final, trajectory = the K items joined along the env axis   # if K > 1
    nets = agent.update_statistics(nets, trajectory)     # if the agent keeps statistics
    experience = agent.update_experience(experience, initial, final, trajectory, nets)
    repeat agent.optimizer_steps_per_update(layout):     # optimizer steps
        if agent.ready_to_learn(experience) on every learner device:
            loss -> grads -> pmean over the learner devices -> agent.optimize_from_grads
    publish agent.acting_nets(nets, updates) to every inference device's staging

Each compiled function is `jax.jit(jax.shard_map(...))` over the 1-D learner mesh, the
modern form of `pmap` (JAX's own `pmap` is implemented this way since 0.8). Arguments and
results carry a leading learner axis; the agent's functions see one device's entry,
without that axis. Gradients and metrics are averaged with `pmean` over the mesh.

The join is one compiled call on the learner devices (no host round trip): each device
concatenates its own pieces, [E / L, ...] of each item, into [K x E / L, ...], item k in
rows [k x E / L, (k + 1) x E / L); 0-d leaves (replicated, [L] globally) are the first
item's. Its results are sharded as the items are (leading learner axis over the learner
mesh), so `update_experience` compiles once whatever K is.

Units: `updates` counts learner updates (K trajectories learnt from each); policy lag
is in these units. `optimizer_steps` counts the optimizer steps run, skipped ones
included.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sebulba.agent import (
    Agent,
    Layout,
    check_unchanged,
    checked_metrics,
    combine_partitions,
)
from sebulba.runtime import sharding, transfers
from sebulba.runtime.accounting import Accounting
from sebulba.runtime.channels import QueueItem, Staging
from sebulba.types import Experience, Metrics, Nets, OptState, PyTree

LEARNER_AXIS = sharding.LEARNER_AXIS
# Optimizer steps the devices may have queued: after dispatching a step the learner
# waits for the one this many steps before it. XLA:CPU with several (simulated) devices
# hangs, then aborts on an all-reduce timeout, once about 37 collective programs are
# queued (JAX 0.10.2, measured on 2 cores); a short queue also lets a stop cut an update
# within a few steps, while the devices still always have a step queued.
MAX_QUEUED_STEPS = 3


def per_learner_device(
    fn: Callable, devices: Sequence[jax.Device], donate_argnums: tuple[int, ...]
) -> Callable:
    """Compiles `fn` to run on each learner device on its own entry of every argument."""

    def on_one_device(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

    mesh = sharding.learner_mesh(tuple(devices))
    spec = P(LEARNER_AXIS)
    mapped = jax.shard_map(on_one_device, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(mapped, donate_argnums=donate_argnums)


def env_axis_joiner(devices: Sequence[jax.Device]) -> Callable:
    """Compiles `join(trees) -> tree`: K pytrees of global [L, E / L, ...] arrays (per-env
    leaves) or [L] arrays (0-d leaves, replicated) joined on the learner devices.

    Per-env leaves are concatenated along axis 1, the env axis after the learner axis
    ([L, K x E / L, ...], tree k's envs in rows [k x E / L, (k + 1) x E / L) of every
    device); 0-d leaves are taken from the first tree. Each device joins its own pieces
    (a `shard_map`, no communication), and the result keeps the inputs' sharding.
    """

    def join(trees):
        def leaf(*xs):
            if xs[0].ndim <= 1:  # [1] on this device: a replicated 0-d leaf
                return xs[0]
            return jnp.concatenate(xs, axis=1)

        return jax.tree.map(leaf, *trees)

    mesh = sharding.learner_mesh(tuple(devices))
    spec = P(LEARNER_AXIS)
    return jax.jit(jax.shard_map(join, mesh=mesh, in_specs=spec, out_specs=spec))


def optimizer_step(agent: Agent, nets: Nets, opt: OptState, experience: Experience
                   ) -> tuple[Nets, OptState, Experience, Metrics]:
    """One optimizer step on one learner device's entry (inside the learner's shard_map).

    Skipped, with everything unchanged, unless `agent.ready_to_learn` holds on every
    learner device. Metrics are averaged over the devices, with `loss` added, and
    `learning` (1 where the step ran, 0 where it was skipped and every other metric is
    0) where the agent overrides `ready_to_learn`.
    """

    def learn(nets, opt, experience):
        diff, fixed = agent.partition_for_grad(nets)

        def loss_fn(diff_nets):
            loss, aux = _checked_loss(
                agent.loss(combine_partitions(diff_nets, fixed), opt, experience))
            check_unchanged("loss", "experience", experience, aux[0], _KEEPS)
            return loss, (aux[0], checked_metrics(aux[1]))

        (loss, (experience, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(diff)
        grads = jax.lax.pmean(grads, LEARNER_AXIS)
        returned = agent.optimize_from_grads(nets, opt, grads)
        if not isinstance(returned, tuple) or len(returned) != 2:
            raise ValueError(f"Agent.optimize_from_grads must return (nets, opt); it "
                             f"returned a {type(returned).__name__}")
        check_unchanged("optimize_from_grads", "nets", nets, returned[0], _KEEPS)
        check_unchanged("optimize_from_grads", "opt", opt, returned[1], _KEEPS)
        nets, opt = returned
        # Averaged here, in the branch: the same on every device, as the skip's zeros are
        # (shard_map types must match, and a metric may be per-device or a constant).
        return nets, opt, experience, jax.lax.pmean({**metrics, "loss": loss}, LEARNER_AXIS)

    ready = agent.ready_to_learn(experience)
    if ready is True:  # the default: no conditional in the compiled step
        return learn(nets, opt, experience)
    ready = jnp.asarray(ready, bool)
    # One verdict for all devices: a collective inside only some devices' branch would hang.
    ready = jax.lax.pmin(ready.astype(jnp.int32), LEARNER_AXIS) > 0
    out_shapes = jax.eval_shape(learn, nets, opt, experience)

    def skip(nets, opt, experience):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes[3])
        return nets, opt, experience, zeros

    nets, opt, experience, metrics = jax.lax.cond(ready, learn, skip, nets, opt, experience)
    return nets, opt, experience, {**metrics, "learning": ready.astype(jnp.float32)}


# Why a learner hook returns what it was given, in shapes and dtypes: its result is the
# next call's argument (donated), so another would compile the learner's functions again
# at each call, or fail there far from the hook; and what is published must not change.
_KEEPS = ("a learner hook returns the structure, shapes and dtypes it was given: its "
          "result is its next call's argument, compiled for them")


def _checked_loss(returned: PyTree) -> tuple[jax.Array, tuple[Experience, Metrics]]:
    """`Agent.loss`'s result, a ValueError unless it is (scalar loss, (experience,
    metrics)) (traced: once, where the optimizer step is first traced)."""
    if (not isinstance(returned, tuple) or len(returned) != 2
            or not isinstance(returned[1], tuple) or len(returned[1]) != 2):
        raise ValueError("Agent.loss must return (loss, (experience, metrics)); it returned "
                         f"{jax.tree.structure(returned)}")
    loss = returned[0]
    if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        raise ValueError(
            f"Agent.loss returned a loss {jnp.result_type(loss)}{list(jnp.shape(loss))}; the "
            "loss is a floating scalar (shape ()) to differentiate: reduce it (jnp.mean), "
            "and return what else to report as metrics")
    return returned


def _checked_update_experience(agent: Agent) -> Callable:
    """`agent.update_experience`, refusing (at trace time) an experience of another
    structure, shape or dtype than it was given."""

    def fn(experience, initial, final, trajectory, nets):
        returned = agent.update_experience(experience, initial, final, trajectory, nets)
        check_unchanged("update_experience", "experience", experience, returned, _KEEPS)
        return returned

    return fn


def _checked_update_statistics(agent: Agent) -> Callable:
    """`agent.update_statistics`, refusing (at trace time) networks of another
    structure, shape or dtype than it was given."""

    def fn(nets, trajectory):
        returned = agent.update_statistics(nets, trajectory)
        check_unchanged("update_statistics", "nets", nets, returned, _KEEPS)
        return returned

    return fn


def _acting_nets_and_finite(agent: Agent) -> Callable:
    """`agent.acting_nets`, with a [leaves] bool vector: which of its leaves are finite.
    Python numbers in it (an epsilon of 0.1) become arrays, as `step` receives them."""

    def fn(nets, updates):
        acting = jax.tree.map(jnp.asarray, agent.acting_nets(nets, updates))
        flags = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                 else jnp.array(True) for x in jax.tree.leaves(acting)]
        return acting, jnp.stack(flags) if flags else jnp.ones((0,), bool)

    return fn


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed at run time (a peer died): XLA raises
    a JaxRuntimeError, or gloo's all-reduce a ValueError ("Gloo all-reduce failed:
    ... Connection reset by peer"); a ValueError of tracing is not one."""
    return isinstance(error, jax.errors.JaxRuntimeError) or "Gloo" in str(error)


class Learner:
    """Owns the learner state of a run and runs learner updates on it.

    Construction compiles nothing; `start` places a state on the learner devices (the
    compiled functions are reused by later runs). Metrics are fetched one update late,
    so the host never waits for the device to finish the update it just dispatched; it
    waits for the previous one before dispatching the next, and inside an update every
    `MAX_QUEUED_STEPS` optimizer steps, so the devices never hold an unbounded queue.
    """

    def __init__(self, agent: Agent, devices: Sequence[jax.Device], layout: Layout, *,
                 check_finite: bool = True):
        k = layout.trajectories_per_update
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"trajectories_per_update must be an int >= 1, got {k!r}")
        optims = agent.optimizer_steps_per_update(layout)
        if not isinstance(optims, int) or isinstance(optims, bool) or optims < 0:
            raise ValueError(
                f"{type(agent).__name__}.optimizer_steps_per_update(layout) must be an int "
                f">= 0, got {optims!r}")
        self.agent = agent
        self.devices = list(devices)  # the learner mesh: every process's learner devices
        self.optims_per_update = optims
        self.trajectories_per_update = k
        self.check_finite = check_finite
        self.num_processes = len({d.process_index for d in self.devices})
        self._first_local = sharding.local_devices_of(self.devices)[0]
        self._join = env_axis_joiner(self.devices)
        self._update_experience = per_learner_device(
            _checked_update_experience(agent), self.devices, donate_argnums=(0,))
        self._update_statistics = None  # compiled only for agents that keep statistics
        if type(agent).update_statistics is not Agent.update_statistics:
            self._update_statistics = per_learner_device(
                _checked_update_statistics(agent), self.devices, donate_argnums=(0,))
        self._optimize = per_learner_device(
            lambda n, o, e: optimizer_step(agent, n, o, e), self.devices,
            donate_argnums=(0, 1, 2))
        self._acting_nets = jax.jit(_acting_nets_and_finite(agent))
        mesh = sharding.learner_mesh(tuple(self.devices))
        self._any = jax.jit(jax.shard_map(
            lambda flag: jax.lax.pmax(flag, LEARNER_AXIS), mesh=mesh,
            in_specs=P(LEARNER_AXIS), out_specs=P(LEARNER_AXIS)))
        self.start(None, None, None)

    def check_hooks(self, nets: PyTree, opt: PyTree, experience: PyTree,
                    step_state: PyTree, trajectory: PyTree) -> None:
        """Traces the learner's functions on one learner device's shapes (abstract or
        concrete leaves, without the learner axis: `step_state` and `trajectory` as one
        update's shard, [K x E / L, ...]), compiling and allocating nothing: an agent's
        learner hook that breaks its contract (an experience, networks or optimizer
        state of another structure, dtype or shape than it was given, a metric that is
        not a scalar) is a ValueError naming the hook and the leaf now, before a run
        starts, rather than at its first update. The trace is the one the first update
        compiles (same shapes and shardings), so it costs no second one."""
        learner_sharding = sharding.learner_sharding(self.devices)

        def on_mesh(tree):  # as the learner's arguments are: [L, ...] over the mesh
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (len(self.devices), *jnp.shape(x)), jnp.result_type(x),
                sharding=learner_sharding), tree)

        nets, opt, experience = on_mesh(nets), on_mesh(opt), on_mesh(experience)
        step_state, trajectory = on_mesh(step_state), on_mesh(trajectory)
        if self._update_statistics is not None:
            jax.eval_shape(self._update_statistics, nets, trajectory)
        jax.eval_shape(self._update_experience, experience, step_state, step_state,
                       trajectory, nets)
        if self.optims_per_update:
            jax.eval_shape(self._optimize, nets, opt, experience)

    def start(self, nets: Nets | None, opt: OptState | None, experience: PyTree | None, *,
              stagings: Iterable[Staging] = (), accounting: Accounting | None = None,
              updates: int = 0) -> None:
        """Takes the learner state of a run (leaves [num_learners, ...], on the mesh) and
        publishes its networks to `stagings`."""
        self.nets, self.opt, self.experience = nets, opt, experience
        self.stagings = list(stagings)
        self.accounting = accounting if accounting is not None else Accounting()
        self.updates = updates
        self.optimizer_steps = 0
        self.steps_cut = 0  # optimizer steps left out of updates cut short (see `update`)
        self.metrics: dict[str, float] = {}
        self._pending: tuple[int, Metrics, jax.Array] | None = None  # update, metrics, finite
        self.published: Nets | None = None
        self._stop_vote: jax.Array | None = None
        if nets is not None:
            self.publish()

    def vote_to_stop(self, wanted: bool) -> bool:
        """Whether every process of the run stops now: casts this process's vote and
        returns the outcome of the previous call's (true if any process voted to stop).

        All processes call it once per learner update, so they see the same outcomes at
        the same update and stop together (a process that stopped alone would leave the
        others waiting in a collective). The vote is a tiny all-reduce read one update
        late, like the metrics, so the learner never waits for it; a single process
        needs none and gets its own vote at once.
        """
        if self.num_processes == 1:
            return wanted
        previous, local = self._stop_vote, sharding.local_devices_of(self.devices)
        flags = sharding.assemble(
            [jax.device_put(np.asarray(wanted, np.int32), d) for d in local], self.devices)
        with self._naming_peer_failures():
            self._stop_vote = self._any(flags)
            return previous is not None and bool(transfers.to_host(
                previous.addressable_shards[0].data, "learner: stop vote to host")[0])

    @contextlib.contextmanager
    def _naming_peer_failures(self) -> Iterator[None]:
        """Re-raises a collective that failed in a multi-process run as the likely cause."""
        try:
            yield
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if self.num_processes > 1 and is_collective_failure(e):
                raise RuntimeError(
                    f"the learner's update across {self.num_processes} processes failed; a "
                    f"peer process probably died or became unreachable: {e}") from e
            raise

    def publish(self) -> None:
        """Sends `acting_nets(nets, updates)` of the first local replica to every staging."""
        single = sharding.first_replica(self.nets)
        version = transfers.to_device(np.int32(self.updates), self._first_local,
                                      "learner: version to device")
        self.published, self._published_finite = self._acting_nets(single, version)
        for staging in self.stagings:
            staging.publish(self.updates, self.published)

    def update(self, items: Sequence[QueueItem],
               cut: Callable[[float], bool] | None = None) -> None:
        """One learner update on `trajectories_per_update` items (in queue order; a bare
        QueueItem is one item): join, update_experience, optimizer steps, publish.

        `cut(seconds)`, asked between optimizer steps with the time the remaining steps
        would take (estimated without the first step's: see `_optimizer_steps`), ends the
        update there when true (a stop with a deadline). The update still counts, with
        fewer optimizer steps (`steps_cut` counts those left out): its state is as
        consistent as a full update's. Only for single-process runs, where no
        other process waits in the left-out steps' collectives.
        """
        if isinstance(items, QueueItem):
            items = [items]
        if len(items) != self.trajectories_per_update:
            raise ValueError(
                f"a learner update takes trajectories_per_update="
                f"{self.trajectories_per_update} queue items, got {len(items)}")
        with self._naming_peer_failures():
            t_wait = time.perf_counter()
            # The previous update's metrics: it has had this update's host work to finish
            # in, and waiting for it bounds the programs queued on the devices. The wait
            # is the previous update's optimizing, and is counted as such.
            self._fetch_pending()
            t0 = time.perf_counter()
            if len(items) == 1:
                item = items[0]
                initial, final, trajectory = (
                    item.initial_step_state, item.final_step_state, item.trajectory)
            else:
                initial, final, trajectory = self._join(tuple(
                    (i.initial_step_state, i.final_step_state, i.trajectory) for i in items))
            if self._update_statistics is not None:
                self.nets = self._update_statistics(self.nets, trajectory)
            self.experience = self._update_experience(
                self.experience, initial, final, trajectory, self.nets)
            t1 = time.perf_counter()
            metrics, steps = self._optimizer_steps(cut)
            self.optimizer_steps += steps
            self.steps_cut += self.optims_per_update - steps
            self.updates += 1
            # (An agent without optimizer steps learns in its statistics or experience
            # alone: its networks still move on, and are checked.)
            if metrics is not None or not self.optims_per_update:
                self.publish()
                self._pending = (self.updates, metrics or {}, self._published_finite)
            t2 = time.perf_counter()
        self.accounting.add_time("update_experience", t1 - t0)
        self.accounting.add_time("optimize", t2 - t1 + t0 - t_wait)

    def _optimizer_steps(self, cut: Callable[[float], bool] | None
                         ) -> tuple[Metrics | None, int]:
        """Runs the update's optimizer steps, with at most MAX_QUEUED_STEPS queued on the
        devices (or fewer: see `update`'s `cut`); the last step's metrics and the steps run.

        The remaining steps' time given to `cut` is estimated from the steps that ended
        after the first one: the first step of a run's first update (after a start or a
        resume) holds the XLA compilation, seconds for steps of milliseconds, and
        averaged in it made every remaining step look that slow, cutting an update that
        would have ended well within the deadline. Until a second step has ended there is
        no estimate, and `cut` is asked with 0 s: the update is cut then only if its
        deadline has passed already (a compilation slow enough to use up the time), never
        on a guess. A stop is for a grace period: an update that ends in time must not
        lose steps, and one that would not is cut at the next step once measured.
        """
        planned, queued = self.optims_per_update, collections.deque()
        metrics, dispatched, done = None, 0, 0
        first_done: tuple[float, int] | None = None  # (when, steps done) at the first end
        while dispatched < planned:
            if cut is not None and first_done is not None:
                since, done_then = first_done
                remaining_s = ((time.perf_counter() - since) / (done - done_then)
                               * (planned - done) if done > done_then else 0.0)
                if cut(remaining_s):
                    break
            self.nets, self.opt, self.experience, metrics = self._optimize(
                self.nets, self.opt, self.experience)
            dispatched += 1
            queued.append(metrics)
            if len(queued) == MAX_QUEUED_STEPS and dispatched < planned:
                jax.block_until_ready(queued.popleft())
                done = dispatched - len(queued)
                if first_done is None:
                    first_done = (time.perf_counter(), done)
        return metrics, dispatched

    def device_busy(self) -> bool:
        """Whether the last update still runs on the devices (its metrics and published
        networks not ready yet): `update` returns once its work is dispatched."""
        return self._pending is not None and not all(
            x.is_ready() for x in jax.tree.leaves(self._pending[1:]))

    def finish(self) -> None:
        """Fetches the last update's metrics (and checks them): at the end of a run, and
        before its state is copied out (a checkpoint must not hold NaN networks that the
        next update's check would only then report)."""
        with self._naming_peer_failures():
            self._fetch_pending()

    def _fetch_pending(self) -> None:
        if self._pending is None:
            return
        updates, metrics, finite = self._pending
        self._pending = None
        # One transfer: the first local replica of every metric (all equal: pmean), and
        # the published networks' finite flags.
        names = list(metrics)
        *fetched, finite = transfers.to_host_all(
            [metrics[k].addressable_shards[0].data for k in names] + [finite],
            "learner: metrics to host")
        values = {k: float(x[0]) for k, x in zip(names, fetched, strict=True)}
        if self.check_finite and not np.isfinite(values.get("loss", 0.0)):
            raise FloatingPointError(
                f"the learner's loss is {values['loss']} after update {updates}; metrics: {values}")
        if self.check_finite and not np.all(finite):
            # NaN can reach the acting networks without showing in the loss (a loss that
            # does not read them, an optimizer step that overflows after it).
            paths = [jax.tree_util.keystr(p) for p, _ in
                     jax.tree_util.tree_flatten_with_path(self.published)[0]]
            bad = [p for p, ok in zip(paths, finite, strict=True) if not ok]
            raise FloatingPointError(
                f"the networks published after update {updates} hold NaN or inf, first in "
                f"{bad[0]} ({len(bad)} of {len(paths)} leaves); metrics: {values}")
        self.metrics = values
