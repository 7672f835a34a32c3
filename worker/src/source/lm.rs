//! What the language-model readers share: mapping a file, the errors that
//! name the spec field, checking the options, reading the indices on the
//! host and building a batch.

use super::{TokenOptions, IGNORE_INDEX};
use crate::error::{Error, Result, TorchContext};
use crate::source::batch::Batch;
use memmap2::Mmap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// An error about the file that `field` names:
/// `data.path = "x.bin": <reason>`.
pub(crate) fn file_err(field: &'static str, path: &Path, reason: impl Into<String>) -> Error {
    Error::Field {
        field,
        value: format!("{:?}", path.display().to_string()),
        reason: reason.into(),
    }
}

/// A token out of `0..vocab_size` at `position` (`where_` adds context,
/// e.g. the row).
pub(crate) fn token_err(
    field: &'static str,
    path: &Path,
    token: i64,
    position: usize,
    vocab_size: i64,
    where_: &str,
) -> Error {
    let what = if token < 0 {
        "negative".to_string()
    } else {
        format!(">= model.vocab_size = {vocab_size}")
    };
    file_err(
        field,
        path,
        format!("token {token} at position {position}{where_} is {what}"),
    )
}

/// A file mapped read-only, with the open file kept to check its length.
#[derive(Debug)]
pub(crate) struct Mapped {
    map: Mmap,
    file: std::fs::File,
}

impl std::ops::Deref for Mapped {
    type Target = Mmap;

    fn deref(&self) -> &Mmap {
        &self.map
    }
}

impl Mapped {
    /// Refuses a file that became shorter than the map: reading a page
    /// past its end would kill the process with SIGBUS (an in-place
    /// rewrite truncates it). Called before a batch touches the map. A
    /// file replaced by a rename is not seen: the map and the open file
    /// keep the old inode.
    pub(crate) fn check_len(&self, field: &'static str, path: &Path) -> Result<()> {
        let now = self
            .file
            .metadata()
            .map_err(|e| file_err(field, path, format!("cannot stat: {e}")))?
            .len();
        let mapped = self.map.len() as u64;
        if now < mapped {
            return Err(file_err(
                field,
                path,
                format!(
                    "shrank from {mapped} to {now} bytes while the job read it; rewrite token \
                     files by writing a new file and renaming it (accrue tokenize does)"
                ),
            ));
        }
        Ok(())
    }
}

/// Maps `path` read-only. The map is not read here: pages come in as the
/// reader touches them.
pub(crate) fn map_file(field: &'static str, path: &Path) -> Result<Mapped> {
    let file = std::fs::File::open(path)
        .map_err(|e| file_err(field, path, format!("cannot open: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| file_err(field, path, format!("cannot stat: {e}")))?
        .len();
    if len == 0 {
        return Err(file_err(field, path, "is empty (0 bytes)"));
    }
    // SAFETY: the map is read-only. A file truncated under it faults
    // (SIGBUS) on the pages past its new end rather than corrupting memory;
    // the readers check the length (`Mapped::check_len`) before each batch,
    // which leaves only a truncation between that check and the copy, and
    // `accrue tokenize` replaces its files by a rename, never in place.
    let map = unsafe { Mmap::map(&file) }
        .map_err(|e| file_err(field, path, format!("cannot map: {e}")))?;
    Ok(Mapped { map, file })
}

/// Hints the kernel that the map is about to be read front to back (the
/// whole-file validation at open).
pub(crate) fn advise_sequential(map: &Mmap) {
    #[cfg(unix)]
    {
        let _ = map.advise(memmap2::Advice::Sequential);
    }
    #[cfg(not(unix))]
    let _ = map;
}

/// Hints the kernel that the map is read at random places (batches).
pub(crate) fn advise_random(map: &Mmap) {
    #[cfg(unix)]
    {
        let _ = map.advise(memmap2::Advice::Random);
    }
    #[cfg(not(unix))]
    let _ = map;
}

/// Refuses options no batch can be built with.
pub(crate) fn check_options(opts: &TokenOptions, padded: bool) -> Result<()> {
    if opts.seq_len == 0 {
        return Err(Error::Field {
            field: "data.seq_len",
            value: "0".into(),
            reason: "a sample needs at least 1 position".into(),
        });
    }
    if opts.seq_len > i64::MAX as usize / 2 {
        return Err(Error::Field {
            field: "data.seq_len",
            value: opts.seq_len.to_string(),
            reason: "is too large".into(),
        });
    }
    if opts.vocab_size < 1 {
        return Err(Error::Field {
            field: "model.vocab_size",
            value: opts.vocab_size.to_string(),
            reason: "must be at least 1".into(),
        });
    }
    if padded && !(0..opts.vocab_size).contains(&opts.pad_id) {
        return Err(Error::Field {
            field: "data.pad_id",
            value: opts.pad_id.to_string(),
            reason: format!(
                "is an input token: it must lie in 0..model.vocab_size = 0..{}",
                opts.vocab_size
            ),
        });
    }
    Ok(())
}

/// The sample indices of a batch, read on the host (they may live on a
/// CUDA device) and checked against `0..len`.
pub(crate) fn host_indices(
    indices: &Tensor,
    len: usize,
    field: &'static str,
    path: &Path,
) -> Result<Vec<usize>> {
    let host = indices
        .f_to_device(Device::Cpu)
        .and_then(|t| t.f_to_kind(Kind::Int64))
        .and_then(|t| t.f_contiguous())
        .and_then(|t| t.f_reshape([-1]))
        .ctx("reading sample indices")?;
    let raw = Vec::<i64>::try_from(&host).ctx("reading sample indices")?;
    raw.into_iter()
        .map(|j| {
            usize::try_from(j)
                .ok()
                .filter(|&j| j < len)
                .ok_or_else(|| file_err(field, path, format!("sample {j} is out of 0..{len}")))
        })
        .collect()
}

/// `inputs` and `targets` (row-major `[rows, seq_len]`) as a batch on
/// `device`; `count` = the targets that are not [`IGNORE_INDEX`], counted
/// on the host.
pub(crate) fn lm_batch(
    inputs: &[i64],
    targets: &[i64],
    rows: usize,
    seq_len: usize,
    device: Device,
) -> Result<Batch> {
    debug_assert_eq!(inputs.len(), rows * seq_len);
    debug_assert_eq!(targets.len(), rows * seq_len);
    let count = targets.iter().filter(|&&t| t != IGNORE_INDEX).count() as u64;
    let shape = [rows as i64, seq_len as i64];
    let make = |v: &[i64]| {
        Tensor::f_from_slice(v)
            .and_then(|t| t.f_view(shape))
            .and_then(|t| t.f_to_device(device))
            .ctx("building a token batch")
    };
    Ok(Batch {
        inputs: make(inputs)?,
        targets: make(targets)?,
        count,
    })
}
