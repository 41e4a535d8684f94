"""MNIST in a TensorFlow 1 session with keras_dist.

``kdrun -np 2 python examples/tensorflow_v1/train.py``: Horovod's TF1 recipe
on TensorFlow 2's ``tf.compat.v1``: a convolutional network of raw ops,
``hvd.DistributedOptimizer`` over ``tf.train.AdamOptimizer``,
``hvd.BroadcastGlobalVariablesHook(0)`` in a ``MonitoredTrainingSession``,
the GPU pinned by local rank, checkpoints from rank 0 only. Trains on the
5,000-digit MNIST subset shipped in ``examples/mnist`` (or the ``.npz``
given with ``--data``), never on made-up data. Each rank ends by printing
its test accuracy and a digest of its weights: the digests are the same on
every rank.
"""

import argparse
import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import keras_dist as hvd  # noqa: E402

tf.disable_v2_behavior()

HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(HERE, os.pardir, "mnist", "mnist_5k.npz")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="training steps of the whole job (each rank runs steps // size)")
    parser.add_argument("--batch-size", type=int, default=100, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.001,
                        help="single-process learning rate; multiplied by the number of ranks")
    parser.add_argument("--data", default=SHIPPED,
                        help="an .npz with x_train, y_train, x_test, y_test")
    parser.add_argument("--checkpoint-dir", default="./checkpoints",
                        help="where rank 0 restores from and saves checkpoints")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    return parser.parse_args()


def dense(inputs, units, name):
    with tf.variable_scope(name):
        kernel = tf.get_variable("kernel", [inputs.shape[-1], units],
                                 initializer=tf.glorot_uniform_initializer())
        bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
    return tf.matmul(inputs, kernel) + bias


def conv_relu_pool(inputs, filters, name):
    with tf.variable_scope(name):
        kernel = tf.get_variable("kernel", [5, 5, inputs.shape[-1], filters],
                                 initializer=tf.glorot_uniform_initializer())
        bias = tf.get_variable("bias", [filters], initializer=tf.zeros_initializer())
    activation = tf.nn.relu(tf.nn.conv2d(inputs, kernel, [1, 1, 1, 1], "SAME") + bias)
    return tf.nn.max_pool2d(activation, ksize=2, strides=2, padding="SAME")


def conv_model(image, label, training):
    """Two convolutions, a dense layer with dropout, ten logits; returns
    (predicted class, loss)."""
    features = tf.reshape(image, [-1, 28, 28, 1])
    features = conv_relu_pool(features, 32, "conv_layer1")
    features = conv_relu_pool(features, 64, "conv_layer2")
    hidden = tf.nn.relu(dense(tf.reshape(features, [-1, 7 * 7 * 64]), 1024, "dense"))
    hidden = tf.nn.dropout(hidden, rate=tf.where(training, 0.5, 0.0))
    logits = dense(hidden, 10, "logits")
    loss = tf.losses.softmax_cross_entropy(tf.one_hot(tf.cast(label, tf.int32), 10), logits)
    return tf.argmax(logits, 1), loss


def batches(x, y, batch_size, seed):
    """Endless shuffled batches (each rank its own order: its own share of the data)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch_size + 1, batch_size):
            chosen = order[start:start + batch_size]
            yield x[chosen], y[chosen]


class FinalReport(tf.train.SessionRunHook):
    """At the end: this rank's test accuracy and a digest of its trainable weights."""

    def __init__(self, accuracy, feeds):
        self.accuracy, self.feeds = accuracy, feeds

    def end(self, session):
        accuracy = session.run(self.accuracy, self.feeds)
        digest = hashlib.sha256()
        for value in session.run(tf.trainable_variables()):
            digest.update(np.ascontiguousarray(value).tobytes())
        print(f"rank {hvd.rank()}: test accuracy {accuracy:.3f}, "
              f"weights digest {digest.hexdigest()[:16]}", flush=True)


def main():
    args = parse_args()
    hvd.init()

    with np.load(args.data) as data:
        x_train = data["x_train"].reshape(-1, 784) / 255.0
        x_test = data["x_test"].reshape(-1, 784) / 255.0
        y_train, y_test = data["y_train"], data["y_test"]

    with tf.name_scope("input"):
        image = tf.placeholder(tf.float32, [None, 784], name="image")
        label = tf.placeholder(tf.float32, [None], name="label")
        training = tf.placeholder_with_default(False, [], name="training")
    predict, loss = conv_model(image, label, training)
    accuracy = tf.reduce_mean(tf.cast(tf.equal(predict, tf.cast(label, tf.int64)), tf.float32))

    # The learning rate grows with the global batch; the optimizer averages
    # the ranks' gradients.
    opt = tf.train.AdamOptimizer(args.lr * hvd.size())
    opt = hvd.DistributedOptimizer(opt)

    global_step = tf.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)

    hooks = [
        # Every rank starts from rank 0's variables: its initial ones, or
        # those rank 0 restored from its checkpoint.
        hvd.BroadcastGlobalVariablesHook(0),
        # The global batch is size times larger: fewer steps.
        tf.train.StopAtStepHook(last_step=args.steps // hvd.size()),
        FinalReport(accuracy, {image: x_test, label: y_test}),
    ]
    if hvd.rank() == 0:
        hooks.append(tf.train.LoggingTensorHook({"step": global_step, "loss": loss},
                                                every_n_iter=10))

    # One GPU per process, chosen by local rank.
    config = tf.ConfigProto(intra_op_parallelism_threads=args.threads,
                            inter_op_parallelism_threads=args.threads)
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    # Only rank 0 writes checkpoints, so that ranks do not overwrite each other.
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
    training_batches = batches(x_train, y_train, args.batch_size, seed=hvd.rank())
    with tf.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                           config=config) as session:
        while not session.should_stop():
            images, labels = next(training_batches)
            session.run(train_op, feed_dict={image: images, label: labels, training: True})


if __name__ == "__main__":
    tf.logging.set_verbosity(tf.logging.INFO)
    main()
