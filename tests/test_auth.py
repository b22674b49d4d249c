"""edgeflux.auth: where the servers' password comes from, and what is refused."""
import os
import stat

import pytest

from edgeflux import auth


@pytest.fixture
def auth_file(tmp_path, monkeypatch):
    path = tmp_path / "config" / "auth"
    monkeypatch.setenv(auth.FILE_ENV, str(path))
    return path


def test_no_password_anywhere_is_none_and_gives_clients_nothing(auth_file):
    assert auth.load_password() is None and auth.client_env(None) == {}


def test_init_writes_a_private_random_password_once_and_keeps_it(auth_file):
    path = auth.init_auth_file()
    assert path == auth_file and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    password = auth.load_password()
    assert len(password) >= auth.MIN_LENGTH
    assert auth.init_auth_file() == path and auth.load_password() == password   # devices already hold it
    assert auth.client_env(password) == {"PREFECT_API_AUTH_STRING": f"edgeflux:{password}",
                                         "MLFLOW_TRACKING_USERNAME": "edgeflux", "MLFLOW_TRACKING_PASSWORD": password}


def test_the_environment_wins_over_the_file(auth_file, monkeypatch):
    auth.init_auth_file()
    monkeypatch.setenv(auth.PASSWORD_ENV, "from-the-environment")
    assert auth.load_password() == "from-the-environment"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_file_others_can_read_is_refused_with_the_chmod(auth_file, mode):
    auth_file.parent.mkdir()
    auth_file.write_text("a-long-enough-password\n")
    auth_file.chmod(mode)
    with pytest.raises(auth.AuthError, match=f"readable by others .*: chmod 600 {auth_file}$"):
        auth.load_password()
    with pytest.raises(auth.AuthError):
        auth.init_auth_file()   # kept, but not silently: it would be handed to the servers


@pytest.mark.parametrize("password", ["short", "has a space in it", ""])
def test_a_weak_password_is_refused_naming_how_to_make_one(auth_file, monkeypatch, password):
    auth_file.parent.mkdir()
    auth_file.write_text(password + "\n")
    auth_file.chmod(0o600)
    with pytest.raises(auth.AuthError, match="at least 12 characters.*--init-auth"):
        auth.load_password()


def test_export_fills_only_what_the_environment_lacks(auth_file, monkeypatch):
    monkeypatch.setenv(auth.PASSWORD_ENV, "p" * 16)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "someone-else")
    for key in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(key, raising=False)
    auth.export_credentials()
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "someone-else"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "p" * 16
    assert os.environ["PREFECT_API_AUTH_STRING"] == "edgeflux:" + "p" * 16


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                           ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                           ("::", False), ("192.168.1.5", False), ("cloud.lan", False)])
def test_what_counts_as_loopback(host, loopback):
    assert auth.is_loopback(host) is loopback
