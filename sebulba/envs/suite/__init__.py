"""The envs sebulba ships for tests and benchmarks: small tasks with known optima.

Importing this package registers its gymnasium ids, which gymnasium does for an id
written in its `module:Id` form; `import sebulba` alone registers nothing. So the ids
below work with `gymnasium.make`, the launcher's `--env` and subprocess env workers:

  gymnasium.make("sebulba.envs.suite:sebulba/CueRecall-v0")

Memory (`suite.memory`), single-agent, `module:Id` ids:

  sebulba/CueRecall-v0              a cue at the first step, recalled `delay` steps later
  sebulba/CartPoleNoVelocity-v1     CartPole-v1 observing only cart position and pole angle
  sebulba/PendulumNoVelocity-v1     Pendulum-v1 (Box actions) observing only the angle
  sebulba/RepeatFirst-v0            name the symbol shown at step 0, at every step
  sebulba/RepeatPrevious-v0         name the symbol shown k steps ago, at every step
  sebulba/CountRecall-v0            report how often symbol 0 has been seen so far
  sebulba/RepeatFirstContinuous-v0  name the sign pattern of the vector shown at step 0

The last four have known optima: an episode has a fixed length, ends by termination
(never truncation: the length is part of the task), and its rewards add up to at most
1.0, which a policy with memory reaches. Each class's docstring states its "chance", the
expected return of the best policy that acts on the current observation only.

Multi-agent (`suite.role_call`, extra `multiagent`), a PettingZoo env module:

  sebulba.envs.suite.role_call      K agents who must answer differently from one
                                    another (`vectorization="pettingzoo"`, agent_ids)
"""

from sebulba.envs.suite.memory import (
    CartPoleNoVelocity,
    CountRecall,
    CueRecall,
    PendulumNoVelocity,
    RepeatFirst,
    RepeatFirstContinuous,
    RepeatPrevious,
)

# The ids in `module:Id` form, which import this package (and so register the envs).
CUE_RECALL = f"{__name__}:sebulba/CueRecall-v0"
CARTPOLE_NO_VELOCITY = f"{__name__}:sebulba/CartPoleNoVelocity-v1"
PENDULUM_NO_VELOCITY = f"{__name__}:sebulba/PendulumNoVelocity-v1"
REPEAT_FIRST = f"{__name__}:sebulba/RepeatFirst-v0"
REPEAT_PREVIOUS = f"{__name__}:sebulba/RepeatPrevious-v0"
COUNT_RECALL = f"{__name__}:sebulba/CountRecall-v0"
REPEAT_FIRST_CONTINUOUS = f"{__name__}:sebulba/RepeatFirstContinuous-v0"
# The module of the multi-agent env, an `env` for vectorization "pettingzoo".
ROLE_CALL = f"{__name__}.role_call"

__all__ = [
    "CARTPOLE_NO_VELOCITY",
    "COUNT_RECALL",
    "CUE_RECALL",
    "PENDULUM_NO_VELOCITY",
    "REPEAT_FIRST",
    "REPEAT_FIRST_CONTINUOUS",
    "REPEAT_PREVIOUS",
    "ROLE_CALL",
    "CartPoleNoVelocity",
    "CountRecall",
    "CueRecall",
    "PendulumNoVelocity",
    "RepeatFirst",
    "RepeatFirstContinuous",
    "RepeatPrevious",
]
