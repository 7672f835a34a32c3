//! Fuzzing the data plane's parsers with proptest: random bytes, and random
//! mutations of valid frames, hellos and recorded handshakes, fed to the
//! frame header reader, the hello reader and both sides of the handshake.
//! Each must end with an error (never a panic, never an accepted
//! handshake), read no more than its limits, and never allocate more than
//! the protocol's bounds however large the lengths the bytes announce (a
//! counting allocator measures the largest single allocation).
//!
//! Bounded: a fixed number of cases per property (a few seconds in debug,
//! in `make test`); `PROPTEST_CASES=100000 cargo test -p accrue-worker
//! --test wire_fuzz` fuzzes longer.

use accrue_worker::comm::wire::{
    self, handshake_accept, handshake_connect, read_abort, read_frame_header, Header, Hello, Kind,
    HEADER_LEN, HELLO_FIXED_LEN, MAX_ABORT_BYTES, MAX_JOB_ID, NONCE_LEN, PROOF_LEN,
};
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{self, Cursor, Read, Write};
use std::sync::OnceLock;

/// Records the largest single allocation of the current thread while on.
struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ON.try_with(|on| {
        if on.get() {
            let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        System.realloc(p, l, new)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the largest single allocation it
/// made (on this thread).
fn largest_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|m| m.set(0));
    ON.with(|on| on.set(true));
    let r = f();
    ON.with(|on| on.set(false));
    (r, LARGEST.with(|m| m.get()))
}

/// Largest allocation reading a hello may make: the job id (at most
/// MAX_JOB_ID bytes) and an error message.
const HELLO_ALLOC_BOUND: usize = 1024;
/// Largest allocation reading frames may make: an Abort payload (at most
/// MAX_ABORT_BYTES) and an error message.
const FRAME_ALLOC_BOUND: usize = MAX_ABORT_BYTES as usize + 512;

/// A peer whose bytes are `input`; what we write goes to `output`.
struct Scripted {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Scripted {
    fn new(input: Vec<u8>) -> Self {
        Self {
            input: Cursor::new(input),
            output: Vec::new(),
        }
    }
}

impl Read for Scripted {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        self.input.read(b)
    }
}

impl Write for Scripted {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
const JOB: &str = "fuzz-1";
const GEN: u64 = 3;

fn hello() -> Hello {
    Hello {
        rank: 0,
        generation: GEN,
        job: JOB.into(),
    }
}

/// Reads frames from `bytes` as a ring link does until the bytes end or a
/// frame is refused; returns how many frames were read. Checks that no
/// accepted header announces more than its limit.
fn read_frames(bytes: &[u8], max_data: u64) -> usize {
    let mut r = bytes;
    let mut n = 0;
    loop {
        let h = match read_frame_header(&mut r, max_data) {
            Ok(h) => h,
            Err(_) => return n,
        };
        n += 1;
        match h.kind {
            Kind::Data => {
                assert!(h.len <= max_data, "{h:?} passed a limit of {max_data}");
                if io::copy(&mut (&mut r).take(h.len), &mut io::sink()).unwrap() < h.len {
                    return n;
                }
            }
            Kind::Abort => {
                assert!(h.len <= MAX_ABORT_BYTES, "{h:?}");
                if read_abort(&mut r, h.len).is_err() {
                    return n;
                }
            }
            Kind::Goodbye => {}
        }
    }
}

/// Bytes a real connector sent in a real handshake (hello and proof),
/// recorded once.
fn recorded_connector() -> &'static [u8] {
    static REC: OnceLock<Vec<u8>> = OnceLock::new();
    REC.get_or_init(|| {
        let (mut c, a) = std::os::unix::net::UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || {
            let mut tap = TapReads(a, Vec::new());
            handshake_accept(&mut tap, KEY, JOB, GEN, 0).unwrap();
            tap.1
        });
        handshake_connect(&mut c, KEY, &hello()).unwrap();
        let rec = acceptor.join().unwrap();
        assert_eq!(rec.len(), HELLO_FIXED_LEN + JOB.len() + PROOF_LEN);
        rec
    })
}

/// Records what is read through it.
struct TapReads(std::os::unix::net::UnixStream, Vec<u8>);

impl Read for TapReads {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        let n = self.0.read(b)?;
        self.1.extend_from_slice(&b[..n]);
        Ok(n)
    }
}

impl Write for TapReads {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.write(b)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// One mutation of a byte string.
#[derive(Clone, Debug)]
enum Mutation {
    Truncate(usize),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Append(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..64)
        )
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Append),
    ]
}

fn mutate(mut b: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        let len = b.len();
        match m {
            Mutation::Truncate(i) => b.truncate(i % (len + 1)),
            Mutation::Set(i, v) if len > 0 => b[i % len] = *v,
            Mutation::Set(..) => {}
            Mutation::Insert(i, x) => {
                let at = i % (len + 1);
                b.splice(at..at, x.iter().copied());
            }
            Mutation::Append(x) => b.extend_from_slice(x),
        }
    }
    b
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::Data), Just(Kind::Abort), Just(Kind::Goodbye)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Random bytes as a frame stream.
    #[test]
    fn random_bytes_as_frames(bytes in proptest::collection::vec(any::<u8>(), 0..600), max in 0u64..8192) {
        let (_, largest) = largest_alloc(|| read_frames(&bytes, max));
        prop_assert!(largest <= FRAME_ALLOC_BOUND, "allocated {} bytes", largest);
    }

    /// Valid headers announcing any length (up to 2^64 - 1), then random
    /// bytes: a length over the limit is refused at its header, and
    /// nothing is allocated for it.
    #[test]
    fn frames_announcing_any_length(
        frames in proptest::collection::vec((kind(), any::<u64>(), 0u64..64, any::<bool>()), 1..6),
        tail in proptest::collection::vec(any::<u8>(), 0..200),
        max in 0u64..(1 << 20),
    ) {
        let mut bytes = Vec::new();
        for (kind, len, small, use_small) in frames {
            let len = if use_small { small } else { len };
            let h = Header { kind, job_tag: wire::job_tag(JOB), generation: GEN, seq: 0, len };
            bytes.extend_from_slice(&h.encode());
            bytes.extend(std::iter::repeat_n(7u8, len.min(64) as usize));
        }
        bytes.extend_from_slice(&tail);
        let (_, largest) = largest_alloc(|| read_frames(&bytes, max));
        prop_assert!(largest <= FRAME_ALLOC_BOUND, "allocated {} bytes", largest);
    }

    /// Random bytes, and random bytes after a valid magic and version, as
    /// a hello: read no further than a hello can be long; when one is
    /// parsed, it is exactly the bytes it was read from.
    #[test]
    fn random_bytes_as_a_hello(
        mut bytes in proptest::collection::vec(any::<u8>(), 0..400),
        prefixed in any::<bool>(),
    ) {
        if prefixed {
            let mut b = b"ACRH".to_vec();
            b.extend_from_slice(&wire::VERSION.to_le_bytes());
            b.extend_from_slice(&bytes);
            bytes = b;
        }
        let mut r = &bytes[..];
        let (res, largest) = largest_alloc(|| Hello::read(&mut r));
        let used = bytes.len() - r.len();
        prop_assert!(largest <= HELLO_ALLOC_BOUND, "allocated {} bytes", largest);
        prop_assert!(used <= HELLO_FIXED_LEN + MAX_JOB_ID, "read {} bytes", used);
        if let Ok((h, nonce)) = res {
            prop_assert_eq!(&h.encode(&nonce).unwrap()[..], &bytes[..used]);
        }
    }

    /// Mutations of a valid hello: a truncated one is an error; any other
    /// parses back to exactly its bytes or is an error.
    #[test]
    fn mutated_hellos(
        job in "[a-z0-9-]{0,40}",
        rank in any::<u32>(),
        generation in any::<u64>(),
        ms in proptest::collection::vec(mutation(), 1..4),
    ) {
        let h = Hello { rank, generation, job };
        let valid = h.encode(&[3; NONCE_LEN]).unwrap();
        let bytes = mutate(valid.clone(), &ms);
        let mut r = &bytes[..];
        let (res, largest) = largest_alloc(|| Hello::read(&mut r));
        prop_assert!(largest <= HELLO_ALLOC_BOUND, "allocated {} bytes", largest);
        let used = bytes.len() - r.len();
        if bytes.len() < valid.len() && valid.starts_with(&bytes) {
            prop_assert!(res.is_err(), "a truncated hello parsed");
        }
        if let Ok((h2, nonce)) = res {
            prop_assert_eq!(&h2.encode(&nonce).unwrap()[..], &bytes[..used]);
        }
    }

    /// The accepting side fed random bytes, a valid hello with a random
    /// proof, or a recorded real handshake (mutated or not: a replay):
    /// never accepted, never more written than the challenge and a
    /// refusal, nothing allocated beyond the hello's bound.
    #[test]
    fn the_acceptor_never_accepts_garbage_or_replays(
        random in proptest::collection::vec(any::<u8>(), 0..300),
        proof in proptest::array::uniform32(any::<u8>()),
        ms in proptest::collection::vec(mutation(), 0..3),
        which in 0u8..3,
    ) {
        let input = match which {
            0 => random,
            1 => {
                let mut b = hello().encode(&[5; NONCE_LEN]).unwrap();
                b.extend_from_slice(&proof);
                b.extend_from_slice(&random);
                b
            }
            _ => mutate(recorded_connector().to_vec(), &ms),
        };
        let mut s = Scripted::new(input);
        let (res, largest) = largest_alloc(|| handshake_accept(&mut s, KEY, JOB, GEN, 0));
        prop_assert!(res.is_err(), "accepted: {:?}", res);
        prop_assert!(largest <= HELLO_ALLOC_BOUND, "allocated {} bytes", largest);
        let out = &s.output;
        prop_assert!(
            out.is_empty() || out.len() == NONCE_LEN || (out.len() == NONCE_LEN + 1 && out[NONCE_LEN] == 0),
            "wrote {} bytes", out.len()
        );
    }

    /// The connecting side fed random answers: never trusts them.
    #[test]
    fn the_connector_never_trusts_a_random_answer(
        mut answer in proptest::collection::vec(any::<u8>(), 0..120),
        accept in any::<bool>(),
    ) {
        if accept && answer.len() > NONCE_LEN {
            answer[NONCE_LEN] = 1;
        }
        let mut s = Scripted::new(answer);
        let (res, largest) = largest_alloc(|| handshake_connect(&mut s, KEY, &hello()));
        prop_assert!(res.is_err());
        prop_assert!(largest <= HELLO_ALLOC_BOUND, "allocated {} bytes", largest);
        prop_assert!(s.output.len() <= HELLO_FIXED_LEN + JOB.len() + PROOF_LEN);
    }
}

/// The measurement itself: a large allocation is seen (so the bounds
/// above can fail), and a hello announcing 65 535 bytes of job id or a
/// frame announcing 2^64 - 1 bytes allocates nothing near that.
#[test]
fn the_counter_sees_allocations_and_announced_lengths_allocate_nothing() {
    let (v, largest) = largest_alloc(|| vec![0u8; 100_000]);
    assert!(largest >= 100_000 && v.len() == 100_000, "{largest}");
    let mut b = hello().encode(&[0; NONCE_LEN]).unwrap();
    b[HELLO_FIXED_LEN - 2..HELLO_FIXED_LEN].copy_from_slice(&u16::MAX.to_le_bytes());
    let (r, largest) = largest_alloc(|| Hello::read(&mut &b[..]));
    assert!(r.is_err());
    assert!(largest <= HELLO_ALLOC_BOUND, "{largest}");
    let h = Header {
        kind: Kind::Data,
        job_tag: 0,
        generation: 0,
        seq: 0,
        len: u64::MAX,
    };
    let (n, largest) = largest_alloc(|| read_frames(&h.encode(), 1 << 20));
    assert_eq!(n, 0);
    assert!(largest <= FRAME_ALLOC_BOUND, "{largest}");
    assert_eq!(HEADER_LEN, 40);
}
