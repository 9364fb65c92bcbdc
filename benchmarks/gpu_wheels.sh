#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with what the lent GPU machine's image lacks for benchmarks/gpu_check.py: DeepSpeed,
# built here as a pure-Python wheel (its ops are JIT-built there when used), and the dependencies the image has not
# (hjson, pydantic and its own), and torchao for the fp8 section (its float8 training is Python on torch's
# _scaled_mm; a C extension built for another torch only warns). Versions are this venv's, so the GPU run uses what the suite tested. Run from the
# repository root with the venv active; the launch command that installs them there is in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(version deepspeed)"
platforms=()
for n in 17 27 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "hjson==$(version hjson)" "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" \
    "annotated-types==$(version annotated-types)" "typing-inspection==$(version typing-inspection)" \
    "torchao==$(version torchao)"
ls -l .whl
