//! The data set readers (worker/src/source/data.rs) on small files written in the
//! real formats: MNIST IDX files, CIFAR-10 binary batches and safetensors
//! files with `x` and `y`. Every failure must name the file and say what is
//! wrong with it.

use accrue_worker::source::data::{
    load_cifar10, load_mnist, parse_cifar, parse_idx_images, parse_idx_labels, read_tensors,
    Dataset, CIFAR_FILES, MNIST_FILES,
};
use accrue_worker::Error;
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::Kind;
use tempfile::TempDir;

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;
const CIFAR_RECORD: usize = 1 + 3 * 32 * 32;

// ---------------------------------------------------------------- helpers

/// An IDX3 image file: magic, n, rows, cols (big-endian u32), then pixels.
fn idx_images(magic: u32, n: u32, rows: u32, cols: u32, pixels: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for v in [magic, n, rows, cols] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    out.extend_from_slice(pixels);
    out
}

/// An IDX1 label file: magic, n (big-endian u32), then labels.
fn idx_labels(magic: u32, n: u32, labels: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&magic.to_be_bytes());
    out.extend_from_slice(&n.to_be_bytes());
    out.extend_from_slice(labels);
    out
}

/// A distinct-looking byte for image `i`, pixel offset `p` (covers 0..=255).
fn mnist_byte(split: usize, i: usize, p: usize) -> u8 {
    ((split * 101 + i * 37 + p * 11) % 256) as u8
}

const ROWS: usize = 5;
const COLS: usize = 4;

fn mnist_pixels(split: usize, n: usize) -> Vec<u8> {
    let mut px = Vec::new();
    for i in 0..n {
        for p in 0..ROWS * COLS {
            px.push(mnist_byte(split, i, p));
        }
    }
    px
}

const MNIST_TRAIN_LABELS: [u8; 3] = [7, 0, 9];
const MNIST_TEST_LABELS: [u8; 2] = [3, 1];

/// Writes a valid 4-file MNIST folder: 3 training and 2 test images of 5x4.
fn write_mnist(dir: &Path) {
    let train = mnist_pixels(0, 3);
    let test = mnist_pixels(1, 2);
    let files: [(&str, Vec<u8>); 4] = [
        (
            MNIST_FILES[0],
            idx_images(IMAGES_MAGIC, 3, ROWS as u32, COLS as u32, &train),
        ),
        (
            MNIST_FILES[1],
            idx_labels(LABELS_MAGIC, 3, &MNIST_TRAIN_LABELS),
        ),
        (
            MNIST_FILES[2],
            idx_images(IMAGES_MAGIC, 2, ROWS as u32, COLS as u32, &test),
        ),
        (
            MNIST_FILES[3],
            idx_labels(LABELS_MAGIC, 2, &MNIST_TEST_LABELS),
        ),
    ];
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// A distinct-looking byte for CIFAR record `r` of file `f`, channel `c`, row
/// `h`, column `w`.
fn cifar_byte(f: usize, r: usize, c: usize, h: usize, w: usize) -> u8 {
    ((f * 53 + r * 29 + c * 97 + h * 7 + w * 3) % 256) as u8
}

fn cifar_label(f: usize, r: usize) -> u8 {
    ((f * 3 + r) % 10) as u8
}

/// One CIFAR-10 record laid out as the real files are: the label, then the
/// red, green and blue planes, each row-major 32x32.
fn cifar_record(f: usize, r: usize) -> Vec<u8> {
    let mut rec = vec![0u8; CIFAR_RECORD];
    rec[0] = cifar_label(f, r);
    for c in 0..3 {
        for h in 0..32 {
            for w in 0..32 {
                rec[1 + c * 1024 + h * 32 + w] = cifar_byte(f, r, c, h, w);
            }
        }
    }
    rec
}

/// Records per file: 2 in each training batch, 3 in the test batch.
fn cifar_records_in(f: usize) -> usize {
    if f == 5 {
        3
    } else {
        2
    }
}

fn write_cifar(dir: &Path) {
    for (f, name) in CIFAR_FILES.iter().enumerate() {
        let bytes: Vec<u8> = (0..cifar_records_in(f))
            .flat_map(|r| cifar_record(f, r))
            .collect();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

fn f32s(t: &tch::Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.flatten(0, -1)).unwrap()
}

fn i64s(t: &tch::Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(&t.flatten(0, -1)).unwrap()
}

/// The pixel value the readers must produce for a byte: exactly byte / 255.
fn scaled(b: u8) -> f32 {
    b as f32 / 255.0
}

/// Unwraps an `Error::Data`, checks it names `want_path`, and returns the
/// reason and the full message.
fn data_error<T: std::fmt::Debug>(r: Result<T, Error>, want_path: &Path) -> (String, String) {
    let err = r.expect_err("expected a data error");
    let msg = err.to_string();
    match err {
        Error::Data { path, reason } => {
            assert_eq!(path, want_path, "error names the wrong file: {msg}");
            assert!(
                msg.contains(&want_path.display().to_string()),
                "message does not name the file: {msg}"
            );
            assert!(
                msg.starts_with("data file "),
                "unexpected message form: {msg}"
            );
            (reason, msg)
        }
        other => panic!("expected Error::Data, got {other:?} ({msg})"),
    }
}

fn assert_contains(msg: &str, needle: &str) {
    assert!(
        msg.contains(needle),
        "message {msg:?} does not contain {needle:?}"
    );
}

// ------------------------------------------------------------------ MNIST

#[test]
fn mnist_loads_both_splits_with_shapes_pixels_and_labels() {
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let splits = load_mnist(dir.path()).unwrap();

    let check = |ds: &Dataset, split: usize, labels: &[u8]| {
        let n = labels.len();
        assert_eq!(ds.x.size(), vec![n as i64, 1, ROWS as i64, COLS as i64]);
        assert_eq!(ds.x.kind(), Kind::Float);
        assert_eq!(ds.y.size(), vec![n as i64]);
        assert_eq!(ds.y.kind(), Kind::Int64);
        assert_eq!(ds.len(), n);
        assert_eq!(ds.sample_shape(), vec![1, ROWS as i64, COLS as i64]);
        // Every pixel: [i, 0, r, c] is byte 16 + i*rows*cols + r*cols + c,
        // divided by 255 exactly (rows and columns not swapped).
        let got = f32s(&ds.x);
        let want: Vec<f32> = (0..n)
            .flat_map(|i| (0..ROWS * COLS).map(move |p| scaled(mnist_byte(split, i, p))))
            .collect();
        assert_eq!(got, want);
        let want_labels: Vec<i64> = labels.iter().map(|&l| l as i64).collect();
        assert_eq!(i64s(&ds.y), want_labels);
    };
    check(&splits.train, 0, &MNIST_TRAIN_LABELS);
    let eval = splits.eval.as_ref().expect("MNIST has a test split");
    check(eval, 1, &MNIST_TEST_LABELS);

    // A few positions spelled out through 4-D indexing.
    let x = &splits.train.x;
    for (i, r, c) in [(0usize, 0usize, 0usize), (1, 2, 3), (2, 4, 1), (2, 4, 3)] {
        let want = scaled(mnist_byte(0, i, r * COLS + c)) as f64;
        assert_eq!(x.double_value(&[i as i64, 0, r as i64, c as i64]), want);
    }
    assert_eq!(
        eval.x.double_value(&[1, 0, 3, 2]),
        scaled(mnist_byte(1, 1, 3 * COLS + 2)) as f64
    );
    assert_eq!(splits.train.classes().unwrap(), 10);
}

#[test]
fn mnist_extreme_bytes_map_to_zero_and_one() {
    let pixels: Vec<u8> = vec![0, 255, 128, 1];
    let bytes = idx_images(IMAGES_MAGIC, 1, 2, 2, &pixels);
    let (n, rows, cols, px) = parse_idx_images(&bytes, Path::new("img")).unwrap();
    assert_eq!((n, rows, cols), (1, 2, 2));
    assert_eq!(px, pixels);

    let dir = TempDir::new().unwrap();
    std::fs::write(dir.path().join(MNIST_FILES[0]), &bytes).unwrap();
    std::fs::write(
        dir.path().join(MNIST_FILES[1]),
        idx_labels(LABELS_MAGIC, 1, &[4]),
    )
    .unwrap();
    std::fs::write(dir.path().join(MNIST_FILES[2]), &bytes).unwrap();
    std::fs::write(
        dir.path().join(MNIST_FILES[3]),
        idx_labels(LABELS_MAGIC, 1, &[5]),
    )
    .unwrap();
    let s = load_mnist(dir.path()).unwrap();
    assert_eq!(f32s(&s.train.x), vec![0.0, 1.0, 128.0 / 255.0, 1.0 / 255.0]);
    assert_eq!(i64s(&s.train.y), vec![4]);
    assert_eq!(i64s(&s.eval.unwrap().y), vec![5]);
}

#[test]
fn idx_parsers_return_header_fields_and_payload() {
    let px = mnist_pixels(0, 3);
    let (n, rows, cols, got) = parse_idx_images(
        &idx_images(IMAGES_MAGIC, 3, ROWS as u32, COLS as u32, &px),
        Path::new("x"),
    )
    .unwrap();
    assert_eq!((n, rows, cols), (3, ROWS, COLS));
    assert_eq!(got, px);
    let labels = parse_idx_labels(&idx_labels(LABELS_MAGIC, 3, &[1, 2, 3]), Path::new("y"));
    assert_eq!(labels.unwrap(), vec![1, 2, 3]);
    // Zero images is a valid (empty) file.
    let (n, _, _, got) =
        parse_idx_images(&idx_images(IMAGES_MAGIC, 0, 28, 28, &[]), Path::new("x")).unwrap();
    assert_eq!((n, got.len()), (0, 0));
}

#[test]
fn mnist_truncated_image_file_is_refused() {
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let path = dir.path().join(MNIST_FILES[0]);
    let mut px = mnist_pixels(0, 3);
    px.pop(); // 59 pixel bytes where the header declares 3 * 5 * 4 = 60
    std::fs::write(&path, idx_images(IMAGES_MAGIC, 3, 5, 4, &px)).unwrap();
    let (reason, _) = data_error(load_mnist(dir.path()), &path);
    assert_eq!(
        reason,
        "truncated: the header declares 3 images of 5x4 = 60 pixel bytes, the file holds 59"
    );
}

#[test]
fn mnist_trailing_bytes_are_refused() {
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let path = dir.path().join(MNIST_FILES[2]);
    let mut px = mnist_pixels(1, 2);
    px.extend_from_slice(&[0, 0, 0]); // 43 where 2 * 5 * 4 = 40 are declared
    std::fs::write(&path, idx_images(IMAGES_MAGIC, 2, 5, 4, &px)).unwrap();
    let (reason, msg) = data_error(load_mnist(dir.path()), &path);
    assert_contains(&msg, "t10k-images-idx3-ubyte");
    assert_eq!(
        reason,
        "trailing bytes: the header declares 2 images of 5x4 = 40 pixel bytes, the file holds 43"
    );
}

#[test]
fn idx_label_file_with_wrong_length_is_refused() {
    let p = Path::new("/d/train-labels-idx1-ubyte");
    let (reason, msg) = data_error(
        parse_idx_labels(&idx_labels(LABELS_MAGIC, 3, &[1, 2]), p),
        p,
    );
    assert_contains(&msg, "train-labels-idx1-ubyte");
    assert_eq!(
        reason,
        "truncated: the header declares 3 labels, the file holds 2"
    );
    let (reason, _) = data_error(
        parse_idx_labels(&idx_labels(LABELS_MAGIC, 1, &[1, 2]), p),
        p,
    );
    assert_eq!(
        reason,
        "trailing bytes: the header declares 1 labels, the file holds 2"
    );
}

#[test]
fn mnist_wrong_magic_number_is_refused() {
    // A label file where the image file belongs (magic 0x801 not 0x803).
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let path = dir.path().join(MNIST_FILES[0]);
    std::fs::write(
        &path,
        idx_images(LABELS_MAGIC, 3, 5, 4, &mnist_pixels(0, 3)),
    )
    .unwrap();
    let (reason, msg) = data_error(load_mnist(dir.path()), &path);
    assert_contains(&msg, "train-images-idx3-ubyte");
    assert_eq!(
        reason,
        "bad magic number 0x00000801, an IDX image file has 0x00000803"
    );

    // And the other way round: image magic in the label file.
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let path = dir.path().join(MNIST_FILES[1]);
    std::fs::write(&path, idx_labels(IMAGES_MAGIC, 3, &MNIST_TRAIN_LABELS)).unwrap();
    let (reason, _) = data_error(load_mnist(dir.path()), &path);
    assert_eq!(
        reason,
        "bad magic number 0x00000803, an IDX label file has 0x00000801"
    );

    // A little-endian magic (a common writer mistake) is not accepted either.
    let mut le = IMAGES_MAGIC.to_le_bytes().to_vec();
    le.extend_from_slice(&idx_images(IMAGES_MAGIC, 0, 1, 1, &[])[4..]);
    let p = Path::new("le-images");
    let (reason, _) = data_error(parse_idx_images(&le, p), p);
    assert_contains(&reason, "bad magic number 0x03080000");
}

#[test]
fn mnist_header_shorter_than_16_bytes_is_refused() {
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let path = dir.path().join(MNIST_FILES[0]);
    let full = idx_images(IMAGES_MAGIC, 3, 5, 4, &[]);
    std::fs::write(&path, &full[..10]).unwrap();
    let (reason, msg) = data_error(load_mnist(dir.path()), &path);
    assert_contains(&msg, "train-images-idx3-ubyte");
    assert_eq!(
        reason,
        "truncated IDX header: 10 bytes, an image file needs 16"
    );

    // An empty file is a short header too, not a panic.
    std::fs::write(&path, []).unwrap();
    let (reason, _) = data_error(load_mnist(dir.path()), &path);
    assert_eq!(
        reason,
        "truncated IDX header: 0 bytes, an image file needs 16"
    );

    // A label file needs 8 bytes of header.
    let p = Path::new("labels");
    let (reason, _) = data_error(parse_idx_labels(&[0, 0, 8, 1, 0], p), p);
    assert_eq!(
        reason,
        "truncated IDX header: 5 bytes, a label file needs 8"
    );
}

#[test]
fn idx_header_with_huge_dimensions_is_an_error_not_a_panic() {
    // n * rows * cols overflows 64 bits; the reader must refuse the file.
    let p = Path::new("huge-images");
    let bytes = idx_images(IMAGES_MAGIC, u32::MAX, u32::MAX, u32::MAX, &[1, 2, 3]);
    let (reason, _) = data_error(parse_idx_images(&bytes, p), p);
    assert_contains(&reason, "truncated:");
    assert_contains(&reason, "the file holds 3");
}

#[test]
fn mnist_label_count_must_match_image_count() {
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let ipath = dir.path().join(MNIST_FILES[0]);
    let lpath = dir.path().join(MNIST_FILES[1]);
    // A well-formed label file, but with 2 labels for 3 images.
    std::fs::write(&lpath, idx_labels(LABELS_MAGIC, 2, &[1, 2])).unwrap();
    let (reason, msg) = data_error(load_mnist(dir.path()), &lpath);
    assert_contains(&msg, "train-labels-idx1-ubyte");
    assert_eq!(
        reason,
        format!("holds 2 labels but {} holds 3 images", ipath.display())
    );
}

#[test]
fn mnist_missing_file_is_an_io_error_naming_it() {
    let dir = TempDir::new().unwrap();
    write_mnist(dir.path());
    let missing = dir.path().join(MNIST_FILES[3]);
    std::fs::remove_file(&missing).unwrap();
    let err = load_mnist(dir.path()).expect_err("a missing file must fail");
    let msg = err.to_string();
    match err {
        Error::Io { path, source } => {
            assert_eq!(path, missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
    assert_contains(&msg, &format!("I/O on {}", missing.display()));
    assert_contains(&msg, "t10k-labels-idx1-ubyte");
}

// --------------------------------------------------------------- CIFAR-10

#[test]
fn cifar10_loads_batches_channel_major_with_labels() {
    let dir = TempDir::new().unwrap();
    write_cifar(dir.path());
    let splits = load_cifar10(dir.path()).unwrap();

    // Training: data_batch_1..5 in order, 2 records each.
    let train = &splits.train;
    assert_eq!(train.x.size(), vec![10, 3, 32, 32]);
    assert_eq!(train.x.kind(), Kind::Float);
    assert_eq!(train.y.kind(), Kind::Int64);
    let order: Vec<(usize, usize)> = (0..5).flat_map(|f| (0..2).map(move |r| (f, r))).collect();
    let want_y: Vec<i64> = order
        .iter()
        .map(|&(f, r)| cifar_label(f, r) as i64)
        .collect();
    assert_eq!(i64s(&train.y), want_y);
    // Every pixel: byte 1 + c*1024 + h*32 + w of the record is [c, h, w].
    let want_x: Vec<f32> = order
        .iter()
        .flat_map(|&(f, r)| {
            cifar_record(f, r)[1..]
                .iter()
                .map(|&b| scaled(b))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(f32s(&train.x), want_x);

    // Positions spelled out, chosen so that swapping c/h/w would differ.
    for (n, c, h, w) in [
        (0usize, 0usize, 0usize, 1usize),
        (3, 2, 5, 7),
        (9, 1, 31, 0),
        (4, 0, 17, 30),
    ] {
        let (f, r) = order[n];
        let byte = cifar_record(f, r)[1 + c * 1024 + h * 32 + w];
        assert_eq!(byte, cifar_byte(f, r, c, h, w));
        assert_eq!(
            train
                .x
                .double_value(&[n as i64, c as i64, h as i64, w as i64]),
            scaled(byte) as f64,
            "pixel [{n}, {c}, {h}, {w}]"
        );
    }

    // Test: test_batch.bin, 3 records.
    let eval = splits.eval.as_ref().expect("CIFAR-10 has a test split");
    assert_eq!(eval.x.size(), vec![3, 3, 32, 32]);
    assert_eq!(
        i64s(&eval.y),
        (0..3).map(|r| cifar_label(5, r) as i64).collect::<Vec<_>>()
    );
    assert_eq!(
        eval.x.double_value(&[2, 1, 10, 20]),
        scaled(cifar_byte(5, 2, 1, 10, 20)) as f64
    );
}

#[test]
fn parse_cifar_splits_labels_and_pixels() {
    let mut bytes = cifar_record(0, 0);
    bytes.extend(cifar_record(0, 1));
    let (labels, pixels) = parse_cifar(&bytes, Path::new("b")).unwrap();
    assert_eq!(labels, vec![cifar_label(0, 0), cifar_label(0, 1)]);
    assert_eq!(pixels.len(), 2 * 3072);
    assert_eq!(&pixels[..3072], &cifar_record(0, 0)[1..]);
    assert_eq!(&pixels[3072..], &cifar_record(0, 1)[1..]);
}

#[test]
fn cifar_file_size_not_a_multiple_of_the_record_is_refused() {
    let dir = TempDir::new().unwrap();
    write_cifar(dir.path());
    let path = dir.path().join("data_batch_2.bin");
    let mut bytes = cifar_record(1, 0);
    bytes.extend(cifar_record(1, 1));
    bytes.pop(); // 6145 bytes: 1 whole record and 3072 left over
    std::fs::write(&path, &bytes).unwrap();
    let (reason, msg) = data_error(load_cifar10(dir.path()), &path);
    assert_contains(&msg, "data_batch_2.bin");
    assert_eq!(
        reason,
        "size 6145 is not a positive multiple of the 3073-byte CIFAR-10 record \
         (1 whole records and 3072 bytes left over)"
    );

    // An empty batch file is refused as well.
    std::fs::write(&path, []).unwrap();
    let (reason, _) = data_error(load_cifar10(dir.path()), &path);
    assert_contains(
        &reason,
        "size 0 is not a positive multiple of the 3073-byte",
    );
}

#[test]
fn cifar_label_above_9_is_refused() {
    let dir = TempDir::new().unwrap();
    write_cifar(dir.path());
    let path = dir.path().join("test_batch.bin");
    let mut bytes: Vec<u8> = (0..3).flat_map(|r| cifar_record(5, r)).collect();
    bytes[CIFAR_RECORD] = 10; // record 1's label
    std::fs::write(&path, &bytes).unwrap();
    let (reason, msg) = data_error(load_cifar10(dir.path()), &path);
    assert_contains(&msg, "test_batch.bin");
    assert_eq!(reason, "record 1 has label 10, CIFAR-10 labels are 0..=9");

    // 9 itself is fine.
    bytes[CIFAR_RECORD] = 9;
    std::fs::write(&path, &bytes).unwrap();
    let s = load_cifar10(dir.path()).unwrap();
    assert_eq!(s.eval.unwrap().y.int64_value(&[1]), 9);
}

#[test]
fn cifar_missing_batch_is_an_io_error_naming_it() {
    let dir = TempDir::new().unwrap();
    write_cifar(dir.path());
    let missing = dir.path().join("data_batch_4.bin");
    std::fs::remove_file(&missing).unwrap();
    let err = load_cifar10(dir.path()).expect_err("a missing batch must fail");
    let msg = err.to_string();
    match err {
        Error::Io { path, .. } => assert_eq!(path, missing),
        other => panic!("expected Error::Io, got {other:?}"),
    }
    assert_contains(&msg, &format!("I/O on {}", missing.display()));
}

// ---------------------------------------------------------------- tensors

/// Runs Python code with `d` (the folder, a str) bound, to write safetensors
/// files through the `safetensors` package the way users would.
fn python(dir: &Path, body: &str) {
    let code = format!(
        "import sys\nimport numpy as np\nfrom safetensors.numpy import save_file\nd = sys.argv[1]\n{body}\n"
    );
    let out = Command::new(env!("ACCRUE_PYTHON"))
        .arg("-c")
        .arg(&code)
        .arg(dir)
        .output()
        .expect("run the project's Python");
    assert!(
        out.status.success(),
        "python failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn tensors_path(dir: &TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

#[test]
fn tensors_reads_x_and_y_values() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "x = (np.arange(12, dtype=np.float32).reshape(4, 3) * 0.25 - 1.0)\n\
         x[2, 1] = 1.2345679\n\
         y = np.array([3, 0, 2, 1], dtype=np.int64)\n\
         save_file({'x': x, 'y': y}, d + '/train.safetensors')",
    );
    let ds = read_tensors(&tensors_path(&dir, "train.safetensors")).unwrap();
    assert_eq!(ds.x.size(), vec![4, 3]);
    assert_eq!(ds.x.kind(), Kind::Float);
    assert_eq!(ds.y.size(), vec![4]);
    assert_eq!(ds.y.kind(), Kind::Int64);
    let mut want: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    want[2 * 3 + 1] = 1.234_567_9;
    assert_eq!(f32s(&ds.x), want);
    assert_eq!(i64s(&ds.y), vec![3, 0, 2, 1]);
    assert_eq!(ds.classes().unwrap(), 4);
}

#[test]
fn tensors_converts_double_x_and_int32_y() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "x = np.array([[0.5, -2.0, 1e-3], [7.0, 8.0, 9.0]], dtype=np.float64)\n\
         y = np.array([1, 5], dtype=np.int32)\n\
         save_file({'y': y, 'x': x}, d + '/t.safetensors')",
    );
    let ds = read_tensors(&tensors_path(&dir, "t.safetensors")).unwrap();
    assert_eq!(ds.x.kind(), Kind::Float);
    assert_eq!(ds.y.kind(), Kind::Int64);
    assert_eq!(f32s(&ds.x), vec![0.5, -2.0, 1e-3_f64 as f32, 7.0, 8.0, 9.0]);
    assert_eq!(i64s(&ds.y), vec![1, 5]);
}

#[test]
fn tensors_without_y_is_refused() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "save_file({'x': np.zeros((4, 3), dtype=np.float32)}, d + '/no_y.safetensors')",
    );
    let path = tensors_path(&dir, "no_y.safetensors");
    let (reason, msg) = data_error(read_tensors(&path), &path);
    assert_contains(&msg, "no_y.safetensors");
    assert_eq!(
        reason,
        "has no tensor \"y\" (it holds [\"x\"]; need x and y)"
    );
}

#[test]
fn tensors_with_float_y_is_refused() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "save_file({'x': np.zeros((4, 3), dtype=np.float32),\n\
                    'y': np.array([0, 1, 2, 3], dtype=np.float32)}, d + '/float_y.safetensors')",
    );
    let path = tensors_path(&dir, "float_y.safetensors");
    let (reason, msg) = data_error(read_tensors(&path), &path);
    assert_contains(&msg, "float_y.safetensors");
    assert_eq!(reason, "y has dtype Float, need an integer type");
}

#[test]
fn tensors_with_integer_x_is_refused() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "save_file({'x': np.zeros((4, 3), dtype=np.int64),\n\
                    'y': np.zeros(4, dtype=np.int64)}, d + '/int_x.safetensors')",
    );
    let path = tensors_path(&dir, "int_x.safetensors");
    let (reason, _) = data_error(read_tensors(&path), &path);
    assert_eq!(reason, "x has dtype Int64, need a floating-point type");
}

#[test]
fn tensors_with_mismatched_n_is_refused() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "save_file({'x': np.zeros((4, 3), dtype=np.float32),\n\
                    'y': np.zeros(3, dtype=np.int64)}, d + '/short_y.safetensors')\n\
         save_file({'x': np.zeros((4, 3), dtype=np.float32),\n\
                    'y': np.zeros((4, 1), dtype=np.int64)}, d + '/2d_y.safetensors')",
    );
    let path = tensors_path(&dir, "short_y.safetensors");
    let (reason, msg) = data_error(read_tensors(&path), &path);
    assert_contains(&msg, "short_y.safetensors");
    assert_eq!(
        reason,
        "x has shape [4, 3] and y [3]; need x [N, ...] and y [N] with the same N"
    );
    // y must be 1-D even when N agrees.
    let path = tensors_path(&dir, "2d_y.safetensors");
    let (reason, _) = data_error(read_tensors(&path), &path);
    assert_contains(&reason, "x has shape [4, 3] and y [4, 1]");
}

#[test]
fn tensors_with_negative_label_is_refused() {
    let dir = TempDir::new().unwrap();
    python(
        dir.path(),
        "save_file({'x': np.zeros((3, 2), dtype=np.float32),\n\
                    'y': np.array([0, -1, 2], dtype=np.int64)}, d + '/neg.safetensors')",
    );
    let path = tensors_path(&dir, "neg.safetensors");
    let (reason, _) = data_error(read_tensors(&path), &path);
    assert_eq!(reason, "y holds a negative label (-1)");
}

#[test]
fn tensors_missing_or_garbage_file_names_the_path() {
    let dir = TempDir::new().unwrap();
    let missing = tensors_path(&dir, "absent.safetensors");
    let (_, msg) = data_error(read_tensors(&missing), &missing);
    assert_contains(&msg, "absent.safetensors");

    let garbage = tensors_path(&dir, "garbage.safetensors");
    std::fs::write(&garbage, b"this is not a safetensors file").unwrap();
    let (_, msg) = data_error(read_tensors(&garbage), &garbage);
    assert_contains(&msg, "garbage.safetensors");
}
