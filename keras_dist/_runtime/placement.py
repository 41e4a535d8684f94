"""Where a process that started itself stands in its job, and where to meet the others.

A cluster that starts the processes itself hands each its place in
environment variables: torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``; Kubeflow Trainer's ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT`` (for a pod that runs one process). ``init(rendezvous=,
rank=, size=, local_rank=)`` gives the same explicitly. Pure functions of
their arguments: the tests give them environments as dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: Variables an MPI process manager (Hydra, Open MPI, Slurm's PMI, PMIx) sets:
#: with any of them the process is already part of an MPI job.
MPI_LAUNCHER_VARIABLES = ("PMI_FD", "PMI_RANK", "PMI_PORT", "PMIX_RANK",
                          "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
KUBEFLOW_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A process's place in a job it was not launched into by MPI.

    Attributes:
        rank: this process's rank, in [0, size).
        size: the number of processes of the job.
        host: where rank 0 listens (a name or an address).
        port: the port rank 0 listens on.
        local_rank: this process's rank on its machine, when the cluster
            said (checked against what MPI finds), else None.
        source: what gave these values, for messages.
    """

    rank: int
    size: int
    host: str
    port: int
    local_rank: int | None
    source: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def whole_number(value, name: str, source: str = "", minimum: int = 0) -> int:
    """``value`` (an int, or a string of digits) as an int >= ``minimum``.

    Raises:
        ValueError: it is not one; the message names ``name`` and ``source``.
    """
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if number is None or number < minimum:
        where = f" ({source})" if source else ""
        raise ValueError(f"`{name}` must be a whole number >= {minimum}. "
                         f"Received: {name}={value!r}{where}")
    return number


def split_address(address, name: str, source: str = "") -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``; ``"[::1]:80"`` -> ``("::1", 80)``.

    Raises:
        ValueError: it is not ``host:port``; the message names ``name``.
    """
    where = f" ({source})" if source else ""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"`{name}` must be \"host:port\". Received: {name}={address!r}{where}")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"`{name}` must be \"host:port\". Received: {name}={address!r}{where}")
    return host, _port(port, name, source)


def _port(value, name: str, source: str) -> int:
    port = whole_number(value, name, source, minimum=1)
    if port > 65535:
        raise ValueError(f"`{name}` must be a port in [1, 65535]. Received: {name}={value!r} "
                         f"({source})")
    return port


def _checked(rank: int, size: int, local_rank: int | None, host: str, port: int,
             source: str, names: tuple[str, str]) -> Placement:
    if not 0 <= rank < size:
        raise ValueError(f"`{names[0]}` must be in [0, {names[1]}). "
                         f"Received: {names[0]}={rank} ({names[1]}={size}; {source})")
    return Placement(rank, size, host, port, local_rank, source)


def torchrun_variables(place: Placement) -> dict[str, str]:
    """The variables torchrun would give the process at ``place`` (which
    ``from_environment`` reads back): for executors that start ranks."""
    variables = {"RANK": str(place.rank), "WORLD_SIZE": str(place.size),
                 "MASTER_ADDR": place.host, "MASTER_PORT": str(place.port)}
    if place.local_rank is not None:
        variables["LOCAL_RANK"] = str(place.local_rank)
    return variables


def from_arguments(rendezvous, rank, size, local_rank=None) -> Placement:
    """The placement ``init(rendezvous=, rank=, size=, local_rank=)`` gives.

    Raises:
        ValueError: an argument is missing or out of range.
    """
    source = "init() arguments"
    if rank is None or size is None:
        raise ValueError("`init(rendezvous=...)` needs `rank` and `size` too. Received: "
                         f"rendezvous={rendezvous!r}, rank={rank!r}, size={size!r}")
    host, port = split_address(rendezvous, "rendezvous", source)
    size = whole_number(size, "size", source, minimum=1)
    rank = whole_number(rank, "rank", source)
    if local_rank is not None:
        local_rank = whole_number(local_rank, "local_rank", source)
    return _checked(rank, size, local_rank, host, port, source, ("rank", "size"))


def under_mpi_launcher(environ: Mapping[str, str]) -> bool:
    """Whether an MPI process manager started this process (mpiexec, kdrun, srun)."""
    return any(environ.get(name) for name in MPI_LAUNCHER_VARIABLES)


def from_environment(environ: Mapping[str, str]) -> Placement | None:
    """The placement the cluster's variables give, or None when there are none.

    torchrun's variables come first (a Kubeflow pod that runs torchrun has
    both); MPI's own launchers win over both (``under_mpi_launcher``).

    Raises:
        ValueError: the variables are incomplete or inconsistent; the message
            names each one missing or wrong.
    """
    if under_mpi_launcher(environ):
        return None
    if environ.get("RANK") and environ.get("WORLD_SIZE"):
        return _torchrun(environ)
    if any(environ.get(name) for name in KUBEFLOW_VARIABLES):
        return _kubeflow(environ)
    return None


def _missing(environ: Mapping[str, str], names: tuple[str, ...], source: str) -> None:
    missing = [name for name in names if not environ.get(name)]
    if missing:
        given = {name: environ[name] for name in names if environ.get(name)}
        raise ValueError(f"{source} are incomplete: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set. Received: {given}")


def _torchrun(environ: Mapping[str, str]) -> Placement:
    source = "torchrun's variables"
    _missing(environ, TORCHRUN_VARIABLES, source)
    size = whole_number(environ["WORLD_SIZE"], "WORLD_SIZE", source, minimum=1)
    rank = whole_number(environ["RANK"], "RANK", source)
    local_rank = environ.get("LOCAL_RANK")
    local_rank = None if not local_rank else whole_number(local_rank, "LOCAL_RANK", source)
    port = _port(environ["MASTER_PORT"], "MASTER_PORT", source)
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # torchrun's own agent serves its store on MASTER_PORT: meet one above it.
        port, source = port + 1, source + " (under torchrun: MASTER_PORT + 1)"
    return _checked(rank, size, local_rank, environ["MASTER_ADDR"], port, source,
                    ("RANK", "WORLD_SIZE"))


def _kubeflow(environ: Mapping[str, str]) -> Placement:
    source = "Kubeflow Trainer's variables"
    _missing(environ, KUBEFLOW_VARIABLES, source)
    nodes = whole_number(environ["PET_NNODES"], "PET_NNODES", source, minimum=1)
    node_rank = whole_number(environ["PET_NODE_RANK"], "PET_NODE_RANK", source)
    per_node = whole_number(environ.get("PET_NPROC_PER_NODE") or "1", "PET_NPROC_PER_NODE", source,
                      minimum=1)
    local_rank = environ.get("LOCAL_RANK")
    if per_node > 1 and not local_rank:
        raise ValueError(
            f"PET_NPROC_PER_NODE={per_node} asks for {per_node} processes on each node, and "
            "this process has no LOCAL_RANK: start them with torchrun (which reads PET_*) "
            "or set PET_NPROC_PER_NODE=1.")
    local_rank = whole_number(local_rank, "LOCAL_RANK", source) if local_rank else None
    if (local_rank or 0) >= per_node:
        raise ValueError(f"`LOCAL_RANK` must be in [0, PET_NPROC_PER_NODE). Received: "
                         f"LOCAL_RANK={local_rank} (PET_NPROC_PER_NODE={per_node})")
    port = _port(environ["PET_MASTER_PORT"], "PET_MASTER_PORT", source)
    _checked(node_rank, nodes, None, "", port, source, ("PET_NODE_RANK", "PET_NNODES"))
    return Placement(node_rank * per_node + (local_rank or 0), nodes * per_node,
                     environ["PET_MASTER_ADDR"], port, local_rank, source)
