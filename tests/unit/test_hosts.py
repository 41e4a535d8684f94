"""kdrun's hosts: ``-H`` lists, host files, ``-np`` against the slots, and the
mpiexec command lines they give."""

import os

import pytest

from keras_dist.launcher import hosts, mpiexec
from keras_dist.launcher.options import UsageError, parse_args

NO_SLURM: dict[str, str] = {}


# --- -H ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a", (("a", 1),)),
        ("a:4", (("a", 4),)),
        ("a:04", (("a", 4),)),
        ("node1:2,node2:4,node3", (("node1", 2), ("node2", 4), ("node3", 1))),
        (" a:2 , b ", (("a", 2), ("b", 1))),
        ("10.0.0.1:2,10.0.0.2:2", (("10.0.0.1", 2), ("10.0.0.2", 2))),
        ("gpu-node_3.cluster.org:8", (("gpu-node_3.cluster.org", 8),)),
    ],
)
def test_host_list(text, expected):
    assert hosts.parse_host_list(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("a:0", "slots >= 1"),
        ("a:-1", "slots >= 1"),
        ("a:x", "slots >= 1"),
        ("a:", "slots >= 1"),
        ("a:00", "slots >= 1"),
        (":2", "slots >= 1"),
        ("a,,b", "slots >= 1"),
        ("a b", "slots >= 1"),
        ("a:2,a:1", "'a' is listed twice"),
    ],
)
def test_host_list_errors_say_what_was_received(text, message):
    with pytest.raises(ValueError, match=message) as info:
        hosts.parse_host_list(text)
    assert f"Received: -H {text!r}" in str(info.value)


# --- host files ----------------------------------------------------------------


def test_hostfile_all_forms_comments_and_blank_lines():
    text = (
        "# cluster A\n"
        "\n"
        "node1 slots=4\n"
        "node2:2   # the -H form\n"
        "   node3\t\n"
        "node4 slots = 3\n"
        "node5\tslots=1  # tab\n"
        "  # indented comment\n"
    )
    assert hosts.parse_hostfile(text, "hf") == (
        ("node1", 4), ("node2", 2), ("node3", 1), ("node4", 3), ("node5", 1))


def test_hostfile_keeps_the_order_of_its_lines():
    assert hosts.parse_hostfile("b slots=1\na slots=2\n", "hf") == (("b", 1), ("a", 2))


@pytest.mark.parametrize(
    "line",
    [
        "node1 slots=0",
        "node1 slots=x",
        "node1 slots=",
        "node1 slot=4",
        "node1 max_slots=4",
        "node1 4",
        "node1:2 slots=2",
        "node1 slots=2 extra",
        "node1:0",
        "node1:",
        "slots=2",
        "no*de slots=1",
    ],
)
def test_hostfile_bad_line_names_file_line_and_text(line):
    text = f"# header\ngood slots=1\n{line}\n"
    with pytest.raises(ValueError) as info:
        hosts.parse_hostfile(text, "/etc/hosts.kd")
    message = str(info.value)
    assert message.startswith("/etc/hosts.kd:3: ")
    assert "`host slots=N`, `host:N` or `host`" in message
    assert f"Received: {line!r}" in message


def test_hostfile_host_listed_twice():
    with pytest.raises(ValueError, match=r"^hf:4: host 'a' is already listed on line 1"):
        hosts.parse_hostfile("a slots=1\nb\n\na:2\n", "hf")


@pytest.mark.parametrize("text", ["", "\n\n", "# only\n  # comments\n"])
def test_hostfile_without_hosts(text):
    with pytest.raises(ValueError, match="^hf: the host file lists no host"):
        hosts.parse_hostfile(text, "hf")


def test_read_hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=2\nb slots=2\n")
    assert hosts.read_hostfile(str(path)) == (("a", 2), ("b", 2))


def test_read_missing_hostfile(tmp_path):
    path = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"Cannot read the host file '{path}'.*No such file"):
        hosts.read_hostfile(path)


def test_total_slots_and_format():
    assert hosts.total_slots((("a", 2), ("b", 3))) == 5
    assert hosts.format_hosts((("a", 2), ("b", 3))) == "a:2,b:3"


# --- parse_args: hosts and -np ---------------------------------------------------


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two nodes\nn1 slots=2\nn2 slots=3\n")
    return str(path)


def test_args_hostfile(hostfile):
    options = parse_args(["-np", "4", "--hostfile", hostfile, "python", "x.py"], NO_SLURM)
    assert options.hosts == (("n1", 2), ("n2", 3))
    assert options.num_proc == 4
    assert not options.slurm


def test_args_hostfile_spellings(hostfile):
    for argv in (["-hostfile", hostfile], [f"--hostfile={hostfile}"]):
        assert parse_args([*argv, "x"], NO_SLURM).hosts == (("n1", 2), ("n2", 3))


def test_args_np_defaults_to_the_slots_of_the_hosts(hostfile):
    assert parse_args(["--hostfile", hostfile, "python"], NO_SLURM).num_proc == 5
    assert parse_args(["-H", "a:2,b", "python"], NO_SLURM).num_proc == 3


def test_args_np_may_use_fewer_slots_than_given():
    options = parse_args(["-np", "1", "-H", "a:2,b:2", "python"], NO_SLURM)
    assert options.num_proc == 1 and options.hosts == (("a", 2), ("b", 2))


def test_args_np_above_the_slots_is_an_error(hostfile):
    with pytest.raises(UsageError, match=r"^`-np` must be at most the 4 slots of the hosts "
                                         r"\(-H a:2,b:2\)\. Received: -np 5$"):
        parse_args(["-np", "5", "-H", "a:2,b:2", "python"], NO_SLURM)
    with pytest.raises(UsageError, match=rf"5 slots of the hosts \(--hostfile {hostfile}\)\. "
                                         r"Received: -np 6$"):
        parse_args(["-np", "6", "--hostfile", hostfile, "python"], NO_SLURM)


def test_args_np_is_required_without_hosts():
    with pytest.raises(UsageError, match="`-np N` is required without -H, --hostfile, a "
                                         "Slurm job or an MPI host file variable"):
        parse_args(["python"], NO_SLURM)


def test_args_np_without_hosts_is_not_limited():
    assert parse_args(["-np", "64", "python"], NO_SLURM).num_proc == 64


def test_args_hosts_and_hostfile_together(hostfile):
    with pytest.raises(UsageError, match=r"`-H` and `--hostfile` cannot be used together\. "
                                         rf"Received: -H 'a:2' --hostfile '{hostfile}'"):
        parse_args(["-H", "a:2", "--hostfile", hostfile, "python"], NO_SLURM)


def test_args_bad_hostfile_is_a_usage_error(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=two\n")
    with pytest.raises(UsageError, match=rf"^{path}:2: a host file line"):
        parse_args(["--hostfile", str(path), "python"], NO_SLURM)
    with pytest.raises(UsageError, match="Cannot read the host file"):
        parse_args(["--hostfile", str(tmp_path / "none"), "python"], NO_SLURM)


def test_args_explicit_hosts_win_over_slurm(hostfile):
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "s[1-2]",
             "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS": "8"}
    options = parse_args(["-H", "a:2", "python"], slurm)
    assert options.hosts == (("a", 2),) and options.num_proc == 2 and not options.slurm
    options = parse_args(["--hostfile", hostfile, "python"], slurm)
    assert options.hosts == (("n1", 2), ("n2", 3)) and not options.slurm


def test_args_default_environment_is_os_environ(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS",
                 *hosts.HOSTFILE_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert parse_args(["-np", "2", "python"]).hosts == ()
    monkeypatch.setenv("SLURM_JOB_ID", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "c[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    options = parse_args(["python"])
    assert options.hosts == (("c1", 1), ("c2", 1)) and options.slurm


# --- the host file an MPI's variables name (a Kubeflow MPIJob's launcher) -------------
#
# The MPI Operator (MPIJob v2beta1) writes /etc/mpi/hostfile from a ConfigMap,
# one line per worker pod, "<pod>.<job>.<namespace>.svc[.<cluster domain>]":
# "<name>:<slots>" for MPICH and Intel MPI, "<name> slots=<slots>" for Open
# MPI, the launcher first with runLauncherAsWorker; and names it in the
# launcher pod's HYDRA_HOST_FILE (MPICH), I_MPI_HYDRA_HOST_FILE (Intel) or
# OMPI_MCA_orte_default_hostfile (Open MPI).

MPICH_HOSTFILE = "pi-worker-0.pi.default.svc:2\npi-worker-1.pi.default.svc:2\n"
OPENMPI_HOSTFILE = "pi-worker-0.pi.default.svc slots=2\npi-worker-1.pi.default.svc slots=2\n"
WORKERS = (("pi-worker-0.pi.default.svc", 2), ("pi-worker-1.pi.default.svc", 2))


@pytest.fixture
def mpijob(tmp_path):
    """Writes a host file as the operator does; returns its path."""
    def write(text, name="hostfile"):
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write


@pytest.mark.parametrize("variable, text", [
    ("HYDRA_HOST_FILE", MPICH_HOSTFILE),
    ("I_MPI_HYDRA_HOST_FILE", MPICH_HOSTFILE),
    ("OMPI_MCA_orte_default_hostfile", OPENMPI_HOSTFILE),
])
def test_args_take_the_hosts_of_the_mpijob_hostfile(mpijob, variable, text):
    path = mpijob(text)
    environ = {variable: path, "K_MPI_JOB_ROLE": "launcher"}
    options = parse_args(["python", "train.py"], environ)
    assert options.hosts == WORKERS
    assert options.num_proc == 4  # the slots of the workers
    assert options.hosts_source == f"{variable}={path}"
    assert not options.slurm


def test_mpijob_hostfile_with_a_cluster_domain_and_the_launcher_as_worker(mpijob):
    # --cluster-domain given to the operator, and runLauncherAsWorker: true.
    path = mpijob("pi-launcher.pi.team-a.svc.cluster.local:1\n"
                  "pi-worker-0.pi.team-a.svc.cluster.local:1\n")
    options = parse_args(["python"], {"HYDRA_HOST_FILE": path})
    assert options.hosts == (("pi-launcher.pi.team-a.svc.cluster.local", 1),
                             ("pi-worker-0.pi.team-a.svc.cluster.local", 1))


def test_mpijob_hostfile_np_may_use_fewer_slots_and_not_more(mpijob):
    path = mpijob(MPICH_HOSTFILE)
    assert parse_args(["-np", "3", "python"], {"HYDRA_HOST_FILE": path}).num_proc == 3
    with pytest.raises(UsageError, match=rf"^`-np` must be at most the 4 slots of the hosts "
                                         rf"\(HYDRA_HOST_FILE={path}\)\. Received: -np 5$"):
        parse_args(["-np", "5", "python"], {"HYDRA_HOST_FILE": path})


def test_explicit_hosts_and_slurm_win_over_the_mpijob_hostfile(mpijob, hostfile):
    environ = {"HYDRA_HOST_FILE": mpijob(MPICH_HOSTFILE)}
    assert parse_args(["-H", "a:2", "python"], environ).hosts == (("a", 2),)
    options = parse_args(["--hostfile", hostfile, "python"], environ)
    assert options.hosts == (("n1", 2), ("n2", 3))
    assert options.hosts_source == f"--hostfile {hostfile}"
    slurm = {**environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "s[1-2]",
             "SLURM_TASKS_PER_NODE": "1(x2)"}
    options = parse_args(["python"], slurm)
    assert options.slurm and options.hosts == (("s1", 1), ("s2", 1))


def test_no_variable_no_hostfile():
    # A stray /etc/mpi/hostfile (or an MPIJob's role variable alone) changes nothing:
    # only a variable naming the file does.
    environ = {"K_MPI_JOB_ROLE": "launcher", "HYDRA_HOST_FILE": ""}
    assert hosts.hostfile_from_environment(environ) is None
    options = parse_args(["-np", "2", "python"], environ)
    assert options.hosts == () and options.hosts_source == ""
    with pytest.raises(UsageError, match="`-np N` is required"):
        parse_args(["python"], environ)


def test_hostfile_variables_naming_one_file_or_two(mpijob):
    path = mpijob(MPICH_HOSTFILE)
    both = {"HYDRA_HOST_FILE": path, "OMPI_MCA_orte_default_hostfile": path}
    assert hosts.hostfile_from_environment(both) == ("HYDRA_HOST_FILE", path)
    other = mpijob(OPENMPI_HOSTFILE, "other")
    with pytest.raises(UsageError, match=r"^The MPI host file variables must name one file\. "
                                         rf"Received: HYDRA_HOST_FILE='{path}', "
                                         rf"OMPI_MCA_orte_default_hostfile='{other}'\. "
                                         r"Give the hosts with -H or --hostfile\.$"):
        parse_args(["python"], {**both, "OMPI_MCA_orte_default_hostfile": other})


def test_mpijob_hostfile_missing_or_malformed_names_the_variable(mpijob, tmp_path):
    missing = str(tmp_path / "none")
    with pytest.raises(UsageError, match=rf"^Cannot read the host file '{missing}'.*No such "
                                         r"file.*\(the host file HYDRA_HOST_FILE names, read "
                                         r"when no -H or --hostfile is given\)$"):
        parse_args(["python"], {"HYDRA_HOST_FILE": missing})
    path = mpijob("pi-worker-0.pi.default.svc:2\npi-worker-1.pi.default.svc:0\n")
    with pytest.raises(UsageError, match=rf"^{path}:2: a host file line .*"
                                         r"\(the host file HYDRA_HOST_FILE names"):
        parse_args(["python"], {"HYDRA_HOST_FILE": path})
    # -H does not read it at all.
    assert parse_args(["-H", "a", "python"], {"HYDRA_HOST_FILE": missing}).hosts == (("a", 1),)


def test_a_discovery_script_gives_the_hosts_instead_of_the_mpijob_hostfile(mpijob, tmp_path):
    # The operator's /etc/mpi/discover_hosts.sh prints the running workers, one a line.
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho pi-worker-0.pi.default.svc\n")
    script.chmod(0o755)
    options = parse_args(["-np", "2", "--host-discovery-script", str(script), "--slots", "2",
                          "python"], {"HYDRA_HOST_FILE": mpijob(MPICH_HOSTFILE)})
    assert options.hosts == () and options.elastic.discovery_script == str(script)


def test_mpich_command_from_the_mpijob_hostfile(mpijob):
    options = parse_args(["python", "x.py"], {"HYDRA_HOST_FILE": mpijob(MPICH_HOSTFILE)})
    args = mpiexec.build_command("mpiexec", "mpich", options, {})
    assert args == ["mpiexec", "-hosts", "pi-worker-0.pi.default.svc:2,"
                    "pi-worker-1.pi.default.svc:2", "-n", "4", "python", "x.py"]


# --- command lines -----------------------------------------------------------------


def test_mpich_command_from_a_hostfile(hostfile):
    options = parse_args(["--hostfile", hostfile, "python", "x.py"], NO_SLURM)
    args = mpiexec.build_command("mpiexec", "mpich", options, {})
    assert args == ["mpiexec", "-hosts", "n1:2,n2:3", "-n", "5", "python", "x.py"]


def test_openmpi_command_from_a_hostfile(hostfile):
    options = parse_args(["-np", "3", "--hostfile", hostfile, "python"], NO_SLURM)
    args = mpiexec.build_command("mpirun", "openmpi", options, {})
    assert args[args.index("-H") + 1] == "n1:2,n2:3"
    assert args[-3:] == ["-np", "3", "python"]
    assert "-launcher" not in args


def test_no_hosts_no_host_arguments():
    options = parse_args(["-np", "2", "python"], NO_SLURM)
    for flavor in ("mpich", "openmpi", "openmpi5"):
        args = mpiexec.build_command("mpiexec", flavor, options, {})
        assert not {"-hosts", "-H", "-launcher"} & set(args), (flavor, args)
    assert ("--allow-run-as-root" in mpiexec.build_command("mpirun", "openmpi", options, {})
            ) == (os.geteuid() == 0)
