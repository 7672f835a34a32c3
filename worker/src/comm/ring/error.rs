//! The ring's own errors: every failure names the peer and what was being done.

use crate::comm::wire;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum CommError {
    #[error("lost rank {rank} ({addr}) during {during}: {reason}")]
    PeerLost {
        rank: usize,
        addr: String,
        during: String,
        reason: String,
    },
    #[error("rank {rank} ({addr}) was silent for {secs:.1} s during {during} (comm timeout)")]
    Timeout {
        rank: usize,
        addr: String,
        secs: f64,
        during: String,
    },
    #[error("lost rank {lost} (reported by rank {reporter}): {reason}")]
    Aborted {
        lost: usize,
        reporter: usize,
        reason: String,
    },
    #[error("protocol error from rank {rank} ({addr}): {reason}")]
    Protocol {
        rank: usize,
        addr: String,
        reason: String,
    },
    #[error("cannot form the ring: {0}")]
    Setup(String),
    #[error("buffer of {got} elements, the ring expects {want} on every rank")]
    Size { got: usize, want: usize },
    #[error(transparent)]
    Wire(#[from] wire::WireError),
}

impl CommError {
    /// The rank this error blames, if any.
    pub fn lost_rank(&self) -> Option<usize> {
        match self {
            CommError::PeerLost { rank, .. } | CommError::Timeout { rank, .. } => Some(*rank),
            CommError::Aborted { lost, .. } => Some(*lost),
            _ => None,
        }
    }
}

/// The ring below the collective interface: its errors travel boxed (the
/// worker's error takes them out again as `Error::Comm`).
impl From<CommError> for crate::comm::collective::CollectiveError {
    fn from(e: CommError) -> Self {
        crate::comm::collective::CollectiveError::Transport(Box::new(e))
    }
}
