#!/usr/bin/env bash
# `make fuzz-api`: Schemathesis against a live payonce, from docs/openapi.yaml.
#
# Builds the release binary, starts `payonce serve` on 127.0.0.1 (a free
# port) with a fresh file database, a callback secret and an API token,
# seeds orders in every state (so the list, event and detail responses the
# schema is checked against are not all empty), then runs Schemathesis for a
# bounded number of cases per operation and a bounded time. Checks: no 5xx,
# every status, content type, header and body as the description says.
# Callbacks are signed by tests/deploy/schemathesis_hooks.py, so the fuzzer
# reaches the body validation behind the signature check.
#
# Settings (environment): FUZZ_MAX_EXAMPLES (default 50, per operation),
# FUZZ_TIMEOUT_S (default 600, the whole run), FUZZ_SEED (replay a run),
# SCHEMATHESIS (the `st` to run; default target/fuzz-venv/bin/st, then `st`
# on PATH). .ci/run installs Schemathesis into target/fuzz-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

MAX_EXAMPLES=${FUZZ_MAX_EXAMPLES:-50}
TIMEOUT_S=${FUZZ_TIMEOUT_S:-600}
ST=${SCHEMATHESIS:-}
if [ -z "$ST" ]; then
    if [ -x "$ROOT/target/fuzz-venv/bin/st" ]; then
        ST="$ROOT/target/fuzz-venv/bin/st"
    elif command -v st >/dev/null 2>&1; then
        ST=$(command -v st)
    else
        echo "fuzz-api: Schemathesis not found: run .ci/run, or" >&2
        echo "  python3 -m venv target/fuzz-venv && target/fuzz-venv/bin/pip install schemathesis" >&2
        exit 2
    fi
fi

cargo build --release --locked --bin payonce
BIN="$ROOT/target/release/payonce"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/payonce-fuzz.XXXXXX")
PAYONCE_PID=
cleanup() {
    if [ -n "$PAYONCE_PID" ]; then
        kill "$PAYONCE_PID" 2>/dev/null || true
        wait "$PAYONCE_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

SECRET="fuzz-secret-$RANDOM$RANDOM"
TOKEN="fuzz-token-$RANDOM$RANDOM"
# Every channel on: generic by secret, WeChat Pay and Alipay with RSA keys
# made here (the hooks sign with the private halves).
openssl genrsa -out "$WORK/wechatpay.key" 2048 2>/dev/null
openssl rsa -in "$WORK/wechatpay.key" -pubout -out "$WORK/wechatpay.pub" 2>/dev/null
openssl genrsa -out "$WORK/alipay.key" 2048 2>/dev/null
openssl rsa -in "$WORK/alipay.key" -pubout -out "$WORK/alipay.pub" 2>/dev/null
WECHATPAY_SERIAL=PUB_KEY_ID_FUZZ
ALIPAY_APP_ID=2021000000000001
export PAYONCE_FUZZ_SECRET="$SECRET"
export PAYONCE_FUZZ_WECHATPAY_KEY="$WORK/wechatpay.key" PAYONCE_FUZZ_WECHATPAY_SERIAL="$WECHATPAY_SERIAL"
export PAYONCE_FUZZ_ALIPAY_KEY="$WORK/alipay.key" PAYONCE_FUZZ_ALIPAY_APP_ID="$ALIPAY_APP_ID"

PAYONCE_CALLBACK_SECRET="$SECRET" PAYONCE_API_TOKEN="fuzz:$TOKEN" PAYONCE_LOG=warn \
    PAYONCE_WECHATPAY_APIV3_KEY=fuzz-apiv3-key-0123456789abcdef0 \
    "$BIN" serve --db "$WORK/fuzz.db" --listen 127.0.0.1:0 --coupon NEW10 --points-per-yuan 1 \
    --wechatpay-public-key "$WECHATPAY_SERIAL=$WORK/wechatpay.pub" \
    --alipay-public-key "$WORK/alipay.pub" --alipay-app-id "$ALIPAY_APP_ID" \
    >"$WORK/stdout" 2>"$WORK/stderr" &
PAYONCE_PID=$!
for _ in $(seq 1 100); do
    if grep -q '^listening on http://' "$WORK/stdout" 2>/dev/null; then break; fi
    if ! kill -0 "$PAYONCE_PID" 2>/dev/null; then
        echo "fuzz-api: payonce exited at start:" >&2
        cat "$WORK/stderr" >&2
        exit 1
    fi
    sleep 0.1
done
BASE=$(sed -n '1s/^listening on //p' "$WORK/stdout")
[ -n "$BASE" ] || { echo "fuzz-api: payonce did not print its address" >&2; exit 1; }
echo "fuzz-api: payonce at $BASE (db $WORK/fuzz.db)"

# ---- seed: an order in every state, every callback outcome ----
api() { # METHOD PATH [JSON]
    curl -sS -o /dev/null -w '%{http_code}' -X "$1" -H "Authorization: Bearer $TOKEN" \
        -H 'Content-Type: application/json' ${3:+--data-binary "$3"} "$BASE$2"
}
callback() { # PATH JSON
    local sig
    sig=$(printf '%s' "$2" | PAYONCE_CALLBACK_SECRET="$SECRET" "$BIN" sign)
    curl -sS -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
        -H "Payonce-Signature: $sig" --data-binary "$2" "$BASE$1"
}
expect() { # WANT GOT WHAT
    if [ "$1" != "$2" ]; then
        echo "fuzz-api: seeding failed: $3 answered $2, expected $1" >&2
        exit 1
    fi
}
for n in 1001 1002 1003 1004 1005 1006 1007 1008; do
    expect 201 "$(api POST /v1/orders "{\"order_no\":\"ORD-$n\",\"user_id\":\"u-42\",\"amount\":9900}")" "create ORD-$n"
done
# Platform paid times must lie within 72 h of payonce's clock (docs/decisions.md,
# "Platform times"): now.
PAID_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
PAID_AT_BEIJING=$(date -u -d '+8 hours' '+%Y-%m-%d %H:%M:%S')
pay() { # PAY_NO ORDER_NO AMOUNT STATUS
    expect 200 "$(callback /v1/callbacks/generic \
        "{\"pay_no\":\"$1\",\"order_no\":\"$2\",\"amount\":$3,\"status\":\"$4\",\"paid_at\":\"$PAID_AT\"}")" "pay $1"
}
pay PAY-1001 ORD-1001 9900 SUCCESS          # applied
pay PAY-1001 ORD-1001 9900 SUCCESS          # duplicate
pay PAY-1002 ORD-1001 9900 SUCCESS          # already_paid (refund required)
pay PAY-1003 ORD-1002 9900 SUCCESS          # applied, then refunded below
expect 200 "$(api POST /v1/orders/ORD-1002/refund '{"refund_no":"RF-1001"}')" "refund ORD-1002"
expect 200 "$(callback /v1/callbacks/generic/refund '{"refund_no":"RF-1001","order_no":"ORD-1002","status":"SUCCESS"}')" "refund RF-1001"
expect 200 "$(api POST /v1/orders/ORD-1003/close)" "close ORD-1003"
pay PAY-1004 ORD-1003 9900 SUCCESS          # paid_after_close
pay PAY-1005 ORD-1004 1 SUCCESS             # amount_mismatch
pay PAY-1006 ORD-1005 9900 FAILED           # payment_failed
pay PAY-1007 ORD-1006 9900 SUCCESS          # applied; refund fails, then an unexpected SUCCESS
expect 200 "$(api POST /v1/orders/ORD-1006/refund '{"refund_no":"RF-1002"}')" "refund ORD-1006"
expect 200 "$(callback /v1/callbacks/generic/refund '{"refund_no":"RF-1002","order_no":"ORD-1006","status":"FAILED"}')" "refund RF-1002"
expect 200 "$(callback /v1/callbacks/generic/refund '{"refund_no":"RF-1002","order_no":"ORD-1006","status":"SUCCESS"}')" "unexpected RF-1002"
expect 200 "$(api POST /v1/compensations '{"order_no":"ORD-1001","action":"freeze_coupon","coupon_template_id":"NEW10","reason":"seed"}')" "compensation"
# An Alipay payment: RSA2 over the sorted parameters.
ALIPAY_FORM=(app_id="$ALIPAY_APP_ID" charset=utf-8 "gmt_payment=$PAID_AT_BEIJING" out_trade_no=ORD-1008
    total_amount=99.00 trade_no=ALI-1008 trade_status=TRADE_SUCCESS)
ALIPAY_SIGN=$(IFS='&'; printf '%s' "${ALIPAY_FORM[*]}" | openssl dgst -sha256 -sign "$WORK/alipay.key" | base64 | tr -d '\n')
ALIPAY_ARGS=()
for kv in "${ALIPAY_FORM[@]}" "sign=$ALIPAY_SIGN" sign_type=RSA2; do ALIPAY_ARGS+=(--data-urlencode "$kv"); done
answer=$(curl -sS -w ' %{http_code}' "${ALIPAY_ARGS[@]}" "$BASE/v1/callbacks/alipay")
expect "success 200" "$answer" "alipay ALI-1008"
echo "fuzz-api: seeded 8 orders (PENDING, PAID, CLOSED, REFUNDED, every callback outcome, an Alipay payment)"

# ---- Schemathesis ----
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance
SEED_ARGS=()
[ -n "${FUZZ_SEED:-}" ] && SEED_ARGS=(--seed "$FUZZ_SEED")
set +e
(
    cd "$WORK"
    SCHEMATHESIS_HOOKS="$ROOT/tests/deploy/schemathesis_hooks.py" \
        timeout --kill-after=10 "$TIMEOUT_S" "$ST" run "$ROOT/docs/openapi.yaml" \
        --url "$BASE" \
        -H "Authorization: Bearer $TOKEN" \
        --checks "$CHECKS" \
        --max-examples "$MAX_EXAMPLES" \
        --request-timeout 20 \
        --workers 1 \
        --generation-database none \
        --output-sanitize false \
        --no-color \
        "${SEED_ARGS[@]}"
) 2>&1 | tee "$WORK/schemathesis.txt"
ST_RC=${PIPESTATUS[0]}
set -e

# ---- what happened ----
CASES=$({ grep -A1 '^Test cases:' "$WORK/schemathesis.txt" || true; } | tail -1 | sed 's/^ *//')
echo
echo "fuzz-api: schemathesis test cases: ${CASES:-unknown}"
curl -sS -H "Authorization: Bearer $TOKEN" "$BASE/metrics" >"$WORK/metrics"
echo "fuzz-api: payonce answers by status:"
awk -F'status="' '/^payonce_http_requests_total/ { split($2, a, "\""); n = $0; sub(/.* /, "", n); s[a[1]] += n }
    END { for (k in s) printf "  %s %d\n", k, s[k] }' "$WORK/metrics" | sort
echo "fuzz-api: callback outcomes:"
grep '^payonce_callback_outcomes_total' "$WORK/metrics" | sed 's/^payonce_callback_outcomes_total/  /' || true

FAIL=0
if ! kill -0 "$PAYONCE_PID" 2>/dev/null; then
    echo "fuzz-api: FAIL: payonce is no longer running" >&2
    FAIL=1
elif [ "$(curl -sS -o /dev/null -w '%{http_code}' "$BASE/healthz")" != 200 ]; then
    echo "fuzz-api: FAIL: /healthz is not 200 after the run" >&2
    FAIL=1
fi
# A request that failed inside payonce (a 5xx) or a handler panic, whatever was answered.
if grep -E 'level=error msg="?(request failed|handler panicked)' "$WORK/stderr" >"$WORK/errors"; then
    echo "fuzz-api: FAIL: payonce logged server errors:" >&2
    head -20 "$WORK/errors" >&2
    FAIL=1
fi
if [ "$ST_RC" -eq 124 ] || [ "$ST_RC" -eq 137 ]; then
    echo "fuzz-api: FAIL: Schemathesis did not finish within ${TIMEOUT_S}s" >&2
    FAIL=1
elif [ "$ST_RC" -ne 0 ]; then
    echo "fuzz-api: FAIL: Schemathesis exited $ST_RC (see above)" >&2
    FAIL=1
fi
# One closing line: Schemathesis' cases passed, and those that failed or errored.
PASSED=$(printf '%s\n' "$CASES" | { grep -oE '[0-9]+ passed' || true; } | awk '{ n += $1 } END { print n + 0 }')
FAILED=$(printf '%s\n' "$CASES" | { grep -oE '[0-9]+ (failed|errored)' || true; } | awk '{ n += $1 } END { print n + 0 }')
[ "$FAIL" -ne 0 ] && [ "${FAILED:-0}" -eq 0 ] && FAILED=1
echo "fuzz-api: ${PASSED:-0} passed, ${FAILED:-0} failed"
exit "$FAIL"
