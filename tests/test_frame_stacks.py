"""Frame stacks kept on the inference device (`Config.stack_frames_on_device`): the agent
acts on exactly the observations its trajectory holds, across episode starts, for each
Atari source; only the newest frame goes to the device; a source that breaks its rule
is caught."""

from __future__ import annotations

import importlib.util
import types
from typing import NamedTuple

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
from sebulba.envs import registry
from sebulba.envs.frame_stacks import FrameStack
from sebulba.runtime import inferencer, transfers

HAS_ENVPOOL = importlib.util.find_spec("envpool") is not None
HAS_ALE = importlib.util.find_spec("ale_py") is not None
needs_envpool = pytest.mark.skipif(not HAS_ENVPOOL, reason="needs the envpool extra")
needs_ale = pytest.mark.skipif(not HAS_ALE, reason="needs the atari extra (ale-py)")

T, E = 8, 4
# Short episodes, so that every run has many episode starts (the stacks refilled).
SOURCES = {
    "envpool": ("Breakout-v5", {"max_episode_steps": 12}),
    "envpool_async": ("Breakout-v5", {"max_episode_steps": 12}),
    "vector_entry_point": ("ALE/Breakout-v5", {"max_num_frames_per_episode": 48}),
}


def digest(obs: jax.Array, weights: jax.Array) -> jax.Array:
    """[E] a weighted sum of each observation: any frame missing, misplaced or stale
    changes it."""
    return jnp.sum(obs.astype(jnp.int32) * weights, axis=tuple(range(1, obs.ndim)))


class Seen(NamedTuple):
    steps: jax.Array  # int32: steps compared
    mismatches: jax.Array  # int32: steps whose observation acted on differs from the stored
    firsts: jax.Array  # int32: episode starts among them
    refilled: jax.Array  # int32: first steps whose older frames were not all zero


class ObservationDigests(sebulba.Agent):
    """Acts at random and outputs a digest of each observation it acted on; the learner
    compares it with the digest of the observation the trajectory holds."""

    def __init__(self, env_spec):
        super().__init__(env_spec)
        shape = env_spec.observation_space.shape
        self.weights = jnp.asarray(
            np.random.default_rng(0).integers(1, 8, size=shape), jnp.int32)

    def new_networks(self, key):
        return {"w": jnp.ones(())}

    def new_step_state(self, nets, key, num_envs):
        return jax.random.split(key, num_envs)

    def new_opt_state(self, nets, key):
        return ()

    def new_experience_state(self, nets, key, layout):
        return Seen(*(jnp.zeros((), jnp.int32) for _ in range(4)))

    def step(self, step_state, nets, env_step):
        keys = jax.vmap(jax.random.split)(step_state)
        action = jax.vmap(lambda k: jax.random.randint(
            k, (), 0, self.env_spec.action_space.n))(keys[:, 0])
        extras = {"digest": digest(env_step.obs, self.weights)}
        return sebulba.ActorOutput(action, extras), keys[:, 1]

    def update_experience(self, experience, initial, final, trajectory, nets):
        obs = trajectory.env_steps.obs[:, :-1]  # [E, T, ...]: the steps acted on
        first = trajectory.env_steps.first[:, :-1]
        stored = jax.vmap(lambda o: digest(o, self.weights), in_axes=1, out_axes=1)(obs)
        acted = trajectory.actor_outputs.extras["digest"]
        older = obs[:, :, :-1].reshape(obs.shape[0], obs.shape[1], -1)
        return Seen(experience.steps + acted.size,
                    experience.mismatches + jnp.sum(acted != stored),
                    experience.firsts + jnp.sum(first),
                    experience.refilled + jnp.sum(first & jnp.any(older != 0, axis=-1)))

    def loss(self, nets, opt, experience):
        return jnp.square(nets["w"]), (experience, {})

    def optimize_from_grads(self, nets, opt, grads):
        return nets, opt


def sent_observations(monkeypatch) -> list[tuple[int, ...]]:
    """Records the shapes of the observations each acting call sends to the device."""
    shapes: list[tuple[int, ...]] = []
    to_device = transfers.to_device

    def recording(tree, device, place):
        if place == inferencer.OBS:
            env_step = tree if isinstance(tree, sebulba.EnvStep) else tree[1]  # by id: (ids, step)
            shapes.append(tuple(env_step.obs.shape))
        return to_device(tree, device, place)

    monkeypatch.setattr(transfers, "to_device", recording)
    return shapes


def run(vectorization: str, stacked: bool | None, steps: int = 2 * 2 * E * T * 6,
        guarded: bool = False, async_factor: int = 2):
    env, kwargs = SOURCES[vectorization]
    config = sebulba.Config(env=env, env_kwargs=kwargs, vectorization=vectorization,
                            envs_per_group=E, steps_per_cycle=T, async_factor=async_factor,
                            stack_frames_on_device=stacked, transfer_guard=guarded)
    agent = ObservationDigests(config.env_spec())
    result = sebulba.Sebulba(agent, config).run(steps, progress_timeout_s=60)
    assert result.env_steps == result.consumed + result.dropped + result.in_flight
    return jax.tree.map(lambda x: int(np.sum(x)), result.learner_experience)  # per device


@pytest.mark.timeout(240)
@pytest.mark.parametrize("vectorization,async_factor", [
    pytest.param("envpool", 2, marks=needs_envpool),
    pytest.param("envpool_async", 2, marks=needs_envpool),
    # Three groups in one pool: envs that run ahead of their group are held back, their
    # actions sent later (the by-id loop's `_HoldBack`).
    pytest.param("envpool_async", 3, marks=needs_envpool),
    pytest.param("vector_entry_point", 2, marks=needs_ale)])
def test_the_agent_acts_on_the_observations_its_trajectory_holds(
        vectorization, async_factor, monkeypatch, no_leftovers):
    shapes = sent_observations(monkeypatch)
    # Under the transfer guard: the frame stacks stay on the device, and the newest frames
    # are the one copy in of each acting call.
    seen = run(vectorization, True, guarded=True, async_factor=async_factor)
    assert seen.steps >= 2 * E * T * 4
    assert seen.firsts >= 2 * E * 3  # episodes of at most 12 steps: the stacks refilled
    assert seen.mismatches == 0
    # ale-py refills with zeros before the reset frame, EnvPool with the frame repeated.
    if vectorization == "vector_entry_point":
        assert seen.refilled == 0
    else:
        assert seen.refilled == seen.firsts
    # Only the newest frame of four went to the device.
    assert shapes and set(shapes) == {(E, 1, 84, 84)}


@needs_envpool
@pytest.mark.timeout(120)
def test_whole_observations_are_sent_on_the_cpu_by_default(monkeypatch, no_leftovers):
    shapes = sent_observations(monkeypatch)
    seen = run("envpool", None, steps=2 * E * T * 2)
    assert seen.mismatches == 0
    assert set(shapes) == {(E, 4, 84, 84)}


def test_the_default_stacks_frames_on_accelerators_only():
    class Source:
        frame_stack = FrameStack(4)

    space = sebulba.env_spec("CartPole-v1").observation_space
    frames = sebulba.envs.env_spec("Breakout-v5", vectorization="envpool").observation_space \
        if HAS_ENVPOOL else None
    cpu = jax.devices("cpu")[0]
    gpu = types.SimpleNamespace(platform="gpu")  # only its platform is read
    assert inferencer.frame_stack_sent(Source(), frames, cpu, None) is None
    assert inferencer.frame_stack_sent(Source(), frames, cpu, False) is None
    assert inferencer.frame_stack_sent(Source(), frames, gpu, False) is None
    if frames is not None:
        assert inferencer.frame_stack_sent(Source(), frames, cpu, True) == FrameStack(4)
        assert inferencer.frame_stack_sent(Source(), frames, gpu, None) == FrameStack(4)
    with pytest.raises(ValueError, match=r"does not fit observations of shape \(4,\): "
                                         "frames need at least two axes"):
        inferencer.frame_stack_sent(Source(), space, cpu, True)
    wrong = gym.spaces.Box(0, 255, (3, 84, 84), np.uint8)
    with pytest.raises(ValueError, match=r"shape \(3, 84, 84\): their first axis must hold "
                                         "frames x frame_size = 4 entries"):
        inferencer.frame_stack_sent(Source(), wrong, gpu, None)

    class NoStack:
        pass

    assert inferencer.frame_stack_sent(NoStack(), space, cpu, None) is None
    assert inferencer.frame_stack_sent(NoStack(), space, gpu, None) is None
    with pytest.raises(ValueError, match="stack_frames_on_device=True needs a source that "
                                         "declares its observations' frame stack .*NoStack "
                                         ".*declares none; .*without episodic_life"):
        inferencer.frame_stack_sent(NoStack(), space, cpu, True)


def _wrong_rule_sources(request):
    """EnvPool's groups, claiming ale-py's rule (zeros before the reset frame)."""
    sources = registry.get("envpool").make_sources(request)
    for source in sources:
        source.frame_stack = FrameStack(4, 1, "zeros")
    return sources


@needs_envpool
@pytest.mark.timeout(120)
def test_a_source_that_breaks_its_frame_rule_stops_the_run(no_leftovers):
    kind = registry.get("envpool")
    registry.register(registry.EnvSourceKind(
        "envpool_wrong_frames", _wrong_rule_sources, kind.env_spec, kind.check_env,
        needs_env_id=True))
    try:
        env, kwargs = SOURCES["envpool"]
        config = sebulba.Config(env=env, env_kwargs=kwargs,
                                vectorization="envpool_wrong_frames", envs_per_group=E,
                                steps_per_cycle=T, stack_frames_on_device=True)
        agent = ObservationDigests(config.env_spec())
        with pytest.raises(sebulba.envs.BadEnvOutput,
                           match=r"env \d of group \d \(EnvPoolGroups\): its observation "
                                 r"at step \d+ of a cycle does not follow the one before as "
                                 r"its source's frame_stack, FrameStack\(frames=4, "
                                 r"frame_size=1, padding='zeros'\), says \(an episode starts "
                                 r"there, and its older frames are not zeros\)") as caught:
            sebulba.Sebulba(agent, config).run(2 * E * T * 40, progress_timeout_s=60)
        assert caught.value.field == "obs" and 1 <= caught.value.step <= T
    finally:
        registry.unregister("envpool_wrong_frames")


@pytest.mark.parametrize("padding", ["repeat", "zeros"])
def test_restacking_on_the_device_and_on_the_host_agree(padding):
    spec = FrameStack(3, 2, padding)
    rng = np.random.default_rng(1)
    stack = rng.integers(0, 255, (5, 6, 4), np.uint8)
    newest = rng.integers(0, 255, (5, 2, 4), np.uint8)
    first = np.array([True, False, True, False, False])
    host = spec.restack(stack, newest, first, xp=np)
    np.testing.assert_array_equal(np.asarray(spec.restack(stack, newest, first)), host)
    np.testing.assert_array_equal(host[1], np.concatenate([stack[1, 2:], newest[1]]))
    padded = np.tile(newest[0], (3, 1)) if padding == "repeat" else \
        np.concatenate([np.zeros((4, 4), np.uint8), newest[0]])
    np.testing.assert_array_equal(host[0], padded)
    # One env's consecutive observations: a frame dropped from the stack is found.
    obs = [stack[0]]
    for t in range(4):
        obs.append(spec.restack(obs[-1][None], newest[t:t + 1], first[t:t + 1], xp=np)[0])
    obs = np.stack(obs)
    starts = np.r_[True, first[:4]]
    assert spec.mismatch(obs, starts) is None
    assert starts.tolist() == [True, True, False, True, False]
    broken = obs.copy()
    broken[4, 0] += 1  # an older frame where the episode goes on
    assert spec.mismatch(broken, starts) == (
        4, "its older frames are not the previous observation's newer ones")
    broken = obs.copy()
    broken[3, 0] += 1  # the padding where an episode starts
    fill = "the newest frame repeated" if padding == "repeat" else "zeros"
    assert spec.mismatch(broken, starts) == (
        3, f"an episode starts there, and its older frames are not {fill}")
    broken = obs.copy()
    broken[4, 5] += 1  # the last newest frame: nothing after it to compare it with
    assert spec.mismatch(broken, starts) is None


@pytest.mark.parametrize("kwargs,message", [
    ({"frames": 1}, "frames must be an int >= 2, got 1"),
    ({"frames": 4, "frame_size": 0}, "frame_size must be an int >= 1, got 0"),
    ({"frames": 4, "padding": "edge"}, "padding must be one of .*'repeat', 'zeros'.*'edge'"),
])
def test_bad_frame_stacks_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FrameStack(**kwargs)
