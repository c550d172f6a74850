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
}

/// Why a close did not (newly) close a trade.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum CloseRefused {
    NoSuchTrade,
    AlreadyClosed,
    /// Paid or finished.
    Paid,
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
    pub fn open(&self, out_trade_no: &str, amount: i64, pay_no: Option<String>) -> Result<(), String> {
        if amount <= 0 {
            return Err(format!("a trade of {amount} fen"));
        }
        let mut book = self.book.lock();
        if book.trades.contains_key(out_trade_no) {
            return Err(format!("trade {out_trade_no} is open already"));
        }
        let trade =
            Trade { out_trade_no: out_trade_no.to_owned(), amount, state: TradeState::NotPaid, pay_no, paid_at: None };
        book.trades.insert(out_trade_no.to_owned(), trade);
        Ok(())
    }

    pub fn trade(&self, out_trade_no: &str) -> Option<Trade> {
        self.book.lock().trades.get(out_trade_no).cloned()
    }

    pub fn buyer_paying(&self, out_trade_no: &str) -> Result<(), Refused> {
        let mut book = self.book.lock();
        let trade = book.trades.get_mut(out_trade_no).ok_or(Refused::NoSuchTrade)?;
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
        now_s: i64,
        new_pay_no: impl FnOnce() -> String,
    ) -> Result<String, Refused> {
        let mut book = self.book.lock();
        let trade = book.trades.get_mut(out_trade_no).ok_or(Refused::NoSuchTrade)?;
        match trade.state {
            TradeState::NotPaid | TradeState::Paying => {
                let pay_no = trade.pay_no.get_or_insert_with(new_pay_no).clone();
                trade.state = TradeState::Paid;
                trade.paid_at = Some(now_s);
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
        let Some(refund) = book.refunds.iter_mut().find(|r| r.out_refund_no == out_refund_no) else {
            return false;
        };
        refund.status = status;
        refund.settled_at = (status != RefundStatus::Processing).then_some(now_s);
        true
    }

    pub fn refunds(&self) -> Vec<RefundRecord> {
        let book = self.book.lock();
        book.refunds
            .iter()
            .map(|r| RefundRecord {
                out_trade_no: r.out_trade_no.clone(),
                out_refund_no: r.out_refund_no.clone(),
                refund_id: r.refund_id.clone(),
                amount: r.amount,
                status: r.status,
            })
            .collect()
    }
}
