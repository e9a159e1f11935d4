"""The runtime: the threads, queues and devices of a run.

`loop.Sebulba` starts the learner and one inferencer thread per env source, runs the
update loop and shuts down; `inferencer` holds the acting loop (one compiled, donated call
per env step) and the trajectories it builds; `learner` the sharded update;
`channels` the staging areas and the trajectory queue between them; `sharding` how data
moves to the learner devices; `transfers` every host-device transfer of the hot paths,
counted and checkable under JAX's transfer guard; `memory` the memory a layout needs,
refused before allocation when it cannot fit; `accounting` where every env step went
(`RunResult`);
`watchdog`, `preemption` and `distributed` stop a run that cannot go on, cleanly.
"""
