"""Writes scikit-learn's handwritten digits (1,797 real 8x8 scans, 10 classes)
as MNIST IDX files: 1,437 training and 360 test images, split with a fixed
seed. Usage: python scripts/make_digits.py OUT_DIR"""
import struct
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits


def write_idx(path, array, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic))
        for dim in array.shape:
            f.write(struct.pack(">I", dim))
        f.write(array.astype(np.uint8).tobytes())


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
    labels = digits.target.astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    test, train = order[:360], order[360:]
    write_idx(out / "train-images-idx3-ubyte", images[train], 0x00000803)
    write_idx(out / "train-labels-idx1-ubyte", labels[train], 0x00000801)
    write_idx(out / "t10k-images-idx3-ubyte", images[test], 0x00000803)
    write_idx(out / "t10k-labels-idx1-ubyte", labels[test], 0x00000801)
    print(f"wrote {len(train)} training and {len(test)} test digits to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/digits")
