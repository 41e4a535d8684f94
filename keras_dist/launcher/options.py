"""kdrun's command line: parsing and the options it yields."""

from __future__ import annotations

import dataclasses
import os

USAGE = """\
usage: kdrun -np N [-H HOST:SLOTS[,...]] [--timeline PATH] [--output-dir DIR] [--] COMMAND...

Runs COMMAND (no shell) on N ranks through mpiexec.

options:
  -np N, -n N          number of ranks
  -H, --hosts LIST     hosts and slots, e.g. node1:2,node2:2 (default: this machine)
  --timeline PATH      write a Chrome-trace timeline of the collectives to PATH
  --output-dir DIR     write each rank's output to DIR/rank<r>.stdout and .stderr
                       (MPICH; Open MPI writes its own layout under DIR)
  --mpiexec PATH       the mpiexec to use (default: beside this Python, else on PATH)
  -h, --help           show this message
"""


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


def _parse_hosts(text: str) -> tuple[tuple[str, int], ...]:
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0":
            raise UsageError(
                f"`-H` must be a comma-separated list of host[:slots] with slots >= 1. "
                f"Received: -H {text!r}"
            )
        hosts.append((name, int(slots) if slots else 1))
    return tuple(hosts)


def parse_args(argv: list[str]) -> LaunchOptions:
    """Parses kdrun's arguments; everything from the command on is passed untouched.

    Raises:
        UsageError: an unknown option, a missing value, or no command.
    """
    values: dict[str, str] = {}
    names = {
        "-np": "np", "-n": "np", "--num-proc": "np",
        "-H": "hosts", "--hosts": "hosts", "-hosts": "hosts",
        "--timeline": "timeline", "--mpiexec": "mpiexec", "--output-dir": "output_dir",
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
    if "np" not in values:
        raise UsageError("`-np N` is required.")
    if not values["np"].isdigit() or int(values["np"]) < 1:
        raise UsageError(f"`-np` must be a whole number >= 1. Received: -np {values['np']!r}")
    if not command:
        raise UsageError("No command given to run.")
    timeline = values.get("timeline")
    return LaunchOptions(
        num_proc=int(values["np"]),
        command=command,
        hosts=_parse_hosts(values["hosts"]) if "hosts" in values else (),
        timeline=os.path.abspath(timeline) if timeline else None,
        mpiexec=values.get("mpiexec"),
        output_dir=os.path.abspath(values["output_dir"]) if "output_dir" in values else None,
    )
