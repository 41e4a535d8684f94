"""A Slurm allocation's hosts and slots, read from the environment Slurm gives
a batch script or an ``salloc`` shell.

Slurm writes node lists in its compressed hostlist syntax
(``node[01-03,07],gpu5``) and task counts run-length encoded (``2(x3),1``);
the functions here expand both. They are pure: the environment is an argument.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping

from keras_dist.launcher.hosts import HOST_NAME, Hosts

JOB_ID_ENV = "SLURM_JOB_ID"
NODELIST_ENV = "SLURM_JOB_NODELIST"
TASKS_PER_NODE_ENV = "SLURM_TASKS_PER_NODE"
NTASKS_ENV = "SLURM_NTASKS"

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASK_COUNT = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The Slurm job kdrun runs in.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        hosts: each node of the job with its number of tasks, in Slurm's order.
        num_tasks: ``SLURM_NTASKS``, or the tasks of all nodes when it is not set.
    """

    job_id: str
    hosts: Hosts
    num_tasks: int


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return items


def _expand_ranges(body: str, text: str) -> list[str]:
    """``01-03,07`` -> ``["01", "02", "03", "07"]``, each as wide as its lower bound."""
    numbers = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if match is None or (match.group(2) is not None
                             and int(match.group(2)) < int(match.group(1))):
            raise ValueError(
                f"`{NODELIST_ENV}` brackets must hold N or N-M ranges with N <= M, "
                f"separated by commas. Received: [{body}] in {text!r}"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        numbers += [f"{value:0{len(low)}d}" for value in range(int(low), int(high) + 1)]
    return numbers


def expand_nodelist(text: str) -> list[str]:
    """Expands a Slurm host list: ``"node[01-03,07],gpu5"`` -> ``["node01", "node02",
    "node03", "node07", "gpu5"]``.

    A name may hold several bracket groups (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1,
    r2n2``); numbers keep the width of the range's lower bound (``[8-10]`` -> ``8, 9,
    10``; ``[08-10]`` -> ``08, 09, 10``).

    Raises:
        ValueError: an empty name, unbalanced or nested brackets, or a bad range.
    """
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        # Literal pieces and bracket bodies alternate: "r[1-2]n[1-2]" -> r, 1-2, n, 1-2, "".
        pieces = re.split(r"\[([^\[\]]*)\]", item)
        literals = "".join(pieces[0::2])
        if not item or (literals and not HOST_NAME.fullmatch(literals)):
            raise ValueError(
                f"`{NODELIST_ENV}` must be a comma-separated list of names such as "
                f"node[01-03,07]. Received: {text!r}"
            )
        choices = [[piece] if index % 2 == 0 else _expand_ranges(piece, text)
                   for index, piece in enumerate(pieces)]
        names += ["".join(parts) for parts in itertools.product(*choices)]
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """Expands Slurm's task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: an item that is not ``N`` or ``N(xM)`` with N, M >= 1.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASK_COUNT.fullmatch(item.strip())
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise ValueError(
                f"`{TASKS_PER_NODE_ENV}` must be a comma-separated list of N or N(xM) with "
                f"N, M >= 1. Received: {text!r}"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def find_allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The Slurm job described by ``environ``; None outside one (``SLURM_JOB_ID``
    or ``SLURM_JOB_NODELIST`` unset).

    Raises:
        ValueError: a malformed Slurm variable, ``SLURM_TASKS_PER_NODE`` missing
            or counting a different number of nodes than ``SLURM_JOB_NODELIST``,
            or a node listed twice.
    """
    job_id, nodelist = environ.get(JOB_ID_ENV), environ.get(NODELIST_ENV)
    if not job_id or not nodelist:
        return None
    nodes = expand_nodelist(nodelist)
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"`{NODELIST_ENV}` must name each node once. Received: {nodelist!r}")
    tasks_text = environ.get(TASKS_PER_NODE_ENV)
    if not tasks_text:
        raise ValueError(
            f"Inside Slurm job {job_id}, `{TASKS_PER_NODE_ENV}` must be set to the tasks "
            "of each node (Slurm sets it for sbatch and salloc). Received: it is not set. "
            "Give the hosts with -H or --hostfile instead."
        )
    tasks = expand_tasks_per_node(tasks_text)
    if len(tasks) != len(nodes):
        raise ValueError(
            f"`{TASKS_PER_NODE_ENV}` must give one count per node of `{NODELIST_ENV}` "
            f"({len(nodes)} nodes). Received: {TASKS_PER_NODE_ENV}={tasks_text!r} "
            f"({len(tasks)} counts), {NODELIST_ENV}={nodelist!r}"
        )
    ntasks = environ.get(NTASKS_ENV)
    if ntasks is not None and (not ntasks.strip().isdigit() or int(ntasks) < 1):
        raise ValueError(f"`{NTASKS_ENV}` must be a whole number >= 1. "
                         f"Received: {NTASKS_ENV}={ntasks!r}")
    return Allocation(
        job_id=job_id,
        hosts=tuple(zip(nodes, tasks)),
        num_tasks=int(ntasks) if ntasks is not None else sum(tasks),
    )
