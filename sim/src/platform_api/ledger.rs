//! What a platform knows: its merchant's trades and refunds, changed by the
//! merchant's calls and by the scenario's controls (a buyer paying, a refund
//! settling). One lock over the whole book, so a check and the change it
//! guards (a refund's idempotency, a close racing a payment) are one step.

use super::{RefundRecord, RefundStatus, Refused};
use parking_lot::Mutex;
use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TradeState {
    NotPaid,
    /// The buyer has the cashier open (WeChat USERPAYING).
    Paying,
    Paid,
    /// Alipay's TRADE_FINISHED: paid, and past its refund period.
    Finished,
    Closed,
}

#[derive(Clone, Debug)]
pub(super) struct Trade {
    pub out_trade_no: String,
    /// Fen.
    pub amount: i64,
    pub state: TradeState,
    /// The platform's trade number: Alipay's trade_no exists from the
    /// start, WeChat's transaction_id from the payment.
    pub pay_no: Option<String>,
    pub paid_at: Option<i64>,
    /// How it was made: WeChat's `trade_type` (`NATIVE`, `JSAPI`, `H5`,
    /// `APP`); Alipay's method (`alipay.trade.precreate`, `.page.pay`, ...).
    pub trade_type: String,
    /// Its `time_expire`: past it the buyer can no longer pay. `None`: a
    /// trade made out of band, which never expires.
    pub expires_at_ms: Option<i64>,
    pub notify_url: Option<String>,
    /// WeChat: the appid it was made for.
    pub appid: Option<String>,
    pub description: Option<String>,
    /// What the answer that made it handed over (`code_url`, `prepay_id`,
    /// `h5_url`, `qr_code`), so an identical repeat is answered the same.
    pub payment: Option<String>,
}

impl Trade {
    /// An unpaid trade of this number, amount and way of making, nothing else known.
    pub fn new(out_trade_no: &str, amount: i64, trade_type: &str) -> Trade {
        Trade {
            out_trade_no: out_trade_no.to_owned(),
            amount,
            state: TradeState::NotPaid,
            pay_no: None,
            paid_at: None,
            trade_type: trade_type.to_owned(),
            expires_at_ms: None,
            notify_url: None,
            appid: None,
            description: None,
            payment: None,
        }
    }

    /// Unpaid and past its `time_expire` at `now_ms`.
    fn expired(&self, now_ms: i64) -> bool {
        matches!(self.state, TradeState::NotPaid | TradeState::Paying)
            && self.expires_at_ms.is_some_and(|at| now_ms >= at)
    }
}

#[derive(Clone, Debug)]
pub(super) struct Refund {
    pub out_trade_no: String,
    pub out_refund_no: String,
    pub refund_id: String,
    /// Fen.
    pub amount: i64,
    pub status: RefundStatus,
    pub created_at: i64,
    pub settled_at: Option<i64>,
    /// Once settled SUCCESS: the trade's refunded fen at that moment, this
    /// refund included (what Alipay's notice of it says in `refund_fee`).
    pub refunded_after: Option<i64>,
}

/// Why a close did not (newly) close a trade.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum CloseRefused {
    NoSuchTrade,
    AlreadyClosed,
    /// Paid or finished.
    Paid,
}

/// Why a request to make a trade (a prepay, or a request the buyer opens)
/// did not make it or find its identical twin.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PrepayRefused {
    /// Paid or finished.
    Paid,
    /// Closed, or unpaid past its `time_expire`: the buyer cannot pay it.
    Closed,
    /// The out_trade_no is taken by a trade made otherwise (why, in the platform's words).
    Inconsistent(String),
}

/// Why a refund request was refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum RefundRefused {
    NoSuchTrade,
    NotPaid,
    Finished,
    /// More than what is left to refund.
    Exceeds,
    /// The refund number is taken by another trade or another amount.
    Discordant,
}

#[derive(Default)]
struct Book {
    trades: HashMap<String, Trade>,
    /// In the order they were requested.
    refunds: Vec<Refund>,
}

#[derive(Default)]
pub(super) struct Ledger {
    book: Mutex<Book>,
}

impl Ledger {
    /// A trade made out of band (tests only): see `PlatformApi::open_trade`.
    pub fn open(&self, trade: Trade) -> Result<(), String> {
        if trade.amount <= 0 {
            return Err(format!("a trade of {} fen", trade.amount));
        }
        let mut book = self.book.lock();
        if book.trades.contains_key(&trade.out_trade_no) {
            return Err(format!("trade {} is open already", trade.out_trade_no));
        }
        book.trades.insert(trade.out_trade_no.clone(), trade);
        Ok(())
    }

    /// Makes `wanted` unless a trade of its number exists; an existing one
    /// is answered again when `consistent` finds it made by the same request
    /// (`Err`: why not), as the platforms do for a merchant's retry. One
    /// lock over look-up and insert, so concurrent identical requests make
    /// one trade. The trade made or found.
    pub fn prepay(
        &self,
        wanted: Trade,
        now_ms: i64,
        consistent: impl FnOnce(&Trade) -> Result<(), String>,
    ) -> Result<Trade, PrepayRefused> {
        let mut book = self.book.lock();
        let Some(existing) = book.trades.get_mut(&wanted.out_trade_no) else {
            book.trades.insert(wanted.out_trade_no.clone(), wanted.clone());
            return Ok(wanted);
        };
        match existing.state {
            TradeState::Paid | TradeState::Finished => return Err(PrepayRefused::Paid),
            TradeState::Closed => return Err(PrepayRefused::Closed),
            TradeState::NotPaid | TradeState::Paying if existing.expired(now_ms) => return Err(PrepayRefused::Closed),
            TradeState::NotPaid | TradeState::Paying => {}
        }
        consistent(existing).map_err(PrepayRefused::Inconsistent)?;
        // A trade made without handing anything over (out of band, or a
        // request the buyer opened) gets the identifier of its first prepay.
        if existing.payment.is_none() {
            existing.payment = wanted.payment;
        }
        Ok(existing.clone())
    }

    /// How many trades exist, whatever their state.
    pub fn trades(&self) -> usize {
        self.book.lock().trades.len()
    }

    pub fn trade(&self, out_trade_no: &str) -> Option<Trade> {
        self.book.lock().trades.get(out_trade_no).cloned()
    }

    /// The trade the platform numbered `pay_no` (WeChat's transaction_id,
    /// Alipay's trade_no): the platforms find a trade by either number.
    pub fn trade_by_pay_no(&self, pay_no: &str) -> Option<Trade> {
        self.book.lock().trades.values().find(|t| t.pay_no.as_deref() == Some(pay_no)).cloned()
    }

    pub fn buyer_paying(&self, out_trade_no: &str, now_ms: i64) -> Result<(), Refused> {
        let mut book = self.book.lock();
        let trade = book.trades.get_mut(out_trade_no).ok_or(Refused::NoSuchTrade)?;
        if trade.expired(now_ms) {
            return Err(Refused::Expired);
        }
        match trade.state {
            TradeState::NotPaid | TradeState::Paying => {
                trade.state = TradeState::Paying;
                Ok(())
            }
            TradeState::Closed => Err(Refused::Closed),
            TradeState::Paid | TradeState::Finished => {
                Err(Refused::AlreadyPaid { pay_no: trade.pay_no.clone().unwrap_or_default() })
            }
        }
    }

    /// `new_pay_no` is asked for the platform's trade number when the trade has none yet.
    pub fn buyer_pays(
        &self,
        out_trade_no: &str,
        now_ms: i64,
        new_pay_no: impl FnOnce() -> String,
    ) -> Result<String, Refused> {
        let mut book = self.book.lock();
        let trade = book.trades.get_mut(out_trade_no).ok_or(Refused::NoSuchTrade)?;
        if trade.expired(now_ms) {
            return Err(Refused::Expired);
        }
        match trade.state {
            TradeState::NotPaid | TradeState::Paying => {
                let pay_no = trade.pay_no.get_or_insert_with(new_pay_no).clone();
                trade.state = TradeState::Paid;
                trade.paid_at = Some(now_ms.div_euclid(1000));
                Ok(pay_no)
            }
            TradeState::Closed => Err(Refused::Closed),
            TradeState::Paid | TradeState::Finished => {
                Err(Refused::AlreadyPaid { pay_no: trade.pay_no.clone().unwrap_or_default() })
            }
        }
    }

    pub fn finish(&self, out_trade_no: &str) -> Result<(), String> {
        let mut book = self.book.lock();
        let trade = book.trades.get_mut(out_trade_no).ok_or_else(|| format!("no trade {out_trade_no}"))?;
        match trade.state {
            TradeState::Paid | TradeState::Finished => {
                trade.state = TradeState::Finished;
                Ok(())
            }
            state => Err(format!("trade {out_trade_no} is {state:?}, not paid")),
        }
    }

    pub fn close(&self, out_trade_no: &str) -> Result<Trade, CloseRefused> {
        let mut book = self.book.lock();
        let trade = book.trades.get_mut(out_trade_no).ok_or(CloseRefused::NoSuchTrade)?;
        match trade.state {
            TradeState::NotPaid | TradeState::Paying => {
                trade.state = TradeState::Closed;
                Ok(trade.clone())
            }
            TradeState::Closed => Err(CloseRefused::AlreadyClosed),
            TradeState::Paid | TradeState::Finished => Err(CloseRefused::Paid),
        }
    }

    /// A refund request. The same `out_refund_no` again, for the same trade
    /// and amount, is the same refund (`false`: not new); the refund number
    /// is what makes the merchant's retry safe.
    pub fn refund(
        &self,
        out_trade_no: &str,
        out_refund_no: &str,
        amount: i64,
        now_s: i64,
        new_refund_id: impl FnOnce() -> String,
    ) -> Result<(Refund, Trade, bool), RefundRefused> {
        let mut book = self.book.lock();
        let trade = book.trades.get(out_trade_no).cloned().ok_or(RefundRefused::NoSuchTrade)?;
        if let Some(existing) = book.refunds.iter().find(|r| r.out_refund_no == out_refund_no) {
            if existing.out_trade_no != out_trade_no || existing.amount != amount {
                return Err(RefundRefused::Discordant);
            }
            return Ok((existing.clone(), trade, false));
        }
        match trade.state {
            TradeState::Paid => {}
            TradeState::Finished => return Err(RefundRefused::Finished),
            TradeState::NotPaid | TradeState::Paying | TradeState::Closed => return Err(RefundRefused::NotPaid),
        }
        let committed: i64 = book
            .refunds
            .iter()
            .filter(|r| r.out_trade_no == out_trade_no && r.status.holds_money())
            .map(|r| r.amount)
            .sum();
        if amount <= 0 || committed + amount > trade.amount {
            return Err(RefundRefused::Exceeds);
        }
        let refund = Refund {
            out_trade_no: out_trade_no.to_owned(),
            out_refund_no: out_refund_no.to_owned(),
            refund_id: new_refund_id(),
            amount,
            status: RefundStatus::Processing,
            created_at: now_s,
            settled_at: None,
            refunded_after: None,
        };
        book.refunds.push(refund.clone());
        Ok((refund, trade, true))
    }

    /// The refund of that number (WeChat's out_refund_no is unique per
    /// merchant; Alipay's out_request_no per trade, and payonce's refund_nos
    /// are unique anyway), and its trade.
    pub fn refund_of(&self, out_refund_no: &str) -> Option<(Refund, Trade)> {
        let book = self.book.lock();
        let refund = book.refunds.iter().find(|r| r.out_refund_no == out_refund_no)?.clone();
        let trade = book.trades.get(&refund.out_trade_no)?.clone();
        Some((refund, trade))
    }

    /// Fen refunded (settled SUCCESS) and fen committed (not failed) on a trade.
    pub fn refunded(&self, out_trade_no: &str) -> (i64, i64) {
        let book = self.book.lock();
        let of_trade = || book.refunds.iter().filter(|r| r.out_trade_no == out_trade_no);
        let settled = of_trade().filter(|r| r.status == RefundStatus::Success).map(|r| r.amount).sum();
        let committed = of_trade().filter(|r| r.status.holds_money()).map(|r| r.amount).sum();
        (settled, committed)
    }

    /// A refund was ever requested on the trade (whatever became of it).
    pub fn has_refunds(&self, out_trade_no: &str) -> bool {
        self.book.lock().refunds.iter().any(|r| r.out_trade_no == out_trade_no)
    }

    pub fn settle(&self, out_refund_no: &str, status: RefundStatus, now_s: i64) -> bool {
        let mut book = self.book.lock();
        let Some(i) = book.refunds.iter().position(|r| r.out_refund_no == out_refund_no) else {
            return false;
        };
        let trade_no = book.refunds[i].out_trade_no.clone();
        let others: i64 = book
            .refunds
            .iter()
            .enumerate()
            .filter(|(j, r)| *j != i && r.out_trade_no == trade_no && r.status == RefundStatus::Success)
            .map(|(_, r)| r.amount)
            .sum();
        let refund = &mut book.refunds[i];
        refund.status = status;
        refund.settled_at = (status != RefundStatus::Processing).then_some(now_s);
        refund.refunded_after = (status == RefundStatus::Success).then_some(others + refund.amount);
        true
    }

    pub fn refunds(&self) -> Vec<RefundRecord> {
        let book = self.book.lock();
        book.refunds
            .iter()
            .map(|r| RefundRecord {
                out_trade_no: r.out_trade_no.clone(),
                pay_no: book.trades.get(&r.out_trade_no).and_then(|t| t.pay_no.clone()).unwrap_or_default(),
                out_refund_no: r.out_refund_no.clone(),
                refund_id: r.refund_id.clone(),
                amount: r.amount,
                status: r.status,
            })
            .collect()
    }
}
