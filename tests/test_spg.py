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
