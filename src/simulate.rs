//! `payonce simulate`: a payment-platform simulator (being written).
