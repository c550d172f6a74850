//! Whether the database's paths still name the files payonce has open.
//!
//! SQLite keeps a file descriptor on the database, its `-wal` and its `-shm`
//! for as long as a connection lives. An operator (or a cleanup script) who
//! deletes or replaces one of them does not disturb those descriptors: the
//! process goes on writing into an unlinked file, every commit is answered,
//! and the next process to open the path sees none of it. So payonce records
//! the device and inode of each path when it opens the database and compares
//! them with `stat` of the same paths later (after every commit, and about
//! once a second). An inode number is only reused once its file is freed,
//! and SQLite's open descriptors keep the old files alive, so a new file
//! under an old name always has another identity. Three `stat` calls cost a few microseconds (docs/performance.md,
//! "Watching the database files"), far below one commit's fsync.
//!
//! Pure file-system metadata; what to do about a change is `store.rs`'s
//! business.

use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A file's identity: the device it lives on and its inode there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

/// What a watched path names now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathState {
    /// The file payonce opened.
    Same,
    /// Nothing: the file was deleted (or renamed away).
    Missing,
    /// Another file (or the path cannot be examined at all).
    Other,
}

/// The three watched paths, in this order.
pub const WATCHED: [&str; 3] = ["database", "-wal", "-shm"];

/// The database file's, `-wal`'s and `-shm`'s paths and their identities at open.
#[derive(Debug)]
pub struct WatchedFiles {
    paths: [PathBuf; 3],
    ids: [FileId; 3],
}

/// One look at the three paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub database: PathState,
    pub wal: PathState,
    pub shm: PathState,
}

impl Verdict {
    pub fn all_same(&self) -> bool {
        self.states().iter().all(|s| *s == PathState::Same)
    }

    /// `-wal` was deleted and nothing took its name, while the database and
    /// `-shm` paths name no other file: the commits that live only in the
    /// unlinked `-wal` can still be checkpointed into the database through a
    /// connection that has it open. Had another file taken any of the names,
    /// another process may be using it, and a checkpoint from the old `-wal`
    /// would write over its pages.
    pub fn wal_rescuable(&self) -> bool {
        self.database == PathState::Same && self.wal == PathState::Missing && self.shm != PathState::Other
    }

    fn states(&self) -> [PathState; 3] {
        [self.database, self.wal, self.shm]
    }
}

impl WatchedFiles {
    /// Records what the database's paths name now. `database` is the path
    /// SQLite opened (`sqlite3_db_filename`): the journal files are named
    /// after it. Fails when one of the files does not exist, i.e. before the
    /// database is in WAL mode with a read done.
    pub fn record(database: &Path) -> std::io::Result<WatchedFiles> {
        let mut wal = database.as_os_str().to_owned();
        wal.push("-wal");
        let mut shm = database.as_os_str().to_owned();
        shm.push("-shm");
        let paths = [database.to_path_buf(), PathBuf::from(wal), PathBuf::from(shm)];
        let mut ids = [FileId { dev: 0, ino: 0 }; 3];
        for (id, path) in ids.iter_mut().zip(&paths) {
            let meta = std::fs::metadata(path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            *id = FileId { dev: meta.dev(), ino: meta.ino() };
        }
        Ok(WatchedFiles { paths, ids })
    }

    /// Three `stat` calls.
    pub fn check(&self) -> Verdict {
        let state = |i: usize| match std::fs::metadata(&self.paths[i]) {
            Ok(meta) if (FileId { dev: meta.dev(), ino: meta.ino() }) == self.ids[i] => PathState::Same,
            Ok(_) => PathState::Other,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => PathState::Missing,
            // Cannot tell (permissions changed, I/O error): not the file we know.
            Err(_) => PathState::Other,
        };
        Verdict { database: state(0), wal: state(1), shm: state(2) }
    }

    /// The database file's path as SQLite opened it.
    pub fn database_path(&self) -> &Path {
        &self.paths[0]
    }

    /// What changed, for the error message and the log: e.g.
    /// `"/var/lib/payonce/payonce.db-wal was deleted"`.
    pub fn describe(&self, verdict: &Verdict) -> String {
        let parts: Vec<String> = verdict
            .states()
            .iter()
            .zip(&self.paths)
            .filter_map(|(state, path)| match state {
                PathState::Same => None,
                PathState::Missing => Some(format!("{} was deleted", path.display())),
                PathState::Other => Some(format!("{} names another file than the one payonce opened", path.display())),
            })
            .collect();
        parts.join("; ")
    }
}

impl fmt::Display for PathState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathState::Same => "same",
            PathState::Missing => "missing",
            PathState::Other => "other",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("payonce-filewatch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    fn touch(path: &Path) {
        std::fs::write(path, b"x").expect("write");
    }

    #[test]
    fn deleted_replaced_and_untouched_paths() {
        let dir = scratch("states");
        let db = dir.join("a.db");
        for name in ["a.db", "a.db-wal", "a.db-shm"] {
            touch(&dir.join(name));
        }
        // Held open, as SQLite holds them: an unlinked inode that is still
        // open is not freed, so no new file can get its number.
        let _open: Vec<std::fs::File> =
            ["a.db", "a.db-wal", "a.db-shm"].iter().map(|n| std::fs::File::open(dir.join(n)).expect("open")).collect();
        let files = WatchedFiles::record(&db).expect("record");
        assert!(files.check().all_same());

        std::fs::remove_file(dir.join("a.db-wal")).expect("rm wal");
        let verdict = files.check();
        assert_eq!(
            (verdict.database, verdict.wal, verdict.shm),
            (PathState::Same, PathState::Missing, PathState::Same)
        );
        assert!(verdict.wal_rescuable());
        assert!(files.describe(&verdict).ends_with("a.db-wal was deleted"), "{}", files.describe(&verdict));

        // A new file under the old name is another file, however alike.
        touch(&dir.join("a.db-wal"));
        let verdict = files.check();
        assert_eq!(verdict.wal, PathState::Other);
        assert!(!verdict.wal_rescuable());

        // A replaced -shm forbids the rescue even with -wal missing.
        std::fs::remove_file(dir.join("a.db-wal")).expect("rm wal");
        std::fs::remove_file(dir.join("a.db-shm")).expect("rm shm");
        touch(&dir.join("a.db-shm"));
        let verdict = files.check();
        assert_eq!((verdict.wal, verdict.shm), (PathState::Missing, PathState::Other));
        assert!(!verdict.wal_rescuable());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn recording_needs_all_three_files() {
        let dir = scratch("record");
        touch(&dir.join("b.db"));
        touch(&dir.join("b.db-wal"));
        let err = WatchedFiles::record(&dir.join("b.db")).expect_err("no -shm");
        assert!(err.to_string().contains("b.db-shm"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
