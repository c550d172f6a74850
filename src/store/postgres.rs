//! The PostgreSQL engine: several `payonce serve` processes, on any number of
//! hosts, on one database (docs/postgres.md).
//!
//! - A pool of connections (`r2d2_postgres`), each with its own statement
//!   cache; the query methods reach a connection only through that cache.
//! - Every write is one READ COMMITTED transaction whose first statements
//!   take `pg_advisory_xact_lock` on each key its caller holds in the
//!   process-local [`crate::keylock::KeyedLocks`] and passed to
//!   `Store::write`, in the order it took them. PostgreSQL itself releases them at COMMIT or ROLLBACK, so the
//!   lock can never be dropped before the commit, and every read of the
//!   body follows the lock and sees the previous holder's rows.
//! - A serialization failure or deadlock (`40001`, `40P01`) runs the whole
//!   body again on a new transaction, at most [`WRITE_ATTEMPTS_MAX`] times.
//! - Inserting into `outbox_event` takes one more advisory lock, on the
//!   outbox, held to the commit: transactions that emit events commit one
//!   at a time, in `seq` order, so a reader's cursor never skips an event
//!   that commits later with a smaller `seq`.
//! - Reads run REPEATABLE READ, READ ONLY: one snapshot for the whole body.
//! - The schema (`schema.postgres.sql`) is applied in one transaction under
//!   an advisory lock and versioned in `payonce_schema_version`.

use super::{
    params, Cell, Conn, Param, ReadTx, Row, StoreOptions, POOL_WAIT_MS, POSTGRES_MIGRATIONS,
    POSTGRES_SCHEMA_VERSION_FIRST, SCHEMA_POSTGRES_SQL, SCHEMA_VERSION, WRITE_ATTEMPTS_MAX,
};
use crate::error::{Error, ErrorKind};
use crate::test_hooks::EnvHook;
use bytes::BytesMut;
use postgres::error::{Severity, SqlState};
use postgres::types::{IsNull, ToSql, Type};
use postgres::{Client, IsolationLevel, NoTls, Statement, Transaction};
use r2d2_postgres::PostgresConnectionManager;
use std::cell::{Cell as Flag, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Advisory-lock key of schema application: one process applies or checks
/// the schema at a time.
const SCHEMA_LOCK: &str = "payonce:schema";
/// Advisory-lock key every event-emitting transaction takes just before its
/// insert into `outbox_event`.
const OUTBOX_LOCK: &str = "payonce:outbox";

/// Test hooks, read from the environment when the store opens. Neither is
/// documented for operators: they exist so a test can show the outbox lock
/// matters.
#[derive(Clone, Debug, Default)]
struct Hooks {
    /// `PAYONCE_TEST_HOLD_AFTER_EVENT_MS`: sleep this long right after an
    /// insert into `outbox_event`, inside the transaction.
    hold_after_event: Option<Duration>,
    /// `PAYONCE_TEST_NAIVE_OUTBOX=1`: skip the outbox lock (a plain sequence).
    naive_outbox: bool,
}

impl Hooks {
    fn from_env() -> Hooks {
        let hold_after_event = EnvHook::HoldAfterEventMs.hold();
        let naive_outbox = EnvHook::NaiveOutbox.is_on();
        Hooks { hold_after_event, naive_outbox }
    }
}

pub struct PostgresEngine {
    pool: r2d2::Pool<Manager>,
    /// [`Manager::reachable`], read when the pool times out.
    reachable: Arc<AtomicBool>,
    storage_ok: Arc<AtomicBool>,
    hooks: Hooks,
    /// Test hook: this many coming write attempts end, after their body ran,
    /// with a real serialization failure raised by the server.
    serialization_failures: std::sync::atomic::AtomicU32,
}

/// A pooled connection: the client and the statements prepared on it.
pub(super) struct PgConnection {
    client: Client,
    statements: HashMap<&'static str, Statement>,
    /// Set when a statement on it failed because the connection or the
    /// server went away: the pool drops it instead of handing it out again
    /// (the client may not have seen its socket close yet).
    broken: Flag<bool>,
}

struct Manager {
    inner: Connector,
    /// Session settings every new connection gets.
    session: String,
    /// Whether the last attempt to open a connection succeeded: a pool
    /// that times out while the server refuses connections is
    /// `database_unavailable`, one that is merely full is `database_busy`.
    reachable: Arc<AtomicBool>,
}

/// Plain TCP, or TLS when the URL says `sslmode=require`.
enum Connector {
    Plain(PostgresConnectionManager<NoTls>),
    Tls(PostgresConnectionManager<tokio_postgres_rustls::MakeRustlsConnect>),
}

impl Connector {
    fn new(config: postgres::Config, shown: &str) -> Result<Connector, Error> {
        use postgres::config::SslMode;
        Ok(match config.get_ssl_mode() {
            // prefer (the default) and disable: plain TCP, as before. libpq's
            // prefer would encrypt without checking the certificate; payonce
            // does not pretend that is protection.
            SslMode::Disable | SslMode::Prefer => Connector::Plain(PostgresConnectionManager::new(config, NoTls)),
            _ => Connector::Tls(PostgresConnectionManager::new(config, tls_connector(shown)?)),
        })
    }

    fn connect(&self) -> Result<Client, postgres::Error> {
        match self {
            Connector::Plain(m) => r2d2::ManageConnection::connect(m),
            Connector::Tls(m) => r2d2::ManageConnection::connect(m),
        }
    }
}

/// TLS that checks the server's certificate and host name (libpq's
/// `verify-full`) against the Mozilla roots and, if `PAYONCE_DB_CA_FILE`
/// names a PEM file, its certificates (a private CA).
fn tls_connector(shown: &str) -> Result<tokio_postgres_rustls::MakeRustlsConnect, Error> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = std::env::var_os("PAYONCE_DB_CA_FILE").filter(|p| !p.is_empty()) {
        let shown_path = std::path::Path::new(&path).display().to_string();
        let file =
            std::fs::File::open(&path).map_err(|e| Error::internal(format!("PAYONCE_DB_CA_FILE {shown_path}: {e}")))?;
        let mut added = 0;
        for cert in rustls_pemfile::certs(&mut std::io::BufReader::new(file)) {
            let cert = cert.map_err(|e| Error::internal(format!("PAYONCE_DB_CA_FILE {shown_path}: {e}")))?;
            roots.add(cert).map_err(|e| Error::internal(format!("PAYONCE_DB_CA_FILE {shown_path}: {e}")))?;
            added += 1;
        }
        if added == 0 {
            return Err(Error::internal(format!("PAYONCE_DB_CA_FILE {shown_path} holds no PEM certificate")));
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::internal(format!("TLS for {shown}: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

impl r2d2::ManageConnection for Manager {
    type Connection = PgConnection;
    type Error = postgres::Error;

    fn connect(&self) -> Result<PgConnection, postgres::Error> {
        let connected = self.inner.connect().and_then(|mut client| {
            client.batch_execute(&self.session)?;
            Ok(client)
        });
        self.reachable.store(connected.is_ok(), Ordering::SeqCst);
        Ok(PgConnection { client: connected?, statements: HashMap::new(), broken: Flag::new(false) })
    }

    fn is_valid(&self, conn: &mut PgConnection) -> Result<(), postgres::Error> {
        conn.client.simple_query("").map(drop)
    }

    fn has_broken(&self, conn: &mut PgConnection) -> bool {
        conn.broken.get() || conn.client.is_closed()
    }
}

/// `url` with its password replaced, for messages and logs: a password in
/// a PostgreSQL URL is never printed.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => match authority[..at].find(':') {
            Some(colon) => format!("{}:***{}", &authority[..colon], &authority[at..]),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    // A password may also come as a query parameter.
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|kv| if kv.starts_with("password=") { "password=***".to_owned() } else { kv.to_owned() })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{}{authority}{tail}", &url[..scheme_end])
}

/// A 64-bit advisory-lock key for `name`: the first 8 bytes of its SHA-256.
/// Two names sharing a key would only serialise more than needed.
fn lock_key(name: &str) -> i64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(name.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// `?N` placeholders (the SQL both engines share) as PostgreSQL's `$N`.
/// The shared SQL has no `?` inside string literals.
fn postgres_sql(sql: &str) -> String {
    sql.replace('?', "$")
}

impl PostgresEngine {
    pub(super) fn open(url: &str, options: &StoreOptions) -> Result<PostgresEngine, Error> {
        let shown = redact_url(url);
        let config: postgres::Config =
            url.parse().map_err(|e| Error::internal(format!("cannot parse the database URL {shown}: {e}")))?;
        // lock_timeout bounds the advisory locks as busy_timeout bounds
        // SQLite's writer lock: past it the request is 503 database_busy.
        let session = format!(
            "SET application_name = 'payonce'; SET lock_timeout = '{}ms'; SET TIME ZONE 'UTC'",
            options.busy_timeout_ms
        );
        let reachable = Arc::new(AtomicBool::new(true));
        let manager = Manager { inner: Connector::new(config, &shown)?, session, reachable: Arc::clone(&reachable) };
        // One connection first, directly: an unreachable server or a refused
        // login fails here at once with its cause (the pool would retry for
        // POOL_WAIT_MS and report a timeout).
        r2d2::ManageConnection::connect(&manager).map_err(|e| {
            Error::new(ErrorKind::DatabaseUnavailable, format!("cannot connect to {shown}: {}", with_causes(&e)))
        })?;
        let pool = r2d2::Pool::builder()
            .max_size(options.pool_size)
            .min_idle(Some(1))
            .connection_timeout(Duration::from_millis(POOL_WAIT_MS))
            .build(manager)
            .map_err(|e| Error::internal(format!("cannot open database {shown}: {e}")))?;
        let engine = PostgresEngine {
            pool,
            reachable,
            storage_ok: Arc::new(AtomicBool::new(true)),
            hooks: Hooks::from_env(),
            serialization_failures: std::sync::atomic::AtomicU32::new(0),
        };
        engine.apply_schema().map_err(|e| Error::new(e.kind, format!("database {shown}: {}", e.message)))?;
        Ok(engine)
    }

    /// `work` on a pooled connection's client itself, outside payonce's
    /// write path: `payonce copy-db` (store/copy.rs) loads rows with COPY.
    pub(super) fn with_raw_client<T>(&self, work: &mut dyn FnMut(&mut Client) -> Result<T, Error>) -> Result<T, Error> {
        let mut conn = self.connection()?;
        work(&mut conn.client)
    }

    /// A pooled connection, waiting at most [`POOL_WAIT_MS`] for one.
    fn connection(&self) -> Result<r2d2::PooledConnection<Manager>, Error> {
        self.pool.get().map_err(|e| {
            if self.reachable.load(Ordering::SeqCst) {
                Error::from(e)
            } else {
                Error::new(ErrorKind::DatabaseUnavailable, format!("cannot connect to the database: {e}"))
            }
        })
    }

    /// Brings the database to [`SCHEMA_VERSION`] in one transaction under a
    /// transaction-scoped advisory lock, so processes starting together
    /// never both apply it: the second waits, then reads the version.
    fn apply_schema(&self) -> Result<(), Error> {
        let mut conn = self.connection()?;
        let mut tx = conn.client.transaction().map_err(plain_error)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(SCHEMA_LOCK)]).map_err(plain_error)?;
        let exists: bool =
            tx.query_one("SELECT to_regclass('payonce_schema_version') IS NOT NULL", &[]).map_err(plain_error)?.get(0);
        let version: i64 = if exists {
            tx.query_one("SELECT coalesce(max(version), 0) FROM payonce_schema_version", &[])
                .map_err(plain_error)?
                .get(0)
        } else {
            tx.batch_execute("CREATE TABLE payonce_schema_version (version BIGINT NOT NULL PRIMARY KEY)")
                .map_err(plain_error)?;
            0
        };
        if version > SCHEMA_VERSION {
            return Err(Error::internal(format!(
                "database schema version {version} is newer than this payonce ({SCHEMA_VERSION})"
            )));
        }
        if version == 0 {
            tx.batch_execute(SCHEMA_POSTGRES_SQL)
                .map_err(|e| Error::internal(format!("applying schema.postgres.sql failed: {}", message_of(&e))))?;
            tx.execute("INSERT INTO payonce_schema_version (version) VALUES ($1)", &[&SCHEMA_VERSION])
                .map_err(plain_error)?;
        } else if version < POSTGRES_SCHEMA_VERSION_FIRST {
            return Err(Error::internal(format!(
                "database schema version {version} is older than any payonce PostgreSQL schema ({POSTGRES_SCHEMA_VERSION_FIRST})"
            )));
        } else if version < SCHEMA_VERSION {
            // Each numbered migration above the database's version, in
            // order, in this one transaction: any failure leaves it as it was.
            for migration in POSTGRES_MIGRATIONS.iter().filter(|m| m.version > version) {
                tx.batch_execute(migration.sql).map_err(|e| {
                    Error::internal(format!(
                        "migration {} ({}) failed: {}",
                        migration.version,
                        migration.name,
                        message_of(&e)
                    ))
                })?;
            }
            tx.execute("INSERT INTO payonce_schema_version (version) VALUES ($1)", &[&SCHEMA_VERSION])
                .map_err(plain_error)?;
        }
        tx.commit().map_err(plain_error)?;
        Ok(())
    }

    pub(super) fn write<T>(
        &self,
        held: &[String],
        work: &mut dyn FnMut(&dyn Conn) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let keys: Vec<i64> = held.iter().map(|k| lock_key(k)).collect();
        for attempt in 1..=WRITE_ATTEMPTS_MAX {
            let mut conn = self.connection()?;
            let PgConnection { client, statements, broken } = &mut *conn;
            let tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::ReadCommitted)
                .start()
                .map_err(|e| forget_if_gone(broken, plain_error(e)))?;
            let pg = PgTx::new(tx, statements, &self.hooks);
            let result = keys
                .iter()
                .try_for_each(|key| pg.execute("SELECT pg_advisory_xact_lock(?1)", params![*key]).map(drop))
                .and_then(|()| work(&pg))
                .and_then(|value| self.maybe_fail_serialization(&pg).map(|()| value));
            // Dropping the transaction after an error rolls it back. A
            // COMMIT whose answer was lost is an error too: nothing is
            // acknowledged that is not known to have committed, and the
            // client's retry finds it by its business key.
            let result = result.and_then(|value| pg.commit().map(|()| value)).map_err(|e| forget_if_gone(broken, e));
            match result {
                Err(_) if pg.conflict.get() && attempt < WRITE_ATTEMPTS_MAX => {
                    crate::log::info(
                        "write transaction re-run after a serialization failure or deadlock",
                        &[("attempt", &attempt)],
                    );
                }
                Err(_) if pg.conflict.get() => {
                    return Err(Error::new(
                        ErrorKind::DatabaseBusy,
                        format!("the database kept refusing this write (serialization failure or deadlock, {WRITE_ATTEMPTS_MAX} attempts); retry shortly"),
                    ));
                }
                other => return other,
            }
        }
        unreachable!("the last attempt returns")
    }

    #[cfg(any(test, feature = "test-support"))]
    /// See [`crate::store::Store::fail_next_writes_serializing`].
    pub(super) fn fail_next_writes_serializing(&self, attempts: u32) {
        self.serialization_failures.store(attempts, std::sync::atomic::Ordering::SeqCst);
    }

    fn maybe_fail_serialization(&self, pg: &PgTx) -> Result<(), Error> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.serialization_failures.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_err() {
            return Ok(());
        }
        pg.execute(
            "DO $$ BEGIN RAISE EXCEPTION 'injected serialization failure (test hook)' USING ERRCODE = '40001'; END $$",
            params![],
        )
        .map(drop)
    }

    pub(super) fn read<T>(&self, work: &mut dyn FnMut(&dyn Conn) -> Result<T, Error>) -> Result<T, Error> {
        let mut conn = self.connection()?;
        let PgConnection { client, statements, broken } = &mut *conn;
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(|e| forget_if_gone(broken, plain_error(e)))?;
        let pg = PgTx::new(tx, statements, &self.hooks);
        work(&pg).and_then(|value| pg.commit().map(|()| value)).map_err(|e| forget_if_gone(broken, e))
    }

    pub(super) fn storage_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.storage_ok)
    }

    /// `/healthz`: the schema version and one page of `orders`, on a
    /// pooled connection (the server's state, not a local file, is what
    /// can go wrong here).
    pub(super) fn check_health(&self) -> Result<(), Error> {
        let unavailable = |e: Error| Error::new(ErrorKind::DatabaseUnavailable, e.message);
        self.read(&mut |conn| {
            let tx = ReadTx { conn };
            let version =
                tx.one("SELECT coalesce(max(version), 0) FROM payonce_schema_version", params![], |r| r.int(0))?;
            if version != SCHEMA_VERSION {
                return Err(Error::internal(format!(
                    "the database's schema version is {version}, not {SCHEMA_VERSION}"
                )));
            }
            tx.read_health_page()
        })
        .map_err(|e| if e.kind == ErrorKind::Internal { unavailable(e) } else { e })
    }

    #[cfg(any(test, feature = "test-support"))]
    /// See [`crate::store::Store::count_raw`].
    pub(super) fn count_raw(&self, sql: &str) -> Result<i64, String> {
        let mut conn = self.pool.get().map_err(|e| e.to_string())?;
        let row = conn.client.query_one(sql, &[]).map_err(|e| message_of(&e))?;
        let cells = cells_of(&row).map_err(|e| e.message)?;
        match cells.as_slice() {
            [Cell::Int(v)] => Ok(*v),
            other => Err(format!("expected one integer, got {other:?}")),
        }
    }

    #[cfg(any(test, feature = "test-support"))]
    /// See [`crate::store::Store::execute_raw`].
    pub(super) fn execute_raw(&self, sql: &str) -> Result<u64, String> {
        let mut conn = self.pool.get().map_err(|e| e.to_string())?;
        conn.client.execute(sql, &[]).map_err(|e| message_of(&e))
    }
}

/// The query methods' view of one PostgreSQL transaction.
struct PgTx<'a> {
    tx: RefCell<Option<Transaction<'a>>>,
    statements: RefCell<&'a mut HashMap<&'static str, Statement>>,
    hooks: &'a Hooks,
    /// Set when a statement failed with a serialization failure or a
    /// deadlock: the whole transaction may be run again.
    conflict: Flag<bool>,
}

impl<'a> PgTx<'a> {
    fn new(tx: Transaction<'a>, statements: &'a mut HashMap<&'static str, Statement>, hooks: &'a Hooks) -> PgTx<'a> {
        PgTx { tx: RefCell::new(Some(tx)), statements: RefCell::new(statements), hooks, conflict: Flag::new(false) }
    }

    fn commit(&self) -> Result<(), Error> {
        let tx = self.tx.borrow_mut().take().ok_or_else(|| Error::internal("transaction already ended"))?;
        tx.commit().map_err(|e| self.error(e))
    }

    fn statement(&self, tx: &mut Transaction<'a>, sql: &'static str) -> Result<Statement, Error> {
        let mut statements = self.statements.borrow_mut();
        if let Some(statement) = statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = tx.prepare(&postgres_sql(sql)).map_err(|e| self.error(e))?;
        statements.insert(sql, statement.clone());
        Ok(statement)
    }

    fn error(&self, err: postgres::Error) -> Error {
        let code = err.code();
        if code == Some(&SqlState::T_R_SERIALIZATION_FAILURE) || code == Some(&SqlState::T_R_DEADLOCK_DETECTED) {
            self.conflict.set(true);
            return Error::database_busy();
        }
        if code == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            return Error::database_busy();
        }
        plain_error(err)
    }
}

impl Conn for PgTx<'_> {
    fn execute(&self, sql: &'static str, params: &[Param]) -> Result<usize, Error> {
        let mut guard = self.tx.borrow_mut();
        let tx = guard.as_mut().ok_or_else(|| Error::internal("transaction already ended"))?;
        let statement = self.statement(tx, sql)?;
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        let changed = tx.execute(&statement, &values).map_err(|e| self.error(e))?;
        usize::try_from(changed).map_err(|_| Error::internal("affected-row count out of range"))
    }

    fn query_each(
        &self,
        sql: &'static str,
        params: &[Param],
        each: &mut dyn FnMut(Row) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let rows = {
            let mut guard = self.tx.borrow_mut();
            let tx = guard.as_mut().ok_or_else(|| Error::internal("transaction already ended"))?;
            let statement = self.statement(tx, sql)?;
            let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
            tx.query(&statement, &values).map_err(|e| self.error(e))?
        };
        for row in &rows {
            each(Row(cells_of(row)?))?;
        }
        Ok(())
    }

    fn stale_read(&self, what: &str) -> Error {
        crate::log::info("write transaction will re-run: its read was overtaken", &[("why", &what)]);
        self.conflict.set(true);
        Error::database_busy()
    }

    fn hold_key(&self, text: &str) -> Result<(), Error> {
        self.execute("SELECT pg_advisory_xact_lock(?1)", params![lock_key(text)]).map(drop)
    }

    fn before_event_insert(&self) -> Result<(), Error> {
        if self.hooks.naive_outbox {
            return Ok(());
        }
        self.execute("SELECT pg_advisory_xact_lock(?1)", params![lock_key(OUTBOX_LOCK)]).map(drop)
    }

    fn after_event_insert(&self) {
        if let Some(hold) = self.hooks.hold_after_event {
            std::thread::sleep(hold);
        }
    }
}

fn cells_of(row: &postgres::Row) -> Result<Vec<Cell>, Error> {
    let read = |e: postgres::Error| Error::internal(format!("cannot read a column: {e}"));
    let mut cells = Vec::with_capacity(row.len());
    for (i, column) in row.columns().iter().enumerate() {
        let ty = column.type_();
        let cell = if *ty == Type::INT8 {
            row.try_get::<_, Option<i64>>(i).map_err(read)?.map_or(Cell::Null, Cell::Int)
        } else if *ty == Type::INT4 {
            row.try_get::<_, Option<i32>>(i).map_err(read)?.map_or(Cell::Null, |v| Cell::Int(i64::from(v)))
        } else if *ty == Type::INT2 {
            row.try_get::<_, Option<i16>>(i).map_err(read)?.map_or(Cell::Null, |v| Cell::Int(i64::from(v)))
        } else if *ty == Type::BOOL {
            row.try_get::<_, Option<bool>>(i).map_err(read)?.map_or(Cell::Null, |v| Cell::Int(i64::from(v)))
        } else if [Type::TEXT, Type::VARCHAR, Type::BPCHAR, Type::NAME].contains(ty) {
            row.try_get::<_, Option<String>>(i).map_err(read)?.map_or(Cell::Null, Cell::Text)
        } else if *ty == Type::BYTEA {
            row.try_get::<_, Option<Vec<u8>>>(i).map_err(read)?.map_or(Cell::Null, Cell::Blob)
        } else if *ty == Type::VOID {
            Cell::Null
        } else {
            return Err(Error::internal(format!("column {} has the unexpected type {ty}", column.name())));
        };
        cells.push(cell);
    }
    Ok(cells)
}

impl ToSql for Param<'_> {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match *self {
            Param::Null => Ok(IsNull::Yes),
            Param::Int(v) if *ty == Type::INT8 => v.to_sql(ty, out),
            Param::Int(v) if *ty == Type::INT4 => i32::try_from(v)?.to_sql(ty, out),
            Param::Int(v) if *ty == Type::INT2 => i16::try_from(v)?.to_sql(ty, out),
            Param::Text(v) if [Type::TEXT, Type::VARCHAR, Type::BPCHAR, Type::NAME, Type::UNKNOWN].contains(ty) => {
                v.to_sql(ty, out)
            }
            Param::Blob(v) if *ty == Type::BYTEA => v.to_sql(ty, out),
            other => Err(format!("{other:?} cannot be bound to a {ty} parameter").into()),
        }
    }

    fn accepts(_: &Type) -> bool {
        // Checked per value in to_sql: one parameter type for every column type.
        true
    }

    postgres::types::to_sql_checked!();
}

/// The server's message (a trigger's RAISE text, a constraint's name), else
/// the client's error.
fn message_of(err: &postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => db.message().to_owned(),
        None => err.to_string(),
    }
}

/// `err` and every error under it ("error performing TLS handshake: invalid
/// peer certificate: UnknownIssuer"), so a refused start says why.
fn with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(e) = cause {
        let more = e.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = e.source();
    }
    text
}

/// Whether `err` means the connection or the server is gone rather than
/// that this statement was refused: then the request is 503
/// `database_unavailable` (docs/postgres.md, "When the database goes
/// away") and the connection leaves the pool.
fn connection_gone(err: &postgres::Error) -> bool {
    if err.is_closed() {
        return true;
    }
    match err.as_db_error() {
        Some(db) => gone(db.code(), db.parsed_severity()),
        // No answer from the server at all: an I/O error, a broken
        // protocol exchange.
        None => true,
    }
}

/// SQLSTATE classes 08 (connection exception) and 57 (operator
/// intervention: admin_shutdown on `pg_ctl restart -m fast`,
/// `pg_terminate_backend` or a postmaster that died; crash_shutdown;
/// cannot_connect_now ...), 53300 too_many_connections, and any FATAL or
/// PANIC error, after which the server closes the session whatever its
/// code. `severity` is the unlocalized one (PostgreSQL 9.6+).
fn gone(code: &SqlState, severity: Option<Severity>) -> bool {
    let class = code.code().get(..2);
    class == Some("08")
        || class == Some("57")
        || *code == SqlState::TOO_MANY_CONNECTIONS
        || matches!(severity, Some(Severity::Fatal | Severity::Panic))
}

/// Marks the connection for the pool to drop when `err` says it is gone.
fn forget_if_gone(broken: &Flag<bool>, err: Error) -> Error {
    if err.kind == ErrorKind::DatabaseUnavailable {
        broken.set(true);
    }
    err
}

/// An error outside a write body's conflicts (which [`PgTx::error`] sorts
/// first): a connection or server gone is `database_unavailable`, anything
/// else the server refused is payonce's own fault.
fn plain_error(err: postgres::Error) -> Error {
    if connection_gone(&err) {
        return Error::new(
            ErrorKind::DatabaseUnavailable,
            format!("the database connection was lost ({}); retry shortly", message_of(&err)),
        );
    }
    Error::internal(format!("database error: {}", message_of(&err)))
}

impl From<r2d2::Error> for Error {
    fn from(err: r2d2::Error) -> Error {
        // The pool timed out waiting for a connection while the server
        // accepts them: it is saturated. (PostgreSQL's engine tells an
        // unreachable server apart, see PostgresEngine::connection.)
        Error::new(ErrorKind::DatabaseBusy, format!("no database connection available: {err}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_appear_in_a_shown_url() {
        assert_eq!(
            redact_url("postgres://payonce:s3cret@db.example:5432/pay"),
            "postgres://payonce:***@db.example:5432/pay"
        );
        assert_eq!(redact_url("postgresql://payonce@db/pay"), "postgresql://payonce@db/pay");
        assert_eq!(
            redact_url("postgres://db/pay?user=payonce&password=s3cret&sslmode=disable"),
            "postgres://db/pay?user=payonce&password=***&sslmode=disable"
        );
        assert_eq!(redact_url("postgres://u:p%40ss@h/d"), "postgres://u:***@h/d");
    }

    #[test]
    fn placeholders_become_dollar_numbers() {
        assert_eq!(postgres_sql("SELECT ?1, ?2 WHERE a = ?10"), "SELECT $1, $2 WHERE a = $10");
    }

    #[test]
    fn a_connection_or_server_gone_is_told_from_a_refused_statement() {
        use Severity::{Error as Refused, Fatal};
        for code in [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::DATABASE_DROPPED,
            SqlState::IDLE_SESSION_TIMEOUT,
            SqlState::QUERY_CANCELED,
            SqlState::CONNECTION_EXCEPTION,
            SqlState::CONNECTION_FAILURE,
            SqlState::SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
            SqlState::PROTOCOL_VIOLATION,
            SqlState::TOO_MANY_CONNECTIONS,
        ] {
            assert!(gone(&code, Some(Refused)), "{}", code.code());
            assert!(gone(&code, None), "{}", code.code());
        }
        for code in [
            SqlState::UNIQUE_VIOLATION,
            SqlState::RAISE_EXCEPTION,
            SqlState::CHARACTER_NOT_IN_REPERTOIRE,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::DISK_FULL,
            SqlState::IN_FAILED_SQL_TRANSACTION,
        ] {
            assert!(!gone(&code, Some(Refused)), "{}", code.code());
            assert!(!gone(&code, None), "{}", code.code());
        }
        // The server ends the session after any FATAL, whatever its code.
        assert!(gone(&SqlState::INVALID_PASSWORD, Some(Fatal)));
        assert!(gone(&SqlState::INTERNAL_ERROR, Some(Severity::Panic)));
    }

    #[test]
    fn lock_keys_are_stable_and_distinct() {
        assert_eq!(lock_key("pay:P1"), lock_key("pay:P1"));
        assert_ne!(lock_key("pay:P1"), lock_key("pay:P2"));
        assert_ne!(lock_key(OUTBOX_LOCK), lock_key(SCHEMA_LOCK));
    }
}
