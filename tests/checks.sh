# Sourced by the shell suites (tests/clients/clients.sh, tests/deploy/nginx.sh,
# tests/deploy/deb.sh): one way to count and print checks, so each suite's
# last line reads "NAME: N passed, M failed" and its exit status is the verdict.
FAILURES=0
PASSES=0
pass() { echo "  ok    $*"; PASSES=$((PASSES + 1)); }
fail() { echo "  FAIL  $*"; FAILURES=$((FAILURES + 1)); }
check() { # check DESCRIPTION COMMAND...
    local what=$1; shift
    if "$@"; then pass "$what"; else fail "$what"; fi
}
free_port() { # a loopback port free at the time of asking
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
checks_verdict() { # checks_verdict SUITE: the summary line; fails if any check failed
    echo "$1: $PASSES passed, $FAILURES failed"
    [ "$FAILURES" -eq 0 ]
}
