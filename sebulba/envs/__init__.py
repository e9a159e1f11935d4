"""Env sources: where env steps come from.

`base` holds the protocol every source follows (`EnvSource`) and the host side of one env
step; one module per source (`gymnasium_source`, `async_workers`, `envpool_source`,
`pettingzoo_source`); `output_checks` checks what envs return (`BadEnvOutput`);
`frame_stacks` describes observations that stack an env's last frames (`FrameStack`);
`registry` maps each `Config.vectorization` name to its source; `suite` holds the small
envs with known optima that sebulba ships for tests.
"""

from sebulba.envs.base import (
    EnvSource,
    EpisodeTracker,
    action_to_env,
    check_spaces,
    example_env_step,
)
from sebulba.envs.frame_stacks import FrameStack
from sebulba.envs.output_checks import BadEnvOutput
from sebulba.envs.registry import (
    EnvSourceKind,
    SourceRequest,
    env_spec,
    names,
    register,
    unregister,
)

__all__ = [
    "BadEnvOutput",
    "EnvSource",
    "EnvSourceKind",
    "EpisodeTracker",
    "FrameStack",
    "SourceRequest",
    "action_to_env",
    "check_spaces",
    "env_spec",
    "example_env_step",
    "names",
    "register",
    "unregister",
]
