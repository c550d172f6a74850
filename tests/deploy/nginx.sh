#!/usr/bin/env bash
# `make test-deploy`: deploy/nginx.conf in front of a real payonce, on loopback.
#
# Starts payonce (release build, a temp database, a callback secret and an
# API token) and nginx with deploy/nginx.conf rendered for a temp directory
# and a self-signed certificate, then shows:
#   - a signed callback through the proxy is applied (and its re-delivery is a duplicate);
#   - admin and order routes through the proxy are 404 from nginx (payonce never sees them),
#     including a path that only becomes /v1/callbacks/ after normalisation;
#   - a declared Content-Length of 100 GiB is refused by nginx (413);
#   - a 1 MiB header is refused by nginx (400);
#   - a client sending its header one byte a second is cut by nginx (client_header_timeout);
#   - a body trickling one byte a second is held at nginx, then cut when it stalls
#     (client_body_timeout); payonce never sees any of these;
#   - payonce stays healthy (GET /healthz directly, 200) after each.
# Exits non-zero on any failure. Needs nginx, openssl, curl and python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
for tool in "$NGINX" openssl curl python3; do
    command -v "$tool" >/dev/null 2>&1 || { echo "test-deploy: $tool is required (.ci/run installs nginx)" >&2; exit 2; }
done

cargo build --release --locked --bin payonce
BIN="$ROOT/target/release/payonce"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/payonce-deploy.XXXXXX")
chmod 755 "$WORK"   # nginx's workers may run as another user
PAYONCE_PID=
NGINX_PID=
cleanup() {
    local rc=$?
    if [ -n "$NGINX_PID" ]; then
        kill "$NGINX_PID" 2>/dev/null || true
        wait "$NGINX_PID" 2>/dev/null || true
    fi
    if [ -n "$PAYONCE_PID" ]; then
        kill "$PAYONCE_PID" 2>/dev/null || true
        wait "$PAYONCE_PID" 2>/dev/null || true
    fi
    if [ "$rc" -ne 0 ]; then
        echo "--- nginx error.log ---" >&2; tail -20 "$WORK/log/error.log" 2>/dev/null >&2 || true
        echo "--- payonce stderr ---" >&2; tail -20 "$WORK/payonce.err" 2>/dev/null >&2 || true
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

. "$ROOT/tests/checks.sh"

# ---- payonce ----
SECRET="deploy-secret-$RANDOM$RANDOM"
TOKEN="deploy-token-$RANDOM$RANDOM"
PAYONCE_CALLBACK_SECRET="$SECRET" PAYONCE_API_TOKEN="merchant:$TOKEN" \
    "$BIN" serve --db "$WORK/payonce.db" --listen 127.0.0.1:0 --coupon NEW10 \
    >"$WORK/payonce.out" 2>"$WORK/payonce.err" &
PAYONCE_PID=$!
for _ in $(seq 1 100); do
    grep -q '^listening on http://' "$WORK/payonce.out" 2>/dev/null && break
    kill -0 "$PAYONCE_PID" 2>/dev/null || { echo "payonce exited at start" >&2; exit 1; }
    sleep 0.1
done
DIRECT=$(sed -n '1s/^listening on //p' "$WORK/payonce.out")
[ -n "$DIRECT" ] || { echo "payonce did not print its address" >&2; exit 1; }
UPSTREAM=${DIRECT#http://}

# ---- nginx, from deploy/nginx.conf ----
mkdir -p "$WORK/run" "$WORK/log"
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 \
    -addext subjectAltName=IP:127.0.0.1 -keyout "$WORK/tls.key" -out "$WORK/tls.crt" 2>/dev/null
PORT=$(free_port)
sed -e "s|{{LISTEN}}|127.0.0.1:$PORT|g" \
    -e "s|{{SERVER_NAME}}|localhost|g" \
    -e "s|{{TLS_CERT}}|$WORK/tls.crt|g" \
    -e "s|{{TLS_KEY}}|$WORK/tls.key|g" \
    -e "s|{{UPSTREAM}}|$UPSTREAM|g" \
    -e "s|{{RUN_DIR}}|$WORK/run|g" \
    -e "s|{{LOG_DIR}}|$WORK/log|g" \
    deploy/nginx.conf >"$WORK/nginx.conf"
if grep -q '{{[A-Z_]*}}' "$WORK/nginx.conf"; then
    echo "a placeholder of deploy/nginx.conf was not filled: $(grep -o '{{[A-Z_]*}}' "$WORK/nginx.conf" | sort -u)" >&2
    exit 1
fi
"$NGINX" -t -q -p "$WORK" -c "$WORK/nginx.conf"
"$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' 2>>"$WORK/log/error.log" &
NGINX_PID=$!
PROXY="https://127.0.0.1:$PORT"
for _ in $(seq 1 100); do
    curl -ks -o /dev/null "$PROXY/" 2>/dev/null && break
    kill -0 "$NGINX_PID" 2>/dev/null || { echo "nginx exited at start" >&2; exit 1; }
    sleep 0.1
done
echo "test-deploy: payonce at $DIRECT, nginx ($("$NGINX" -v 2>&1 | sed 's/.*: //')) at $PROXY"

# ---- helpers ----
direct_api() { # METHOD PATH [JSON] -> body; status in $WORK/status
    curl -sS -o "$WORK/body" -w '%{http_code}' -X "$1" -H "Authorization: Bearer $TOKEN" \
        -H 'Content-Type: application/json' ${3:+--data-binary "$3"} "$DIRECT$2" >"$WORK/status"
    cat "$WORK/body"
}
signed_callback() { # PATH JSON -> body; status in $WORK/status
    local sig
    sig=$(printf '%s' "$2" | PAYONCE_CALLBACK_SECRET="$SECRET" "$BIN" sign)
    curl -ksS -o "$WORK/body" -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
        -H "Payonce-Signature: $sig" --data-binary "$2" "$PROXY$1" >"$WORK/status"
    cat "$WORK/body"
}
# Requests payonce has answered, from its own metrics (all routes, all statuses).
payonce_requests() {
    curl -sS -H "Authorization: Bearer $TOKEN" "$DIRECT/metrics" | awk '/^payonce_http_requests_total/ && !/route="\/metrics"/ { n += $NF } END { print n + 0 }'
}
healthy() { # WHAT
    local status
    status=$(curl -sS -o /dev/null -w '%{http_code}' "$DIRECT/healthz" || true)
    if [ "$status" = 200 ] && kill -0 "$PAYONCE_PID" 2>/dev/null; then
        pass "payonce healthy after $1 (GET /healthz direct: 200)"
    else
        fail "payonce not healthy after $1 (GET /healthz direct: $status)"
    fi
}
unseen() { # BEFORE WHAT: payonce answered no request since BEFORE
    local after
    after=$(payonce_requests)
    if [ "$after" = "$1" ]; then pass "payonce never saw $2"; else fail "payonce saw $2 ($1 -> $after requests)"; fi
}

# ---- 1. a signed callback through the proxy is applied ----
echo "1. signed callback through the proxy"
direct_api POST /v1/orders '{"order_no":"DEPLOY-1","user_id":"u-1","amount":9900}' >/dev/null
[ "$(cat "$WORK/status")" = 201 ] || { echo "creating DEPLOY-1 directly failed: $(cat "$WORK/status") $(cat "$WORK/body")" >&2; exit 1; }
PAY='{"pay_no":"DEPLOY-PAY-1","order_no":"DEPLOY-1","amount":9900,"status":"SUCCESS"}'
body=$(signed_callback /v1/callbacks/generic "$PAY")
if [ "$(cat "$WORK/status")" = 200 ] && [[ "$body" == *'"outcome":"applied"'* ]]; then
    pass "POST $PROXY/v1/callbacks/generic: 200 $body"
else
    fail "signed callback through the proxy: $(cat "$WORK/status") $body"
fi
order=$(direct_api GET /v1/orders/DEPLOY-1)
if [[ "$order" == *'"status":"PAID"'* && "$order" == *'"pay_no":"DEPLOY-PAY-1"'* ]]; then
    pass "GET /v1/orders/DEPLOY-1 (direct): PAID by DEPLOY-PAY-1, coupon issued: $([[ "$order" == *NEW10* ]] && echo yes || echo no)"
else
    fail "order not PAID after the callback: $order"
fi
body=$(signed_callback /v1/callbacks/generic "$PAY")
if [ "$(cat "$WORK/status")" = 200 ] && [[ "$body" == *'"outcome":"duplicate"'* ]]; then
    pass "re-delivery through the proxy: 200 $body"
else
    fail "re-delivery through the proxy: $(cat "$WORK/status") $body"
fi
body=$(curl -ksS -o - -w ' %{http_code}' -X POST -H 'Content-Type: application/json' \
    -H 'Payonce-Signature: t=1,v1=00' --data-binary "$PAY" "$PROXY/v1/callbacks/generic")
[[ "$body" == *' 401' ]] && pass "a forged signature through the proxy: payonce's 401" || fail "forged signature: $body"
healthy "the callbacks"

# ---- 2. nothing but /v1/callbacks/ is forwarded ----
echo "2. admin and order routes through the proxy"
before=$(payonce_requests)
for probe in "GET /v1/admin/mode" "PUT /v1/admin/mode" "GET /v1/orders" "POST /v1/orders" "GET /v1/orders/DEPLOY-1" \
    "POST /v1/admin/drain" "GET /v1/events" "GET /metrics" "GET /healthz" "GET /v1/callbacks" \
    "GET /v1/callbacks/../admin/mode" "GET /v1/callbacks/%2e%2e/admin/mode" "GET /v1/callbacks%2F..%2Fadmin/mode" \
    "POST /v1/admin/payments/X%2F..%2F..%2F..%2Fcallbacks%2Fgeneric/resolve"; do
    method=${probe%% *}
    path=${probe#* }
    data=()
    [ "$method" = GET ] || data=(--data-binary '{"mode":"record_only"}')
    status=$(curl -ksS --path-as-is -o "$WORK/body" -w '%{http_code}' -X "$method" \
        -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
        "${data[@]}" "$PROXY$path" || true)
    if [ "$status" = 404 ]; then
        pass "$method $path: 404 $(head -c 90 "$WORK/body")"
    else
        fail "$method $path: $status $(head -c 200 "$WORK/body")"
    fi
done
after=$(payonce_requests)
# The last probe is normalised by nginx into /v1/callbacks/generic/resolve and
# forwarded as that path: payonce answers its own 404, but no admin route runs.
resolved=$(curl -sS -H "Authorization: Bearer $TOKEN" "$DIRECT/metrics" | awk '/^payonce_http_requests_total/ && /route="\/v1\/admin/ { n += $NF } END { print n + 0 }')
if [ "$resolved" = 0 ]; then
    pass "no admin route ran in payonce ($((after - before)) of those requests reached payonce, as /v1/callbacks/ paths)"
else
    fail "an admin route ran in payonce through the proxy ($resolved requests)"
fi
mode=$(direct_api GET /v1/admin/mode)
[[ "$mode" == *'"normal"'* ]] && pass "mode still normal: $mode" || fail "mode changed through the proxy: $mode"
healthy "the admin probes"

# ---- 3. hostile requests stop at nginx ----
echo "3. hostile requests"
PROBE="python3 $ROOT/tests/deploy/proxy_probe.py $PORT"
for probe in big-length big-header slow-header slow-body; do
    before=$(payonce_requests)
    if line=$($PROBE "$probe"); then pass "$line"; else fail "$line"; fi
    unseen "$before" "the $probe request"
    healthy "the $probe request"
done
# Not a limit nginx sets: a header value that is not ASCII reaches payonce,
# which answers it itself (no signature here, so 401).
if line=$($PROBE non-ascii-header); then pass "$line"; else fail "$line"; fi
healthy "a non-ASCII header value"

# ---- 4. the proxy still works after all that ----
echo "4. after the hostile requests"
direct_api POST /v1/orders '{"order_no":"DEPLOY-2","user_id":"u-1","amount":100}' >/dev/null
body=$(signed_callback /v1/callbacks/generic '{"pay_no":"DEPLOY-PAY-2","order_no":"DEPLOY-2","amount":100,"status":"SUCCESS"}')
if [ "$(cat "$WORK/status")" = 200 ] && [[ "$body" == *'"outcome":"applied"'* ]]; then
    pass "another signed callback through the proxy: 200 $body"
else
    fail "callback after the hostile requests: $(cat "$WORK/status") $body"
fi
inspection=$(direct_api GET /v1/inspections)
[[ "$inspection" == *'"ok":true'* ]] && pass "inspection clean: $inspection" || fail "inspection: $inspection"

echo
checks_verdict test-deploy
