//! The SQLite engine: an `r2d2` pool of connections with payonce's PRAGMAs,
//! the schema of `schema.sql` applied once to a new database or an older
//! one brought up to it by the numbered migrations (both guarded by
//! `user_version`), and a process-wide writer queue. Every write is
//! `BEGIN IMMEDIATE` on the queue's connection; reads run on a snapshot.
//!
//! A file database is watched: its paths must keep naming the files this
//! process has open (`storage_lost` otherwise), and one anchor connection
//! outside the pool keeps `-wal` and `-shm` in place.

pub mod group_commit;

use super::{
    Cell, Conn, Param, ReadTx, Row, StoreOptions, BUSY_TIMEOUT_MS, MIGRATIONS, POOL_WAIT_MS, SCHEMA_SQL, SCHEMA_VERSION,
};
use crate::error::Error;
use crate::filewatch::{Verdict, WatchedFiles};
use group_commit::GroupCommitter;
use parking_lot::Mutex;
use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synchronous {
    /// Every commit is fsynced: an acknowledged callback survives power loss.
    Full,
    /// For benchmarks and throwaway databases only.
    Normal,
}

pub struct SqliteEngine {
    pool: r2d2::Pool<SqliteConnectionManager>,
    /// The writer queue holds the one connection every write of this
    /// process uses, so its page cache and prepared statements stay warm
    /// (in WAL mode another connection's commit would invalidate them).
    writer: Option<GroupCommitter>,
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
    is_memory: bool,
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

/// Page cache of each pooled connection while it reads, in KiB. Small on
/// purpose: this build's page caches share one pool (SQLite's memory
/// management is on), so a full cache is memory the process keeps, and a
/// reader's snapshot is a few index and table pages; the pool's twenty at
/// SQLite's default 2,000 KiB were two thirds of payonce's peak RSS while
/// the duplicate checks read no faster for it (docs/performance.md,
/// "Near the batching limit: the page caches").
pub const READER_CACHE_KIB: i64 = 256;
/// Page cache of the one connection the group committer writes with, in
/// KiB: the pages every payment's inserts touch (the tables' and unique
/// indexes' right edges, the orders and user rows it updates) stay in it
/// from one batch to the next, since no other connection of this process
/// writes. Smaller, the writer reads them again from the OS at every batch
/// (about 10 µs of CPU more per payment at 8 MiB, measured).
pub const WRITER_CACHE_KIB: i64 = 16 * 1024;

static MEMDB_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Turns SQLite's memory statistics off for the whole process, before its
/// first connection (SQLite accepts the setting only before it initializes;
/// later it answers SQLITE_MISUSE and the statistics stay on, which is
/// harmless). With them on, every allocation SQLite makes takes one global
/// mutex to count it, and the writer allocates several times per page an
/// operation changes (the savepoint's sub-journal): about 2 µs of a
/// payment's writer time (docs/performance.md, "Near the batching limit").
/// payonce reads none of these statistics; `sqlite3_memory_used` reads 0.
pub fn prepare_sqlite_library() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: sqlite3_config with SQLITE_CONFIG_MEMSTATUS takes one int;
        // called once, before this process opens a connection (when another
        // part of the process opened one first, SQLite refuses it unchanged).
        let _refused_when_initialized =
            unsafe { rusqlite::ffi::sqlite3_config(rusqlite::ffi::SQLITE_CONFIG_MEMSTATUS, 0 as std::os::raw::c_int) };
    });
}

impl SqliteEngine {
    /// Opens `path`, or a fresh shared in-memory database for `":memory:"`.
    pub fn open(path: &str, options: &StoreOptions) -> Result<SqliteEngine, Error> {
        prepare_sqlite_library();
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
        // No test on check-out: a SQLite connection does not go stale the way
        // a socket does (a lost file is `check_storage`'s business), and
        // r2d2_sqlite's test prepared and ran `SELECT 1` on every read.
        // A file database's pool opens all its connections now, while the
        // files are the ones just recorded: one opened later, after an
        // operator deleted `-wal`, would create a new `-wal` under the old
        // name, read the database without the deleted file's frames and
        // stop the rescue checkpoint (another file took the name). Nothing
        // ever closes them (below), so the pool never opens another.
        let min_idle = if is_memory { 1 } else { options.pool_size };
        let pool = r2d2::Pool::builder()
            .test_on_check_out(false)
            .max_size(options.pool_size)
            .min_idle(Some(min_idle))
            .idle_timeout(None)
            .max_lifetime(None)
            .connection_timeout(Duration::from_millis(POOL_WAIT_MS))
            .build(manager)
            .map_err(|e| Error::internal(format!("cannot open database {path:?}: {e}")))?;
        let mut store = SqliteEngine {
            pool,
            writer: options
                .writer_queue
                .then(|| GroupCommitter::new(options.group_commit_max, options.group_commit_wait_us)),
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
        ReadTx { conn: &SqliteTx { conn } }.read_health_page()
    }

    /// Brings the database to [`SCHEMA_VERSION`] in ONE IMMEDIATE
    /// transaction that reads `user_version` first, so two processes opening
    /// one file never both apply or migrate it: the second waits, then reads
    /// the new version. A new database gets the whole `SCHEMA_SQL`; an older
    /// one runs each migration above its version, in order; a newer one is
    /// refused. Any failure rolls everything back, leaving the file as it was.
    fn apply_schema(&self) -> Result<(), Error> {
        /// What a migration that edits the stored CREATE text says first.
        const EDITS_SCHEMA_TEXT: &str = "PRAGMA writable_schema = ON;";
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
                let failed = |e: rusqlite::Error| {
                    Error::internal(format!("migration {} ({}) failed: {e}", migration.version, migration.name))
                };
                tx.execute_batch(migration.sql).map_err(failed)?;
                if migration.sql.contains(EDITS_SCHEMA_TEXT) {
                    // SQLite's procedure for editing sqlite_schema: a new
                    // schema_version makes every connection parse the new
                    // text; reading every object back here makes a text that
                    // does not parse fail this migration, not a later statement.
                    let cookie: i64 = tx.query_row("PRAGMA schema_version", [], |r| r.get(0))?;
                    tx.pragma_update(None, "schema_version", cookie + 1)?;
                    tx.query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(())).map_err(failed)?;
                    let check: String = tx.query_row("PRAGMA quick_check", [], |r| r.get(0)).map_err(failed)?;
                    if check != "ok" {
                        return Err(Error::internal(format!(
                            "migration {} ({}) left the database failing quick_check: {check}",
                            migration.version, migration.name
                        )));
                    }
                }
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

    /// Runs `work` in one `BEGIN IMMEDIATE` transaction, after this
    /// process's writer queue, with the storage checks around it (see
    /// [`crate::store::Store::write`]).
    pub(super) fn write<T: Send>(
        &self,
        work: &mut (dyn FnMut(&dyn Conn) -> Result<T, Error> + Send),
    ) -> Result<T, Error> {
        self.check_storage()?;
        let result = self.write_queued(work);
        // Outside the writer queue (the next writer need not wait for it),
        // before the caller answers.
        self.check_storage()?;
        result
    }

    fn write_queued<T: Send>(&self, work: &mut (dyn FnMut(&dyn Conn) -> Result<T, Error> + Send)) -> Result<T, Error> {
        match &self.writer {
            // Queued behind this process's other writers, batched with them
            // into one transaction and one COMMIT (group_commit.rs).
            // The writer keeps its connection for good, with a larger page cache.
            Some(committer) => committer.run(
                || {
                    let conn = self.pool.get()?;
                    conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
                    Ok(conn)
                },
                &mut |conn| work(&SqliteTx { conn }),
            ),
            // Without the queue (measured only): a pooled connection, its own
            // BEGIN IMMEDIATE and COMMIT, SQLite's busy handler between them.
            None => {
                let mut conn = self.pool.get()?;
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let value = work(&SqliteTx { conn: &tx })?;
                tx.commit()?;
                Ok(value)
            }
        }
    }

    /// The group committer's counters (`None` without the writer queue).
    pub(super) fn group_commit(&self) -> Option<&GroupCommitter> {
        self.writer.as_ref()
    }

    /// Runs `work` on one read snapshot (a DEFERRED transaction that only reads).
    pub(super) fn read<T>(&self, work: &mut dyn FnMut(&dyn Conn) -> Result<T, Error>) -> Result<T, Error> {
        let conn = self.pool.get()?;
        // BEGIN and COMMIT through the statement cache: every callback's
        // duplicate check is a read, and preparing the two each time was a
        // fifth of its cost.
        conn.prepare_cached("BEGIN DEFERRED")?.execute([])?;
        let snapshot = ReadSnapshot { conn: &conn };
        let value = work(&SqliteTx { conn: snapshot.conn })?;
        snapshot.conn.prepare_cached("COMMIT")?.execute([])?;
        Ok(value)
    }

    pub(super) fn is_memory(&self) -> bool {
        self.is_memory
    }

    #[cfg(any(test, feature = "test-support"))]
    /// See [`crate::store::Store::count_raw`].
    pub(super) fn count_raw(&self, sql: &str) -> Result<i64, String> {
        let conn = self.pool.get().map_err(|e| e.to_string())?;
        conn.query_row(sql, [], |r| r.get(0)).map_err(|e| e.to_string())
    }

    #[cfg(any(test, feature = "test-support"))]
    /// See [`crate::store::Store::execute_raw`].
    pub(super) fn execute_raw(&self, sql: &str) -> Result<u64, String> {
        let conn = self.pool.get().map_err(|e| e.to_string())?;
        conn.execute(sql, []).map(|n| n as u64).map_err(|e| e.to_string())
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

    #[cfg(any(test, feature = "test-support"))]
    /// A pooled connection for checks and tests that need raw SQL (the
    /// schema tests use it to prove the database refuses what it must).
    pub fn raw_connection(&self) -> Result<r2d2::PooledConnection<SqliteConnectionManager>, Error> {
        Ok(self.pool.get()?)
    }
}

/// A read transaction in progress: ended by its COMMIT, or rolled back here
/// when the work fails or panics, so no pooled connection keeps a snapshot.
struct ReadSnapshot<'c> {
    conn: &'c Connection,
}

impl Drop for ReadSnapshot<'_> {
    fn drop(&mut self) {
        if !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
    }
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
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    conn.set_prepared_statement_cache_capacity(64);
    conn.pragma_update(None, "cache_size", -READER_CACHE_KIB)?;
    Ok(())
}

/// The query methods' view of one SQLite transaction: every statement
/// through the connection's prepared-statement cache.
pub(super) struct SqliteTx<'c> {
    pub(super) conn: &'c Connection,
}

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match *self {
            Param::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Param::Int(v) => ToSqlOutput::Borrowed(ValueRef::Integer(v)),
            Param::Text(v) => ToSqlOutput::Borrowed(ValueRef::Text(v.as_bytes())),
            Param::Blob(v) => ToSqlOutput::Borrowed(ValueRef::Blob(v)),
        })
    }
}

fn cell_of(value: ValueRef<'_>) -> Result<Cell, Error> {
    Ok(match value {
        ValueRef::Null => Cell::Null,
        ValueRef::Integer(v) => Cell::Int(v),
        ValueRef::Text(v) => Cell::Text(
            std::str::from_utf8(v).map_err(|e| Error::internal(format!("a text column is not UTF-8: {e}")))?.to_owned(),
        ),
        ValueRef::Blob(v) => Cell::Blob(v.to_vec()),
        ValueRef::Real(v) => return Err(Error::internal(format!("unexpected REAL value {v} in the database"))),
    })
}

impl Conn for SqliteTx<'_> {
    fn execute(&self, sql: &'static str, params: &[Param]) -> Result<usize, Error> {
        Ok(self.conn.prepare_cached(sql)?.execute(rusqlite::params_from_iter(params))?)
    }

    fn query_each(
        &self,
        sql: &'static str,
        params: &[Param],
        each: &mut dyn FnMut(Row) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let columns = stmt.column_count();
        let mut rows = stmt.query(rusqlite::params_from_iter(params))?;
        while let Some(row) = rows.next()? {
            let mut cells = Vec::with_capacity(columns);
            for i in 0..columns {
                cells.push(cell_of(row.get_ref(i)?)?);
            }
            each(Row(cells))?;
        }
        Ok(())
    }

    fn stale_read(&self, what: &str) -> Error {
        Error::internal(format!("{what}, which one writer at a time rules out"))
    }

    /// One writer at a time: this transaction already excludes every other write.
    fn hold_key(&self, _text: &str) -> Result<(), Error> {
        Ok(())
    }

    /// One writer at a time (`BEGIN IMMEDIATE`): `seq` order is commit order.
    fn before_event_insert(&self) -> Result<(), Error> {
        Ok(())
    }

    fn after_event_insert(&self) {
        if let Some(hold) = crate::test_hooks::EnvHook::HoldAfterEventMs.hold() {
            std::thread::sleep(hold);
        }
    }
}

impl From<rusqlite::Error> for Error {
    fn from(err: rusqlite::Error) -> Error {
        use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
        match err.sqlite_error_code() {
            Some(DatabaseBusy) | Some(DatabaseLocked) => Error::database_busy(),
            _ => Error::internal(format!("database error: {err}")),
        }
    }
}
