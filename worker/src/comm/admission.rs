//! What the data plane's listening ports (a ring rank's data port, the
//! c10d store of a generation) let in: at most so many handshakes at once,
//! (the store) no connection once every rank it serves is connected, and
//! one deadline for a whole handshake (both), so idle, slow or countless
//! clients can neither exhaust a process's threads and file descriptors
//! nor hold a place for long (docs/SECURITY.md, "Handshake" and "c10d
//! groups").

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Why an incoming connection is closed before its handshake starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{limit} handshakes are in progress already (the limit)")]
    Handshakes { limit: usize },
    #[error("all {ranks} ranks this port serves are connected already")]
    Ranks { ranks: usize },
}

/// Whether one more incoming connection may start a handshake while
/// `pending` handshakes run and `connected` authenticated peers are served,
/// with at most `max_pending` handshakes at once and `ranks` peers in all.
/// Pure: the acceptors call it for every connection.
pub fn admit(
    pending: usize,
    connected: usize,
    max_pending: usize,
    ranks: usize,
) -> Result<(), Refusal> {
    if connected >= ranks {
        return Err(Refusal::Ranks { ranks });
    }
    if pending >= max_pending {
        return Err(Refusal::Handshakes { limit: max_pending });
    }
    Ok(())
}

/// A stream whose every read and write ends by one deadline (a per-call
/// timeout alone would let a peer that sends a byte at a time hold it
/// forever).
pub struct Deadline<'a> {
    s: &'a mut TcpStream,
    end: Instant,
}

impl<'a> Deadline<'a> {
    /// `s`, until `limit` from now.
    pub fn new(s: &'a mut TcpStream, limit: Duration) -> Self {
        Self {
            s,
            end: Instant::now() + limit,
        }
    }

    fn left(&self) -> io::Result<Duration> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_read_timeout(Some(left))?;
        self.s.read(buf).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer before the handshake's deadline",
            ),
            _ => e,
        })
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.s.set_write_timeout(Some(left))?;
        self.s.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.s.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_admitted_below_both_limits_only() {
        assert_eq!(admit(0, 0, 64, 2), Ok(()));
        assert_eq!(admit(63, 1, 64, 2), Ok(()));
        assert_eq!(admit(64, 1, 64, 2), Err(Refusal::Handshakes { limit: 64 }));
        assert_eq!(admit(0, 2, 64, 2), Err(Refusal::Ranks { ranks: 2 }));
        // Every rank connected: refused whatever the handshakes.
        assert_eq!(admit(64, 2, 64, 2), Err(Refusal::Ranks { ranks: 2 }));
        assert_eq!(admit(0, 0, 0, 2), Err(Refusal::Handshakes { limit: 0 }));
    }

    #[test]
    fn the_deadline_covers_the_whole_exchange() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut d = Deadline::new(&mut s, Duration::from_millis(300));
        let started = Instant::now();
        let mut got = 0;
        let mut buf = [0u8; 1];
        // A byte every 100 ms: each read is quick, the whole is cut.
        let e = loop {
            c.write_all(b"x").unwrap();
            match d.read(&mut buf) {
                Ok(n) => got += n,
                Err(e) => break e,
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(got >= 2, "{got} bytes read before the deadline");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
