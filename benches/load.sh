#!/usr/bin/env bash
# The load benchmark in one command: installs the Python peer's packages into .venv, builds the
# release sidecar and the driver, then runs it. Extra arguments go to the driver, e.g.
#   bash benches/load.sh --rates 1000,10000,25000 --store-only 500000 --repeat 3
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r .ci/requirements.txt -r benches/requirements.txt
cargo build --release --locked -p kvevent-subscriber -p kvevent-benches --bin kvevent-subscriber --bin load
exec target/release/load "$@"
