//! What a `SIGHUP` reload replaces while requests go on: keys,
//! certificates, secrets. Every reader takes the current value once
//! ([`Held::current`]) and keeps it for the whole request or call, so a
//! swap never mixes two sets inside one verification or signature, and
//! nothing in flight fails because of it. And how a secret's file is read
//! (at start by `config`, again on `SIGHUP` by whoever holds the secret):
//! the same checks both times.

use std::sync::Arc;

pub struct Held<K>(Arc<parking_lot::RwLock<Arc<K>>>);

impl<K> Clone for Held<K> {
    fn clone(&self) -> Held<K> {
        Held(Arc::clone(&self.0))
    }
}

impl<K> Held<K> {
    pub fn new(keys: K) -> Held<K> {
        Held(Arc::new(parking_lot::RwLock::new(Arc::new(keys))))
    }

    /// The value in use now.
    pub fn current(&self) -> Arc<K> {
        Arc::clone(&self.0.read())
    }

    /// Makes `keys` the value every later [`Held::current`] answers.
    pub fn replace(&self, keys: K) {
        *self.0.write() = Arc::new(keys);
    }

    /// Makes `change` of the value in use the one every later
    /// [`Held::current`] answers, with no other replacement in between
    /// (`change` only copies: nothing slow runs under the lock).
    pub fn update(&self, change: impl FnOnce(&K) -> K) {
        let mut held = self.0.write();
        let changed = change(&held);
        *held = Arc::new(changed);
    }
}

impl<K: Default> Default for Held<K> {
    fn default() -> Held<K> {
        Held::new(K::default())
    }
}

/// Secrets and keys are not printed: how many there are, if a list.
impl<K> std::fmt::Debug for Held<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held(..)")
    }
}

/// Reads a secret file again and replaces the secret it feeds; warnings go
/// into the vector, an error keeps the old secret.
pub type ReloadSecret = Arc<dyn Fn(&mut Vec<String>) -> Result<(), String> + Send + Sync>;

/// One secret file a reload reads again (`--callback-secret-file`,
/// `--api-token-file`, `--webhook-secret-file`, ...): the configuration
/// built `reload`, which reads and checks the file as at start and replaces
/// the secrets it feeds, or answers why not and changes nothing.
#[derive(Clone)]
pub struct SecretFile {
    /// The setting that named the file, e.g. `callback-secret-file`.
    pub setting: &'static str,
    pub path: String,
    pub reload: ReloadSecret,
}

impl std::fmt::Debug for SecretFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretFile(--{} {:?})", self.setting, self.path)
    }
}

/// Refuses a file of secrets that every user of the host may read or
/// write; warns when its group may read it and that group is not this
/// process's own (the deploy layout is 0640 root:payonce, payonce's group).
pub fn check_secret_mode(
    flag: &str,
    path: &str,
    metadata: &std::fs::Metadata,
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let mode = metadata.mode() & 0o777;
        if mode & 0o007 != 0 {
            return Err(format!(
                "--{flag} {path:?}: every user of this host may read or write it (mode {mode:04o}); \
                 `chmod o-rwx` it (0600, or 0640 with payonce's group)"
            ));
        }
        let own_group = std::fs::metadata("/proc/self").map(|m| m.gid()).ok();
        if mode & 0o070 != 0 && own_group != Some(metadata.gid()) {
            warnings.push(format!(
                "--{flag} {path:?}: its group (gid {}) may read it (mode {mode:04o}) and is not payonce's own; \
                 `chmod g-rwx` it unless that group is meant to",
                metadata.gid()
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = (flag, path, metadata, warnings);
    Ok(())
}

/// A secret's file: its text with trailing newlines trimmed; several lines
/// (blank ones skipped) become the comma-separated list the value takes.
/// Refused when missing, unreadable, empty, of several lines for a single
/// secret, or open to every user of the host.
pub fn read_secret_file(flag: &str, path: &str, list: bool, warnings: &mut Vec<String>) -> Result<String, String> {
    let metadata = std::fs::metadata(path).map_err(|e| format!("--{flag} {path:?}: cannot read it: {e}"))?;
    if !metadata.is_file() {
        return Err(format!("--{flag} {path:?}: not a file"));
    }
    check_secret_mode(flag, path, &metadata, warnings)?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("--{flag} {path:?}: cannot read it: {e}"))?;
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    match lines.as_slice() {
        [] => Err(format!("--{flag} {path:?}: the file is empty")),
        [one] => Ok((*one).to_owned()),
        _ if list => Ok(lines.join(",")),
        _ => Err(format!("--{flag} {path:?}: expected one line, found {}", lines.len())),
    }
}
