"""sebulba: the Sebulba actor-learner architecture (Podracers) for JAX and Gymnasium."""

from sebulba.agent import Agent, Layout, combine_partitions, zeros_trajectory
from sebulba.config import Config
from sebulba.envs import env_spec
from sebulba.runtime.accounting import RunResult
from sebulba.runtime.loop import Sebulba
from sebulba.types import ActorOutput, AgentState, EnvSpec, EnvStep, Trajectory

__all__ = [
    "ActorOutput",
    "Agent",
    "AgentState",
    "Config",
    "EnvSpec",
    "EnvStep",
    "Layout",
    "RunResult",
    "Sebulba",
    "Trajectory",
    "combine_partitions",
    "env_spec",
    "zeros_trajectory",
]
