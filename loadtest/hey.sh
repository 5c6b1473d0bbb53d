#!/usr/bin/env bash
# Drive steadyserve with hey and print the same summary as `python -m loadtest run`.
#
#   loadtest/hey.sh [-u URL] [-c CONCURRENCY] [-n REQUESTS | -z DURATION] [-b BODY_FILE]
#                   [-o OUT_DIR] [-- extra flags for `python -m loadtest hey-summary`]
#
#   loadtest/hey.sh -u http://127.0.0.1:8000/infer -c 64 -n 5000 -- --slo-p99-ms 150
#
# hey is closed loop (each of its -c workers waits for an answer before sending again), so
# its latencies leave out the queueing a stalled server causes; use `python -m loadtest
# run` (open loop) for SLA numbers. hey leaves failed requests out of its CSV: with -n
# the missing ones are counted as requests with no response ("unfinished").
set -euo pipefail

url="http://127.0.0.1:8000/infer"
concurrency=64
requests=2000
duration=""
body_file=""
out_dir=""

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

while getopts "u:c:n:z:b:o:h" option; do
    case "$option" in
        u) url="$OPTARG" ;;
        c) concurrency="$OPTARG" ;;
        n) requests="$OPTARG" ;;
        z) duration="$OPTARG" ;;
        b) body_file="$OPTARG" ;;
        o) out_dir="$OPTARG" ;;
        h) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift

if ! command -v hey >/dev/null 2>&1; then
    echo "hey.sh: 'hey' is not installed (Debian/Ubuntu: apt-get install hey)" >&2
    exit 127
fi

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then python="$repo_root/.venv/bin/python"; else python=python3; fi
fi

work_dir="$(mktemp -d)"
trap 'rm -rf "$work_dir"' EXIT

if [[ -z "$body_file" ]]; then
    # One ~12-word sentence, the bench's request.
    body_file="$work_dir/body.json"
    printf '%s\n' '{"inputs":"The quick brown fox jumps over the lazy dog near the quiet river bank."}' \
        >"$body_file"
fi

amount=(-n "$requests")
# hey splits -n evenly over its workers and drops the remainder.
expected=(--expected "$((requests / concurrency * concurrency))")
if [[ -n "$duration" ]]; then
    amount=(-z "$duration")
    expected=()
fi

echo "hey.sh: ${amount[*]} -c $concurrency POST $url (body $body_file)" >&2
hey -m POST -T application/json -D "$body_file" -c "$concurrency" "${amount[@]}" -o csv "$url" \
    >"$work_dir/hey.csv"

summary_flags=(--url "$url" --concurrency "$concurrency" "${expected[@]}")
if [[ -n "$out_dir" ]]; then
    summary_flags+=(--out "$out_dir")
fi
cd "$repo_root"
"$python" -m loadtest hey-summary "$work_dir/hey.csv" "${summary_flags[@]}" "$@"
