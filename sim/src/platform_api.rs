//! The platforms' merchant APIs, the servers payonce calls
//! (docs/platforms.md): WeChat Pay v3's prepay (native, jsapi, h5, app),
//! trade query, close, refund and refund query, and Alipay's OpenAPI gateway
//! (`alipay.trade.precreate`, `.query`, `.close`, `.refund`,
//! `.fastpay.refund.query`, and the page, wap and app requests a buyer
//! opens), on loopback, for scenarios and tests to drive in process, and on
//! their own for a real payonce (`payonce-sim platforms`,
//! [`crate::standalone`]).
//!
//! Like the notifications of [`crate::platform`], this is the independent
//! oracle of payonce's platform client: written from payonce's docs (docs/platforms.md) and the
//! platforms' documentation, sharing no code with the service. It checks
//! every request's signature as the platform would (a request it would
//! refuse is refused here, loudly), signs every answer with the platform's
//! key, and keeps a record of every call so a test can count them. A trade
//! exists only once the merchant's prepay (or the buyer's opening of a
//! signed request) made it, with the `time_expire`, `notify_url` and amount
//! it was made with; a buyer can pay only a trade that exists, unexpired and
//! not closed.
//!
//! - [`PlatformApi`]: one platform's server, its state controls (a buyer
//!   opening a request, paying, a refund settling) and its faults;
//! - `http`: the HTTP/1.1 listener and the transport faults;
//! - `ledger`: the trades and refunds;
//! - `wechatpay`, `alipay`: each platform's requests and answers.

mod alipay;
mod certs;
mod http;
mod ledger;
mod wechatpay;

#[cfg(test)]
mod cert_tests;
#[cfg(test)]
mod pay_http;
#[cfg(test)]
mod payonce_sync;
#[cfg(test)]
mod prepay_tests;
#[cfg(test)]
mod suite;
#[cfg(test)]
mod tests;

use crate::platform::{
    random_digits, Platform, RefundNotice, SIM_ALIPAY_APP_ID, SIM_RSA_BITS, SIM_WECHATPAY_SERIAL, WECHATPAY_APPID,
    WECHATPAY_MCHID,
};
use ledger::Ledger;
use rsa::pkcs8::{EncodePublicKey, LineEnding};
use rsa::{RsaPrivateKey, RsaPublicKey};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A fault the platform shows, switched at run time ([`PlatformApi::set_fault`],
/// [`PlatformApi::fail_next`]). Every request still lands in [`PlatformApi::calls`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Unreachable, fast: a new connection is closed before a byte is read;
    /// a request on a connection already open is read and the connection
    /// closed, unanswered. Nothing is acted on.
    Refuse,
    /// Unreachable, slow: the request is read and never answered; the
    /// connection stays open until the client gives up. Nothing is acted on.
    Hang,
    /// HTTP 500 with the platform's system-error body (WeChat `SYSTEM_ERROR`,
    /// Alipay `20000` `isp.unknow-error`), signed. Nothing is acted on.
    ServerError,
    /// The request is acted on and answered after this delay: a client that
    /// gives up first has lost an answer to a call that took effect.
    Slow(Duration),
    /// The request waits this long before it is acted on, then is acted on
    /// and answered normally: a platform slow to process, holding one call
    /// while others arrive (or the client gives up on a call that then
    /// takes effect anyway).
    Delay(Duration),
    /// Acted on, answered, and one byte of the signed text changed after
    /// signing (a digit of an amount where there is one); a body-less WeChat
    /// 204 gets its `Wechatpay-Signature` changed instead.
    TamperAnswers,
    /// Acted on, answered correctly signed, naming another merchant: WeChat's
    /// trade answers carry another `mchid` and `appid`. WeChat's refund and
    /// prepay answers and all Alipay answers name no merchant, and are unchanged.
    WrongMerchant,
    /// Acted on, answered correctly signed, about another trade: the
    /// answer's `out_trade_no` is not the one asked about. WeChat's prepay
    /// answers name no trade, and are unchanged.
    WrongTrade,
    /// Acted on, answered correctly signed, with the trade's amount in this
    /// currency: WeChat's trade answers carry it as `amount.currency`.
    /// Alipay's answers name no currency (its amounts are yuan) and are
    /// unchanged. payonce must take such a payment as `amount_mismatch`
    /// for an order in another currency.
    Currency(String),
}

/// Why the buyer could not pay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    NoSuchTrade,
    /// Closed (by the merchant's close, or an Alipay trade fully refunded).
    Closed,
    AlreadyPaid {
        pay_no: String,
    },
    /// Unpaid and past its `time_expire` by the platform's clock.
    Expired,
}

/// A refund's state at the platform (WeChat's words; Alipay reports only
/// `REFUND_SUCCESS`, and nothing for the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundStatus {
    Processing,
    Success,
    Closed,
    Abnormal,
}

impl RefundStatus {
    pub fn wechatpay(self) -> &'static str {
        match self {
            RefundStatus::Processing => "PROCESSING",
            RefundStatus::Success => "SUCCESS",
            RefundStatus::Closed => "CLOSED",
            RefundStatus::Abnormal => "ABNORMAL",
        }
    }

    /// Counts against what is left to refund: a closed refund gave it back;
    /// an abnormal one still owes the buyer (WeChat retries it on request).
    fn holds_money(self) -> bool {
        self != RefundStatus::Closed
    }
}

/// One refund the platform holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundRecord {
    pub out_trade_no: String,
    /// The refunded trade's platform number (WeChat's transaction_id,
    /// Alipay's trade_no), whichever number the refund was asked by.
    pub pay_no: String,
    /// WeChat's out_refund_no, Alipay's out_request_no.
    pub out_refund_no: String,
    pub refund_id: String,
    /// Fen.
    pub amount: i64,
    pub status: RefundStatus,
}

/// What a trade was made with, as the platform keeps it (where its
/// notifications go, when it stops taking payments).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TradeRecord {
    pub out_trade_no: String,
    /// Fen.
    pub amount: i64,
    /// WeChat's `trade_type` (`NATIVE`, `JSAPI`, `H5`, `APP`); Alipay's
    /// method (`alipay.trade.precreate`, `alipay.trade.page.pay`, ...).
    pub trade_type: String,
    /// Its `time_expire`; `None` for a trade made out of band.
    pub expires_at_ms: Option<i64>,
    pub notify_url: Option<String>,
    /// WeChat: the appid it was made for.
    pub appid: Option<String>,
    /// WeChat's `description`, Alipay's `subject`.
    pub description: Option<String>,
    /// The platform's trade number (Alipay's from the start, WeChat's once paid).
    pub pay_no: Option<String>,
    /// What the answer that made it handed over (`code_url`, `prepay_id`,
    /// `h5_url`, `qr_code`), answered again to an identical repeat; `None`
    /// for a trade no prepay made.
    pub payment: Option<String>,
}

/// One request the platform received, and what it answered.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// `GET`, `POST`.
    pub http_method: String,
    /// WeChat: the path and query as sent; Alipay: the `method` parameter
    /// (`alipay.trade.refund`; empty when missing).
    pub api: String,
    /// WeChat: the JSON body; Alipay: `biz_content`, parsed. Null when
    /// absent or not JSON.
    pub body: Value,
    /// Alipay: every parameter, decoded, query string first; WeChat: empty.
    pub params: Vec<(String, String)>,
    /// The request's signature verified with the merchant's key (and its
    /// merchant id, serial and timestamp were acceptable).
    pub verified: bool,
    /// The HTTP status answered; `None` when unanswered (refused, hung).
    pub status: Option<u16>,
    /// The answer's code: WeChat's error `code`; Alipay's `sub_code`, else
    /// its `code` (`10000` for success). `None` for WeChat's successes.
    pub code: Option<String>,
}

/// How the simulated WeChat Pay knows its merchant and signs.
#[derive(Clone, Debug)]
pub struct WechatpayApiConfig {
    pub mchid: String,
    /// The appid its answers name for a trade made out of band.
    pub appid: String,
    /// The appids bound to the merchant: a prepay for another is refused
    /// (`APPID_MCHID_NOT_MATCH`). [`WechatpayApiConfig::new`]: `appid` alone.
    pub appids: Vec<String>,
    /// The `notify_url` every prepay must carry (payonce's callback URL);
    /// `None`: any http(s) URL.
    pub expected_notify_url: Option<String>,
    /// The serial payonce names in `serial_no` (`--wechatpay-merchant-serial`).
    pub merchant_serial: String,
    /// Verifies the requests: the public half of `--wechatpay-merchant-key`.
    pub merchant_public_key: RsaPublicKey,
    /// Signs the answers; `None`: a throwaway key made for this run.
    pub platform_key: Option<RsaPrivateKey>,
    /// The platform key's serial, sent as `Wechatpay-Serial`.
    pub platform_serial: String,
    /// The merchant's APIv3 key: `GET /v3/certificates` answers with the
    /// platform certificates encrypted with it; `None`: that API is 404.
    pub apiv3_key: Option<Vec<u8>>,
    /// Certificate mode: the platform key is a platform certificate, whose
    /// serial is `platform_serial`, listed by `GET /v3/certificates` and
    /// valid this long (ms); `None`: a WeChat Pay public key, listed nowhere.
    pub certificate_valid_ms: Option<i64>,
    /// The loopback port to listen on; 0 picks a free one.
    pub port: u16,
}

impl WechatpayApiConfig {
    /// The simulator's merchant (mchid 1900000100), platform serial
    /// `PUB_KEY_ID_SIMULATOR` and a throwaway platform key.
    pub fn new(merchant_serial: &str, merchant_public_key: RsaPublicKey) -> WechatpayApiConfig {
        WechatpayApiConfig {
            mchid: WECHATPAY_MCHID.to_owned(),
            appid: WECHATPAY_APPID.to_owned(),
            appids: vec![WECHATPAY_APPID.to_owned()],
            expected_notify_url: None,
            merchant_serial: merchant_serial.to_owned(),
            merchant_public_key,
            platform_key: None,
            platform_serial: SIM_WECHATPAY_SERIAL.to_owned(),
            apiv3_key: None,
            certificate_valid_ms: None,
            port: 0,
        }
    }
}

/// How the simulated Alipay knows its app and signs.
#[derive(Clone, Debug)]
pub struct AlipayApiConfig {
    pub app_id: String,
    /// Verifies the requests: the public half of `--alipay-app-private-key`.
    pub app_public_key: RsaPublicKey,
    /// The `notify_url` every precreate and every request the buyer opens
    /// must carry; `None`: any http(s) URL.
    pub expected_notify_url: Option<String>,
    /// Signs the answers ("the Alipay public key" is its public half);
    /// `None`: a throwaway key made for this run.
    pub alipay_key: Option<RsaPrivateKey>,
    /// The loopback port to listen on; 0 picks a free one.
    pub port: u16,
    /// Certificate mode: the SNs every request must carry (`app_cert_sn`,
    /// `alipay_root_cert_sn`) and every answer names (`alipay_cert_sn`);
    /// `None`: public-key mode.
    pub certificates: Option<crate::alipay_certs::CertSns>,
}

impl AlipayApiConfig {
    /// The simulator's app_id (2021000000000000) and a throwaway Alipay key.
    pub fn new(app_public_key: RsaPublicKey) -> AlipayApiConfig {
        AlipayApiConfig {
            app_id: SIM_ALIPAY_APP_ID.to_owned(),
            app_public_key,
            expected_notify_url: None,
            alipay_key: None,
            port: 0,
            certificates: None,
        }
    }
}

/// One platform's merchant API on `127.0.0.1:<port>`, its state and its
/// faults. Dropping it stops the server and ends its connections.
pub struct PlatformApi {
    server: http::Server,
    platform: Platform,
    merchant_id: String,
    public_key: RsaPublicKey,
    serial: Option<String>,
    ledger: Arc<Ledger>,
    /// Alipay's gateway, for the requests the buyer opens without a call.
    alipay: Option<Arc<alipay::Alipay>>,
    /// WeChat Pay: what it signs with and the certificates it lists.
    wechatpay_keys: Option<Arc<parking_lot::RwLock<wechatpay::SigningState>>>,
}

/// The path of WeChat Pay's platform certificate download.
const CERTIFICATES_PATH: &str = "/v3/certificates";

pub use certs::{new_serial, PlatformCertificate};

impl PlatformApi {
    pub fn start_wechatpay(config: WechatpayApiConfig) -> Result<PlatformApi, String> {
        let key = key_or_throwaway(config.platform_key.clone())?;
        let public_key = RsaPublicKey::from(&key);
        if config.certificate_valid_ms.is_some() && config.apiv3_key.is_none() {
            return Err("certificate mode needs the merchant's APIv3 key (apiv3_key)".into());
        }
        let ledger = Arc::new(Ledger::default());
        let certificates = match config.certificate_valid_ms {
            Some(valid_ms) => {
                let expire_ms = now_ms() + valid_ms;
                let pem = certs::certificate_pem(&key, &config.platform_serial, expire_ms)?;
                vec![PlatformCertificate { serial: config.platform_serial.clone(), pem, expire_ms }]
            }
            None => Vec::new(),
        };
        let keys = Arc::new(parking_lot::RwLock::new(wechatpay::SigningState {
            serial: config.platform_serial.clone(),
            key: rsa::pkcs1v15::SigningKey::new(key),
            certificates,
        }));
        let api = wechatpay::Wechatpay::new(&config, Arc::clone(&keys), Arc::clone(&ledger));
        let server = http::Server::start("wechatpay", config.port, Arc::new(api))?;
        Ok(PlatformApi {
            server,
            platform: Platform::Wechatpay,
            merchant_id: config.mchid,
            public_key,
            serial: Some(config.platform_serial),
            ledger,
            alipay: None,
            wechatpay_keys: Some(keys),
        })
    }

    pub fn start_alipay(config: AlipayApiConfig) -> Result<PlatformApi, String> {
        let key = key_or_throwaway(config.alipay_key.clone())?;
        let public_key = RsaPublicKey::from(&key);
        let ledger = Arc::new(Ledger::default());
        let api = Arc::new(alipay::Alipay::new(&config, key, Arc::clone(&ledger)));
        let server = http::Server::start("alipay", config.port, Arc::clone(&api))?;
        Ok(PlatformApi {
            server,
            platform: Platform::Alipay,
            merchant_id: config.app_id,
            public_key,
            serial: None,
            ledger,
            alipay: Some(api),
            wechatpay_keys: None,
        })
    }

    pub fn platform(&self) -> Platform {
        self.platform
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.server.addr())
    }

    /// What payonce is pointed at: WeChat's API base (`--wechatpay-api-base`),
    /// Alipay's gateway (`--alipay-gateway`, `.../gateway.do`).
    pub fn endpoint(&self) -> String {
        match self.platform {
            Platform::Alipay => format!("{}/gateway.do", self.base_url()),
            _ => self.base_url(),
        }
    }

    /// The merchant it serves: WeChat's mchid, Alipay's app_id.
    pub fn merchant_id(&self) -> &str {
        &self.merchant_id
    }

    /// What payonce verifies the answers with (WeChat's platform key,
    /// "the Alipay public key").
    pub fn platform_public_key(&self) -> &RsaPublicKey {
        &self.public_key
    }

    /// The same, as an SPKI PEM (`-----BEGIN PUBLIC KEY-----`).
    pub fn platform_public_key_pem(&self) -> Result<String, String> {
        self.public_key.to_public_key_pem(LineEnding::LF).map_err(|e| format!("cannot encode the public key: {e}"))
    }

    /// WeChat: the platform key's serial (`Wechatpay-Serial`) it started
    /// with. Alipay: `None`.
    pub fn platform_serial(&self) -> Option<&str> {
        self.serial.as_deref()
    }

    /// WeChat: the serial it signs under now, and the key (a rotation or a
    /// move to a public key changes them). Alipay: `None`.
    pub fn signing_now(&self) -> Option<(String, RsaPrivateKey)> {
        let keys = self.wechatpay_keys.as_ref()?.read();
        let key: &RsaPrivateKey = keys.key.as_ref();
        Some((keys.serial.clone(), key.clone()))
    }

    /// WeChat: the platform certificates `GET /v3/certificates` lists now.
    pub fn listed_certificates(&self) -> Vec<PlatformCertificate> {
        self.wechatpay_keys.as_ref().map(|k| k.read().certificates.clone()).unwrap_or_default()
    }

    /// WeChat: rotates its platform certificate as WeChat Pay does: a new
    /// key's certificate (valid `valid_ms`) is listed beside the old ones,
    /// and from now on answers are signed with it. Its serial, or why not.
    pub fn rotate_certificate(&self, valid_ms: i64) -> Result<String, String> {
        let keys = self.wechatpay_keys.as_ref().ok_or("Alipay has no platform certificates")?;
        let key = key_or_throwaway(None)?;
        let serial = certs::new_serial();
        let expire_ms = now_ms() + valid_ms;
        let pem = certs::certificate_pem(&key, &serial, expire_ms)?;
        let mut keys = keys.write();
        keys.certificates.push(PlatformCertificate { serial: serial.clone(), pem, expire_ms });
        keys.serial = serial.clone();
        keys.key = rsa::pkcs1v15::SigningKey::new(key);
        Ok(serial)
    }

    /// WeChat: moves the merchant to a WeChat Pay public key: from now on
    /// answers are signed by `key` under `public_key_id` (`PUB_KEY_ID_...`,
    /// which the merchant configures; no download lists it). The
    /// certificates stay listed.
    pub fn switch_to_public_key(&self, public_key_id: &str, key: RsaPrivateKey) -> Result<(), String> {
        let keys = self.wechatpay_keys.as_ref().ok_or("Alipay has no WeChat Pay public key")?;
        let mut keys = keys.write();
        keys.serial = public_key_id.to_owned();
        keys.key = rsa::pkcs1v15::SigningKey::new(key);
        Ok(())
    }

    /// WeChat: the certificate `serial` is listed as expired from now on
    /// (its `expire_time` now); `false` when none is listed under it.
    pub fn expire_certificate(&self, serial: &str) -> bool {
        let Some(keys) = &self.wechatpay_keys else { return false };
        let mut keys = keys.write();
        let now = now_ms();
        let mut found = false;
        for cert in keys.certificates.iter_mut().filter(|c| c.serial == serial) {
            cert.expire_ms = now;
            found = true;
        }
        found
    }

    /// WeChat: stops listing the certificate `serial` (it stays valid); `false` when it was not listed.
    pub fn unlist_certificate(&self, serial: &str) -> bool {
        let Some(keys) = &self.wechatpay_keys else { return false };
        let mut keys = keys.write();
        let before = keys.certificates.len();
        keys.certificates.retain(|c| c.serial != serial);
        keys.certificates.len() != before
    }

    /// WeChat: the certificate downloads (`GET /v3/certificates`) it answered or refused.
    pub fn certificate_downloads(&self) -> usize {
        self.server.calls().iter().filter(|c| c.api == CERTIFICATES_PATH).count()
    }

    /// A trade made out of band (tests only): unpaid, never expiring, as if
    /// the merchant had made it some other way. The platforms make trades
    /// through prepay; this stays for the tests and scenarios that predate
    /// it. `Err` for a number the platform cannot carry (WeChat: 6-32 of
    /// `[A-Za-z0-9_*|-]`, Alipay: up to 64 of `[A-Za-z0-9_]`), one open
    /// already, or a non-positive amount.
    pub fn open_trade(&self, out_trade_no: &str, amount_fen: i64) -> Result<(), String> {
        let trade = match self.platform {
            Platform::Wechatpay if !wechatpay::valid_out_trade_no(out_trade_no) => {
                return Err(format!("WeChat Pay cannot carry out_trade_no {out_trade_no:?}"));
            }
            Platform::Alipay if !alipay::valid_out_trade_no(out_trade_no) => {
                return Err(format!("Alipay cannot carry out_trade_no {out_trade_no:?}"));
            }
            // Alipay numbers the trade when it is made, WeChat when it is paid.
            Platform::Alipay => ledger::Trade {
                pay_no: Some(alipay::new_trade_no(crate::now_s())),
                ..ledger::Trade::new(out_trade_no, amount_fen, alipay::PRECREATE)
            },
            _ => ledger::Trade::new(out_trade_no, amount_fen, wechatpay::NATIVE),
        };
        self.ledger.open(trade)
    }

    /// The buyer opens a request payonce signed for them (Alipay's page, wap
    /// and app payments): `signed` is the `url` (this gateway's URL, `?`,
    /// the signed form) or the `order_string` (the form alone). It is
    /// checked as the gateway checks a call (signature, app, timestamp), its
    /// method must be page or wap pay for a URL and app pay for an order
    /// string, with the matching `product_code`, and its trade is checked
    /// like a precreate's; then the trade is made, or an identical one
    /// found. The out_trade_no, or why not (`sub_code: sub_msg`).
    ///
    /// No server call: faults do not apply, and [`PlatformApi::prepay_calls`]
    /// does not count it. It is in [`PlatformApi::calls`], as `GET` for a
    /// URL and `APP` for an order string, `api` its method, `status` 200
    /// (the cashier page, or Alipay's error page) and `code` `10000` or the
    /// refusal's sub_code.
    pub fn buyer_opens(&self, signed: &str) -> Result<String, String> {
        let Some(alipay) = &self.alipay else {
            return Err("WeChat Pay has no request for the buyer to open".into());
        };
        let (form, opened) = match signed.split_once('?') {
            Some((gateway, _)) if gateway != self.endpoint() => {
                return Err(format!("{gateway} is not this gateway ({})", self.endpoint()));
            }
            Some((_, query)) => (query, alipay::Opened::Url),
            None => (signed, alipay::Opened::OrderString),
        };
        let params = http::parse_form(form).ok_or("the signed form is not a utf-8 form")?;
        let (call, made) = alipay.buyer_opens(params, opened);
        self.server.record(call);
        made
    }

    /// The server calls that asked to make a payment (WeChat Pay's four
    /// prepay paths, Alipay's `alipay.trade.precreate`), whatever they were
    /// answered, unanswered ones included: "one call reached the platform"
    /// counts every one of them. Requests the buyer opens are not calls.
    pub fn prepay_calls(&self) -> usize {
        self.prepays().len()
    }

    /// Those calls themselves, in the order answered.
    pub fn prepays(&self) -> Vec<Call> {
        let is_prepay = |call: &Call| match self.platform {
            Platform::Alipay => call.api == alipay::PRECREATE,
            _ => wechatpay::is_prepay(&call.api),
        };
        self.server.calls().into_iter().filter(|call| is_prepay(call)).collect()
    }

    /// The trades that exist, whatever their state.
    pub fn trades(&self) -> usize {
        self.ledger.trades()
    }

    /// The buyer has the cashier open (WeChat `USERPAYING`; Alipay still
    /// `WAIT_BUYER_PAY`).
    pub fn buyer_paying(&self, out_trade_no: &str) -> Result<(), Refused> {
        self.ledger.buyer_paying(out_trade_no, now_ms())
    }

    /// The buyer pays: the platform's payment number (WeChat transaction_id,
    /// Alipay trade_no), or why the platform refused the payment.
    pub fn buyer_pays(&self, out_trade_no: &str) -> Result<String, Refused> {
        self.ledger.buyer_pays(out_trade_no, now_ms(), wechatpay::new_transaction_id)
    }

    /// Alipay: a paid trade past its refund period (`TRADE_FINISHED`,
    /// refunds refused). WeChat Pay has no such state.
    pub fn finish_trade(&self, out_trade_no: &str) -> Result<(), String> {
        match self.platform {
            Platform::Alipay => self.ledger.finish(out_trade_no),
            _ => Err("WeChat Pay has no finished trade state".into()),
        }
    }

    /// What the trade was made with; `None`: no such trade.
    pub fn trade(&self, out_trade_no: &str) -> Option<TradeRecord> {
        let trade = self.ledger.trade(out_trade_no)?;
        Some(TradeRecord {
            out_trade_no: trade.out_trade_no,
            amount: trade.amount,
            trade_type: trade.trade_type,
            expires_at_ms: trade.expires_at_ms,
            notify_url: trade.notify_url,
            appid: trade.appid,
            description: trade.description,
            pay_no: trade.pay_no,
            payment: trade.payment,
        })
    }

    /// The trade's state in the platform's words (`NOTPAY`, `TRADE_CLOSED`, ...).
    pub fn trade_state(&self, out_trade_no: &str) -> Option<&'static str> {
        let trade = self.ledger.trade(out_trade_no)?;
        Some(match self.platform {
            Platform::Alipay => alipay::trade_status(&trade, &self.ledger),
            _ => wechatpay::trade_state(&trade, &self.ledger),
        })
    }

    /// A refund reaches its result; `false` when the platform has no refund
    /// of that number. Alipay shows only `Success` (`REFUND_SUCCESS`); any
    /// other status leaves its refund query without `refund_status`.
    pub fn settle_refund(&self, out_refund_no: &str, status: RefundStatus) -> bool {
        self.ledger.settle(out_refund_no, status, crate::now_s())
    }

    /// Every refund the platform holds, in the order requested: one per
    /// out_refund_no, however often it was submitted.
    pub fn refunds(&self) -> Vec<RefundRecord> {
        self.ledger.refunds()
    }

    /// The fen refunded on the trade: its refunds settled SUCCESS.
    pub fn refunded_total(&self, out_trade_no: &str) -> i64 {
        self.ledger.refunded(out_trade_no).0
    }

    /// The notice the platform sends once the refund of that number has
    /// settled SUCCESS, CLOSED or ABNORMAL, with the amounts it has: the
    /// refund's, the trade's, and the trade's refunded total when it
    /// settled (this refund included when it succeeded). `None`: no such
    /// refund, or one not settled.
    pub fn refund_notice(&self, out_refund_no: &str) -> Option<RefundNotice> {
        let (refund, trade) = self.ledger.refund_of(out_refund_no)?;
        refund.settled_at?;
        let refunded_total = match refund.refunded_after {
            Some(after) => after,
            None => self.ledger.refunded(&trade.out_trade_no).0,
        };
        Some(RefundNotice {
            refund_no: refund.out_refund_no,
            order_no: trade.out_trade_no,
            pay_no: trade.pay_no.unwrap_or_default(),
            amount: refund.amount,
            total: trade.amount,
            refunded_total,
            success: refund.status == RefundStatus::Success,
        })
    }

    /// The fault every request (and connection) gets from now on; `None`: healthy.
    pub fn set_fault(&self, fault: Option<Fault>) {
        self.server.set_fault(fault, None);
    }

    /// The fault for the next `count` requests only, then healthy again
    /// (with [`Fault::Refuse`], a refused new connection counts as one).
    pub fn fail_next(&self, fault: Fault, count: usize) {
        self.server.set_fault(Some(fault), Some(count));
    }

    /// Every request so far, in the order answered (unanswered ones when read).
    pub fn calls(&self) -> Vec<Call> {
        self.server.calls()
    }

    /// `observer` sees each call as it joins [`PlatformApi::calls`].
    pub fn on_call(&self, observer: impl Fn(&Call) + Send + Sync + 'static) {
        self.server.on_call(Arc::new(observer));
    }
}

/// `yyyy-MM-dd{separator}HH:mm:ss` in Beijing time, as Unix seconds.
fn beijing_unix(text: &str, separator: u8) -> Option<i64> {
    let b = text.as_bytes();
    let shape = b.len() == 19 && b[4] == b'-' && b[7] == b'-' && b[10] == separator && b[13] == b':' && b[16] == b':';
    if !shape {
        return None;
    }
    let number = |from: usize, to: usize| -> Option<u16> {
        let part = text.get(from..to)?;
        part.bytes().all(|c| c.is_ascii_digit()).then(|| part.parse().ok())?
    };
    let month = time::Month::try_from(u8::try_from(number(5, 7)?).ok()?).ok()?;
    let byte = |from: usize| number(from, from + 2).and_then(|n| u8::try_from(n).ok());
    let date = time::Date::from_calendar_date(i32::from(number(0, 4)?), month, byte(8)?).ok()?;
    let clock = time::Time::from_hms(byte(11)?, byte(14)?, byte(17)?).ok()?;
    let beijing = time::UtcOffset::from_hms(8, 0, 0).ok()?;
    Some(time::PrimitiveDateTime::new(date, clock).assume_offset(beijing).unix_timestamp())
}

/// Why a `notify_url` would be refused: absent, not an http(s) URL with a
/// host, or not the one the platform was told to expect.
fn notify_url_refusal(url: Option<&str>, expected: Option<&str>) -> Option<String> {
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        return Some("notify_url is missing".into());
    };
    let rest = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://"));
    let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or(""));
    if host.is_none_or(str::is_empty) || url.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
        return Some(format!("notify_url {url:?} is not an http(s) URL"));
    }
    match expected {
        Some(expected) if url != expected => Some(format!("notify_url {url:?} is not the merchant's {expected:?}")),
        _ => None,
    }
}

/// `len` random characters of `[a-z0-9]` for the identifiers the platforms
/// hand the buyer (QR code texts); digits should the OS have no randomness.
fn random_token(len: usize) -> String {
    match crate::platform::random_text(len) {
        Ok(text) => text.to_ascii_lowercase(),
        Err(_) => unique_digits(len),
    }
}

/// The platforms' clock, in Unix milliseconds: the system's (their answers
/// carry the real time, so payonce's clock must be near it anyway).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The given platform key, or one made now the way the rest of the
/// simulator makes its throwaway keys.
fn key_or_throwaway(key: Option<RsaPrivateKey>) -> Result<RsaPrivateKey, String> {
    match key {
        Some(key) => Ok(key),
        None => RsaPrivateKey::new(&mut rsa::rand_core::OsRng, SIM_RSA_BITS)
            .map_err(|e| format!("cannot generate an RSA key: {e}")),
    }
}

/// The answer as a tampering network would deliver it: one byte of `text`
/// changed, and still well-formed, so only the signature can tell. The last
/// digit changes where there is one (in these answers, an amount or a
/// timestamp), else the last letter's case, else the last byte's low bit.
fn tamper(text: &mut [u8]) {
    if let Some(digit) = text.iter_mut().rev().find(|b| b.is_ascii_digit()) {
        *digit = if *digit == b'9' { b'0' } else { *digit + 1 };
    } else if let Some(letter) = text.iter_mut().rev().find(|b| b.is_ascii_alphabetic()) {
        *letter ^= 0x20;
    } else if let Some(last) = text.last_mut() {
        *last ^= 1;
    }
}

/// Another merchant's trade number, as close to `out_trade_no` as possible
/// (its last character changed), so only an exact comparison tells.
fn other_trade_no(out_trade_no: &str) -> String {
    let mut other: Vec<char> = out_trade_no.chars().collect();
    match other.last_mut() {
        Some(last) => *last = if *last == '0' { '1' } else { '0' },
        None => other.push('0'),
    }
    other.into_iter().collect()
}

/// Fen from a yuan string of at most two decimals (`10.00`, `0.5`, `7`).
fn yuan_to_fen(text: &str) -> Option<i64> {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 2 || whole.len() > 12 {
        return None;
    }
    if text.ends_with('.') {
        return None;
    }
    let cents = format!("{fraction:0<2}");
    Some(whole.parse::<i64>().ok()? * 100 + cents.parse::<i64>().ok()?)
}

/// `n` random digits for the platforms' numbers (transaction_id, trade_no,
/// refund_id): unique across runs, which a payonce on a file database needs.
/// Should the OS have no randomness, the clock and a counter stand in.
fn unique_digits(n: usize) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    if let Ok(digits) = random_digits(n) {
        return digits;
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let text = format!("{nanos}{:06}", COUNTER.fetch_add(1, Ordering::Relaxed) % 1_000_000);
    let padded = format!("{text:0>n$}");
    padded[padded.len() - n..].to_owned()
}
