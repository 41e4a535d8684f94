"""The job's secret: where it is read from, what is refused, and what rank 0
says when its rendezvous port is open to the network without one."""

import warnings

import pytest

from keras_dist._config import Config
from keras_dist._runtime import placement, rendezvous
from keras_dist.errors import RendezvousError

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def clean_env(monkeypatch):
    for name in rendezvous.SECRET_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_secret_is_the_empty_key(clean_env):
    assert Config.from_env().rendezvous_secret == b""


def test_the_secret_from_the_variable_or_a_file(clean_env, tmp_path):
    clean_env.setenv("KERAS_DIST_SECRET", SECRET)
    assert Config.from_env().rendezvous_secret == SECRET.encode()
    clean_env.delenv("KERAS_DIST_SECRET")
    (tmp_path / "secret").write_text(f"  {SECRET}\n")  # as `echo` or a mounted Secret leaves it
    clean_env.setenv("KERAS_DIST_SECRET_FILE", str(tmp_path / "secret"))
    assert Config.from_env().rendezvous_secret == SECRET.encode()


def test_the_secret_is_never_printed(clean_env):
    clean_env.setenv("KERAS_DIST_SECRET", SECRET)
    assert SECRET not in repr(Config.from_env())


@pytest.mark.parametrize("setting, message", [
    ({"KERAS_DIST_SECRET": "short"},
     "`KERAS_DIST_SECRET` must hold at least 16 bytes (for example the output of "),
    ({"KERAS_DIST_SECRET": SECRET, "KERAS_DIST_SECRET_FILE": "/x"},
     "Set one of `KERAS_DIST_SECRET` and `KERAS_DIST_SECRET_FILE`, not both. Received: both"),
    ({"KERAS_DIST_SECRET_FILE": "/nonexistent/secret"},
     "`KERAS_DIST_SECRET_FILE` must name a readable file. Received: "
     "KERAS_DIST_SECRET_FILE='/nonexistent/secret'"),
])
def test_a_bad_secret_setting_says_what_was_expected(clean_env, setting, message):
    for name, value in setting.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError) as raised:
        Config.from_env()
    assert message in str(raised.value)
    assert SECRET not in str(raised.value)


def test_an_empty_secret_file_is_refused(clean_env, tmp_path):
    (tmp_path / "secret").write_text("\n")
    clean_env.setenv("KERAS_DIST_SECRET_FILE", str(tmp_path / "secret"))
    with pytest.raises(ValueError, match="an empty file"):
        Config.from_env()


class _Bound(Exception):
    """Stands in for binding the port: the test stops there."""


@pytest.mark.parametrize("host, secret, interface, warned", [
    ("10.1.2.3", b"", "", True),            # open to the network, no secret: said once
    ("10.1.2.3", SECRET.encode(), "", False),
    ("127.0.0.1", b"", "127.0.0.1", False),  # loopback: bound to loopback only
    ("localhost", b"", "127.0.0.1", False),
])
def test_rank_0_says_when_its_port_is_open_without_a_secret(monkeypatch, host, secret,
                                                            interface, warned):
    bound = []

    def listen(where, port, backlog=None):
        bound.append(where)
        raise OSError("stop here")
    monkeypatch.setattr(rendezvous, "listen", listen)
    place = placement.from_arguments(f"{host}:29500", 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RendezvousError, match="rank 0 cannot listen on port 29500"):
            rendezvous.join(place, 1.0, secret)
    said = [str(w.message) for w in caught if "rendezvous port 29500" in str(w.message)]
    assert bound == [interface]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "open to anyone who can reach this machine" in said[0]
        assert "Set KERAS_DIST_SECRET (or KERAS_DIST_SECRET_FILE)" in said[0]
