//! `payonce copy-db`: a SQLite ledger copied into an empty PostgreSQL
//! database, every row as it was (ids, states, timestamps, the outbox's
//! seqs), checked by row counts and a checksum per table (docs/postgres.md,
//! "Moving from SQLite").
//!
//! The schema refuses such rows from live writes (an order is born PENDING,
//! a coupon is issued ACTIVE, a succeeded refund adds to its order), so the
//! copy runs in one PostgreSQL transaction that disables each table's own
//! triggers with `ALTER TABLE .. DISABLE TRIGGER USER`, loads the rows with
//! `COPY .. FROM STDIN`, and enables the triggers again before it commits.
//! `ALTER TABLE` holds each table's ACCESS EXCLUSIVE lock until then, so no
//! other session ever sees a table without its guards; CHECKs, unique keys
//! and foreign keys stay in force throughout and check every copied row.
//! After the commit the copy reads the catalogue back and fails loudly if
//! any trigger is not enabled.

use super::postgres::PostgresEngine;
use super::sqlite::SqliteEngine;
use super::{StoreOptions, SCHEMA_VERSION};
use crate::error::Error;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::Path;

/// Every table of the schema, parents before the tables that refer to them.
/// A table of the source that is not here stops the copy: a table added to
/// the schema must be added here too (tests/it/copy_db.rs copies them all).
pub const COPIED_TABLES: &[&str] = &[
    "orders",
    "pay_callback_log",
    "refund",
    "user_coupon",
    "point_log",
    "outbox_event",
    "idempotency_key",
    "audit_log",
    "settings",
    "webhook_endpoint",
    "webhook_delivery",
    "platform_call",
];

/// What one table's copy found: its rows and their checksum, equal on both
/// sides (the copy fails otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableCopied {
    pub table: &'static str,
    pub rows: u64,
    /// SHA-256 over the rows in primary-key order, each column typed as the
    /// PostgreSQL column is, hex.
    pub checksum: String,
}

/// The copy's result: the schema version both sides have, and each table.
#[derive(Debug, Clone)]
pub struct CopyReport {
    pub schema_version: i64,
    pub tables: Vec<TableCopied>,
    /// User triggers found enabled on the target after the commit.
    pub triggers_enabled: u64,
}

/// A column of a copied table, as PostgreSQL declares it.
struct Column {
    name: String,
    kind: ColumnKind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ColumnKind {
    Integer,
    Text,
    Bytes,
}

/// One value, typed by its PostgreSQL column, as both sides hash it.
enum Cell {
    Null,
    Integer(i64),
    Text(String),
    Bytes(Vec<u8>),
}

/// Copies the SQLite database `from` into the empty PostgreSQL database
/// `to`. A source at an older schema version is migrated on a temporary
/// copy first (the file itself is only read); a newer one is refused, as is
/// a target holding any row. `progress` hears each table once it is loaded.
pub fn copy_sqlite_to_postgres(
    from: &Path,
    to: &str,
    options: &StoreOptions,
    progress: &mut dyn FnMut(&TableCopied),
) -> Result<CopyReport, Error> {
    if !from.is_file() {
        return Err(Error::invalid(format!("--from {}: no such file", from.display())));
    }
    let source_version = {
        let conn = open_read_only(from)?;
        schema_version_of(&conn, from)?
    };
    if source_version > SCHEMA_VERSION {
        return Err(Error::invalid(format!(
            "{} is at schema version {source_version}, newer than this payonce ({SCHEMA_VERSION}): copy it with the payonce that wrote it",
            from.display()
        )));
    }
    // An older source is brought to this schema on a copy, never in place.
    let migrated = if source_version < SCHEMA_VERSION { Some(migrated_copy(from, options)?) } else { None };
    let source_path = migrated.as_ref().map_or(from, |dir| dir.file.as_path());
    let source = open_read_only(source_path)?;

    // Nothing is written to a target that is refused: it is looked at
    // before the schema is applied.
    let target = PostgresEngine::connect(to, options)?;
    target.with_raw_client(&mut |client| refuse_a_used_target(client))?;
    target.apply_schema()?;
    target.with_raw_client(&mut |client| copy_into(&source, client, progress))
}

/// The target's current schema holds no relation at all, or exactly
/// payonce's tables at this version (a payonce that started on it once,
/// whose rows the copy counts in its transaction). Anything else, another
/// application's tables or an older payonce schema, is refused as is.
fn refuse_a_used_target(client: &mut postgres::Client) -> Result<(), Error> {
    let rows = client
        .query(
            "SELECT c.relname::text FROM pg_class c
             WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
             ORDER BY 1",
            &[],
        )
        .map_err(pg_error)?;
    let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    if names.is_empty() {
        return Ok(());
    }
    let mut payonce: Vec<&str> = COPIED_TABLES.to_vec();
    payonce.push("payonce_schema_version");
    payonce.sort_unstable();
    if names.iter().map(String::as_str).eq(payonce.iter().copied()) {
        let version: i64 = client
            .query_one("SELECT coalesce(max(version), 0) FROM payonce_schema_version", &[])
            .map_err(pg_error)?
            .get(0);
        if version == SCHEMA_VERSION {
            return Ok(());
        }
        return Err(Error::invalid(format!(
            "the target database holds a payonce schema at version {version}, not {SCHEMA_VERSION}: copy-db fills only an empty database"
        )));
    }
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    Err(Error::invalid(format!(
        "the target database is not empty ({} tables, e.g. {}): copy-db fills only an empty database",
        names.len(),
        shown.join(", ")
    )))
}

/// The copy itself, on the target's connection: one transaction, then the
/// check that the guards are back.
fn copy_into(
    source: &Connection,
    client: &mut postgres::Client,
    progress: &mut dyn FnMut(&TableCopied),
) -> Result<CopyReport, Error> {
    let mut tx = client.transaction().map_err(pg_error)?;
    // A large table's COPY takes longer than a request's statement may
    // (--db-statement-timeout-ms); the TCP timeouts still bound a lost host.
    tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL idle_in_transaction_session_timeout = 0")
        .map_err(pg_error)?;
    // One snapshot of the source for every table.
    source.execute_batch("BEGIN").map_err(Error::from)?;
    check_tables_match(source)?;
    for table in COPIED_TABLES {
        let rows: i64 = tx.query_one(&format!("SELECT count(*) FROM {table}"), &[]).map_err(pg_error)?.get(0);
        // A fresh schema's one row: the mode setting, `normal`.
        let fresh_rows = if *table == "settings" {
            tx.query_one("SELECT count(*) FROM settings WHERE name = 'mode' AND value = 'normal'", &[])
                .map_err(pg_error)?
                .get::<_, i64>(0)
        } else {
            0
        };
        if rows != fresh_rows {
            return Err(Error::invalid(format!(
                "the target database is not empty ({table} has {rows} rows): copy-db fills only an empty database"
            )));
        }
    }
    tx.batch_execute("DELETE FROM settings").map_err(pg_error)?;

    let mut tables = Vec::new();
    for table in COPIED_TABLES {
        let columns = columns_of(&mut tx, table)?;
        let key = primary_key_of(&mut tx, table)?;
        tx.batch_execute(&format!("ALTER TABLE {table} DISABLE TRIGGER USER")).map_err(pg_error)?;
        let names = columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ");
        let select = format!("SELECT {names} FROM {table} ORDER BY {}", key.join(", "));
        // Text keys in byte order on PostgreSQL too, as SQLite's BINARY.
        let text_key = |k: &String| columns.iter().any(|c| &c.name == k && c.kind == ColumnKind::Text);
        let pg_order: Vec<String> =
            key.iter().map(|k| if text_key(k) { format!("{k} COLLATE \"C\"") } else { k.clone() }).collect();
        let select_back = format!("SELECT {names} FROM {table} ORDER BY {}", pg_order.join(", "));
        let mut source_hash = Sha256::new();
        let mut rows = 0u64;
        {
            let mut writer = tx.copy_in(&format!("COPY {table} ({names}) FROM STDIN")).map_err(pg_error)?;
            let mut statement = source.prepare(&select).map_err(Error::from)?;
            let mut cursor = statement.query([]).map_err(Error::from)?;
            let mut line = Vec::new();
            while let Some(row) = cursor.next().map_err(Error::from)? {
                line.clear();
                for (i, column) in columns.iter().enumerate() {
                    let cell = sqlite_cell(row.get_ref(i).map_err(Error::from)?, column, table)?;
                    hash_cell(&mut source_hash, &cell);
                    if i > 0 {
                        line.push(b'\t');
                    }
                    copy_text(&mut line, &cell);
                }
                line.push(b'\n');
                writer.write_all(&line).map_err(|e| Error::internal(format!("copying {table}: {e}")))?;
                rows += 1;
            }
            writer.finish().map_err(|e| Error::internal(format!("copying {table}: {}", pg_message(&e))))?;
        }
        tx.batch_execute(&format!("ALTER TABLE {table} ENABLE TRIGGER USER")).map_err(pg_error)?;
        // Read back what PostgreSQL holds, in the same order and form.
        let mut target_hash = Sha256::new();
        let mut target_rows = 0u64;
        for row in tx.query(&select_back, &[]).map_err(pg_error)? {
            for (i, column) in columns.iter().enumerate() {
                let cell = match column.kind {
                    ColumnKind::Integer if *row.columns()[i].type_() == postgres::types::Type::INT4 => {
                        row.get::<_, Option<i32>>(i).map_or(Cell::Null, |v| Cell::Integer(i64::from(v)))
                    }
                    ColumnKind::Integer => row.get::<_, Option<i64>>(i).map_or(Cell::Null, Cell::Integer),
                    ColumnKind::Text => row.get::<_, Option<String>>(i).map_or(Cell::Null, Cell::Text),
                    ColumnKind::Bytes => row.get::<_, Option<Vec<u8>>>(i).map_or(Cell::Null, Cell::Bytes),
                };
                hash_cell(&mut target_hash, &cell);
            }
            target_rows += 1;
        }
        let (source_sum, target_sum) = (hex(&source_hash.finalize()), hex(&target_hash.finalize()));
        if (rows, &source_sum) != (target_rows, &target_sum) {
            return Err(Error::internal(format!(
                "{table}: the source has {rows} rows (checksum {source_sum}), the target read back {target_rows} ({target_sum}); nothing was committed"
            )));
        }
        let copied = TableCopied { table, rows, checksum: source_sum };
        progress(&copied);
        tables.push(copied);
    }
    // The identities go on after the copied ids and seqs (the outbox's seq
    // after SQLite's AUTOINCREMENT counter, which never goes back).
    for table in COPIED_TABLES {
        for column in identity_columns_of(&mut tx, table)? {
            let mut next: i64 = source
                .query_row(&format!("SELECT coalesce(max({column}), 0) FROM {table}"), [], |r| r.get(0))
                .map_err(Error::from)?;
            let counter: Option<i64> =
                source.query_row("SELECT seq FROM sqlite_sequence WHERE name = ?1", [table], |r| r.get(0)).ok();
            next = next.max(counter.unwrap_or(0));
            if next > 0 {
                tx.execute(&format!("SELECT setval(pg_get_serial_sequence('{table}', '{column}'), $1)"), &[&next])
                    .map_err(pg_error)?;
            }
        }
    }
    tx.commit().map_err(pg_error)?;
    source.execute_batch("COMMIT").map_err(Error::from)?;

    // The guards are back: every user trigger of the copied tables enabled.
    let disabled: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
             WHERE NOT t.tgisinternal AND c.relnamespace = current_schema()::regnamespace AND t.tgenabled <> 'O'",
            &[],
        )
        .map_err(pg_error)?
        .get(0);
    if disabled > 0 {
        return Err(Error::internal(format!("{disabled} triggers are not enabled on the target after the copy")));
    }
    let enabled: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
             WHERE NOT t.tgisinternal AND c.relnamespace = current_schema()::regnamespace",
            &[],
        )
        .map_err(pg_error)?
        .get(0);
    Ok(CopyReport { schema_version: SCHEMA_VERSION, tables, triggers_enabled: enabled as u64 })
}

fn open_read_only(path: &Path) -> Result<Connection, Error> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    Connection::open_with_flags(path, flags)
        .map_err(|e| Error::invalid(format!("cannot open {} as SQLite: {e}", path.display())))
}

fn schema_version_of(conn: &Connection, path: &Path) -> Result<i64, Error> {
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| Error::invalid(format!("{} is not a SQLite database: {e}", path.display())))?;
    let has_orders: bool = conn
        .query_row("SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'orders'", [], |r| r.get(0))
        .map_err(Error::from)?;
    if version < 1 || !has_orders {
        return Err(Error::invalid(format!("{} is not a payonce database", path.display())));
    }
    Ok(version)
}

/// A temporary copy of an older source, migrated to this schema by opening
/// it as payonce does; removed when dropped.
struct MigratedCopy {
    dir: std::path::PathBuf,
    file: std::path::PathBuf,
}

impl Drop for MigratedCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn migrated_copy(from: &Path, options: &StoreOptions) -> Result<MigratedCopy, Error> {
    let dir = std::env::temp_dir().join(format!("payonce-copy-db-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::internal(format!("creating {}: {e}", dir.display())))?;
    let copy = MigratedCopy { file: dir.join("source.db"), dir };
    {
        let source = open_read_only(from)?;
        let mut dest = Connection::open(&copy.file).map_err(Error::from)?;
        // The whole file in one step: one consistent snapshot of it.
        let backup = rusqlite::backup::Backup::new(&source, &mut dest).map_err(Error::from)?;
        backup.run_to_completion(i32::MAX, std::time::Duration::from_millis(10), None).map_err(Error::from)?;
    }
    let path = copy.file.to_str().ok_or_else(|| Error::internal("a temporary path that is not UTF-8"))?;
    drop(SqliteEngine::open(path, options)?);
    Ok(copy)
}

/// The source has exactly the tables this copy knows (SQLite's own and
/// none other).
fn check_tables_match(source: &Connection) -> Result<(), Error> {
    let mut statement = source
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name")
        .map_err(Error::from)?;
    let names = statement
        .query_map([], |r| r.get::<_, String>(0))
        .map_err(Error::from)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(Error::from)?;
    for name in &names {
        if !COPIED_TABLES.contains(&name.as_str()) {
            return Err(Error::internal(format!("the source has a table copy-db does not know: {name}")));
        }
    }
    for table in COPIED_TABLES {
        if !names.iter().any(|n| n == table) {
            return Err(Error::internal(format!("the source has no table {table}")));
        }
    }
    Ok(())
}

fn columns_of(tx: &mut postgres::Transaction<'_>, table: &str) -> Result<Vec<Column>, Error> {
    let rows = tx
        .query(
            "SELECT column_name::text, data_type::text FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = $1 AND is_generated = 'NEVER'
             ORDER BY ordinal_position",
            &[&table],
        )
        .map_err(pg_error)?;
    rows.iter()
        .map(|row| {
            let (name, data_type): (String, String) = (row.get(0), row.get(1));
            let kind = match data_type.as_str() {
                "bigint" | "integer" | "smallint" => ColumnKind::Integer,
                "text" => ColumnKind::Text,
                "bytea" => ColumnKind::Bytes,
                other => {
                    return Err(Error::internal(format!(
                        "{table}.{name}: a column of type {other} copy-db does not know"
                    )))
                }
            };
            Ok(Column { name, kind })
        })
        .collect()
}

/// The columns that order a table's rows on both sides: its primary key,
/// else its first unique key of plain columns (idempotency_key's
/// uk_scope_key).
fn primary_key_of(tx: &mut postgres::Transaction<'_>, table: &str) -> Result<Vec<String>, Error> {
    let rows = tx
        .query(
            "SELECT i.indexrelid::regclass::text, a.attname::text FROM pg_index i
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
             WHERE i.indrelid = $1::text::regclass AND i.indisunique AND i.indexprs IS NULL AND i.indpred IS NULL
             ORDER BY i.indisprimary DESC, i.indexrelid::regclass::text,
                      array_position(i.indkey::int2[], a.attnum)",
            &[&table],
        )
        .map_err(pg_error)?;
    let first: Option<String> = rows.first().map(|r| r.get(0));
    let key: Vec<String> = rows.iter().filter(|r| Some(r.get::<_, String>(0)) == first).map(|r| r.get(1)).collect();
    if key.is_empty() {
        return Err(Error::internal(format!("{table} has no unique key to order its rows by")));
    }
    Ok(key)
}

fn identity_columns_of(tx: &mut postgres::Transaction<'_>, table: &str) -> Result<Vec<String>, Error> {
    let rows = tx
        .query(
            "SELECT column_name::text FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = $1 AND is_identity = 'YES'",
            &[&table],
        )
        .map_err(pg_error)?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A SQLite value as its PostgreSQL column will hold it.
fn sqlite_cell(value: ValueRef<'_>, column: &Column, table: &str) -> Result<Cell, Error> {
    let wrong = |found: &str| {
        Error::internal(format!("{table}.{}: a {found} where PostgreSQL keeps another type", column.name))
    };
    Ok(match (value, column.kind) {
        (ValueRef::Null, _) => Cell::Null,
        (ValueRef::Integer(v), ColumnKind::Integer) => Cell::Integer(v),
        (ValueRef::Integer(v), ColumnKind::Text) => Cell::Text(v.to_string()),
        (ValueRef::Text(t), ColumnKind::Text) => {
            Cell::Text(String::from_utf8(t.to_vec()).map_err(|_| wrong("text that is not UTF-8"))?)
        }
        (ValueRef::Text(t) | ValueRef::Blob(t), ColumnKind::Bytes) => Cell::Bytes(t.to_vec()),
        (ValueRef::Blob(_), _) => return Err(wrong("blob")),
        (ValueRef::Real(_), _) => return Err(wrong("real")),
        (ValueRef::Text(_), ColumnKind::Integer) => return Err(wrong("text")),
        (ValueRef::Integer(_), ColumnKind::Bytes) => return Err(wrong("integer")),
    })
}

/// A tag and the length before each value: no two rows hash alike unless
/// they are alike.
fn hash_cell(hash: &mut Sha256, cell: &Cell) {
    match cell {
        Cell::Null => hash.update([0u8]),
        Cell::Integer(v) => {
            hash.update([1u8]);
            hash.update(v.to_be_bytes());
        }
        Cell::Text(t) => {
            hash.update([2u8]);
            hash.update((t.len() as u64).to_be_bytes());
            hash.update(t.as_bytes());
        }
        Cell::Bytes(b) => {
            hash.update([3u8]);
            hash.update((b.len() as u64).to_be_bytes());
            hash.update(b);
        }
    }
}

/// COPY's text format: `\N` for NULL, backslash escapes for the
/// separators, bytea as `\x` hex (its backslash escaped in turn).
fn copy_text(line: &mut Vec<u8>, cell: &Cell) {
    match cell {
        Cell::Null => line.extend_from_slice(b"\\N"),
        Cell::Integer(v) => line.extend_from_slice(v.to_string().as_bytes()),
        Cell::Text(t) => {
            for &b in t.as_bytes() {
                match b {
                    b'\\' => line.extend_from_slice(b"\\\\"),
                    b'\t' => line.extend_from_slice(b"\\t"),
                    b'\n' => line.extend_from_slice(b"\\n"),
                    b'\r' => line.extend_from_slice(b"\\r"),
                    _ => line.push(b),
                }
            }
        }
        Cell::Bytes(bytes) => {
            line.extend_from_slice(b"\\\\x");
            line.extend_from_slice(hex(bytes).as_bytes());
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn pg_message(e: &postgres::Error) -> String {
    e.as_db_error().map_or_else(|| e.to_string(), |db| db.message().to_owned())
}

fn pg_error(e: postgres::Error) -> Error {
    Error::internal(format!("PostgreSQL: {}", pg_message(&e)))
}
