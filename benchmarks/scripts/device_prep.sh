#!/usr/bin/env bash
# Run here (no GPU needed) before a device session: fills .carry/ (git-ignored) with what the GPU machine
# lacks, so that its calls spend device time on tests and benchmarks, not on setup.
#   .carry/smollm2.gguf.{a,b}, .carry/join.sh  the default model in two transfers (../shared/tools/smollm2-halves)
#   .carry/pylib    the gguf package (pure Python; the device image has transformers but not gguf)
#   .carry/data     ../shared/data, which does not travel (the evaluations' and tests' files)
#   .carry/cache    the CUDA kernels built for sm_90a by this machine's nvcc (about 3 minutes on 2 cores)
#   .carry/tree.txt this checkout's commit and nibble.bench.timing.source_hash(): the device copy's .git is stale,
#                   so device_suite.sh gives the benchmarks this commit where the sources are still these
# A call carries at most 64 MiB with the working tree (~12 MB), so they travel in three calls, back to back (the
# machine stays warm ~30 s between calls):
#   carry [.carry/smollm2.gguf.a, .carry/join.sh]:  bash .carry/join.sh a
#   carry [.carry/smollm2.gguf.b, .carry/join.sh]:  bash .carry/join.sh b
#   carry [.carry/cache, .carry/data, .carry/pylib, .carry/tree.txt]:  bash benchmarks/scripts/device_suite.sh kernels
# device_suite.sh copies what arrived to /root/nibble-*, so later calls on the same machine carry nothing.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
python=${PYTHON:-.venv/bin/python}
[ -f .carry/smollm2.gguf.b ] || bash ../shared/tools/smollm2-halves
grep -qx '/.carry/' .git/info/exclude || echo '/.carry/' >> .git/info/exclude
if [ ! -d .carry/pylib/gguf ]; then
  tmp=$(mktemp -d)
  "$python" -m pip download -q --no-deps -d "$tmp" "gguf==$("$python" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  "$python" -m zipfile -e "$tmp"/gguf-*.whl .carry/pylib
fi
rm -rf .carry/data && mkdir -p .carry/data
(cd ../shared/data && tar cf - --exclude='*.bz2' .) | (cd .carry/data && tar xf -)
NIBBLE_CACHE_DIR="$top/.carry/cache" "$python" -m nibble.cli build-kernels --arch 90
"$python" -c 'from nibble.bench.timing import git_commit, source_hash; print(git_commit()); print(source_hash())' \
  > .carry/tree.txt
du -sh .carry/pylib .carry/data .carry/cache
