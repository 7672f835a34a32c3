//! TensorBoard's event file format, written by hand (no crate on
//! crates.io that is kept up fits: `tensorboard-rs` is unmaintained).
//!
//! A file is a sequence of TFRecords, each
//!
//! ```text
//! u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes
//! payload (length bytes)     | u32 masked CRC-32C of the payload
//! ```
//!
//! (masked: `((crc >> 15) | (crc << 17)) + 0xa282ead8`), whose payloads
//! are serialized `tensorboard.Event` messages: the first says
//! `file_version: "brain.Event:2"`, the others carry a wall time, a step
//! and a `Summary`. The messages below are the few fields of
//! tensorboard/compat/proto/{event,summary,tensor,tensor_shape}.proto that
//! are written, with their field numbers (checked against TensorBoard
//! 2.21's generated descriptors).

use prost::Message;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// The version string of the first event of every file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// `DataType.DT_STRING` (tensorflow/core/framework/types.proto).
const DT_STRING: i32 = 7;

/// `tensorboard.Event` (event.proto): `what` is a oneof there; one of
/// `file_version` and `summary` is set here.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorboard.Summary` (summary.proto).
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorboard.Summary.Value`: `value` is a oneof there; one of
/// `simple_value` and `tensor` is set here.
#[derive(Clone, PartialEq, Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorboard.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
    #[prost(string, tag = "2")]
    pub display_name: String,
    #[prost(string, tag = "3")]
    pub summary_description: String,
}

/// `tensorboard.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorboard.TensorProto`: a string tensor.
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShapeProto>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorboard.TensorShapeProto` (no dims: a scalar).
#[derive(Clone, PartialEq, Message)]
pub struct TensorShapeProto {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

/// `tensorboard.TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, Message)]
pub struct Dim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), byte-wise
/// from a table built at compile time.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82f6_3b78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The CRC as TFRecord stores it.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    // ((crc >> 15) | (crc << 17)) + 0xa282ead8, wrapping.
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Appends `payload` framed as one TFRecord to `out`.
pub fn frame(payload: &[u8], out: &mut Vec<u8>) {
    let len = (payload.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
}

/// The payloads of the TFRecords in `bytes`, each checked against its
/// CRCs (Err names the first bad record; a torn last record is an error).
pub fn read_records(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let n = out.len();
        if bytes.len() < 12 {
            return Err(format!(
                "record {n}: {} bytes left, a header is 12",
                bytes.len()
            ));
        }
        let (len, rest) = bytes.split_at(8);
        let crc = u32::from_le_bytes(rest[..4].try_into().unwrap_or_default());
        if crc != masked_crc(len) {
            return Err(format!("record {n}: the length's CRC does not match"));
        }
        let len = u64::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
        let rest = &rest[4..];
        if rest.len() < len.saturating_add(4) {
            return Err(format!(
                "record {n}: {len} bytes announced, {} left",
                rest.len()
            ));
        }
        let (payload, rest) = rest.split_at(len);
        let crc = u32::from_le_bytes(rest[..4].try_into().unwrap_or_default());
        if crc != masked_crc(payload) {
            return Err(format!("record {n}: the payload's CRC does not match"));
        }
        out.push(payload.to_vec());
        bytes = &rest[4..];
    }
    Ok(out)
}

/// `events.out.tfevents.<unix secs>.<host>.<pid>.<n>`, as TensorFlow's
/// writers name their files (TensorBoard reads the files whose name holds
/// `tfevents`, in name order: the zero-padded time keeps them in the order
/// they were made).
pub fn file_name(unix_secs: u64, host: &str, pid: u32, n: u64) -> String {
    format!("events.out.tfevents.{unix_secs:010}.{host}.{pid}.{n}")
}

/// This machine's host name as a file name piece (`localhost` when it
/// cannot be read; anything but `[A-Za-z0-9._-]` becomes `_`).
pub fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | '.' | '-' | '_' => c,
            _ => '_',
        })
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// The event of a file's start.
pub fn version_event(wall_time: f64) -> Event {
    Event {
        wall_time,
        step: 0,
        file_version: Some(FILE_VERSION.into()),
        summary: None,
    }
}

/// One event with a scalar (`simple_value`) per (tag, value).
pub fn scalars_event(wall_time: f64, step: i64, values: &[(&str, f32)]) -> Event {
    Event {
        wall_time,
        step,
        file_version: None,
        summary: Some(Summary {
            value: values
                .iter()
                .map(|&(tag, v)| Value {
                    tag: tag.into(),
                    simple_value: Some(v),
                    ..Default::default()
                })
                .collect(),
        }),
    }
}

/// One event with `text` under `tag` as TensorBoard's text plugin writes
/// it (tensorboard/plugins/text/summary_v2.py): a scalar DT_STRING tensor
/// with plugin_data `text` (its TextPluginData version 0 encodes as no
/// bytes). The plugin renders it as Markdown.
pub fn text_event(wall_time: f64, step: i64, tag: &str, text: &str) -> Event {
    Event {
        wall_time,
        step,
        file_version: None,
        summary: Some(Summary {
            value: vec![Value {
                tag: tag.into(),
                tensor: Some(TensorProto {
                    dtype: DT_STRING,
                    tensor_shape: Some(TensorShapeProto::default()),
                    string_val: vec![text.as_bytes().to_vec()],
                }),
                metadata: Some(SummaryMetadata {
                    plugin_data: Some(PluginData {
                        plugin_name: "text".into(),
                        content: Vec::new(),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }],
        }),
    }
}

/// An open event file: records go through a buffer, [`EventFile::flush`]
/// writes them out.
pub struct EventFile {
    path: PathBuf,
    out: BufWriter<File>,
    buf: Vec<u8>,
    dirty: bool,
}

impl EventFile {
    /// Creates `dir` (and its parents) and in it a new file `name` (never
    /// one that exists), starting with the file-version event.
    pub fn create(dir: &Path, name: &str, wall_time: f64) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut f = Self {
            path,
            out: BufWriter::with_capacity(64 * 1024, file),
            buf: Vec::new(),
            dirty: false,
        };
        f.write(&version_event(wall_time))?;
        Ok(f)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `event` (to the buffer; written out when it fills or on
    /// [`EventFile::flush`]).
    pub fn write(&mut self, event: &Event) -> io::Result<()> {
        self.buf.clear();
        frame(&event.encode_to_vec(), &mut self.buf);
        self.out.write_all(&self.buf)?;
        self.dirty = true;
        Ok(())
    }

    /// Whether events were appended since the last flush.
    pub fn dirty(&self) -> bool {
        self.dirty
    }

    pub fn flush(&mut self) -> io::Result<()> {
        if self.dirty {
            self.out.flush()?;
            self.dirty = false;
        }
        Ok(())
    }
}
