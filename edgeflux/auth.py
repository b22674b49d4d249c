"""Who may talk to the fleet's servers: one password, shared by the cloud host and its devices.

The Prefect server (its API auth string) and the MLflow tracking server (its basic-auth app) check it
whenever it is set, and a server of edgeflux's refuses to listen on an address other than loopback
without it (`edgeflux.service.Service.check_startable`): anyone who can write a deployment runs code on
every device that polls it. The user is always ``edgeflux``; the password comes from

    EDGEFLUX_PASSWORD            the environment (a CI secret, a systemd credential), else
    EDGEFLUX_AUTH_FILE           a file holding it on one line (default ~/.config/edgeflux/auth),
                                 mode 0600 and refused otherwise

never from params.yaml or git. `edgeflux servers --init-auth` writes a new file with a random password;
copy it to each device (`scp -p`). Clients get it as the tools' own variables (``client_env``), so
Prefect's and MLflow's clients, the workers and every flow and stage they start authenticate unchanged.
Torch-free and light: the CLI, a worker and the servers import it.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from pathlib import Path

from edgeflux.errors import UserError

USER = "edgeflux"
PASSWORD_ENV = "EDGEFLUX_PASSWORD"
FILE_ENV = "EDGEFLUX_AUTH_FILE"
HOW = (f"`edgeflux servers --init-auth` writes one (a random password, mode 0600; copy it to each device), "
       f"or set {PASSWORD_ENV}")
MIN_LENGTH = 12   # MLflow refuses shorter admin passwords


class AuthError(UserError):
    """Credentials that are missing where they are required, unreadable, or not private."""


def auth_file() -> Path:
    return Path(os.environ.get(FILE_ENV) or Path.home() / ".config" / "edgeflux" / "auth").expanduser()


def load_password() -> str | None:
    """The password (see the module docstring); None when none is set. AuthError for a file others can read,
    or a password MLflow would refuse."""
    password, where = os.environ.get(PASSWORD_ENV), f"${PASSWORD_ENV}"
    if not password:
        path = auth_file()
        if not path.is_file():
            return None
        password, where = _read_private(path), str(path)
    if len(password) < MIN_LENGTH or any(c.isspace() for c in password):
        raise AuthError(f"the password in {where} must be at least {MIN_LENGTH} characters without spaces: "
                        f"{HOW}")
    return password


def _read_private(path: Path) -> str:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise AuthError(f"{path} holds the servers' password but is readable by others (mode {mode:o}): "
                        f"chmod 600 {path}")
    return path.read_text().strip()


def init_auth_file() -> Path:
    """A new credentials file with a random password, created private (0600) from the start; an existing
    one is kept (devices already hold it)."""
    path = auth_file()
    if path.exists():
        _read_private(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(24) + "\n")
    return path


def client_env(password: str | None) -> dict[str, str]:
    """The variables Prefect's and MLflow's own clients authenticate with (none without a password)."""
    if not password:
        return {}
    return {"PREFECT_API_AUTH_STRING": f"{USER}:{password}", "MLFLOW_TRACKING_USERNAME": USER,
            "MLFLOW_TRACKING_PASSWORD": password}


def export_credentials() -> None:
    """Give this process's Prefect and MLflow clients the credentials, where the environment has none."""
    for key, value in client_env(load_password()).items():
        os.environ.setdefault(key, value)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False   # a name: it may resolve to anything
