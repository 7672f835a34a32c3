//! The data plane's wire format: an authenticated handshake per connection,
//! then frames tagged with job, generation and sequence number.
//!
//! Handshake (the connecting rank is the sender of the ring link):
//! ```text
//! C -> A  hello:     "ACRH" | version u16 | rank u32 | generation u64 | job len u16 | job bytes
//! A -> C  challenge: 32 random bytes
//! C -> A  proof:     HMAC-SHA256(secret, "accrue-ring-v1" | challenge | job | generation | rank)
//! A -> C  verdict:   1 byte (1 = accepted)
//! ```
//! Frame: a 40-byte header (magic "ACR1", kind, job tag, generation, sequence,
//! payload length; little endian) and the payload.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};

pub const HELLO_MAGIC: &[u8; 4] = b"ACRH";
pub const FRAME_MAGIC: u32 = 0x3152_4341; // "ACR1" little endian
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 40;
/// The longest job id a hello carries (its length goes as a u16).
pub const MAX_JOB_ID: usize = 256;

/// A value that does not fit the wire format: refused, never truncated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{what} of {len} bytes is too long for the ring handshake (limit {limit} bytes)")]
    TooLong {
        what: &'static str,
        len: usize,
        limit: usize,
    },
}

/// The job id's length as the hello sends it, checked against [`MAX_JOB_ID`]
/// (which the reading side enforces too) and against the u16 it goes in.
pub fn job_id_len(job: &str) -> Result<u16, WireError> {
    let len = job.len();
    let too_long = WireError::TooLong {
        what: "job id",
        len,
        limit: MAX_JOB_ID,
    };
    if len > MAX_JOB_ID {
        return Err(too_long);
    }
    u16::try_from(len).map_err(|_| too_long)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Data = 1,
    /// Payload: lost rank (u32) + reason (UTF-8).
    Abort = 2,
    /// A clean close at the end of a job.
    Goodbye = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub job_tag: u64,
    pub generation: u64,
    pub seq: u64,
    pub len: u64,
}

/// First 8 bytes of SHA-256 of the job id: frames name their job cheaply.
pub fn job_tag(job: &str) -> u64 {
    let d = Sha256::digest(job.as_bytes());
    u64::from_le_bytes(d[..8].try_into().unwrap_or([0; 8]))
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.job_tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a header; `Err` says what is wrong with the bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != FRAME_MAGIC {
            return Err(format!("bad frame magic {magic:#010x}"));
        }
        let kind = match b[4] {
            1 => Kind::Data,
            2 => Kind::Abort,
            3 => Kind::Goodbye,
            k => return Err(format!("unknown frame kind {k}")),
        };
        Ok(Self {
            kind,
            job_tag: u64_at(8),
            generation: u64_at(16),
            seq: u64_at(24),
            len: u64_at(32),
        })
    }
}

pub fn read_header(r: &mut impl Read) -> io::Result<[u8; HEADER_LEN]> {
    let mut b = [0u8; HEADER_LEN];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// What the connecting side says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub rank: u32,
    pub generation: u64,
    pub job: String,
}

impl Hello {
    /// The hello's bytes; a job id longer than [`MAX_JOB_ID`] is refused.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let len = job_id_len(&self.job)?;
        let job = self.job.as_bytes();
        let mut b = Vec::with_capacity(20 + job.len());
        b.extend_from_slice(HELLO_MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(job);
        Ok(b)
    }

    /// Reads a hello; refuses a bad magic, version or oversized job id
    /// before reading further.
    pub fn read(r: &mut impl Read) -> Result<Self, String> {
        let mut head = [0u8; 20];
        r.read_exact(&mut head)
            .map_err(|e| format!("reading hello: {e}"))?;
        if &head[0..4] != HELLO_MAGIC {
            return Err(format!(
                "not an accrue ring hello (first bytes {:02x?})",
                &head[0..4]
            ));
        }
        let version = u16::from_le_bytes([head[4], head[5]]);
        if version != VERSION {
            return Err(format!(
                "ring protocol version {version}, this worker speaks {VERSION}"
            ));
        }
        let rank = u32::from_le_bytes([head[6], head[7], head[8], head[9]]);
        let generation = u64::from_le_bytes(head[10..18].try_into().unwrap_or([0; 8]));
        let len = u16::from_le_bytes([head[18], head[19]]) as usize;
        if len > MAX_JOB_ID {
            return Err(format!("job id of {len} bytes exceeds {MAX_JOB_ID}"));
        }
        let mut job = vec![0u8; len];
        r.read_exact(&mut job)
            .map_err(|e| format!("reading hello: {e}"))?;
        let job = String::from_utf8(job).map_err(|_| "job id is not UTF-8".to_string())?;
        Ok(Self {
            rank,
            generation,
            job,
        })
    }
}

fn mac(secret: &[u8], challenge: &[u8; 32], hello: &Hello) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so new_from_slice cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    mac.update(b"accrue-ring-v1");
    mac.update(challenge);
    mac.update(hello.job.as_bytes());
    mac.update(&hello.generation.to_le_bytes());
    mac.update(&hello.rank.to_le_bytes());
    mac
}

/// The proof that the connecting side knows the job's secret.
pub fn proof(secret: &[u8], challenge: &[u8; 32], hello: &Hello) -> [u8; 32] {
    mac(secret, challenge, hello).finalize().into_bytes().into()
}

/// Constant-time check of a proof.
pub fn verify(secret: &[u8], challenge: &[u8; 32], hello: &Hello, got: &[u8; 32]) -> bool {
    mac(secret, challenge, hello).verify_slice(got).is_ok()
}

/// Client side of the handshake.
pub fn handshake_connect(
    s: &mut (impl Read + Write),
    secret: &[u8],
    hello: &Hello,
) -> Result<(), String> {
    let bytes = hello.encode().map_err(|e| e.to_string())?;
    s.write_all(&bytes)
        .map_err(|e| format!("sending hello: {e}"))?;
    let mut challenge = [0u8; 32];
    s.read_exact(&mut challenge)
        .map_err(|e| format!("reading challenge: {e}"))?;
    s.write_all(&proof(secret, &challenge, hello))
        .map_err(|e| format!("sending proof: {e}"))?;
    let mut verdict = [0u8; 1];
    s.read_exact(&mut verdict)
        .map_err(|e| format!("reading verdict (refused?): {e}"))?;
    if verdict[0] != 1 {
        return Err("the peer refused the handshake (wrong secret, job or generation)".into());
    }
    Ok(())
}

/// Server side: checks job, generation and rank, then the proof. Returns the
/// hello on success.
pub fn handshake_accept(
    s: &mut (impl Read + Write),
    secret: &[u8],
    job: &str,
    generation: u64,
    expected_rank: u32,
) -> Result<Hello, String> {
    let hello = Hello::read(s)?;
    let mut challenge = [0u8; 32];
    rand::Rng::fill(&mut rand::thread_rng(), &mut challenge);
    s.write_all(&challenge)
        .map_err(|e| format!("sending challenge: {e}"))?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("reading proof: {e}"))?;
    let problem = if hello.job != job {
        Some(format!("job {:?}, expected {job:?}", hello.job))
    } else if hello.generation != generation {
        Some(format!(
            "generation {}, expected {generation}",
            hello.generation
        ))
    } else if hello.rank != expected_rank {
        Some(format!(
            "rank {}, expected rank {expected_rank}",
            hello.rank
        ))
    } else if !verify(secret, &challenge, &hello, &got) {
        Some("wrong secret (HMAC proof does not match)".to_string())
    } else {
        None
    };
    let _ = s.write_all(&[u8::from(problem.is_none())]);
    match problem {
        Some(p) => Err(p),
        None => Ok(hello),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_garbage() {
        let h = Header {
            kind: Kind::Data,
            job_tag: job_tag("j"),
            generation: 3,
            seq: 99,
            len: 4096,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let garbage = [0xabu8; HEADER_LEN];
        assert!(Header::decode(&garbage)
            .unwrap_err()
            .contains("bad frame magic"));
    }

    #[test]
    fn hello_round_trip_and_long_job_ids_are_refused_not_truncated() {
        for len in [0, 1, 255, MAX_JOB_ID] {
            let hello = Hello {
                rank: 3,
                generation: 7,
                job: "j".repeat(len),
            };
            let bytes = hello.encode().unwrap();
            assert_eq!(bytes.len(), 20 + len);
            assert_eq!(Hello::read(&mut &bytes[..]).unwrap(), hello);
        }
        // 257 bytes, and 65_537 (which `as u16` would have sent as 1).
        for len in [MAX_JOB_ID + 1, (1 << 16) + 1] {
            let hello = Hello {
                rank: 0,
                generation: 1,
                job: "j".repeat(len),
            };
            let err = hello.encode().unwrap_err();
            assert_eq!(
                err,
                WireError::TooLong {
                    what: "job id",
                    len,
                    limit: MAX_JOB_ID
                }
            );
            assert_eq!(
                err.to_string(),
                format!(
                    "job id of {len} bytes is too long for the ring handshake (limit 256 bytes)"
                )
            );
            // The handshake fails before writing anything.
            let mut sink = std::io::Cursor::new(Vec::new());
            let e = handshake_connect(&mut sink, b"s", &hello).unwrap_err();
            assert!(e.contains("too long"), "{e}");
            assert!(sink.get_ref().is_empty());
        }
    }

    #[test]
    fn proof_depends_on_every_field() {
        let hello = Hello {
            rank: 1,
            generation: 2,
            job: "job".into(),
        };
        let c = [7u8; 32];
        let p = proof(b"secret", &c, &hello);
        assert!(verify(b"secret", &c, &hello, &p));
        assert!(!verify(b"other", &c, &hello, &p));
        assert!(!verify(b"secret", &[8u8; 32], &hello, &p));
        assert!(!verify(
            b"secret",
            &c,
            &Hello {
                rank: 2,
                ..hello.clone()
            },
            &p
        ));
        assert!(!verify(
            b"secret",
            &c,
            &Hello {
                generation: 3,
                ..hello.clone()
            },
            &p
        ));
    }
}
