//! What the flood tests of a listening port (the ring's data port, the
//! c10d store's) look at: this process's threads by name, and whether the
//! far end closed a connection. Included by path where the whole of
//! `common` is not needed.

/// Threads of this process whose name starts with `prefix` (Linux cuts
/// names at 15 bytes).
pub fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.starts_with(prefix))
        .count()
}

/// Whether the other end has closed `s` (non-blocking; data is drained).
pub fn closed_by_peer(s: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}
