"""How evenly sharded optimizer state spreads over ranks for KerasHub's GPT-2 and BERT-base.

The trainable weight shapes of ``keras_hub.models.GPT2Backbone.from_preset("gpt2_base_en")``
and ``BertBackbone.from_preset("bert_base_en")`` are written out here (KerasHub is not a
dependency). For each model and number of ranks, prints the largest rank's share of the
optimizer state over the even share, for whole-variable partitioning (what
shape-dependent optimizers such as Adafactor, Lamb and Muon get) and for row splits
(element-wise optimizers: SGD, Adam, AdamW, ...)::

    python -m keras_dist.bench.zero_balance
"""

from __future__ import annotations

import argparse

from keras_dist._keras.zero_partition import Tensor, imbalance

_HIDDEN, _HEADS, _HEAD, _FFN, _LAYERS = 768, 12, 64, 3072, 12


def _encoder_layer(norms_first: bool) -> list[tuple[int, ...]]:
    """One transformer layer of KerasHub (query/key/value/output of EinsumDense)."""
    norm = [(_HIDDEN,), (_HIDDEN,)]
    attention = []
    for _ in ("query", "key", "value"):
        attention += [(_HIDDEN, _HEADS, _HEAD), (_HEADS, _HEAD)]
    attention += [(_HEADS, _HEAD, _HIDDEN), (_HIDDEN,)]
    ffn = [(_HIDDEN, _FFN), (_FFN,), (_FFN, _HIDDEN), (_HIDDEN,)]
    if norms_first:  # GPT-2: pre-norm
        return norm + attention + norm + ffn
    return attention + norm + ffn + norm


def gpt2_base() -> list[tuple[int, ...]]:
    """GPT-2 base (124M): token and position embeddings, 12 decoder layers, final norm."""
    shapes = [(50257, _HIDDEN), (1024, _HIDDEN)]
    for _ in range(_LAYERS):
        shapes += _encoder_layer(norms_first=True)
    return shapes + [(_HIDDEN,), (_HIDDEN,)]


def bert_base() -> list[tuple[int, ...]]:
    """BERT-base (110M): token, position and segment embeddings, norm, 12 layers, pooler."""
    shapes = [(30522, _HIDDEN), (512, _HIDDEN), (2, _HIDDEN), (_HIDDEN,), (_HIDDEN,)]
    for _ in range(_LAYERS):
        shapes += _encoder_layer(norms_first=False)
    return shapes + [(_HIDDEN, _HIDDEN), (_HIDDEN,)]


MODELS = {"gpt2_base_en": gpt2_base, "bert_base_en": bert_base}


def table(ranks=(2, 4, 8)) -> list[tuple[str, int, float, float]]:
    """``(model, ranks, whole-variable imbalance, row-split imbalance)`` rows."""
    rows = []
    for name, model in MODELS.items():
        shapes = model()
        for n in ranks:
            whole = imbalance([Tensor(s) for s in shapes], n)
            split = imbalance([Tensor(s, splittable=True) for s in shapes], n)
            rows.append((name, n, whole, split))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    print("| model | parameters | ranks | whole variables: max / even | row splits: max / even |")
    print("|---|---|---|---|---|")
    for name, n, whole, split in table(args.ranks):
        params = sum(Tensor(s).bytes for s in MODELS[name]()) // 4
        print(f"| {name} | {params:,} | {n} | {whole:.3f} | {split:.4f} |")


if __name__ == "__main__":
    main()
