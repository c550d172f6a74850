#!/usr/bin/env bash
# `make test-clients`: clients generated from docs/openapi.yaml with each
# generator's default options, run against a live payonce.
#
#   TypeScript: openapi-typescript (npm, pinned with tests/clients/package-lock.json)
#     writes tests/clients/generated/payonce.ts; tsc (strict) type-checks
#     create_order.ts against it, including two bodies that must NOT compile;
#     node runs the result through openapi-fetch.
#   Python: openapi-python-client (PyPI, pinned below, in target/clients-venv)
#     writes target/clients/python/payonce_client; create_order.py calls it.
#   Alipay: alipay_sn.cjs recomputes, with Alipay's official Node.js SDK
#     (alipay-sdk, pinned in the same package.json), the certificate SNs of
#     tests/fixtures/alipay-cert/expected_sn.txt that payonce's own test
#     (src/platforms/alipay/certs.rs) checks payonce against.
# Both create the README's minimal order (order_no, user_id, amount), replay
# it, read it back and get a 409 for a conflicting one, on a
# `payonce serve --dev` with an API token (PAYONCE_BIN, default the debug build).

#
# openapi-python-client 0.29.1 generates no function for POST
# /v1/reconciliations: it supports no text/csv or text/plain request body
# (the statement is CSV). That one warning is expected; any other warning
# of either generator fails the test.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

OPENAPI_PYTHON_CLIENT_VERSION=0.29.1
VENV=target/clients-venv
BIN=${PAYONCE_BIN:-$ROOT/target/debug/payonce}
for tool in node npm python3 "$BIN"; do
    command -v "$tool" >/dev/null 2>&1 || { echo "test-clients: $tool is required" >&2; exit 2; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/payonce-clients.XXXXXX")
PAYONCE_PID=
cleanup() {
    local rc=$?
    if [ -n "$PAYONCE_PID" ]; then
        kill "$PAYONCE_PID" 2>/dev/null || true
        wait "$PAYONCE_PID" 2>/dev/null || true
    fi
    if [ "$rc" -ne 0 ] && [ -f "$WORK/payonce.err" ]; then
        echo "--- payonce stderr ---" >&2; tail -20 "$WORK/payonce.err" >&2
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

. "$ROOT/tests/checks.sh"

# ---- the generators ----
(cd tests/clients && npm ci --no-audit --no-fund --loglevel=error)
installed() { "$VENV/bin/openapi-python-client" --version 2>/dev/null | awk '{print $NF}'; }
if [ "$(installed || true)" != "$OPENAPI_PYTHON_CLIENT_VERSION" ]; then
    rm -rf "$VENV"
    mkdir -p target
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "openapi-python-client==$OPENAPI_PYTHON_CLIENT_VERSION"
fi
TS_VERSION=$(node -p 'require("./tests/clients/node_modules/openapi-typescript/package.json").version')
echo "test-clients: openapi-typescript $TS_VERSION, openapi-python-client $(installed)"

echo "1. generate"
rm -rf tests/clients/generated target/clients/python
mkdir -p tests/clients/generated target/clients
if tests/clients/node_modules/.bin/openapi-typescript docs/openapi.yaml -o tests/clients/generated/payonce.ts \
    >"$WORK/ts-gen.log" 2>&1; then
    if grep -Eiq 'warn|error' "$WORK/ts-gen.log"; then
        fail "openapi-typescript warned: $(grep -Ei 'warn|error' "$WORK/ts-gen.log" | head -5)"
    else
        pass "openapi-typescript: tests/clients/generated/payonce.ts"
    fi
else
    fail "openapi-typescript: $(tail -5 "$WORK/ts-gen.log")"
fi
# ruff, which the Python generator runs over its output, is in the venv.
if PATH="$ROOT/$VENV/bin:$PATH" "$VENV/bin/openapi-python-client" generate --path docs/openapi.yaml \
    --output-path target/clients/python >"$WORK/py-gen.log" 2>&1; then
    warnings=$(grep -E '^WARNING|not in PATH|Unable to|Skipping' "$WORK/py-gen.log" |
        grep -vx 'WARNING parsing POST /v1/reconciliations within operations. Endpoint will not be generated.' || true)
    if [ -n "$warnings" ]; then
        fail "openapi-python-client warned: $warnings"
    else
        pass "openapi-python-client: target/clients/python/payonce_client (all but POST /v1/reconciliations, a text/csv body)"
    fi
else
    fail "openapi-python-client: $(tail -20 "$WORK/py-gen.log")"
fi

echo "2. tsc"
if (cd tests/clients && node_modules/.bin/tsc -p .) >"$WORK/tsc.log" 2>&1; then
    pass "tsc --strict: the minimal body compiles; a body without amount and one with a text amount do not"
else
    fail "tsc: $(cat "$WORK/tsc.log")"
fi

echo "3. against payonce serve --dev"
TOKEN="clients-token-$RANDOM$RANDOM"
PAYONCE_API_TOKEN="shop:$TOKEN" "$BIN" serve --dev --db :memory: --listen 127.0.0.1:0 \
    >"$WORK/payonce.out" 2>"$WORK/payonce.err" &
PAYONCE_PID=$!
for _ in $(seq 1 100); do
    grep -q '^listening on http://' "$WORK/payonce.out" 2>/dev/null && break
    kill -0 "$PAYONCE_PID" 2>/dev/null || { echo "payonce exited at start" >&2; exit 1; }
    sleep 0.1
done
URL=$(sed -n '1s/^listening on //p' "$WORK/payonce.out")
[ -n "$URL" ] || { echo "payonce did not print its address" >&2; exit 1; }

run_client() { # run_client NAME COMMAND...: its ok/FAIL lines counted
    local rc=0
    PAYONCE_URL="$URL" PAYONCE_TOKEN="$TOKEN" "${@:2}" >"$WORK/$1.log" 2>&1 || rc=$?
    cat "$WORK/$1.log"
    PASSES=$((PASSES + $(grep -c '^  ok ' "$WORK/$1.log" || true)))
    FAILURES=$((FAILURES + $(grep -c '^  FAIL ' "$WORK/$1.log" || true)))
    if [ "$rc" -ne 0 ] || ! grep -q '^  ok ' "$WORK/$1.log"; then
        fail "$1 client exited $rc"
    fi
}
if [ -f tests/clients/generated/js/create_order.js ]; then
    run_client typescript node tests/clients/generated/js/create_order.js
else
    fail "typescript: nothing compiled to run"
fi
if [ -d target/clients/python/payonce_client ]; then
    run_client python env PYTHONPATH="$ROOT/target/clients/python" "$VENV/bin/python" tests/clients/create_order.py
else
    fail "python: no client generated"
fi

echo "4. alipay-sdk and payonce on the certificate SNs"
# ---- Alipay's SDK: the certificate SNs payonce's tests expect ----
if node tests/clients/alipay_sn.cjs >"$WORK/alipay-sn.log" 2>&1; then
    pass "alipay-sdk computes the SNs of tests/fixtures/alipay-cert/expected_sn.txt"
else
    fail "alipay-sdk: $(cat "$WORK/alipay-sn.log")"
fi

echo
checks_verdict test-clients
