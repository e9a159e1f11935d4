"""Device-count invariance in lockstep mode: the same run (same envs, same global batch,
same seeds) learns the same networks on one learner device, on two, and as two processes
of one learner device each (tests/lockstep_spg.py: SPG on CartPole-v1, 4 envs, 8 steps
per cycle, 3 updates).

Tolerance: TOLERANCE = 1e-5 on every parameter after 3 updates. What may differ between
the layouts is the order of float32 sums: one device sums the whole batch, two devices
sum their halves and the learner averages the two gradients (measured: at most 3e-8
apart). Adam moves a parameter by about its learning rate, 1e-2, per update, so one
different env step, action or gradient term shows as ~1e-3, two orders above the
tolerance, and rounding stays two orders below it (it could exceed it only for a gradient
entry within rounding of 0, where Adam's step lr g / (|g| + 1e-8) follows the rounding;
none is at these seeds).

Two things once kept the layouts apart, and the tests below would catch either again:
masked means that divided by each device's own count of unmasked steps (so a device's
steps weighed more where it held fewer; `agents.common.policy.masked_mean` now divides
by the mean count per device), and a process p > 0 whose envs started from a step state
of their own rather than their rows of the one-process one (`Sebulba.initial_state`).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import lockstep_spg as spg
from tests.test_multihost import _finish, _start

TOLERANCE = 1e-5


def max_difference(a, b) -> float:
    """Largest absolute difference of two networks' parameters (pytrees, or their
    `lockstep_spg.leaves`)."""
    a, b = (x if isinstance(x, list) else spg.leaves(x) for x in (a, b))
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def one_process():
    """Networks after UPDATES on one learner device and on two; the initial networks and
    step state of the one-process run."""
    loop = spg.make_loop(spg.ENVS, 1)
    one = spg.run(loop)
    two = spg.run(spg.make_loop(spg.ENVS, 2))
    initial = loop.initial_state()
    return {"one": one, "two": two, "initial": initial}


@pytest.fixture(scope="module")
def two_processes(one_process, tmp_path_factory):
    """The networks of each process of a 2-process cluster (one learner device each):
    from its own initial state ("own") and from its rows of the one-process step state
    ("sliced")."""
    out = tmp_path_factory.mktemp("two_processes")
    spg.save(str(out / "step_state.npz"), one_process["initial"].step_state)
    for rc, err in _finish(_start(2, "lockstep_spg", out, out / "step_state.npz"), 200):
        assert rc == 0, err[-3000:]
    return {kind: [spg.load(str(out / f"process{i}_{kind}.npz")) for i in range(2)]
            for kind in ("own", "sliced")}


@pytest.mark.timeout(300)
def test_one_and_two_learner_devices_learn_the_same_networks(one_process, no_leftovers):
    one, two = one_process["one"], one_process["two"]
    assert one.episodes_total > 0  # episodes end inside the trajectories: masks differ
    assert one.policy_lags == two.policy_lags == [0] * spg.UPDATES  # lockstep
    assert max_difference(one.state.nets, two.state.nets) < TOLERANCE
    # They learnt: Adam moved the parameters by far more than the tolerance.
    assert max_difference(one.state.nets, one_process["initial"].nets) > 100 * TOLERANCE


@pytest.mark.timeout(300)
def test_two_processes_learn_what_one_process_learns(one_process, two_processes,
                                                     no_leftovers):
    for kind in ("own", "sliced"):  # from their initial state, or given the one-process rows
        first, second = two_processes[kind]
        assert max_difference(first, second) == 0.0  # one learner: every replica the same
        assert max_difference(first, one_process["two"].state.nets) < TOLERANCE
        assert max_difference(first, one_process["one"].state.nets) < TOLERANCE
