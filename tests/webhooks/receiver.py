"""Merchant endpoint for payonce's webhook tests.

Records every delivery, checks its Standard Webhooks signature with the
reference library (when importable) for each secret in WEBHOOK_SECRETS, and
answers as the tests tell it through the /_ control endpoints.
"""

import json
import os
import threading
import time
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:
    import importlib.metadata
    import standardwebhooks
    import standardwebhooks.webhooks as _swh_module

    LIBRARY = importlib.metadata.version("standardwebhooks")
except Exception:
    standardwebhooks = None
    LIBRARY = None

SECRETS = [s.strip() for s in os.environ.get("WEBHOOK_SECRETS", "").split(",") if s.strip()]
SIGNATURE_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature", "content-type", "user-agent")

LOCK = threading.Lock()
LOG = []
BEHAVIOURS = {}
CLOCK_OFFSET_S = 0.0

if standardwebhooks is not None:
    # The library reads its clock through the module-level name `datetime`
    # (webhooks.py: datetime.now(tz=timezone.utc)), so shifting that name's
    # now() lets tests send timestamps that are too old or too new without
    # waiting or lying in payonce's own clock.
    class _ShiftedDatetime(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(seconds=CLOCK_OFFSET_S)

    _swh_module.datetime = _ShiftedDatetime


def verify_all(body, headers):
    """None if every secret verifies, else the first error's text."""
    for secret in SECRETS:
        try:
            standardwebhooks.Webhook(secret).verify(body, headers)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return None if SECRETS else "WEBHOOK_SECRETS is empty"


def refused_by_all(body, headers):
    for secret in SECRETS:
        try:
            standardwebhooks.Webhook(secret).verify(body, headers)
            return False
        except Exception:
            pass
    return True


def tampered_refused(body, headers):
    flipped_body = body[:-1] + ("y" if body.endswith("x") else "x")
    # Every signature in the header is altered: with rotated secrets any one
    # intact signature would still (rightly) verify.
    sigs = []
    for sig in headers.get("webhook-signature", "").split(" "):
        version, _, b64 = sig.partition(",")
        if b64:
            b64 = ("B" if b64[0] == "A" else "A") + b64[1:]
        sigs.append(f"{version},{b64}")
    flipped_sig = dict(headers, **{"webhook-signature": " ".join(sigs)})
    return refused_by_all(flipped_body, headers) and refused_by_all(body, flipped_sig)


def order_no_of(body):
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get("order_no") if isinstance(value, dict) else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass

    def answer(self, status, value, extra_headers=(), raw=None):
        # 204 and 304 have no body by definition (RFC 9110): a body there
        # would be read as the next response on the kept-alive connection.
        bodiless = status in (204, 304)
        data = b"" if bodiless else (raw if raw is not None else json.dumps(value).encode())
        self.send_response(status)
        if not bodiless:
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
        for name, v in extra_headers:
            self.send_header(name, v)
        self.end_headers()
        self.wfile.write(data)

    def read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length).decode("utf-8", errors="replace") if length else ""

    def handle_any(self):
        try:
            body = self.read_body()
            path = self.path.split("?", 1)[0]
            if path.startswith("/_"):
                try:
                    self.control(path, body)
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    self.answer(400, {"error": f"bad control request: {e!r}"})
            else:
                self.endpoint(path, body)
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up (timeout under delay_ms): nobody to answer.
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = handle_any

    def control(self, path, body):
        global CLOCK_OFFSET_S
        method = self.command
        if method == "GET" and path == "/_info":
            return self.answer(200, {"library": LIBRARY})
        if method == "GET" and path == "/_log":
            with LOCK:
                return self.answer(200, {"requests": LOG})
        if method == "POST" and path == "/_clock":
            with LOCK:
                CLOCK_OFFSET_S = float(json.loads(body)["offset_s"])
            return self.answer(200, {"ok": True})
        if method == "POST" and path == "/_behave":
            behaviour = json.loads(body)
            with LOCK:
                BEHAVIOURS[behaviour.pop("path")] = behaviour
            return self.answer(200, {"ok": True})
        self.answer(404, {"error": f"no control endpoint {method} {path}"})

    def endpoint(self, path, body):
        arrived = time.time()
        all_headers = {k.lower(): v for k, v in self.headers.items()}
        if standardwebhooks is not None:
            verify_error = verify_all(body, all_headers)
            verified = verify_error is None
            refused = tampered_refused(body, all_headers)
        else:
            verify_error, verified, refused = None, None, None
        order_no = order_no_of(body)
        msg_id = all_headers.get("webhook-id")

        with LOCK:
            b = dict(BEHAVIOURS.get(path, {}))
            earlier = sum(1 for e in LOG if e["path"] == path and e["headers"].get("webhook-id") == msg_id)
            fail_status = b.get("fail_status", 500)
            if verified is False:
                status = 400
            elif order_no is not None and order_no in b.get("fail_orders", []):
                status = fail_status
            elif any((msg_id or "").startswith(p) for p in b.get("fail_ids", [])):
                status = fail_status
            elif earlier < b.get("fail_first", 0):
                status = fail_status
            else:
                status = b.get("status", 200)
            entry = {
                "index": len(LOG),
                "path": path,
                "at": arrived,
                "headers": {k: all_headers[k] for k in SIGNATURE_HEADERS if k in all_headers},
                "body": body,
                "order_no": order_no,
                "verified": verified,
                "tampered_refused": refused,
                "verify_error": verify_error,
                "status": None,  # until answered, so a delayed call shows as pending
            }
            LOG.append(entry)

        # delay_orders, when given, limits the delay to those orders' calls.
        delayed = "delay_orders" not in b or order_no in b["delay_orders"]
        if b.get("delay_ms") and delayed:
            time.sleep(b["delay_ms"] / 1000)
        with LOCK:
            entry["status"] = status

        extra = []
        if not 200 <= status < 300 and b.get("retry_after") is not None:
            extra.append(("Retry-After", str(b["retry_after"])))
        # fail_body_hex: the exact bytes of a failing answer's body (NUL
        # bytes, invalid UTF-8), as a hostile receiver would send them.
        raw = None
        if not 200 <= status < 300 and b.get("fail_body_hex") is not None:
            raw = bytes.fromhex(b["fail_body_hex"])
        if verified is False:
            self.answer(400, {"error": "verification failed"}, extra)
        else:
            self.answer(status, {"ok": 200 <= status < 300}, extra, raw)


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
