"""Observations that stack an env's last frames, and how a source says so (`FrameStack`).

Atari sources emit each observation as the env's last n frames along its first axis
(EnvPool's and ale-py's vector env: [4, 84, 84] grayscale). From one step to the next
such a stack changes by one frame: where the episode goes on, the oldest frame is
dropped and the newest appended; where an episode starts (`first`), the stack is
refilled with the newest frame n times (EnvPool) or with zeros before it (ale-py). A
source that knows its env keeps this rule says so with a `FrameStack`; the acting loop
can then send the inference device only the newest frame of each observation and have
the device restack it (`Config.stack_frames_on_device`): a quarter of the observations'
copy for four frames, the part of a CNN's acting call that grows with the envs on a GPU
(benchmarks/RESULTS.md, "Accelerator benchmark"). The trajectory keeps the env's own
stacks; the loop checks a row of each cycle against the rule (`mismatch`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnasium as gym
import numpy as np

PADDINGS = ("repeat", "zeros")


@dataclasses.dataclass(frozen=True)
class FrameStack:
    """Observations of `frames` frames of `frame_size` entries each along the
    observation's first axis, oldest first, kept as described in the module docstring.

    Attributes:
      frames: n, the frames in one observation (at least 2: one frame has nothing to
        keep on the device).
      frame_size: entries of one frame along the first axis (1 grayscale, 3 RGB).
      padding: what comes before the newest frame where an episode starts: "repeat"
        (the newest frame again, EnvPool's) or "zeros" (ale-py's vector env's).
    """

    frames: int
    frame_size: int = 1
    padding: str = "repeat"

    def __post_init__(self):
        for name, least in (("frames", 2), ("frame_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"FrameStack.{name} must be an int >= {least}, got {value!r}")
        if self.padding not in PADDINGS:
            raise ValueError(f"FrameStack.padding must be one of {PADDINGS}, got "
                             f"{self.padding!r}")

    def check_space(self, space: gym.Space) -> None:
        """ValueError unless `space` holds observations of this stack."""
        shape = tuple(getattr(space, "shape", None) or ())
        if len(shape) < 2:
            raise ValueError(f"{self} does not fit observations of shape {shape}: frames "
                             "need at least two axes, the stack's and a frame's own")
        if shape[0] != self.frames * self.frame_size:
            raise ValueError(f"{self} does not fit observations of shape {shape}: their "
                             f"first axis must hold frames x frame_size = "
                             f"{self.frames * self.frame_size} entries")

    def newest(self, obs: np.ndarray) -> np.ndarray:
        """The newest frame of each observation of `obs` [E, n x frame_size, ...]:
        [E, frame_size, ...], a view."""
        return obs[:, -self.frame_size:]

    def restack(self, stack: Any, newest: Any, first: Any, xp: Any = None) -> Any:
        """The observations [E, n x frame_size, ...] that follow `stack` (the previous
        ones) given their newest frames `newest` [E, frame_size, ...] and `first` [E]
        (where an episode starts). `xp`: the array module (jax.numpy by default, numpy
        for host arrays)."""
        if xp is None:
            import jax.numpy as xp
        size = self.frame_size
        shifted = xp.concatenate([stack[:, size:], newest], axis=1)
        if self.padding == "repeat":
            refilled = xp.concatenate([newest] * self.frames, axis=1)
        else:
            refilled = xp.concatenate([xp.zeros_like(stack[:, size:]), newest], axis=1)
        where = xp.reshape(first, (-1,) + (1,) * (len(stack.shape) - 1))
        return xp.where(where, refilled, shifted)

    def mismatch(self, obs: np.ndarray, first: np.ndarray) -> tuple[int, str] | None:
        """The first step t >= 1 of one env's consecutive observations `obs` [T, ...]
        (`first` [T]) whose observation does not follow the one before by this rule, and
        what is wrong with it; None if every one does. Slices compared, no stack built
        (it runs once a cycle, on the inferencer thread)."""
        size, first = self.frame_size, np.asarray(first[1:], bool)
        # Where the episode goes on, the older frames are the previous one's newer frames.
        goes_on = (obs[1:, :-size] != obs[:-1, size:]).reshape(len(first), -1).any(axis=1)
        goes_on &= ~first
        starts = np.flatnonzero(first)
        refill = np.zeros(len(first), bool)
        if len(starts):  # where an episode starts, padding before the newest frame
            older = obs[starts + 1, :-size]
            padding = (np.concatenate([obs[starts + 1, -size:]] * (self.frames - 1), axis=1)
                       if self.padding == "repeat" else np.zeros_like(older))
            refill[starts] = (older != padding).reshape(len(starts), -1).any(axis=1)
        wrong = np.flatnonzero(goes_on | refill)
        if not len(wrong):
            return None
        t = int(wrong[0])
        if refill[t]:
            fill = "the newest frame repeated" if self.padding == "repeat" else "zeros"
            return t + 1, f"an episode starts there, and its older frames are not {fill}"
        return t + 1, "its older frames are not the previous observation's newer ones"


def envpool_frame_stack(pool: Any) -> FrameStack | None:
    """The frame stack of an EnvPool Atari pool, or None for any other pool and for one
    whose episodes end at a life lost (`episodic_life`: its stack goes on across that
    reset, so `first` does not say where it is refilled)."""
    config = getattr(pool, "config", None) or {}
    if "Atari" not in type(pool).__name__ or config.get("episodic_life", True):
        return None
    frames = int(config.get("stack_num", 1))
    return FrameStack(frames, 1 if config.get("gray_scale", True) else 3, "repeat") \
        if frames > 1 else None


def ale_vector_frame_stack(vec: gym.vector.VectorEnv) -> FrameStack | None:
    """The frame stack of ale-py's Atari vector env (each stack refilled with zeros before
    the reset frame, at every reset, life-loss resets included), or None for any other
    vector env."""
    env = vec.unwrapped
    if type(env).__name__ != "AtariVectorEnv" or not type(env).__module__.startswith("ale_py"):
        return None
    frames = int(env.single_observation_space.shape[0])
    return FrameStack(frames, 1, "zeros") if frames > 1 else None
