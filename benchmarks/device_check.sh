#!/usr/bin/env bash
# Issue 29's checks on a lent GPU machine, as one command from the repository root:
# the transfer test on the accelerator (whose guard sees both directions, where XLA:CPU's
# sees host-to-device only), then benchmarks/accelerator.py. Results go to $OUT.
#
# The machine's image has JAX, flax, optax, chex, orbax, absl and pytest, but neither
# gymnasium nor ale-py: carry them as wheels in .whl (RESULTS.md, "Accelerator
# benchmark"), installed here into /tmp/site. Arguments go to the benchmark, e.g.
#
#     bash benchmarks/device_check.sh                       # on the GPU machine
#     SKIP_TRANSFERS=1 SKIP_ANATOMY=1 bash benchmarks/device_check.sh \
#         --stages=breakout_impala
#                                                           # a rerun of what failed
#     PLATFORM=cpu bash benchmarks/device_check.sh --smoke --env_source=gymnasium
#                                                           # here, as the GPU runs it
set -uo pipefail
OUT=${OUT:-/tmp/device_check}
PLATFORM=${PLATFORM:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/machine.txt" 2>&1
  echo "wheels: pip exit $? (log: machine.txt)"
  export PYTHONPATH=/tmp/site:$PWD
fi
# Without gymnasium and ale-py nothing below can run: say so, and stop at once (the
# machine's minutes are few).
if ! python3 -c "import gymnasium, ale_py; print('gymnasium', gymnasium.__version__,
'ale_py', ale_py.__version__)" 2>&1 | tee -a "$OUT/machine.txt"; then
  echo "gymnasium or ale-py missing: carry the wheels in .whl (RESULTS.md)"; exit 3
fi
# The cores this container may use (os.cpu_count() can report the host's).
CORES=$(nproc)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  echo "nproc $CORES; cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo n/a)"
} 2>&1 | tee -a "$OUT/machine.txt"
# JAX on the platform asked for, with the project's own imports (a jaxlib without the
# accelerator's plugin, or a library that clashes with this JAX): else stop at once.
if ! JAX_PLATFORMS=$PLATFORM python3 -c "import sys, jax, sebulba, agents.registry
print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())
assert '$PLATFORM' == 'cpu' or jax.devices()[0].platform != 'cpu', 'no accelerator'" \
    2>&1 | tee -a "$OUT/machine.txt"; then
  echo "JAX or the project does not start on platform $PLATFORM (machine.txt)"; exit 4
fi

# 1. Every loop's transfers under the guard, on the accelerator: each agent (PPO and
# IMPALA are the benchmark's), every vectorization the image has but "async" (worker
# processes, the same acting path as "sync"). The project's pytest options name plugins
# (xdist, timeout) the image may lack: none of them here. -rA: a log cut by the timeout
# still names the tests that passed.
if [ -z "${SKIP_TRANSFERS:-}" ]; then
  JAX_PLATFORMS=$PLATFORM timeout 120 python3 -m pytest -q -rA -p no:cacheprovider \
    -o addopts= -k "not async or envpool_async" tests/test_transfers.py \
    > "$OUT/transfers.txt" 2>&1
  echo "transfer test: exit $? (log: transfers.txt)"; tail -3 "$OUT/transfers.txt"
fi

# 2. Where an acting call's time goes, and profiler traces of a call and of an
# acting-only loop run (each with a summary of its host events in anatomy.jsonl).
if [ -z "${SKIP_ANATOMY:-}" ]; then
  JAX_PLATFORMS=$PLATFORM timeout 90 python3 -m benchmarks.acting_anatomy --seconds=2 \
    --points=mlp:16,mlp:256,nature_cnn:256 --trace_dir="$OUT" \
    > "$OUT/anatomy.jsonl" 2> "$OUT/anatomy_err.txt"
  echo "anatomy: exit $? (records: anatomy.jsonl)"
fi

# 3. The benchmark, within its budget: with the start-up and the steps above the call's
# 10 minutes hold it, and what the session's 15 leave after the first call is a rerun of
# a stage or two (SKIP_TRANSFERS=1 SKIP_ANATOMY=1 and --stages, above). The stage records
# are written as they come; `--table_from` renders the table of a run cut short. At most
# 8 files come back: machine, transfers, anatomy (records, errors, two traces) and these.
JAX_PLATFORMS=$PLATFORM timeout 330 python3 -m benchmarks.accelerator --max_seconds=300 \
  --num_env_threads="$CORES" --out="$OUT/accelerator.jsonl" "$@" \
  > "$OUT/accelerator.txt" 2>&1
status=$?
echo "benchmark: exit $status (records: accelerator.jsonl)"
sed -n '/accelerator benchmark on/,$p' "$OUT/accelerator.txt"
exit $status
