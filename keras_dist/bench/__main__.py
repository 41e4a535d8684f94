"""Entry point: ``python -m keras_dist.bench {allreduce,broadcast,allgather,train,latency} ...``."""

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from keras_dist.bench import train

        return train.main(argv[1:])
    if argv[:1] == ["latency"]:
        from keras_dist.bench import latency

        return latency.main(argv[1:])
    from keras_dist.bench import collectives

    return collectives.main(argv)


if __name__ == "__main__":
    sys.exit(main())
