"""Schemathesis hooks for `make fuzz-api` (loaded through SCHEMATHESIS_HOOKS).

Signs callbacks the way each payment platform would, so that the fuzzer gets
past signature verification and reaches payonce's parsing of the verified
body and the exactly-once path, not only the 401 in front of them:

- generic: `Payonce-Signature` HMAC over the exact bytes sent;
- wechatpay: `Wechatpay-*` headers, SHA256-RSA over "ts\\nnonce\\nbody\\n"
  (the encrypted `resource` stays random: decryption is refused);
- alipay: RSA2 `sign` over the sorted decoded form, with the merchant's app_id.

Only a case that carries the channel's signature (the `Payonce-Signature`
or `Wechatpay-Signature` header, the `sign` form field) is signed; a case
without it (Schemathesis' "missing required" cases) is sent as it is and
must be refused. Keys and secrets come from the environment that
tests/deploy/fuzz-api.sh sets; RSA signing uses the openssl command.
"""

import base64
import hashlib
import hmac
import json
import os
import secrets
import subprocess
import time
import urllib.parse

import schemathesis

SECRET = os.environ.get("PAYONCE_FUZZ_SECRET", "").encode()
WECHATPAY_KEY = os.environ.get("PAYONCE_FUZZ_WECHATPAY_KEY", "")
WECHATPAY_SERIAL = os.environ.get("PAYONCE_FUZZ_WECHATPAY_SERIAL", "")
ALIPAY_KEY = os.environ.get("PAYONCE_FUZZ_ALIPAY_KEY", "")
ALIPAY_APP_ID = os.environ.get("PAYONCE_FUZZ_ALIPAY_APP_ID", "")


def _rsa_sha256(key_path, message):
    signed = subprocess.run(
        ["openssl", "dgst", "-sha256", "-sign", key_path], input=message, capture_output=True, check=True
    )
    return base64.b64encode(signed.stdout).decode()


def _json_bytes(case):
    """The bytes `requests` will send for a case's JSON body, or None."""
    serialized = case.as_transport_kwargs()
    if "json" in serialized:
        # What requests does with json=: json.dumps(allow_nan=False), UTF-8.
        return json.dumps(serialized["json"], allow_nan=False).encode("utf-8")
    data = serialized.get("data")
    if data is None:
        return b""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    return None


def _header_name(headers, wanted):
    return next((n for n in headers if n.lower() == wanted.lower()), None)


def _sign_generic(case, kwargs):
    headers = case.headers or {}
    name = _header_name(headers, "Payonce-Signature")
    if not SECRET or name is None or (case.media_type or "").split(";")[0] != "application/json":
        return
    body = _json_bytes(case)
    if body is None:
        return
    t = str(int(time.time()))
    headers[name] = f"t={t},v1={hmac.new(SECRET, t.encode() + b'.' + body, hashlib.sha256).hexdigest()}"
    case.headers = headers
    kwargs["data"] = body  # send exactly the bytes that were signed


def _sign_wechatpay(case, kwargs):
    headers = case.headers or {}
    if not WECHATPAY_KEY or _header_name(headers, "Wechatpay-Signature") is None:
        return
    if (case.media_type or "").split(";")[0] != "application/json":
        return
    body = _json_bytes(case)
    if body is None:
        return
    for wanted in ("Wechatpay-Serial", "Wechatpay-Timestamp", "Wechatpay-Nonce", "Wechatpay-Signature"):
        name = _header_name(headers, wanted)
        if name is not None and name != wanted:
            del headers[name]
    timestamp, nonce = str(int(time.time())), secrets.token_hex(16)
    headers["Wechatpay-Serial"] = WECHATPAY_SERIAL
    headers["Wechatpay-Timestamp"] = timestamp
    headers["Wechatpay-Nonce"] = nonce
    headers["Wechatpay-Signature"] = _rsa_sha256(WECHATPAY_KEY, f"{timestamp}\n{nonce}\n".encode() + body + b"\n")
    case.headers = headers
    kwargs["data"] = body


def _sign_alipay(case, kwargs):
    form = case.body
    if not ALIPAY_KEY or not isinstance(form, dict) or "sign" not in form:
        return
    if (case.media_type or "").split(";")[0] != "application/x-www-form-urlencoded":
        return
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in form.items()):
        return
    form = dict(form, app_id=ALIPAY_APP_ID, charset="utf-8", sign_type="RSA2")
    content = "&".join(f"{k}={v}" for k, v in sorted(form.items()) if v and k not in ("sign", "sign_type"))
    try:
        form["sign"] = _rsa_sha256(ALIPAY_KEY, content.encode("utf-8"))
    except (UnicodeEncodeError, subprocess.CalledProcessError):
        return
    kwargs["data"] = urllib.parse.urlencode(form).encode("ascii")


@schemathesis.hook
def before_call(context, case, kwargs):
    channel = (case.path_parameters or {}).get("channel")
    if not case.path.startswith("/v1/callbacks/") or channel is None:
        return
    try:
        if channel == "generic":
            _sign_generic(case, kwargs)
        elif channel == "wechatpay":
            _sign_wechatpay(case, kwargs)
        elif channel == "alipay":
            _sign_alipay(case, kwargs)
    except (TypeError, ValueError):
        return  # a body this hook cannot reproduce byte for byte: sent unsigned
