//! The ownership record of a checkpoint folder (`OWNER.json`): the one job
//! whose checkpoints the folder holds. It is written atomically (temporary
//! file, fsync, rename, fsync of the folder) before the first checkpoint,
//! and checked before anything in the folder is read or written.

use super::disk::Disk;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const OWNER_FILE: &str = "OWNER.json";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The coordinator's job id (`accrue-worker train`: the job's name).
    pub job_id: String,
    /// The cluster (`--cluster`) of the coordinator; "" without one.
    #[serde(default)]
    pub cluster: String,
    /// SHA-256 of the spec the folder was claimed with (hex).
    #[serde(default)]
    pub spec_hash: String,
    #[serde(default)]
    pub created_unix_ms: i64,
}

/// The record in `dir`, None when there is none. A record that cannot be
/// read is an error naming the file (never taken for "no owner").
pub fn read(dir: &Path) -> Result<Option<Owner>, String> {
    let path = dir.join(OWNER_FILE);
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Why `me` may not use a folder `owner` owns; None when it may.
pub fn refusal(dir: &Path, owner: &Owner, me: &Owner) -> Option<String> {
    (owner.job_id != me.job_id || owner.cluster != me.cluster).then(|| {
        let cluster = |c: &str| {
            if c.is_empty() {
                String::new()
            } else {
                format!(" of cluster {c}")
            }
        };
        format!(
            "checkpoint.dir {} belongs to job {}{} (its {OWNER_FILE}); this is job {}{}: choose another checkpoint.dir (a folder holds one job's checkpoints)",
            dir.display(),
            owner.job_id,
            cluster(&owner.cluster),
            me.job_id,
            cluster(&me.cluster),
        )
    })
}

/// Writes `me` as the folder's owner, atomically and durably.
pub fn claim(disk: &mut dyn Disk, dir: &Path, me: &Owner) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{OWNER_FILE}.tmp-{}", std::process::id()));
    let bytes = serde_json::to_vec_pretty(me).map_err(std::io::Error::other)?;
    disk.write(&tmp, &bytes)?;
    disk.sync_file(&tmp)?;
    disk.rename(&tmp, &dir.join(OWNER_FILE))?;
    disk.sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(job: &str, cluster: &str) -> Owner {
        Owner {
            job_id: job.into(),
            cluster: cluster.into(),
            spec_hash: "ab".into(),
            created_unix_ms: 1,
        }
    }

    #[test]
    fn only_the_same_job_of_the_same_cluster_may_use_a_folder() {
        let d = Path::new("/ck");
        assert_eq!(refusal(d, &owner("j-1", "c"), &owner("j-1", "c")), None);
        // The spec hash may change (a resumed run with more epochs).
        let mut other_spec = owner("j-1", "c");
        other_spec.spec_hash = "cd".into();
        assert_eq!(refusal(d, &owner("j-1", "c"), &other_spec), None);
        let e = refusal(d, &owner("j-1", "c"), &owner("j-2", "c")).unwrap();
        assert!(
            e.contains("belongs to job j-1 of cluster c") && e.contains("this is job j-2"),
            "{e}"
        );
        assert!(refusal(d, &owner("j-1", "a"), &owner("j-1", "b")).is_some());
    }

    #[test]
    fn a_claim_reads_back_and_leaves_no_temporary_file() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()).unwrap(), None);
        claim(&mut super::super::disk::Local, d.path(), &owner("j-1", "")).unwrap();
        assert_eq!(read(d.path()).unwrap(), Some(owner("j-1", "")));
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![OWNER_FILE.to_string()]);
        std::fs::write(d.path().join(OWNER_FILE), b"{not json").unwrap();
        assert!(read(d.path()).unwrap_err().contains(OWNER_FILE));
    }
}
