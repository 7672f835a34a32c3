//! One owner per checkpoint folder (issue 27; docs/OPERATIONS.md, "Recovery"): the rule
//! the coordinator applies at submit, as pure functions.
//!
//! **Decision.** A job's effective checkpoint folder is its spec's
//! `checkpoint.dir` or, when unset, `<state-dir>/checkpoints/<job-id>`
//! ([`accrue_proto::layout::default_checkpoint_dir`]), made absolute and
//! lexically normal (`.` and `..` removed as a string would be, never
//! reading the file system: the coordinator may not see the workers'
//! files). A submission is refused (FAILED_PRECONDITION) when its folder
//!
//! - is the folder of a job the coordinator knows, in any state (a
//!   finished job's checkpoints are its result, and a failed or cancelled
//!   one may be resumed from them),
//! - lies inside such a folder, or contains one (pruning `keep` and the
//!   newest-step search of one job would see the other's steps),
//! - names a folder under (or containing) the default root
//!   `<state-dir>/checkpoints/`, which is reserved for the default folders
//!   of job ids: a spec could otherwise squat the folder a future job id
//!   will use by default.
//!
//! The shell adds what only the file system shows: a folder whose
//! ownership record (`OWNER.json`, written by the workers before the
//! first checkpoint) names a job is refused too, since a new job has never
//! written one. The workers check the record again before they read or
//! write anything.

use accrue_common::spec::normalize;
use accrue_proto::v1::JobState;
use std::fmt;
use std::path::{Path, PathBuf};

/// The ownership record's file name in a checkpoint folder.
pub const OWNER_FILE: &str = "OWNER.json";

/// Where a job's checkpoints go, absolute and lexically normal: the spec's
/// folder (under `checkpoint_root` when it is relative and a root is
/// configured, as the path confinement places it; else against `cwd`, the
/// coordinator's folder) or the default one of `job_id` under `state_dir`.
/// Pure.
pub fn effective_dir(
    spec_dir: Option<&Path>,
    job_id: &str,
    state_dir: &Path,
    checkpoint_root: Option<&Path>,
    cwd: &Path,
) -> PathBuf {
    let dir = match spec_dir {
        None => accrue_proto::layout::default_checkpoint_dir(state_dir, job_id),
        Some(d) => match checkpoint_root {
            Some(root) => root.join(d),
            None => d.to_path_buf(),
        },
    };
    normalize(&cwd.join(dir))
}

/// The default-folder root, `<state-dir>/checkpoints`, absolute and
/// lexically normal. Pure.
pub fn default_root(state_dir: &Path, cwd: &Path) -> PathBuf {
    normalize(&cwd.join(accrue_proto::layout::default_checkpoint_dir(state_dir, "")))
}

/// A folder a known job claims.
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    pub job: String,
    pub state: JobState,
    /// Its effective folder ([`effective_dir`]).
    pub dir: PathBuf,
}

/// How a new folder meets a claimed one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Relation {
    Same,
    /// The new folder lies inside the other.
    Inside,
    /// The new folder contains the other.
    Contains,
}

impl Relation {
    /// How `new` meets `other` (None: apart). Component-wise: `/a/bc` is
    /// not inside `/a/b`.
    pub fn of(new: &Path, other: &Path) -> Option<Relation> {
        if new == other {
            Some(Relation::Same)
        } else if new.starts_with(other) {
            Some(Relation::Inside)
        } else if other.starts_with(new) {
            Some(Relation::Contains)
        } else {
            None
        }
    }

    fn words(self) -> &'static str {
        match self {
            Relation::Same => "is",
            Relation::Inside => "lies inside",
            Relation::Contains => "contains",
        }
    }
}

/// The folder a submission names, for messages: `explicit` false when the
/// spec sets no `checkpoint.dir` (the default folder).
#[derive(Clone, Debug, PartialEq)]
pub struct Folder {
    pub dir: PathBuf,
    pub explicit: bool,
}

impl fmt::Display for Folder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.explicit {
            write!(f, "checkpoint.dir {}", self.dir.display())
        } else {
            write!(
                f,
                "checkpoint.dir (unset: the default folder {})",
                self.dir.display()
            )
        }
    }
}

/// What a job that owns a folder can be told to do instead.
fn hint(owner: &str, state: JobState) -> String {
    match state {
        JobState::Failed | JobState::Cancelled => {
            format!("; to continue job {owner} from its checkpoints, run `accrue resume {owner}`")
        }
        JobState::Succeeded => format!("; job {owner} succeeded: its checkpoints are its result"),
        _ => String::new(),
    }
}

/// Why a submission's checkpoint folder is refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DirConflict {
    /// The folder meets the folder of a known job.
    #[error("{folder} {} {}, the checkpoint folder of job {owner} ({}); a checkpoint folder belongs to one job: choose another checkpoint.dir{}",
        relation.words(), owner_dir.display(), crate::domain::state_name(*state), hint(owner, *state))]
    Claimed {
        folder: Folder,
        relation: Relation,
        owner: String,
        state: JobState,
        owner_dir: PathBuf,
    },
    /// The folder lies under (or contains) the default-folder root.
    #[error("{folder} {} {}, reserved for the default checkpoint folders of jobs (<state-dir>/checkpoints/<job-id>): leave checkpoint.dir unset to get one, or choose a folder outside it",
        if *contains { "contains" } else { "lies under" }, root.display())]
    Reserved {
        folder: Folder,
        root: PathBuf,
        contains: bool,
    },
    /// The folder holds an ownership record naming a job (`state`: that
    /// job's, when the coordinator knows it).
    #[error("{folder} holds the ownership record {OWNER_FILE} of job {owner}{}; a checkpoint folder belongs to one job: choose another checkpoint.dir{}",
        state.map(|s| format!(" ({})", crate::domain::state_name(s))).unwrap_or_else(|| " (not known to this coordinator)".into()),
        state.map(|s| hint(owner, s)).unwrap_or_default())]
    Recorded {
        folder: Folder,
        owner: String,
        state: Option<JobState>,
    },
    /// The folder holds an ownership record that cannot be read.
    #[error("{folder} holds an ownership record {OWNER_FILE} that cannot be read ({reason}); a checkpoint folder belongs to one job: choose another checkpoint.dir")]
    Unreadable { folder: Folder, reason: String },
}

/// The submission rule (see the module notes), pure: `new` is the
/// submission's effective folder, `known` every job's, `root` the
/// default-folder root. A default folder (`new.explicit` false) is not
/// refused for lying under the root: that is where it belongs.
pub fn check(new: &Folder, known: &[Claim], root: &Path) -> Result<(), DirConflict> {
    if new.explicit {
        if let Some(rel) = Relation::of(&new.dir, root) {
            return Err(DirConflict::Reserved {
                folder: new.clone(),
                root: root.to_path_buf(),
                contains: rel == Relation::Contains,
            });
        }
    }
    for c in known {
        if let Some(relation) = Relation::of(&new.dir, &c.dir) {
            return Err(DirConflict::Claimed {
                folder: new.clone(),
                relation,
                owner: c.job.clone(),
                state: c.state,
                owner_dir: c.dir.clone(),
            });
        }
    }
    Ok(())
}

/// The decision on an ownership record found in the folder (pure):
/// `record` is the file's text (None: there is none), `state_of` the
/// state of a job the coordinator knows. A new job has never written a
/// record, so any record names another job.
pub fn check_record(
    folder: &Folder,
    record: Option<&str>,
    state_of: impl Fn(&str) -> Option<JobState>,
) -> Result<(), DirConflict> {
    let Some(text) = record else { return Ok(()) };
    let owner = serde_json::from_str::<serde_json::Value>(text)
        .map_err(|e| e.to_string())
        .and_then(|v| {
            v.get("job_id")
                .and_then(|j| j.as_str())
                .map(str::to_string)
                .ok_or_else(|| "it names no job_id".to_string())
        });
    match owner {
        Ok(owner) => Err(DirConflict::Recorded {
            folder: folder.clone(),
            state: state_of(&owner),
            owner,
        }),
        Err(reason) => Err(DirConflict::Unreadable {
            folder: folder.clone(),
            reason,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn claim(job: &str, state: JobState, dir: &str) -> Claim {
        Claim {
            job: job.into(),
            state,
            dir: p(dir),
        }
    }

    fn explicit(d: &str) -> Folder {
        Folder {
            dir: p(d),
            explicit: true,
        }
    }

    const ROOT: &str = "/state/checkpoints";

    #[test]
    fn effective_folders_are_absolute_and_lexically_normal() {
        let cwd = p("/home/u");
        let state = p("/state");
        assert_eq!(
            effective_dir(None, "j-3", &state, None, &cwd),
            p("/state/checkpoints/j-3")
        );
        assert_eq!(
            effective_dir(Some(Path::new("ck/./a/../b")), "j-3", &state, None, &cwd),
            p("/home/u/ck/b")
        );
        assert_eq!(
            effective_dir(
                Some(Path::new("run")),
                "j",
                &state,
                Some(Path::new("/srv/ck")),
                &cwd
            ),
            p("/srv/ck/run")
        );
        assert_eq!(
            effective_dir(Some(Path::new("/x/y/")), "j", Path::new("st"), None, &cwd),
            p("/x/y")
        );
        assert_eq!(
            default_root(Path::new("st"), &cwd),
            p("/home/u/st/checkpoints")
        );
    }

    #[test]
    fn a_folder_of_another_job_is_refused_naming_it() {
        let known = [
            claim("a-1", JobState::Running, "/ck/a"),
            claim("b-2", JobState::Failed, "/ck/b"),
            claim("c-3", JobState::Succeeded, "/state/checkpoints/c-3"),
        ];
        let root = p(ROOT);
        // Apart (a sibling whose name starts the same is apart).
        assert_eq!(check(&explicit("/ck/ab"), &known, &root), Ok(()));
        assert_eq!(check(&explicit("/elsewhere"), &known, &root), Ok(()));
        let e = check(&explicit("/ck/a"), &known, &root).unwrap_err();
        assert_eq!(
            e.to_string(),
            "checkpoint.dir /ck/a is /ck/a, the checkpoint folder of job a-1 (running); a checkpoint folder belongs to one job: choose another checkpoint.dir"
        );
        let e = check(&explicit("/ck/b/inner"), &known, &root)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lies inside /ck/b, the checkpoint folder of job b-2 (failed)")
                && e.contains("run `accrue resume b-2`"),
            "{e}"
        );
        let e = check(&explicit("/ck"), &known, &root)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/ck contains /ck/a") && e.contains("job a-1"),
            "{e}"
        );
        // A default folder someone's spec squatted before the rule.
        let squatted = [claim(
            "old-1",
            JobState::Succeeded,
            "/state/checkpoints/j-9",
        )];
        let e = check(
            &Folder {
                dir: p("/state/checkpoints/j-9"),
                explicit: false,
            },
            &squatted,
            &root,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("checkpoint.dir (unset: the default folder /state/checkpoints/j-9) is")
                && e.contains("job old-1 (succeeded)")
                && e.contains("its checkpoints are its result"),
            "{e}"
        );
    }

    #[test]
    fn the_default_root_is_reserved_for_default_folders() {
        let root = p(ROOT);
        for (dir, contains) in [
            ("/state/checkpoints/j-7", false),
            ("/state/checkpoints", false),
            ("/state", true),
            ("/", true),
        ] {
            match check(&explicit(dir), &[], &root) {
                Err(DirConflict::Reserved { contains: c, .. }) => assert_eq!(c, contains, "{dir}"),
                other => panic!("{dir}: {other:?}"),
            }
        }
        let e = check(&explicit("/state/checkpoints/j-7"), &[], &root)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "checkpoint.dir /state/checkpoints/j-7 lies under /state/checkpoints, reserved"
            ),
            "{e}"
        );
        // A job's own default folder is where it belongs.
        let own = Folder {
            dir: p("/state/checkpoints/j-7"),
            explicit: false,
        };
        assert_eq!(check(&own, &[], &root), Ok(()));
        assert_eq!(check(&explicit("/state/other"), &[], &root), Ok(()));
    }

    #[test]
    fn an_ownership_record_in_the_folder_refuses_the_submission() {
        let f = explicit("/ck/x");
        let known = |j: &str| (j == "x-1").then_some(JobState::Cancelled);
        assert_eq!(check_record(&f, None, known), Ok(()));
        let e = check_record(&f, Some(r#"{"job_id": "x-1", "cluster": ""}"#), known)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("holds the ownership record OWNER.json of job x-1 (cancelled)")
                && e.contains("accrue resume x-1"),
            "{e}"
        );
        let e = check_record(&f, Some(r#"{"job_id": "gone-4"}"#), known)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job gone-4 (not known to this coordinator)"),
            "{e}"
        );
        for bad in ["{not json", r#"{"cluster": "c"}"#] {
            assert!(matches!(
                check_record(&f, Some(bad), known),
                Err(DirConflict::Unreadable { .. })
            ));
        }
    }

    fn seg() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            Just("ab".to_string()),
            Just("..".to_string()),
            Just(".".to_string()),
            Just("checkpoints".to_string()),
            Just("state".to_string()),
        ]
    }

    fn path() -> impl Strategy<Value = PathBuf> {
        proptest::collection::vec(seg(), 0..5)
            .prop_map(|v| normalize(&p(&format!("/{}", v.join("/")))))
    }

    proptest! {
        /// Accepted folders never meet a known one nor the reserved root;
        /// refused ones always do, and the refusal names the first job in
        /// the way. The rule is symmetric: if B may join a world holding
        /// A, A would have been refused in a world holding B only when
        /// they meet.
        #[test]
        fn accepted_folders_are_disjoint(new in path(), others in proptest::collection::vec(path(), 0..5), explicit_dir in any::<bool>()) {
            let root = p("/state/checkpoints");
            let known: Vec<Claim> = others.iter().enumerate()
                .map(|(i, d)| claim(&format!("j-{i}"), JobState::Running, d.to_str().unwrap()))
                .collect();
            let folder = Folder { dir: new.clone(), explicit: explicit_dir };
            let meets = |a: &Path, b: &Path| a.starts_with(b) || b.starts_with(a);
            match check(&folder, &known, &root) {
                Ok(()) => {
                    for c in &known { prop_assert!(!meets(&new, &c.dir)); }
                    if explicit_dir { prop_assert!(!meets(&new, &root)); }
                }
                Err(DirConflict::Reserved { .. }) => prop_assert!(explicit_dir && meets(&new, &root)),
                Err(DirConflict::Claimed { owner, owner_dir, relation, .. }) => {
                    let first = known.iter().find(|c| meets(&new, &c.dir)).unwrap();
                    prop_assert_eq!(&owner, &first.job);
                    prop_assert_eq!(&owner_dir, &first.dir);
                    prop_assert_eq!(Some(relation), Relation::of(&new, &first.dir));
                    for c in &known {
                        let accepted_alone = check(&Folder { dir: c.dir.clone(), explicit: false }, &[claim("n", JobState::Pending, new.to_str().unwrap())], &root).is_ok();
                        prop_assert_eq!(accepted_alone, !meets(&new, &c.dir));
                    }
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
    }
}
