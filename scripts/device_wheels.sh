#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels scripts/device_check.sh installs on a GPU machine
# that has JAX, flax, optax, orbax and absl but not this project's data stack (Python 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
P="$P --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64"
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for pkg in ml-collections==1.1.0 tensorflow-datasets==4.9.10 array-record==0.8.6 grain==0.2.18 \
  dm-tree immutabledict simple-parsing docstring-parser tensorflow-metadata \
  googleapis-common-protos termcolor toml importlib_resources==7.1.0 portpicker; do
  python3 -m pip download -q --no-deps $P -d .whl "$pkg"
done
python3 -m pip wheel -q --no-deps -w .whl promise==2.3  # an sdist only: built here (pure Python)
