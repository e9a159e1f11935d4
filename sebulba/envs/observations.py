"""What kind of observation a space holds, decided once from the space, for every agent.

The framework keeps observations as the env emits them on the host, in the trajectory
and across the queue (uint8 frames stay uint8, 4x smaller than float32); networks turn
them into features on the device. This module says how, from the space alone:

- `IMAGE`: a uint8 Box of rank 3 with a channel axis of at most 4 entries at one end
  and two spatial axes of at least 8: gymnasium's RGB frames (H, W, 3) are channels-last,
  ale-py's and EnvPool's stacks (4, 84, 84) channels-first. `image_layout` says which;
  a rank-2 uint8 Box of at least 8 x 8 is one grayscale frame. Networks take NHWC (what
  `flax.linen.Conv` expects) and scale by 1/255 on the device.
- `DISCRETE`: Discrete or MultiDiscrete observations, one-hot encoded on the device.
- `VECTOR`: any other Box, flattened to float32.

A rank-3 uint8 Box whose channel axis cannot be told (e.g. (3, 5, 3)) is an error that
names the shape: a layout guessed from the rank alone can give a network constant outputs.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

VECTOR, IMAGE, DISCRETE = "vector", "image", "discrete"
_MAX_CHANNELS, _MIN_SIDE = 4, 8


def kind(space: gym.Space) -> str:
    """`VECTOR`, `IMAGE` or `DISCRETE`; ValueError, naming the space, if unsupported."""
    if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete):
        return DISCRETE
    if isinstance(space, gym.spaces.Dict | gym.spaces.Tuple):
        raise ValueError(
            f"unsupported observation space {space!r}: Dict and Tuple observations are not "
            "batched by sebulba; wrap the env in gymnasium.wrappers.FlattenObservation, or "
            "keep one entry with gymnasium.wrappers.TransformObservation(env, lambda obs: "
            "obs[key], env.observation_space[key])")
    if not isinstance(space, gym.spaces.Box):
        raise ValueError(
            f"unsupported observation space {space!r}: expected a gymnasium.spaces.Box, "
            "Discrete or MultiDiscrete (wrap the env, e.g. with FlattenObservation)")
    if space.dtype == np.uint8 and len(space.shape) in (2, 3):
        image_layout(space)  # raises for an undecidable frame layout
        return IMAGE
    return VECTOR


def image_layout(space: gym.spaces.Box) -> str:
    """"HWC" or "CHW" for a uint8 frame space ("HW" for one grayscale frame)."""
    shape = tuple(space.shape)
    if len(shape) == 2 and min(shape) >= _MIN_SIDE:
        return "HW"
    if len(shape) == 3:
        last_is_channels = shape[2] <= _MAX_CHANNELS and min(shape[:2]) >= _MIN_SIDE
        first_is_channels = shape[0] <= _MAX_CHANNELS and min(shape[1:]) >= _MIN_SIDE
        if last_is_channels != first_is_channels:
            return "HWC" if last_is_channels else "CHW"
    raise ValueError(
        f"cannot tell the layout of uint8 frames of shape {shape}: expected (H, W, C) or "
        f"(C, H, W) with C <= {_MAX_CHANNELS} and H, W >= {_MIN_SIDE} (or (H, W) grayscale); "
        "reshape the observations with a gymnasium wrapper, or give them a float dtype to "
        "have them flattened")


def num_discrete_values(space: gym.spaces.Discrete | gym.spaces.MultiDiscrete) -> np.ndarray:
    """The number of values of each discrete entry, [1] for Discrete, [k] for MultiDiscrete."""
    return np.atleast_1d(np.asarray(space.n if isinstance(space, gym.spaces.Discrete)
                                    else space.nvec)).reshape(-1)


_NARROWED = {np.dtype(np.float64): np.dtype(np.float32),
             np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32)}


def host_dtype(space: gym.Space) -> np.dtype:
    """The dtype observations of `space` have on the host and in trajectories: the
    space's, except 64-bit ones narrowed to 32 (JAX's default widths; float64 values
    beyond float32's range become inf, which the output checks report). ValueError,
    naming the space, for integers whose bounds do not fit 32 bits: narrowed, they would
    wrap around silently."""
    dtype = np.dtype(space.dtype)
    narrowed = _NARROWED.get(dtype, dtype)
    if narrowed != dtype and narrowed.kind in "iu":
        low, high = _integer_bounds(space)
        info = np.iinfo(narrowed)
        if low < info.min or high > info.max:
            raise ValueError(
                f"observation space {space!r} holds integers from {low} to {high}, beyond "
                f"{narrowed.name} (JAX's default integer width, which sebulba keeps "
                "observations in): they would wrap around; wrap the env to bring them into "
                f"[{info.min}, {info.max}] (or give them a float dtype)")
    return narrowed


def _integer_bounds(space: gym.Space) -> tuple[int, int]:
    """The least and greatest value an integer space holds."""
    if isinstance(space, gym.spaces.Discrete):
        return int(space.start), int(space.start + space.n - 1)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return int(np.min(space.start)), int(np.max(space.start + space.nvec - 1))
    return int(np.min(space.low)), int(np.max(space.high))
