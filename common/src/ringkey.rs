//! Ring keys: the key a job's data-plane ring authenticates with is
//! derived per job and generation, HKDF-SHA256 (RFC 5869) from a master
//! secret only the coordinator holds:
//!
//! ```text
//! key = HKDF-SHA256(salt = "accrue-ring-v2",
//!                   ikm  = master,
//!                   info = "accrue ring key v1" | len(job) u64 LE | job | generation u64 LE,
//!                   L    = 32)
//! ```
//!
//! A key therefore opens one generation of one job's ring and nothing
//! else: the key of generation g is of no use in generation g + 1, nor for
//! another job, and the master cannot be recovered from keys.

use hkdf::Hkdf;
use sha2::Sha256;

/// Bytes of a derived ring key.
pub const RING_KEY_LEN: usize = 32;

/// The fewest bytes a master secret may have.
pub const MIN_MASTER_LEN: usize = 32;

const SALT: &[u8] = b"accrue-ring-v2";
const INFO: &[u8] = b"accrue ring key v1";

/// The ring key of `job`'s generation `generation`.
pub fn derive_ring_key(master: &[u8], job: &str, generation: u64) -> [u8; RING_KEY_LEN] {
    let hk = Hkdf::<Sha256>::new(Some(SALT), master);
    let mut info = Vec::with_capacity(INFO.len() + 16 + job.len());
    info.extend_from_slice(INFO);
    info.extend_from_slice(&(job.len() as u64).to_le_bytes());
    info.extend_from_slice(job.as_bytes());
    info.extend_from_slice(&generation.to_le_bytes());
    let mut key = [0u8; RING_KEY_LEN];
    // HKDF-SHA256 can expand to 255 * 32 bytes; 32 always fits.
    hk.expand(&info, &mut key)
        .unwrap_or_else(|_| unreachable!("32 bytes is a valid HKDF-SHA256 length"));
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// RFC 5869 appendix A.1 through the same crate, then our own
    /// derivation against a value computed independently (Python's hmac
    /// and hashlib, HKDF written out from the RFC).
    #[test]
    fn known_answers() {
        let hk = Hkdf::<Sha256>::new(Some(&(0u8..13).collect::<Vec<_>>()), &[0x0b; 22]);
        let mut okm = [0u8; 42];
        hk.expand(&(0xf0u8..0xfa).collect::<Vec<_>>(), &mut okm)
            .unwrap();
        assert_eq!(
            hex(&okm),
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
        );
        let master: Vec<u8> = (0u8..32).collect();
        assert_eq!(
            hex(&derive_ring_key(&master, "digits-mlp-1", 3)),
            "84dea9c6fec8bd262766c5d48e53a860b534e41f28e8280cbee9cfaad07897b6"
        );
        assert_eq!(
            hex(&derive_ring_key(&master, "digits-mlp-1", 4)),
            "1dcce9a04756b8140553b434ceb8f673c7f8f1378d23a162a587b8e4b64824d8"
        );
    }

    proptest! {
        /// Same inputs, same key; a change of master, job or generation
        /// changes it.
        #[test]
        fn every_input_changes_the_key(
            master in proptest::collection::vec(any::<u8>(), 32..64),
            job in "[a-z0-9-]{1,40}",
            generation in any::<u64>(),
            flip in 0usize..32,
        ) {
            let key = derive_ring_key(&master, &job, generation);
            prop_assert_eq!(key.len(), RING_KEY_LEN);
            prop_assert_eq!(key, derive_ring_key(&master, &job, generation));
            prop_assert_ne!(key, derive_ring_key(&master, &job, generation.wrapping_add(1)));
            prop_assert_ne!(key, derive_ring_key(&master, &format!("{job}x"), generation));
            let mut other = master.clone();
            other[flip] ^= 1;
            prop_assert_ne!(key, derive_ring_key(&other, &job, generation));
        }
    }

    /// The job's length is part of the info, so ("a", g) and ("a\0...", g')
    /// cannot collide by moving bytes between job and generation.
    #[test]
    fn job_and_generation_do_not_run_into_each_other() {
        let m = [9u8; 32];
        assert_ne!(
            derive_ring_key(&m, "a", 0),
            derive_ring_key(&m, "a\0\0\0\0\0\0\0", 0)
        );
    }
}
