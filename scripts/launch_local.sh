#!/usr/bin/env bash
# N local processes of one command as a multi-process JAX run (see scripts/launch_local.py):
#   scripts/launch_local.sh 2 4 -- python experiments/train.py --config=configs/default.py:smoke,layout=dp8
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$py" ] || py=python3
exec "$py" "$here/launch_local.py" "$@"
