// make test-clients (tests/clients/clients.sh): the TypeScript client that
// openapi-typescript generates from docs/openapi.yaml with its default
// options (generated/payonce.ts), called through openapi-fetch against a
// live payonce at PAYONCE_URL with the token PAYONCE_TOKEN. tsc type-checks
// this file first, so a generated type that refused the documented body
// fails the test before anything runs.
import createClient from "openapi-fetch";
import type { components, paths } from "./generated/payonce.js";

type CreateOrderRequest = components["schemas"]["CreateOrderRequest"];

const baseUrl = process.env.PAYONCE_URL;
const token = process.env.PAYONCE_TOKEN;
if (!baseUrl || !token) {
    throw new Error("PAYONCE_URL and PAYONCE_TOKEN must be set");
}
const client = createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${token}` } });

// The body the README's tour sends: no currency (CNY when omitted), no expires_in_s.
const minimal: CreateOrderRequest = { order_no: "TS-1", user_id: "u1", amount: 9900 };
// The generated types are not everything-optional: amount is required ...
// @ts-expect-error amount is missing
const noAmount: CreateOrderRequest = { order_no: "TS-2", user_id: "u1" };
// ... and typed.
// @ts-expect-error amount is a string
const textAmount: CreateOrderRequest = { order_no: "TS-3", user_id: "u1", amount: "99.00" };
void noAmount;
void textAmount;

function check(what: string, ok: boolean, detail: unknown): void {
    if (!ok) {
        console.log(`  FAIL  typescript: ${what}: ${JSON.stringify(detail)}`);
        process.exitCode = 1;
    } else {
        console.log(`  ok    typescript: ${what}`);
    }
}

const created = await client.POST("/v1/orders", { body: minimal });
check("POST /v1/orders with the minimal body: 201", created.response.status === 201, created.error ?? created.data);
const order = created.data;
check(
    "the created order: TS-1, 9900 CNY, PENDING",
    order?.order_no === "TS-1" && order.amount === 9900 && order.currency === "CNY" && order.status === "PENDING",
    order,
);

const again = await client.POST("/v1/orders", { body: minimal });
check(
    "the same body again: 200, Idempotent-Replayed: true",
    again.response.status === 200 && again.response.headers.get("Idempotent-Replayed") === "true",
    again.response.status,
);

const got = await client.GET("/v1/orders/{order_no}", { params: { path: { order_no: "TS-1" } } });
check(
    "GET /v1/orders/TS-1: 200, the same order",
    got.response.status === 200 && got.data?.order_no === "TS-1" && got.data.created_at === order?.created_at && got.data.payments.length === 0,
    got.error ?? got.data,
);

const refused = await client.POST("/v1/orders", { body: { order_no: "TS-1", user_id: "u1", amount: 100 } });
check(
    "the same order_no with another amount: 409 with the error shape",
    refused.response.status === 409 && typeof refused.error?.error.code === "string",
    refused.error,
);
