"""make test-clients (tests/clients/clients.sh): WeChat Pay notifications
signed and checked by the PyPI SDK `wechatpayv3` (pinned in clients.sh),
and the same bytes sent to a live `payonce serve` (PAYONCE_BIN), under
both kinds of serial a merchant in the middle of WeChat Pay's migration
receives: a WeChat Pay public key (`PUB_KEY_ID_...`) and a platform
certificate (its hex serial, also in lower case, which the SDK compares as
a number). payonce must accept exactly what the SDK accepts: each genuine
notice pays its order once; a notice whose body changed after signing, or
signed by a key under another's serial, is refused by both and pays
nothing.

The keys and the certificate are made here, for this run only."""

import base64
import datetime
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID
from wechatpayv3.core import Core
from wechatpayv3.utils import rsa_sign

APIV3_KEY = secrets.token_hex(16)  # 32 characters, as WeChat Pay's APIv3 key
MCHID = "1900000100"
PUBLIC_KEY_ID = "PUB_KEY_ID_0114232234172024101000000000"
failures = 0


def check(what, ok, detail=""):
    global failures
    if ok:
        print(f"  ok    wechatpayv3: {what}")
    else:
        failures += 1
        print(f"  FAIL  wechatpayv3: {what}: {detail!r}")


def pem_private(key):
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def pem_public(key):
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def platform_certificate(key):
    """A platform certificate as WeChat Pay issues one: RSA 2048, a serial
    of 20 bytes printed in upper-case hex."""
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COUNTRY_NAME, "CN"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "TEST ONLY payonce interop"),
            x509.NameAttribute(NameOID.COMMON_NAME, "TEST ONLY WeChat Pay platform"),
        ]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .sign(key, hashes.SHA256())
    )
    return cert, cert.public_bytes(serialization.Encoding.PEM).decode()


def notice(order_no, key, serial, amount=9900):
    """(headers, body) of a TRANSACTION.SUCCESS notification, its resource
    encrypted with the APIv3 key and the whole signed with `key` by the
    SDK's own `rsa_sign`, under `serial`."""
    now = int(time.time())
    plain = json.dumps(
        {
            "mchid": MCHID,
            "appid": "wxd678efh567hg6787",
            "out_trade_no": order_no,
            "transaction_id": "4200000001" + str(now) + secrets.token_hex(3),
            "trade_type": "JSAPI",
            "trade_state": "SUCCESS",
            "trade_state_desc": "支付成功",
            "success_time": datetime.datetime.fromtimestamp(
                now - 1, datetime.timezone(datetime.timedelta(hours=8))
            ).isoformat(timespec="seconds"),
            "payer": {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
            "amount": {"total": amount, "payer_total": amount, "currency": "CNY", "payer_currency": "CNY"},
        },
        ensure_ascii=False,
    )
    nonce = secrets.token_hex(6)
    ciphertext = AESGCM(APIV3_KEY.encode()).encrypt(nonce.encode(), plain.encode(), b"transaction")
    body = json.dumps(
        {
            "id": "EV-" + secrets.token_hex(8),
            "create_time": "2026-12-05T08:00:00+08:00",
            "resource_type": "encrypt-resource",
            "event_type": "TRANSACTION.SUCCESS",
            "summary": "支付成功",
            "resource": {
                "original_type": "transaction",
                "algorithm": "AEAD_AES_256_GCM",
                "ciphertext": base64.b64encode(ciphertext).decode(),
                "associated_data": "transaction",
                "nonce": nonce,
            },
        },
        ensure_ascii=False,
    )
    timestamp, sign_nonce = str(now), secrets.token_hex(16)
    headers = {
        "Wechatpay-Timestamp": timestamp,
        "Wechatpay-Nonce": sign_nonce,
        "Wechatpay-Serial": serial,
        "Wechatpay-Signature-Type": "WECHATPAY2-SHA256-RSA2048",
        "Wechatpay-Signature": rsa_sign(key, f"{timestamp}\n{sign_nonce}\n{body}\n"),
    }
    return headers, body


def http(url, method="GET", body=None, headers=None):
    request = urllib.request.Request(url, data=body.encode() if body else None, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def main():
    platform_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    certificate_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    stranger_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    merchant_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    certificate, certificate_pem = platform_certificate(certificate_key)
    serial = format(certificate.serial_number, "X")

    work = tempfile.mkdtemp(prefix="payonce-wechatpayv3-")
    cert_dir = os.path.join(work, "certs")
    os.makedirs(cert_dir)
    with open(os.path.join(cert_dir, serial + ".pem"), "w") as f:
        f.write(certificate_pem)
    public_key_file = os.path.join(work, "wechatpay_pub_key.pem")
    with open(public_key_file, "w") as f:
        f.write(pem_public(platform_key))

    # The SDK as a merchant configures it, once per kind of serial (it holds
    # either a public key or certificates, never both).
    by_public_key = Core(
        MCHID, "MERCHANTSERIAL", pem_private(merchant_key), APIV3_KEY,
        public_key=pem_public(platform_key), public_key_id=PUBLIC_KEY_ID,
    )
    by_certificate = Core(MCHID, "MERCHANTSERIAL", pem_private(merchant_key), APIV3_KEY, cert_dir=cert_dir)

    payonce = subprocess.Popen(
        [
            os.environ["PAYONCE_BIN"], "serve", "--dev", "--db", ":memory:", "--listen", "127.0.0.1:0",
            "--wechatpay-apiv3-key", APIV3_KEY,
            "--wechatpay-public-key", f"{PUBLIC_KEY_ID}={public_key_file}",
            "--wechatpay-public-key", f"{serial}={os.path.join(cert_dir, serial + '.pem')}",
        ],
        stdout=subprocess.PIPE, stderr=open(os.path.join(work, "payonce.err"), "w"), text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("PAYONCE_")},
    )
    try:
        first = payonce.stdout.readline().strip()
        if not first.startswith("listening on "):
            check("payonce serve starts with both kinds of serial", False, first)
            return
        base = first.removeprefix("listening on ")

        def order(order_no):
            status, text = http(base + "/v1/orders/" + order_no)
            return json.loads(text).get("status") if status == 200 else status

        def create(order_no):
            body = json.dumps({"order_no": order_no, "user_id": "u1", "amount": 9900})
            return http(base + "/v1/orders", "POST", body, {"Content-Type": "application/json"})[0]

        cases = [
            ("a public key (PUB_KEY_ID_)", by_public_key, platform_key, PUBLIC_KEY_ID),
            ("a platform certificate", by_certificate, certificate_key, serial),
            ("a platform certificate, serial in lower case", by_certificate, certificate_key, serial.lower()),
        ]
        for n, (kind, sdk, key, named) in enumerate(cases):
            genuine_order, forged_order = f"WXV3-{n}-GENUINE", f"WXV3-{n}-FORGED"
            for order_no in (genuine_order, forged_order):
                if create(order_no) != 201:
                    check(f"{kind}: order {order_no} created", False)
            headers, body = notice(genuine_order, key, named)
            read = sdk.callback(headers, body)
            check(
                f"{kind}: the SDK verifies and decrypts the genuine notice",
                bool(read) and read["resource"]["out_trade_no"] == genuine_order,
                read,
            )
            status, text = http(base + "/v1/callbacks/wechatpay", "POST", body, {**headers, "Content-Type": "application/json"})
            check(f"{kind}: payonce accepts the same bytes (204) and the order is PAID", (status, order(genuine_order)) == (204, "PAID"), (status, text))

            # One byte of the body changed after signing: refused by both.
            headers, body = notice(forged_order, key, named)
            tampered = body.replace('"resource_type"', '"resource_type" ', 1)
            refused_by_sdk = sdk.callback(headers, tampered) is None
            status, text = http(base + "/v1/callbacks/wechatpay", "POST", tampered, {**headers, "Content-Type": "application/json"})
            check(f"{kind}: a body changed after signing is refused by the SDK and by payonce ({status})",
                  refused_by_sdk and status == 401 and order(forged_order) == "PENDING", (refused_by_sdk, status, text))

            # Signed by a key that is not WeChat Pay's, under the genuine serial.
            headers, body = notice(forged_order, stranger_key, named)
            refused_by_sdk = sdk.callback(headers, body) is None
            status, text = http(base + "/v1/callbacks/wechatpay", "POST", body, {**headers, "Content-Type": "application/json"})
            check(f"{kind}: a notice signed by another key is refused by the SDK and by payonce ({status})",
                  refused_by_sdk and status == 401 and order(forged_order) == "PENDING", (refused_by_sdk, status, text))
    finally:
        payonce.terminate()
        payonce.wait(timeout=10)
        if failures:
            with open(os.path.join(work, "payonce.err")) as f:
                print(f.read()[-3000:], file=sys.stderr)


main()
sys.exit(1 if failures else 0)
