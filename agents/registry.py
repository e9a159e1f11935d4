"""Agents by name, for the launcher and evaluation: add an entry to plug a new one in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import sebulba
from agents.impala import IMPALA, IMPALAConfig
from agents.ppo import PPO, PPOConfig
from agents.r2d2 import R2D2, R2D2Config
from agents.sac import SAC, SACConfig
from agents.spg import SPG, SPGConfig


@dataclasses.dataclass(frozen=True)
class AgentEntry:
    """How to build an agent from an env spec and its config dataclass.

    The config class's fields (int, float, bool, str, or tuples of int) become launcher
    flags named `<agent>_<field>`, documented from the class docstring's `Attributes:`.
    """

    config_class: type
    build: Callable[[sebulba.EnvSpec, Any], sebulba.Agent]


AGENTS: dict[str, AgentEntry] = {
    "impala": AgentEntry(IMPALAConfig, IMPALA),
    "ppo": AgentEntry(PPOConfig, PPO),
    "r2d2": AgentEntry(R2D2Config, R2D2),
    "sac": AgentEntry(SACConfig, SAC),
    "spg": AgentEntry(SPGConfig, SPG),
}
