//! Lines on stdout that never stop a job: a reader that went away (a
//! closed pipe, `accrue local | head`) or any other write error is noted
//! once on stderr and the output dropped from then on. `println!` would
//! panic there, and `accrue local`'s workers die with it.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes `args` and a newline to stdout, flushed; nothing once stdout
/// failed.
pub fn line(args: std::fmt::Arguments<'_>) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out
        .write_fmt(format_args!("{args}\n"))
        .and_then(|()| out.flush())
    {
        if !CLOSED.swap(true, Ordering::Relaxed) {
            // stderr may be gone too: nothing more to do then.
            let _ = writeln!(
                std::io::stderr(),
                "stdout is closed ({e}): its output is dropped from here on"
            );
        }
    }
}

/// Whether a write to stdout failed (its reader went away).
pub fn closed() -> bool {
    CLOSED.load(Ordering::Relaxed)
}

/// `println!` through [`line`].
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))
    };
}

/// `eprintln!` that ignores a closed stderr (`2>&1 | head`).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// stderr for the log lines: a closed stderr drops them. (tracing's
/// writer reports a failed write with `eprintln!`, which panics there.)
pub struct QuietStderr;

impl Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
