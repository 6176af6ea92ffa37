#!/usr/bin/env bash
# The wheels the accelerator check needs beyond what a bare GPU machine has (torch, numpy, rich, psutil,
# pyyaml, jinja2, pandas, scipy ...), downloaded on a machine that reaches PyPI, for a machine that does not:
#
#   tools/wheelhouse.sh [DIR] [PYTHON_VERSION] [--no-bundle]   (defaults: .whl and 3.12, the GPU machine's Python)
#
# DIR/cpu_bundle/spec.json is a Llama tiny program captured on this machine's CPU, which the check replays on the
# accelerator (its portability step); it needs cobench's environment (COBENCH_PYTHON, default .nox/cobench's,
# which `nox -s tests` builds); --no-bundle: the wheels only.
#
# Tracking stays off there (mlflow and its server stack would take most of the 64 MiB a working tree may
# carry), and TorchRec/FBGEMM are not carried (the CUDA build of fbgemm-gpu alone is hundreds of MB): the
# check says SKIPPED for DLRM and seqrec with that reason. tools/accelerator_check.py installs DIR offline.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
version="${2:-3.12}"
python="${PYTHON:-python3}"
mkdir -p "$dir"
rm -f "$dir"/*.whl
# Version ranges as pyproject.toml and hydra-core state them (hydra-core 1.3 takes omegaconf 2.3): the
# wheels a fresh install would take.
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" \
    "hydra-core>=1.3.2,<1.4" "omegaconf>=2.3,<2.4" "mlperf-logging>=4.1.68" "mlcommons-loadgen==6.0.*"
# omegaconf's parser runtime is published as a source archive only: build its (pure-Python) wheel here.
"$python" -m pip wheel --quiet --no-deps -w "$dir" "antlr4-python3-runtime==4.9.3"
if [ "${3:-}" != "--no-bundle" ]; then
    runner="${COBENCH_PYTHON:-.nox/cobench/bin/python}"
    if [ -x "$runner" ]; then
        "$runner" -m suite.accelerator_check --capture-portable "$dir/cpu_bundle"
    else
        echo "no cobench environment at $runner (nox -s tests builds it): no CPU spec; the check skips portability"
    fi
fi
du -ch "$dir"/*.whl | tail -1 | sed "s|total|in $dir (Python $version)|"
