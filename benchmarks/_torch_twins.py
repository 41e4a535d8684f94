"""PyTorch twins of ``keras_dist.bench train``'s MLP and CNN (``emulated_hosts_train.py``).

The same layers with the same shapes (so the same parameter count and the
same gradient bytes per step), trained the same way: SGD at 0.01, softmax
cross-entropy on logits. A twin takes the Keras batch as it is (channels last)
and answers ``train_on_batch`` and ``get_weights`` as a Keras model does, so
the benchmark's blocks and its end-of-run check treat both frameworks alike.
"""

from __future__ import annotations

import numpy as np


def module(name: str, seed: int = 1234):
    """The torch module for ``name`` (``mlp`` or ``cnn``), seeded."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if name == "mlp":  # Dense(512) relu, Dense(512) relu, Dense(10) on 784 inputs
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))
    if name == "cnn":  # Conv(16,3), pool, Conv(32,3), pool, Dense(128), Dense(10) on 28x28x1
        return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(32 * 5 * 5, 128), nn.ReLU(), nn.Linear(128, 10))
    raise ValueError(f"`name` must be 'mlp' or 'cnn'. Received: name={name!r}")


class Twin:
    """A torch module (plain or wrapped in DDP) with Keras's training calls."""

    def __init__(self, net) -> None:
        import torch

        self.net = net
        self.optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        self.loss = torch.nn.CrossEntropyLoss()
        self._batch = None

    def train_on_batch(self, x: np.ndarray, y: np.ndarray) -> float:
        import torch

        if self._batch is None or self._batch[0] is not x:
            inputs = torch.from_numpy(np.ascontiguousarray(
                np.moveaxis(x, -1, 1) if x.ndim == 4 else x))
            self._batch = (x, inputs, torch.from_numpy(np.asarray(y, np.int64)))
        _, inputs, labels = self._batch
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.net(inputs), labels)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def get_weights(self) -> list[np.ndarray]:
        return [p.detach().numpy().copy() for p in self.net.parameters()]

    def count_params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())
