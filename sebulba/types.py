"""The data that flows between env groups, inferencers and the learner.

Shapes use `E` for the envs of one env group (or of one learner shard) and `T` for
`steps_per_cycle`. Per-env leaves always carry the env axis first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import gymnasium as gym
import jax

PyTree = Any
Nets = PyTree  # the agent's network parameters (a pytree of arrays)
OptState = PyTree
Experience = PyTree
StepState = PyTree
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """The spaces of one (unbatched) env; agents build their networks from it
    (`sebulba.envs.observations` says what kind of observation the space holds).

    With `agents_per_env` K > 1 (a multi-agent env, `sebulba.envs.pettingzoo_source`) the spaces are
    one agent's, shared by all K, and each env gives K rows, env-major, to every batch.
    """

    observation_space: gym.Space
    action_space: gym.spaces.Discrete | gym.spaces.MultiDiscrete | gym.spaces.Box
    agents_per_env: int = 1

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return tuple(self.observation_space.shape)

    @property
    def num_actions(self) -> int:
        """Number of discrete actions; an error for continuous action spaces."""
        if not isinstance(self.action_space, gym.spaces.Discrete):
            raise TypeError(f"num_actions needs a Discrete action space, got {self.action_space}")
        return int(self.action_space.n)


class EnvStep(NamedTuple):
    """What the env gave back, the input of one acting step (dm_env-like semantics).

    Gymnasium's NEXT_STEP autoreset is used: after a step with `terminated | truncated`
    the env ignores the next action and returns the first observation of a new episode
    with reward 0. So every observation the env emits appears in the trajectory, the
    final one of a truncated episode included (its value is the bootstrap).

    Attributes:
      obs: [E, *obs_shape] observation to act on.
      reward: [E] float32 reward for the previous action (0 on a `first` step).
      terminated: [E] bool, `obs` ends the episode and its value is 0.
      truncated: [E] bool, `obs` ends the episode by a time limit; bootstrap from it.
      first: [E] bool, `obs` starts an episode: recurrent state resets here.
    """

    obs: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    first: jax.Array


class ActorOutput(NamedTuple):
    """What `Agent.step` returns besides the new StepState.

    Attributes:
      action: [E, *action_shape] sent to the env.
      extras: pytree of [E, ...] leaves recorded in the trajectory, e.g. the behaviour
        policy's logits (IMPALA) or log-probability and value (PPO). `()` if none.
    """

    action: jax.Array
    extras: PyTree = ()


class Trajectory(NamedTuple):
    """One inference cycle of one env group.

    `env_steps` has one more time entry than `actor_outputs`: entry T is the env step
    the last action led to (reward and bootstrap observation). It is also entry 0 of
    the group's next trajectory, so consecutive trajectories overlap by one env step.

    Attributes:
      env_steps: EnvStep with leaves [E, T + 1, ...].
      actor_outputs: ActorOutput with leaves [E, T, ...].
    """

    env_steps: EnvStep
    actor_outputs: ActorOutput


class AgentState(NamedTuple):
    """The whole state of an agent.

    The learner owns `nets`, `opt` and `experience` (one copy per learner device); the
    inferencers own `step_state`, split along the env axis into one slice per env group.
    """

    nets: Nets
    opt: OptState
    experience: Experience
    step_state: StepState
