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
    params, Cell, Conn, Param, ReadTx, Row, StoreOptions, POSTGRES_MIGRATIONS, POSTGRES_SCHEMA_VERSION_FIRST,
    SCHEMA_POSTGRES_SQL, SCHEMA_VERSION, WRITE_ATTEMPTS_MAX,
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// [`Manager::generation`], raised when a connection is found gone.
    generation: Arc<AtomicU64>,
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
    /// [`Manager::generation`] when it was opened.
    generation: u64,
}

struct Manager {
    inner: Connector,
    /// Session settings every new connection gets.
    session: String,
    /// Whether the last attempt to open a connection succeeded: a pool
    /// that times out while the server refuses connections is
    /// `database_unavailable`, one that is merely full is `database_busy`.
    reachable: Arc<AtomicBool>,
    /// Raised past a connection's own generation when that connection is
    /// found gone (the server restarted, failed over, or is cut off): the
    /// pool then drops every connection opened before, without a round
    /// trip on each (one on a cut-off host waits out the TCP timeouts).
    generation: Arc<AtomicU64>,
}

/// Why the pool could not hand out a connection.
#[derive(Debug)]
enum PoolError {
    Postgres(postgres::Error),
    /// Opened before a connection of the same pool was found gone.
    Stale,
}

impl std::fmt::Display for PoolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolError::Postgres(e) => e.fmt(f),
            PoolError::Stale => f.write_str("connection opened before the database connection was lost"),
        }
    }
}

impl std::error::Error for PoolError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PoolError::Postgres(e) => e.source(),
            PoolError::Stale => None,
        }
    }
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
    type Error = PoolError;

    fn connect(&self) -> Result<PgConnection, PoolError> {
        let generation = self.generation.load(Ordering::SeqCst);
        let connected = self.inner.connect().and_then(|mut client| {
            client.batch_execute(&self.session)?;
            Ok(client)
        });
        self.reachable.store(connected.is_ok(), Ordering::SeqCst);
        let client = connected.map_err(PoolError::Postgres)?;
        Ok(PgConnection { client, statements: HashMap::new(), broken: Flag::new(false), generation })
    }

    fn is_valid(&self, conn: &mut PgConnection) -> Result<(), PoolError> {
        if conn.generation < self.generation.load(Ordering::SeqCst) {
            return Err(PoolError::Stale);
        }
        conn.client.simple_query("").map(drop).map_err(|e| {
            // This one is gone, and so, most likely, is every other opened
            // with it: drop them without a round trip each (on a cut link
            // every round trip waits out the TCP timeouts).
            self.generation.fetch_max(conn.generation + 1, Ordering::SeqCst);
            self.reachable.store(false, Ordering::SeqCst);
            PoolError::Postgres(e)
        })
    }

    fn has_broken(&self, conn: &mut PgConnection) -> bool {
        conn.broken.get() || conn.client.is_closed()
    }
}

/// libpq's connection keywords: a `--db` whose first word is one of them
/// followed by `=` is the key-value form ([`is_key_value`]).
const KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslnegotiation",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
];

/// Keywords whose value is never printed.
fn is_secret(keyword: &str) -> bool {
    keyword == "password" || keyword == "sslpassword"
}

/// Whether `db` is libpq's key-value form (`host=h1,h2 port=5432,5432
/// dbname=payonce user=payonce target_session_attrs=read-write`): its first
/// word is a libpq connection keyword followed by `=` (spaces around the
/// `=` allowed, as libpq allows them). A SQLite file whose name starts
/// that way is still reachable as `./host=...`.
pub fn is_key_value(db: &str) -> bool {
    let rest = db.trim_start();
    let key_end = rest.find(|c: char| c == '=' || c.is_whitespace()).unwrap_or(rest.len());
    let (key, after) = rest.split_at(key_end);
    KEYWORDS.contains(&key) && after.trim_start().starts_with('=')
}

/// `db` (a URL or the key-value form) with every password replaced, for
/// messages and logs: a password given to payonce is never printed.
pub fn redact(db: &str) -> String {
    if is_key_value(db) {
        redact_key_value(db)
    } else {
        redact_url(db)
    }
}

/// The key-value form with the value of every `password` and
/// `sslpassword` replaced by `***`, the rest as written. Values are read
/// as libpq reads them: a single-quoted value with `\'` and `\\` escapes,
/// else up to the next unescaped space. An unterminated quote hides
/// everything after a secret's `=`.
fn redact_key_value(text: &str) -> String {
    let mut shown = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        // Leading spaces, the keyword, the spaces and `=` after it.
        let word_start = rest.len() - rest.trim_start().len();
        let key_len =
            rest[word_start..].find(|c: char| c == '=' || c.is_whitespace()).unwrap_or(rest.len() - word_start);
        let key = &rest[word_start..word_start + key_len];
        let after_key = &rest[word_start + key_len..];
        let eq = after_key.len() - after_key.trim_start().len();
        if !after_key[eq..].starts_with('=') {
            shown.push_str(rest);
            return shown;
        }
        let after_eq = &after_key[eq + 1..];
        let value_start = after_eq.len() - after_eq.trim_start().len();
        let head = word_start + key_len + eq + 1 + value_start;
        let value = &rest[head..];
        let value_len = if let Some(quoted) = value.strip_prefix('\'') {
            let mut escaped = false;
            let mut end = None;
            for (i, c) in quoted.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '\'' => {
                        end = Some(i + 2);
                        break;
                    }
                    _ => {}
                }
            }
            match end {
                Some(end) => end,
                None if is_secret(key) => {
                    shown.push_str(&rest[..head]);
                    shown.push_str("***");
                    return shown;
                }
                None => value.len(),
            }
        } else {
            let mut escaped = false;
            value
                .char_indices()
                .find(|&(_, c)| {
                    let ends = !escaped && c.is_whitespace();
                    escaped = !escaped && c == '\\';
                    ends
                })
                .map_or(value.len(), |(i, _)| i)
        };
        shown.push_str(&rest[..head]);
        shown.push_str(if is_secret(key) { "***" } else { &value[..value_len] });
        rest = &value[value_len..];
        if rest.trim().is_empty() {
            shown.push_str(rest);
            return shown;
        }
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
                .map(|kv| match kv.split_once('=') {
                    Some((key, _)) if is_secret(key) => format!("{key}=***"),
                    _ => kv.to_owned(),
                })
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
        let engine = PostgresEngine::connect(url, options)?;
        engine.apply_schema().map_err(|e| Error::new(e.kind, format!("database {}: {}", redact(url), e.message)))?;
        Ok(engine)
    }

    /// The pool on `url` without touching the schema: `payonce copy-db`
    /// (store/copy.rs) looks at the target before it writes anything.
    pub(super) fn connect(url: &str, options: &StoreOptions) -> Result<PostgresEngine, Error> {
        let shown = redact(url);
        let mut config: postgres::Config =
            url.parse().map_err(|e| Error::internal(format!("cannot parse the database URL {shown}: {e}")))?;
        bound_calls(&mut config, options);
        // lock_timeout bounds the advisory locks as busy_timeout bounds
        // SQLite's writer lock: past it the request is 503 database_busy.
        // statement_timeout bounds every statement on the server's side;
        // idle_in_transaction_session_timeout ends a transaction whose
        // client vanished mid-way (a cut link), so its advisory locks do
        // not outlive it until the server's own keepalives notice.
        let session = format!(
            "SET application_name = 'payonce'; SET lock_timeout = '{}ms'; SET statement_timeout = '{}ms'; \
             SET idle_in_transaction_session_timeout = '{}ms'; SET TIME ZONE 'UTC'",
            options.busy_timeout_ms, options.statement_timeout_ms, options.statement_timeout_ms
        );
        let reachable = Arc::new(AtomicBool::new(true));
        let generation = Arc::new(AtomicU64::new(0));
        let manager = Manager {
            inner: Connector::new(config, &shown)?,
            session,
            reachable: Arc::clone(&reachable),
            generation: Arc::clone(&generation),
        };
        // One connection first, directly: an unreachable server or a refused
        // login fails here at once with its cause (the pool would retry for
        // POOL_WAIT_MS and report a timeout).
        r2d2::ManageConnection::connect(&manager).map_err(|e| {
            Error::new(ErrorKind::DatabaseUnavailable, format!("cannot connect to {shown}: {}", with_causes(&e)))
        })?;
        let pool = r2d2::Pool::builder()
            .max_size(options.pool_size)
            .min_idle(Some(1))
            // A request waits for a pooled connection (which includes opening
            // one, host after host) at most the connect timeout.
            .connection_timeout(Duration::from_millis(options.connect_timeout_ms))
            .build(manager)
            .map_err(|e| Error::internal(format!("cannot open database {shown}: {e}")))?;
        let engine = PostgresEngine {
            pool,
            reachable,
            generation,
            storage_ok: Arc::new(AtomicBool::new(true)),
            hooks: Hooks::from_env(),
            serialization_failures: std::sync::atomic::AtomicU32::new(0),
        };
        Ok(engine)
    }

    /// `work` on a pooled connection's client itself, outside payonce's
    /// write path: `payonce copy-db` (store/copy.rs) loads rows with COPY.
    pub(super) fn with_raw_client<T>(&self, work: &mut dyn FnMut(&mut Client) -> Result<T, Error>) -> Result<T, Error> {
        let mut conn = self.connection()?;
        work(&mut conn.client)
    }

    /// A pooled connection, waiting at most the connect timeout for one.
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
    pub(super) fn apply_schema(&self) -> Result<(), Error> {
        let mut conn = self.connection()?;
        let mut tx = conn.client.transaction().map_err(plain_error)?;
        // A migration of a large table may take longer than a request's
        // statement; the TCP timeouts still bound a host that vanished.
        tx.batch_execute("SET LOCAL statement_timeout = 0").map_err(plain_error)?;
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
            let PgConnection { client, statements, broken, generation } = &mut *conn;
            let forget = |e: Error| self.forget_if_gone(broken, *generation, e);
            let tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::ReadCommitted)
                .start()
                .map_err(|e| forget(plain_error(e)))?;
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
            let result = result.and_then(|value| pg.commit().map(|()| value)).map_err(forget);
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
        let PgConnection { client, statements, broken, generation } = &mut *conn;
        let forget = |e: Error| self.forget_if_gone(broken, *generation, e);
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .map_err(|e| forget(plain_error(e)))?;
        let pg = PgTx::new(tx, statements, &self.hooks);
        work(&pg).and_then(|value| pg.commit().map(|()| value)).map_err(forget)
    }

    /// When `err` says the connection or the server is gone: marks the
    /// connection for the pool to drop, makes every connection opened
    /// before it stale (the pool drops them at their next checkout without
    /// a round trip), and counts the server unreachable until a new
    /// connection succeeds (a pool that times out meanwhile is
    /// `database_unavailable`).
    fn forget_if_gone(&self, broken: &Flag<bool>, generation: u64, err: Error) -> Error {
        if err.kind == ErrorKind::DatabaseUnavailable {
            broken.set(true);
            self.generation.fetch_max(generation + 1, Ordering::SeqCst);
            self.reachable.store(false, Ordering::SeqCst);
        }
        err
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
/// Not 57014 query_canceled at ERROR severity: a statement that ran past
/// `statement_timeout` (or was cancelled) leaves its session healthy, so
/// the pool keeps it and the others ([`canceled_error`]).
fn gone(code: &SqlState, severity: Option<Severity>) -> bool {
    let class = code.code().get(..2);
    let fatal = matches!(severity, Some(Severity::Fatal | Severity::Panic));
    fatal
        || class == Some("08")
        || (class == Some("57") && *code != SqlState::QUERY_CANCELED)
        || *code == SqlState::TOO_MANY_CONNECTIONS
}

/// A statement the server cancelled, on a connection that stays usable:
/// one that ran past `--db-statement-timeout-ms`, or an operator's
/// `pg_cancel_backend`. 503 `database_busy` with `Retry-After`: nothing of
/// the transaction committed, and a retry with the same business key is safe.
fn canceled_error(err: &postgres::Error) -> Option<Error> {
    let db = err.as_db_error()?;
    (*db.code() == SqlState::QUERY_CANCELED && !gone(db.code(), db.parsed_severity())).then(|| {
        Error::new(
            ErrorKind::DatabaseBusy,
            format!("the database cancelled a statement ({}); retry shortly", db.message()),
        )
    })
}

/// The connect timeout, TCP keepalives and `TCP_USER_TIMEOUT` from
/// `options`, where the URL does not set them itself: a connection attempt
/// to a host that does not answer ends after the connect timeout (then the
/// next host is tried), and a call on a connection whose host vanished
/// (a cut link, a dead machine) fails within about the statement timeout
/// instead of waiting for the kernel's default of minutes to hours. A
/// server that answers but runs long is bounded by `statement_timeout`.
fn bound_calls(config: &mut postgres::Config, options: &StoreOptions) {
    let statement = Duration::from_millis(options.statement_timeout_ms);
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_millis(options.connect_timeout_ms));
    }
    // Data sent and not acknowledged for this long closes the socket; on
    // Linux it also ends keepalive probing that gets no answer. Always the
    // flag's: the crate reads a URL's `tcp_user_timeout` in seconds where
    // libpq reads milliseconds, so one written for libpq would be 1000
    // times too long.
    config.tcp_user_timeout(statement);
    // The crate's default is the kernel's two hours: a connection waiting
    // for an answer from a host that is gone probes after half the
    // statement timeout (at least a second, the kernel's unit), then every
    // second.
    if config.get_keepalives() && config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle((statement / 2).max(Duration::from_secs(1)));
        if config.get_keepalives_interval().is_none() {
            config.keepalives_interval(Duration::from_secs(1));
        }
        if config.get_keepalives_retries().is_none() {
            let retries = (statement / 2).as_secs().clamp(1, 10);
            config.keepalives_retries(u32::try_from(retries).unwrap_or(1));
        }
    }
}

/// An error outside a write body's conflicts (which [`PgTx::error`] sorts
/// first): a connection or server gone is `database_unavailable`, anything
/// else the server refused is payonce's own fault.
fn plain_error(err: postgres::Error) -> Error {
    if let Some(canceled) = canceled_error(&err) {
        return canceled;
    }
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
    fn passwords_never_appear_in_a_shown_key_value_string_or_multi_host_url() {
        assert_eq!(
            redact("postgres://payonce:s3cret@h1:5432,h2:5432/pay?target_session_attrs=read-write"),
            "postgres://payonce:***@h1:5432,h2:5432/pay?target_session_attrs=read-write"
        );
        assert_eq!(
            redact("postgres://h1,h2/pay?user=u&sslpassword=k3y&password=s3cret"),
            "postgres://h1,h2/pay?user=u&sslpassword=***&password=***"
        );
        assert_eq!(
            redact("host=h1,h2 port=5432,5432 dbname=pay user=payonce password=s3cret target_session_attrs=read-write"),
            "host=h1,h2 port=5432,5432 dbname=pay user=payonce password=*** target_session_attrs=read-write"
        );
        assert_eq!(redact("password = 's3 \\'cret' host=h"), "password = *** host=h");
        assert_eq!(redact("host=h password=s3\\ cret dbname=d"), "host=h password=*** dbname=d");
        assert_eq!(redact("host=h sslpassword='k3y'"), "host=h sslpassword=***");
        // An unterminated quote: everything after the secret's `=` is hidden.
        assert_eq!(redact("host=h password='s3cret dbname=d"), "host=h password=***");
        assert_eq!(redact("host=h  dbname=d "), "host=h  dbname=d ");
        assert_eq!(redact("host=h garbage"), "host=h garbage");
        for text in ["host=h password=s3cret", "password='s3cret", "host=h password =s3cret", "password=\\s3cret"] {
            assert!(!redact(text).contains("s3cret"), "{text}");
        }
    }

    #[test]
    fn the_key_value_form_is_told_from_a_file_name() {
        for db in [
            "host=h1,h2 port=5432,5432 dbname=payonce user=payonce target_session_attrs=read-write",
            "dbname=payonce",
            "  user = payonce host=/run/postgresql",
            "service=payonce",
        ] {
            assert!(is_key_value(db), "{db}");
        }
        for db in ["payonce.db", "./host=h1", "data/host=x.db", "colour=blue", ":memory:", "", "host", "host h=1"] {
            assert!(!is_key_value(db), "{db}");
        }
    }

    #[test]
    fn the_timeouts_bound_connects_and_calls() {
        let options =
            StoreOptions { connect_timeout_ms: 1_500, statement_timeout_ms: 4_000, ..StoreOptions::default() };
        let mut config: postgres::Config = "host=h1,h2 dbname=d target_session_attrs=read-write".parse().unwrap();
        bound_calls(&mut config, &options);
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(config.get_target_session_attrs(), postgres::config::TargetSessionAttrs::ReadWrite);
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_millis(1_500)));
        assert_eq!(config.get_tcp_user_timeout(), Some(&Duration::from_millis(4_000)));
        assert!(config.get_keepalives());
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(2));
        assert_eq!(config.get_keepalives_interval(), Some(Duration::from_secs(1)));
        assert_eq!(config.get_keepalives_retries(), Some(2));

        let mut config: postgres::Config =
            "postgres://u@h1,h2/d?connect_timeout=9&tcp_user_timeout=7000&keepalives_idle=30".parse().unwrap();
        bound_calls(&mut config, &options);
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_secs(9)));
        assert_eq!(config.get_tcp_user_timeout(), Some(&Duration::from_millis(4_000)));
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(30));
    }

    #[test]
    fn placeholders_become_dollar_numbers() {
        assert_eq!(postgres_sql("SELECT ?1, ?2 WHERE a = ?10"), "SELECT $1, $2 WHERE a = $10");
    }

    #[test]
    fn a_cancelled_statement_leaves_its_connection_unless_the_session_ends() {
        assert!(!gone(&SqlState::QUERY_CANCELED, Some(Severity::Error)), "statement_timeout: the session lives");
        assert!(!gone(&SqlState::QUERY_CANCELED, None));
        assert!(gone(&SqlState::QUERY_CANCELED, Some(Severity::Fatal)), "a FATAL ends the session whatever its code");
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
