//! Every read endpoint over HTTP on each engine (the conformance suite):
//! filters, cursors and pages answer the same on SQLite and PostgreSQL.

use crate::engines::Db;
use crate::util::{Pay, Server};
use serde_json::{json, Value};

fn create(server: &Server, order_no: &str, user_id: &str) {
    let resp = server.post_json("/v1/orders", &json!({"order_no": order_no, "user_id": user_id, "amount": 1000}));
    assert_eq!(resp.status, 201, "{}", resp.text());
}

fn get(server: &Server, path: &str) -> Value {
    let resp = server.get(path);
    assert_eq!(resp.status, 200, "{path}: {}", resp.text());
    resp.json()
}

fn order_nos(page: &Value) -> Vec<String> {
    page["orders"].as_array().expect("orders").iter().map(|o| o["order_no"].as_str().expect("no").to_owned()).collect()
}

/// Five orders of two users: R-1 PAID, R-2 CLOSED, R-3 REFUNDED, R-4 and R-5 PENDING.
fn seed(db: &Db) -> Server {
    let server = db.serve(&["--coupon", "NEW10", "--points-per-yuan", "1"]);
    for (order_no, user) in [("R-1", "ua"), ("R-2", "ub"), ("R-3", "ua"), ("R-4", "ub"), ("R-5", "ua")] {
        create(&server, order_no, user);
    }
    for (pay_no, order_no) in [("RP-1", "R-1"), ("RP-3", "R-3")] {
        let resp = Pay { pay_no, order_no, amount: 1000, status: "SUCCESS" }.send(&server);
        assert_eq!(resp.json()["outcome"], "applied", "{}", resp.text());
    }
    let resp = server.post_json("/v1/orders/R-2/close", &json!({}));
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = server.post_json("/v1/orders/R-3/refund", &json!({"refund_no": "RR-3"}));
    assert!(resp.status == 200 || resp.status == 201, "{}", resp.text());
    let resp = server.callback(
        "/v1/callbacks/generic/refund",
        &json!({"refund_no": "RR-3", "order_no": "R-3", "status": "SUCCESS"}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    server
}

for_each_engine! {
    fn every_read_filters_and_pages_alike(db) {
        let server = seed(db);
        let label = db.label();
        assert_eq!(order_nos(&get(&server, "/v1/orders")), ["R-5", "R-4", "R-3", "R-2", "R-1"], "{label}");
        assert_eq!(order_nos(&get(&server, "/v1/orders?user_id=ua")), ["R-5", "R-3", "R-1"], "{label}");
        assert_eq!(order_nos(&get(&server, "/v1/orders?status=PENDING")), ["R-5", "R-4"], "{label}");
        assert_eq!(order_nos(&get(&server, "/v1/orders?user_id=ub&status=CLOSED")), ["R-2"], "{label}");
        assert_eq!(order_nos(&get(&server, "/v1/orders?user_id=nobody")), Vec::<String>::new(), "{label}");
        // Pages of two, by the cursor, to the end.
        let (mut seen, mut path) = (Vec::new(), "/v1/orders?limit=2".to_owned());
        loop {
            let page = get(&server, &path);
            seen.extend(order_nos(&page));
            match page["next_after"].as_str() {
                Some(next) => path = format!("/v1/orders?limit=2&after={next}"),
                None => break,
            }
        }
        assert_eq!(seen, ["R-5", "R-4", "R-3", "R-2", "R-1"], "{label}: every order once, newest first");

        let detail = get(&server, "/v1/orders/R-3");
        assert_eq!(detail["status"], "REFUNDED", "{label}: {detail}");
        assert_eq!(detail["payments"].as_array().map(Vec::len), Some(1), "{label}");
        assert_eq!(detail["coupons"][0]["status"], "FROZEN", "{label}: {detail}");
        assert_eq!(detail["points"].as_array().map(Vec::len), Some(2), "{label}: ORDER_PAID and its reversal");
        let types: Vec<&str> =
            detail["events"].as_array().into_iter().flatten().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(types, ["order.paid", "order.refunding", "order.refunded"], "{label}: the order's events, in order");
        // An operator's compensation is the order's audit row, with its reason.
        let compensation = json!({"order_no": "R-1", "action": "freeze_coupon", "coupon_template_id": "NEW10",
                                  "reason": "<script>alert(1)</script> a reason, kept as text"});
        let resp = server.post_json("/v1/compensations", &compensation);
        assert_eq!(resp.status, 200, "{label}: {}", resp.text());
        let audit = get(&server, "/v1/orders/R-1")["audit"].clone();
        assert_eq!(audit.as_array().map(Vec::len), Some(1), "{label}: {audit}");
        assert_eq!(audit[0]["actor"], "anonymous", "{label}: {audit}");
        assert!(audit[0]["at"].is_string() && audit[0]["action"].is_string(), "{label}: {audit}");
        assert!(audit[0]["detail"].to_string().contains("<script>"), "{label}: the reason as written: {audit}");

        let coupons = get(&server, "/v1/users/ua/coupons");
        assert_eq!(coupons.to_string().matches("NEW10").count(), 2, "{label}: {coupons}");
        let points = get(&server, "/v1/users/ua/points");
        assert!(points.to_string().contains("ORDER_PAID_REVERSAL"), "{label}: {points}");

        let events = get(&server, "/v1/events?after=0&limit=2");
        assert_eq!(events["events"].as_array().map(Vec::len), Some(2), "{label}: {events}");
        let next = events["next_after"].as_i64().expect("next_after");
        let rest = get(&server, &format!("/v1/events?after={next}&limit=100"));
        let types: Vec<&str> = events["events"].as_array().into_iter().chain(rest["events"].as_array()).flatten()
            .map(|e| e["type"].as_str().expect("type")).collect();
        assert_eq!(types, ["order.paid", "order.paid", "order.closed", "order.refunding", "order.refunded"], "{label}");

        assert_eq!(get(&server, "/v1/inspections")["ok"], true, "{label}");
        assert_eq!(get(&server, "/v1/admin/mode"), json!({"mode": "normal"}), "{label}");
        let metrics = server.get("/metrics");
        assert_eq!(metrics.status, 200, "{label}");
        assert!(metrics.text().contains("payonce_group_commit_batches_total "), "{label}");
        assert_eq!(server.get("/healthz").status, 200, "{label}");
    }
}
