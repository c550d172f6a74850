#!/usr/bin/env python3
"""Hostile clients for tests/deploy/nginx.sh: raw TLS requests that curl
cannot send (a 100 GB Content-Length with no body, a 1 MiB header, a client
that sends one byte a second). Each prints one line and exits 0 when the
proxy stopped the request as expected, 1 otherwise.

usage: proxy_probe.py PORT big-length|big-header|slow-header|slow-body|non-ascii-header
"""

import socket
import ssl
import sys
import time

HOST = "127.0.0.1"
PATH = "/v1/callbacks/generic"
# Any wait here is bounded: nginx must act well within this.
DEADLINE_S = 20


def connect(port):
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection((HOST, port), timeout=DEADLINE_S)
    return context.wrap_socket(raw, server_hostname=HOST)


def read_answer(sock):
    """Everything until the proxy closes; b"" when it closed without answering."""
    out = b""
    sock.settimeout(DEADLINE_S)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (ConnectionResetError, ssl.SSLError, socket.timeout, OSError) as e:
        if isinstance(e, socket.timeout):
            raise
    return out


def read_status(sock):
    """Reads until the end of the answer's header; (status, seconds waited)."""
    t0 = time.monotonic()
    out = b""
    sock.settimeout(DEADLINE_S)
    try:
        while b"\r\n\r\n" not in out:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (ConnectionResetError, ssl.SSLError, OSError) as e:
        if isinstance(e, socket.timeout):
            raise
    return status_of(out), time.monotonic() - t0


def status_of(answer):
    try:
        return int(answer.split(b"\r\n", 1)[0].split(b" ")[1])
    except (IndexError, ValueError):
        return None


def head(extra=b"", length=None):
    lines = [b"POST " + PATH.encode() + b" HTTP/1.1", b"Host: " + HOST.encode(), b"Content-Type: application/json"]
    if length is not None:
        lines.append(b"Content-Length: " + str(length).encode())
    return b"\r\n".join(lines) + b"\r\n" + extra


def big_length(port):
    sock = connect(port)
    sock.sendall(head(length=100 * 1024**3) + b"\r\n")
    status, waited = read_status(sock)
    print(f"Content-Length 100 GiB, no body: HTTP {status} after {waited:.2f}s")
    return status == 413


def big_header(port):
    sock = connect(port)
    t0 = time.monotonic()
    try:
        sock.sendall(head(b"X-Padding: " + b"a" * (1024 * 1024) + b"\r\n", length=2) + b"\r\n{}")
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass  # nginx may answer and close before reading it all
    status, _ = read_status(sock)
    print(f"1 MiB header: HTTP {status} after {time.monotonic() - t0:.2f}s")
    return status in (400, 494)


def trickle(sock, data, t0, label):
    """Sends one byte a second; returns the seconds until the proxy cut it."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            return time.monotonic() - t0
        # Between bytes, see whether the proxy has answered or closed.
        sock.settimeout(1.0)
        try:
            sock.recv(65536)  # an answer or end of stream: the proxy has given up on us
            return time.monotonic() - t0
        except socket.timeout:
            pass
        except (ConnectionResetError, ssl.SSLError, OSError):
            return time.monotonic() - t0
        if time.monotonic() - t0 > DEADLINE_S:
            print(f"{label}: still open after {DEADLINE_S}s")
            return None
    return None


def slow_header(port):
    sock = connect(port)
    t0 = time.monotonic()
    data = head(b"X-Slow: " + b"s" * 60 + b"\r\n", length=2) + b"\r\n{}"
    cut = trickle(sock, data, t0, "slow header")
    if cut is None:
        print("slow header (1 byte/s): never cut")
        return False
    print(f"slow header (1 byte/s): cut by nginx after {cut:.1f}s")
    return cut < DEADLINE_S


def slow_body(port):
    """A complete header, then the body one byte a second for a while (held
    at nginx: payonce sees nothing), then silence: cut by client_body_timeout."""
    sock = connect(port)
    sock.sendall(head(length=100) + b"\r\n")
    t0 = time.monotonic()
    for _ in range(3):
        sock.sendall(b" ")
        time.sleep(1)
    stalled = time.monotonic()
    answer = read_answer(sock)
    status = status_of(answer)
    what = f"HTTP {status}" if status else "connection reset"
    print(
        f"slow body (1 byte/s for 3s, then nothing): {what} by nginx "
        f"{time.monotonic() - stalled:.1f}s after the last byte ({time.monotonic() - t0:.1f}s in all)"
    )
    return time.monotonic() - t0 < DEADLINE_S


def non_ascii_header(port):
    sock = connect(port)
    sock.sendall(head(b"X-Name: caf\xc3\xa9\r\n", length=2) + b"\r\n{}")
    answer = read_answer(sock)
    status = status_of(answer)
    print(f"non-ASCII header value: HTTP {status}")
    # payonce answers it in its error shape (the probe sends no signature: 401).
    return status in (400, 401)


def main():
    port, probe = int(sys.argv[1]), sys.argv[2]
    probes = {
        "big-length": big_length,
        "big-header": big_header,
        "slow-header": slow_header,
        "slow-body": slow_body,
        "non-ascii-header": non_ascii_header,
    }
    try:
        ok = probes[probe](port)
    except socket.timeout:
        print(f"{probe}: no answer within {DEADLINE_S}s")
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
