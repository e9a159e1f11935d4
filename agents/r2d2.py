"""R2D2: recurrent experience replay in distributed RL (Kapturowski et al., 2019).

An LSTM Q-network learns from prioritized replay of fixed-length sequences, starting
each sequence from the recurrent state the actor had there, warmed up by a burn-in
prefix, with n-step double Q-learning on rescaled values and a periodically copied
target network. Read top to bottom: config, networks, state, acting, experience,
loss, optimizer.

How it fits the Sebulba loop:

- Sequences come from whole inference cycles. `steps_per_cycle` (T) must equal the
  sequence period, `sequence_length - sequence_overlap` (40 with the defaults 80 and
  40), and divide `sequence_length` (L); anything else is an error when the state is
  built, naming both numbers. A trajectory's `initial_step_state` then holds exactly
  the actor's LSTM state at a sequence start. The experience keeps, per env, the last
  L - T env steps and the K - 1 start states (K = L / T) of its previous trajectories;
  those plus the current trajectory make one L-step sequence (L + 1 env steps with the
  bootstrap step), inserted once the env has sent K trajectories. Each env step is
  thus in K sequences, and learnt from in those where it is past the burn-in.
  (The paper's "80 with a burn-in of 40" can be read as 80 including the burn-in, the
  defaults here, or 40 + 80: sequence_length=120, sequence_overlap=80, burn_in=40.)
- The learner receives trajectories without their group. So the StepState carries
  each env's index in its process (`env_index`) and the experience its slot: env i is
  row (i % E) % (E / D) of group i // E's trajectories on its learner device (E envs
  per group, D learner devices), which is how the loop assigns envs to groups and
  `shard_step_state` splits them; its slot is (i // E) x (E / D) + that row, with E and
  E / D stored in the experience. An update may join several trajectories
  (`Config.trajectories_per_update`), so its rows can come from several groups, or
  hold one env twice (two cycles of one group, the earlier first): rows of one env are
  applied in row order, each sequence built from what the previous one left pending.
- Episode boundaries (NEXT_STEP autoreset): `first` resets the LSTM in acting and in
  training (one network, `agents.common.networks`, unrolled over T = 1 or L steps); the
  action at an episode's last step was ignored by the env and is masked out of the
  loss; `terminated` bootstraps 0, `truncated` and the sequence's end bootstrap from the
  target network.
- Replay: `sebulba.experience.replay`, one per learner device (the framework keeps one
  experience per learner device), `replay_capacity` sequences each; new sequences enter at the
  largest priority seen, priorities are eta max|td| + (1 - eta) mean|td| over the
  learnt steps and are written back by `loss`, which returns the updated experience.
  Each learner device samples `batch_size` sequences with its own key.
- Reward scale: with `normalize_rewards` the experience keeps the running moments of
  the rewards received (`normalization.merged`, over every learner device) and the loss
  learns from rewards divided by their RMS; acting never sees them.
- Warm-up: `ready_to_learn` is False until every learner device's replay holds
  `min_replay_size` sequences; until then the learner skips the optimizer steps
  entirely (Adam's moments and count, the step counter and the target copy stay where
  they were), so the first real update is a first Adam step.
- Target network: `sebulba.target_network`; `nets` is `OnlineAndTarget`, the target is
  kept out of the gradient and out of what actors receive (`acting_nets` publishes the
  online network only) and is copied from the online one every `target_update_period`
  optimizer steps that ran (counted in the optimizer state).
- Exploration: env i of the N acting envs of the whole run uses eps_i =
  epsilon_base^(1 + epsilon_alpha i / (N - 1)) (Ape-X). `new_step_state` is asked for
  the run's N envs (with several processes the loop keeps each process's rows of
  them), so i and N are its own; the experience finds an env's slot from i modulo the
  envs of one process. Evaluation uses `greedy_step`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence as SequenceType
from typing import NamedTuple

import gymnasium as gym
import jax
import jax.numpy as jnp
import optax

import sebulba
from agents.common import checks, networks, normalization
from agents.common.returns import action_mask
from agents.common.value_rescaling import rescale, unrescale
from sebulba import target_network
from sebulba.envs import observations
from sebulba.experience import replay as rp
from sebulba.runtime.sharding import own_key
from sebulba.types import EnvStep, Metrics, Nets, PyTree, Trajectory


@dataclasses.dataclass(frozen=True)
class R2D2Config:
    """R2D2's hyperparameters; the defaults learn the memory suite within 1M env steps
    (benchmarks/RESULTS.md, "The memory suite").

    They keep the paper's sequences, value rescaling, priorities and exploration. They
    differ where the paper's are sized for billions of frames: 3-step returns (Rainbow's n;
    the paper's 5 learn more slowly), dueling streams with a torso and an LSTM each,
    rewards learnt in units of their running RMS, and a learner sized for about 1M steps
    (two learner steps of 32 sequences per trajectory, a target copy every 100 learner
    steps, learning from 500 sequences on, Adam at 5e-4 with epsilon 1e-6). With the
    paper's learner (one step of 64, a copy every 2,500 steps, 1e-4, epsilon 1e-3), 1M
    env steps make 1,560 learner steps, none of which copies the target. Frames get the
    paper's network (Nature CNN, a 512-cell LSTM, 512-unit heads); vector observations a
    128-wide one.

    Attributes:
      torso_sizes: ReLU layers applied to vector observations (frames go through the
        Nature CNN instead).
      lstm_size: LSTM cells; with use_lstm False, the width of a ReLU layer instead.
        0: by observation, 512 for frames (the paper's), 128 otherwise.
      head_sizes: hidden ReLU layers of each dueling head (value and advantage); ():
        one layer as wide as the LSTM.
      use_lstm: False swaps the LSTM for a ReLU layer: a feed-forward Q network with
        everything else unchanged, the baseline that shows what memory buys.
      sequence_length: steps of a replayed sequence, burn-in included (L).
      sequence_overlap: steps shared by consecutive sequences of an env;
        sequence_length - sequence_overlap must equal steps_per_cycle and divide
        sequence_length.
      burn_in: leading steps of a sequence that only refresh the LSTM state (no loss,
        no gradient); at most sequence_overlap, so that the sequence before learns them.
      n_step: steps of reward before bootstrapping the Q-learning target.
      discount: per-step discount.
      value_rescaling: learn h(Q) with h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x.
      value_rescaling_eps: the eps of h.
      target_update_period: learner steps between copies of the online network to the
        target network.
      learning_rate: Adam step size.
      adam_eps: Adam's epsilon. 1e-6, not the paper's 1e-3: with small rewards (1/50 a
        step) the gradients' scale falls below 1e-3 and Adam's steps shrink with it
        (benchmarks/RESULTS.md, "The memory suite").
      max_grad_norm: gradients are clipped to this global norm; 0 turns clipping off.
      batch_size: sequences each learner device samples per learner step.
      replay_capacity: sequences each learner device's replay holds.
      min_replay_size: sequences a learner device's replay must hold before it learns.
      updates_per_trajectory: learner (optimizer) steps per received trajectory, so K x
        this per learner update of K = `Config.trajectories_per_update` trajectories
        (the replay ratio, updates x batch_size / sequences per trajectory shard, does
        not depend on K).
      priority_exponent: alpha, sampling probability p^alpha / sum p^alpha.
      importance_exponent: beta, importance weights (N P(i))^-beta.
      priority_eta: eta, priority eta max|td| + (1 - eta) mean|td|.
      epsilon_base: exploration rate of the most exploring env.
      epsilon_alpha: env i of N explores with epsilon_base^(1 + epsilon_alpha i / (N - 1)).
      shared_core: with an LSTM, the dueling head's value and advantage streams share
        one torso and one LSTM. False (the default): each has its own of the same sizes,
        so that the value, which tracks the return still to come, does not reshape the
        memory the advantages need. Frames always share one Nature CNN and LSTM.
      normalize_rewards: rewards are divided, for learning only, by the running root
        mean square of the rewards received (kept in the experience; 1 before any), so
        that a task paying 1/46 a step is learnt like one paying 1 (raw, Adam's steps
        move Q by more than such an action gap). Acting is unaffected (argmax is
        scale-free).
    """

    torso_sizes: SequenceType[int] = (128,)
    lstm_size: int = 0
    head_sizes: SequenceType[int] = ()
    use_lstm: bool = True
    sequence_length: int = 80
    sequence_overlap: int = 40
    burn_in: int = 40
    n_step: int = 3
    discount: float = 0.997
    value_rescaling: bool = True
    value_rescaling_eps: float = 1e-3
    target_update_period: int = 100
    learning_rate: float = 5e-4
    adam_eps: float = 1e-6
    max_grad_norm: float = 0.0
    batch_size: int = 32
    replay_capacity: int = 100_000
    min_replay_size: int = 500
    updates_per_trajectory: int = 2
    priority_exponent: float = 0.9
    importance_exponent: float = 0.6
    priority_eta: float = 0.9
    epsilon_base: float = 0.4
    epsilon_alpha: float = 7.0
    shared_core: bool = False
    normalize_rewards: bool = True

    def __post_init__(self):
        checks.ints(self, "lstm_size", "sequence_overlap", "burn_in", low=0)
        checks.ints(self, "sequence_length", "n_step", "target_update_period", "batch_size",
                    "replay_capacity", "min_replay_size", "updates_per_trajectory")
        checks.sizes(self, "torso_sizes", "head_sizes")
        if self.sequence_overlap >= self.sequence_length:
            raise ValueError(
                f"sequence_overlap={self.sequence_overlap} must be < sequence_length="
                f"{self.sequence_length}")
        if self.sequence_length % self.sequence_period:
            raise ValueError(
                f"sequence_length={self.sequence_length} must be a multiple of its period, "
                f"sequence_length - sequence_overlap = {self.sequence_period}")
        if self.burn_in >= self.sequence_length:
            raise ValueError(
                f"burn_in={self.burn_in} must be < sequence_length={self.sequence_length}: "
                "some steps must be learnt from")
        if self.burn_in > self.sequence_overlap:
            # Each sequence learns its steps after the burn-in, the next one starts
            # sequence_length - sequence_overlap later: steps in between are never learnt.
            raise ValueError(
                f"burn_in={self.burn_in} must be <= sequence_overlap={self.sequence_overlap}:"
                f" else {self.burn_in - self.sequence_overlap} of every "
                f"{self.sequence_period} env steps fall in a burn-in and are never learnt "
                "from (raise sequence_overlap, with sequence_length, or lower burn_in)")
        if self.min_replay_size > self.replay_capacity:
            raise ValueError(
                f"min_replay_size={self.min_replay_size} must be <= replay_capacity="
                f"{self.replay_capacity}, or learning never starts")
        checks.reals(self, "discount", "importance_exponent", "priority_eta", low=0.0,
                     high=1.0)
        checks.reals(self, "epsilon_base", low=0.0, high=1.0, open_low=True)
        checks.reals(self, "priority_exponent", "epsilon_alpha", "value_rescaling_eps",
                     "max_grad_norm", low=0.0, high=sys.float_info.max,
                     expected="a finite number >= 0")
        checks.reals(self, "learning_rate", "adam_eps", low=0.0, high=sys.float_info.max,
                     open_low=True, expected="a finite number > 0")

    def resolved(self, observation_space: gym.Space) -> R2D2Config:
        """This config with the sizes left to the observation filled in (`lstm_size` 0,
        `head_sizes` ())."""
        lstm = self.lstm_size or (512 if observations.kind(observation_space)
                                  == observations.IMAGE else 128)
        return dataclasses.replace(self, lstm_size=lstm,
                                   head_sizes=tuple(self.head_sizes) or (lstm,))

    @property
    def sequence_period(self) -> int:
        """Steps between the starts of consecutive sequences of an env (must be T)."""
        return self.sequence_length - self.sequence_overlap


# Networks.


def q_network(num_actions: int, observation_space: gym.Space, config: R2D2Config
              ) -> networks.Unroll:
    """Torso (Nature CNN for frames, else a ReLU MLP of `torso_sizes`),
    resetting LSTM core (or, without use_lstm, one more ReLU layer of `lstm_size` in the
    torso), dueling Q head: (state, obs [B, T, ...], first [B, T]) -> Q [B, T, A]."""
    sizes = tuple(config.torso_sizes) + (() if config.use_lstm else (config.lstm_size,))
    twin = (config.use_lstm and not config.shared_core
            and observations.kind(observation_space) != observations.IMAGE)
    torso = networks.torso_for(observation_space, sizes, "relu")
    if twin:
        torso = networks.TwinTorso(torso, networks.torso_for(observation_space, sizes, "relu"))
    if config.use_lstm:
        core = networks.TwinLSTMCore(config.lstm_size) if twin else networks.LSTMCore(
            config.lstm_size)
    else:
        core = networks.NoCore()
    return networks.Unroll(torso, core, networks.DuelingQHead(num_actions, config.head_sizes,
                                                              twin=twin))


# State.


class R2D2StepState(NamedTuple):
    core: networks.CoreState  # leaves [E, ...]: the state before acting on the next step
    key: jax.Array  # [E] typed PRNG keys
    epsilon: jax.Array  # [E] float32 exploration rate of each env
    env_index: jax.Array  # [E] int32 index of the env in the run (finds its slot)


class Sequence(NamedTuple):
    """One replay item (leaves without batch axis; [C, ...] in the replay)."""

    env_steps: EnvStep  # leaves [L + 1, ...]; entry L is the bootstrap step
    action: jax.Array  # [L] actions taken at env steps 0..L-1
    core: networks.CoreState  # leaves [...]: the actor's state before it acted on step 0
    env_index: jax.Array  # int32, the env it came from (diagnostics, tests)


class PendingSteps(NamedTuple):
    """Per env slot S, what the next sequence needs from earlier trajectories."""

    env_steps: EnvStep  # leaves [S, L - T, ...]: the last L - T env steps received
    action: jax.Array  # [S, L - T]
    core: networks.CoreState  # leaves [S, K - 1, ...]: start states of the last K - 1
    # trajectories
    received: jax.Array  # [S] int32 trajectories received, capped at K - 1


class R2D2Experience(NamedTuple):
    replay: rp.Replay  # items: Sequence
    pending: PendingSteps
    reward_moments: dict  # running moments of the rewards received (normalization)
    envs_per_group: jax.Array  # int32 scalar, E of the layout (to find an env's slot)
    envs_per_shard: jax.Array  # int32 scalar, E / D: rows of one trajectory on a device
    envs_per_process: jax.Array  # int32 scalar, the envs of one process (all its groups)
    key: jax.Array  # typed PRNG key for sampling


class R2D2OptState(NamedTuple):
    adam: PyTree
    steps: jax.Array  # int32 optimizer steps applied (skipped warm-up steps excluded)


class R2D2(sebulba.Agent):
    """R2D2 for Discrete action spaces (see the module docstring)."""

    needs_consecutive_trajectories = True  # sequences span an env's consecutive cycles

    def __init__(self, env_spec: sebulba.EnvSpec, config: R2D2Config = R2D2Config()):
        super().__init__(env_spec)
        if not isinstance(env_spec.action_space, gym.spaces.Discrete):
            raise ValueError(
                f"R2D2 acts in Discrete action spaces only, got {env_spec.action_space!r}; "
                "PPO, IMPALA and SPG act in Discrete, MultiDiscrete and Box spaces")
        self.config = config = config.resolved(env_spec.observation_space)
        self.network = q_network(env_spec.num_actions, env_spec.observation_space, config)
        optimizer = optax.adam(config.learning_rate, eps=config.adam_eps)
        if config.max_grad_norm > 0:
            optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optimizer)
        self.optimizer = optimizer

    def new_networks(self, key: jax.Array) -> target_network.OnlineAndTarget:
        return target_network.new(
            networks.init(self.network, key, self.env_spec.observation_space))

    def new_step_state(self, nets: Nets, key: jax.Array, num_envs: int) -> R2D2StepState:
        cfg = self.config
        # The run's envs: the loop keeps each process's rows of them.
        index = jnp.arange(num_envs, dtype=jnp.int32)
        epsilon = cfg.epsilon_base ** (1.0 + cfg.epsilon_alpha * index / max(num_envs - 1, 1))
        return R2D2StepState(
            core=self.network.initial_state(num_envs),
            key=jax.random.split(key, num_envs),
            epsilon=epsilon.astype(jnp.float32),
            env_index=index,
        )

    def new_opt_state(self, nets: Nets, key: jax.Array) -> R2D2OptState:
        return R2D2OptState(self.optimizer.init(nets.online), jnp.zeros((), jnp.int32))

    def new_experience_state(self, nets: Nets, key: jax.Array,
                              layout: sebulba.Layout) -> R2D2Experience:
        cfg = self.config
        if layout.steps_per_cycle != cfg.sequence_period:
            raise ValueError(
                f"steps_per_cycle={layout.steps_per_cycle} must equal the sequence period "
                f"sequence_length - sequence_overlap = {cfg.sequence_length} - "
                f"{cfg.sequence_overlap} = {cfg.sequence_period}: R2D2 builds its sequences "
                "from whole trajectories, starting from their initial LSTM states")
        rows = layout.envs_per_learner_shard  # of one trajectory (group), E / D
        if layout.envs_per_update_shard > cfg.replay_capacity:
            raise ValueError(
                f"replay_capacity={cfg.replay_capacity} is smaller than the "
                f"{layout.envs_per_update_shard} sequences one update brings each learner "
                f"device ({layout.trajectories_per_update} trajectories x {rows} envs)")
        L, T = cfg.sequence_length, cfg.sequence_period
        window, starts = L - T, L // T - 1
        example = sebulba.zeros_trajectory(self, nets, 1, L)
        item = Sequence(
            env_steps=jax.tree.map(lambda x: x[0], example.env_steps),
            action=example.actor_outputs.action[0],
            core=jax.tree.map(lambda x: x[0], self.network.initial_state(1)),
            env_index=jnp.zeros((), jnp.int32),
        )
        slots = layout.num_groups * rows
        pending = PendingSteps(
            env_steps=jax.tree.map(
                lambda x: jnp.zeros((slots, window) + x.shape[1:], x.dtype), item.env_steps),
            action=jnp.zeros((slots, window), item.action.dtype),
            core=jax.tree.map(lambda x: jnp.zeros((slots, starts) + x.shape, x.dtype),
                              item.core),
            received=jnp.zeros((slots,), jnp.int32),
        )
        return R2D2Experience(
            replay=rp.new_replay(item, cfg.replay_capacity,
                                 priority_exponent=cfg.priority_exponent),
            pending=pending,
            reward_moments=normalization.new_moments(()),
            envs_per_group=jnp.asarray(layout.envs_per_group, jnp.int32),
            envs_per_shard=jnp.asarray(rows, jnp.int32),
            envs_per_process=jnp.asarray(layout.total_envs, jnp.int32),
            key=key,
        )

    # Acting: `nets` are the online network's parameters (`acting_nets`).

    def acting_nets(self, nets: target_network.OnlineAndTarget,
                    learner_updates: jax.Array) -> PyTree:
        return nets.online

    def step(self, step_state: R2D2StepState, nets: PyTree,
             env_step: EnvStep) -> tuple[sebulba.ActorOutput, R2D2StepState]:
        """Epsilon-greedy on Q, with each env's own epsilon."""
        core, q = networks.act(self.network, nets, step_state.core, env_step.obs,
                               env_step.first)  # q [E, A]
        keys = jax.vmap(lambda k: jax.random.split(k, 3))(step_state.key)  # [E, 3]
        explore = jax.vmap(jax.random.uniform)(keys[:, 0]) < step_state.epsilon
        random_action = jax.vmap(
            lambda k: jax.random.randint(k, (), 0, q.shape[-1]))(keys[:, 1])
        action = jnp.where(explore, random_action, jnp.argmax(q, axis=-1))
        return sebulba.ActorOutput(action), step_state._replace(core=core, key=keys[:, 2])

    def greedy_step(self, step_state: R2D2StepState, nets: PyTree,
                    env_step: EnvStep) -> tuple[sebulba.ActorOutput, R2D2StepState]:
        core, q = networks.act(self.network, nets, step_state.core, env_step.obs,
                               env_step.first)
        return sebulba.ActorOutput(jnp.argmax(q, axis=-1)), step_state._replace(core=core)

    # Experience: sequences into the replay.

    def update_experience(
        self,
        experience: R2D2Experience,
        initial_step_state: R2D2StepState,
        final_step_state: R2D2StepState,
        trajectory: Trajectory,
        nets: Nets,
    ) -> R2D2Experience:
        """Joins each env's pending steps with this update's trajectories ([B, T(+1), ...],
        B = trajectories_per_update x E / D rows) into one sequence per row, inserts it
        once the env has sent enough, and keeps the new tail.

        A row's slot comes from its env index, so rows may come from any groups. Rows of
        one env (several cycles of one group in one update) are applied in row order:
        pass r handles each env's r-th row, so it sees what the env's previous row left.
        """
        experience = experience._replace(reward_moments=normalization.received_rewards_merged(
            experience.reward_moments, trajectory))
        index = initial_step_state.env_index % experience.envs_per_process  # [B]
        e, rows = experience.envs_per_group, experience.envs_per_shard
        slot = (index // e) * rows + (index % e) % rows  # [B]
        # How many earlier rows of this update belong to the same env: 0 for all rows
        # unless one group sent several of the update's trajectories.
        same = slot[:, None] == slot[None, :]
        rank = jnp.sum(jnp.tril(same, k=-1), axis=1)  # [B]

        def one_pass(r, experience):
            return self._add_rows(experience, slot, rank == r, initial_step_state, trajectory)

        return jax.lax.fori_loop(0, jnp.max(rank) + 1, one_pass, experience)

    def _add_rows(self, experience: R2D2Experience, slot: jax.Array, active: jax.Array,
                  initial_step_state: R2D2StepState, trajectory: Trajectory
                  ) -> R2D2Experience:
        """`update_experience` for the `active` rows [B], whose slots are distinct."""
        cfg = self.config
        L, T = cfg.sequence_length, cfg.sequence_period
        pending = experience.pending

        def rows_of(x):
            return x[slot]

        steps = jax.tree.map(lambda old, new: jnp.concatenate([rows_of(old), new], axis=1),
                             pending.env_steps, trajectory.env_steps)  # [B, L + 1]
        action = jnp.concatenate(
            [rows_of(pending.action), trajectory.actor_outputs.action.astype(
                pending.action.dtype)], axis=1)  # [B, L]
        starts = jax.tree.map(rows_of, pending.core)  # [B, K - 1, ...]
        starts = jax.tree.map(lambda s, x: jnp.concatenate([s, x[:, None]], axis=1),
                              starts, initial_step_state.core)  # [B, K, ...]
        sequences = Sequence(
            env_steps=steps,
            action=action,
            core=jax.tree.map(lambda s: s[:, 0], starts),
            env_index=initial_step_state.env_index,
        )
        complete = rows_of(pending.received) >= L // T - 1
        replay = rp.insert(experience.replay, sequences, complete & active)
        # Inactive rows write out of bounds, which the scatter drops.
        target = jnp.where(active, slot, pending.received.shape[0])

        def write(old, new):
            return old.at[target].set(new, mode="drop")

        pending = PendingSteps(
            env_steps=jax.tree.map(lambda old, s: write(old, s[:, T:L]), pending.env_steps,
                                   steps),
            action=write(pending.action, action[:, T:L]),
            core=jax.tree.map(lambda old, s: write(old, s[:, 1:]), pending.core, starts),
            received=write(pending.received,
                           jnp.minimum(rows_of(pending.received) + 1, L // T - 1)),
        )
        return experience._replace(replay=replay, pending=pending)

    def num_off_policy_optims_per_cycle(self) -> int:
        """`updates_per_trajectory`: the optimizer steps of an update of one trajectory."""
        return self.config.updates_per_trajectory

    def optimizer_steps_per_update(self, layout: sebulba.Layout) -> int:
        """`updates_per_trajectory` for each of the update's trajectories: the replay
        ratio is the same whatever `Config.trajectories_per_update`."""
        return self.config.updates_per_trajectory * layout.trajectories_per_update

    # Learning.

    def sequence_losses(self, nets: Nets, sequences: Sequence,
                        reward_scale: jax.Array | float = 1.0
                        ) -> tuple[jax.Array, jax.Array, Metrics]:
        """Per-sequence losses [b] and priorities [b] of sequences with leaves [b, ...].

        The online network runs the burn-in from the stored state under stop_gradient,
        then the learnt steps; the target network runs the whole sequence. The loss of
        a sequence is the mean over its learnt, non-ignored steps of td^2 / 2.
        """
        cfg = self.config
        steps, burn = sequences.env_steps, cfg.burn_in
        online, target = nets.online, jax.lax.stop_gradient(nets.target)
        unroll = self.network.apply
        core = sequences.core
        if burn:
            core, _ = unroll(online, core, steps.obs[:, :burn], steps.first[:, :burn])
            core = jax.lax.stop_gradient(core)
        _, q = unroll(online, core, steps.obs[:, burn:], steps.first[:, burn:])
        _, q_target = unroll(target, sequences.core, steps.obs, steps.first)
        q_target = q_target[:, burn:]  # [b, M + 1, A], M = L - burn_in learnt steps

        # Double Q: the online network picks the bootstrap action, the target values it.
        best = jnp.argmax(jax.lax.stop_gradient(q), axis=-1)
        bootstrap = jnp.take_along_axis(q_target, best[..., None], axis=-1)[..., 0]
        if cfg.value_rescaling:
            bootstrap = unrescale(bootstrap, cfg.value_rescaling_eps)
        tail = jax.tree.map(lambda x: x[:, burn:], steps)
        returns = jax.vmap(n_step_returns, in_axes=(0, 0, 0, 0, None, None, 0))(
            tail.reward * reward_scale, bootstrap, tail.terminated, tail.truncated,
            cfg.discount, cfg.n_step, tail.first)
        if cfg.value_rescaling:
            returns = rescale(returns, cfg.value_rescaling_eps)
        taken = jnp.take_along_axis(q[:, :-1], sequences.action[:, burn:, None], axis=-1)[..., 0]
        td = jax.lax.stop_gradient(returns) - taken  # [b, M]
        mask = jax.vmap(action_mask)(tail.terminated, tail.truncated, tail.first)  # [b, M]
        count = jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        losses = 0.5 * jnp.sum(mask * td**2, axis=1) / count
        abs_td = jax.lax.stop_gradient(jnp.abs(td)) * mask
        priorities = (cfg.priority_eta * jnp.max(abs_td, axis=1)
                      + (1.0 - cfg.priority_eta) * jnp.sum(abs_td, axis=1) / count)
        metrics = {
            "q_taken": jnp.sum(mask * taken) / jnp.maximum(jnp.sum(mask), 1.0),
            "abs_td": jnp.sum(abs_td) / jnp.maximum(jnp.sum(mask), 1.0),
        }
        return losses, priorities, metrics

    def loss(self, nets: Nets, opt: R2D2OptState,
             experience: R2D2Experience) -> tuple[jax.Array, tuple[R2D2Experience, Metrics]]:
        """Importance-weighted loss of a prioritized batch; writes back its priorities."""
        cfg = self.config
        key, sample_key = jax.random.split(experience.key)
        replay = experience.replay
        batch = rp.sample(replay, own_key(sample_key), cfg.batch_size,
                          cfg.importance_exponent)
        reward_scale = self.reward_scale(experience)
        losses, priorities, metrics = self.sequence_losses(nets, batch.items, reward_scale)
        loss = jnp.mean(batch.weights * losses)
        replay = rp.update_priorities(replay, batch.indices, priorities)
        metrics = {
            **metrics,
            "replay_size": replay.size.astype(jnp.float32),
            "reward_scale": reward_scale,
            "priority_mean": jnp.mean(priorities),
            "importance_weight_mean": jnp.mean(batch.weights),
        }
        return loss, (experience._replace(replay=replay, key=key), metrics)

    def reward_scale(self, experience: R2D2Experience) -> jax.Array:
        """What rewards are multiplied by for learning: with `normalize_rewards`, one over
        the running root mean square of the rewards received (1 before any)."""
        if not self.config.normalize_rewards:
            return jnp.ones((), jnp.float32)
        return normalization.inverse_rms(experience.reward_moments)

    def ready_to_learn(self, experience: R2D2Experience) -> jax.Array:
        """Learning starts once the replay holds `min_replay_size` sequences."""
        return experience.replay.size >= self.config.min_replay_size

    def partition_for_grad(self, nets: target_network.OnlineAndTarget):
        """Differentiates the online network only."""
        return target_network.partition_for_grad(nets)

    def optimize_from_grads(self, nets: target_network.OnlineAndTarget, opt: R2D2OptState,
                            grads: PyTree) -> tuple[target_network.OnlineAndTarget,
                                                    R2D2OptState]:
        """Adam on the online network, target copy every `target_update_period` steps."""
        updates, adam = self.optimizer.update(grads.online, opt.adam, nets.online)
        online = optax.apply_updates(nets.online, updates)
        steps = opt.steps + 1
        nets = target_network.refresh(nets, online, steps, self.config.target_update_period)
        return nets, R2D2OptState(adam, steps)


def n_step_returns(reward: jax.Array, bootstrap: jax.Array, terminated: jax.Array,
                   truncated: jax.Array, discount: float, n: int,
                   first: jax.Array | None = None) -> jax.Array:
    """n-step returns of one sequence, stopping at episode ends, seams and the sequence's
    end.

    G_t = sum_{k<j} discount^k reward[t+k+1] + discount^j v_{t+j}, where j is n or
    fewer: the first k >= 1 such that step t + k ends the episode (then v is 0 if it
    terminated and bootstrap[t+k] if truncated), is followed by a `first` step (a seam:
    the steps before a resume joined to the reset envs after it; v is bootstrap[t+k], as
    if truncated there), or is the sequence's last step M. So no return takes a reward or
    a value from another episode.

    Args:
      reward: [M + 1] float, reward[t] follows the action at t - 1.
      bootstrap: [M + 1] float, value of each step's observation (raw scale).
      terminated: [M + 1] bool.
      truncated: [M + 1] bool.
      discount: scalar in [0, 1].
      n: steps, >= 1 (static).
      first: [M + 1] bool, optional: where an episode starts.

    Returns:
      [M] float32 returns for t = 0..M-1 (meaningless where `action_mask` is 0, which
      with `first` includes the step before each seam).
    """
    m = reward.shape[0] - 1
    stop = terminated | truncated
    if first is not None:  # the step before an episode's start ends the stream there
        stop = stop | jnp.append(first[1:], False)
    stop = stop.at[m].set(True)  # the sequence's end bootstraps too
    end_value = jnp.where(terminated, 0.0, bootstrap)
    t = jnp.arange(m)
    returns = jnp.zeros((m,), jnp.float32)
    scale = jnp.ones((m,), jnp.float32)
    running = jnp.ones((m,), bool)
    for k in range(1, n + 1):
        i = jnp.minimum(t + k, m)  # once clipped, `running` is already False
        returns = returns + jnp.where(running, scale * reward[i], 0.0)
        scale = scale * discount
        ends = stop[i] | (k == n)
        returns = returns + jnp.where(running & ends, scale * end_value[i], 0.0)
        running = running & ~ends
    return returns
