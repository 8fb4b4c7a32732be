#!/usr/bin/env bash
# Run the gloo multi-rank tests N times in a row and count C++ aborts at teardown
# ("terminate called ...") and failures: the reliability check of the teardown
# (titan_plugins/distributed/teardown.py). Not part of the suite: it takes minutes.
#
#   scripts/repeat_multirank.sh [N=20] [pytest args...]   (default: tests/test_moe_parallel.py)
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:-20}"; shift || true
TESTS=("$@"); [ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_moe_parallel.py)
PY="${VENV:-.venv}/bin/python"
aborts=0; failures=0
for i in $(seq 1 "$N"); do
    log="$(mktemp)"
    start=$(date +%s)
    "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" >"$log" 2>&1
    rc=$?
    n_abort=$(grep -c "terminate called" "$log")
    aborts=$((aborts + n_abort)); [ "$rc" -eq 0 ] || failures=$((failures + 1))
    echo "run $i/$N: exit $rc, aborts $n_abort, $(( $(date +%s) - start )) s, $(tail -1 "$log")"
    [ "$rc" -eq 0 ] || tail -40 "$log"
    rm -f "$log"
done
echo "summary: $N runs, $failures failed, $aborts teardown aborts"
[ "$failures" -eq 0 ] && [ "$aborts" -eq 0 ]
