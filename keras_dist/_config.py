"""Every ``KERAS_DIST_*`` setting, read from the environment once.

Horovod's spellings (``HOROVOD_*``) are accepted where Horovod had the knob;
the keras_dist spelling wins when both are set.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

_MIB = 1 << 20


def _raw(name: str, alias: str | None = None) -> tuple[str, str] | None:
    for key in (name, alias):
        if key and os.environ.get(key, "") != "":
            return key, os.environ[key]
    return None


def _float(name: str, default: float | None, alias: str | None = None) -> float | None:
    found = _raw(name, alias)
    if found is None:
        return default
    key, value = found
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"`{key}` must be a number. Received: {key}={value!r}") from None
    if number < 0:
        raise ValueError(f"`{key}` must be >= 0. Received: {key}={value!r}")
    return number


def _int(name: str, default: int | None, alias: str | None = None) -> int | None:
    number = _float(name, None, alias)
    if number is None:
        return default
    if number != int(number):
        key, value = _raw(name, alias)
        raise ValueError(f"`{key}` must be a whole number. Received: {key}={value!r}")
    return int(number)


def _flag(name: str, default: bool, alias: str | None = None) -> bool:
    """A switch: a whole number (nonzero is on), as Horovod reads its switches."""
    number = _int(name, None, alias)
    return default if number is None else number != 0


def switched_on(name: str) -> bool:
    """A native path's switch, read at each use: on unless ``name`` is ``0``,
    ``false``, ``off`` or ``no`` (the general path then serves)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def _choice(name: str, choices: tuple[str, ...], default: str, alias: str | None = None) -> str:
    found = _raw(name, alias)
    if found is None:
        return default
    key, value = found
    value = value.strip().lower()
    if value not in choices:
        raise ValueError(f"`{key}` must be one of {choices}. Received: {key}={value!r}")
    return value


#: The shortest secret accepted: 128 bits.
_SECRET_MIN_BYTES = 16


def _secret() -> bytes:
    """The job's secret for the rendezvous: ``KERAS_DIST_SECRET`` (its UTF-8
    bytes) or the contents of ``KERAS_DIST_SECRET_FILE`` (white space at the
    ends removed, as a mounted Kubernetes Secret or ``echo`` leaves it)."""
    text = os.environ.get("KERAS_DIST_SECRET", "")
    path = os.environ.get("KERAS_DIST_SECRET_FILE", "")
    if text and path:
        raise ValueError("Set one of `KERAS_DIST_SECRET` and `KERAS_DIST_SECRET_FILE`, not both. "
                         f"Received: both (KERAS_DIST_SECRET_FILE={path!r})")
    name, secret = "KERAS_DIST_SECRET", text.encode()
    if path:
        name = "KERAS_DIST_SECRET_FILE"
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as error:
            raise ValueError("`KERAS_DIST_SECRET_FILE` must name a readable file. Received: "
                             f"KERAS_DIST_SECRET_FILE={path!r} ({error.strerror})") from None
        if not secret:
            raise ValueError("`KERAS_DIST_SECRET_FILE` must name a file that holds the secret. "
                             f"Received: KERAS_DIST_SECRET_FILE={path!r}, an empty file")
    if secret and len(secret) < _SECRET_MIN_BYTES:
        raise ValueError(f"`{name}` must hold at least {_SECRET_MIN_BYTES} bytes (for example "
                         "the output of `python -c \"import secrets; "
                         "print(secrets.token_hex(32))\"`). "
                         f"Received: a secret of {len(secret)} bytes")
    return secret


def _torchrun_elastic_job() -> str | None:
    """torchrun's run, when torchrun restarts it (``--max-restarts``) and names
    it (``--rdzv-id``, or ``--standalone``'s own): its restarts are an elastic
    job's launches. Its default name, "none", is the same for every run, so
    commits of another run could be taken for this one's: not elastic then."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id in ("", "none") or not _int("TORCHELASTIC_MAX_RESTARTS", 0):
        return None
    return f"torchrun-{run_id}"


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one process, parsed from its environment."""

    #: CPU data plane: "auto" (shm when it can serve, else mpi), "shm" or "mpi".
    cpu_operations: str = "auto"
    #: GPU data plane: "auto" (nccl when every rank has cupy with NCCL and a
    #: GPU of its own), "nccl" or "mpi".
    gpu_operations: str = "auto"
    #: Whether a group of one rank skips its collectives (the default). Off
    #: (``KERAS_DIST_SIZE_ONE_SHORTCUT=0``), GPU values still go through the
    #: GPU data plane (an NCCL communicator of one rank) and
    #: ``DistributedOptimizer`` still reduces: for checks of those paths on
    #: a machine with one GPU.
    size_one_shortcut: bool = True
    #: Largest fused gradient bucket, in bytes.
    fusion_threshold_bytes: int = 64 * _MIB
    #: Seconds a rank waits in a collective before warning of a stall (0: never).
    stall_check_seconds: float = 60.0
    #: Seconds after which a waiting collective raises (None: never).
    timeout_seconds: float | None = None
    #: Chrome-trace timeline written by rank 0, or None.
    timeline_path: str | None = None
    #: Pretend each machine holds this many ranks (tests of the hierarchical path).
    ranks_per_node: int | None = None
    #: Shared-memory bytes per rank slot of the shm engine.
    shm_slot_bytes: int = 16 * _MIB
    #: Single-copy reads of peers' buffers (process_vm_readv) on the shm engine:
    #: "auto" (when every local rank can read the others) or "off".
    shm_single_copy: str = "auto"
    #: Smallest allreduce, in bytes, that takes the single-copy path
    #: (allgathers take it from 16 KiB).
    shm_single_copy_bytes: int = _MIB
    #: Job identifier (set by kdrun); scopes shared-memory names.
    job_id: str | None = None
    #: Whether process sets may be added and removed after ``init()``.
    dynamic_process_sets: bool = False
    #: Identifier of the elastic job, the same in every launch of it (set by
    #: kdrun, which relaunches the ranks after a failure or to resize; a
    #: torchrun run under ``--max-restarts`` with a run id is one too,
    #: ``torchrun-<TORCHELASTIC_RUN_ID>``); None when the job is not elastic.
    elastic_job: str | None = None
    #: How many times kdrun (or torchrun) has launched this elastic job before
    #: (0: first run).
    elastic_round: int = 0
    #: Where each machine keeps its copy of an elastic job's committed state
    #: (default: /dev/shm, else the temporary directory).
    elastic_dir: str | None = None
    #: Seconds processes that started themselves (torchrun's or Kubeflow's
    #: variables, ``init(rendezvous=...)``) wait for each other at the
    #: rendezvous before giving up.
    rendezvous_timeout_seconds: float = 300.0
    #: The job's secret, which every connection to the rendezvous proves
    #: (``KERAS_DIST_SECRET`` or ``KERAS_DIST_SECRET_FILE``; Ray's and Spark's
    #: executors make one per job); empty: none. Never printed.
    rendezvous_secret: bytes = dataclasses.field(default=b"", repr=False)
    #: Whether the rendezvous's process manager is started by the launcher
    #: (``KERAS_DIST_RENDEZVOUS_SERVED_BY_LAUNCHER=1``, set by Ray's and
    #: Spark's executors) rather than by rank 0.
    rendezvous_served_by_launcher: bool = False

    @classmethod
    def from_env(cls) -> Config:
        timeout = _float("KERAS_DIST_TIMEOUT_SECONDS", None)
        return cls(
            cpu_operations=_choice(
                "KERAS_DIST_CPU_OPERATIONS", ("auto", "shm", "mpi"), "auto",
                "HOROVOD_CPU_OPERATIONS",
            ),
            gpu_operations=_choice(
                "KERAS_DIST_GPU_OPERATIONS", ("auto", "nccl", "mpi"), "auto",
                "HOROVOD_GPU_OPERATIONS",
            ),
            size_one_shortcut=_flag("KERAS_DIST_SIZE_ONE_SHORTCUT", True),
            fusion_threshold_bytes=_int(
                "KERAS_DIST_FUSION_THRESHOLD", 64 * _MIB, "HOROVOD_FUSION_THRESHOLD"
            ),
            stall_check_seconds=_float(
                "KERAS_DIST_STALL_CHECK_SECONDS", 60.0, "HOROVOD_STALL_CHECK_TIME_SECONDS"
            ),
            timeout_seconds=timeout if timeout else None,
            timeline_path=(_raw("KERAS_DIST_TIMELINE", "HOROVOD_TIMELINE") or (None, None))[1],
            ranks_per_node=_int("KERAS_DIST_RANKS_PER_NODE", None) or None,
            shm_slot_bytes=_int("KERAS_DIST_SHM_SLOT_BYTES", 16 * _MIB),
            shm_single_copy=_choice("KERAS_DIST_SHM_SINGLE_COPY", ("auto", "off"), "auto"),
            shm_single_copy_bytes=_int("KERAS_DIST_SHM_SINGLE_COPY_BYTES", _MIB),
            rendezvous_timeout_seconds=_float("KERAS_DIST_RENDEZVOUS_TIMEOUT", 300.0),
            rendezvous_secret=_secret(),
            rendezvous_served_by_launcher=_flag("KERAS_DIST_RENDEZVOUS_SERVED_BY_LAUNCHER",
                                                False),
            job_id=(_raw("KERAS_DIST_JOB_ID") or (None, None))[1],
            dynamic_process_sets=_flag(
                "KERAS_DIST_DYNAMIC_PROCESS_SETS", False, "HOROVOD_DYNAMIC_PROCESS_SETS"
            ),
            elastic_job=(_raw("KERAS_DIST_ELASTIC_JOB") or (None, None))[1]
            or _torchrun_elastic_job(),
            elastic_round=_int("KERAS_DIST_ELASTIC_ROUND", None)
            or _int("TORCHELASTIC_RESTART_COUNT", 0),
            elastic_dir=(_raw("KERAS_DIST_ELASTIC_DIR") or (None, None))[1],
        )
