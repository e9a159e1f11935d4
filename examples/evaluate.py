"""Evaluate a checkpoint: act only, N episodes, mean and spread of the return.

    python -m examples.evaluate --checkpoint=runs/cp --episodes=20
    python -m examples.evaluate --checkpoint=runs/cp --sampled --video_dir=runs/cp/video
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from examples.checkpoints import eval_vectorization, load_policy
from examples.config_flags import run_main
from sebulba.envs import registry
from sebulba.evaluation import check_video_writer, evaluate, record_video
from sebulba.metrics import json_line

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "A training --logdir or its checkpoints/ folder.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
_EPISODES = flags.DEFINE_integer("episodes", 10, "Episodes to evaluate.")
_NUM_ENVS = flags.DEFINE_integer("num_envs", 8, "Envs stepped together.")
_SAMPLED = flags.DEFINE_bool("sampled", False, "Sample actions instead of acting greedily.")
_SEED = flags.DEFINE_integer("seed", 1234, "Seeds the envs and sampling.")
_VIDEO_DIR = flags.DEFINE_string(
    "video_dir", None, "If set, record one episode there (env must render rgb_array).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for flag, low in ((_EPISODES, 1), (_NUM_ENVS, 1), (_SEED, 0)):
        if flag.value < low:
            raise app.UsageError(f"--{flag.name} must be >= {low}, got {flag.value}")
    skipped: list[int] = []
    try:
        agent, nets, meta = load_policy(_CHECKPOINT.value, _STEP.value, skipped)
    except FileNotFoundError as e:
        # The step's own fault only where its directory holds checkpoints.
        flag = "--step" if _STEP.value is not None and os.path.isdir(_CHECKPOINT.value) \
            and "no checkpoint" in str(e) else "--checkpoint"
        value = _STEP.value if flag == "--step" else _CHECKPOINT.value
        raise app.UsageError(f"{flag}={value}: {e}") from None
    except ValueError as e:  # damaged, another run's shapes, an unknown agent
        raise app.UsageError(f"--checkpoint={_CHECKPOINT.value}: {str(e).splitlines()[0]}"
                             ) from None
    for step in skipped:
        print(f"checkpoint {step} is damaged: passed over", file=sys.stderr)
    vectorization = eval_vectorization(meta)
    # A video is of one env made from the id: the run's spaces only where the run's kind
    # made each env itself (an id's own vector env may preprocess frames).
    kind = registry.get(vectorization)
    if _VIDEO_DIR.value and not kind.wraps_each_env:
        why = ("a video records one gymnasium env, and this is a multi-agent env"
               if kind.multi_agent else "whose envs preprocess frames and do not render")
        raise app.UsageError(
            f"--video_dir: env {meta['env']!r} was trained through vectorization "
            f"{vectorization!r}: {why}")
    if _VIDEO_DIR.value:  # before the episodes, not after them
        try:
            check_video_writer("--video_dir")
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    greedy = not _SAMPLED.value
    wrappers = meta.get("env_wrappers") or ()
    # The acting networks the learner published at the checkpoint (a schedule they follow)
    updates = meta["counters"].get("learner_updates", 0)
    result = evaluate(agent, nets, meta["env"], _EPISODES.value, greedy=greedy,
                      num_envs=_NUM_ENVS.value, seed=_SEED.value,
                      env_kwargs=meta["env_kwargs"], vectorization=vectorization,
                      agent_ids=meta.get("agent_ids", False), env_wrappers=wrappers,
                      learner_updates=updates)
    report = {"checkpoint_env_steps": meta["counters"]["consumed"], "greedy": greedy,
              **result.as_dict()}
    if _VIDEO_DIR.value:
        report["video_return"] = record_video(agent, nets, meta["env"], _VIDEO_DIR.value,
                                              greedy=greedy, seed=_SEED.value,
                                              env_kwargs=meta["env_kwargs"],
                                              env_wrappers=wrappers,
                                              learner_updates=updates)
        report["video_dir"] = _VIDEO_DIR.value
    print(json_line(report))


if __name__ == "__main__":
    run_main(main)
