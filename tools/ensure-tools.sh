#!/usr/bin/env bash
# Make sure every system tool the tests drive is on the PATH; `make test` runs this first.
# `tools/ensure-tools.sh --bench` (run by `make bench`) also provides what only the benches
# drive.
#
# Each entry is "COMMAND DEBIAN_PACKAGE". To add a tool, add a line here: nothing else
# needs to change. Python tools (Envoy, kubectl, hadolint, kubernetes-validate, schemathesis)
# come from the dev extra in pyproject.toml instead.
#
# With everything present this does nothing (no package-index update). Otherwise, as root
# with apt-get, it installs the missing packages (one `apt-get update` first); elsewhere it
# names each missing tool and its package, and exits 1.
set -euo pipefail

TOOLS=(
    "promtool prometheus"  # tests/deploy: promtool check/test rules
    "hey hey"              # tests/e2e: the hey load scenario
    "wrk wrk"              # tests/e2e and make bench: the connection-flood benches
    "curl curl"            # tests/e2e: the README's curl examples, run as shown
    "unshare util-linux"   # tests/integration/test_orphans.py: a supervisor as PID 1
)
# Only the benches need these (`make bench`), so `make test` never installs them.
BENCH_TOOLS=(
    "java openjdk-17-jre-headless"  # loadtest/bench.py: TorchServe's front end is Java
)
if [[ "${1:-}" == "--bench" ]]; then
    TOOLS+=("${BENCH_TOOLS[@]}")
fi

missing_commands=()
missing_packages=()
for entry in "${TOOLS[@]}"; do
    read -r tool package <<<"$entry"
    if ! command -v "$tool" >/dev/null 2>&1; then
        missing_commands+=("$tool")
        missing_packages+=("$package")
    fi
done

if ((${#missing_commands[@]} == 0)); then
    exit 0
fi

describe() {
    local i
    for i in "${!missing_commands[@]}"; do
        printf '  %s (Debian package %s)\n' "${missing_commands[$i]}" "${missing_packages[$i]}"
    done
}

if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    {
        echo "ensure-tools: these tools are needed but not on the PATH:"
        describe
        if [[ $EUID -ne 0 ]]; then
            echo "Install them (e.g. sudo apt-get install ${missing_packages[*]}) and re-run."
        else
            echo "No apt-get here: install them with your system's package manager and re-run."
        fi
    } >&2
    exit 1
fi

echo "ensure-tools: installing ${missing_packages[*]} (for ${missing_commands[*]})" >&2
export DEBIAN_FRONTEND=noninteractive
# A package's install starts its service where the init system allows it (`prometheus`, for
# promtool, would start a Prometheus server on :9090) unless policy-rc.d exits 101. Where there
# is none, one that forbids every start is put there for the install and removed afterwards,
# whatever happens; one that was there is left as it is. ENSURE_TOOLS_POLICY_RC_D: for tests.
policy_rc_d=${ENSURE_TOOLS_POLICY_RC_D:-/usr/sbin/policy-rc.d}
if [[ ! -e "$policy_rc_d" && ! -L "$policy_rc_d" ]]; then
    trap 'rm -f "$policy_rc_d"' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
    printf '#!/bin/sh\n# tools/ensure-tools.sh: no service starts while it installs\nexit 101\n' \
        >"$policy_rc_d"
    chmod 755 "$policy_rc_d"
fi
# Another apt or dpkg (an unattended upgrade) may hold the lock: wait for it, up to 5 minutes.
apt_get=(apt-get -o DPkg::Lock::Timeout=300)
"${apt_get[@]}" update -qq
"${apt_get[@]}" install -y -qq --no-install-recommends "${missing_packages[@]}" >/dev/null

still_missing=0
for tool in "${missing_commands[@]}"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "ensure-tools: $tool is still not on the PATH after installing its package" >&2
        still_missing=1
    fi
done
exit "$still_missing"
