"""One network protocol for every agent: a torso, a core and a head, unrolled over [B, T].

    network = Unroll(torso, core, head)
    state = network.initial_state(batch)                      # () for a feed-forward core
    state, outputs = network.apply(params, state, obs, first)   # obs [B, T, ...], first [B, T]

- torso: per-step features, [B, T, *obs_shape] -> [B, T, D] (`MLP`, `NatureCNN`, one-hot),
  chosen from the observation space by `torso_for` (`sebulba.envs.observations`).
- core: the only part with memory, (state, x [B, T, D], first [B, T]) -> (state, y [B, T, D'])
  with `initial_state(batch)`. `NoCore` has the empty state `()` and passes x through;
  `LSTMCore` resets its state before every step whose `first` is set.
- head: what the agent reads off the features (`PolicyValueHead`: a distribution over
  actions and a value; `DuelingQHead`).

Acting is the T = 1 case of the same call (`act`), training unrolls a trajectory or a
segment from the state the actor had at its first step, so acting and training cannot
drift apart, and no agent branches on whether its network is recurrent (the model is
acme's `UnrollableNetwork`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np

from agents.common import distributions, normalization
from agents.common.recurrent import LSTMState, ResetLSTM, initial_lstm_state
from sebulba.envs import observations

Params = Any
CoreState = Any  # a pytree with leaves [B, ...]; () for feed-forward networks

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"tanh": nn.tanh, "relu": nn.relu}


def flatten_trailing(x: jax.Array, rank: int) -> jax.Array:
    """[..., *shape] with len(shape) == rank -> [..., prod(shape)] (images into vectors)."""
    batch_shape = x.shape[: x.ndim - rank]
    return x.reshape(batch_shape + (-1,))


# Torsos: [B, T, *obs_shape] -> [B, T, D].


class MLP(nn.Module):
    """Dense layers of `hidden_sizes` over the flattened last `obs_rank` dims.

    `activation` "tanh" uses orthogonal sqrt(2) init (CleanRL's actor-critic layers),
    "relu" Flax's default (R2D2's). With `activate_final` False the last layer is linear.
    """

    hidden_sizes: Sequence[int]
    activation: str = "tanh"
    obs_rank: int = 1
    activate_final: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = flatten_trailing(x, self.obs_rank).astype(jnp.float32)
        act = _ACTIVATIONS[self.activation]
        kwargs = ({"kernel_init": nn.initializers.orthogonal(np.sqrt(2.0))}
                  if self.activation == "tanh" else {})
        for i, size in enumerate(self.hidden_sizes):
            x = nn.Dense(size, **kwargs)(x)
            if self.activate_final or i < len(self.hidden_sizes) - 1:
                x = act(x)
        return x


# The least side the Nature CNN's unpadded convolutions keep a feature of (8/4, 4/2, 3/1).
NATURE_CNN_MIN_SIDE = 36


class NatureCNN(nn.Module):
    """The DQN Nature torso (Mnih et al., 2015): three convolutions and a 512-unit layer.

    Maps uint8 frames [..., *frame_shape] (0-255; `layout` "HWC", "CHW" or "HW", from
    `sebulba.envs.observations.image_layout`) to features [..., 512]. Frames travel as uint8
    and become NHWC floats in [0, 1] here, on the device. Its convolutions are the
    published torso's, unpadded; frames with a side under `NATURE_CNN_MIN_SIDE` take them
    padded ("SAME"), or they would leave no features and the network's outputs would
    ignore the frames.
    """

    layout: str = "HWC"

    @nn.compact
    def __call__(self, frames: jax.Array) -> jax.Array:
        rank = len(self.layout)
        batch_shape = frames.shape[:-rank]
        x = frames.reshape((-1,) + frames.shape[-rank:]).astype(jnp.float32) / 255.0
        if self.layout == "CHW":
            x = jnp.transpose(x, (0, 2, 3, 1))
        elif self.layout == "HW":
            x = x[..., None]
        init = nn.initializers.orthogonal(np.sqrt(2.0))
        padding = "VALID" if min(x.shape[1:3]) >= NATURE_CNN_MIN_SIDE else "SAME"
        for features, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
            x = nn.relu(nn.Conv(features, (kernel, kernel), (stride, stride),
                                padding=padding, kernel_init=init)(x))
        x = nn.relu(nn.Dense(512, kernel_init=init)(x.reshape(x.shape[0], -1)))
        return x.reshape(batch_shape + (512,))


class OneHot(nn.Module):
    """Discrete observations [..., *space_shape] (`rank` = len(space_shape): 0 for
    Discrete, 1 or more for MultiDiscrete) -> concatenated one-hots of their k entries,
    flattened in order, [..., sum(num_values)], float32."""

    num_values: Sequence[int]
    start: Sequence[int]
    rank: int = 1

    def __call__(self, obs: jax.Array) -> jax.Array:
        obs = flatten_trailing(obs[..., None] if self.rank == 0 else obs, max(self.rank, 1))
        return jnp.concatenate(
            [jax.nn.one_hot(obs[..., i] - s, n) for i, (n, s) in
             enumerate(zip(self.num_values, self.start, strict=True))], axis=-1)


# Cores: (state, x [B, T, D], first [B, T]) -> (state, y [B, T, D']).


class NoCore(nn.Module):
    """The feed-forward core: the empty state `()`, features passed through."""

    def initial_state(self, batch_size: int) -> tuple:
        del batch_size
        return ()

    def __call__(self, state: tuple, x: jax.Array, first: jax.Array) -> tuple[tuple, jax.Array]:
        return state, x


class LSTMCore(nn.Module):
    """An LSTM whose state is zeroed before every step whose `first` is set (`ResetLSTM`)."""

    size: int

    def initial_state(self, batch_size: int) -> LSTMState:
        return initial_lstm_state(batch_size, self.size)

    @nn.compact
    def __call__(self, state: LSTMState, x: jax.Array,
                 first: jax.Array) -> tuple[LSTMState, jax.Array]:
        return ResetLSTM(self.size, name="lstm")(state, x, first)


def core_for(lstm_size: int) -> nn.Module:
    """`LSTMCore(lstm_size)`, or `NoCore()` for lstm_size 0."""
    return LSTMCore(lstm_size) if lstm_size else NoCore()


# Heads: features [B, T, D] -> outputs.


class PolicyValue(NamedTuple):
    policy: distributions.Distribution  # batch axes [B, T]
    value: jax.Array  # [B, T]


class PolicyValueHead(nn.Module):
    """A policy (a distribution over actions, from `policy_head`, e.g.
    `distributions.policy_head_for(action_space)`) and a state value, each behind its
    own tanh MLP.

    With `central_agents` K > 1 (MAPPO's centralized critic for multi-agent envs) the
    value sees, beside the row's own features, those of all K agents of the row's env:
    every batch must hold whole envs, env-major (`joint_features`); the policy still sees
    only its own.

    With `hidden_sizes` () both are linear in the features (a shared torso and core);
    with hidden layers, the policy and the value get separate MLPs, as CleanRL's actor
    and critic: on CartPole-v1 the value loss, much larger than the policy's, otherwise
    reshapes the policy's features. Init: a near-uniform (or near-zero-mean) policy,
    unit-scale values.
    """

    policy_head: nn.Module
    hidden_sizes: Sequence[int] = ()
    central_agents: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> PolicyValue:
        policy = MLP(tuple(self.hidden_sizes), name="policy_torso")(x) if self.hidden_sizes \
            else x
        dist = self.policy_head(policy)
        if self.central_agents > 1:
            x = jnp.concatenate([x, joint_features(x, self.central_agents)], axis=-1)
        value = MLP(tuple(self.hidden_sizes), name="value_torso")(x) if self.hidden_sizes else x
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0), name="value")(value)
        return PolicyValue(dist, value[..., 0])


def joint_features(x: jax.Array, num_agents: int) -> jax.Array:
    """Each row's env's features: [B, T, F] rows env-major (K agents of an env adjacent)
    -> [B, T, K x F], the K agents' features concatenated, the same for the K rows."""
    b, t, f = x.shape
    if b % num_agents:
        raise ValueError(f"a centralized value needs whole envs of {num_agents} agents in "
                         f"each batch, got a batch of {b} rows")
    joint = x.reshape(b // num_agents, num_agents, t, f).transpose(0, 2, 1, 3)
    joint = joint.reshape(b // num_agents, 1, t, num_agents * f)
    return jnp.broadcast_to(joint, (b // num_agents, num_agents, t, num_agents * f)).reshape(
        b, t, num_agents * f)


class DuelingQHead(nn.Module):
    """Q-values [..., A] = V + A - mean(A), each stream a ReLU MLP (Wang et al., 2016)."""

    num_actions: int
    hidden_sizes: Sequence[int] = ()
    twin: bool = False  # advantage from the first half of x, value from the second

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        sizes = tuple(self.hidden_sizes)
        advantage_x, value_x = jnp.split(x, 2, axis=-1) if self.twin else (x, x)
        value = MLP(sizes + (1,), "relu", activate_final=False, name="value")(value_x)
        advantage = MLP(sizes + (self.num_actions,), "relu", activate_final=False,
                        name="advantage")(advantage_x)
        return value + advantage - jnp.mean(advantage, axis=-1, keepdims=True)


# The composition.


class Unroll(nn.Module):
    """torso -> core -> head over [B, T]; `initial_state(batch)` is the core's.

    `apply(params, state, obs [B, T, ...], first [B, T] bool)` -> (state after step T - 1,
    head outputs with leaves [B, T, ...]).
    """

    torso: nn.Module
    core: nn.Module
    head: nn.Module

    def initial_state(self, batch_size: int) -> CoreState:
        return self.core.initial_state(batch_size)

    @nn.compact
    def __call__(self, state: CoreState, obs: jax.Array, first: jax.Array) -> tuple[CoreState, Any]:
        chex.assert_rank(first, 2)
        chex.assert_equal_shape_prefix((obs, first), 2)
        state, x = self.core(state, self.torso(obs), first)
        return state, self.head(x)


def init(network: Unroll, key: jax.Array, observation_space: gym.Space) -> Params:
    """Parameters of `network` for observations of `observation_space` (one env)."""
    batch = getattr(network.head, "central_agents", 1)  # one env's agents, for a central value
    obs = jnp.zeros((batch, 1) + tuple(observation_space.shape),
                    observations.host_dtype(observation_space))
    return network.init(key, network.initial_state(batch), obs, jnp.ones((batch, 1), bool))


def act(network: Unroll, params: Params, state: CoreState, obs: jax.Array,
        first: jax.Array) -> tuple[CoreState, Any]:
    """One acting step, the T = 1 unroll: obs [E, ...], first [E] -> (state, outputs [E, ...])."""
    chex.assert_rank(first, 1)
    state, outputs = network.apply(params, state, obs[:, None], first[:, None])
    return state, jax.tree.map(lambda x: x[:, 0], outputs)


def encoder_for(observation_space: gym.Space) -> nn.Module:
    """Observations -> float features with no parameters: one-hot for discrete spaces,
    flattened floats for vector spaces (frames need a learnt torso: `torso_for`)."""
    kind = observations.kind(observation_space)
    if kind == observations.DISCRETE:
        start = np.atleast_1d(np.asarray(observation_space.start)).reshape(-1)
        return OneHot(tuple(int(n) for n in observations.num_discrete_values(observation_space)),
                      tuple(int(x) for x in start), len(observation_space.shape))
    return MLP((), obs_rank=len(observation_space.shape))


def torso_for(observation_space: gym.Space, hidden_sizes: Sequence[int],
              activation: str = "tanh") -> nn.Module:
    """The torso for an observation space (`sebulba.envs.observations` decides its kind): the
    Nature CNN for frames, else the encoder followed by an MLP of `hidden_sizes`."""
    kind = observations.kind(observation_space)
    if kind == observations.IMAGE:
        return NatureCNN(observations.image_layout(observation_space))
    if kind == observations.DISCRETE:
        return nn.Sequential([encoder_for(observation_space), MLP(tuple(hidden_sizes),
                                                                  activation)])
    return MLP(tuple(hidden_sizes), activation, obs_rank=len(observation_space.shape))


# Policy and value that share no weights, as the pieces of one `Unroll` (IMPALA's LSTM
# agent): the features are the policy's and the value's side by side.


class TwinTorso(nn.Module):
    """Two torsos over the same observations; features [..., D_policy + D_value]."""

    policy: nn.Module
    value: nn.Module

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.concatenate([self.policy(x), self.value(x)], axis=-1)


class TwinLSTMCore(nn.Module):
    """Two resetting LSTMs of `size` units, over the two halves of the features (from
    `TwinTorso`, two torsos of equal sizes); state (policy's, value's) `LSTMState`s."""

    size: int

    def initial_state(self, batch_size: int) -> tuple[LSTMState, LSTMState]:
        return (initial_lstm_state(batch_size, self.size),
                initial_lstm_state(batch_size, self.size))

    @nn.compact
    def __call__(self, state: tuple[LSTMState, LSTMState], x: jax.Array,
                 first: jax.Array) -> tuple[tuple[LSTMState, LSTMState], jax.Array]:
        policy_x, value_x = jnp.split(x, 2, axis=-1)
        policy_state, policy_y = ResetLSTM(self.size, name="policy_lstm")(
            state[0], policy_x, first)
        value_state, value_y = ResetLSTM(self.size, name="value_lstm")(
            state[1], value_x, first)
        return (policy_state, value_state), jnp.concatenate([policy_y, value_y], axis=-1)


class TwinHead(nn.Module):
    """The policy from the first half of the features, a linear value from the second
    (with `central_agents` K > 1, and the K agents' second halves: `PolicyValueHead`)."""

    policy_head: nn.Module
    central_agents: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> PolicyValue:
        policy_x, value_x = jnp.split(x, 2, axis=-1)
        if self.central_agents > 1:
            value_x = jnp.concatenate(
                [value_x, joint_features(value_x, self.central_agents)], axis=-1)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0), name="value")(value_x)
        return PolicyValue(self.policy_head(policy_x), value[..., 0])


def actor_critic(action_space: gym.Space, observation_space: gym.Space,
                 hidden_sizes: Sequence[int], lstm_size: int = 0, *,
                 state_dependent_std: bool = False,
                 normalize_observations: bool = False, central_agents: int = 1) -> Unroll:
    """The policy/value network agents share, for an observation and an action space
    (the policy's distribution: `distributions.policy_head_for`).

    With `normalize_observations`, vector observations are standardized by running
    moments held in the networks' "normalization" collection
    (`normalization.ObservationNormalizer`; frames are scaled to [0, 1] and discrete
    observations one-hot encoded instead). With `central_agents` K > 1 the value is
    centralized over the K agents of each env (`PolicyValueHead`).

    - frames: Nature CNN torso shared by linear policy and value heads (pixels are
      expensive to encode twice), then the core;
    - vectors or discrete observations, no LSTM: separate tanh MLPs of `hidden_sizes` for
      policy and value over the flattened (or one-hot) observation;
    - with an LSTM (`lstm_size` > 0): a tanh MLP torso of `hidden_sizes`, the LSTM, linear
      heads.
    """
    head = distributions.policy_head_for(action_space, state_dependent_std=state_dependent_std)
    kind = observations.kind(observation_space)
    if kind == observations.IMAGE:
        return Unroll(torso_for(observation_space, ()), core_for(lstm_size),
                      PolicyValueHead(head, central_agents=central_agents))
    normalize = normalize_observations and kind == observations.VECTOR
    rank = len(observation_space.shape)

    def normalized(torso: nn.Module) -> nn.Module:
        if not normalize:
            return torso
        return nn.Sequential([normalization.ObservationNormalizer(rank), torso])

    if lstm_size:
        return Unroll(normalized(torso_for(observation_space, hidden_sizes)),
                      LSTMCore(lstm_size), PolicyValueHead(head, central_agents=central_agents))
    return Unroll(normalized(encoder_for(observation_space)), NoCore(),
                  PolicyValueHead(head, tuple(hidden_sizes), central_agents))
