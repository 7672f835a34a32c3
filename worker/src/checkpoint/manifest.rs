//! A step folder's manifest (`MANIFEST.json`, written last into the folder
//! before it is renamed into place): every file's name, size and CRC-32.
//! A step whose files all match their manifest is complete; anything else
//! (a file missing, cut short, changed, or the manifest itself missing) is
//! not, and recovery skips it naming why.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

pub const MANIFEST_FILE: &str = "MANIFEST.json";

/// One file of a step folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub bytes: u64,
    /// CRC-32 (IEEE) of the contents.
    pub crc32: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The step the folder holds (the folder's name says it too).
    pub step: u64,
    pub files: Vec<Entry>,
}

impl Manifest {
    /// The manifest of `files` (name, contents) for `step`.
    pub fn of(step: u64, files: &[(&str, &[u8])]) -> Self {
        Self {
            step,
            files: files
                .iter()
                .map(|(name, bytes)| Entry {
                    name: name.to_string(),
                    bytes: bytes.len() as u64,
                    crc32: crc32fast::hash(bytes),
                })
                .collect(),
        }
    }
}

/// Reads the manifest of `folder` and every file it lists, checking sizes
/// and checksums; returns the files' contents by name. The error is one
/// line naming what does not match.
pub fn read_verified(folder: &Path, step: u64) -> Result<BTreeMap<String, Vec<u8>>, String> {
    read_verified_only(folder, step, |_| true)
}

/// [`read_verified`] for the listed files `wanted` takes only (`accrue
/// sample` reads the model, not the optimizer state); the others are
/// neither read nor checked.
pub fn read_verified_only(
    folder: &Path,
    step: u64,
    wanted: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let files = verified(folder, step, wanted, |_| true)?;
    Ok(files
        .into_iter()
        .filter_map(|(n, b)| Some((n, b?)))
        .collect())
}

/// Verifies every file `folder`'s manifest lists, reading each in pieces;
/// returns every file's name with the contents of those `keep` takes
/// (a reader that maps the large files: they are never held whole).
pub fn verify_keeping(
    folder: &Path,
    step: u64,
    keep: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, Option<Vec<u8>>>, String> {
    verified(folder, step, |_| true, keep)
}

/// The files `wanted` takes checked, by name, with the contents of those
/// `keep` takes.
fn verified(
    folder: &Path,
    step: u64,
    wanted: impl Fn(&str) -> bool,
    keep: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, Option<Vec<u8>>>, String> {
    let text = match std::fs::read(folder.join(MANIFEST_FILE)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("no {MANIFEST_FILE} (an unfinished write)"));
        }
        Err(e) => return Err(format!("{MANIFEST_FILE}: {e}")),
    };
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("{MANIFEST_FILE}: {e}"))?;
    if manifest.step != step {
        return Err(format!(
            "{MANIFEST_FILE} is for step {}, the folder for step {step}",
            manifest.step
        ));
    }
    let mut out = BTreeMap::new();
    for e in &manifest.files {
        if e.name.contains('/') || e.name.starts_with('.') {
            return Err(format!(
                "{MANIFEST_FILE} lists {:?}, not a file name",
                e.name
            ));
        }
        if !wanted(&e.name) {
            continue;
        }
        let (len, crc, bytes) = if keep(&e.name) {
            let bytes =
                std::fs::read(folder.join(&e.name)).map_err(|err| format!("{}: {err}", e.name))?;
            (bytes.len() as u64, crc32fast::hash(&bytes), Some(bytes))
        } else {
            let (len, crc) =
                crc_of(&folder.join(&e.name)).map_err(|err| format!("{}: {err}", e.name))?;
            (len, crc, None)
        };
        if len != e.bytes {
            return Err(format!(
                "{}: {len} bytes, the manifest says {}",
                e.name, e.bytes
            ));
        }
        if crc != e.crc32 {
            return Err(format!(
                "{}: checksum {crc:08x}, the manifest says {:08x}",
                e.name, e.crc32
            ));
        }
        out.insert(e.name.clone(), bytes);
    }
    Ok(out)
}

/// A file's length and CRC-32, read 1 MiB at a time.
fn crc_of(path: &Path) -> std::io::Result<(u64, u32)> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok((len, h.finalize()));
        }
        h.update(&buf[..n]);
        len += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(files: &[(&str, &[u8])], step: u64) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (n, b) in files {
            std::fs::write(d.path().join(n), b).unwrap();
        }
        let m = Manifest::of(step, files);
        std::fs::write(
            d.path().join(MANIFEST_FILE),
            serde_json::to_vec(&m).unwrap(),
        )
        .unwrap();
        d
    }

    #[test]
    fn a_complete_folder_verifies_and_every_damage_is_named() {
        let files: &[(&str, &[u8])] = &[("a.bin", b"hello"), ("b.json", b"{}")];
        let d = folder(files, 7);
        let got = read_verified(d.path(), 7).unwrap();
        assert_eq!(got["a.bin"], b"hello");
        assert_eq!(got.len(), 2);
        // Wrong step.
        assert!(read_verified(d.path(), 8)
            .unwrap_err()
            .contains("for step 7"));
        // Truncated.
        std::fs::write(d.path().join("a.bin"), b"hel").unwrap();
        let e = read_verified(d.path(), 7).unwrap_err();
        assert!(e.contains("a.bin: 3 bytes, the manifest says 5"), "{e}");
        // Same size, other bytes.
        std::fs::write(d.path().join("a.bin"), b"jello").unwrap();
        let e = read_verified(d.path(), 7).unwrap_err();
        assert!(e.contains("a.bin: checksum"), "{e}");
        // Missing file.
        std::fs::remove_file(d.path().join("a.bin")).unwrap();
        assert!(read_verified(d.path(), 7)
            .unwrap_err()
            .starts_with("a.bin:"));
        // No manifest.
        std::fs::remove_file(d.path().join(MANIFEST_FILE)).unwrap();
        assert!(read_verified(d.path(), 7)
            .unwrap_err()
            .contains("no MANIFEST.json"));
    }
}
