"""``python -m keras_dist.bench``: benchmarks, each beside a peer in the same run.

    kdrun -np 2 python -m keras_dist.bench allreduce -b 4 -e 64M --vs mpi   # collectives
    kdrun -np 2 python -m keras_dist.bench train --model cnn --batch-size 32  # training

``collectives`` times allreduce/broadcast/allgather beside mpi4py (nccl-tests'
columns); ``train`` times ``fit``-style training steps beside plain Keras
(Horovod's synthetic-benchmark format). ``--plot FILE.png`` draws either.
"""
