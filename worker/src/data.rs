//! Data set readers: MNIST (IDX files), CIFAR-10 (binary batches), `tensors`
//! (a safetensors file with `x` and integer `y`) and `synthetic` (seeded).
//! Each returns the whole split in memory as (x: f32 [N, ...], y: i64 [N]).
//! Errors name the file and what is wrong with it.

use crate::error::{io_err, Error, Result, TorchContext};
use crate::rng::Mt19937;
use crate::spec::{DataKind, DataSpec};
use std::path::Path;
use tch::{Device, Kind, Tensor};

pub use accrue_common::spec::{CIFAR_FILES, MNIST_FILES};
const CIFAR_RECORD: usize = 1 + 3 * 32 * 32;
const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
const IDX_LABELS_MAGIC: u32 = 0x0000_0801;

/// One split held in memory.
#[derive(Debug)]
pub struct Dataset {
    /// f32 [N, ...]
    pub x: Tensor,
    /// i64 [N]
    pub y: Tensor,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.y.size().first().copied().unwrap_or(0) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Per-sample shape (without the leading N).
    pub fn sample_shape(&self) -> Vec<i64> {
        self.x.size()[1..].to_vec()
    }

    pub fn to_device(self, device: Device) -> Result<Self> {
        Ok(Self {
            x: self
                .x
                .f_to_device(device)
                .ctx("moving data to the device")?,
            y: self
                .y
                .f_to_device(device)
                .ctx("moving data to the device")?,
        })
    }

    /// The samples at `indices` (a micro-batch), on the data's device.
    pub fn batch(&self, indices: &Tensor) -> Result<(Tensor, Tensor)> {
        let x = self
            .x
            .f_index_select(0, indices)
            .ctx("gathering a micro-batch")?;
        let y = self
            .y
            .f_index_select(0, indices)
            .ctx("gathering a micro-batch")?;
        Ok((x, y))
    }

    /// Largest label + 1.
    pub fn classes(&self) -> Result<i64> {
        if self.is_empty() {
            return Ok(0);
        }
        let m = self.y.f_max().ctx("reading labels")?;
        Ok(m.f_int64_value(&[]).ctx("reading labels")? + 1)
    }
}

/// Training split, optional held-out split.
#[derive(Debug)]
pub struct Splits {
    pub train: Dataset,
    pub eval: Option<Dataset>,
}

pub fn load(spec: &DataSpec, seed: u64) -> Result<Splits> {
    let path = || spec.path.clone().unwrap_or_default();
    match spec.kind {
        DataKind::Mnist => load_mnist(&path()),
        DataKind::Cifar10 => load_cifar10(&path()),
        DataKind::Tensors => Ok(Splits {
            train: read_tensors(&path())?,
            eval: spec.eval_path.as_deref().map(read_tensors).transpose()?,
        }),
        DataKind::Synthetic => synthetic(spec, seed),
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(io_err(path))
}

fn data_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Data {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Parses an IDX3 unsigned-byte image file: returns (n, rows, cols, pixels).
pub fn parse_idx_images(bytes: &[u8], path: &Path) -> Result<(usize, usize, usize, Vec<u8>)> {
    if bytes.len() < 16 {
        return Err(data_err(
            path,
            format!(
                "truncated IDX header: {} bytes, an image file needs 16",
                bytes.len()
            ),
        ));
    }
    let magic = be_u32(bytes, 0);
    if magic != IDX_IMAGES_MAGIC {
        return Err(data_err(
            path,
            format!(
                "bad magic number {magic:#010x}, an IDX image file has {IDX_IMAGES_MAGIC:#010x}"
            ),
        ));
    }
    let (n, rows, cols) = (
        be_u32(bytes, 4) as usize,
        be_u32(bytes, 8) as usize,
        be_u32(bytes, 12) as usize,
    );
    // In u128: three u32 factors cannot overflow it (a corrupt header must
    // be an error, not an overflow).
    let want = n as u128 * rows as u128 * cols as u128;
    let have = bytes.len() - 16;
    if have as u128 != want {
        return Err(data_err(
            path,
            format!(
                "{} the header declares {n} images of {rows}x{cols} = {want} pixel bytes, the file holds {have}",
                if (have as u128) < want { "truncated:" } else { "trailing bytes:" }
            ),
        ));
    }
    Ok((n, rows, cols, bytes[16..].to_vec()))
}

/// Parses an IDX1 unsigned-byte label file.
pub fn parse_idx_labels(bytes: &[u8], path: &Path) -> Result<Vec<u8>> {
    if bytes.len() < 8 {
        return Err(data_err(
            path,
            format!(
                "truncated IDX header: {} bytes, a label file needs 8",
                bytes.len()
            ),
        ));
    }
    let magic = be_u32(bytes, 0);
    if magic != IDX_LABELS_MAGIC {
        return Err(data_err(
            path,
            format!(
                "bad magic number {magic:#010x}, an IDX label file has {IDX_LABELS_MAGIC:#010x}"
            ),
        ));
    }
    let n = be_u32(bytes, 4) as usize;
    let have = bytes.len() - 8;
    if have != n {
        return Err(data_err(
            path,
            format!(
                "{} the header declares {n} labels, the file holds {have}",
                if have < n {
                    "truncated:"
                } else {
                    "trailing bytes:"
                }
            ),
        ));
    }
    Ok(bytes[8..].to_vec())
}

fn images_to_tensor(pixels: &[u8], shape: [i64; 4]) -> Result<Tensor> {
    Tensor::from_slice(pixels)
        .f_view(shape)
        .and_then(|t| t.f_to_kind(Kind::Float))
        .and_then(|t| t.f_div_scalar(255.0))
        .ctx("converting images")
}

fn labels_to_tensor(labels: &[u8]) -> Result<Tensor> {
    Tensor::from_slice(labels)
        .f_to_kind(Kind::Int64)
        .ctx("converting labels")
}

fn load_mnist_split(dir: &Path, images: &str, labels: &str) -> Result<Dataset> {
    let ipath = dir.join(images);
    let lpath = dir.join(labels);
    let (n, rows, cols, pixels) = parse_idx_images(&read(&ipath)?, &ipath)?;
    let labs = parse_idx_labels(&read(&lpath)?, &lpath)?;
    if labs.len() != n {
        return Err(data_err(
            &lpath,
            format!(
                "holds {} labels but {} holds {n} images",
                labs.len(),
                ipath.display()
            ),
        ));
    }
    Ok(Dataset {
        x: images_to_tensor(&pixels, [n as i64, 1, rows as i64, cols as i64])?,
        y: labels_to_tensor(&labs)?,
    })
}

pub fn load_mnist(dir: &Path) -> Result<Splits> {
    Ok(Splits {
        train: load_mnist_split(dir, MNIST_FILES[0], MNIST_FILES[1])?,
        eval: Some(load_mnist_split(dir, MNIST_FILES[2], MNIST_FILES[3])?),
    })
}

/// Parses one CIFAR-10 binary batch: records of 1 label byte + 3072 pixels.
pub fn parse_cifar(bytes: &[u8], path: &Path) -> Result<(Vec<u8>, Vec<u8>)> {
    if bytes.is_empty() || !bytes.len().is_multiple_of(CIFAR_RECORD) {
        return Err(data_err(
            path,
            format!(
                "size {} is not a positive multiple of the {CIFAR_RECORD}-byte CIFAR-10 record \
                 ({} whole records and {} bytes left over)",
                bytes.len(),
                bytes.len() / CIFAR_RECORD,
                bytes.len() % CIFAR_RECORD
            ),
        ));
    }
    let n = bytes.len() / CIFAR_RECORD;
    let mut labels = Vec::with_capacity(n);
    let mut pixels = Vec::with_capacity(n * (CIFAR_RECORD - 1));
    for (i, rec) in bytes.chunks_exact(CIFAR_RECORD).enumerate() {
        if rec[0] > 9 {
            return Err(data_err(
                path,
                format!("record {i} has label {}, CIFAR-10 labels are 0..=9", rec[0]),
            ));
        }
        labels.push(rec[0]);
        pixels.extend_from_slice(&rec[1..]);
    }
    Ok((labels, pixels))
}

fn load_cifar_files(dir: &Path, files: &[&str]) -> Result<Dataset> {
    let mut labels = Vec::new();
    let mut pixels = Vec::new();
    for f in files {
        let p = dir.join(f);
        let (l, px) = parse_cifar(&read(&p)?, &p)?;
        labels.extend(l);
        pixels.extend(px);
    }
    let n = labels.len() as i64;
    Ok(Dataset {
        x: images_to_tensor(&pixels, [n, 3, 32, 32])?,
        y: labels_to_tensor(&labels)?,
    })
}

pub fn load_cifar10(dir: &Path) -> Result<Splits> {
    Ok(Splits {
        train: load_cifar_files(dir, &CIFAR_FILES[..5])?,
        eval: Some(load_cifar_files(dir, &CIFAR_FILES[5..])?),
    })
}

/// Reads a safetensors file holding `x` (floating point, [N, ...]) and `y`
/// (integer, [N]).
pub fn read_tensors(path: &Path) -> Result<Dataset> {
    let named = Tensor::read_safetensors(path).map_err(|e| data_err(path, e.to_string()))?;
    let find = |name: &str| {
        named
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
            .ok_or_else(|| {
                let names: Vec<_> = named.iter().map(|(n, _)| n.as_str()).collect();
                data_err(
                    path,
                    format!("has no tensor {name:?} (it holds {names:?}; need x and y)"),
                )
            })
    };
    let x = find("x")?;
    let y = find("y")?;
    if !x.is_floating_point() {
        return Err(data_err(
            path,
            format!("x has dtype {:?}, need a floating-point type", x.kind()),
        ));
    }
    if !matches!(
        y.kind(),
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
    ) {
        return Err(data_err(
            path,
            format!("y has dtype {:?}, need an integer type", y.kind()),
        ));
    }
    let (xs, ys) = (x.size(), y.size());
    if ys.len() != 1 || xs.is_empty() || xs[0] != ys[0] {
        return Err(data_err(
            path,
            format!("x has shape {xs:?} and y {ys:?}; need x [N, ...] and y [N] with the same N"),
        ));
    }
    let y = y.f_to_kind(Kind::Int64).ctx("converting labels")?;
    if ys[0] > 0 {
        let min = y
            .f_min()
            .and_then(|m| m.f_int64_value(&[]))
            .ctx("reading labels")?;
        if min < 0 {
            return Err(data_err(path, format!("y holds a negative label ({min})")));
        }
    }
    Ok(Dataset {
        x: x.f_to_kind(Kind::Float).ctx("converting x")?,
        y,
    })
}

/// A seeded, learnable classification task: x ~ N(0, 1), y = argmax(x . w).
pub fn synthetic(spec: &DataSpec, seed: u64) -> Result<Splits> {
    let shape = spec.shape.clone().unwrap_or_else(|| vec![32]);
    let classes = spec.classes.unwrap_or(10) as usize;
    let n = spec.samples.unwrap_or(1024) as usize;
    let n_eval = spec.eval_samples.unwrap_or(256) as usize;
    let features: usize = shape.iter().product::<i64>() as usize;
    let mut rng = Mt19937::new(seed ^ 0x5eed_da7a);
    let w: Vec<f32> = (0..features * classes).map(|_| rng.next_normal()).collect();
    let mut make = |count: usize| {
        let x: Vec<f32> = (0..count * features).map(|_| rng.next_normal()).collect();
        let y: Vec<i64> = x
            .chunks_exact(features.max(1))
            .map(|row| {
                let mut scores = vec![0f32; classes];
                for (i, v) in row.iter().enumerate() {
                    for (c, s) in scores.iter_mut().enumerate() {
                        *s += v * w[i * classes + c];
                    }
                }
                (0..classes)
                    .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
                    .unwrap_or(0) as i64
            })
            .collect();
        let mut full = vec![count as i64];
        full.extend_from_slice(&shape);
        let x = Tensor::from_slice(&x)
            .f_view(full.as_slice())
            .ctx("shaping synthetic data")?;
        Ok::<_, Error>(Dataset {
            x,
            y: Tensor::from_slice(&y),
        })
    };
    let train = make(n)?;
    let eval = if n_eval > 0 {
        Some(make(n_eval)?)
    } else {
        None
    };
    Ok(Splits { train, eval })
}
