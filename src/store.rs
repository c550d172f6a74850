//! The storage module: the only place that speaks SQL.
//!
//! A [`Store`] is an `r2d2` pool of SQLite connections with payonce's
//! PRAGMAs, the schema of `schema.sql` applied once to a new database or an
//! older one brought up to it by the numbered migrations (both guarded by
//! `user_version`), and a process-wide writer queue. Every write runs in
//! [`Store::write`]: queue, `BEGIN IMMEDIATE`, the caller's closure over a
//! [`Tx`], `COMMIT`. Reads run in [`Store::read`] on a consistent snapshot.
//!
//! A later PostgreSQL backend is an addition here: the rest of payonce sees
//! only `Store`, `Tx` and the row types below.

use crate::domain::{
    EventType, Order, OrderStatus, PaymentOutcome, PlatformStatus, RefundStatus, PLATFORM_TIME_AFTER_MS_MAX,
    PLATFORM_TIME_BEFORE_MS_MAX, POINT_TYPE_ORDER_PAID, POINT_TYPE_ORDER_PAID_REVERSAL,
};
use crate::error::Error;
use crate::filewatch::{Verdict, WatchedFiles};
use parking_lot::Mutex;
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, Row, TransactionBehavior};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The whole current schema, applied to a new database.
pub const SCHEMA_SQL: &str = include_str!("../schema.sql");
/// `PRAGMA user_version` once `SCHEMA_SQL` is applied (or the last migration).
pub const SCHEMA_VERSION: i64 = 2;

/// One numbered schema change: run on a database at `version - 1`, it leaves
/// the database at `version`.
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Every schema change since version 1 (the first released schema), in
/// order. The last one's version is [`SCHEMA_VERSION`], and a database
/// migrated through all of them has exactly the schema of `SCHEMA_SQL`
/// (tests/it/schema.rs builds a v1 database and checks it).
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 2,
    name: "refund_platform_settled_at",
    sql: include_str!("../migrations/0002_refund_platform_settled_at.sql"),
}];

/// How long a connection waits in SQLite's busy handler for another
/// process's writer before the request fails with 503 `database_busy`.
pub const BUSY_TIMEOUT_MS: u64 = 5_000;
/// How long a request waits for a pooled connection.
pub const POOL_WAIT_MS: u64 = 10_000;
/// One connection per HTTP worker (16) plus the background workers and a
/// metrics scrape, so a background task never waits behind a full pool.
pub const POOL_SIZE_DEFAULT: u32 = 20;
/// Rows of `orders` `/healthz` reads: one API page.
const HEALTH_ORDERS_ROWS: i64 = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synchronous {
    /// Every commit is fsynced: an acknowledged callback survives power loss.
    Full,
    /// For benchmarks and throwaway databases only.
    Normal,
}

#[derive(Clone, Debug)]
pub struct StoreOptions {
    pub pool_size: u32,
    pub busy_timeout_ms: u64,
    pub synchronous: Synchronous,
    /// Queue this process's writers on one mutex so SQLite's busy handler
    /// (which sleeps in steps of up to 100 ms) only arbitrates between
    /// processes. Off only to measure what it buys.
    pub writer_queue: bool,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            pool_size: POOL_SIZE_DEFAULT,
            busy_timeout_ms: BUSY_TIMEOUT_MS,
            synchronous: Synchronous::Full,
            writer_queue: true,
        }
    }
}

pub struct Store {
    pool: r2d2::Pool<SqliteConnectionManager>,
    /// The writer queue holds the one connection every write of this
    /// process uses, so its page cache and prepared statements stay warm
    /// (in WAL mode another connection's commit would invalidate them).
    writer_queue: Option<Mutex<Option<r2d2::PooledConnection<SqliteConnectionManager>>>>,
    /// One connection open for the store's life, outside the pool.
    /// For `:memory:`: a memdb database vanishes with its last connection,
    /// and the pool may close idle ones. For a file: SQLite deletes `-wal`
    /// and `-shm` when the last connection of all processes closes, and a
    /// pool can briefly reach zero; this one never closes and carries
    /// `SQLITE_FCNTL_PERSIST_WAL`, so payonce itself never removes the files
    /// it watches. It also holds the original `-wal` open, which is what a
    /// rescue checkpoint needs once the path was deleted.
    anchor: Mutex<Connection>,
    /// The files of a file database (`None` for `:memory:`).
    watch: Option<Watch>,
    /// False once the watch found a path changed; read by `/metrics`.
    storage_ok: Arc<AtomicBool>,
    pub is_memory: bool,
}

/// The watched files and what became of them.
struct Watch {
    files: WatchedFiles,
    /// Why this process stopped writing; set once, read by every refusal
    /// without waiting for a rescue in progress.
    why: OnceLock<String>,
    /// Whether the commits that live only in a deleted `-wal` reached the
    /// database file; held while a rescue runs, so only one runs at a time.
    rescue: Mutex<WalRescue>,
}

/// The rescue checkpoint of a deleted `-wal`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WalRescue {
    /// `-wal` was not deleted, or another file took a name: no checkpoint.
    NotAttempted,
    /// Not done yet (another connection held the WAL); retried by the watch.
    Pending(String),
    /// Every frame of the deleted `-wal` is in the database file.
    Done,
}

impl std::fmt::Display for WalRescue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WalRescue::NotAttempted => f.write_str("not attempted"),
            WalRescue::Pending(why) => write!(f, "pending ({why})"),
            WalRescue::Done => f.write_str("done: the deleted -wal is checkpointed into the database file"),
        }
    }
}

static MEMDB_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Store {
    /// Opens `path`, or a fresh shared in-memory database for `":memory:"`.
    pub fn open(path: &str, options: &StoreOptions) -> Result<Store, Error> {
        let is_memory = path == ":memory:";
        let (target, flags) = if is_memory {
            let n = MEMDB_COUNTER.fetch_add(1, Ordering::Relaxed);
            let uri = format!("file:/payonce-{}-{n}?vfs=memdb", std::process::id());
            let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_URI
                | OpenFlags::SQLITE_OPEN_NO_MUTEX;
            (uri, flags)
        } else {
            let flags =
                OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
            (path.to_owned(), flags)
        };
        // Opened first and directly: a file that is not a database fails
        // here at once (the pool would retry for POOL_WAIT_MS).
        let anchor = Connection::open_with_flags(&target, flags)
            .and_then(|conn| configure_connection(&conn, options, is_memory).map(|()| conn))
            .map_err(|e| Error::internal(format!("cannot open database {path:?}: {e}")))?;
        if !is_memory {
            persist_wal(&anchor)?;
        }
        let init_options = options.clone();
        let manager = SqliteConnectionManager::file(&target)
            .with_flags(flags)
            .with_init(move |conn| configure_connection(conn, &init_options, is_memory));
        // Connections are kept for the process's life (no idle timeout, no
        // maximum lifetime): each new one opens the paths afresh, and after
        // a deleted `-wal` it would create a new one under the old name.
        let pool = r2d2::Pool::builder()
            .max_size(options.pool_size)
            .min_idle(Some(1))
            .idle_timeout(None)
            .max_lifetime(None)
            .connection_timeout(Duration::from_millis(POOL_WAIT_MS))
            .build(manager)
            .map_err(|e| Error::internal(format!("cannot open database {path:?}: {e}")))?;
        let mut store = Store {
            pool,
            writer_queue: options.writer_queue.then(|| Mutex::new(None)),
            anchor: Mutex::new(anchor),
            watch: None,
            storage_ok: Arc::new(AtomicBool::new(true)),
            is_memory,
        };
        store.apply_schema()?;
        if !is_memory {
            store.watch = Some(store.record_files(path)?);
        }
        Ok(store)
    }

    /// Records the identities of the files the anchor has open. After the
    /// schema is applied the file is in WAL mode, and the anchor's read
    /// below opens `-wal` and `-shm` if it had not yet.
    fn record_files(&self, path: &str) -> Result<Watch, Error> {
        let anchor = self.anchor.lock();
        anchor.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
        // The name SQLite opened (absolute, symlinks resolved): the journal files are named after it.
        let opened = anchor.path().filter(|p| !p.is_empty()).unwrap_or(path);
        let files = WatchedFiles::record(std::path::Path::new(opened))
            .map_err(|e| Error::internal(format!("cannot watch the database files: {e}")))?;
        Ok(Watch { files, why: OnceLock::new(), rescue: Mutex::new(WalRescue::NotAttempted) })
    }

    /// The database file's path as SQLite opened it (`None` for `:memory:`).
    pub fn database_path(&self) -> Option<&std::path::Path> {
        self.watch.as_ref().map(|w| w.files.database_path())
    }

    /// Shared with `/metrics`: false once the storage is lost.
    pub fn storage_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.storage_ok)
    }

    /// Checks that the database, `-wal` and `-shm` paths still name the
    /// files this process has open. The first time one does not, this
    /// process stops writing for good (`storage_lost`), logs why, and, when
    /// `-wal` was deleted and nothing took its name, checkpoints the deleted
    /// `-wal` into the database first: commits acknowledged before the
    /// deletion live only there. Three `stat` calls while all is well.
    pub fn check_storage(&self) -> Result<(), Error> {
        let Some(watch) = &self.watch else {
            return Ok(());
        };
        if self.storage_ok.load(Ordering::Acquire) {
            let verdict = watch.files.check();
            if verdict.all_same() {
                return Ok(());
            }
            self.lose_storage(watch, &verdict);
        }
        let why = watch.why.get().map_or("the database files changed", String::as_str);
        Err(Error::storage_lost(why))
    }

    fn lose_storage(&self, watch: &Watch, verdict: &Verdict) {
        let mut rescue = watch.rescue.lock();
        if watch.why.get().is_some() {
            return; // another thread got here first
        }
        // Refuse from now on, before the checkpoint: nothing more may be acknowledged.
        self.storage_ok.store(false, Ordering::Release);
        let why = watch.files.describe(verdict);
        crate::log::error(
            "storage lost: a database path no longer names the file payonce has open; every write is refused until payonce is restarted",
            &[("why", &why), ("database", &verdict.database), ("wal", &verdict.wal), ("shm", &verdict.shm)],
        );
        let _ = watch.why.set(why);
        if verdict.wal_rescuable() {
            *rescue = self.rescue_wal(watch);
        }
    }

    /// Once storage is lost: retries a pending rescue checkpoint. Returns
    /// why writing stopped and the rescue's state, or `None` while all is well.
    pub fn storage_lost_state(&self) -> Option<(String, WalRescue)> {
        let watch = self.watch.as_ref()?;
        let why = watch.why.get()?;
        let mut rescue = watch.rescue.lock();
        if matches!(*rescue, WalRescue::Pending(_)) {
            *rescue = self.rescue_wal(watch);
        }
        Some((why.clone(), rescue.clone()))
    }

    /// `wal_checkpoint(TRUNCATE)` through the anchor, which holds the
    /// original `-wal` open: every frame of the deleted file is copied into
    /// the database file and synced. Only while the names still say that
    /// nothing replaced `-wal` (re-checked here, it may have changed).
    fn rescue_wal(&self, watch: &Watch) -> WalRescue {
        let verdict = watch.files.check();
        if !verdict.wal_rescuable() {
            let why = watch.files.describe(&verdict);
            crate::log::error("not checkpointing the deleted -wal: another file took a name", &[("why", &why)]);
            return WalRescue::NotAttempted;
        }
        let anchor = self.anchor.lock();
        let result = anchor.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
        });
        match result {
            Ok((0, frames, checkpointed)) => {
                crate::log::error(
                    "checkpointed the deleted -wal into the database file",
                    &[("frames", &frames), ("checkpointed", &checkpointed)],
                );
                WalRescue::Done
            }
            Ok((_, frames, checkpointed)) => {
                WalRescue::Pending(format!("busy: {checkpointed} of {frames} frames checkpointed"))
            }
            Err(e) => WalRescue::Pending(e.to_string()),
        }
    }

    /// `/healthz`: the files are the ones opened, and a connection of its
    /// own (an empty page cache: a pooled one answers from pages it cached
    /// before the file went bad) reads the schema version and one page of
    /// `orders`.
    pub fn check_health(&self) -> Result<(), Error> {
        self.check_storage()?;
        let fresh;
        let pooled;
        let conn: &Connection = match self.watch.as_ref().map(|w| w.files.database_path()) {
            Some(path) => {
                // READ_WRITE without CREATE: a vanished file is an error, not a new empty database.
                let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
                fresh = Connection::open_with_flags(path, flags)?;
                fresh.busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS))?;
                fresh.pragma_update(None, "query_only", "ON")?;
                &fresh
            }
            None => {
                pooled = self.pool.get()?;
                &pooled
            }
        };
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version != SCHEMA_VERSION {
            return Err(Error::internal(format!("the database's schema version is {version}, not {SCHEMA_VERSION}")));
        }
        let mut stmt = conn.prepare(&format!("SELECT {ORDER_COLUMNS} FROM orders ORDER BY id DESC LIMIT ?1"))?;
        let orders = stmt.query_map([HEALTH_ORDERS_ROWS], order_from_row)?;
        for order in orders {
            order?;
        }
        Ok(())
    }

    /// Brings the database to [`SCHEMA_VERSION`] in ONE IMMEDIATE
    /// transaction that reads `user_version` first, so two processes opening
    /// one file never both apply or migrate it: the second waits, then reads
    /// the new version. A new database gets the whole `SCHEMA_SQL`; an older
    /// one runs each migration above its version, in order; a newer one is
    /// refused. Any failure rolls everything back, leaving the file as it was.
    fn apply_schema(&self) -> Result<(), Error> {
        let mut conn = self.pool.get()?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(Error::internal(format!(
                "database schema version {version} is newer than this payonce ({SCHEMA_VERSION})"
            )));
        }
        if version == 0 {
            tx.execute_batch(SCHEMA_SQL)?;
        } else {
            for migration in MIGRATIONS.iter().filter(|m| m.version > version) {
                tx.execute_batch(migration.sql).map_err(|e| {
                    Error::internal(format!("migration {} ({}) failed: {e}", migration.version, migration.name))
                })?;
                let broken: Option<String> = tx.query_row("PRAGMA foreign_key_check", [], |r| r.get(0)).optional()?;
                if let Some(table) = broken {
                    return Err(Error::internal(format!(
                        "migration {} ({}) left a foreign key broken in {table}",
                        migration.version, migration.name
                    )));
                }
            }
        }
        if version < SCHEMA_VERSION {
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Runs `work` in one `BEGIN IMMEDIATE` transaction and commits it when
    /// `work` returns `Ok`; rolls back otherwise. The caller takes its key
    /// lock before calling and drops it after this returns, i.e. after commit.
    ///
    /// Before BEGIN and after the transaction ends (committed or not), the
    /// database's paths are checked: a write into files no path names any
    /// more is answered 503 `storage_lost`, never acknowledged, even though
    /// it committed (a retry after the restart finds it, exactly once).
    pub fn write<T>(&self, work: impl FnOnce(&Tx) -> Result<T, Error>) -> Result<T, Error> {
        self.check_storage()?;
        let result = self.write_queued(work);
        // Outside the writer queue (the next writer need not wait for it),
        // before the caller answers.
        self.check_storage()?;
        result
    }

    fn write_queued<T>(&self, work: impl FnOnce(&Tx) -> Result<T, Error>) -> Result<T, Error> {
        // Taken after the caller's key lock, released after commit (drop order).
        let mut writer = self.writer_queue.as_ref().map(|m| m.lock());
        let mut pooled;
        let conn: &mut Connection = match writer.as_deref_mut() {
            Some(slot) => match slot {
                Some(conn) => conn,
                None => slot.insert(self.pool.get()?),
            },
            None => {
                pooled = self.pool.get()?;
                &mut pooled
            }
        };
        run_immediate(conn, work)
    }

    /// Runs `work` on one read snapshot.
    pub fn read<T>(&self, work: impl FnOnce(&Tx) -> Result<T, Error>) -> Result<T, Error> {
        let mut conn = self.pool.get()?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
        let value = work(&Tx { conn: &tx })?;
        tx.commit()?;
        Ok(value)
    }

    /// Copies the database into the new file `dest` with SQLite's online
    /// backup API, in one step, so the copy is one consistent snapshot while
    /// writers go on (WAL), then runs `integrity_check` on the copy. `dest`
    /// is a temporary file: no rollback journal is kept beside it and it is
    /// not synced here (the caller syncs it once, then renames it into place).
    pub fn backup_into(&self, dest: &std::path::Path) -> Result<(), Error> {
        let conn = self.pool.get()?;
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let mut dest = Connection::open_with_flags(dest, flags)?;
        // A half-written temporary file is discarded, never rolled back: a
        // journal would only be one more file to leave behind.
        let _mode: String = dest.query_row("PRAGMA journal_mode=OFF", [], |r| r.get(0))?;
        dest.pragma_update(None, "synchronous", "OFF")?;
        let backup = rusqlite::backup::Backup::new(&conn, &mut dest)?;
        // -1 pages: the whole database in one step, inside one read transaction.
        loop {
            match backup.step(-1)? {
                rusqlite::backup::StepResult::Done => break,
                rusqlite::backup::StepResult::More => continue,
                rusqlite::backup::StepResult::Busy | rusqlite::backup::StepResult::Locked => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                _ => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        drop(backup);
        let check: String = dest.query_row("PRAGMA integrity_check", [], |r| r.get(0))?;
        if check != "ok" {
            return Err(Error::internal(format!("the backup failed its integrity check: {check}")));
        }
        dest.close().map_err(|(_, e)| Error::from(e))?;
        Ok(())
    }

    /// A pooled connection for checks and tests that need raw SQL (the
    /// schema tests use it to prove the database refuses what it must).
    pub fn raw_connection(&self) -> Result<r2d2::PooledConnection<SqliteConnectionManager>, Error> {
        Ok(self.pool.get()?)
    }
}

fn run_immediate<T>(conn: &mut Connection, work: impl FnOnce(&Tx) -> Result<T, Error>) -> Result<T, Error> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let value = work(&Tx { conn: &tx })?;
    tx.commit()?;
    Ok(value)
}

/// `SQLITE_FCNTL_PERSIST_WAL` on `conn`'s database: when it is the last
/// connection to close, SQLite checkpoints but keeps `-wal` and `-shm`.
fn persist_wal(conn: &Connection) -> Result<(), Error> {
    let mut on: std::os::raw::c_int = 1;
    // SAFETY: the handle is valid while `conn` lives; this file control
    // reads and writes one int through the pointer, which outlives the call.
    let rc = unsafe {
        rusqlite::ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            rusqlite::ffi::SQLITE_FCNTL_PERSIST_WAL,
            (&mut on as *mut std::os::raw::c_int).cast(),
        )
    };
    if rc != rusqlite::ffi::SQLITE_OK {
        return Err(Error::internal(format!("cannot set SQLITE_FCNTL_PERSIST_WAL (SQLite code {rc})")));
    }
    Ok(())
}

fn configure_connection(conn: &Connection, options: &StoreOptions, is_memory: bool) -> rusqlite::Result<()> {
    // busy_timeout first: switching a new file to WAL may wait for another process.
    conn.busy_timeout(Duration::from_millis(options.busy_timeout_ms))?;
    if !is_memory {
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(rusqlite::Error::InvalidParameterName(format!("journal_mode stayed {mode}, WAL required")));
        }
    }
    let synchronous = match options.synchronous {
        Synchronous::Full => "FULL",
        Synchronous::Normal => "NORMAL",
    };
    conn.pragma_update(None, "synchronous", synchronous)?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

/// A transaction (IMMEDIATE for writes, a read snapshot for reads). Every
/// query payonce runs is a method here.
pub struct Tx<'c> {
    conn: &'c Connection,
}

/// A new order, validated.
#[derive(Clone, Debug)]
pub struct NewOrder {
    pub order_no: String,
    pub user_id: String,
    pub amount: i64,
    pub currency: String,
    pub created_at: String,
    pub expires_at: String,
}

/// A row of `pay_callback_log`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallbackRecord {
    pub id: i64,
    pub pay_no: String,
    pub channel: String,
    pub order_id: i64,
    pub amount: i64,
    pub status: PlatformStatus,
    pub outcome: PaymentOutcome,
    pub decided: bool,
    pub source: String,
    pub paid_at: Option<String>,
    pub received_at: String,
    pub decided_at: Option<String>,
}

/// A payment delivery to record: what the platform said, byte for byte.
#[derive(Clone, Debug)]
pub struct NewCallback<'a> {
    pub pay_no: &'a str,
    pub channel: &'a str,
    pub order_id: i64,
    pub amount: i64,
    pub status: PlatformStatus,
    pub source: &'a str,
    pub raw_body: &'a [u8],
    pub paid_at: Option<&'a str>,
    pub received_at: &'a str,
}

pub enum Claim {
    /// This delivery is the first of its pay_no; the row waits to be decided.
    New(i64),
    /// The pay_no was recorded before.
    Existing(CallbackRecord),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefundRecord {
    pub id: i64,
    pub refund_no: String,
    pub order_id: i64,
    pub status: RefundStatus,
    pub requested_at: String,
    pub settled_at: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CouponRow {
    pub order_no: String,
    pub coupon_template_id: String,
    pub status: String,
    pub created_at: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PointRow {
    pub order_no: String,
    pub point_type: String,
    pub points: i64,
    pub created_at: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EventRow {
    pub seq: i64,
    pub event_id: String,
    pub event_type: String,
    pub order_no: String,
    pub data: Value,
    pub created_at: String,
}

/// Where a keyed request's response is stored, with the work, in one transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencySlot {
    pub scope: String,
    pub key: String,
    /// Hex SHA-256 of the raw request body.
    pub fingerprint: String,
    pub created_at: String,
    pub expires_at: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    pub fingerprint: String,
    pub status_code: u16,
    pub body: Vec<u8>,
}

/// One finding of the inspection.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub kind: &'static str,
    pub order_no: String,
    pub detail: Value,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    pub id: i64,
    pub at: String,
    pub actor: String,
    pub action: String,
    pub order_no: Option<String>,
    pub detail: String,
}

/// A payment as reconciliation sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPayment {
    pub pay_no: String,
    pub order_no: String,
    pub amount: i64,
    pub outcome: String,
    pub paid_time: String,
}

fn local_payment_from_row(r: &Row) -> rusqlite::Result<LocalPayment> {
    Ok(LocalPayment {
        pay_no: r.get(0)?,
        order_no: r.get(1)?,
        amount: r.get(2)?,
        outcome: r.get(3)?,
        paid_time: r.get(4)?,
    })
}

fn audit_from_row(r: &Row) -> rusqlite::Result<AuditRow> {
    Ok(AuditRow {
        id: r.get(0)?,
        at: r.get(1)?,
        actor: r.get(2)?,
        action: r.get(3)?,
        order_no: r.get(4)?,
        detail: r.get(5)?,
    })
}

const ORDER_COLUMNS: &str = "id, order_no, user_id, amount, currency, status, pay_no, created_at, \
     expires_at, paid_at, closed_at, refund_no, refunded_at";
const CALLBACK_COLUMNS: &str = "id, pay_no, channel, order_id, amount, status, outcome, state, \
     source, paid_at, received_at, decided_at";

fn order_from_row(row: &Row) -> rusqlite::Result<Order> {
    let status: String = row.get(5)?;
    Ok(Order {
        id: row.get(0)?,
        order_no: row.get(1)?,
        user_id: row.get(2)?,
        amount: row.get(3)?,
        currency: row.get(4)?,
        status: OrderStatus::parse(&status).ok_or_else(|| bad_value(5, &status))?,
        pay_no: row.get(6)?,
        created_at: row.get(7)?,
        expires_at: row.get(8)?,
        paid_at: row.get(9)?,
        closed_at: row.get(10)?,
        refund_no: row.get(11)?,
        refunded_at: row.get(12)?,
    })
}

fn callback_from_row(row: &Row) -> rusqlite::Result<CallbackRecord> {
    let status: String = row.get(5)?;
    let outcome: String = row.get(6)?;
    let state: String = row.get(7)?;
    // Pair assertion with the CHECKs of schema.sql: read back what was written.
    let outcome = PaymentOutcome::parse(&outcome).ok_or_else(|| bad_value(6, &outcome))?;
    let decided = match state.as_str() {
        "received" => false,
        "decided" => true,
        _ => return Err(bad_value(7, &state)),
    };
    assert_eq!(decided, outcome != PaymentOutcome::Recorded, "callback state/outcome disagree");
    Ok(CallbackRecord {
        id: row.get(0)?,
        pay_no: row.get(1)?,
        channel: row.get(2)?,
        order_id: row.get(3)?,
        amount: row.get(4)?,
        status: PlatformStatus::parse(&status).ok_or_else(|| bad_value(5, &status))?,
        outcome,
        decided,
        source: row.get(8)?,
        paid_at: row.get(9)?,
        received_at: row.get(10)?,
        decided_at: row.get(11)?,
    })
}

fn refund_from_row(row: &Row) -> rusqlite::Result<RefundRecord> {
    let status: String = row.get(3)?;
    Ok(RefundRecord {
        id: row.get(0)?,
        refund_no: row.get(1)?,
        order_id: row.get(2)?,
        status: RefundStatus::parse(&status).ok_or_else(|| bad_value(3, &status))?,
        requested_at: row.get(4)?,
        settled_at: row.get(5)?,
    })
}

fn bad_value(column: usize, value: &str) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(
        column,
        rusqlite::types::Type::Text,
        format!("unexpected value {value:?}").into(),
    )
}

/// Converts an affected-row count that must be 0 or 1 into a decision.
fn one_row(changed: usize, what: &str) -> Result<bool, Error> {
    match changed {
        0 => Ok(false),
        1 => Ok(true),
        n => Err(Error::internal(format!("{what} changed {n} rows, expected at most one"))),
    }
}

impl Tx<'_> {
    /// Runs one statement through the connection's prepared-statement cache.
    fn execute<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.conn.prepare_cached(sql)?.execute(params)
    }

    /// One row, through the prepared-statement cache.
    fn query_row<T, P: rusqlite::Params, F: FnOnce(&Row<'_>) -> rusqlite::Result<T>>(
        &self,
        sql: &str,
        params: P,
        f: F,
    ) -> rusqlite::Result<T> {
        self.conn.prepare_cached(sql)?.query_row(params, f)
    }

    // ---- orders ----

    /// Inserts the order unless its order_no exists; `Err(existing)` then.
    pub fn insert_order(&self, order: &NewOrder) -> Result<Result<Order, Order>, Error> {
        let inserted = self.execute(
            "INSERT INTO orders (order_no, user_id, amount, currency, status, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, 'PENDING', ?5, ?6)
             ON CONFLICT (order_no) DO NOTHING",
            params![order.order_no, order.user_id, order.amount, order.currency, order.created_at, order.expires_at],
        )?;
        let stored = self
            .order_by_no(&order.order_no)?
            .ok_or_else(|| Error::internal(format!("order {} vanished inside its transaction", order.order_no)))?;
        Ok(if one_row(inserted, "insert order")? { Ok(stored) } else { Err(stored) })
    }

    pub fn order_by_no(&self, order_no: &str) -> Result<Option<Order>, Error> {
        let sql = format!("SELECT {ORDER_COLUMNS} FROM orders WHERE order_no = ?1");
        Ok(self.query_row(&sql, [order_no], order_from_row).optional()?)
    }

    pub fn order_by_id(&self, id: i64) -> Result<Order, Error> {
        let sql = format!("SELECT {ORDER_COLUMNS} FROM orders WHERE id = ?1");
        Ok(self.query_row(&sql, [id], order_from_row)?)
    }

    /// Newest first, filtered, after the cursor (an order id).
    pub fn list_orders(
        &self,
        user_id: Option<&str>,
        status: Option<OrderStatus>,
        before_id: Option<i64>,
        limit: usize,
    ) -> Result<Vec<Order>, Error> {
        let sql = format!(
            "SELECT {ORDER_COLUMNS} FROM orders
             WHERE (?1 IS NULL OR user_id = ?1) AND (?2 IS NULL OR status = ?2) AND (?3 IS NULL OR id < ?3)
             ORDER BY id DESC LIMIT ?4"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows =
            stmt.query_map(params![user_id, status.map(OrderStatus::as_str), before_id, limit], order_from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// PENDING orders whose `expires_at` is not after `now`, oldest first
    /// (served by the partial index `ix_orders_pending_expiry`).
    pub fn expired_pending_orders(&self, now: &str, limit: usize) -> Result<Vec<String>, Error> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT order_no FROM orders WHERE status = 'PENDING' AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2",
        )?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt.query_map(params![now, limit], |r| r.get(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// CAS PENDING→PAID, only at the order's own amount. `false` when the
    /// order is not PENDING or the amount differs; the caller reads why.
    pub fn cas_order_paid(&self, order_id: i64, amount: i64, pay_no: &str, paid_at: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE orders SET status = 'PAID', pay_no = ?3, paid_at = ?4
             WHERE id = ?1 AND status = 'PENDING' AND amount = ?2",
            params![order_id, amount, pay_no, paid_at],
        )?;
        one_row(changed, "pay order")
    }

    /// CAS PENDING→CLOSED.
    pub fn cas_order_closed(&self, order_id: i64, closed_at: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE orders SET status = 'CLOSED', closed_at = ?2 WHERE id = ?1 AND status = 'PENDING'",
            params![order_id, closed_at],
        )?;
        one_row(changed, "close order")
    }

    /// CAS PAID→REFUNDING.
    pub fn cas_order_refunding(&self, order_id: i64, refund_no: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE orders SET status = 'REFUNDING', refund_no = ?2 WHERE id = ?1 AND status = 'PAID'",
            params![order_id, refund_no],
        )?;
        one_row(changed, "start refund")
    }

    /// CAS REFUNDING→REFUNDED for this refund_no.
    pub fn cas_order_refunded(&self, order_id: i64, refund_no: &str, refunded_at: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE orders SET status = 'REFUNDED', refunded_at = ?3
             WHERE id = ?1 AND status = 'REFUNDING' AND refund_no = ?2",
            params![order_id, refund_no, refunded_at],
        )?;
        one_row(changed, "settle refund")
    }

    /// CAS REFUNDING→PAID for this refund_no (the refund failed; a new one may be asked).
    pub fn cas_order_refund_failed(&self, order_id: i64, refund_no: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE orders SET status = 'PAID', refund_no = NULL
             WHERE id = ?1 AND status = 'REFUNDING' AND refund_no = ?2",
            params![order_id, refund_no],
        )?;
        one_row(changed, "fail refund")
    }

    // ---- payment callbacks ----

    /// Claims the pay_no: inserts the delivery as `received`, or returns the
    /// record that already holds it (`uk_pay_no`).
    pub fn claim_pay_no(&self, cb: &NewCallback) -> Result<Claim, Error> {
        let inserted = self.execute(
            "INSERT INTO pay_callback_log
                 (pay_no, channel, order_id, amount, status, outcome, state, source, raw_body, paid_at, received_at)
             VALUES (?1, ?2, ?3, ?4, ?5, 'recorded', 'received', ?6, ?7, ?8, ?9)
             ON CONFLICT (pay_no) DO NOTHING",
            params![
                cb.pay_no,
                cb.channel,
                cb.order_id,
                cb.amount,
                cb.status.as_str(),
                cb.source,
                cb.raw_body,
                cb.paid_at,
                cb.received_at
            ],
        )?;
        if one_row(inserted, "record callback")? {
            return Ok(Claim::New(self.conn.last_insert_rowid()));
        }
        let existing = self
            .callback_by_pay_no(cb.pay_no)?
            .ok_or_else(|| Error::internal(format!("pay_no {} conflicted but is not recorded", cb.pay_no)))?;
        Ok(Claim::Existing(existing))
    }

    /// A SUCCESS of a pay_no recorded FAILED (decided `payment_failed`, or
    /// still `received` in record-only mode) supersedes it, once: the row is
    /// `received` again, carrying the new delivery. `false` when the row is
    /// not (or no longer) a FAILED.
    pub fn supersede_failed_payment(&self, id: i64, cb: &NewCallback) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE pay_callback_log
             SET status = 'SUCCESS', outcome = 'recorded', state = 'received', decided_at = NULL,
                 amount = ?2, raw_body = ?3, paid_at = ?4, source = ?5
             WHERE id = ?1 AND status = 'FAILED' AND outcome IN ('payment_failed', 'recorded')",
            params![id, cb.amount, cb.raw_body, cb.paid_at, cb.source],
        )?;
        one_row(changed, "supersede failed payment")
    }

    pub fn callback_by_id(&self, id: i64) -> Result<CallbackRecord, Error> {
        let sql = format!("SELECT {CALLBACK_COLUMNS} FROM pay_callback_log WHERE id = ?1");
        Ok(self.query_row(&sql, [id], callback_from_row)?)
    }

    pub fn callback_by_pay_no(&self, pay_no: &str) -> Result<Option<CallbackRecord>, Error> {
        let sql = format!("SELECT {CALLBACK_COLUMNS} FROM pay_callback_log WHERE pay_no = ?1");
        Ok(self.query_row(&sql, [pay_no], callback_from_row).optional()?)
    }

    pub fn raw_body_of(&self, id: i64) -> Result<Vec<u8>, Error> {
        Ok(self.query_row("SELECT raw_body FROM pay_callback_log WHERE id = ?1", [id], |r| r.get(0))?)
    }

    /// CAS received→decided. `rewards_due` is set exactly for `applied`.
    pub fn decide_callback(
        &self,
        id: i64,
        outcome: PaymentOutcome,
        decided_at: &str,
        rewards_due: Option<&str>,
    ) -> Result<bool, Error> {
        assert!(outcome != PaymentOutcome::Recorded, "deciding a callback as recorded");
        assert_eq!(outcome == PaymentOutcome::Applied, rewards_due.is_some());
        let changed = self.execute(
            "UPDATE pay_callback_log SET outcome = ?2, state = 'decided', decided_at = ?3, rewards_due = ?4,
                 applied_at = CASE WHEN ?2 = 'applied' THEN ?3 END
             WHERE id = ?1 AND state = 'received'",
            params![id, outcome.as_str(), decided_at, rewards_due],
        )?;
        one_row(changed, "decide callback")
    }

    pub fn callbacks_of_order(&self, order_id: i64) -> Result<Vec<CallbackRecord>, Error> {
        let sql = format!("SELECT {CALLBACK_COLUMNS} FROM pay_callback_log WHERE order_id = ?1 ORDER BY id");
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map([order_id], callback_from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- side effects, each under its own UNIQUE key ----

    /// Issues a coupon under `uk_order_tpl`; `false` if it was issued before.
    pub fn issue_coupon(&self, user_id: &str, order_id: i64, template: &str, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO user_coupon (user_id, order_id, coupon_template_id, status, created_at)
             VALUES (?1, ?2, ?3, 'ACTIVE', ?4)
             ON CONFLICT (order_id, coupon_template_id) DO NOTHING",
            params![user_id, order_id, template, now],
        )?;
        one_row(changed, "issue coupon")
    }

    /// Adds the order's points under `uk_order_type`; `false` if added before.
    pub fn add_order_points(&self, user_id: &str, order_id: i64, points: i64, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (order_id, point_type) DO NOTHING",
            params![user_id, order_id, POINT_TYPE_ORDER_PAID, points, now],
        )?;
        one_row(changed, "add points")
    }

    /// Reverses the order's `ORDER_PAID` points by one negative entry under
    /// `uk_order_type`; `false` when there is nothing to reverse or it was
    /// reversed before.
    pub fn reverse_order_points(&self, order_id: i64, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO point_log (user_id, order_id, point_type, points, created_at)
             SELECT user_id, order_id, ?2, -points, ?3 FROM point_log
             WHERE order_id = ?1 AND point_type = ?4
             ON CONFLICT (order_id, point_type) DO NOTHING",
            params![order_id, POINT_TYPE_ORDER_PAID_REVERSAL, now, POINT_TYPE_ORDER_PAID],
        )?;
        one_row(changed, "reverse points")
    }

    /// Freezes the order's ACTIVE coupons; returns how many.
    pub fn freeze_active_coupons(&self, order_id: i64) -> Result<usize, Error> {
        Ok(self.execute(
            "UPDATE user_coupon SET status = 'FROZEN' WHERE order_id = ?1 AND status = 'ACTIVE'",
            [order_id],
        )?)
    }

    /// Writes an outbox event under `uk_event_id`; `false` if it exists.
    pub fn emit_event(
        &self,
        event_type: EventType,
        subject: &str,
        order_no: &str,
        data: &Value,
        now: &str,
    ) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO outbox_event (event_id, type, order_no, data, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (event_id) DO NOTHING",
            params![event_type.event_id(subject), event_type.as_str(), order_no, data.to_string(), now],
        )?;
        one_row(changed, "emit event")
    }

    pub fn events_after(&self, after_seq: i64, limit: usize) -> Result<Vec<EventRow>, Error> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, event_id, type, order_no, data, created_at FROM outbox_event
             WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt.query_map(params![after_seq, limit], |row| {
            let data: String = row.get(4)?;
            Ok(EventRow {
                seq: row.get(0)?,
                event_id: row.get(1)?,
                event_type: row.get(2)?,
                order_no: row.get(3)?,
                data: serde_json::from_str(&data).map_err(|e| bad_value(4, &e.to_string()))?,
                created_at: row.get(5)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- refunds ----

    pub fn refund_by_no(&self, refund_no: &str) -> Result<Option<RefundRecord>, Error> {
        Ok(self
            .conn
            .query_row(
                "SELECT id, refund_no, order_id, status, requested_at, settled_at FROM refund WHERE refund_no = ?1",
                [refund_no],
                refund_from_row,
            )
            .optional()?)
    }

    /// Inserts a REQUESTED refund under `uk_refund_no`; `false` if the refund_no exists.
    pub fn insert_refund(&self, refund_no: &str, order_id: i64, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO refund (refund_no, order_id, status, requested_at) VALUES (?1, ?2, 'REQUESTED', ?3)
             ON CONFLICT (refund_no) DO NOTHING",
            params![refund_no, order_id, now],
        )?;
        one_row(changed, "request refund")
    }

    /// CAS REQUESTED→`to`; `platform_settled_at` is the platform's own time
    /// of a successful refund, when its notice carried one.
    pub fn settle_refund(
        &self,
        id: i64,
        to: RefundStatus,
        now: &str,
        platform_settled_at: Option<&str>,
    ) -> Result<bool, Error> {
        assert!(to != RefundStatus::Requested, "settling a refund as REQUESTED");
        assert!(platform_settled_at.is_none() || to == RefundStatus::Succeeded, "a platform time on a failed refund");
        let changed = self.execute(
            "UPDATE refund SET status = ?2, settled_at = ?3, platform_settled_at = ?4
             WHERE id = ?1 AND status = 'REQUESTED'",
            params![id, to.as_str(), now, platform_settled_at],
        )?;
        one_row(changed, "settle refund")
    }

    // ---- rewards read back ----

    pub fn coupons_of_order(&self, order_id: i64) -> Result<Vec<CouponRow>, Error> {
        self.coupons_where("c.order_id = ?1", &[&order_id])
    }

    pub fn coupons_of_user(&self, user_id: &str) -> Result<Vec<CouponRow>, Error> {
        self.coupons_where("c.user_id = ?1", &[&user_id])
    }

    fn coupons_where(&self, filter: &str, args: &[&dyn rusqlite::ToSql]) -> Result<Vec<CouponRow>, Error> {
        let sql = format!(
            "SELECT o.order_no, c.coupon_template_id, c.status, c.created_at
             FROM user_coupon c JOIN orders o ON o.id = c.order_id WHERE {filter} ORDER BY c.id"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(args, |row| {
            Ok(CouponRow {
                order_no: row.get(0)?,
                coupon_template_id: row.get(1)?,
                status: row.get(2)?,
                created_at: row.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn points_of_order(&self, order_id: i64) -> Result<Vec<PointRow>, Error> {
        self.points_where("p.order_id = ?1", &[&order_id])
    }

    pub fn points_of_user(&self, user_id: &str) -> Result<Vec<PointRow>, Error> {
        self.points_where("p.user_id = ?1", &[&user_id])
    }

    fn points_where(&self, filter: &str, args: &[&dyn rusqlite::ToSql]) -> Result<Vec<PointRow>, Error> {
        let sql = format!(
            "SELECT o.order_no, p.point_type, p.points, p.created_at
             FROM point_log p JOIN orders o ON o.id = p.order_id WHERE {filter} ORDER BY p.id"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(args, |row| {
            Ok(PointRow {
                order_no: row.get(0)?,
                point_type: row.get(1)?,
                points: row.get(2)?,
                created_at: row.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- access-layer Idempotency-Key ----

    /// The stored response of (scope, key) unless it expired by `now`.
    pub fn stored_response(&self, scope: &str, key: &str, now: &str) -> Result<Option<StoredResponse>, Error> {
        Ok(self
            .conn
            .query_row(
                "SELECT fingerprint, status_code, response_body FROM idempotency_key
                 WHERE scope = ?1 AND key = ?2 AND expires_at > ?3",
                params![scope, key, now],
                |r| Ok(StoredResponse { fingerprint: r.get(0)?, status_code: r.get(1)?, body: r.get(2)? }),
            )
            .optional()?)
    }

    /// Stores the response of (scope, key) in the caller's transaction, over
    /// an expired one if any. `false` when a live response is already stored
    /// (another process won the key): the caller must roll back its work.
    pub fn store_response(&self, slot: &IdempotencySlot, status_code: u16, body: &[u8]) -> Result<bool, Error> {
        let changed = self.execute(
            "INSERT INTO idempotency_key (scope, key, fingerprint, status_code, response_body, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (scope, key) DO UPDATE SET
                 fingerprint = excluded.fingerprint, status_code = excluded.status_code,
                 response_body = excluded.response_body, created_at = excluded.created_at,
                 expires_at = excluded.expires_at
             WHERE idempotency_key.expires_at <= excluded.created_at",
            params![slot.scope, slot.key, slot.fingerprint, status_code, body, slot.created_at, slot.expires_at],
        )?;
        one_row(changed, "store idempotent response")
    }

    /// Removes up to `limit` expired stored responses (the table is not a
    /// ledger; only expired keys are ever removed). Returns how many.
    pub fn purge_expired_responses(&self, now: &str, limit: usize) -> Result<usize, Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Ok(self.execute(
            "DELETE FROM idempotency_key WHERE rowid IN
                 (SELECT rowid FROM idempotency_key WHERE expires_at <= ?1 LIMIT ?2)",
            params![now, limit],
        )?)
    }

    // ---- operations: record-only mode, drain, resolutions, compensation ----

    /// Records waiting in record-only mode, in arrival order.
    pub fn received_callbacks(&self, limit: usize) -> Result<Vec<(i64, String)>, Error> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT id, pay_no FROM pay_callback_log WHERE state = 'received' ORDER BY id LIMIT ?1")?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt.query_map([limit], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn count_received(&self) -> Result<i64, Error> {
        Ok(self.query_row("SELECT count(*) FROM pay_callback_log WHERE state = 'received'", [], |r| r.get(0))?)
    }

    /// The resolution of a payment: (resolution, reason, resolved_at).
    pub fn payment_resolution(&self, id: i64) -> Result<Option<(String, String, String)>, Error> {
        Ok(self.query_row(
            "SELECT resolution, resolution_reason, resolved_at FROM pay_callback_log WHERE id = ?1",
            [id],
            |r| {
                let resolution: Option<String> = r.get(0)?;
                Ok(match resolution {
                    Some(resolution) => Some((resolution, r.get(1)?, r.get(2)?)),
                    None => None,
                })
            },
        )?)
    }

    /// CAS unresolved → resolved, for refund-required payments only.
    pub fn resolve_payment(&self, id: i64, resolution: &str, reason: &str, now: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE pay_callback_log SET resolution = ?2, resolution_reason = ?3, resolved_at = ?4
             WHERE id = ?1 AND resolution IS NULL
               AND outcome IN ('paid_after_close', 'already_paid', 'amount_mismatch')",
            params![id, resolution, reason, now],
        )?;
        one_row(changed, "resolve payment")
    }

    /// `audit_log` rows of one action about one refund_no, oldest first.
    pub fn refund_audit(&self, action: &str, refund_no: &str) -> Result<Vec<AuditRow>, Error> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT id, at, actor, action, order_no, detail FROM audit_log
             WHERE action = ?1 AND json_extract(detail, '$.refund_no') = ?2
               AND action IN ('unexpected_refund', 'unexpected_refund_resolved')
             ORDER BY id",
        )?;
        let rows = stmt.query_map(params![action, refund_no], audit_from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// One coupon of an order, with its status (at most one: uk_order_tpl).
    pub fn coupon_of_order(&self, order_id: i64, template: &str) -> Result<Option<CouponRow>, Error> {
        let rows = self.coupons_where("c.order_id = ?1 AND c.coupon_template_id = ?2", &[&order_id, &template])?;
        Ok(rows.into_iter().next())
    }

    /// CAS ACTIVE→FROZEN for one coupon.
    pub fn freeze_coupon(&self, order_id: i64, template: &str) -> Result<bool, Error> {
        let changed = self.execute(
            "UPDATE user_coupon SET status = 'FROZEN'
             WHERE order_id = ?1 AND coupon_template_id = ?2 AND status = 'ACTIVE'",
            params![order_id, template],
        )?;
        one_row(changed, "freeze coupon")
    }

    /// One points entry of an order by type (at most one: uk_order_type).
    pub fn points_entry(&self, order_id: i64, point_type: &str) -> Result<Option<PointRow>, Error> {
        let rows = self.points_where("p.order_id = ?1 AND p.point_type = ?2", &[&order_id, &point_type])?;
        Ok(rows.into_iter().next())
    }

    // ---- inspection: every query is served by an index ----

    /// Runs every inspection query; `received_before` (now minus
    /// `ops::RECEIVED_STALE_MS`) bounds `received_not_applied`.
    pub fn inspect(&self, received_before: &str) -> Result<Vec<Finding>, Error> {
        let mut findings = Vec::new();
        let mut collect = |kind: &'static str, sql: &str, args: &[&dyn rusqlite::ToSql]| -> Result<(), Error> {
            let mut stmt = self.conn.prepare_cached(sql)?;
            let rows = stmt.query_map(args, |r| {
                let detail: String = r.get(1)?;
                Ok(Finding {
                    kind,
                    order_no: r.get(0)?,
                    detail: serde_json::from_str(&detail).unwrap_or(Value::String(detail)),
                })
            })?;
            for row in rows {
                findings.push(row?);
            }
            Ok(())
        };
        collect(
            "duplicate_coupon",
            "SELECT o.order_no, json_object('coupon_template_id', d.coupon_template_id, 'rows', d.n)
             FROM (SELECT order_id, coupon_template_id, count(*) AS n FROM user_coupon
                   GROUP BY order_id, coupon_template_id HAVING count(*) > 1) d
             JOIN orders o ON o.id = d.order_id",
            &[],
        )?;
        collect(
            "duplicate_points",
            "SELECT o.order_no, json_object('point_type', d.point_type, 'rows', d.n)
             FROM (SELECT order_id, point_type, count(*) AS n FROM point_log
                   GROUP BY order_id, point_type HAVING count(*) > 1) d
             JOIN orders o ON o.id = d.order_id",
            &[],
        )?;
        collect(
            "paid_without_rewards",
            "SELECT o.order_no, json_object('pay_no', p.pay_no, 'rewards_due', json(p.rewards_due),
                    'missing_coupons', (SELECT json_group_array(t.value) FROM json_each(p.rewards_due, '$.coupons') t
                        WHERE NOT EXISTS (SELECT 1 FROM user_coupon c
                                          WHERE c.order_id = p.order_id AND c.coupon_template_id = t.value)),
                    'missing_points', json_extract(p.rewards_due, '$.points') > 0 AND NOT EXISTS
                        (SELECT 1 FROM point_log l WHERE l.order_id = p.order_id AND l.point_type = 'ORDER_PAID'))
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.outcome = 'applied'
               AND (EXISTS (SELECT 1 FROM json_each(p.rewards_due, '$.coupons') t
                            WHERE NOT EXISTS (SELECT 1 FROM user_coupon c
                                              WHERE c.order_id = p.order_id AND c.coupon_template_id = t.value))
                    OR (json_extract(p.rewards_due, '$.points') > 0 AND NOT EXISTS
                        (SELECT 1 FROM point_log l WHERE l.order_id = p.order_id AND l.point_type = 'ORDER_PAID')))",
            &[],
        )?;
        collect(
            "applied_callback_order_not_paid",
            "SELECT o.order_no, json_object('pay_no', p.pay_no, 'order_status', o.status, 'order_pay_no', o.pay_no)
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.outcome = 'applied'
               AND (o.status NOT IN ('PAID', 'REFUNDING', 'REFUNDED') OR o.pay_no IS NOT p.pay_no)",
            &[],
        )?;
        collect(
            "refund_required",
            "SELECT o.order_no, json_object('pay_no', p.pay_no, 'outcome', p.outcome, 'amount', p.amount,
                                            'channel', p.channel, 'decided_at', p.decided_at)
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.outcome IN ('paid_after_close', 'already_paid', 'amount_mismatch') AND p.resolution IS NULL
             ORDER BY p.id",
            &[],
        )?;
        collect(
            "unexpected_refund",
            "SELECT a.order_no, json_object('refund_no', json_extract(a.detail, '$.refund_no'),
                                            'status', json_extract(a.detail, '$.status'), 'deliveries', count(*),
                                            'first_at', min(a.at))
             FROM audit_log a
             WHERE a.action = 'unexpected_refund'
               AND NOT EXISTS (SELECT 1 FROM audit_log r WHERE r.action = 'unexpected_refund_resolved'
                               AND json_extract(r.detail, '$.refund_no') = json_extract(a.detail, '$.refund_no'))
             GROUP BY json_extract(a.detail, '$.refund_no'), a.order_no
             ORDER BY min(a.id)",
            &[],
        )?;
        collect(
            "received_not_applied",
            "SELECT o.order_no, json_object('pay_no', p.pay_no, 'received_at', p.received_at)
             FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
             WHERE p.state = 'received' AND p.received_at < ?1
               AND (SELECT value FROM settings WHERE name = 'mode') = 'normal'
             ORDER BY p.id",
            &[&received_before],
        )?;
        Ok(findings)
    }

    // ---- reconciliation ----

    /// Payments whose money moved (or that wait, recorded, with a SUCCESS),
    /// by pay_no, for matching a platform's SUCCESS row.
    pub fn money_moved_payment(&self, pay_no: &str) -> Result<Option<LocalPayment>, Error> {
        Ok(self
            .conn
            .query_row(
                "SELECT p.pay_no, o.order_no, p.amount, p.outcome, coalesce(p.paid_at, p.decided_at, p.received_at)
                 FROM pay_callback_log p JOIN orders o ON o.id = p.order_id
                 WHERE p.pay_no = ?1 AND p.status = 'SUCCESS'
                   AND p.outcome IN ('recorded', 'applied', 'already_paid', 'paid_after_close', 'amount_mismatch')",
                [pay_no],
                local_payment_from_row,
            )
            .optional()?)
    }

    /// Applied payments whose paid time is in [from, to). The paid time is
    /// the platform's when it lies within [decided_at − 72 h, decided_at +
    /// 5 min], else `decided_at`: a platform time outside that window (one
    /// recorded before payonce windowed notifications, or by a repair) must
    /// not date an applied payment out of `missing_remote`'s reach. That
    /// test reads every applied payment (no index holds it): about as long
    /// as an inspection on the same file.
    pub fn applied_payments_between(&self, from: &str, to: &str) -> Result<Vec<LocalPayment>, Error> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT p.pay_no, o.order_no, p.amount, p.outcome, p.placed
             FROM (SELECT pay_no, order_id, amount, outcome,
                          CASE WHEN paid_at >= strftime('%Y-%m-%dT%H:%M:%fZ', decided_at, ?3)
                                AND paid_at <= strftime('%Y-%m-%dT%H:%M:%fZ', decided_at, ?4)
                               THEN paid_at ELSE decided_at END AS placed
                   FROM pay_callback_log WHERE outcome = 'applied') p
             JOIN orders o ON o.id = p.order_id
             WHERE p.placed >= ?1 AND p.placed < ?2
             ORDER BY p.placed",
        )?;
        let before = format!("-{:.3} seconds", PLATFORM_TIME_BEFORE_MS_MAX as f64 / 1000.0);
        let after = format!("+{:.3} seconds", PLATFORM_TIME_AFTER_MS_MAX as f64 / 1000.0);
        let rows = stmt.query_map(params![from, to, before, after], local_payment_from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// A SUCCEEDED refund by refund_no: (order_no, amount refunded = the order's amount).
    pub fn succeeded_refund(&self, refund_no: &str) -> Result<Option<(String, i64)>, Error> {
        Ok(self
            .conn
            .query_row(
                "SELECT o.order_no, o.amount FROM refund r JOIN orders o ON o.id = r.order_id
                 WHERE r.refund_no = ?1 AND r.status = 'SUCCEEDED'",
                [refund_no],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// SUCCEEDED refunds settled in [from, to), by the platform's refund time
    /// when its notice carried one, else by when payonce settled them:
    /// (refund_no, order_no, amount).
    pub fn refunds_settled_between(&self, from: &str, to: &str) -> Result<Vec<(String, String, i64)>, Error> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT r.refund_no, o.order_no, o.amount FROM refund r JOIN orders o ON o.id = r.order_id
             WHERE r.status = 'SUCCEEDED'
               AND coalesce(r.platform_settled_at, r.settled_at) >= ?1
               AND coalesce(r.platform_settled_at, r.settled_at) < ?2
             ORDER BY coalesce(r.platform_settled_at, r.settled_at)",
        )?;
        let rows = stmt.query_map(params![from, to], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    // ---- audit and settings ----

    pub fn audit(
        &self,
        at: &str,
        actor: &str,
        action: &str,
        order_no: Option<&str>,
        detail: &Value,
    ) -> Result<(), Error> {
        self.execute(
            "INSERT INTO audit_log (at, actor, action, order_no, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![at, actor, action, order_no, detail.to_string()],
        )?;
        Ok(())
    }

    pub fn setting(&self, name: &str) -> Result<Option<String>, Error> {
        Ok(self.query_row("SELECT value FROM settings WHERE name = ?1", [name], |r| r.get(0)).optional()?)
    }

    pub fn put_setting(&self, name: &str, value: &str) -> Result<(), Error> {
        self.execute(
            "INSERT INTO settings (name, value) VALUES (?1, ?2)
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            params![name, value],
        )?;
        Ok(())
    }
}
