//! Data set readers: MNIST (IDX files), CIFAR-10 (binary batches), `tensors`
//! (a safetensors file with `x` and integer `y`) and `synthetic` (seeded).
//! Each returns the whole split in memory as (x: f32 [N, ...], y: i64 [N]).
//! Errors name the file and what is wrong with it.

use crate::error::{io_err, Error, Result, TorchContext};
use crate::source::batch::Batch;
use crate::source::rng::Mt19937;
use crate::source::DataSource;
use crate::spec::{DataKind, DataSpec, MAX_CLASSES};
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
        self.x
            .size()
            .get(1..)
            .map(<[i64]>::to_vec)
            .unwrap_or_default()
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
    pub fn batch(&self, indices: &Tensor) -> Result<Batch> {
        let x = self
            .x
            .f_index_select(0, indices)
            .ctx("gathering a micro-batch")?;
        let y = self
            .y
            .f_index_select(0, indices)
            .ctx("gathering a micro-batch")?;
        let n = y.size().first().copied().unwrap_or(0) as u64;
        Ok(Batch::per_sample(x, y, n))
    }

    /// Largest label + 1.
    pub fn classes(&self) -> Result<i64> {
        Ok(self.max_label()?.map_or(0, |m| m.label + 1))
    }

    /// The largest label and the first sample holding it (None: no samples).
    pub fn max_label(&self) -> Result<Option<MaxLabel>> {
        if self.is_empty() {
            return Ok(None);
        }
        let at = self
            .y
            .f_argmax(0, false)
            .and_then(|i| i.f_int64_value(&[]))
            .ctx("reading labels")?;
        let label = self.y.f_int64_value(&[at]).ctx("reading labels")?;
        Ok(Some(MaxLabel { label, sample: at }))
    }
}

impl DataSource for Dataset {
    fn len(&self) -> usize {
        Dataset::len(self)
    }

    fn batch(&self, indices: &Tensor) -> Result<Batch> {
        Dataset::batch(self, indices)
    }

    /// A view of the held tensors (no gather).
    fn range(&self, start: i64, len: i64, _device: Device) -> Result<Batch> {
        let x = self.x.f_narrow(0, start, len).ctx("evaluating")?;
        let y = self.y.f_narrow(0, start, len).ctx("evaluating")?;
        Ok(Batch::per_sample(x, y, len as u64))
    }

    fn resident(&self) -> Vec<(&'static str, Tensor)> {
        vec![
            ("data.x", self.x.shallow_clone()),
            ("data.y", self.y.shallow_clone()),
        ]
    }
}

/// A split's largest label and the first sample (0-based) holding it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxLabel {
    pub label: i64,
    pub sample: i64,
}

/// The class count the model is built with: `model.num_classes`, which
/// every label must be below, or (unset) the largest label + 1, which must
/// not pass [`MAX_CLASSES`]. `labels`: each split's description ("the
/// training split (data.path = ...)") and its largest label (None: empty).
/// Checked before the model is built, so a bad label is a field error and
/// never a libtorch loss error or a huge output layer.
pub fn class_count(num_classes: Option<i64>, labels: &[(String, Option<MaxLabel>)]) -> Result<i64> {
    let largest = labels
        .iter()
        .filter_map(|(split, m)| m.map(|m| (split, m)))
        .max_by_key(|(_, m)| m.label);
    match (num_classes, largest) {
        (Some(n), Some((split, m))) if m.label >= n => Err(Error::Field {
            field: "model.num_classes",
            value: n.to_string(),
            reason: format!(
                "label {} at sample {} of {split} is out of range (labels must be in 0..={})",
                m.label,
                m.sample,
                n - 1
            ),
        }),
        (Some(n), _) => Ok(n),
        (None, Some((split, m))) if m.label >= MAX_CLASSES => Err(Error::Field {
            field: "model.num_classes",
            value: format!(
                "{} (unset: inferred from the labels)",
                m.label.saturating_add(1)
            ),
            reason: format!(
                "label {} at sample {} of {split} is above the limit of {MAX_CLASSES} classes; \
                 fix the labels",
                m.label, m.sample
            ),
        }),
        (None, m) => Ok(m.map_or(0, |(_, m)| m.label + 1)),
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
        // Token data is read lazily (source::tokens, source::sequences);
        // the engine's workload never asks this loader for it.
        DataKind::Sequences | DataKind::Tokens => Err(Error::Data {
            path: path(),
            reason: format!(
                "data.kind = \"{}\" is read by the language-model sources, not loaded whole",
                spec.kind.as_str()
            ),
        }),
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
    if rows == 0 || cols == 0 {
        return Err(data_err(
            path,
            format!(
                "the header declares images of rows = {rows}, columns = {cols}; \
                 an image needs at least 1 of each"
            ),
        ));
    }
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
    let named = Tensor::read_safetensors(path)
        .map_err(|e| data_err(path, crate::error::torch_text("reading a tensors file", &e)))?;
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
    check_sample_shape(path, &xs)?;
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

/// Refuses an `x` of shape `xs` ([N, ...]) whose samples are not at least
/// 1-D or hold no value: a model would be built with zero inputs (a
/// libtorch panic in weight initialization) or fail in its first layer.
pub fn check_sample_shape(path: &Path, xs: &[i64]) -> Result<()> {
    if xs.len() < 2 {
        return Err(data_err(
            path,
            format!(
                "x has shape {xs:?}: need x [N, features...] with at least 2 dimensions \
                 (a 1-D x has no feature dimension; store it as [N, 1])"
            ),
        ));
    }
    if xs[1..].contains(&0) {
        return Err(data_err(
            path,
            format!(
                "x has shape {xs:?}: every sample must hold at least one value \
                 (no dimension after N may be 0)"
            ),
        ));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn max(label: i64, sample: i64) -> Option<MaxLabel> {
        Some(MaxLabel { label, sample })
    }

    #[test]
    fn labels_are_checked_against_num_classes() {
        let train = "the training split (data.path = \"d\")".to_string();
        let eval = "the held-out split (data.eval_path = \"e\")".to_string();
        let labels = [(train.clone(), max(1, 3)), (eval.clone(), max(4, 7))];
        let msg = class_count(Some(2), &labels).unwrap_err().to_string();
        assert_eq!(
            msg,
            "model.num_classes = 2: label 4 at sample 7 of the held-out split \
             (data.eval_path = \"e\") is out of range (labels must be in 0..=1)"
        );
        assert_eq!(class_count(Some(5), &labels).unwrap(), 5);
        // Unset: the largest label + 1, up to the limit.
        assert_eq!(class_count(None, &labels).unwrap(), 5);
        assert_eq!(class_count(None, &[(train.clone(), None)]).unwrap(), 0);
        let last = MAX_CLASSES - 1;
        assert_eq!(
            class_count(None, &[(train.clone(), max(last, 0))]).unwrap(),
            MAX_CLASSES
        );
        let msg = class_count(None, &[(train, max(1_000_000_000, 2))])
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "model.num_classes = 1000000001 (unset: inferred from the labels): label 1000000000 \
             at sample 2 of the training split (data.path = \"d\") is above the limit of \
             1048576 classes; fix the labels"
        );
    }

    #[test]
    fn samples_must_be_at_least_1_d_and_non_empty() {
        let p = Path::new("x.safetensors");
        assert!(check_sample_shape(p, &[200, 3]).is_ok());
        assert!(check_sample_shape(p, &[0, 3, 4]).is_ok());
        let msg = check_sample_shape(p, &[200, 0]).unwrap_err().to_string();
        assert!(
            msg.starts_with("data file x.safetensors: x has shape [200, 0]: every sample"),
            "{msg}"
        );
        let msg = check_sample_shape(p, &[8, 3, 0]).unwrap_err().to_string();
        assert!(msg.contains("[8, 3, 0]"), "{msg}");
        let msg = check_sample_shape(p, &[8]).unwrap_err().to_string();
        assert!(
            msg.contains("x has shape [8]: need x [N, features...]"),
            "{msg}"
        );
    }

    #[test]
    fn idx_images_without_rows_or_columns_are_refused() {
        let mut bytes = vec![0, 0, 8, 3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 28];
        let msg = parse_idx_images(&bytes, Path::new("i"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "data file i: the header declares images of rows = 0, columns = 28; \
             an image needs at least 1 of each"
        );
        bytes[11] = 28;
        bytes[15] = 0;
        assert!(parse_idx_images(&bytes, Path::new("i")).is_err());
    }
}
