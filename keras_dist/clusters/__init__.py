"""Executors for clusters that start the processes themselves (Ray, Spark).

An executor is a launcher: it places the ranks, starts the job's process
manager on a port it binds once (``common.JobProcessManager``), hands every
rank the job's secret, and names the rank that failed first. Each cluster is
a package with one file per process's code. This layer uses the runtime's
public parts and ``keras_dist.errors`` only, never a transport or the Keras
layer (an import contract). ``keras_dist.ray`` and ``keras_dist.spark`` are
the public import paths.
"""
