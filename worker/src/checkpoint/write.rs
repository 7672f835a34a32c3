//! Writing a step folder (see the module documentation of
//! checkpoint/mod.rs): the whole payload at once ([`write`]), or in parts
//! by several processes, a pipeline's stages ([`begin_step`],
//! [`write_part`], [`finish_step`]).

use super::disk::{self, Disk};
use super::owner::{self, Owner};
use super::{
    ckpt_err, manifest, prune, step_name, Payload, TrainerState, WriteOptions, LATEST,
    OPTIMIZER_FILE, TRAINER_FILE,
};
use crate::error::Result;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// Writes step-`state.step` durably and atomically, points LATEST at it and
/// prunes to the newest `keep` (see the module documentation).
pub fn write(
    dir: &Path,
    state: &TrainerState,
    model: &[(String, Tensor)],
    optimizer: &[(String, Tensor)],
    extra: &[(String, Vec<u8>)],
    opts: &WriteOptions,
) -> Result<PathBuf> {
    let mut payload = Payload::new(state, model, optimizer, opts.max_shard)?;
    payload.extra = extra.to_vec();
    write_on(&mut disk::Local, dir, state.step, &payload, opts)
}

/// Claims `dir` for `me` unless it is claimed: refused when another job
/// owns it.
pub fn claim(disk: &mut dyn Disk, dir: &Path, me: &Owner) -> Result<()> {
    match owner::read(dir).map_err(|e| ckpt_err(dir, e))? {
        Some(o) => match owner::refusal(dir, &o, me) {
            Some(r) => Err(ckpt_err(dir, r)),
            None => Ok(()),
        },
        None => {
            let existed = dir.is_dir();
            disk.create_dir_all(dir)
                .map_err(|e| ckpt_err(dir, format!("creating the folder: {e}")))?;
            if !existed {
                if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                    disk.sync_dir(parent)
                        .map_err(|e| ckpt_err(parent, format!("fsync: {e}")))?;
                }
            }
            owner::claim(disk, dir, me)
                .map_err(|e| ckpt_err(dir, format!("writing {}: {e}", owner::OWNER_FILE)))
        }
    }
}

/// [`write`] on `disk`, with the payload already serialised.
pub fn write_on(
    disk: &mut dyn Disk,
    dir: &Path,
    step: u64,
    payload: &Payload,
    opts: &WriteOptions,
) -> Result<PathBuf> {
    claim(disk, dir, &opts.owner)?;
    let name = step_name(step);
    let tmp = temporary(dir, step);
    if let Err(e) = write_step(disk, &tmp, step, payload) {
        abandon_step(disk, &tmp);
        return Err(ckpt_err(
            dir,
            format!(
                "writing {name} failed: {e}; {} (the temporary folder was removed)",
                latest_says(dir)
            ),
        ));
    }
    publish(disk, dir, step, &tmp, opts)
}

/// Step `step`'s temporary folder in `dir` (this process's).
fn temporary(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!(".{}.tmp-{}", step_name(step), std::process::id()))
}

/// Removes a temporary folder after a failed write (best effort: a
/// crashed process cannot, the sweep at the next start does).
pub fn abandon_step(disk: &mut dyn Disk, tmp: &Path) {
    if tmp.exists() {
        let _ = disk.remove_dir_all(tmp);
    }
}

/// A step folder written by several processes (pipeline stages, issue
/// 40, each writing its own tensors): the writer claims `dir` and makes
/// the step's temporary folder, which it returns; every part then writes
/// its files there ([`write_part`]) and the writer ends with
/// [`finish_step`], listing them all in the manifest. The rules are
/// [`write`]'s: nothing is visible before the rename, and a failure
/// removes the temporary folder ([`abandon_step`]).
pub fn begin_step(disk: &mut dyn Disk, dir: &Path, step: u64, owner: &Owner) -> Result<PathBuf> {
    claim(disk, dir, owner)?;
    let tmp = temporary(dir, step);
    fresh_dir(disk, &tmp)
        .map_err(|e| ckpt_err(dir, format!("writing {}: {e}", step_name(step))))?;
    Ok(tmp)
}

/// Writes `files` into `tmp`, each fsynced; their manifest entries.
pub fn write_part(
    disk: &mut dyn Disk,
    tmp: &Path,
    files: &[(&str, &[u8])],
) -> std::result::Result<Vec<manifest::Entry>, String> {
    for &(name, bytes) in files {
        let path = tmp.join(name);
        disk.write(&path, bytes).map_err(at(&path))?;
        disk.sync_file(&path).map_err(at(&path))?;
    }
    Ok(manifest::Manifest::of(0, files).files)
}

/// The manifest of every part's `entries` into `tmp`, then the folder
/// renamed into place and LATEST pointed at it ([`write`]'s rules).
pub fn finish_step(
    disk: &mut dyn Disk,
    dir: &Path,
    step: u64,
    tmp: &Path,
    entries: Vec<manifest::Entry>,
    opts: &WriteOptions,
) -> Result<PathBuf> {
    let m = manifest::Manifest {
        step,
        files: entries,
    };
    if let Err(e) = write_manifest(disk, tmp, &m) {
        abandon_step(disk, tmp);
        return Err(ckpt_err(
            dir,
            format!(
                "writing {} failed: {e}; {} (the temporary folder was removed)",
                step_name(step),
                latest_says(dir)
            ),
        ));
    }
    publish(disk, dir, step, tmp, opts)
}

/// The complete temporary folder `tmp` renamed into step `step`'s place,
/// LATEST pointed at it, older steps pruned.
fn publish(
    disk: &mut dyn Disk,
    dir: &Path,
    step: u64,
    tmp: &Path,
    opts: &WriteOptions,
) -> Result<PathBuf> {
    let name = step_name(step);
    let final_dir = dir.join(&name);
    let publish = |disk: &mut dyn Disk| -> std::io::Result<()> {
        if final_dir.exists() {
            disk.remove_dir_all(&final_dir)?;
        }
        disk.rename(tmp, &final_dir)?;
        disk.sync_dir(dir)
    };
    if let Err(e) = publish(disk) {
        abandon_step(disk, tmp);
        return Err(ckpt_err(&final_dir, format!("renaming into place: {e}")));
    }
    let latest_tmp = dir.join(format!(".{LATEST}.tmp-{}", std::process::id()));
    let point = |disk: &mut dyn Disk| -> std::io::Result<()> {
        disk.write(&latest_tmp, format!("{name}\n").as_bytes())?;
        disk.sync_file(&latest_tmp)?;
        disk.rename(&latest_tmp, &dir.join(LATEST))?;
        disk.sync_dir(dir)
    };
    if let Err(e) = point(disk) {
        if latest_tmp.exists() {
            let _ = disk.remove_file(&latest_tmp);
        }
        return Err(ckpt_err(
            &dir.join(LATEST),
            format!("pointing LATEST at {name} (complete, kept): {e}"),
        ));
    }
    prune(disk, dir, opts.keep, step, opts.protect_upto)?;
    Ok(final_dir)
}

fn at(path: &Path) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", path.display())
}

/// `tmp` empty (a leftover of a crashed write removed first).
fn fresh_dir(disk: &mut dyn Disk, tmp: &Path) -> std::result::Result<(), String> {
    if tmp.exists() {
        disk.remove_dir_all(tmp).map_err(at(tmp))?;
    }
    disk.create_dir_all(tmp).map_err(at(tmp))
}

/// The manifest into `tmp`, fsynced, then the folder.
fn write_manifest(
    disk: &mut dyn Disk,
    tmp: &Path,
    m: &manifest::Manifest,
) -> std::result::Result<(), String> {
    let path = tmp.join(manifest::MANIFEST_FILE);
    let text = serde_json::to_vec_pretty(m).map_err(|e| e.to_string())?;
    disk.write(&path, &text).map_err(at(&path))?;
    disk.sync_file(&path).map_err(at(&path))?;
    disk.sync_dir(tmp).map_err(at(tmp))
}

/// The files of one step into `tmp`, each fsynced, the manifest last, then
/// the folder.
fn write_step(
    disk: &mut dyn Disk,
    tmp: &Path,
    step: u64,
    p: &Payload,
) -> std::result::Result<(), String> {
    fresh_dir(disk, tmp)?;
    let mut files: Vec<(&str, &[u8])> = p
        .model
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect();
    files.push((OPTIMIZER_FILE, &p.optimizer));
    files.push((TRAINER_FILE, &p.trainer));
    files.extend(p.extra.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    let files = write_part(disk, tmp, &files)?;
    write_manifest(disk, tmp, &manifest::Manifest { step, files })
}

/// "LATEST still names step-N" (or that there is none), for errors.
pub fn latest_says(dir: &Path) -> String {
    match std::fs::read_to_string(dir.join(LATEST)) {
        Ok(s) => format!("LATEST still names {}", s.trim()),
        Err(_) => "no LATEST yet".into(),
    }
}
