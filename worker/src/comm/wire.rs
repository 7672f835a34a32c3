//! The data plane's wire format: a mutually authenticated handshake per
//! connection, then frames tagged with job, generation and sequence number.
//!
//! Handshake (the connecting rank C is the sender of the ring link, the
//! accepting rank A its receiver; `key` is the ring key of the job's
//! generation, see `accrue_common::ringkey`):
//! ```text
//! C -> A  hello:     "ACRH" | version u16 = 2 | rank u32 | generation u64 | nonce_c [32]
//!                    | job len u16 | job bytes
//! A -> C  challenge: nonce_a [32]
//! C -> A  proof:     HMAC-SHA256(key, "accrue-ring-v2" | "c" | nonce_a | nonce_c | job | generation | rank)
//! A -> C  verdict:   1 byte (1 = accepted), and when accepted
//!                    HMAC-SHA256(key, "accrue-ring-v2" | "a" | nonce_a | nonce_c | job | generation | rank)
//! ```
//! Both nonces are fresh random bytes, so a proof is good for one
//! connection only: captured handshake bytes replayed to either side fail.
//! Proofs are compared in constant time. C sends no frame until A's proof
//! verifies; A reads no frame from a connection whose proof did not.
//!
//! Frame: a 40-byte header (magic "ACR1", kind, job tag, generation, sequence,
//! payload length; little endian) and the payload. A header announcing more
//! than the reader's limit is refused before any payload byte is read.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};

pub const HELLO_MAGIC: &[u8; 4] = b"ACRH";
pub const FRAME_MAGIC: u32 = 0x3152_4341; // "ACR1" little endian
pub const VERSION: u16 = 2;
pub const HEADER_LEN: usize = 40;
/// The longest job id a hello carries (its length goes as a u16).
pub const MAX_JOB_ID: usize = 256;
/// Bytes of each side's nonce and of each proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// The hello's fixed part (everything before the job id's bytes).
pub const HELLO_FIXED_LEN: usize = 4 + 2 + 4 + 8 + NONCE_LEN + 2;
/// The longest payload an Abort frame may announce.
pub const MAX_ABORT_BYTES: u64 = 4096;
/// Domain separation of the proofs (and the protocol's version).
const PROOF_CONTEXT: &[u8] = b"accrue-ring-v2";

pub type Nonce = [u8; NONCE_LEN];

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

/// Why the next frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed or ended (the peer is gone).
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The header's bytes are not a frame of this protocol.
    #[error("{0}")]
    Garbage(String),
    /// The header announces more payload than the reader accepts: refused
    /// before any payload byte is read.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLong { kind: Kind, len: u64, limit: u64 },
}

/// Reads the next frame header and checks it can be read further: a data
/// frame of at most `max_data` bytes, an Abort of at most
/// [`MAX_ABORT_BYTES`], a Goodbye. Reads exactly [`HEADER_LEN`] bytes.
pub fn read_frame_header(r: &mut impl Read, max_data: u64) -> Result<Header, FrameError> {
    let h = Header::decode(&read_header(r)?).map_err(FrameError::Garbage)?;
    let limit = match h.kind {
        Kind::Data => max_data,
        Kind::Abort => MAX_ABORT_BYTES,
        Kind::Goodbye => u64::MAX,
    };
    if h.len > limit {
        return Err(FrameError::TooLong {
            kind: h.kind,
            len: h.len,
            limit,
        });
    }
    Ok(h)
}

/// Reads an Abort frame's payload of `len` bytes (checked by
/// [`read_frame_header`]): the lost rank and the reason.
pub fn read_abort(r: &mut impl Read, len: u64) -> io::Result<(usize, String)> {
    if !(4..=MAX_ABORT_BYTES).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("abort frame of {len} bytes (4 to {MAX_ABORT_BYTES} allowed)"),
        ));
    }
    let mut b = vec![0u8; len as usize];
    r.read_exact(&mut b)?;
    let lost = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    Ok((lost, String::from_utf8_lossy(&b[4..]).into_owned()))
}

/// What the connecting side says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub rank: u32,
    pub generation: u64,
    pub job: String,
}

/// Why a handshake failed. Every failure closes the connection.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        source: io::Error,
    },
    #[error("not an accrue ring hello (first bytes {first:02x?})")]
    NotHello { first: [u8; 4] },
    #[error("ring protocol version {got}, this worker speaks {VERSION}")]
    Version { got: u16 },
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("the hello's job id is not UTF-8")]
    JobNotUtf8,
    /// The acceptor: the hello names another job, generation or rank.
    #[error("hello for {what} {got}, expected {want}")]
    Unexpected {
        what: &'static str,
        got: String,
        want: String,
    },
    /// The acceptor: the connector's proof does not verify (a wrong key, a
    /// key of another generation, or replayed bytes).
    #[error("the connector's HMAC proof does not match (wrong key, another generation's key, or a replayed handshake)")]
    BadProof,
    /// The connector: the acceptor said no.
    #[error("the peer refused the handshake (wrong key, job or generation)")]
    Refused,
    /// The connector: the acceptor's proof does not verify (it does not
    /// hold this generation's key, or replays another connection's answer).
    #[error("the peer's HMAC proof does not match (it does not hold this generation's key)")]
    BadPeerProof,
}

fn io_err(step: &'static str) -> impl FnOnce(io::Error) -> HandshakeError {
    move |source| HandshakeError::Io { step, source }
}

impl Hello {
    /// The hello's bytes with the connector's nonce; a job id longer than
    /// [`MAX_JOB_ID`] is refused.
    pub fn encode(&self, nonce: &Nonce) -> Result<Vec<u8>, WireError> {
        let len = job_id_len(&self.job)?;
        let job = self.job.as_bytes();
        let mut b = Vec::with_capacity(HELLO_FIXED_LEN + job.len());
        b.extend_from_slice(HELLO_MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(nonce);
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(job);
        Ok(b)
    }

    /// Reads a hello and the connector's nonce; refuses a bad magic,
    /// version or oversized job id before reading further. Reads at most
    /// [`HELLO_FIXED_LEN`] + [`MAX_JOB_ID`] bytes and allocates at most
    /// [`MAX_JOB_ID`] for the job id.
    pub fn read(r: &mut impl Read) -> Result<(Self, Nonce), HandshakeError> {
        let mut head = [0u8; HELLO_FIXED_LEN];
        r.read_exact(&mut head[..6])
            .map_err(io_err("reading hello"))?;
        if &head[0..4] != HELLO_MAGIC {
            return Err(HandshakeError::NotHello {
                first: [head[0], head[1], head[2], head[3]],
            });
        }
        let version = u16::from_le_bytes([head[4], head[5]]);
        if version != VERSION {
            return Err(HandshakeError::Version { got: version });
        }
        r.read_exact(&mut head[6..])
            .map_err(io_err("reading hello"))?;
        let rank = u32::from_le_bytes([head[6], head[7], head[8], head[9]]);
        let generation = u64::from_le_bytes([
            head[10], head[11], head[12], head[13], head[14], head[15], head[16], head[17],
        ]);
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&head[18..18 + NONCE_LEN]);
        let len = u16::from_le_bytes([head[HELLO_FIXED_LEN - 2], head[HELLO_FIXED_LEN - 1]]);
        let len = usize::from(len);
        if len > MAX_JOB_ID {
            return Err(WireError::TooLong {
                what: "job id",
                len,
                limit: MAX_JOB_ID,
            }
            .into());
        }
        let mut job = [0u8; MAX_JOB_ID];
        r.read_exact(&mut job[..len])
            .map_err(io_err("reading hello"))?;
        let job = std::str::from_utf8(&job[..len])
            .map_err(|_| HandshakeError::JobNotUtf8)?
            .to_string();
        Ok((
            Self {
                rank,
                generation,
                job,
            },
            nonce,
        ))
    }
}

/// Which side a proof speaks for (each side's proofs are useless as the
/// other side's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Connector,
    Acceptor,
}

fn mac(key: &[u8], role: Role, nonce_a: &Nonce, nonce_c: &Nonce, hello: &Hello) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so new_from_slice cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(PROOF_CONTEXT);
    mac.update(match role {
        Role::Connector => b"c",
        Role::Acceptor => b"a",
    });
    mac.update(nonce_a);
    mac.update(nonce_c);
    mac.update(hello.job.as_bytes());
    mac.update(&hello.generation.to_le_bytes());
    mac.update(&hello.rank.to_le_bytes());
    mac
}

/// `role`'s proof that it holds `key`, for this connection's nonces.
pub fn proof(
    key: &[u8],
    role: Role,
    nonce_a: &Nonce,
    nonce_c: &Nonce,
    hello: &Hello,
) -> [u8; PROOF_LEN] {
    mac(key, role, nonce_a, nonce_c, hello)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a proof.
pub fn verify(
    key: &[u8],
    role: Role,
    nonce_a: &Nonce,
    nonce_c: &Nonce,
    hello: &Hello,
    got: &[u8],
) -> bool {
    mac(key, role, nonce_a, nonce_c, hello)
        .verify_slice(got)
        .is_ok()
}

fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    rand::Rng::fill(&mut rand::thread_rng(), &mut n);
    n
}

/// Connecting side: sends the hello with a fresh nonce, proves it holds
/// `key`, and verifies the acceptor's proof. Nothing may be sent on `s`
/// unless this returns Ok.
pub fn handshake_connect(
    s: &mut (impl Read + Write),
    key: &[u8],
    hello: &Hello,
) -> Result<(), HandshakeError> {
    let nonce_c = nonce();
    let bytes = hello.encode(&nonce_c)?;
    s.write_all(&bytes).map_err(io_err("sending hello"))?;
    let mut nonce_a = [0u8; NONCE_LEN];
    s.read_exact(&mut nonce_a)
        .map_err(io_err("reading challenge"))?;
    s.write_all(&proof(key, Role::Connector, &nonce_a, &nonce_c, hello))
        .map_err(io_err("sending proof"))?;
    let mut verdict = [0u8; 1];
    s.read_exact(&mut verdict)
        .map_err(io_err("reading verdict (refused?)"))?;
    if verdict[0] != 1 {
        return Err(HandshakeError::Refused);
    }
    let mut theirs = [0u8; PROOF_LEN];
    s.read_exact(&mut theirs)
        .map_err(io_err("reading the peer's proof"))?;
    if !verify(key, Role::Acceptor, &nonce_a, &nonce_c, hello, &theirs) {
        return Err(HandshakeError::BadPeerProof);
    }
    Ok(())
}

/// Accepting side: reads the hello, challenges it with a fresh nonce,
/// checks job, generation, rank and the connector's proof, then answers
/// with its own proof. Returns the hello on success; on failure the
/// verdict 0 is sent (best effort) and nothing further is read.
pub fn handshake_accept(
    s: &mut (impl Read + Write),
    key: &[u8],
    job: &str,
    generation: u64,
    expected_rank: u32,
) -> Result<Hello, HandshakeError> {
    accept(s, key, job, generation, |r| {
        (r != expected_rank).then(|| expected_rank.to_string())
    })
}

/// [`handshake_accept`] for a server any rank below `world` may reach (the
/// c10d store): the same proofs, any rank of the generation.
pub fn handshake_accept_any(
    s: &mut (impl Read + Write),
    key: &[u8],
    job: &str,
    generation: u64,
    world: u32,
) -> Result<Hello, HandshakeError> {
    accept(s, key, job, generation, |r| {
        (r >= world).then(|| format!("a rank below {world}"))
    })
}

/// `bad_rank` says what was expected when the hello's rank is not.
fn accept(
    s: &mut (impl Read + Write),
    key: &[u8],
    job: &str,
    generation: u64,
    bad_rank: impl Fn(u32) -> Option<String>,
) -> Result<Hello, HandshakeError> {
    let (hello, nonce_c) = Hello::read(s)?;
    let nonce_a = nonce();
    s.write_all(&nonce_a).map_err(io_err("sending challenge"))?;
    let mut got = [0u8; PROOF_LEN];
    s.read_exact(&mut got).map_err(io_err("reading proof"))?;
    let unexpected =
        |what, got: String, want: String| Some(HandshakeError::Unexpected { what, got, want });
    let problem = if hello.job != job {
        unexpected("job", format!("{:?}", hello.job), format!("{job:?}"))
    } else if hello.generation != generation {
        unexpected(
            "generation",
            hello.generation.to_string(),
            generation.to_string(),
        )
    } else if let Some(want) = bad_rank(hello.rank) {
        unexpected("rank", hello.rank.to_string(), want)
    } else if !verify(key, Role::Connector, &nonce_a, &nonce_c, &hello, &got) {
        Some(HandshakeError::BadProof)
    } else {
        None
    };
    if let Some(p) = problem {
        let _ = s.write_all(&[0]);
        return Err(p);
    }
    let mut answer = [0u8; 1 + PROOF_LEN];
    answer[0] = 1;
    answer[1..].copy_from_slice(&proof(key, Role::Acceptor, &nonce_a, &nonce_c, &hello));
    s.write_all(&answer).map_err(io_err("sending verdict"))?;
    Ok(hello)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

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
    fn an_oversized_frame_is_refused_after_its_header_only() {
        for (kind, len, limit) in [
            (Kind::Data, 1025, 1024),
            (Kind::Data, u64::MAX, 1024),
            (Kind::Abort, MAX_ABORT_BYTES + 1, MAX_ABORT_BYTES),
        ] {
            let h = Header {
                kind,
                job_tag: 1,
                generation: 1,
                seq: 0,
                len,
            };
            let mut bytes = h.encode().to_vec();
            bytes.extend_from_slice(&[7u8; 64]);
            let mut r = &bytes[..];
            let e = read_frame_header(&mut r, 1024).unwrap_err();
            assert!(
                matches!(e, FrameError::TooLong { len: l, limit: m, .. } if l == len && m == limit),
                "{e}"
            );
            assert_eq!(r.len(), 64, "no payload byte was read");
        }
        let ok = Header {
            kind: Kind::Data,
            job_tag: 1,
            generation: 1,
            seq: 0,
            len: 1024,
        };
        assert_eq!(read_frame_header(&mut &ok.encode()[..], 1024).unwrap(), ok);
    }

    #[test]
    fn hello_round_trip_and_long_job_ids_are_refused_not_truncated() {
        let nonce = [9u8; NONCE_LEN];
        for len in [0, 1, 255, MAX_JOB_ID] {
            let hello = Hello {
                rank: 3,
                generation: 7,
                job: "j".repeat(len),
            };
            let bytes = hello.encode(&nonce).unwrap();
            assert_eq!(bytes.len(), HELLO_FIXED_LEN + len);
            assert_eq!(Hello::read(&mut &bytes[..]).unwrap(), (hello, nonce));
        }
        // 257 bytes, and 65_537 (which `as u16` would have sent as 1).
        for len in [MAX_JOB_ID + 1, (1 << 16) + 1] {
            let hello = Hello {
                rank: 0,
                generation: 1,
                job: "j".repeat(len),
            };
            let err = hello.encode(&nonce).unwrap_err();
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
            assert!(e.to_string().contains("too long"), "{e}");
            assert!(sink.get_ref().is_empty());
        }
        // A hello announcing a longer job id is refused before its bytes
        // are read.
        let mut bytes = Hello {
            rank: 0,
            generation: 1,
            job: String::new(),
        }
        .encode(&nonce)
        .unwrap();
        bytes[HELLO_FIXED_LEN - 2..].copy_from_slice(&u16::MAX.to_le_bytes());
        bytes.extend_from_slice(&[b'j'; 300]);
        let mut r = &bytes[..];
        let e = Hello::read(&mut r).unwrap_err();
        assert!(e.to_string().contains("65535 bytes"), "{e}");
        assert_eq!(r.len(), 300);
    }

    #[test]
    fn proof_depends_on_every_field_and_the_role() {
        let hello = Hello {
            rank: 1,
            generation: 2,
            job: "job".into(),
        };
        let (a, c) = ([7u8; 32], [8u8; 32]);
        let p = proof(b"secret", Role::Connector, &a, &c, &hello);
        assert!(verify(b"secret", Role::Connector, &a, &c, &hello, &p));
        assert!(!verify(b"secret", Role::Acceptor, &a, &c, &hello, &p));
        assert!(!verify(b"other", Role::Connector, &a, &c, &hello, &p));
        assert!(!verify(b"secret", Role::Connector, &c, &c, &hello, &p));
        assert!(!verify(b"secret", Role::Connector, &a, &a, &hello, &p));
        assert!(!verify(
            b"secret",
            Role::Connector,
            &a,
            &c,
            &hello,
            &p[..31]
        ));
        for other in [
            Hello {
                rank: 2,
                ..hello.clone()
            },
            Hello {
                generation: 3,
                ..hello.clone()
            },
            Hello {
                job: "jo".into(),
                ..hello.clone()
            },
        ] {
            assert!(!verify(b"secret", Role::Connector, &a, &c, &other, &p));
        }
    }

    fn hello() -> Hello {
        Hello {
            rank: 0,
            generation: 5,
            job: "j-1".into(),
        }
    }

    /// Runs both sides over a socket pair.
    fn both(
        connector_key: &'static [u8],
        acceptor_key: &'static [u8],
    ) -> (Result<(), HandshakeError>, Result<Hello, HandshakeError>) {
        let (mut c, mut a) = UnixStream::pair().unwrap();
        let acc = std::thread::spawn(move || handshake_accept(&mut a, acceptor_key, "j-1", 5, 0));
        let con = handshake_connect(&mut c, connector_key, &hello());
        (con, acc.join().unwrap())
    }

    #[test]
    fn the_right_key_on_both_sides_and_only_then() {
        let (c, a) = both(b"k5", b"k5");
        c.unwrap();
        assert_eq!(a.unwrap(), hello());
        let (c, a) = both(b"k4", b"k5");
        assert!(matches!(c, Err(HandshakeError::Refused)), "{c:?}");
        assert!(matches!(a, Err(HandshakeError::BadProof)), "{a:?}");
    }

    /// An acceptor that does not hold the key but says "accepted" (here:
    /// by replaying a real acceptor's answer from an earlier connection)
    /// is caught by the connector.
    #[test]
    fn a_replayed_acceptor_answer_is_refused_by_the_connector() {
        // A real handshake, recorded from the acceptor's side.
        let (mut c, a) = UnixStream::pair().unwrap();
        let rec = std::thread::spawn(move || {
            let mut tap = Tap(a, Vec::new());
            handshake_accept(&mut tap, b"k5", "j-1", 5, 0).unwrap();
            tap.1
        });
        handshake_connect(&mut c, b"k5", &hello()).unwrap();
        let answer = rec.join().unwrap();
        assert_eq!(answer.len(), NONCE_LEN + 1 + PROOF_LEN);
        // The impostor replays it to the next connector.
        let (mut c, mut a) = UnixStream::pair().unwrap();
        let impostor = std::thread::spawn(move || {
            let _ = Hello::read(&mut a);
            a.write_all(&answer[..NONCE_LEN]).unwrap();
            let mut p = [0u8; PROOF_LEN];
            let _ = a.read_exact(&mut p);
            let _ = a.write_all(&answer[NONCE_LEN..]);
        });
        let e = handshake_connect(&mut c, b"k5", &hello()).unwrap_err();
        assert!(matches!(e, HandshakeError::BadPeerProof), "{e}");
        impostor.join().unwrap();
    }

    /// Records what is written through it.
    struct Tap(UnixStream, Vec<u8>);
    impl Read for Tap {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.0.read(b)
        }
    }
    impl Write for Tap {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let n = self.0.write(b)?;
            self.1.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.0.flush()
        }
    }
}
