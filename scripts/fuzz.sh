#!/usr/bin/env bash
# Runs each libFuzzer target given on the command line for FUZZ_SECONDS (default 30), FUZZ_JOBS
# (default: the number of cores) at a time, each on its own corpus (build-fuzz/corpus-NAME, seeded
# from tests/fuzz/seeds/NAME). Prints each target's last lines; exits non-zero, with the failing
# target's log, if any target finds a crash, a leak, a timeout or undefined behaviour (the input
# that found it is saved as build-fuzz/crash-NAME-*; `./build-fuzz/NAME FILE` replays it).
#   scripts/fuzz.sh build-fuzz/fuzz_generate_request build-fuzz/fuzz_safetensors
set -uo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-30}
jobs=${FUZZ_JOBS:-$(nproc)}

one() { # target -> its exit status; the log in build-fuzz/log-NAME
    local t=$1 n
    n=$(basename "$t")
    mkdir -p "build-fuzz/corpus-$n"
    "./$t" -max_total_time="$secs" -print_final_stats=0 -artifact_prefix="build-fuzz/crash-$n-" "build-fuzz/corpus-$n" "tests/fuzz/seeds/$n" \
        > "build-fuzz/log-$n" 2>&1
}
export -f one
export secs

[ $# -gt 0 ] || { echo "usage: $0 FUZZ_TARGET..." >&2; exit 2; }
echo "  fuzz: $# targets, ${secs}s each, $jobs at a time"
failed=0
printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'one "$1"' _ {} || failed=1
for t in "$@"; do
    n=$(basename "$t")
    # libFuzzer ends a clean run with "Done N runs in S second(s)"
    if grep -q '^Done [0-9]* runs' "build-fuzz/log-$n" && ! grep -q 'ERROR: \|runtime error:' "build-fuzz/log-$n"; then
        echo "  ok     $n: $(grep '^Done' "build-fuzz/log-$n" | tail -1)"
    else
        echo "  FAIL   $n (build-fuzz/log-$n):"
        tail -40 "build-fuzz/log-$n" | sed 's/^/    /'
        failed=1
    fi
done
exit $failed
