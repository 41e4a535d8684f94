"""The hosts a job runs on and their slots, from ``-H`` or a host file.

Hosts are ``((name, slots), ...)`` in the order given; ranks fill them in that
order (host 0's slots first). A host file follows Open MPI's and Horovod's
syntax, one host per line::

    # comments and blank lines are ignored
    node1 slots=4
    node2:4        # the -H form works too
    node3          # one slot

An MPI's launcher may also be given its host file in the environment, as the
Kubeflow MPI Operator (MPIJob ``v2beta1``) does in the launcher pod: it
mounts ``/etc/mpi/hostfile`` (``<worker pod>.<job>.<namespace>.svc:<slots>``
lines for MPICH and Intel MPI, ``... slots=<slots>`` for Open MPI) and names
it in ``HYDRA_HOST_FILE``, ``I_MPI_HYDRA_HOST_FILE`` or
``OMPI_MCA_orte_default_hostfile``; ``hostfile_from_environment`` finds it.

Errors are ``ValueError``s that name what was expected and what was received
(with the file name and line number for a host file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

Hosts = tuple[tuple[str, int], ...]

#: The variables naming the host file of MPICH's hydra, Intel MPI's hydra and
#: Open MPI's mpirun, in the order kdrun looks at them (the Kubeflow MPI
#: Operator sets the one of the job's ``mpiImplementation``).
HOSTFILE_VARIABLES = ("HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE",
                      "OMPI_MCA_orte_default_hostfile")

#: Host names and IPv4 addresses, as Horovod accepts them.
HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SLOTS = re.compile(r"0*[1-9][0-9]*")


def total_slots(hosts: Hosts) -> int:
    """The number of ranks ``hosts`` hold."""
    return sum(slots for _, slots in hosts)


def format_hosts(hosts: Hosts) -> str:
    """``hosts`` as a ``-H`` value: ``"a:2,b:2"``."""
    return ",".join(f"{name}:{slots}" for name, slots in hosts)


def _host_and_slots(item: str) -> tuple[str, int] | None:
    """``host`` or ``host:slots`` -> (host, slots); None when it is neither."""
    name, colon, slots = item.partition(":")
    if not HOST_NAME.fullmatch(name) or (colon and not _SLOTS.fullmatch(slots)):
        return None
    return name, int(slots) if colon else 1


def parse_host_list(text: str) -> Hosts:
    """Parses a ``-H`` value: ``host[:slots],...``, a bare host counting one slot.

    Raises:
        ValueError: an item that is not ``host`` or ``host:slots`` with slots >= 1,
            or a host listed twice.
    """
    hosts: list[tuple[str, int]] = []
    for item in text.split(","):
        host = _host_and_slots(item.strip())
        if host is None:
            raise ValueError(
                "`-H` must be a comma-separated list of host[:slots] with slots >= 1. "
                f"Received: -H {text!r}"
            )
        if any(name == host[0] for name, _ in hosts):
            raise ValueError(f"`-H` must list each host once; {host[0]!r} is listed twice. "
                             f"Received: -H {text!r}")
        hosts.append(host)
    return tuple(hosts)


def _parse_hostfile_line(line: str) -> tuple[str, int] | None:
    """One host file line without its comment -> (host, slots); None if malformed."""
    fields = line.split()
    if len(fields) == 1:
        return _host_and_slots(fields[0])
    # "host slots=N", also written "host slots = N" or "host slots= N".
    rest = "".join(fields[1:])
    key, equals, slots = rest.partition("=")
    if (key != "slots" or not equals or not _SLOTS.fullmatch(slots)
            or not HOST_NAME.fullmatch(fields[0])):
        return None
    return fields[0], int(slots)


def parse_hostfile(text: str, filename: str) -> Hosts:
    """Parses the contents of a host file (see the module docstring).

    Args:
        text: the file's contents.
        filename: the file's name, for error messages.

    Raises:
        ValueError: a malformed line or a host listed twice (with its line
            number), or a file that lists no host.
    """
    hosts: list[tuple[str, int]] = []
    lines: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        host = _parse_hostfile_line(line)
        if host is None:
            raise ValueError(
                f"{filename}:{number}: a host file line must be `host slots=N`, `host:N` or "
                f"`host` with N >= 1. Received: {raw.strip()!r}"
            )
        if host[0] in lines:
            raise ValueError(f"{filename}:{number}: host {host[0]!r} is already listed on "
                             f"line {lines[host[0]]}; a host file must list each host once.")
        lines[host[0]] = number
        hosts.append(host)
    if not hosts:
        raise ValueError(f"{filename}: the host file lists no host (only blank lines and "
                         "comments).")
    return tuple(hosts)


def read_hostfile(path: str) -> Hosts:
    """Reads and parses the host file at ``path``.

    Raises:
        ValueError: the file cannot be read, or what ``parse_hostfile`` raises.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"Cannot read the host file {path!r}: {error}") from None
    return parse_hostfile(text, path)


def hostfile_from_environment(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The host file an MPI's own settings in ``environ`` name, as ``(variable,
    path)``; None when none of ``HOSTFILE_VARIABLES`` is set.

    Only the variables count: a file at ``/etc/mpi/hostfile`` that no variable
    names is not read, so a stray one never changes where a job runs.

    Raises:
        ValueError: two of the variables name different files.
    """
    named = [(name, environ[name]) for name in HOSTFILE_VARIABLES if environ.get(name)]
    if len({path for _, path in named}) > 1:
        given = ", ".join(f"{name}={path!r}" for name, path in named)
        raise ValueError("The MPI host file variables must name one file. Received: "
                         f"{given}. Give the hosts with -H or --hostfile.")
    return named[0] if named else None
