"""SPG's construction checks: every field, named with its value."""

from __future__ import annotations

import dataclasses

import pytest

from agents.spg import SPGConfig


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs,message", [
    ({"hidden_sizes": (64, 0)}, r"hidden_sizes must be a tuple of ints >= 1, got \(64, 0\)"),
    ({"hidden_sizes": [64, 64]}, r"hidden_sizes must be a tuple of ints >= 1, got \[64, 64\]"),
    ({"learning_rate": -1}, "learning_rate must be a finite number > 0, got -1"),
    ({"learning_rate": 0.0}, "learning_rate must be a finite number > 0, got 0.0"),
    ({"learning_rate": "1e-3"}, "learning_rate must be a finite number > 0, got '1e-3'"),
    ({"learning_rate": float("inf")}, "learning_rate must be a finite number > 0, got inf"),
    ({"entropy_cost": float("inf")}, "entropy_cost must be a finite number >= 0, got inf"),
    ({"gaussian_entropy_cost": -1.0}, "gaussian_entropy_cost must be a finite number >= 0"),
    ({"discount": 5.0}, r"discount must be in \[0, 1\], got 5.0"),
    ({"discount": float("nan")}, r"discount must be in \[0, 1\], got nan"),
    ({"value_cost": -0.5}, "value_cost must be a finite number >= 0, got -0.5"),
    ({"entropy_cost": -0.01}, "entropy_cost must be a finite number >= 0, got -0.01"),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be a finite number > 0, got 0.0"),
    ({"lstm_size": -1}, r"lstm_size must be an int >= 1 \(or 0: no LSTM\), got -1"),
    ({"lstm_size": 8.0}, r"lstm_size must be an int >= 1 \(or 0: no LSTM\), got 8.0"),
    ({"lstm_size": True}, r"lstm_size must be an int >= 1 \(or 0: no LSTM\), got True"),
])
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SPGConfig(**kwargs)


def test_good_configs_are_accepted_as_given():
    assert SPGConfig() == SPGConfig(**{f.name: f.default
                                       for f in dataclasses.fields(SPGConfig)})
    edge = dict(hidden_sizes=(), lstm_size=16, discount=1.0, value_cost=0.0,
                entropy_cost=0.0)
    cfg = SPGConfig(**edge)
    assert {k: getattr(cfg, k) for k in edge} == edge


def test_a_gaussian_policy_gets_its_own_entropy_cost_zero_by_default():
    """A Gaussian's entropy grows without bound with its std: the categorical bonus
    (0.01) at a reward scale of 0.01 drove every log-std to its bound."""
    import sebulba
    from agents.spg import SPG

    assert SPG(sebulba.env_spec("Pendulum-v1")).entropy_cost == 0.0
    assert SPG(sebulba.env_spec("Pendulum-v1"),
               SPGConfig(gaussian_entropy_cost=0.003)).entropy_cost == 0.003
    assert SPG(sebulba.env_spec("CartPole-v1")).entropy_cost == 0.01


@pytest.mark.timeout(60)
def test_down_divides_rewards_only_by_a_return_std_above_one():
    """With normalize_rewards "down" the loss learns rewards over the return's std where
    it exceeds 1 (rewards x10 under a std of 10 give the unit loss) and raw under it
    (a std of 0.5 scales nothing up); "off" holds no moments at all."""
    import jax
    import jax.numpy as jnp

    import sebulba
    from agents.common.normalization import COLLECTION
    from agents.spg import SPG

    spec = sebulba.env_spec("CartPole-v1")
    E, T = 3, 5
    layout = sebulba.Layout(envs_per_group=E, num_groups=1, steps_per_cycle=T,
                            num_learner_devices=1)
    off = SPG(spec, SPGConfig(normalize_rewards="off"))
    assert COLLECTION not in off.new_networks(jax.random.key(0))
    agent = SPG(spec)
    nets = agent.new_networks(jax.random.key(0))
    experience = agent.new_experience_state(nets, jax.random.key(1), layout)
    steps = experience.trajectory.env_steps
    steps = steps._replace(
        obs=jax.random.normal(jax.random.key(2), steps.obs.shape),
        reward=jax.random.uniform(jax.random.key(3), steps.reward.shape))

    def loss(reward_factor: float, std: float) -> float:
        stats = {**nets[COLLECTION], "reward": {**nets[COLLECTION]["reward"],
                                                "var": jnp.float32(std**2)}}
        exp = experience._replace(trajectory=experience.trajectory._replace(
            env_steps=steps._replace(reward=steps.reward * reward_factor)))
        return float(agent.loss({**nets, COLLECTION: stats}, None, exp)[0])

    unit = loss(1.0, 0.5)
    assert loss(10.0, 10.0) == pytest.approx(unit, rel=1e-5)
    assert loss(1.0, 0.01) == pytest.approx(unit, rel=1e-6)  # never scaled up
    assert loss(10.0, 1.0) != pytest.approx(unit, rel=1e-2)
