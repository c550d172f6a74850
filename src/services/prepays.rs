//! Paying: the platform's payment of an order created once per order and
//! channel (docs/platforms.md, "Paying").
//!
//! A server call (every WeChat Pay method, Alipay precreate) is one
//! `platform_call` row of kind `prepay` (`uk_platform_call_prepay`). The pay
//! request that inserts it makes the call, outside any transaction, and
//! finishes the row with what it answered; every other request for the order
//! and channel — in this process or another on the same database — reads the
//! row and waits for that answer (bounded by the timeout plus a second), so
//! a triple click is one platform call. Each step on the row is a
//! compare-and-set on its `attempts`: a refresh past `--prepay-reuse-s`, a
//! retry after a failure, and the call of a caller that died mid-call (its
//! lease ran out) each take the row once. Alipay's page, wap and app
//! payments are requests signed for the buyer to open: nothing is called
//! or kept, and the platform's `out_trade_no` keeps them one trade.

use super::Core;
use crate::clock::{format_ms, parse_rfc3339_ms};
use crate::domain::{IdempotencySlot, Order, OrderStatus, PlatformCallKind, PlatformCallStatus};
use crate::error::{Error, ErrorKind};
use crate::keylock::LockKey;
use crate::platform_ops::{Paying, PaymentOffer};
use crate::platforms::{Calls, Exchange, Payment, PrepayAnswer, PrepayRequest};
use crate::store::{NewPrepay, PrepayFinish, PrepayParams, PrepayRow, ReadTx};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// What a waiting request adds to the platform timeout before it answers
/// `payment_in_progress`, and what a call's lease adds to it for the
/// recording around the call.
const WAIT_MARGIN_MS: u64 = 1_000;
/// What a call's lease adds to its two platform calls (the creation and the
/// query of a "paid" answer) for the writes around them.
const LEASE_MARGIN_MS: u64 = 5_000;
/// How often a waiting request reads the row again.
const WAIT_POLL: Duration = Duration::from_millis(20);
/// `description`: WeChat Pay's limit, and Alipay's `subject` takes it.
const DESCRIPTION_CHARS_MAX: usize = 127;
/// The longest openid, client_ip or return_url payonce sends on.
const OPENID_BYTES_MAX: usize = 128;
const RETURN_URL_BYTES_MAX: usize = 1_024;

/// `POST /v1/orders/{order_no}/pay`'s body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PayRequest {
    pub channel: String,
    pub method: String,
    pub appid: Option<String>,
    pub openid: Option<String>,
    pub client_ip: Option<String>,
    pub return_url: Option<String>,
    pub description: Option<String>,
}

/// The parameters a prepay row keeps from its first request, so every
/// later call of the row sends the platform the same request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Kept {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    openid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    client_ip: Option<String>,
    description: String,
}

/// The payment object answered: who, how, when, then the method's keys.
#[derive(Serialize)]
struct OfferText<'a> {
    channel: &'a str,
    method: &'a str,
    created_at: &'a str,
    expires_at: &'a str,
    #[serde(flatten)]
    fields: &'a serde_json::Map<String, serde_json::Value>,
}

/// The one member of a kept payment its reuse needs.
#[derive(Deserialize)]
struct CreatedAt {
    created_at: String,
}

/// An error as a prepay row keeps it for the requests that waited on it.
#[derive(Serialize, Deserialize)]
struct KeptError {
    code: String,
    message: String,
}

/// What a pay request answers: the payment, or the refusal.
type Answered = Result<Paying, Error>;

#[derive(Clone, Copy)]
pub struct Prepays<'a> {
    core: &'a Core,
}

impl<'a> Prepays<'a> {
    pub(crate) fn new(core: &'a Core) -> Prepays<'a> {
        Prepays { core }
    }

    /// The payment of `order_no` through `request.channel`: created at the
    /// platform once, answered again while younger than `--prepay-reuse-s`.
    /// With an Idempotency-Key the answer (or a business refusal) is stored
    /// like any POST's; a 502 or 503 is not, so a retry asks again.
    pub fn pay(&self, order_no: &str, request: &PayRequest, slot: Option<&IdempotencySlot>) -> Result<Paying, Error> {
        let result = self.pay_unkeyed(order_no, request);
        match slot {
            Some(slot) => self.core.write_op(&[], Some(slot), |_| result.clone()),
            None => result,
        }
    }

    fn pay_unkeyed(&self, order_no: &str, request: &PayRequest) -> Result<Paying, Error> {
        let platforms = &self.core.config().platforms;
        let api = platforms.registry.calls(&request.channel).ok_or_else(|| not_configured(&request.channel))?;
        let notify_base = platforms.public_base_url.as_deref().ok_or_else(|| {
            Error::new(
                ErrorKind::ChannelNotConfigured,
                format!("{} payments need --public-base-url: the platform notifies payonce there", request.channel),
            )
        })?;
        if !api.prepay_methods().contains(&request.method.as_str()) {
            return Err(Error::invalid(format!(
                "method must be one of {} for {}",
                api.prepay_methods().join(", "),
                request.channel
            )));
        }
        let appid = chosen_appid(api, request)?;
        check_fields(request)?;
        let order = self.payable(order_no)?;
        let notify_url = format!("{}/v1/callbacks/{}", notify_base.trim_end_matches('/'), api.name());
        let kept = Kept {
            openid: request.openid.clone(),
            client_ip: request.client_ip.clone(),
            description: request.description.clone().unwrap_or_else(|| order.order_no.clone()),
        };
        let asked = Asked { api, order: &order, method: &request.method, appid, notify_url: &notify_url };
        // The platform's own refusal of what it cannot carry (an order_no,
        // a currency, a missing openid), before anything is kept or called.
        api.prepay_check(&asked.prepay_request(&kept, request.return_url.as_deref())).map_err(Error::invalid)?;
        if api.prepay_is_signed_only(&request.method) {
            return self.signed_for_buyer(&asked, &kept, request.return_url.as_deref());
        }
        self.once(&asked, &kept)
    }

    /// The order, when a payment may be created for it now: PENDING, not
    /// past `expires_at`, and no close begun at the platforms.
    fn payable(&self, order_no: &str) -> Result<Order, Error> {
        let now_ms = self.core.clock().now_ms();
        self.core.store().read(|tx| refuse_unpayable_in(tx, order_no, now_ms))
    }

    /// Alipay page, wap and app: signed afresh for every request. The row
    /// (done, no call) says a request was handed to the buyer, who may open
    /// it until `expires_at`: a close waits for that (`close_at`).
    fn signed_for_buyer(&self, asked: &Asked, kept: &Kept, return_url: Option<&str>) -> Result<Paying, Error> {
        let channel = asked.api.name();
        let order_no = asked.order.order_no.as_str();
        let params = kept_text(kept)?;
        let new = PrepayParams { method: asked.method, appid: asked.appid, params: &params };
        let now_ms = self.core.clock().now_ms();
        let now = format_ms(now_ms);
        let key = self.core.locks().lock(LockKey::Order(order_no));
        self.core.store().write(&[&key], |tx| {
            refuse_unpayable_in(tx, order_no, now_ms)?;
            let Some(row) = tx.prepay_row(channel, order_no)? else {
                let first = NewPrepay {
                    channel,
                    order_no,
                    method: asked.method,
                    appid: asked.appid,
                    params: &params,
                    now: &now,
                    lease_until: None,
                };
                return tx.begin_prepay(&first).map(drop);
            };
            if asked.api.prepay_is_signed_only(&row.method) {
                return Ok(());
            }
            // A server payment's row: the buyer's trade may exist there
            // already, unless every attempt was refused.
            let in_flight = row.status == PlatformCallStatus::Pending;
            if row.trade_may_exist || in_flight || !tx.sign_over_prepay(row.id, row.attempts, &new, &now)? {
                return Err(conflict(channel, &row, asked.method));
            }
            Ok(())
        })?;
        drop(key);
        let exchange = asked.api.prepay(&asked.prepay_request(kept, return_url), now_ms);
        match exchange.meaning {
            PrepayAnswer::Created(payment) => Ok(asked.paying(&payment, &now)?.0),
            PrepayAnswer::NotSendable(why) => Err(Error::invalid(why)),
            other => Err(Error::internal(format!("a request signed for the buyer answered {other:?}"))),
        }
    }

    /// The server call, once: the row's answer, or the call this request
    /// makes because it won the row, or the wait for another's call.
    fn once(&self, asked: &Asked, kept: &Kept) -> Result<Paying, Error> {
        let channel = asked.api.name();
        let order_no = asked.order.order_no.as_str();
        let platforms = &self.core.config().platforms;
        let deadline = Instant::now() + Duration::from_millis(platforms.timeout_ms.saturating_add(WAIT_MARGIN_MS));
        // The attempt this request saw in flight: when it ends failed, its
        // error is this request's answer too.
        let mut waited_on = None;
        loop {
            let now_ms = self.core.clock().now_ms();
            let lease_until = format_ms(now_ms.saturating_add(self.lease_ms()));
            let now = format_ms(now_ms);
            let Some(row) = self.core.store().read(|tx| tx.prepay_row(channel, order_no))? else {
                if let Some(id) = self.begin(asked, kept, &now, &lease_until)? {
                    return self.call(asked, kept, id, 1);
                }
                continue;
            };
            let row_kept: Kept = serde_json::from_str(&row.params)
                .map_err(|e| Error::internal(format!("platform_call {} params: {e}", row.id)))?;
            let in_flight = row.in_flight(&now);
            let differs =
                row.method != asked.method || row.appid.as_deref() != asked.appid || row_kept.openid != kept.openid;
            if differs {
                // Other parameters replace those of a row whose every attempt
                // was refused (no trade can exist); otherwise they conflict.
                if row.trade_may_exist || in_flight {
                    return Err(conflict(channel, &row, asked.method));
                }
                if self.reclaim(asked, &row, Some(kept), &now, &lease_until)? {
                    return self.call(asked, kept, row.id, row.attempts + 1);
                }
                continue;
            }
            if in_flight {
                waited_on.get_or_insert(row.attempts);
                if Instant::now() >= deadline {
                    return Err(in_progress(channel, order_no));
                }
                std::thread::sleep(WAIT_POLL);
                continue;
            }
            if let Some(answered) = self.stored_answer(asked, &row, waited_on, now_ms)? {
                return answered;
            }
            if self.reclaim(asked, &row, None, &now, &lease_until)? {
                return self.call(asked, &row_kept, row.id, row.attempts + 1);
            }
        }
    }

    /// What a finished row answers without a call: its payment while it is
    /// younger than `--prepay-reuse-s`; the error of the attempt this
    /// request waited on. `None`: the row needs a new call.
    fn stored_answer(
        &self,
        asked: &Asked,
        row: &PrepayRow,
        waited_on: Option<i64>,
        now_ms: i64,
    ) -> Result<Option<Answered>, Error> {
        let Some(answer) = row.answer.as_deref() else {
            return Ok(None);
        };
        let waited_for_this = waited_on == Some(row.attempts);
        match row.status {
            PlatformCallStatus::Done => {
                // Its age from when the platform was asked (the payment's
                // `created_at`), as the platform counts the prepay_id's life.
                let created_at = serde_json::from_str::<CreatedAt>(answer).map(|a| a.created_at);
                let asked_at = created_at.as_deref().unwrap_or(&row.updated_at);
                let age_ms = parse_rfc3339_ms(asked_at).map_or(i64::MAX, |at| now_ms.saturating_sub(at));
                if waited_for_this || age_ms < self.core.config().platforms.prepay_reuse_ms {
                    return Ok(Some(Ok(Paying {
                        order: asked.order.clone(),
                        payment: PaymentOffer::from_text(answer),
                    })));
                }
                Ok(None)
            }
            PlatformCallStatus::Failed if waited_for_this => {
                let kept: KeptError = serde_json::from_str(answer)
                    .map_err(|e| Error::internal(format!("platform_call {} answer: {e}", row.id)))?;
                let kind = ErrorKind::ALL
                    .iter()
                    .copied()
                    .find(|k| crate::wire::code_of(*k) == kept.code)
                    .unwrap_or(ErrorKind::PlatformUnavailable);
                Ok(Some(Err(Error::new(kind, kept.message))))
            }
            _ => Ok(None),
        }
    }

    /// The row of a first call, inserted under the order's key after the
    /// order is checked again in the same transaction: a close queued (under
    /// the same key) first refuses the payment; a payment begun first holds
    /// the close's confirmation until its call ends (`close_at`).
    fn begin(&self, asked: &Asked, kept: &Kept, now: &str, lease_until: &str) -> Result<Option<i64>, Error> {
        let order_no = asked.order.order_no.as_str();
        let params = kept_text(kept)?;
        let now_ms = self.core.clock().now_ms();
        let key = self.core.locks().lock(LockKey::Order(order_no));
        self.core.store().write(&[&key], |tx| {
            refuse_unpayable_in(tx, order_no, now_ms)?;
            tx.begin_prepay(&NewPrepay {
                channel: asked.api.name(),
                order_no,
                method: asked.method,
                appid: asked.appid,
                params: &params,
                now,
                lease_until: Some(lease_until),
            })
        })
    }

    /// Takes `row` for a new call, under the order's key and after the
    /// order is checked again, as [`Prepays::begin`]: a refresh, a retry or
    /// a dead caller's call never creates a trade for an order a close has
    /// begun on. With `replacing`, the call sends those parameters instead.
    fn reclaim(
        &self,
        asked: &Asked,
        row: &PrepayRow,
        replacing: Option<&Kept>,
        now: &str,
        lease_until: &str,
    ) -> Result<bool, Error> {
        let order_no = asked.order.order_no.as_str();
        let params = replacing.map(kept_text).transpose()?;
        let new = params.as_deref().map(|params| PrepayParams { method: asked.method, appid: asked.appid, params });
        let now_ms = self.core.clock().now_ms();
        let key = self.core.locks().lock(LockKey::Order(order_no));
        self.core.store().write(&[&key], |tx| {
            refuse_unpayable_in(tx, order_no, now_ms)?;
            tx.reclaim_prepay(row.id, row.attempts, now, lease_until, new.as_ref())
        })
    }

    /// Attempt `attempt` of row `id`: the platform call, then the row
    /// finished with what this request answers.
    fn call(&self, asked: &Asked, kept: &Kept, id: i64, attempt: i64) -> Result<Paying, Error> {
        let now_ms = self.core.clock().now_ms();
        // Only the request that calls takes one of the places of requests
        // waiting on platforms; those waiting on its row take none.
        let place = super::platform_calls::WaitingPlace::take(&self.core.config().platforms.waiting);
        let exchange = match place {
            Some(_) => asked.api.prepay(&asked.prepay_request(kept, None), now_ms),
            None => Exchange::unknown(
                format!("prepay {}", asked.order.order_no),
                None,
                String::new(),
                "too many requests are waiting on the payment platforms".to_owned(),
                PrepayAnswer::Unknown,
            ),
        };
        crate::test_hooks::EnvHook::HoldAfterPrepayMs.sleep();
        let channel = asked.api.name();
        let order_no = asked.order.order_no.as_str();
        let (status, answer, result) = match &exchange.meaning {
            PrepayAnswer::Created(payment) => {
                let (paying, text) = asked.paying(payment, &format_ms(now_ms))?;
                (PlatformCallStatus::Done, text, Ok(paying))
            }
            meaning => {
                let err = self.refusal(asked, meaning, &exchange);
                let kept = KeptError { code: crate::wire::code_of(err.kind).to_owned(), message: err.message.clone() };
                let text = serde_json::to_string(&kept).map_err(|e| Error::internal(format!("prepay answer: {e}")))?;
                (PlatformCallStatus::Failed, text, Err(err))
            }
        };
        // Only a refusal proves there is no trade; anything else may have made one.
        let trade_may_exist = !matches!(exchange.meaning, PrepayAnswer::Refused { .. } | PrepayAnswer::NotSendable(_));
        let end = PrepayFinish {
            status,
            trade_may_exist,
            request: &exchange.request,
            http_status: exchange.http_status,
            response: &exchange.recorded_response(),
            answer: &answer,
            now: &self.core.clock().now_text(),
        };
        if self.core.store().write(&[], |tx| tx.finish_prepay(id, attempt, &end))? {
            self.core.metrics().observe_platform_call(PlatformCallKind::Prepay, status.as_str());
        } else {
            // This call outlived its lease and another took the row: the
            // platform answered both about the one trade of this out_trade_no.
            crate::log::warn("prepay finished after its lease", &[("channel", &channel), ("order_no", &order_no)]);
        }
        result
    }

    /// The error a call that created nothing answers. A trade the platform
    /// says is paid is queried and the payment applied first (source
    /// `query`), so the buyer's click after paying finds the order PAID.
    fn refusal(&self, asked: &Asked, meaning: &PrepayAnswer, exchange: &Exchange<PrepayAnswer>) -> Error {
        let channel = asked.api.name();
        let order_no = asked.order.order_no.as_str();
        match meaning {
            PrepayAnswer::Paid => match self.core.platform_calls().sync_at(channel, order_no) {
                Ok(order) if order.status == OrderStatus::Paid => Error::invalid_transition(format!(
                    "order {order_no:?} is PAID: {channel} says its trade is paid, and the payment is applied"
                )),
                Ok(_) | Err(_) => Error::new(
                    ErrorKind::PlatformUnavailable,
                    format!("{channel} says the trade of {order_no:?} is paid, and its query did not confirm it yet; retry shortly"),
                ),
            },
            PrepayAnswer::Closed => Error::new(
                ErrorKind::OrderExpired,
                format!("{channel} says the trade of {order_no:?} is closed: no payment can be made"),
            ),
            PrepayAnswer::Refused { code, message } => Error::new(
                ErrorKind::PlatformRefused,
                format!("{channel} refused the payment of {order_no:?}: {}: {}", printable(code), printable(message)),
            ),
            PrepayAnswer::NotSendable(why) => Error::invalid(why.clone()),
            PrepayAnswer::Created(_) | PrepayAnswer::Unknown => {
                let why = exchange.distrust.as_deref().unwrap_or("no usable answer");
                crate::log::warn(
                    "prepay unanswered",
                    &[("channel", &channel), ("order_no", &order_no), ("why", &why)],
                );
                Error::new(
                    ErrorKind::PlatformUnavailable,
                    format!("{channel} did not answer the creation of {order_no:?}'s payment ({}); retry shortly", printable(why)),
                )
            }
        }
    }

    /// A call's lease: the call, the query a "paid" answer makes, and the
    /// recording around them. Waiters give up sooner (the timeout plus a
    /// second), so a lease never ends while its caller may still record.
    fn lease_ms(&self) -> i64 {
        let timeout = self.core.config().platforms.timeout_ms;
        let lease = timeout.saturating_mul(2).saturating_add(LEASE_MARGIN_MS);
        i64::try_from(lease).unwrap_or(i64::MAX)
    }
}

/// One pay request, resolved: the platform, the order, the method, the
/// appid chosen and where the platform notifies.
struct Asked<'r> {
    api: &'r dyn Calls,
    order: &'r Order,
    method: &'r str,
    appid: Option<&'r str>,
    notify_url: &'r str,
}

impl Asked<'_> {
    fn prepay_request<'k>(&'k self, kept: &'k Kept, return_url: Option<&'k str>) -> PrepayRequest<'k> {
        PrepayRequest {
            order_no: &self.order.order_no,
            amount: self.order.amount,
            currency: &self.order.currency,
            description: &kept.description,
            expires_at_ms: parse_rfc3339_ms(&self.order.expires_at).unwrap_or_default(),
            notify_url: self.notify_url,
            method: self.method,
            appid: self.appid,
            openid: kept.openid.as_deref(),
            client_ip: kept.client_ip.as_deref(),
            return_url,
        }
    }

    /// The answer of a created payment, and its text as the row keeps it.
    fn paying(&self, payment: &Payment, created_at: &str) -> Result<(Paying, String), Error> {
        let text = serde_json::to_string(&OfferText {
            channel: self.api.name(),
            method: self.method,
            created_at,
            expires_at: &self.order.expires_at,
            fields: &payment.fields,
        })
        .map_err(|e| Error::internal(format!("a payment's answer: {e}")))?;
        Ok((Paying { order: self.order.clone(), payment: PaymentOffer::from_text(&text) }, text))
    }
}

/// The appid a WeChat Pay payment is created under: the one asked for,
/// when configured; the only one configured otherwise.
fn chosen_appid<'r>(api: &'r dyn Calls, request: &'r PayRequest) -> Result<Option<&'r str>, Error> {
    let channel = api.name();
    match (api.prepay_appids(), request.appid.as_deref()) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(Error::invalid(format!("appid: {channel} payments name no appid"))),
        (Some([]), _) => Err(Error::new(
            ErrorKind::ChannelNotConfigured,
            format!("{channel} payments need an app: configure --wechatpay-appid"),
        )),
        (Some(appids), Some(asked)) => match appids.iter().find(|a| *a == asked) {
            Some(appid) => Ok(Some(appid.as_str())),
            None => Err(Error::invalid(format!("appid {asked:?} is not configured (--wechatpay-appid)"))),
        },
        (Some([only]), None) => Ok(Some(only.as_str())),
        (Some(appids), None) => {
            Err(Error::invalid(format!("appid is required: several are configured ({})", appids.join(", "))))
        }
    }
}

/// The body's own fields, each refused by name.
fn check_fields(request: &PayRequest) -> Result<(), Error> {
    if let Some(description) = &request.description {
        let chars = description.chars().count();
        if chars == 0 || chars > DESCRIPTION_CHARS_MAX || description.chars().any(char::is_control) {
            return Err(Error::invalid(format!(
                "description must be 1-{DESCRIPTION_CHARS_MAX} characters, without control characters"
            )));
        }
    }
    if let Some(openid) = &request.openid {
        if openid.is_empty() || openid.len() > OPENID_BYTES_MAX || !openid.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::invalid(format!("openid must be 1-{OPENID_BYTES_MAX} printable ASCII characters")));
        }
    }
    if let Some(ip) = &request.client_ip {
        if ip.parse::<std::net::IpAddr>().is_err() {
            return Err(Error::invalid("client_ip must be an IPv4 or IPv6 address"));
        }
    }
    if let Some(url) = &request.return_url {
        let http = url.starts_with("https://") || url.starts_with("http://");
        if !http || url.len() > RETURN_URL_BYTES_MAX || !url.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::invalid(format!(
                "return_url must be an http:// or https:// URL of at most {RETURN_URL_BYTES_MAX} bytes"
            )));
        }
    }
    Ok(())
}

fn kept_text(kept: &Kept) -> Result<String, Error> {
    serde_json::to_string(kept).map_err(|e| Error::internal(format!("prepay params: {e}")))
}

/// The order as this transaction reads it, when [`refuse_unpayable`] lets
/// a payment be created for it.
fn refuse_unpayable_in(tx: &ReadTx, order_no: &str, now_ms: i64) -> Result<Order, Error> {
    let order = tx.order_by_no(order_no)?.ok_or_else(|| Error::order_not_found(order_no))?;
    let closing = !tx.platform_closes_of_order(order_no)?.is_empty();
    refuse_unpayable(&order, closing, now_ms)?;
    Ok(order)
}

/// The refusals of an order no payment may be created for now.
fn refuse_unpayable(order: &Order, closing: bool, now_ms: i64) -> Result<(), Error> {
    let order_no = &order.order_no;
    match order.status {
        OrderStatus::Pending => {}
        OrderStatus::Paid => {
            return Err(Error::invalid_transition(format!("order {order_no:?} is PAID: it has been paid already")));
        }
        status => {
            return Err(Error::invalid_transition(format!("order {order_no:?} is {}; cannot pay it", status.as_str())));
        }
    }
    let expires_ms = parse_rfc3339_ms(&order.expires_at).unwrap_or(i64::MIN);
    if now_ms >= expires_ms {
        return Err(Error::new(
            ErrorKind::OrderExpired,
            format!("order {order_no:?} expired at {}: no payment can be made", order.expires_at),
        ));
    }
    if closing {
        return Err(Error::new(
            ErrorKind::OrderExpired,
            format!("order {order_no:?} is being closed at the platforms: no payment can be made"),
        ));
    }
    Ok(())
}

fn not_configured(channel: &str) -> Error {
    Error::new(
        ErrorKind::ChannelNotConfigured,
        format!(
            "channel {channel:?} takes no payments here: payonce creates payments at wechatpay or alipay once \
             their outgoing settings are given (docs/platforms.md)"
        ),
    )
}

fn conflict(channel: &str, row: &PrepayRow, asked_method: &str) -> Error {
    let appid = row.appid.as_deref().map(|a| format!(", appid {a}")).unwrap_or_default();
    Error::new(
        ErrorKind::PaymentConflict,
        format!(
            "this order's {channel} payment exists as method {}{appid}: a platform keeps one trade per order, so \
             {asked_method} with these parameters cannot be created for it",
            row.method
        ),
    )
}

fn in_progress(channel: &str, order_no: &str) -> Error {
    Error::new(
        ErrorKind::PaymentInProgress,
        format!("the {channel} payment of {order_no:?} is being created by another request; retry shortly"),
    )
}

/// A platform's words in payonce's message: no control characters (a NUL
/// would not survive PostgreSQL's text).
fn printable(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).take(500).collect()
}
