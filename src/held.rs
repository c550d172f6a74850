//! What a `SIGHUP` reload replaces while requests go on: keys,
//! certificates, secrets. Every reader takes the current value once
//! ([`Held::current`]) and keeps it for the whole request or call, so a
//! swap never mixes two sets inside one verification or signature, and
//! nothing in flight fails because of it.

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
