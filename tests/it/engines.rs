//! The storage conformance suite's harness: `for_each_engine!` turns one
//! test body into a test per engine, `<module>::<case>::sqlite` and
//! `<module>::<case>::postgres`, so every storage-level and exactly-once
//! test runs on both. The PostgreSQL half needs a server (`pg.rs`: from
//! `PAYONCE_TEST_PG`, or a throwaway cluster); without one it is skipped
//! with a loud line, and with `PAYONCE_REQUIRE_PG=1` (CI) it fails instead.

use crate::util::{Server, TempDir};
use std::path::PathBuf;
use std::process::Stdio;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

/// One fresh, empty database of one engine: a SQLite file in a directory
/// of its own, or a new PostgreSQL database.
pub struct Db {
    pub engine: Engine,
    /// What `--db` and `App::open` take: the file's path or the URL.
    pub spec: String,
    /// Holds the SQLite file; logs of servers go here on both engines.
    pub dir: TempDir,
}

impl Db {
    pub fn sqlite(label: &str) -> Db {
        let dir = TempDir::new(label);
        let spec = dir.path("payonce.db").display().to_string();
        Db { engine: Engine::Sqlite, spec, dir }
    }

    pub fn postgres(label: &str) -> Option<Db> {
        let spec = crate::pg::fresh_database(label)?;
        Some(Db { engine: Engine::Postgres, spec, dir: TempDir::new(label) })
    }

    /// Another fresh, empty database of the same engine.
    pub fn twin(&self, label: &str) -> Db {
        match self.engine {
            Engine::Sqlite => Db::sqlite(label),
            Engine::Postgres => Db::postgres(label).expect("the server of the first database"),
        }
    }

    pub fn label(&self) -> &'static str {
        match self.engine {
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgres",
        }
    }

    /// The SQLite file, for the checks that read it from outside payonce.
    pub fn sqlite_file(&self) -> Option<PathBuf> {
        (self.engine == Engine::Sqlite).then(|| PathBuf::from(&self.spec))
    }

    /// A `payonce serve` on this database, its stderr in the database's directory.
    pub fn serve(&self, extra: &[&str]) -> Server {
        self.serve_env(extra, &[])
    }

    /// [`Db::serve`] with extra environment variables (test hooks).
    pub fn serve_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Server {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let log = self.dir.path(&format!("serve.{}.stderr.log", N.fetch_add(1, Ordering::SeqCst)));
        let file = std::fs::File::create(&log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let mut server = Server::start_logged_env(std::path::Path::new(&self.spec), extra, Stdio::from(file), env);
        server.set_stderr_log(log);
        server
    }

    /// The integer `sql` returns, read through a store of its own.
    pub fn count(&self, store: &payonce::store::Store, sql: &str) -> i64 {
        store.count_raw(sql).unwrap_or_else(|e| panic!("{}: {sql}: {e}", self.label()))
    }

    pub fn store(&self) -> payonce::store::Store {
        payonce::store::Store::open(&self.spec, &payonce::store::StoreOptions::default())
            .unwrap_or_else(|e| panic!("{}: open {}: {e}", self.label(), self.spec))
    }
}

/// `for_each_engine! { fn case(db) { ... } ... }`: each case becomes a
/// module with a `sqlite` and a `postgres` test; `db` is a fresh [`Db`].
macro_rules! for_each_engine {
    ($($(#[$meta:meta])* fn $name:ident($db:ident) $body:block)*) => {$(
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn case($db: &$crate::engines::Db) $body

            #[test]
            fn sqlite() {
                case(&$crate::engines::Db::sqlite(stringify!($name)));
            }

            #[test]
            fn postgres() {
                if let Some(db) = $crate::engines::Db::postgres(stringify!($name)) {
                    case(&db);
                }
            }
        }
    )*};
}
