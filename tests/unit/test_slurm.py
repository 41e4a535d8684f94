"""kdrun inside a Slurm job: Slurm's node lists and task counts, the hosts and
-np they give, and the mpiexec command line that launches through Slurm."""

import pytest

from keras_dist.launcher import mpiexec, slurm
from keras_dist.launcher.options import UsageError, parse_args

# --- SLURM_JOB_NODELIST --------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("node[7]", ["node7"]),
        ("node[1,3,5]", ["node1", "node3", "node5"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[001-002]", ["n001", "n002"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a[1-2],b,c[3,5-6]", ["a1", "a2", "b", "c3", "c5", "c6"]),
        ("gpu-a100-[1-2].cluster.org",
         ["gpu-a100-1.cluster.org", "gpu-a100-2.cluster.org"]),
        ("[1-3]", ["1", "2", "3"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("  node[1-2]\n", ["node1", "node2"]),
    ],
)
def test_expand_nodelist(text, expected):
    assert slurm.expand_nodelist(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "list of names"),
        ("a,,b", "list of names"),
        ("a,", "list of names"),
        (",a", "list of names"),
        ("node[1-2", "list of names"),
        ("node1-2]", "list of names"),
        ("node]1[", "list of names"),
        ("node[1[2]]", "list of names"),
        ("node 1", "list of names"),
        ("node*", "list of names"),
        ("node[]", r"Received: \[\] in 'node\[\]'"),
        ("node[3-1]", r"Received: \[3-1\] in 'node\[3-1\]'"),
        ("node[a-b]", r"Received: \[a-b\]"),
        ("node[1-]", r"Received: \[1-\]"),
        ("node[-1]", r"Received: \[-1\]"),
        ("node[1,,2]", r"Received: \[1,,2\]"),
        ("node[1-2-3]", r"Received: \[1-2-3\]"),
    ],
)
def test_expand_nodelist_errors(text, message):
    with pytest.raises(ValueError, match=message) as info:
        slurm.expand_nodelist(text)
    assert "`SLURM_JOB_NODELIST`" in str(info.value)


# --- SLURM_TASKS_PER_NODE --------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1", [1]),
        ("4", [4]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("2(x3)", [2, 2, 2]),
        ("1,2(x2),3", [1, 2, 2, 3]),
        ("16(x1)", [16]),
        ("8(x2),4(x2)", [8, 8, 4, 4]),
    ],
)
def test_expand_tasks_per_node(text, expected):
    assert slurm.expand_tasks_per_node(text) == expected


@pytest.mark.parametrize(
    "text", ["", "0", "2(x0)", "x", "2(3)", "2(x3", "2x3", "2(x3),", "-1", "2(x-1)"])
def test_expand_tasks_per_node_errors(text):
    with pytest.raises(ValueError, match=r"`SLURM_TASKS_PER_NODE` must be a comma-separated "
                                         r"list of N or N\(xM\)") as info:
        slurm.expand_tasks_per_node(text)
    assert f"Received: {text!r}" in str(info.value)


# --- the allocation ------------------------------------------------------------


def _env(**values):
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-03,07],gpu5",
           "SLURM_TASKS_PER_NODE": "2(x3),1,4", "SLURM_NTASKS": "11",
           "HOME": "/root"}
    env.update(values)
    return {name: value for name, value in env.items() if value is not None}


def test_find_allocation():
    allocation = slurm.find_allocation(_env())
    assert allocation == slurm.Allocation(
        job_id="42",
        hosts=(("node01", 2), ("node02", 2), ("node03", 2), ("node07", 1), ("gpu5", 4)),
        num_tasks=11,
    )


def test_no_allocation_without_job_id_or_nodelist():
    assert slurm.find_allocation({}) is None
    assert slurm.find_allocation(_env(SLURM_JOB_ID=None)) is None
    assert slurm.find_allocation(_env(SLURM_JOB_NODELIST=None)) is None
    assert slurm.find_allocation(_env(SLURM_JOB_ID="")) is None


def test_num_tasks_defaults_to_the_tasks_of_all_nodes():
    assert slurm.find_allocation(_env(SLURM_NTASKS=None)).num_tasks == 11
    assert slurm.find_allocation(_env(SLURM_NTASKS="3")).num_tasks == 3


def test_allocation_counts_must_match_the_nodes():
    with pytest.raises(ValueError, match=r"one count per node of `SLURM_JOB_NODELIST` \(5 "
                                         r"nodes\)\. Received: SLURM_TASKS_PER_NODE='2\(x3\)'"
                                         r" \(3 counts\)"):
        slurm.find_allocation(_env(SLURM_TASKS_PER_NODE="2(x3)"))


def test_allocation_without_tasks_per_node():
    with pytest.raises(ValueError, match="Inside Slurm job 42, `SLURM_TASKS_PER_NODE` must be "
                                         "set.*Received: it is not set"):
        slurm.find_allocation(_env(SLURM_TASKS_PER_NODE=None))


def test_allocation_node_listed_twice():
    with pytest.raises(ValueError, match="must name each node once. Received: 'a,b,a'"):
        slurm.find_allocation(_env(SLURM_JOB_NODELIST="a,b,a", SLURM_TASKS_PER_NODE="1(x3)"))


@pytest.mark.parametrize("ntasks", ["0", "x", "", "-2"])
def test_allocation_bad_ntasks(ntasks):
    with pytest.raises(ValueError, match=f"`SLURM_NTASKS` must be a whole number >= 1. "
                                         f"Received: SLURM_NTASKS={ntasks!r}"):
        slurm.find_allocation(_env(SLURM_NTASKS=ntasks))


def test_allocation_bad_nodelist_is_raised():
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        slurm.find_allocation(_env(SLURM_JOB_NODELIST="node[1-"))


# --- kdrun's options in a Slurm job ------------------------------------------------


def test_args_take_hosts_and_np_from_slurm():
    options = parse_args(["python", "train.py"], _env())
    assert options.slurm
    assert options.num_proc == 11
    assert options.hosts == (("node01", 2), ("node02", 2), ("node03", 2), ("node07", 1),
                             ("gpu5", 4))
    assert options.command == ("python", "train.py")


def test_args_np_given_in_slurm_job():
    assert parse_args(["-np", "4", "python"], _env()).num_proc == 4


def test_args_np_above_the_job_tasks():
    with pytest.raises(UsageError, match=r"^`-np` must be at most the 11 slots of the hosts "
                                         r"\(Slurm job 42: node01:2,node02:2,node03:2,"
                                         r"node07:1,gpu5:4\)\. Received: -np 12$"):
        parse_args(["-np", "12", "python"], _env())


def test_args_slurm_ntasks_above_the_tasks_per_node():
    with pytest.raises(UsageError, match=r"Received: SLURM_NTASKS=12$"):
        parse_args(["python"], _env(SLURM_NTASKS="12"))


def test_args_bad_slurm_variable_is_a_usage_error():
    with pytest.raises(UsageError, match="SLURM_TASKS_PER_NODE"):
        parse_args(["python"], _env(SLURM_TASKS_PER_NODE="2(x3),1,x"))


def test_args_outside_slurm():
    options = parse_args(["-np", "2", "python"], _env(SLURM_JOB_ID=None))
    assert not options.slurm and options.hosts == ()


# --- the command line ----------------------------------------------------------------


def test_mpich_launches_through_slurm():
    options = parse_args(["python", "x.py"], _env())
    args = mpiexec.build_command("/bin/mpiexec", "mpich", options,
                                 {"KERAS_DIST_JOB_ID": "abc"})
    assert args == [
        "/bin/mpiexec", "-launcher", "slurm",
        "-hosts", "node01:2,node02:2,node03:2,node07:1,gpu5:4",
        "-genv", "KERAS_DIST_JOB_ID", "abc", "-n", "11", "python", "x.py",
    ]


@pytest.mark.parametrize("flavor", ["openmpi", "openmpi5"])
def test_openmpi_finds_the_slurm_job_itself(flavor):
    options = parse_args(["-np", "4", "python", "x.py"], _env())
    args = mpiexec.build_command("mpirun", flavor, options, {"KERAS_DIST_JOB_ID": "abc"})
    assert "-H" not in args and "-launcher" not in args
    assert "KERAS_DIST_JOB_ID=abc" in args
    assert args[-4:] == ["-np", "4", "python", "x.py"]
