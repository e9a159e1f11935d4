"""Agents by name, for the launcher and evaluation: add an entry, or `register` one from a
script of your own, to plug a new one in."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from typing import Any

import gymnasium as gym

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
SHIPPED = frozenset(AGENTS)  # the agents of this package; `register` adds others


def register(name: str, config_class: type,
             build: Callable[[sebulba.EnvSpec, Any], sebulba.Agent]) -> None:
    """Adds agent `name` to `AGENTS`, for a launcher of your own that imports
    `examples.train` after registering (the launcher defines `--agent`'s values and the
    `--<name>_<field>` flags when it is imported). `build(env_spec, config)` makes the agent
    from the run's env spec and an instance of `config_class`, a dataclass whose fields all
    have defaults (docs/writing-an-agent.md, "A launcher option")."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"an agent's name must be lowercase letters, digits and _ (it "
                         f"prefixes its flags: --<name>_<field>), got {name!r}")
    if name in AGENTS:
        if AGENTS[name] == AgentEntry(config_class, build):
            return  # registered already, as it is: nothing changes
        raise ValueError(f"agent {name!r} is registered already (as "
                         f"{AGENTS[name].build!r}); choose another name")
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"agent {name!r}: config_class must be a dataclass (its fields "
                        f"become flags), got {config_class!r}")
    if not callable(build):
        raise TypeError(f"agent {name!r}: build must be callable as build(env_spec, config), "
                        f"got {build!r}")
    if "examples.train" in sys.modules:
        raise RuntimeError(f"register agent {name!r} before importing examples.train: the "
                           "launcher defines --agent's values and the agents' flags as it "
                           "is imported")
    AGENTS[name] = AgentEntry(config_class, build)


# The version of the agents' defaults a checkpoint records ("agent_defaults"; absent: 1).
# Bumped where a default changes what an older checkpoint's networks do once loaded, or
# how a resumed run learns on, so that loading one says so instead of acting or learning
# otherwise in silence (`changed_since`, `unresumable_since`).
DEFAULTS_VERSION = 3


def _ppo_rewards_were_raw(version: int, agent_name: str, config: Any,
                          space: gym.Space) -> bool:
    """Before version 2 PPO's normalize_rewards "auto" left discrete actions' rewards
    raw (without an LSTM)."""
    return (version < 2 and agent_name == "ppo" and config.normalize_rewards == "auto"
            and not isinstance(space, gym.spaces.Box) and not config.use_lstm)


def _spg_rewards_were_raw(version: int, agent_name: str, config: Any) -> bool:
    """Before version 3 SPG learnt raw rewards (it had no normalize_rewards)."""
    return version < 3 and agent_name == "spg" and config.normalize_rewards != "off"


def config_as_written(version: int, agent_name: str, config: Any, space: gym.Space) -> Any:
    """`config` (of agent `agent_name`, saved under agents' defaults `version`) with what
    its "auto" meant then made explicit where a field can say it: PPO's
    normalize_rewards "off" for discrete actions before version 2, SPG's before version
    3."""
    if _ppo_rewards_were_raw(version, agent_name, config, space):
        return dataclasses.replace(config, normalize_rewards="off")
    if _spg_rewards_were_raw(version, agent_name, config):
        return dataclasses.replace(config, normalize_rewards="off")
    return config


def changed_since(version: int, agent_name: str, config: Any, space: gym.Space) -> list[str]:
    """What agent `agent_name` with `config` in `space` does otherwise with networks
    written under agents' defaults `version`: one sentence each, empty where nothing
    changed (`config_as_written` first removes what a field can still say)."""
    from agents.common.distributions import box_units

    changes = []
    if (version < 2 and agent_name in ("ppo", "impala", "spg")
            and isinstance(space, gym.spaces.Box) and box_units(space) is not None):
        changes.append(
            f"the Gaussian policy works in units of the action space's bounds since version "
            f"2 ({space}: the same networks act on another scale)")
    if _ppo_rewards_were_raw(version, agent_name, config, space):
        changes.append(
            "PPO's normalize_rewards 'auto' divides rewards for discrete actions too since "
            "version 2 (its networks keep the return's moments); normalize_rewards='off' "
            "(--ppo_normalize_rewards=off) is what 'auto' was")
    if _spg_rewards_were_raw(version, agent_name, config):
        changes.append(
            "SPG divides large rewards by the return's std since version 3 (its networks "
            "keep the return's moments); --spg_normalize_rewards=off is what it learnt with")
    return changes


def unresumable_since(version: int, agent_name: str, config: Any,
                      has_experience: bool) -> list[str]:
    """Why a run of agent `agent_name` with `config` would not continue the learning of a
    checkpoint written under agents' defaults `version` (holding its experience or not)
    as it was learning, where its networks still act as they did: one sentence each."""
    if version >= 3 or agent_name != "sac":
        return []
    if has_experience:
        return ["SAC's experience holds the running moments of the rewards since version 3 "
                "(normalize_rewards), which this checkpoint's replay lacks: start a new run "
                "(its networks still evaluate as they did)"]
    if config.normalize_rewards:
        return ["SAC's critics learn rewards divided by their running RMS since version 3 "
                "(normalize_rewards), and this checkpoint's learnt them raw: "
                "--sac_normalize_rewards=false continues as it learnt"]
    return []


def defaults_message(checkpoint: str, version: int, changes: list[str],
                     consequence: str = "its networks would act otherwise here") -> str:
    """Why `checkpoint`, written under agents' defaults `version`, is refused: `changes`
    (`changed_since`'s, or with another `consequence` `unresumable_since`'s) said once for
    every place that loads one."""
    return (f"{checkpoint} was written under the agents' defaults of version {version} "
            f"(this sebulba's: {DEFAULTS_VERSION}), and {consequence}: {'; '.join(changes)}")
