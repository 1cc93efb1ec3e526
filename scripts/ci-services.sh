#!/usr/bin/env bash
# The services the docker, browser and multihost test tiers need, on a fresh Debian machine
# as root:
#   ./scripts/ci-services.sh            # all of: packages, docker, images
#   ./scripts/ci-services.sh packages   # apt: docker.io, debootstrap, chromium, chromium-driver,
#                                       #      bubblewrap, iproute2 (network namespaces: the
#                                       #      multihost tests make and remove their own)
#   ./scripts/ci-services.sh docker     # start dockerd (no systemd here) and wait until it answers
#   ./scripts/ci-services.sh images     # jetctl images build --offline-base (no registry needed)
# Idempotent: what is installed, running or built already is left as it is.
# JETCTL_DOCKER_DATA_ROOT (default /var/lib/jetctl-docker) holds the engine's data and log.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_ROOT=${JETCTL_DOCKER_DATA_ROOT:-/var/lib/jetctl-docker}

packages() {
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v chromium >/dev/null || need+=(chromium)
  command -v chromedriver >/dev/null || need+=(chromium-driver)
  command -v bwrap >/dev/null || need+=(bubblewrap)  # envs.code's sandbox on the host
  command -v ip >/dev/null || need+=(iproute2)  # tests/multihost: ip netns, veth links
  if ((${#need[@]})); then
    echo "[services] apt-get install ${need[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
  fi
  echo "[services] packages: $(dockerd --version), $(chromium --version 2>/dev/null | head -1)"
}

engine_ready() {
  .venv/bin/python -c "import docker, sys; docker.from_env(timeout=5).ping()" >/dev/null 2>&1
}

docker_up() {
  if engine_ready; then
    echo "[services] dockerd already answers"
    return
  fi
  mkdir -p "$DATA_ROOT"
  echo "[services] starting dockerd (data root $DATA_ROOT, log $DATA_ROOT.log)"
  nohup dockerd --data-root "$DATA_ROOT" >"$DATA_ROOT.log" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    if engine_ready; then
      echo "[services] dockerd is ready"
      return
    fi
    sleep 0.5
  done
  echo "[services] dockerd did not answer within 60 s; its log:" >&2
  tail -n 30 "$DATA_ROOT.log" >&2
  exit 1
}

images() {
  .venv/bin/jetctl images build --offline-base
}

case "${1:-all}" in
  packages) packages ;;
  docker) docker_up ;;
  images) images ;;
  all) packages; docker_up; images ;;
  *) echo "usage: $0 [all|packages|docker|images]" >&2; exit 2 ;;
esac
