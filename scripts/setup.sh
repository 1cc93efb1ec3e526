#!/usr/bin/env bash
# Set up jetctl in ./.venv (idempotent): CPU torch pinned first, then the project and its
# dev tools, the docker SDK, selenium and ray (the docker, browser and multihost test tiers),
# the experiment trackers of run.trackers (their read-back tests) and the OpenTelemetry
# exporter of run.tracing (its OTLP test).
# Usage: ./scripts/setup.sh   (then .venv/bin/jetctl ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  .venv/bin/pip install -q torch==2.13.0
fi
echo "[setup] installing jetctl and its dependencies"
log=$(mktemp)
if ! .venv/bin/pip install -q -e '.[dev,docker,browser,ray,trackers,research,tracing]' >"$log" 2>&1; then
  grep -v "is ignored: it is neither" "$log" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
.venv/bin/python -c "import jetctl, torch, transformers, grpc; print('[setup] ok: torch', torch.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)"
