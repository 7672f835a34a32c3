//! One-use sign-in codes for the status page (docs/OPERATIONS.md, "The
//! status page"): `accrue local` prints `https://HOST:PORT/#signin=CODE`;
//! the page sends the code to `POST /v1/signin` and gets the token the
//! code was issued for, once.
//!
//! A code is 32 random bytes as 64 hex digits. The coordinator keeps only
//! its SHA-256 (codes are looked up by hash, never compared as text), with
//! the token it stands for and when it expires ([`CODE_TTL`] after it was
//! issued). Redeeming removes it: a second use finds nothing. At most
//! [`MAX_PENDING`] codes wait at once (the oldest goes first). Time is
//! passed in, so the rules are tested without waiting.

use rand::RngCore;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a code may wait to be used.
pub const CODE_TTL: Duration = Duration::from_secs(600);
/// Codes waiting at once, at most.
pub const MAX_PENDING: usize = 64;

struct Pending {
    token: String,
    issued: Instant,
}

/// The codes issued and not yet used or expired, by SHA-256.
#[derive(Default)]
pub struct SignIns {
    codes: Mutex<HashMap<[u8; 32], Pending>>,
}

impl std::fmt::Debug for SignIns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No token and no digest in logs.
        f.debug_struct("SignIns").finish_non_exhaustive()
    }
}

fn digest(code: &str) -> [u8; 32] {
    Sha256::digest(code.as_bytes()).into()
}

fn expired(p: &Pending, now: Instant) -> bool {
    now.saturating_duration_since(p.issued) >= CODE_TTL
}

impl SignIns {
    /// A fresh code for `token`, issued at `now`.
    pub fn issue_at(&self, token: &str, now: Instant) -> String {
        let mut raw = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut raw);
        let code: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut codes = self.codes.lock().unwrap_or_else(|p| p.into_inner());
        codes.retain(|_, p| !expired(p, now));
        while codes.len() >= MAX_PENDING {
            let oldest = codes.iter().min_by_key(|(_, p)| p.issued).map(|(k, _)| *k);
            match oldest {
                Some(k) => codes.remove(&k),
                None => break,
            };
        }
        codes.insert(
            digest(&code),
            Pending {
                token: token.to_string(),
                issued: now,
            },
        );
        code
    }

    /// The token `code` was issued for, when it is known and was issued
    /// less than [`CODE_TTL`] before `now`; the code is used up either way.
    pub fn redeem_at(&self, code: &str, now: Instant) -> Option<String> {
        if code.len() != 64 || !code.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut codes = self.codes.lock().unwrap_or_else(|p| p.into_inner());
        let p = codes.remove(&digest(&code.to_ascii_lowercase()))?;
        codes.retain(|_, p| !expired(p, now));
        (!expired(&p, now)).then_some(p.token)
    }

    /// Codes waiting now (expired ones not counted).
    pub fn pending_at(&self, now: Instant) -> usize {
        let codes = self.codes.lock().unwrap_or_else(|p| p.into_inner());
        codes.values().filter(|p| !expired(p, now)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_code_is_64_hex_digits_and_fresh_each_time() {
        let s = SignIns::default();
        let now = Instant::now();
        let a = s.issue_at("tok", now);
        let b = s.issue_at("tok", now);
        assert_eq!(a.len(), 64);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
        assert_eq!(s.pending_at(now), 2);
        // Kept by hash: nothing in its Debug.
        assert!(!format!("{s:?}").contains("tok"));
    }

    #[test]
    fn a_code_is_used_once() {
        let s = SignIns::default();
        let now = Instant::now();
        let a = s.issue_at("tok-a", now);
        let b = s.issue_at("tok-b", now);
        assert_eq!(s.redeem_at(&a, now).as_deref(), Some("tok-a"));
        assert_eq!(s.redeem_at(&a, now), None, "a second use");
        // Upper case is the same code (hex), and used once too.
        assert_eq!(
            s.redeem_at(&b.to_ascii_uppercase(), now).as_deref(),
            Some("tok-b")
        );
        assert_eq!(s.redeem_at(&b, now), None);
        assert_eq!(s.pending_at(now), 0);
    }

    #[test]
    fn a_code_expires() {
        let s = SignIns::default();
        let t0 = Instant::now();
        let a = s.issue_at("tok", t0);
        let b = s.issue_at("tok", t0);
        let just = t0 + CODE_TTL - Duration::from_millis(1);
        assert_eq!(s.redeem_at(&a, just).as_deref(), Some("tok"));
        assert_eq!(s.redeem_at(&b, t0 + CODE_TTL), None, "expired");
        // An expired code is gone, not waiting for a later clock.
        assert_eq!(s.redeem_at(&b, t0), None);
        let c = s.issue_at("tok", t0);
        assert_eq!(s.pending_at(t0 + CODE_TTL), 0);
        assert_eq!(s.redeem_at(&c, t0 + 2 * CODE_TTL), None);
    }

    #[test]
    fn unknown_or_malformed_codes_find_nothing() {
        let s = SignIns::default();
        let now = Instant::now();
        let a = s.issue_at("tok", now);
        for bad in [
            "",
            "x",
            &"0".repeat(64),
            &a[..63],
            &format!("{a}0"),
            &format!("{}g", &a[..63]),
        ] {
            assert_eq!(s.redeem_at(bad, now), None, "{bad:?}");
        }
        // None of those used the real code up.
        assert_eq!(s.redeem_at(&a, now).as_deref(), Some("tok"));
    }

    #[test]
    fn at_most_max_pending_codes_wait_the_oldest_going_first() {
        let s = SignIns::default();
        let t0 = Instant::now();
        let first = s.issue_at("first", t0);
        let mut last = String::new();
        for i in 1..=MAX_PENDING {
            last = s.issue_at("later", t0 + Duration::from_millis(i as u64));
        }
        let now = t0 + Duration::from_secs(1);
        assert_eq!(s.pending_at(now), MAX_PENDING);
        assert_eq!(s.redeem_at(&first, now), None, "the oldest was dropped");
        assert_eq!(s.redeem_at(&last, now).as_deref(), Some("later"));
    }
}
