"""The network protocol: torso, core and head unrolled over [B, T]; acting is its T = 1 case.

Every agent builds its networks through `agents.common.networks` and acts and trains
through the same `apply`; these tests hold each agent to that on vector observations
and on stacked frames.
"""

from __future__ import annotations

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebulba
import sebulba.envs
from agents.common import networks
from agents.registry import AGENTS
from sebulba.envs import example_env_step, observations

VECTOR = sebulba.EnvSpec(gym.spaces.Box(-1.0, 1.0, (6,), np.float32), gym.spaces.Discrete(3))
SPECS = {  # the observation kinds an agent must act and train on
    "vector": VECTOR,
    "rgb_frames": sebulba.EnvSpec(gym.spaces.Box(0, 255, (60, 80, 3), np.uint8),
                                  gym.spaces.Discrete(3)),
    "stacked_frames": sebulba.EnvSpec(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
                                      gym.spaces.Discrete(3)),
    "discrete": sebulba.EnvSpec(gym.spaces.Discrete(7), gym.spaces.Discrete(3)),
    "multi_discrete": sebulba.EnvSpec(gym.spaces.MultiDiscrete([3, 5]), gym.spaces.Discrete(3)),
    # Frames smaller than the Nature CNN's unpadded convolutions keep a feature of (36).
    "small_frames": sebulba.EnvSpec(gym.spaces.Box(0, 255, (10, 10, 3), np.uint8),
                                    gym.spaces.Discrete(3)),
    # MultiDiscrete of one entry, and of rank 2: one-hots of every entry, in order.
    "multi_discrete_one": sebulba.EnvSpec(gym.spaces.MultiDiscrete([5]),
                                          gym.spaces.Discrete(3)),
    "multi_discrete_2d": sebulba.EnvSpec(gym.spaces.MultiDiscrete([[2, 3], [4, 5]]),
                                         gym.spaces.Discrete(3)),
}
B, T = 3, 5


def unrolled_and_stepped(network, params, obs, first, state):
    """(outputs of one [B, T] unroll, outputs of T acting steps stacked on axis 1)."""
    _, unrolled = network.apply(params, state, obs, first)
    outs = []
    for t in range(T):
        state, out = networks.act(network, params, state, obs[:, t], first[:, t])
        outs.append(out)
    return unrolled, jax.tree.map(lambda *xs: jnp.stack(xs, 1), *outs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lstm_size", [0, 8])
def test_acting_is_the_one_step_case_of_the_unroll(lstm_size):
    network = networks.actor_critic(gym.spaces.Discrete(3), VECTOR.observation_space, (16,),
                                    lstm_size)
    params = networks.init(network, jax.random.key(0), VECTOR.observation_space)
    state = network.initial_state(B)
    assert (state == ()) == (lstm_size == 0)  # feed-forward: the empty state
    obs = jax.random.normal(jax.random.key(1), (B, T, 6))
    first = jnp.zeros((B, T), bool).at[:, 0].set(True).at[1, 3].set(True)
    unrolled, stepped = unrolled_and_stepped(network, params, obs, first, state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 unrolled, stepped)
    assert unrolled.policy.logits.shape == (B, T, 3) and unrolled.value.shape == (B, T)


@pytest.mark.timeout(60)
def test_shapes_are_checked_at_the_boundary():
    network = networks.actor_critic(gym.spaces.Discrete(3), VECTOR.observation_space, (16,))
    params = networks.init(network, jax.random.key(0), VECTOR.observation_space)
    with pytest.raises(AssertionError):  # obs without the time axis
        network.apply(params, (), jnp.zeros((B, 6)), jnp.zeros((B, T), bool))


def _zero_sized(params) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [jax.tree_util.keystr(path) for path, x in flat if 0 in np.shape(x)]


def two_observations(space: gym.Space) -> np.ndarray:
    """Two different observations of `space`, as the host holds them: [2, *shape]."""
    space.seed(0)
    first = np.asarray(space.sample())
    second = first
    while np.array_equal(second, first):
        second = np.asarray(space.sample())
    return np.stack([first, second]).astype(observations.host_dtype(space))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(set(AGENTS) - {"sac"}))  # SAC: Box actions, below
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_agent_acts_on_its_observations_through_the_protocol(name, kind):
    spec = SPECS[kind]
    entry = AGENTS[name]
    agent = entry.build(spec, entry.config_class())
    nets = agent.new_networks(jax.random.key(0))
    assert _zero_sized(nets) == []
    acting = agent.acting_nets(nets, jnp.int32(0))
    if name == "r2d2":  # the target network stays on the learner
        assert jax.tree.structure(acting) == jax.tree.structure(nets.online)
    obs = two_observations(spec.observation_space)
    env_step = example_env_step(spec, 2)._replace(obs=obs, first=np.ones(2, bool))
    _, out = networks.act(agent.network, acting, agent.network.initial_state(2),
                          jnp.asarray(obs), env_step.first)
    head = out.policy.logits if hasattr(out, "policy") else out  # policy logits or Q-values
    # Two different observations give different outputs (no constant network).
    assert not np.allclose(head[0], head[1], atol=1e-6)
    state = agent.new_step_state(nets, jax.random.key(1), 2)
    output, _ = jax.jit(agent.step)(state, acting, env_step)
    assert output.action.shape == (2,)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("space,message", [
    (gym.spaces.Box(0, 255, (3, 5, 3), np.uint8), r"cannot tell the layout of uint8 frames"),
    (gym.spaces.Dict({"a": gym.spaces.Discrete(2)}), r"FlattenObservation, or keep one "
                                                       r"entry with .*TransformObservation"),
    (gym.spaces.Tuple((gym.spaces.Discrete(2),)), r"Dict and Tuple observations"),
])
def test_unsupported_observation_spaces_are_refused_by_name(space, message):
    with pytest.raises(ValueError, match=message):
        sebulba.envs.check_spaces(space, gym.spaces.Discrete(2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("space,encoded", [
    (gym.spaces.Discrete(3, start=1), [[0, 0, 1]]),  # obs 3
    (gym.spaces.MultiDiscrete([5]), [[0, 0, 0, 1, 0]]),  # obs [3]
    (gym.spaces.MultiDiscrete([[2, 3], [4, 5]]),  # obs [[1, 2], [3, 0]]
     [[0, 1] + [0, 0, 1] + [0, 0, 0, 1] + [1, 0, 0, 0, 0]]),
])
def test_discrete_observations_are_one_hot_per_entry_in_order(space, encoded):
    obs = {0: 3, 1: [3], 2: [[1, 2], [3, 0]]}[len(space.shape)]
    assert space.contains(np.asarray(obs, space.dtype))
    encoder = networks.encoder_for(space)
    out = encoder.apply({}, jnp.asarray([obs], observations.host_dtype(space)))
    np.testing.assert_array_equal(out, np.asarray(encoded, np.float32))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("space", [gym.spaces.Box(0, 2**40, (3,), np.int64),
                                   gym.spaces.Box(0, 2**40, (3,), np.uint64),
                                   gym.spaces.Discrete(10, start=2**31 - 5)])
def test_integer_observations_beyond_32_bits_are_refused_by_name(space):
    """Narrowed to JAX's 32-bit integers, they would wrap around silently."""
    with pytest.raises(ValueError, match=r"holds integers from .* they would wrap around"):
        sebulba.envs.check_spaces(space, gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match="would wrap around"):
        observations.host_dtype(space)
    fits = gym.spaces.Box(-5, 2**31 - 1, (3,), np.int64)
    assert observations.host_dtype(fits) == np.int32


@pytest.mark.parametrize("shape,layout", [((210, 160, 3), "HWC"), ((4, 84, 84), "CHW"),
                                          ((84, 84), "HW"), ((64, 64, 1), "HWC")])
def test_frame_layouts_are_read_from_the_space(shape, layout):
    space = gym.spaces.Box(0, 255, shape, np.uint8)
    assert observations.kind(space) == observations.IMAGE
    assert observations.image_layout(space) == layout
    assert observations.kind(gym.spaces.Box(0.0, 1.0, shape, np.float32)) == observations.VECTOR


def test_sac_acts_on_its_observations_and_refuses_what_its_mlps_cannot_read():
    box = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)
    spec = sebulba.EnvSpec(VECTOR.observation_space, box)
    agent = AGENTS["sac"].build(spec, AGENTS["sac"].config_class())
    nets = agent.new_networks(jax.random.key(0))
    assert _zero_sized(nets) == []
    acting = agent.acting_nets(nets, jnp.int32(0))
    obs = two_observations(spec.observation_space)
    env_step = example_env_step(spec, 2)._replace(obs=obs, first=np.ones(2, bool))
    state = agent.new_step_state(nets, jax.random.key(1), 2)
    greedy, _ = jax.jit(agent.greedy_step)(state, acting, env_step)
    assert greedy.action.shape == (2, 2)
    assert not np.allclose(greedy.action[0], greedy.action[1], atol=1e-6)
    assert np.all(np.abs(np.asarray(greedy.action)) <= 2.0)
    for kind in ("rgb_frames", "discrete"):
        with pytest.raises(ValueError, match="SAC's networks are MLPs on vector observations"):
            AGENTS["sac"].build(sebulba.EnvSpec(SPECS[kind].observation_space, box),
                                AGENTS["sac"].config_class())


@pytest.mark.timeout(60)
def test_a_log_std_past_its_bound_can_be_brought_back_by_the_loss():
    """The log-std is clipped to [min_log_std, max_log_std]; past a bound (an entropy
    bonus raised it at a reward scale too small to hold it) the part of the gradient
    that would bring it back must pass, or no later loss could move it."""
    import optax

    from agents.common.distributions import GaussianHead, clip_returning

    head = GaussianHead((2,))
    params = head.init(jax.random.key(0), jnp.zeros((1, 3)))
    stuck = jax.tree.map(lambda x: x, params)
    stuck["params"]["log_std"] = jnp.array([2.5, -5.5])  # above max 2, below min -5
    features = jnp.ones((8, 3))

    def log_std_grad(p, loss):
        return jax.grad(lambda p: loss(head.apply(p, features)))(p)["params"]["log_std"]

    def sharper(d):  # wants a smaller std on both
        return -jnp.mean(d.log_prob(d.mean))

    def wider(d):  # an entropy bonus: wants a larger std on both
        return -jnp.mean(d.entropy())

    np.testing.assert_array_equal(head.apply(stuck, features).log_std[0], [2.0, -5.0])
    g_sharper, g_wider = log_std_grad(stuck, sharper), log_std_grad(stuck, wider)
    # The entry above max comes back down, the one below min is held; the other way
    # round for the bonus.
    assert g_sharper[0] > 0 and g_sharper[1] == 0
    assert g_wider[0] == 0 and g_wider[1] < 0
    # Inside the bounds it is the clip's gradient (the identity).
    x = jnp.array([-6.0, -1.0, 0.5, 3.0])
    assert jnp.all(clip_returning(x, -5.0, 2.0) == jnp.clip(x, -5.0, 2.0))
    np.testing.assert_array_equal(
        jax.grad(lambda x: jnp.sum(clip_returning(x, -5.0, 2.0) * 2.0))(x), [0, 2, 2, 2])
    # Adam brings the stuck entry back inside within a few hundred steps.
    opt = optax.adam(1e-2)
    state = opt.init(stuck)
    for _ in range(100):
        grads = jax.grad(lambda p: sharper(head.apply(p, features)))(stuck)
        updates, state = opt.update(grads, state)
        stuck = optax.apply_updates(stuck, updates)
    assert float(stuck["params"]["log_std"][0]) < 2.0
