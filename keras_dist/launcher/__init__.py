"""The launcher, ``kdrun``: mpiexec (or Slurm) and a supervisor per rank. It never
initialises MPI (it never imports mpi4py)."""
