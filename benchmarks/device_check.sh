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
#     PLATFORM=cpu bash benchmarks/device_check.sh --smoke  # here, to try the script
set -uo pipefail
OUT=${OUT:-/tmp/device_check}
PLATFORM=${PLATFORM:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/install.txt" 2>&1
  echo "wheels: pip exit $? (log: install.txt)"
  export PYTHONPATH=/tmp/site:$PWD
fi
# Without gymnasium and ale-py nothing below can run: say so, and stop at once (the
# machine's minutes are few).
if ! python3 -c "import gymnasium, ale_py; print('gymnasium', gymnasium.__version__,
'ale_py', ale_py.__version__)" 2>&1 | tee "$OUT/imports.txt"; then
  echo "gymnasium or ale-py missing: carry the wheels in .whl (RESULTS.md)"; exit 3
fi
# The cores this container may use (os.cpu_count() can report the host's).
CORES=$(nproc)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 -c "import jax, sys; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  echo "nproc $CORES; cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo n/a)"
} 2>&1 | tee "$OUT/machine.txt"

# 1. Every loop's transfers under the guard, on the accelerator. The project's pytest
# options name plugins (xdist, timeout) the image may lack: none of them here.
JAX_PLATFORMS=$PLATFORM timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts= \
  -m "not slow" tests/test_transfers.py > "$OUT/transfers.txt" 2>&1
echo "transfer test: exit $? (log: transfers.txt)"; tail -3 "$OUT/transfers.txt"

# 2. The benchmark, within its budget (with the start-up, the call's 10 minutes hold
# both, and the session's 15 leave room to run it again).
JAX_PLATFORMS=$PLATFORM timeout 300 python3 -m benchmarks.accelerator --max_seconds=270 \
  --num_env_threads="$CORES" --out="$OUT/accelerator.jsonl" "$@" \
  > "$OUT/accelerator.txt" 2>&1
status=$?
echo "benchmark: exit $status (records: accelerator.jsonl)"
sed -n '/accelerator benchmark on/,$p' "$OUT/accelerator.txt"
exit $status
