//! The coordinator's vocabulary, at the bottom of its layers: who asks
//! ([`Caller`]), how a generation's ring key is made ([`RingKeys`]) and a
//! job state's name ([`state_name`]). It imports nothing from this crate
//! and no transport library (no gRPC, no HTTP): every layer above may use
//! it, and the adapters translate into it (auth turns a principal into a
//! [`Caller`]).

/// A job's state; the proto's enum is the domain's (the names below are
/// how it is shown).
pub use accrue_proto::v1::JobState;

/// A state's name in messages, JSON and the CLI.
pub fn state_name(s: JobState) -> &'static str {
    match s {
        JobState::Unspecified => "unspecified",
        JobState::Pending => "pending",
        JobState::Rendezvous => "rendezvous",
        JobState::Running => "running",
        JobState::Recovering => "recovering",
        JobState::Succeeded => "succeeded",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

/// Who asks for a change to a job.
#[derive(Clone, Debug, PartialEq)]
pub enum Caller {
    /// Authentication is off (no tokens file): anyone may change any job.
    Anyone,
    /// An authenticated principal; `admin` when its token holds that scope.
    Principal { name: String, admin: bool },
}

impl Caller {
    /// Who asks, for a transition's reason.
    pub fn who(&self) -> String {
        match self {
            Caller::Anyone => "a client (authentication off)".into(),
            Caller::Principal { name, admin: true } => format!("{name} (admin)"),
            Caller::Principal { name, .. } => name.clone(),
        }
    }
}

/// The ring key of a job's generation: HKDF from the coordinator's master
/// secret in the service (`RingMaster::keys`, one layer up), any pure
/// function in tests. The scheduler only calls it when it forms a
/// generation and puts the key in that generation's Assignments.
pub type RingKeys = Box<dyn Fn(&str, u64) -> Vec<u8> + Send>;
