#!/usr/bin/env bash
# `make test-deb`: the Debian package of `make deb` on this machine, as root.
#
#   1. dpkg -i: /usr/bin/payonce, the unit (byte for byte deploy/payonce.service),
#      the payonce system user, /etc/payonce/payonce.toml (a conffile, 0640
#      root:payonce, byte for byte deploy/payonce.toml.example, no secret in
#      it), /var/lib/payonce (0750 payonce); the unit neither enabled nor
#      running, its ExecStart `serve --config /etc/payonce/payonce.toml`;
#   2. as shipped, the unit's command refuses to start (no callback secret's
#      file);
#   3. configured as an operator would (the secret and a token in files
#      0640 root:payonce beside the config, the token's key and a free
#      loopback port in the config), the unit is started: by systemd when systemd
#      is PID 1, otherwise its ExecStart is run by hand exactly as systemd
#      would (User=, Group=, Environment=, EnvironmentFile=, ${VAR}
#      expansion, WorkingDirectory=, UMask=, LimitNOFILE=), and the output
#      says so in a banner; /healthz answers 200, an order is created and read
#      back, the process runs as payonce and the ledger is /var/lib/payonce/payonce.db;
#   4. dpkg -r: the unit stopped (by prerm under systemd; by this script,
#      said loudly, without it), binary and unit gone, config and ledger kept;
#   5. dpkg --purge: /etc/payonce gone with the secret files, no unit mask
#      left, the ledger still kept (and the purge says so);
#   6. on exit, whatever happened: the machine as it was before (package
#      purged, /var/lib/payonce, /etc/payonce and a payonce user or group this
#      test created removed).
# Refuses to run where payonce is installed or /etc/payonce or
# /var/lib/payonce exist: those could be a real ledger.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

if [ "$(id -u)" -ne 0 ]; then
    echo "test-deb: must run as root (it installs and removes a package): sudo make test-deb" >&2
    exit 2
fi
for tool in dpkg dpkg-deb curl python3 setpriv getent; do
    command -v "$tool" >/dev/null 2>&1 || { echo "test-deb: $tool is required" >&2; exit 2; }
done

ARCH=$(dpkg --print-architecture)
DEB=${1:-$(ls -t target/debian/payonce_*_"$ARCH".deb 2>/dev/null | head -1 || true)}
[ -n "$DEB" ] && [ -f "$DEB" ] || { echo "test-deb: no target/debian/payonce_*_$ARCH.deb: run make deb" >&2; exit 2; }

status=$(dpkg-query -W -f='${Status}' payonce 2>/dev/null || true)
if [ -n "$status" ] && [ "$status" != "unknown ok not-installed" ]; then
    echo "test-deb: the payonce package is on this machine ($status): refusing to touch it" >&2
    exit 2
fi
for dir in /etc/payonce /var/lib/payonce; do
    if [ -e "$dir" ]; then
        echo "test-deb: $dir exists (a real installation?): refusing to run" >&2
        exit 2
    fi
done
HAD_USER=; getent passwd payonce >/dev/null && HAD_USER=1
HAD_GROUP=; getent group payonce >/dev/null && HAD_GROUP=1

UNIT=/usr/lib/systemd/system/payonce.service
CONFIG=/etc/payonce/payonce.toml
SYSTEMD=
if [ -d /run/systemd/system ] && [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
    SYSTEMD=1
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/payonce-deb.XXXXXX")
MANUAL_PID=
cleanup() {
    local rc=$?
    set +e
    if [ -n "$MANUAL_PID" ] && kill -0 "$MANUAL_PID" 2>/dev/null; then
        kill "$MANUAL_PID"; wait "$MANUAL_PID" 2>/dev/null
    fi
    if [ -n "$SYSTEMD" ]; then
        systemctl stop payonce.service >/dev/null 2>&1
    fi
    if [ "$rc" -ne 0 ] && [ -f "$WORK/payonce.err" ]; then
        echo "--- payonce stderr ---" >&2; tail -20 "$WORK/payonce.err" >&2
    fi
    if dpkg-query -W -f='${Status}' payonce 2>/dev/null | grep -qv 'not-installed'; then
        dpkg --purge payonce >/dev/null 2>&1
    fi
    # This test made them (it refused to start where they existed).
    rm -rf /var/lib/payonce /etc/payonce
    [ -n "$HAD_USER" ] || userdel payonce 2>/dev/null
    [ -n "$HAD_GROUP" ] || groupdel payonce 2>/dev/null
    [ -n "$SYSTEMD" ] && systemctl daemon-reload >/dev/null 2>&1
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

. "$ROOT/tests/checks.sh"
stat_is() { [ "$(stat -c '%a %U:%G' "$1" 2>/dev/null)" = "$2" ]; }

# ---- the unit's [Service] settings, read as systemd reads them ----
service_values() { # every value of KEY= in [Service], in order
    awk -v key="$1" '
        /^\[/ { in_service = ($0 == "[Service]"); next }
        in_service && index($0, key "=") == 1 { print substr($0, length(key) + 2) }
    ' "$UNIT"
}
service_value() { service_values "$1" | tail -1; }

# The environment systemd gives the service: its own base, Environment=,
# then each EnvironmentFile= (a later assignment wins).
unit_environment() {
    local user=$1 line file
    echo "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    echo "HOME=$(getent passwd "$user" | cut -d: -f6)"
    echo "USER=$user"
    echo "LOGNAME=$user"
    echo "SHELL=$(getent passwd "$user" | cut -d: -f7)"
    while IFS= read -r line; do
        [ -n "$line" ] && echo "$line"
    done < <(service_values Environment)
    while IFS= read -r file; do
        file=${file#-}
        [ -r "$file" ] || continue
        while IFS= read -r line || [ -n "$line" ]; do
            line=${line#"${line%%[![:space:]]*}"}
            case "$line" in '' | '#'* | ';'*) continue ;; esac
            local key=${line%%=*} value=${line#*=}
            value=${value%\"}; value=${value#\"}; value=${value%\'}; value=${value#\'}
            echo "$key=$value"
        done <"$file"
    done < <(service_values EnvironmentFile)
}

# ExecStart's words with ${VAR} and $VAR replaced from that environment.
exec_start_words() {
    local envfile=$1 cmd
    cmd=$(service_value ExecStart)
    cmd=${cmd#[-@+!:]}
    python3 - "$envfile" "$cmd" <<'PY'
import re, shlex, sys
env = {}
for line in open(sys.argv[1]):
    key, _, value = line.rstrip("\n").partition("=")
    env[key] = value
def expand(word):
    if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", word):   # $VAR: split into words
        return env.get(word[1:], "").split()
    return [re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word)]
for word in shlex.split(sys.argv[2]):
    for out in expand(word):
        print(out)
PY
}

# Runs the unit's command as systemd would, in the background or (with
# --foreground) to its end; stdout and stderr to $WORK/payonce.{out,err}.
run_unit_by_hand() {
    local user group wd umask_ nofile
    user=$(service_value User); group=$(service_value Group)
    wd=$(service_value WorkingDirectory); umask_=$(service_value UMask)
    nofile=$(service_value LimitNOFILE)
    unit_environment "$user" >"$WORK/unit.env"
    mapfile -t ARGV < <(exec_start_words "$WORK/unit.env")
    mapfile -t ENVV <"$WORK/unit.env"
    echo "    as $user:$group in ${wd:-/}, umask ${umask_:-0022}, LimitNOFILE=${nofile:-default}:"
    echo "    env -i $(sed -e '/SECRET\|TOKEN/s/=.*/=(set)/' "$WORK/unit.env" | tr '\n' ' ')"
    echo "    ${ARGV[*]}"
    local run=(setpriv "--reuid=$user" "--regid=$group" --init-groups -- env -i "${ENVV[@]}" "${ARGV[@]}")
    if [ "${1:-}" = --foreground ]; then
        (cd "${wd:-/}" && umask "${umask_:-0022}" && { [ -z "$nofile" ] || ulimit -n "$nofile"; } &&
            exec "${run[@]}") >"$WORK/payonce.out" 2>"$WORK/payonce.err"
    else
        (cd "${wd:-/}" && umask "${umask_:-0022}" && { [ -z "$nofile" ] || ulimit -n "$nofile"; } &&
            exec "${run[@]}") >"$WORK/payonce.out" 2>"$WORK/payonce.err" &
        MANUAL_PID=$!
    fi
}

echo "test-deb: $DEB"
echo "1. dpkg -i"
dpkg -i "$DEB" >"$WORK/dpkg-i.log" 2>&1 || { cat "$WORK/dpkg-i.log" >&2; fail "dpkg -i"; exit 1; }
pass "dpkg -i $(basename "$DEB")"
grep -q 'systemctl enable --now payonce' "$WORK/dpkg-i.log" &&
    pass "the install says what to do next: $(grep -m1 'installed, not started' "$WORK/dpkg-i.log")" ||
    fail "the install does not say how to configure and start payonce"
check "/usr/bin/payonce, 0755 root" stat_is /usr/bin/payonce "755 root:root"
check "/usr/bin/payonce runs (payonce help)" sh -c '/usr/bin/payonce help 2>&1 | grep -q "payonce serve"'
check "$UNIT is deploy/payonce.service, byte for byte" cmp -s "$UNIT" deploy/payonce.service
check "ExecStart is /usr/bin/payonce serve --config $CONFIG" sh -c "grep -qx 'ExecStart=/usr/bin/payonce serve --config $CONFIG' $UNIT"
pw=$(getent passwd payonce || true)
uid=$(echo "$pw" | cut -d: -f3)
if [ -n "$pw" ] && [ "$uid" -lt 1000 ] && [ "$(echo "$pw" | cut -d: -f7)" = /usr/sbin/nologin ]; then
    pass "system user: $pw"
else
    fail "payonce system user: '$pw'"
fi
check "$CONFIG is a conffile" sh -c "dpkg-query -W -f='\${Conffiles}' payonce | grep -q ' $CONFIG '"
check "$CONFIG: 0640 root:payonce" stat_is "$CONFIG" "640 root:payonce"
check "/etc/payonce: 0750 root:payonce" stat_is /etc/payonce "750 root:payonce"
check "$CONFIG is deploy/payonce.toml.example, byte for byte" cmp -s "$CONFIG" deploy/payonce.toml.example
if grep -Eq '^[[:space:]]*(callback-secret|api-token|wechatpay-apiv3-key)[[:space:]]*=' "$CONFIG"; then
    fail "$CONFIG holds a secret's value: $(grep -E '^[[:space:]]*(callback-secret|api-token|wechatpay-apiv3-key)[[:space:]]*=' "$CONFIG" | cut -d= -f1)"
else
    pass "$CONFIG holds no secret's value (only *-file keys)"
fi
check "/var/lib/payonce: 0750 payonce:payonce" stat_is /var/lib/payonce "750 payonce:payonce"
if [ -e /etc/systemd/system/multi-user.target.wants/payonce.service ]; then
    fail "the unit was enabled by the install"
else
    pass "the unit is not enabled by the install"
fi
if [ -n "$SYSTEMD" ]; then
    systemctl is-active --quiet payonce.service && fail "the unit is running after the install" ||
        pass "the unit is not running after the install"
fi

echo "2. as shipped, the unit's command refuses to start"
rc=0
run_unit_by_hand --foreground || rc=$?
if [ "$rc" -ne 0 ] && grep -q 'callback-secret-file "/etc/payonce/callback-secret"' "$WORK/payonce.err"; then
    pass "exit $rc: $(head -1 "$WORK/payonce.err")"
else
    fail "as shipped it did not refuse (exit $rc): $(head -3 "$WORK/payonce.err")"
fi
check "the refused start wrote no database" test ! -e /var/lib/payonce/payonce.db

echo "3. configured and started"
PORT=$(free_port)
SECRET="deb-secret-$RANDOM$RANDOM"
TOKEN="deb-token-$RANDOM$RANDOM"
(umask 027 && echo "$SECRET" >/etc/payonce/callback-secret && echo "shop:$TOKEN" >/etc/payonce/api-token)
chgrp payonce /etc/payonce/callback-secret /etc/payonce/api-token
sed -i -e "s/^listen = .*/listen = \"127.0.0.1:$PORT\"/" "$CONFIG"
echo 'api-token-file = "/etc/payonce/api-token"' >>"$CONFIG"
check "the secret files: 0640 root:payonce" sh -c \
    "[ \"\$(stat -c '%a %U:%G' /etc/payonce/callback-secret /etc/payonce/api-token | sort -u)\" = '640 root:payonce' ]"
if [ -n "$SYSTEMD" ]; then
    echo "    systemd is PID 1: systemctl start payonce"
    systemctl daemon-reload
    if systemctl start payonce.service; then
        pass "systemctl start payonce"
    else
        fail "systemctl start payonce: $(systemctl status --no-pager payonce.service 2>&1 | tail -5)"
    fi
    PID=$(systemctl show -p MainPID --value payonce.service)
else
    echo "    ================================================================================"
    echo "    === systemd is NOT running here (PID 1 is '$(cat /proc/1/comm 2>/dev/null)'): the unit cannot be"
    echo "    === started by systemctl. Running its ExecStart BY HAND, as systemd would:"
    run_unit_by_hand
    echo "    === NOT tested without systemd: systemd's own start, the sandboxing settings"
    echo "    === (ProtectSystem=, SystemCallFilter=, ...) and prerm stopping the unit."
    echo "    ================================================================================"
    PID=$MANUAL_PID
fi
code=000
for _ in $(seq 1 100); do
    code=$(curl -s -o "$WORK/healthz" -w '%{http_code}' "http://127.0.0.1:$PORT/healthz" || true)
    [ "$code" = 200 ] && break
    sleep 0.2
done
[ "$code" = 200 ] && pass "GET /healthz: 200 $(head -c 100 "$WORK/healthz")" || fail "GET /healthz: $code"
api() { # api METHOD PATH [BODY]: the body on stdout, the status in $WORK/status
    curl -s -o "$WORK/body" -w '%{http_code}' -X "$1" "http://127.0.0.1:$PORT$2" \
        -H "Authorization: Bearer $TOKEN" ${3:+-H 'Content-Type: application/json' -d "$3"} >"$WORK/status" || true
    cat "$WORK/body"
}
body=$(api POST /v1/orders '{"order_no":"DEB-1","user_id":"u-1","amount":9900}')
[ "$(cat "$WORK/status")" = 201 ] && pass "POST /v1/orders: 201 $body" || fail "POST /v1/orders: $(cat "$WORK/status") $body"
body=$(api GET /v1/orders/DEB-1)
[ "$(cat "$WORK/status")" = 200 ] && [[ "$body" == *'"DEB-1"'* ]] &&
    pass "GET /v1/orders/DEB-1: 200" || fail "GET /v1/orders/DEB-1: $(cat "$WORK/status") $body"
body=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/v1/orders/DEB-1" || true)
[ "$body" = 401 ] && pass "the token of /etc/payonce/api-token is required: 401 without it" || fail "without a token: $body"
if [ -n "$SYSTEMD" ]; then journalctl -u payonce.service --no-pager >"$WORK/payonce.err" 2>&1 || true; fi
grep -q 'warning: --.*-file' "$WORK/payonce.err" && fail "a secret file was warned about: $(grep -m1 'warning: --.*-file' "$WORK/payonce.err")" ||
    pass "the secret files, group payonce, are read without a warning"
user=$(stat -c %U "/proc/$PID" 2>/dev/null || true)
[ "$user" = payonce ] && pass "the process ($PID) runs as payonce" || fail "the process runs as '$user'"
check "the ledger is /var/lib/payonce/payonce.db, owned by payonce" sh -c \
    '[ "$(stat -c %U /var/lib/payonce/payonce.db 2>/dev/null)" = payonce ]'
umask_db=$(stat -c %a /var/lib/payonce/payonce.db 2>/dev/null || echo none)
[ "$umask_db" = 600 ] && pass "payonce.db is 0600 (UMask=0077)" || fail "payonce.db mode $umask_db"

echo "4. dpkg -r"
if [ -n "$SYSTEMD" ]; then
    dpkg -r payonce >"$WORK/dpkg-r.log" 2>&1 || { cat "$WORK/dpkg-r.log" >&2; fail "dpkg -r"; }
    systemctl is-active --quiet payonce.service && fail "the unit still runs after dpkg -r" ||
        pass "dpkg -r stopped the unit"
else
    echo "    === systemd is NOT running: prerm cannot stop the unit; this test stops the process"
    echo "    === itself with SIGTERM (the unit's KillSignal=) before dpkg -r."
    kill -TERM "$MANUAL_PID"
    rc=0; wait "$MANUAL_PID" || rc=$?
    MANUAL_PID=
    [ "$rc" -eq 0 ] && pass "SIGTERM: payonce exited 0" || fail "SIGTERM: payonce exited $rc"
    dpkg -r payonce >"$WORK/dpkg-r.log" 2>&1 && pass "dpkg -r" || { cat "$WORK/dpkg-r.log" >&2; fail "dpkg -r"; }
fi
sum_before=$(sha256sum /var/lib/payonce/payonce.db | cut -d' ' -f1)
check "/usr/bin/payonce is gone" test ! -e /usr/bin/payonce
check "$UNIT is gone" test ! -e "$UNIT"
check "dpkg: payonce removed, its config files kept" sh -c \
    "[ \"\$(dpkg-query -W -f='\${Status}' payonce)\" = 'deinstall ok config-files' ]"
check "$CONFIG and the secret files kept" test -f "$CONFIG" -a -f /etc/payonce/callback-secret
check "/var/lib/payonce/payonce.db kept" test -s /var/lib/payonce/payonce.db

echo "5. dpkg --purge"
dpkg --purge payonce >"$WORK/dpkg-purge.log" 2>&1 && pass "dpkg --purge" || { cat "$WORK/dpkg-purge.log" >&2; fail "dpkg --purge"; }
check "/etc/payonce is gone, the secret files with it" test ! -e /etc/payonce
grep -q 'removed the secret /etc/payonce/callback-secret' "$WORK/dpkg-purge.log" &&
    pass "the purge names the secrets it removed" || fail "the purge is silent about the secret files"
status=$(dpkg-query -W -f='${Status}' payonce 2>/dev/null || true)
[ -z "$status" ] || [ "$status" = "unknown ok not-installed" ] && pass "dpkg knows payonce no more" ||
    fail "dpkg status after purge: $status"
leftovers=$(find /etc/systemd /var/lib/systemd -name 'payonce*' 2>/dev/null | tr '\n' ' ')
[ -z "$leftovers" ] && pass "no unit, mask or deb-systemd-helper state left" || fail "left behind: $leftovers"
sum_after=$(sha256sum /var/lib/payonce/payonce.db 2>/dev/null | cut -d' ' -f1 || true)
[ -n "$sum_before" ] && [ "$sum_before" = "$sum_after" ] &&
    pass "the ledger survives purge, unchanged: /var/lib/payonce/payonce.db" || fail "the ledger changed or went on purge"
grep -q '/var/lib/payonce KEPT' "$WORK/dpkg-purge.log" &&
    pass "the purge says so: $(grep -m1 KEPT "$WORK/dpkg-purge.log")" || fail "the purge is silent about the kept ledger"
check "the payonce user stays (owner of the kept ledger)" sh -c "getent passwd payonce >/dev/null"

echo
checks_verdict test-deb
