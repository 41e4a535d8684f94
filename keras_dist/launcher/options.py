"""kdrun's command line: parsing and the options it yields."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from keras_dist.launcher import hosts as _hosts
from keras_dist.launcher import slurm as _slurm

USAGE = """\
usage: kdrun [-np N] [-H HOST:SLOTS[,...] | --hostfile FILE] [--timeline PATH]
             [--output-dir DIR] [--no-label] [--ranks LIST] [--bind-to none|core]
             [--gpu-per-rank] [--] COMMAND...

Runs COMMAND (no shell) on N ranks through mpiexec.

options:
  -np N, -n N          number of ranks (default: the slots of the hosts; required
                       without hosts); at most the slots of the hosts
  -H, --hosts LIST     hosts and slots, e.g. node1:2,node2:2 (default: the nodes of
                       the Slurm job kdrun runs in, else the host file named by
                       HYDRA_HOST_FILE, I_MPI_HYDRA_HOST_FILE or
                       OMPI_MCA_orte_default_hostfile, as in a Kubeflow MPIJob's
                       launcher, else this machine)
  --hostfile FILE      hosts from FILE, one a line: `host slots=N`, `host:N` or `host`
  --timeline PATH      write a Chrome-trace timeline of the collectives to PATH
  --output-dir DIR     write each rank's output to DIR/rank<r>.stdout and .stderr
                       (unlabelled) instead of printing it
  --no-label           print the ranks' lines without the `[rank] ` prefix
  --ranks LIST         print only these ranks' output, e.g. --ranks 0 or --ranks 0,2
  --bind-to WHAT       none (default): ranks run on any core; core: each rank is
                       pinned to one core of its host, in order (for ranks of one
                       thread each, at most one rank per core)
  --gpu-per-rank       give each rank one GPU of its host: CUDA_VISIBLE_DEVICES is
                       the GPU at its local rank (among those CUDA_VISIBLE_DEVICES
                       lists for kdrun, else GPU <local rank>)
  --mpiexec PATH       the mpiexec to use (default: beside this Python, else on PATH)
  -h, --help           show this message

elastic jobs (any of these makes the job elastic: after a failure kdrun launches
it again on the healthy slots, and the ranks resume from their last commit):
  --max-restarts R     relaunch after a failure at most R times (default 3)
  --min-np MIN         fewest ranks to run on (default: -np)
  --max-np MAX         most ranks to grow to (default: -np)
  --host-discovery-script S
                       an executable printing the usable hosts, one a line,
                       `host:slots` or `host`; run every second while the job
                       runs: the job resizes at its next commit when they change
  --slots N            slots of a discovered host given without them (default 1)
  --elastic-timeout T  seconds to wait for MIN slots before giving up (default 600;
                       also HOROVOD_ELASTIC_TIMEOUT)
  --host-cooldown T    seconds a host that failed is left out (default 60)
"""


#: What ``--bind-to`` accepts.
BIND_TO = ("none", "core")


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """How kdrun runs an elastic job (see ``keras_dist.launcher.elastic``)."""

    min_np: int
    max_np: int
    max_restarts: int = 3
    discovery_script: str | None = None
    slots: int = 1
    timeout: float = 600.0
    cooldown: float = 60.0


class UsageError(ValueError):
    """The command line given to kdrun is invalid."""


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """A parsed kdrun command line."""

    num_proc: int
    command: tuple[str, ...]
    hosts: tuple[tuple[str, int], ...] = ()
    timeline: str | None = None
    mpiexec: str | None = None
    output_dir: str | None = None
    #: Prefix each line of a rank's output with ``[rank] ``.
    label: bool = True
    #: Print only these ranks' output (None: every rank's).
    ranks: tuple[int, ...] | None = None
    #: The hosts are the nodes of the Slurm job kdrun runs in; mpiexec starts
    #: its processes there through Slurm.
    slurm: bool = False
    #: Set for an elastic job.
    elastic: ElasticOptions | None = None
    #: ``"none"``, or ``"core"``: mpiexec pins each rank to a core of its host.
    bind_to: str = "none"
    #: Each rank sees one GPU of its host, the one at its local rank
    #: (``supervisor.gpu_for_local_rank``).
    gpu_per_rank: bool = False
    #: Where the hosts came from, for messages: ``"-H a:2,b:2"``, ``"--hostfile
    #: F"``, ``"Slurm job 7: a:4,b:4"``, ``"HYDRA_HOST_FILE=/etc/mpi/hostfile"``;
    #: empty without hosts.
    hosts_source: str = ""


def _resolve_hosts(
    values: dict[str, str], environ: Mapping[str, str]
) -> tuple[_hosts.Hosts, str, _slurm.Allocation | None]:
    """The hosts from -H, --hostfile, Slurm or the host file an MPI variable
    names (in that order), with a description of where they came from for
    messages, and the Slurm job when they are its nodes.

    A host discovery script gives the hosts itself: then no MPI variable is
    looked at (-H, --hostfile and Slurm are, to refuse them with it)."""
    if "hosts" in values and "hostfile" in values:
        raise UsageError("`-H` and `--hostfile` cannot be used together. Received: "
                         f"-H {values['hosts']!r} --hostfile {values['hostfile']!r}")
    try:
        if "hosts" in values:
            return _hosts.parse_host_list(values["hosts"]), f"-H {values['hosts']}", None
        if "hostfile" in values:
            hosts = _hosts.read_hostfile(values["hostfile"])
            return hosts, f"--hostfile {values['hostfile']}", None
        allocation = _slurm.find_allocation(environ)
        if allocation is None and "discovery" not in values:
            named = _hosts.hostfile_from_environment(environ)
            if named is not None:
                return _hostfile_named_by(*named), "=".join(named), None
    except ValueError as error:
        raise UsageError(str(error)) from None
    if allocation is None:
        return (), "", None
    return (allocation.hosts,
            f"Slurm job {allocation.job_id}: {_hosts.format_hosts(allocation.hosts)}",
            allocation)


def _hostfile_named_by(variable: str, path: str) -> _hosts.Hosts:
    try:
        return _hosts.read_hostfile(path)
    except ValueError as error:
        raise ValueError(f"{error} (the host file {variable} names, read when no -H or "
                         "--hostfile is given)") from None


def parse_args(argv: list[str], environ: Mapping[str, str] | None = None) -> LaunchOptions:
    """Parses kdrun's arguments; everything from the command on is passed untouched.

    The hosts are those of ``-H`` or ``--hostfile``; without either, inside a
    Slurm job (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` in ``environ``), the
    job's nodes with ``SLURM_TASKS_PER_NODE`` slots each; else those of the host
    file that ``HYDRA_HOST_FILE``, ``I_MPI_HYDRA_HOST_FILE`` or
    ``OMPI_MCA_orte_default_hostfile`` names (a Kubeflow MPIJob's launcher pod
    has one; ``hosts.hostfile_from_environment``). ``-np`` defaults to
    ``SLURM_NTASKS`` in a Slurm job, else to the slots of the hosts given, and
    may not exceed those slots (as horovodrun: "Requested more processes than
    there are available slots"). Without hosts, ranks run on this machine and
    ``-np`` is required.

    Args:
        argv: kdrun's arguments, without the program name.
        environ: the environment to look for a Slurm job or an MPI host file in
            (default ``os.environ``).

    Raises:
        UsageError: an unknown option, a missing or malformed value, ``-H`` with
            ``--hostfile``, a bad host file, Slurm variable or MPI host file
            variable, ``-np`` above the slots of the hosts, or no command.
    """
    values: dict[str, str] = {}
    names = {
        "-np": "np", "-n": "np", "--num-proc": "np",
        "-H": "hosts", "--hosts": "hosts", "-hosts": "hosts",
        "--hostfile": "hostfile", "-hostfile": "hostfile",
        "--timeline": "timeline", "--mpiexec": "mpiexec", "--output-dir": "output_dir",
        "--ranks": "ranks", "--max-restarts": "max_restarts", "--min-np": "min_np",
        "--max-np": "max_np", "--host-discovery-script": "discovery", "--slots": "slots",
        "--elastic-timeout": "elastic_timeout", "--host-cooldown": "cooldown",
        "--bind-to": "bind_to", "-bind-to": "bind_to",
    }
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            index += 1
            break
        if arg in ("-h", "--help"):
            raise UsageError("")
        if not arg.startswith("-") or arg == "-":
            break
        if arg in ("--no-label", "--gpu-per-rank"):  # the options without a value
            values[arg[2:].replace("-", "_")] = ""
            index += 1
            continue
        name, has_value, value = arg.partition("=")
        if name not in names:
            raise UsageError(f"Unknown option {arg!r}. Put `--` before the command if it "
                             "starts with '-'.")
        if not has_value:
            if index + 1 >= len(argv):
                raise UsageError(f"Option {name} needs a value.")
            index += 1
            value = argv[index]
        values[names[name]] = value
        index += 1
    command = tuple(argv[index:])
    hosts, hosts_source, allocation = _resolve_hosts(
        values, os.environ if environ is None else environ)
    if "np" in values and (not values["np"].isdigit() or int(values["np"]) < 1):
        raise UsageError(f"`-np` must be a whole number >= 1. Received: -np {values['np']!r}")
    elastic = _elastic_options(values, environ or os.environ)
    if elastic is not None and elastic.discovery_script:
        if hosts:
            raise UsageError("`--host-discovery-script` gives the hosts: it cannot be used "
                             f"with {hosts_source.split(' ')[0]}.")
        if "np" not in values:
            raise UsageError("`-np N` (the size to start at) is required with "
                             "--host-discovery-script.")
    if "np" in values:
        num_proc = int(values["np"])
    elif hosts:
        num_proc = allocation.num_tasks if allocation else _hosts.total_slots(hosts)
    else:
        raise UsageError("`-np N` is required without -H, --hostfile, a Slurm job or an MPI "
                         "host file variable.")
    if elastic is not None:
        elastic = dataclasses.replace(
            elastic, min_np=elastic.min_np or num_proc, max_np=elastic.max_np or num_proc)
        if not elastic.min_np <= num_proc <= elastic.max_np:
            raise UsageError(f"`--min-np` <= `-np` <= `--max-np` must hold. Received: --min-np "
                             f"{elastic.min_np} -np {num_proc} --max-np {elastic.max_np}")
        if hosts and elastic.min_np > _hosts.total_slots(hosts):
            raise UsageError(f"`--min-np` must be at most the {_hosts.total_slots(hosts)} slots "
                             f"of the hosts ({hosts_source}). Received: --min-np {elastic.min_np}")
        if hosts and num_proc > _hosts.total_slots(hosts):
            num_proc = _hosts.total_slots(hosts)
    if hosts and num_proc > _hosts.total_slots(hosts):
        given = f"-np {num_proc}" if "np" in values else f"SLURM_NTASKS={num_proc}"
        raise UsageError(
            f"`-np` must be at most the {_hosts.total_slots(hosts)} slots of the hosts "
            f"({hosts_source}). Received: {given}"
        )
    if not command:
        raise UsageError("No command given to run.")
    ranks = tuple(int(r) for r in values["ranks"].split(",") if r.strip().isdigit()) if (
        "ranks" in values) else None
    if ranks is not None and (not ranks or len(ranks) != len(values["ranks"].split(","))
                              or max(ranks) >= num_proc):
        raise UsageError(f"`--ranks` must be a comma-separated list of ranks in [0, {num_proc}). "
                         f"Received: --ranks {values['ranks']!r}")
    bind_to = values.get("bind_to", "none")
    if bind_to not in BIND_TO:
        raise UsageError(f"`--bind-to` must be one of {', '.join(BIND_TO)}. "
                         f"Received: --bind-to {bind_to!r}")
    timeline = values.get("timeline")
    return LaunchOptions(
        num_proc=num_proc,
        command=command,
        hosts=hosts,
        hosts_source=hosts_source,
        slurm=allocation is not None,
        timeline=os.path.abspath(timeline) if timeline else None,
        mpiexec=values.get("mpiexec"),
        output_dir=os.path.abspath(values["output_dir"]) if "output_dir" in values else None,
        label="no_label" not in values,
        ranks=ranks,
        elastic=elastic,
        bind_to=bind_to,
        gpu_per_rank="gpu_per_rank" in values,
    )


def _whole(values: dict[str, str], key: str, option: str, least: int) -> int | None:
    if key not in values:
        return None
    if not values[key].isdigit() or int(values[key]) < least:
        raise UsageError(f"`{option}` must be a whole number >= {least}. "
                         f"Received: {option} {values[key]!r}")
    return int(values[key])


def _seconds(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(
            f"`{option}` must be a number of seconds >= 0. Received: {option} {text!r}")
    return value


def _elastic_options(values: dict[str, str], environ: Mapping[str, str]) -> ElasticOptions | None:
    keys = ("max_restarts", "min_np", "max_np", "discovery", "slots", "elastic_timeout",
            "cooldown")
    if not any(key in values for key in keys):
        return None
    script = values.get("discovery")
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise UsageError("`--host-discovery-script` must be an executable file. "
                         f"Received: {script!r}")
    timeout = values.get("elastic_timeout", environ.get("HOROVOD_ELASTIC_TIMEOUT", "600"))
    return ElasticOptions(
        min_np=_whole(values, "min_np", "--min-np", 1) or 0,
        max_np=_whole(values, "max_np", "--max-np", 1) or 0,
        max_restarts=_whole(values, "max_restarts", "--max-restarts", 0) or (
            0 if values.get("max_restarts") == "0" else 3),
        discovery_script=os.path.abspath(script) if script else None,
        slots=_whole(values, "slots", "--slots", 1) or 1,
        timeout=_seconds(timeout, "--elastic-timeout"),
        cooldown=_seconds(values.get("cooldown", "60"), "--host-cooldown"),
    )
