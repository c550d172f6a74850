//! The storage seam: the only module that speaks SQL, and the only one that
//! knows which engine holds the ledger.
//!
//! A [`Store`] is one of two engines:
//! - [`sqlite`]: an `r2d2` pool of SQLite connections, a process-wide writer
//!   queue, and `BEGIN IMMEDIATE` for every write;
//! - [`postgres`]: an `r2d2` pool of PostgreSQL connections; every write is a
//!   READ COMMITTED transaction that first takes `pg_advisory_xact_lock` on
//!   each key the caller holds in its [`crate::keylock::KeyedLocks`] and
//!   passes to [`Store::write`].
//!
//! Above this module nothing names an engine. Callers get a [`ReadTx`] in
//! [`Store::read`] and a [`WriteTx`] in [`Store::write`]; the query methods
//! that change rows exist on `WriteTx` only, so a read cannot write. A
//! `WriteTx` derefs to a `ReadTx` for the reads a write makes.
//!
//! The queries are written once, grouped by concern (`orders`, `payments`,
//! `effects`, `idempotency`, `reports`), in the SQL both engines accept
//! (`?N` placeholders, `ON CONFLICT .. DO NOTHING`, `RETURNING`,
//! `IS DISTINCT FROM`), and run only through the engine's statement cache.
//! No query uses JSON functions: JSON is built and read in Rust.
//!
//! A write's body is `Fn`, not `FnMut`: PostgreSQL re-runs the whole
//! transaction after a serialization failure or a deadlock (at most
//! [`WRITE_ATTEMPTS_MAX`] times, then 503 `database_busy`), so a body must
//! have no effect outside its transaction. `Fn` makes the compiler keep that
//! rule: a body cannot push to, count in or otherwise change anything it
//! captured, so a rolled-back attempt leaves nothing behind. What a body
//! learns, it returns.

mod copy;
pub use copy::{copy_sqlite_to_postgres, CopyReport, TableCopied, COPIED_TABLES};
mod effects;
use sqlite::group_commit;
mod idempotency;
mod leases;
pub use leases::LeasedTable;
mod orders;
pub use orders::NewRefund;
mod payments;
mod platform_calls;
pub use platform_calls::{
    NewPlatformCall, NewPrepay, PlatformCallRow, PrepayFinish, PrepayParams, PrepayRow, PLATFORM_CALLS,
};
mod postgres;
mod reports;
mod sqlite;
mod webhooks;
pub use reports::STATS_STATEMENTS;
pub use webhooks::{REPLAY_EVENTS_MAX, WEBHOOK_DELIVERIES};

use crate::error::{Error, ErrorKind};
use crate::keylock::KeyGuard;
pub use crate::store::sqlite::{prepare_sqlite_library, Synchronous, WalRescue};

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The whole current SQLite schema, applied to a new database.
pub const SCHEMA_SQL: &str = include_str!("../../schema.sql");
/// The whole current PostgreSQL schema (the same tables, columns, keys,
/// CHECKs and triggers), applied to a new database.
pub const SCHEMA_POSTGRES_SQL: &str = include_str!("../../schema.postgres.sql");
/// The schema version once `SCHEMA_SQL` is applied (or the last migration):
/// `PRAGMA user_version` on SQLite, `payonce_schema_version` on PostgreSQL.
pub const SCHEMA_VERSION: i64 = 14;

/// One numbered schema change: run on a database at `version - 1`, it leaves
/// the database at `version`.
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every SQLite schema change since version 1 (the first released schema),
/// in order. The last one's version is [`SCHEMA_VERSION`], and a database
/// migrated through all of them has exactly the schema of `SCHEMA_SQL`
/// (tests/it/schema.rs builds a v1 database and checks it). PostgreSQL
/// starts at version 3 and has [`POSTGRES_MIGRATIONS`] of its own.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 2,
        name: "refund_platform_settled_at",
        sql: include_str!("../../migrations/0002_refund_platform_settled_at.sql"),
    },
    Migration {
        version: 3,
        name: "audit_log_refund_no",
        sql: include_str!("../../migrations/0003_audit_log_refund_no.sql"),
    },
    Migration {
        version: 4,
        name: "pay_callback_log_decided_index",
        sql: include_str!("../../migrations/0004_pay_callback_log_decided_index.sql"),
    },
    Migration { version: 5, name: "webhooks", sql: include_str!("../../migrations/0005_webhooks.sql") },
    Migration {
        version: 6,
        name: "outbox_event_order_index",
        sql: include_str!("../../migrations/0006_outbox_event_order_index.sql"),
    },
    Migration { version: 7, name: "platform_calls", sql: include_str!("../../migrations/0007_platform_calls.sql") },
    Migration {
        version: 8,
        name: "check_value_lists",
        sql: include_str!("../../migrations/0008_check_value_lists.sql"),
    },
    Migration {
        version: 9,
        name: "pay_callback_log_currency",
        sql: include_str!("../../migrations/0009_pay_callback_log_currency.sql"),
    },
    Migration {
        version: 10,
        name: "platform_call_prepay",
        sql: include_str!("../../migrations/0010_platform_call_prepay.sql"),
    },
    Migration { version: 11, name: "refund_amounts", sql: include_str!("../../migrations/0011_refund_amounts.sql") },
    Migration { version: 12, name: "payment_refunds", sql: include_str!("../../migrations/0012_payment_refunds.sql") },
    Migration {
        version: 13,
        name: "cheaper_payment_writes",
        sql: include_str!("../../migrations/0013_cheaper_payment_writes.sql"),
    },
    Migration { version: 14, name: "stats_indexes", sql: include_str!("../../migrations/0014_stats_indexes.sql") },
];

/// The oldest schema version a PostgreSQL database can have: PostgreSQL
/// support began there.
pub const POSTGRES_SCHEMA_VERSION_FIRST: i64 = 3;

/// Every PostgreSQL schema change since [`POSTGRES_SCHEMA_VERSION_FIRST`], in
/// order, numbered as SQLite's: a database migrated through them has exactly
/// the schema of `SCHEMA_POSTGRES_SQL` (tests/it/schema.rs checks it).
pub const POSTGRES_MIGRATIONS: &[Migration] = &[
    Migration {
        version: 4,
        name: "pay_callback_log_decided_index",
        sql: include_str!("../../migrations/postgres/0004_pay_callback_log_decided_index.sql"),
    },
    Migration { version: 5, name: "webhooks", sql: include_str!("../../migrations/postgres/0005_webhooks.sql") },
    Migration {
        version: 6,
        name: "outbox_event_order_index",
        sql: include_str!("../../migrations/postgres/0006_outbox_event_order_index.sql"),
    },
    Migration {
        version: 7,
        name: "platform_calls",
        sql: include_str!("../../migrations/postgres/0007_platform_calls.sql"),
    },
    Migration {
        version: 8,
        name: "check_value_lists",
        sql: include_str!("../../migrations/postgres/0008_check_value_lists.sql"),
    },
    Migration {
        version: 9,
        name: "pay_callback_log_currency",
        sql: include_str!("../../migrations/postgres/0009_pay_callback_log_currency.sql"),
    },
    Migration {
        version: 10,
        name: "platform_call_prepay",
        sql: include_str!("../../migrations/postgres/0010_platform_call_prepay.sql"),
    },
    Migration {
        version: 11,
        name: "refund_amounts",
        sql: include_str!("../../migrations/postgres/0011_refund_amounts.sql"),
    },
    Migration {
        version: 12,
        name: "payment_refunds",
        sql: include_str!("../../migrations/postgres/0012_payment_refunds.sql"),
    },
    Migration {
        version: 13,
        name: "cheaper_payment_writes",
        sql: include_str!("../../migrations/postgres/0013_cheaper_payment_writes.sql"),
    },
    Migration {
        version: 14,
        name: "stats_indexes",
        sql: include_str!("../../migrations/postgres/0014_stats_indexes.sql"),
    },
];

/// How long a connection waits for another process's writer (SQLite's busy
/// handler, PostgreSQL's `lock_timeout`) before the request fails with 503
/// `database_busy`.
pub const BUSY_TIMEOUT_MS: u64 = 5_000;
/// How long a request waits for a pooled connection.
pub const POOL_WAIT_MS: u64 = 10_000;
/// PostgreSQL: how long one attempt to connect to one host may take
/// (`--db-connect-timeout-ms`).
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;
/// PostgreSQL: the server's `statement_timeout` on payonce's connections,
/// which also bounds how long a call waits on a host that stopped answering
/// (TCP keepalives, `TCP_USER_TIMEOUT`; `--db-statement-timeout-ms`).
pub const STATEMENT_TIMEOUT_MS: u64 = 10_000;
/// One connection per HTTP worker (16) plus the background workers and a
/// metrics scrape, so a background task never waits behind a full pool.
pub const POOL_SIZE_DEFAULT: u32 = 20;
/// How many times a PostgreSQL write transaction runs before a serialization
/// failure or deadlock is answered 503 `database_busy`.
pub const WRITE_ATTEMPTS_MAX: u32 = 5;

#[derive(Clone, Debug)]
pub struct StoreOptions {
    pub pool_size: u32,
    pub busy_timeout_ms: u64,
    /// PostgreSQL only: [`CONNECT_TIMEOUT_MS`].
    pub connect_timeout_ms: u64,
    /// PostgreSQL only: [`STATEMENT_TIMEOUT_MS`].
    pub statement_timeout_ms: u64,
    /// SQLite only; PostgreSQL's durability is the server's configuration.
    pub synchronous: Synchronous,
    /// SQLite only: queue this process's writers on one mutex so SQLite's
    /// busy handler (which sleeps in steps of up to 100 ms) only arbitrates
    /// between processes. Off only to measure what it buys.
    pub writer_queue: bool,
    /// SQLite only: operations per group-commit transaction (1: no batching).
    pub group_commit_max: usize,
    /// SQLite only: how long a committer holding operations waits for more
    /// (0: commit whatever is queued, never wait).
    pub group_commit_wait_us: u64,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            pool_size: POOL_SIZE_DEFAULT,
            busy_timeout_ms: BUSY_TIMEOUT_MS,
            connect_timeout_ms: CONNECT_TIMEOUT_MS,
            statement_timeout_ms: STATEMENT_TIMEOUT_MS,
            synchronous: Synchronous::Full,
            writer_queue: true,
            group_commit_max: group_commit::GROUP_COMMIT_MAX_DEFAULT,
            group_commit_wait_us: group_commit::GROUP_COMMIT_WAIT_US_DEFAULT,
        }
    }
}

/// Which engine a `--db` value names: PostgreSQL for a `postgres://` or
/// `postgresql://` URL (one host or libpq's `h1:5432,h2:5432`) and for
/// libpq's key-value form (`host=h1,h2 port=5432,5432 dbname=payonce ...`),
/// recognised by its first word: a libpq connection keyword followed by `=`
/// (docs/postgres.md, "The database URL"); SQLite for anything else.
pub fn is_postgres(db: &str) -> bool {
    db.starts_with("postgres://") || db.starts_with("postgresql://") || postgres::is_key_value(db)
}

/// A `--db` naming another database by URL (`mysql://…`, `sqlite://…`) is
/// refused rather than taken as a SQLite file of that name: a file named
/// `mysql:` in the working directory would silently hold the ledger.
/// SQLite's own `file:` URIs (`file:/NAME?vfs=memdb`) have no `//` and stay.
fn refuse_other_schemes(db: &str) -> Result<(), Error> {
    let Some((scheme, _)) = db.split_once("://") else {
        return Ok(());
    };
    let looks_like_a_scheme =
        !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.');
    if looks_like_a_scheme && !is_postgres(db) {
        return Err(Error::invalid(format!(
            "--db {scheme}://…: payonce stores its ledger in SQLite (a file path) or PostgreSQL \
             (postgres:// or postgresql://), not {scheme}"
        )));
    }
    Ok(())
}

/// `db` as payonce prints it: a PostgreSQL URL or key-value string
/// without its password.
pub fn shown_db(db: &str) -> String {
    if is_postgres(db) {
        postgres::redact(db)
    } else {
        db.to_owned()
    }
}

pub struct Store {
    engine: Engine,
    pub is_memory: bool,
    /// Rung after every commit that wrote an outbox event (the webhook relay waits on it).
    outbox_signal: Arc<Signal>,
    /// Test hook ([`Store::rerun_next_writes`]): SQLite write bodies still to
    /// be rehearsed once and rolled back before they run.
    #[cfg(any(test, feature = "test-support"))]
    rehearsals: std::sync::atomic::AtomicU32,
}

/// A counter with a condition variable: a waiter wakes when it moves. The
/// webhook relay sleeps on it between polls, so an event committed in this
/// process is relayed at once rather than at the next poll.
#[derive(Default)]
pub struct Signal {
    rung: parking_lot::Mutex<u64>,
    moved: parking_lot::Condvar,
}

impl Signal {
    pub fn ring(&self) {
        *self.rung.lock() += 1;
        self.moved.notify_all();
    }

    /// The count now; pass it to [`Signal::wait_past`].
    pub fn count(&self) -> u64 {
        *self.rung.lock()
    }

    /// Waits until the count differs from `seen` or `timeout` passed.
    pub fn wait_past(&self, seen: u64, timeout: std::time::Duration) {
        let mut rung = self.rung.lock();
        if *rung == seen {
            let _ = self.moved.wait_for(&mut rung, timeout);
        }
    }
}

enum Engine {
    Sqlite(Box<sqlite::SqliteEngine>),
    Postgres(postgres::PostgresEngine),
}

impl Store {
    /// Opens a SQLite file, a fresh shared in-memory SQLite database for
    /// `":memory:"`, or a PostgreSQL database for a `postgres://` URL or a
    /// libpq key-value string ([`is_postgres`]); the
    /// schema is applied or migrated before this returns.
    pub fn open(db: &str, options: &StoreOptions) -> Result<Store, Error> {
        refuse_other_schemes(db)?;
        if is_postgres(db) {
            return Ok(Store::on(Engine::Postgres(postgres::PostgresEngine::open(db, options)?), false));
        }
        let engine = sqlite::SqliteEngine::open(db, options)?;
        let is_memory = engine.is_memory();
        Ok(Store::on(Engine::Sqlite(Box::new(engine)), is_memory))
    }

    fn on(engine: Engine, is_memory: bool) -> Store {
        Store {
            engine,
            is_memory,
            outbox_signal: Arc::default(),
            #[cfg(any(test, feature = "test-support"))]
            rehearsals: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// `sqlite` or `postgres`, for logs and `/metrics`.
    pub fn engine_name(&self) -> &'static str {
        match &self.engine {
            Engine::Sqlite(_) => "sqlite",
            Engine::Postgres(_) => "postgres",
        }
    }

    /// Runs `work` in one write transaction and commits it when `work`
    /// returns `Ok`; rolls back otherwise. The caller takes its key locks
    /// before calling and drops them after this returns, i.e. after commit,
    /// and passes them as `held` (`&[]` for a write no key serializes): on
    /// PostgreSQL the transaction takes an advisory lock on each, in order,
    /// so other processes wait for the same keys until this one commits.
    ///
    /// SQLite: the database's paths are checked before BEGIN and after the
    /// transaction ends; a write into files no path names any more is
    /// answered 503 `storage_lost`, never acknowledged, even though it
    /// committed (a retry after the restart finds it, exactly once).
    /// PostgreSQL: `work` may run again after a serialization failure or a
    /// deadlock, on a new transaction.
    pub fn write<T: Send>(
        &self,
        held: &[&KeyGuard<'_>],
        work: impl Fn(&WriteTx) -> Result<T, Error> + Send + Sync,
    ) -> Result<T, Error> {
        let keys: Vec<String> = held.iter().map(|guard| guard.key().to_owned()).collect();
        self.write_locking(&keys, work)
    }

    /// [`Store::write`] with the held keys as their texts
    /// ([`crate::keylock::LockKey::text`]), in the order they were taken:
    /// for `Core::write_op`, whose Idempotency-Key lock the API layer holds.
    pub(crate) fn write_locking<T: Send>(
        &self,
        keys: &[String],
        work: impl Fn(&WriteTx) -> Result<T, Error> + Send + Sync,
    ) -> Result<T, Error> {
        let emitted = AtomicBool::new(false);
        let mut attempt = |conn: &dyn Conn| {
            #[cfg(any(test, feature = "test-support"))]
            self.rehearse_if_armed(conn, &work)?;
            emitted.store(false, Relaxed);
            work(&WriteTx { read: ReadTx { conn }, emitted: &emitted })
        };
        let result = match &self.engine {
            Engine::Sqlite(engine) => engine.write(&mut attempt),
            Engine::Postgres(engine) => engine.write(keys, &mut attempt),
        };
        if result.is_ok() && emitted.load(Relaxed) {
            self.outbox_signal.ring();
        }
        result
    }

    /// Rung after each commit of this process that wrote an outbox event.
    pub fn outbox_signal(&self) -> Arc<Signal> {
        Arc::clone(&self.outbox_signal)
    }

    /// Runs `work` on one consistent read snapshot.
    pub fn read<T>(&self, mut work: impl FnMut(&ReadTx) -> Result<T, Error>) -> Result<T, Error> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.read(&mut |conn| work(&ReadTx { conn })),
            Engine::Postgres(engine) => engine.read(&mut |conn| work(&ReadTx { conn })),
        }
    }

    /// SQLite: checks that the database, `-wal` and `-shm` paths still name
    /// the files this process has open (see [`sqlite::SqliteEngine::check_storage`]).
    /// PostgreSQL keeps its own files: always `Ok`.
    pub fn check_storage(&self) -> Result<(), Error> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.check_storage(),
            Engine::Postgres(_) => Ok(()),
        }
    }

    /// Once storage is lost (SQLite only): why writing stopped and the
    /// rescue checkpoint's state, retrying a pending one.
    pub fn storage_lost_state(&self) -> Option<(String, WalRescue)> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.storage_lost_state(),
            Engine::Postgres(_) => None,
        }
    }

    /// Shared with `/metrics`: false once the storage is lost.
    pub fn storage_flag(&self) -> Arc<AtomicBool> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.storage_flag(),
            Engine::Postgres(engine) => engine.storage_flag(),
        }
    }

    /// `/healthz`: a connection of its own reads the schema version and one
    /// page of `orders`.
    pub fn check_health(&self) -> Result<(), Error> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.check_health(),
            Engine::Postgres(engine) => engine.check_health(),
        }
    }

    /// The SQLite database file's path as SQLite opened it (`None` for
    /// `:memory:` and for PostgreSQL).
    pub fn database_path(&self) -> Option<&std::path::Path> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.database_path(),
            Engine::Postgres(_) => None,
        }
    }

    /// Copies a SQLite database into the new file `dest` (one consistent
    /// snapshot, integrity-checked). PostgreSQL is backed up with its own
    /// tools: refused, naming them.
    pub fn backup_into(&self, dest: &std::path::Path) -> Result<(), Error> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.backup_into(dest),
            Engine::Postgres(_) => Err(Error::new(
                ErrorKind::InvalidRequest,
                "payonce backup copies SQLite files; back a PostgreSQL database up with pg_dump or point-in-time recovery (docs/postgres.md)",
            )),
        }
    }

    /// (batches, operations) group-committed so far; `None` on PostgreSQL,
    /// whose concurrent commits share fsyncs by themselves.
    pub fn group_commit_totals(&self) -> Option<(u64, u64)> {
        match &self.engine {
            Engine::Sqlite(engine) => {
                engine.group_commit().map(|c| (c.counters.batches.load(Relaxed), c.counters.operations.load(Relaxed)))
            }
            Engine::Postgres(_) => None,
        }
    }

    /// Batches SQLite's group committer ran again with savepoints after an
    /// operation failed (src/store/sqlite/group_commit.rs); 0 on PostgreSQL.
    pub fn group_commit_reruns(&self) -> u64 {
        match &self.engine {
            Engine::Sqlite(engine) => engine.group_commit().map_or(0, |c| c.counters.reruns.load(Relaxed)),
            Engine::Postgres(_) => 0,
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// Test hook: the next group COMMIT fails (and rolls back) on SQLite.
    #[doc(hidden)]
    pub fn fail_next_commit(&self) {
        if let Engine::Sqlite(engine) = &self.engine {
            if let Some(c) = engine.group_commit() {
                c.fail_next_commit();
            }
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// Test hook: on SQLite, the next group-commit batch's leader panics
    /// after its operations ran and before its COMMIT, outside any
    /// operation (the batch must fail whole, and nobody may wait forever).
    #[doc(hidden)]
    pub fn panic_next_batch_leader(&self) {
        if let Engine::Sqlite(engine) = &self.engine {
            if let Some(c) = engine.group_commit() {
                c.panic_next_leader();
            }
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// Test hook (PostgreSQL): the next `attempts` write attempts end, after
    /// their body ran, with a real `40001` from the server, so the retry of
    /// the whole body is seen.
    #[doc(hidden)]
    pub fn fail_next_writes_serializing(&self, attempts: u32) {
        if let Engine::Postgres(engine) = &self.engine {
            engine.fail_next_writes_serializing(attempts);
        }
    }

    /// Test hook, both engines: each of the next `writes` write bodies runs
    /// twice, its first run rolled back, as PostgreSQL re-runs a body after a
    /// serialization failure. On PostgreSQL the server itself fails the first
    /// run with a real `40001` (see [`Store::fail_next_writes_serializing`]);
    /// on SQLite, where nothing re-runs a body, the first run is rehearsed
    /// inside a savepoint and rolled back. Whatever a body leaks outside its
    /// transaction (a count, a pushed answer) then shows twice.
    #[cfg(any(test, feature = "test-support"))]
    pub fn rerun_next_writes(&self, writes: u32) {
        match &self.engine {
            Engine::Sqlite(_) => self.rehearsals.store(writes, std::sync::atomic::Ordering::SeqCst),
            Engine::Postgres(engine) => engine.fail_next_writes_serializing(writes),
        }
    }

    /// The SQLite half of [`Store::rerun_next_writes`].
    #[cfg(any(test, feature = "test-support"))]
    fn rehearse_if_armed<T>(&self, conn: &dyn Conn, work: &impl Fn(&WriteTx) -> Result<T, Error>) -> Result<(), Error> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.rehearsals.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_err() {
            return Ok(());
        }
        let emitted = AtomicBool::new(false);
        conn.execute("SAVEPOINT rehearsal", &[])?;
        let _rehearsed = work(&WriteTx { read: ReadTx { conn }, emitted: &emitted });
        conn.execute("ROLLBACK TO rehearsal", &[])?;
        conn.execute("RELEASE rehearsal", &[])?;
        Ok(())
    }

    /// Test hook: write operations waiting for the SQLite writer right now.
    #[cfg(any(test, feature = "test-support"))]
    #[doc(hidden)]
    pub fn queued_writers(&self) -> usize {
        match &self.engine {
            Engine::Sqlite(engine) => engine.group_commit().map_or(0, |c| c.queued()),
            Engine::Postgres(_) => 0,
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// Raw SQL for the schema contract tests, which prove the database
    /// refuses what it must on either engine: runs `sql` (one statement,
    /// no parameters) in a transaction of its own and returns the rows it
    /// changed, or the engine's error message.
    #[doc(hidden)]
    pub fn execute_raw(&self, sql: &str) -> Result<u64, String> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.execute_raw(sql),
            Engine::Postgres(engine) => engine.execute_raw(sql),
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// Raw SQL for the conformance tests' checks: the one integer that `sql`
    /// (one statement, no parameters, one row of one column) returns.
    #[doc(hidden)]
    pub fn count_raw(&self, sql: &str) -> Result<i64, String> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.count_raw(sql),
            Engine::Postgres(engine) => engine.count_raw(sql),
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// A pooled SQLite connection for the SQLite-only tests that need raw
    /// SQL (file formats, PRAGMAs); `None` on PostgreSQL.
    #[doc(hidden)]
    pub fn raw_connection(&self) -> Result<r2d2::PooledConnection<r2d2_sqlite::SqliteConnectionManager>, Error> {
        match &self.engine {
            Engine::Sqlite(engine) => engine.raw_connection(),
            Engine::Postgres(_) => Err(Error::internal("raw_connection is SQLite's; use execute_raw")),
        }
    }
}

// ---- what the query methods see of an engine ----

/// A value bound to a `?N` placeholder.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Param<'a> {
    Null,
    Int(i64),
    Text(&'a str),
    Blob(&'a [u8]),
}

impl From<i64> for Param<'_> {
    fn from(v: i64) -> Self {
        Param::Int(v)
    }
}
impl From<u16> for Param<'_> {
    fn from(v: u16) -> Self {
        Param::Int(i64::from(v))
    }
}
impl<'a> From<&'a str> for Param<'a> {
    fn from(v: &'a str) -> Self {
        Param::Text(v)
    }
}
impl<'a> From<&'a String> for Param<'a> {
    fn from(v: &'a String) -> Self {
        Param::Text(v)
    }
}
impl<'a> From<&'a [u8]> for Param<'a> {
    fn from(v: &'a [u8]) -> Self {
        Param::Blob(v)
    }
}
impl<'a> From<&'a Vec<u8>> for Param<'a> {
    fn from(v: &'a Vec<u8>) -> Self {
        Param::Blob(v)
    }
}
impl<'a, T: Into<Param<'a>>> From<Option<T>> for Param<'a> {
    fn from(v: Option<T>) -> Self {
        v.map_or(Param::Null, Into::into)
    }
}

/// `params![a, b]`: the values of one statement, in placeholder order.
macro_rules! params {
    ($($value:expr),* $(,)?) => { &[$($crate::store::Param::from($value)),*] as &[$crate::store::Param] };
}
pub(crate) use params;

/// One column value read back, whatever the engine.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Cell {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
}

/// One row read back: typed accessors that fail loudly on a surprise, so a
/// value the schema should have refused is an error, not a default.
#[derive(Debug)]
pub(crate) struct Row(pub(crate) Vec<Cell>);

impl Row {
    fn cell(&self, i: usize) -> Result<&Cell, Error> {
        self.0.get(i).ok_or_else(|| Error::internal(format!("column {i} missing from a row")))
    }
    pub(crate) fn int(&self, i: usize) -> Result<i64, Error> {
        self.opt_int(i)?.ok_or_else(|| Error::internal(format!("column {i} is NULL")))
    }
    pub(crate) fn opt_int(&self, i: usize) -> Result<Option<i64>, Error> {
        match self.cell(i)? {
            Cell::Null => Ok(None),
            Cell::Int(v) => Ok(Some(*v)),
            other => Err(Error::internal(format!("column {i} is {other:?}, not an integer"))),
        }
    }
    pub(crate) fn text(&self, i: usize) -> Result<String, Error> {
        self.opt_text(i)?.ok_or_else(|| Error::internal(format!("column {i} is NULL")))
    }
    pub(crate) fn opt_text(&self, i: usize) -> Result<Option<String>, Error> {
        match self.cell(i)? {
            Cell::Null => Ok(None),
            Cell::Text(v) => Ok(Some(v.clone())),
            other => Err(Error::internal(format!("column {i} is {other:?}, not text"))),
        }
    }
    pub(crate) fn blob(&self, i: usize) -> Result<Vec<u8>, Error> {
        match self.cell(i)? {
            Cell::Blob(v) => Ok(v.clone()),
            Cell::Text(v) => Ok(v.clone().into_bytes()),
            other => Err(Error::internal(format!("column {i} is {other:?}, not bytes"))),
        }
    }
    pub(crate) fn flag(&self, i: usize) -> Result<bool, Error> {
        Ok(self.int(i)? != 0)
    }
}

/// An engine's open transaction, as the query methods use it. Every
/// statement goes through the engine's prepared-statement cache; `sql` is
/// always a literal, so the cache is keyed by it.
pub(crate) trait Conn {
    fn execute(&self, sql: &'static str, params: &[Param]) -> Result<usize, Error>;
    /// Calls `each` for every row, in order, without collecting them.
    fn query_each(
        &self,
        sql: &'static str,
        params: &[Param],
        each: &mut dyn FnMut(Row) -> Result<(), Error>,
    ) -> Result<(), Error>;
    /// The error for a write that found its read overtaken by a concurrent
    /// commit: on PostgreSQL the whole body runs again (as after a
    /// serialization failure); SQLite, with one writer at a time, never
    /// meets it, so there it is an internal error.
    fn stale_read(&self, what: &str) -> Error;
    /// Holds the key `text` ([`crate::keylock::LockKey::text`]) until this
    /// transaction ends, for a write that could not take it before it began
    /// (PostgreSQL: `pg_advisory_xact_lock`; SQLite's one writer at a time
    /// already excludes every other write).
    fn hold_key(&self, text: &str) -> Result<(), Error>;
    /// Called just before a row goes into `outbox_event`, inside the
    /// transaction (PostgreSQL takes the outbox lock here).
    fn before_event_insert(&self) -> Result<(), Error>;
    /// Called right after that insert (a test hook may hold the transaction open).
    fn after_event_insert(&self);
}

/// A read transaction: a consistent snapshot, and only the methods that read.
///
/// ```compile_fail
/// // A read transaction has no write methods: this does not compile.
/// let store = payonce::store::Store::open(":memory:", &Default::default()).unwrap();
/// store.read(|tx| tx.cas_order_closed(1, "2026-01-01T00:00:00.000Z")).unwrap();
/// ```
///
/// ```
/// // The same call in a write transaction does.
/// let store = payonce::store::Store::open(":memory:", &Default::default()).unwrap();
/// assert!(!store.write(&[], |tx| tx.cas_order_closed(1, "2026-01-01T00:00:00.000Z")).unwrap());
/// ```
pub struct ReadTx<'t> {
    conn: &'t dyn Conn,
}

/// A write transaction: the reads of [`ReadTx`] (by `Deref`) and the
/// methods that change rows.
pub struct WriteTx<'t> {
    read: ReadTx<'t>,
    /// Set when this attempt wrote an outbox event.
    emitted: &'t AtomicBool,
}

impl<'t> std::ops::Deref for WriteTx<'t> {
    type Target = ReadTx<'t>;
    fn deref(&self) -> &ReadTx<'t> {
        &self.read
    }
}

impl ReadTx<'_> {
    fn rows(&self, sql: &'static str, params: &[Param]) -> Result<Vec<Row>, Error> {
        let mut rows = Vec::new();
        self.conn.query_each(sql, params, &mut |row| {
            rows.push(row);
            Ok(())
        })?;
        Ok(rows)
    }

    fn all<T>(
        &self,
        sql: &'static str,
        params: &[Param],
        f: impl Fn(&Row) -> Result<T, Error>,
    ) -> Result<Vec<T>, Error> {
        let mut out = Vec::new();
        self.conn.query_each(sql, params, &mut |row| {
            out.push(f(&row)?);
            Ok(())
        })?;
        Ok(out)
    }

    fn optional<T>(
        &self,
        sql: &'static str,
        params: &[Param],
        f: impl Fn(&Row) -> Result<T, Error>,
    ) -> Result<Option<T>, Error> {
        let rows = self.rows(sql, params)?;
        match rows.as_slice() {
            [] => Ok(None),
            [row] => Ok(Some(f(row)?)),
            _ => Err(Error::internal(format!("{} rows where at most one was expected", rows.len()))),
        }
    }

    fn one<T>(&self, sql: &'static str, params: &[Param], f: impl Fn(&Row) -> Result<T, Error>) -> Result<T, Error> {
        self.optional(sql, params, f)?.ok_or_else(|| Error::internal("no row where one was expected"))
    }
}

impl WriteTx<'_> {
    fn execute(&self, sql: &'static str, params: &[Param]) -> Result<usize, Error> {
        self.read.conn.execute(sql, params)
    }

    /// The body decided on a read another transaction overtook (only a
    /// write that holds no key for what it changes can meet this): on
    /// PostgreSQL the whole body runs again on a fresh transaction, where
    /// it sees the other commit; SQLite's one writer rules it out.
    pub fn stale_read(&self, what: &str) -> Error {
        self.read.conn.stale_read(what)
    }

    /// Takes `key` inside this transaction, held to its end, in the
    /// database where other processes see it: for a write that learns its
    /// keys only as it reads (the keyed drain's pay_nos). Other processes'
    /// writes holding the same key wait for this one's commit, as they
    /// would for a key taken before BEGIN.
    ///
    /// Refused once this attempt wrote an event: an event takes the outbox
    /// lock, and every other writer takes its keys before that lock, so a
    /// key taken after it could deadlock two processes on PostgreSQL.
    pub fn hold_key(&self, key: crate::keylock::LockKey<'_>) -> Result<(), Error> {
        if self.emitted.load(Relaxed) {
            return Err(Error::internal(format!(
                "key {} taken after an event was written in the same transaction: keys come before the outbox lock",
                key.text()
            )));
        }
        self.read.conn.hold_key(&key.text())
    }
}

/// Converts an affected-row count that must be 0 or 1 into a decision.
fn one_row(changed: usize, what: &str) -> Result<bool, Error> {
    match changed {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(Error::internal(format!("{what} changed {n} rows, expected at most one"))),
    }
}

fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// A value the schema's CHECKs should have refused was read back.
fn bad_value(what: &str, value: &str) -> Error {
    Error::internal(format!("unexpected {what} {value:?} in the database"))
}

/// Someone else's text (a webhook receiver's error body, a platform's
/// answer) as payonce records it: each NUL byte becomes the six characters
/// `\u0000`, JSON's spelling of it. PostgreSQL's `text` refuses 0x00, and a
/// write that fails on it must never decide whether a retry schedule moves
/// on (docs/operations.md, "Someone else's bytes, and NUL bytes"). Invalid UTF-8 never
/// reaches here: it is decoded with U+FFFD where it is read.
pub fn escape_foreign_text(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\\u0000"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}
