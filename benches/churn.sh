#!/usr/bin/env bash
# The churn benchmark on this build and on the build BEFORE, alternated, two rounds:
#   bash benches/churn.sh BEFORE-COMMIT [churn flags...]
# The build before runs the same program (benches/src/bin/churn.rs), edited for its API: its
# add_source returned the id itself, its stats had no slots, and its Fleet is not compared.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: bash benches/churn.sh BEFORE-COMMIT [churn flags...]}
shift
dir=target/churn-before
[ -d "$dir" ] || git worktree add --force --detach "$dir" "$before"
sed -e 's/\(add_source([^)]*)\)?/\1/' -e 's/\(add_loading_source([^)]*)\)?/\1/' \
  -e 's/s\.source_slots,/"-",/' -e '/\/\/ fleet: begin/,/\/\/ fleet: end/d' \
  benches/src/bin/churn.rs > "$dir/benches/src/bin/churn.rs"
(cd "$dir" && cargo build --quiet --release --locked -p kvevent-benches --bin churn)
cargo build --quiet --release --locked -p kvevent-benches --bin churn
for round in 1 2; do
  echo "# round $round: this build ($(git rev-parse --short HEAD))"
  target/release/churn "$@"
  echo "# round $round: the build before ($before)"
  "$dir/target/release/churn" "$@"
done
