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
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python3 -c "import jax, sys; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

# 1. Every loop's transfers under the guard, on the accelerator.
JAX_PLATFORMS=$PLATFORM timeout 150 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_transfers.py > "$OUT/transfers.txt" 2>&1
echo "transfer test: exit $? (log: transfers.txt)"; tail -3 "$OUT/transfers.txt"

# 2. The benchmark, within its budget (the run's 10 minutes hold both).
JAX_PLATFORMS=$PLATFORM timeout 420 python3 -m benchmarks.accelerator --max_seconds=360 \
  --out="$OUT/accelerator.jsonl" "$@" > "$OUT/accelerator.txt" 2>&1
status=$?
echo "benchmark: exit $status (records: accelerator.jsonl)"
sed -n '/accelerator benchmark on/,$p' "$OUT/accelerator.txt"
exit $status
