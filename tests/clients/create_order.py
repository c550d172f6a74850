"""make test-clients (tests/clients/clients.sh): the Python client that
openapi-python-client generates from docs/openapi.yaml with its default
options (package payonce_client), against a live payonce at PAYONCE_URL
with the token PAYONCE_TOKEN: the README's minimal order created, read back
and parsed into the generated models, a conflicting one refused."""

import os
import sys

from payonce_client import AuthenticatedClient
from payonce_client.api.orders import create_order, get_order
from payonce_client.models import CreateOrderRequest, Error, Order, OrderDetail, OrderStatus
from payonce_client.types import UNSET

failures = 0


def check(what, ok, detail):
    global failures
    if ok:
        print(f"  ok    python: {what}")
    else:
        failures += 1
        print(f"  FAIL  python: {what}: {detail!r}")


client = AuthenticatedClient(
    base_url=os.environ["PAYONCE_URL"], token=os.environ["PAYONCE_TOKEN"], raise_on_unexpected_status=True
)

# The body the README's tour sends: no currency (CNY when omitted), no expires_in_s.
minimal = CreateOrderRequest(order_no="PY-1", user_id="u1", amount=9900)
check("the minimal body leaves currency unset", minimal.currency is UNSET, minimal.to_dict())

created = create_order.sync_detailed(client=client, body=minimal)
check("POST /v1/orders with the minimal body: 201", created.status_code == 201, created.content)
order = created.parsed
check(
    "parsed as Order: PY-1, 9900 CNY, PENDING",
    isinstance(order, Order)
    and (order.order_no, order.amount, order.currency, order.status) == ("PY-1", 9900, "CNY", OrderStatus.PENDING),
    order,
)

again = create_order.sync_detailed(client=client, body=minimal, idempotency_key=UNSET)
check(
    "the same body again: 200, Idempotent-Replayed: true",
    again.status_code == 200 and again.headers.get("Idempotent-Replayed") == "true",
    (again.status_code, dict(again.headers)),
)

got = get_order.sync_detailed("PY-1", client=client)
detail = got.parsed
check(
    "GET /v1/orders/PY-1: 200, parsed as OrderDetail, the same order",
    got.status_code == 200
    and isinstance(detail, OrderDetail)
    and detail.order_no == "PY-1"
    and isinstance(order, Order)
    and detail.created_at == order.created_at
    and detail.payments == [],
    got.content,
)

refused = create_order.sync_detailed(
    client=client, body=CreateOrderRequest(order_no="PY-1", user_id="u1", amount=100)
)
check(
    "the same order_no with another amount: 409, parsed as Error",
    refused.status_code == 409 and isinstance(refused.parsed, Error) and bool(refused.parsed.error.code),
    refused.content,
)

sys.exit(1 if failures else 0)
