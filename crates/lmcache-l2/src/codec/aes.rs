//! AES-256-GCM with one key per cache_salt.
//!
//! Key for salt `s`: HKDF-SHA256(ikm = master key, info = "lmcache-rs-l2-aesgcm-v1" ‖ s).
//! Payload: a random 96-bit nonce, then ciphertext and the 16-byte tag. The wire key is the
//! associated data, so a blob moved to another key (or another tenant) fails authentication.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use hkdf::Hkdf;
use lmcache_core::ObjectKey;
use parking_lot::Mutex;
use serde_json::{Map, Value};
use sha2::Sha256;

use crate::blob::BlobError;
use crate::error::ConfigError;
use crate::wire_key;

const INFO: &[u8] = b"lmcache-rs-l2-aesgcm-v1";
const NONCE: usize = 12;
const TAG: usize = 16;

/// AES-256-GCM codec state: the master key and the derived per-salt ciphers.
pub struct AesGcmCodec {
    master: [u8; 32],
    path: PathBuf,
    ciphers: Mutex<HashMap<String, Arc<Aes256Gcm>>>,
}

impl std::fmt::Debug for AesGcmCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("AesGcmCodec").field("master_key_path", &self.path).finish()
    }
}

impl AesGcmCodec {
    /// From `{"master_key_path": ..., "aes_bits": 256}`. The file holds 32 raw bytes or 64 hex
    /// digits.
    pub fn from_spec(obj: &Map<String, Value>) -> Result<Self, ConfigError> {
        if let Some(bits) = obj.get("aes_bits")
            && bits.as_u64() != Some(256)
        {
            return Err(ConfigError::field("serde.aes_bits", "only 256 is supported"));
        }
        let path = obj
            .get("master_key_path")
            .and_then(Value::as_str)
            .ok_or_else(|| ConfigError::field("serde.master_key_path", "missing"))?;
        let bytes = std::fs::read(path)
            .map_err(|e| ConfigError::field("serde.master_key_path", format!("{path}: {e}")))?;
        let master = parse_key(&bytes).ok_or_else(|| {
            ConfigError::field(
                "serde.master_key_path",
                format!("{path}: must hold 32 raw bytes or 64 hex digits"),
            )
        })?;
        Ok(Self::new(master, PathBuf::from(path)))
    }

    /// From a master key in memory.
    pub fn new(master: [u8; 32], path: PathBuf) -> Self {
        Self { master, path, ciphers: Mutex::new(HashMap::new()) }
    }

    fn cipher(&self, salt: &str) -> Arc<Aes256Gcm> {
        let mut map = self.ciphers.lock();
        if let Some(c) = map.get(salt) {
            return c.clone();
        }
        let mut info = INFO.to_vec();
        info.extend_from_slice(salt.as_bytes());
        let mut okm = [0u8; 32];
        // 32 bytes is far below HKDF-SHA256's 8160-byte limit, so expand cannot fail.
        let _ = Hkdf::<Sha256>::new(None, &self.master).expand(&info, &mut okm);
        let c = Arc::new(Aes256Gcm::new(&okm.into()));
        map.insert(salt.to_owned(), c.clone());
        c
    }

    /// Encrypts `raw` for `key`.
    pub fn seal(&self, key: &ObjectKey, raw: &[u8]) -> Result<Vec<u8>, BlobError> {
        let mut nonce = [0u8; NONCE];
        getrandom::fill(&mut nonce)
            .map_err(|e| BlobError::Decode(format!("no randomness: {e}")))?;
        let aad = wire_key::encode(key);
        let ct = self
            .cipher(key.cache_salt.as_str())
            .encrypt(&Nonce::from(nonce), Payload { msg: raw, aad: aad.as_bytes() })
            .map_err(|_| BlobError::Decode("encryption failed".into()))?;
        let mut out = Vec::with_capacity(NONCE + ct.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        Ok(out)
    }

    /// Authenticates and decrypts into `dest`.
    pub fn open_into(
        &self,
        key: &ObjectKey,
        payload: &[u8],
        dest: &mut [u8],
    ) -> Result<(), BlobError> {
        if payload.len() < NONCE + TAG || payload.len() - NONCE - TAG != dest.len() {
            return Err(BlobError::RawLength {
                found: payload.len().saturating_sub(NONCE + TAG) as u64,
                expected: dest.len() as u64,
            });
        }
        let mut nonce = [0u8; NONCE];
        nonce.copy_from_slice(&payload[..NONCE]);
        let aad = wire_key::encode(key);
        let pt = self
            .cipher(key.cache_salt.as_str())
            .decrypt(&Nonce::from(nonce), Payload { msg: &payload[NONCE..], aad: aad.as_bytes() })
            .map_err(|_| BlobError::Decode("authentication failed".into()))?;
        dest.copy_from_slice(&pt);
        Ok(())
    }
}

fn parse_key(bytes: &[u8]) -> Option<[u8; 32]> {
    if bytes.len() == 32 {
        return bytes.try_into().ok();
    }
    let text = std::str::from_utf8(bytes).ok()?.trim();
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_per_salt_and_bind_the_object_key() {
        let c = AesGcmCodec::new([1; 32], PathBuf::new());
        let a = ObjectKey::new([1; 32], "m", 1, 0, 0, "a").unwrap();
        let b = ObjectKey::new([1; 32], "m", 1, 0, 0, "b").unwrap();
        let ct = c.seal(&a, b"secret kv").unwrap();
        let mut out = [0u8; 9];
        c.open_into(&a, &ct, &mut out).unwrap();
        assert_eq!(&out, b"secret kv");
        assert!(c.open_into(&b, &ct, &mut out).is_err(), "other salt decrypted");
        let other = AesGcmCodec::new([2; 32], PathBuf::new());
        assert!(other.open_into(&a, &ct, &mut out).is_err(), "other master decrypted");
        assert_ne!(c.seal(&a, b"secret kv").unwrap(), ct, "nonce reused");
    }

    /// The per-salt keys themselves differ: with the same nonce and the same associated data
    /// (so only the key can tell them apart), salt b's cipher neither reproduces salt a's
    /// ciphertext nor opens it. (The test above would pass on the associated data alone.)
    #[test]
    fn two_salts_get_two_keys_not_just_two_labels() {
        let c = AesGcmCodec::new([1; 32], PathBuf::new());
        let nonce = Nonce::from([7u8; NONCE]);
        let p = |msg: &'static [u8]| Payload { msg, aad: b"same associated data" };
        let ct_a = c.cipher("a").encrypt(&nonce, p(b"secret kv")).unwrap();
        let ct_b = c.cipher("b").encrypt(&nonce, p(b"secret kv")).unwrap();
        assert_ne!(ct_a, ct_b, "salts a and b encrypt with one key");
        let opened =
            c.cipher("b").decrypt(&nonce, Payload { msg: &ct_a, aad: b"same associated data" });
        assert!(opened.is_err(), "salt b's key opened salt a's ciphertext");
        // And the derivation is stable: the same salt gets the same key again.
        let again =
            c.cipher("a").decrypt(&nonce, Payload { msg: &ct_a, aad: b"same associated data" });
        assert_eq!(again.unwrap(), b"secret kv");
        let fresh = AesGcmCodec::new([1; 32], PathBuf::new());
        assert_eq!(fresh.cipher("a").encrypt(&nonce, p(b"secret kv")).unwrap(), ct_a);
        // The empty salt is a salt like any other.
        assert_ne!(c.cipher("").encrypt(&nonce, p(b"secret kv")).unwrap(), ct_a);
    }

    #[test]
    fn hex_and_raw_keys_parse() {
        assert_eq!(parse_key(&[7; 32]), Some([7; 32]));
        assert_eq!(parse_key("07".repeat(32).as_bytes()), Some([7; 32]));
        assert_eq!(parse_key(b"short"), None);
    }
}
