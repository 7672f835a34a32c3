//! `accrue-worker train --profile PATH` (issue 31): libtorch's profiler
//! (Kineto, what torch.profiler drives; the shim is csrc/profile.cpp) over
//! a few optimizer steps, written as a Chrome trace, so accrue's own CPU
//! ops and CUDA kernels can be read next to a PyTorch loop's
//! (worker/benches/lm_gpu_profile.py sums them by kind). Which steps: the
//! pure [`decide`]; the engine's run loop is the shell around it.

use crate::error::{Error, Result};
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

extern "C" {
    fn accrue_profiler_start(cuda: i32, err: *mut c_char, len: usize) -> i32;
    fn accrue_profiler_stop(path: *const c_char, err: *mut c_char, len: usize) -> i64;
}

/// What to profile: the `steps` optimizer steps after the first
/// `after_steps` of this run (warm-up and graph captures left out), into
/// `path`.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub path: PathBuf,
    pub after_steps: u64,
    pub steps: u64,
}

/// What the run loop does before its next micro-step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Start,
    Stop,
    Nothing,
}

/// The decision at a window boundary (`in_window`: a micro-step of the
/// window in flight has run; the profiler starts and stops only between
/// windows) after `steps_run` optimizer steps of this run; `done`: the run
/// has no step left (a running profile is stopped and written then).
pub fn decide(
    p: &Profile,
    steps_run: u64,
    in_window: bool,
    running: bool,
    done: bool,
    finished: bool,
) -> Act {
    if in_window || finished {
        return Act::Nothing;
    }
    let end = p.after_steps.saturating_add(p.steps);
    match running {
        false if !done && steps_run >= p.after_steps && steps_run < end => Act::Start,
        true if done || steps_run >= end => Act::Stop,
        _ => Act::Nothing,
    }
}

fn message(buf: &[c_char]) -> String {
    // SAFETY: the shim NUL-terminates what it writes, and the buffer
    // starts zeroed (an empty message if it wrote nothing).
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// A profiling session on this thread, from [`Session::start`] to
/// [`Session::finish`] (or drop, which stops without writing).
#[must_use = "the profile is written by finish"]
pub struct Session {
    open: bool,
}

impl Session {
    /// Starts recording CPU ops, and CUDA kernels when `cuda`.
    pub fn start(cuda: bool) -> Result<Self> {
        let mut buf = [0 as c_char; 1024];
        // SAFETY: a plain C function of the shim; it catches every C++
        // exception and writes at most buf.len() bytes into buf.
        if unsafe { accrue_profiler_start(i32::from(cuda), buf.as_mut_ptr(), buf.len()) } != 0 {
            return Err(Error::Profiler(format!("starting: {}", message(&buf))));
        }
        Ok(Self { open: true })
    }

    /// Stops recording and writes the Chrome trace to `path`; returns the
    /// number of events recorded.
    pub fn finish(mut self, path: &std::path::Path) -> Result<u64> {
        // A path libtorch cannot take leaves the session open: drop stops it.
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            Error::Profiler(format!("the path {} holds a NUL byte", path.display()))
        })?;
        self.open = false;
        stop(Some(&c)).map_err(|e| Error::Profiler(format!("writing {}: {e}", path.display())))
    }
}

/// Stops the profiler, writing its trace to `path` when one is given; the
/// number of events, or libtorch's message.
fn stop(path: Option<&CStr>) -> std::result::Result<u64, String> {
    let mut buf = [0 as c_char; 1024];
    let path = path.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: a plain C function of the shim; it catches every C++
    // exception and writes at most buf.len() bytes into buf; `path` is
    // null (write nothing) or a NUL-terminated string that outlives the
    // call.
    let n = unsafe { accrue_profiler_stop(path, buf.as_mut_ptr(), buf.len()) };
    u64::try_from(n).map_err(|_| message(&buf))
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.open {
            if let Err(e) = stop(None) {
                tracing::warn!(error = %e, "stopping the profiler");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(after: u64, steps: u64) -> Profile {
        Profile {
            path: "t.json".into(),
            after_steps: after,
            steps,
        }
    }

    #[test]
    fn starts_after_the_warm_up_and_stops_after_its_steps() {
        let pr = p(2, 3);
        assert_eq!(decide(&pr, 0, false, false, false, false), Act::Nothing);
        assert_eq!(
            decide(&pr, 2, true, false, false, false),
            Act::Nothing,
            "mid-window"
        );
        assert_eq!(decide(&pr, 2, false, false, false, false), Act::Start);
        assert_eq!(decide(&pr, 4, false, true, false, false), Act::Nothing);
        assert_eq!(decide(&pr, 5, false, true, false, false), Act::Stop);
        assert_eq!(
            decide(&pr, 5, false, false, false, true),
            Act::Nothing,
            "once"
        );
        // A run shorter than the profile: stopped (and written) at its end.
        assert_eq!(decide(&pr, 3, false, true, true, false), Act::Stop);
        // A run that ends before the profile starts never starts it.
        assert_eq!(decide(&pr, 2, false, false, true, false), Act::Nothing);
    }

    proptest! {
        /// Driven over a run of n windows, the profile covers exactly the
        /// steps after..min(after + steps, n), starting and stopping once.
        #[test]
        fn covers_exactly_its_steps(after in 0u64..20, steps in 1u64..10, n in 0u64..40) {
            let pr = p(after, steps);
            let (mut running, mut finished, mut covered, mut starts) = (false, false, 0u64, 0);
            for step in 0..=n {
                let done = step == n;
                match decide(&pr, step, false, running, done, finished) {
                    Act::Start => { running = true; starts += 1; }
                    Act::Stop => { running = false; finished = true; }
                    Act::Nothing => {}
                }
                if running && !done {
                    covered += 1;
                }
            }
            prop_assert!(!running, "left running");
            let want = n.min(after + steps).saturating_sub(after);
            prop_assert_eq!(covered, want);
            prop_assert_eq!(starts, u64::from(want > 0));
        }
    }
}
