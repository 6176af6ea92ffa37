"""Who a run is, and whom it trusts, when it writes to a team's MLflow server.

Credentials reach MLflow's client only through its own variables (``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``, or ``MLFLOW_TRACKING_TOKEN``) or through a file that only its owner can
read: ``tracking.credentials_file``, or MLflow's own ``~/.mlflow/credentials``, which its client reads
by itself. Both files have MLflow's layout::

    [mlflow]
    mlflow_tracking_username = bench-node07
    mlflow_tracking_password = ...

A file that others can read is refused, naming it and the ``chmod`` that fixes it; no secret is ever
read from the configuration, nor written into it.

The server's certificate is checked against the system's CAs, or against a private CA:
``tracking.server_cert`` (a PEM file), else ``$MLFLOW_TRACKING_SERVER_CERT_PATH``. Checking is never
turned off by cobench; MLflow's ``MLFLOW_TRACKING_INSECURE_TLS`` still does, and cobench says so.
"""

from __future__ import annotations

import configparser
import logging
import os
import ssl
from pathlib import Path

from harness.config import TrackingConfig

logger = logging.getLogger(__name__)

MLFLOW_CREDENTIALS_FILE = "~/.mlflow/credentials"  # read by MLflow's client itself when present
FILE_KEYS = ("mlflow_tracking_username", "mlflow_tracking_password", "mlflow_tracking_token")
CERT_VARIABLE, INSECURE_VARIABLE = "MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_INSECURE_TLS"


class CredentialsError(ValueError):
    """Credentials or certificates that cannot be used as given; the message says what to do."""


def check_owner_only(path: Path, what: str) -> None:
    """Refuse a file holding a secret that its group or anyone else may read (or write)."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise CredentialsError(f"{what} {path} may be read by others (mode {mode:o}): it holds a password. "
                               f"Make it yours alone: `chmod 600 {path}`")


def read_credentials_file(path: Path) -> dict[str, str]:
    """MLflow's variables, from a credentials file in MLflow's layout (section ``[mlflow]``)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except configparser.Error as err:
        raise CredentialsError(f"tracking.credentials_file {path} is not an INI file ({type(err).__name__}); "
                               f"write it as [mlflow] with {' / '.join(FILE_KEYS)}") from None
    section = parser["mlflow"] if parser.has_section("mlflow") else {}
    found = {key.upper(): section[key] for key in FILE_KEYS if section.get(key)}
    has_password = "MLFLOW_TRACKING_USERNAME" in found and "MLFLOW_TRACKING_PASSWORD" in found
    if not (has_password or "MLFLOW_TRACKING_TOKEN" in found):
        raise CredentialsError(f"tracking.credentials_file {path} holds no credentials: it needs a section [mlflow] "
                               "with mlflow_tracking_username and mlflow_tracking_password (or mlflow_tracking_token)")
    return found


def apply_tracking_credentials(cfg: TrackingConfig, uri: str) -> None:
    """Give MLflow's client what ``cfg`` names for the server ``uri``: the credentials file's values and the
    private CA, as MLflow's variables of this process (a ``tracking.*`` key wins over the environment).
    A store that is no server (sqlite, PostgreSQL) needs none of it."""
    if not uri.startswith(("http://", "https://")):
        return
    if cfg.credentials_file:
        path = Path(cfg.credentials_file).expanduser().absolute()
        if not path.is_file():
            raise CredentialsError(f"tracking.credentials_file {path} does not exist: create it (mode 600) with a "
                                   "section [mlflow] holding mlflow_tracking_username and mlflow_tracking_password")
        check_owner_only(path, "tracking.credentials_file")
        values = read_credentials_file(path)
        if "MLFLOW_TRACKING_TOKEN" not in values:
            os.environ.pop("MLFLOW_TRACKING_TOKEN", None)  # this file says who this is; nothing else speaks
        os.environ.update(values)
    else:
        mlflow_file = Path(MLFLOW_CREDENTIALS_FILE).expanduser()
        if mlflow_file.is_file():  # MLflow's client reads it by itself, so it must be as private
            check_owner_only(mlflow_file, "MLflow's credentials file")
    if cfg.server_cert:
        os.environ[CERT_VARIABLE] = str(Path(cfg.server_cert).expanduser().absolute())
    cert = os.environ.get(CERT_VARIABLE)
    if cert and not Path(cert).is_file():
        where = "tracking.server_cert" if cfg.server_cert else CERT_VARIABLE
        raise CredentialsError(f"{where} {cert} does not exist: give the PEM file of the CA that signed the "
                               "server's certificate")
    if uri.startswith("https://") and tls_unverified():
        logger.warning("%s is set: the certificate of %s is NOT checked, so anyone in between can read the "
                       "password and the results. Give its CA with tracking.server_cert=PATH instead.",
                       INSECURE_VARIABLE, uri)


def tls_unverified() -> bool:
    """Whether MLflow's client was told to skip certificate checks (its own variable)."""
    return os.environ.get(INSECURE_VARIABLE, "").strip().lower() in ("true", "1")


def tls_context() -> ssl.SSLContext:
    """The TLS checks MLflow's client makes, for cobench's own requests (the reachability check)."""
    context = ssl.create_default_context(cafile=os.environ.get(CERT_VARIABLE) or None)
    if tls_unverified():  # the user's explicit choice, warned about when the store is opened
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def untrusted_certificate_advice(uri: str, err: ssl.SSLCertVerificationError) -> str:
    """What to tell the user when the server's certificate did not verify."""
    given = os.environ.get(CERT_VARIABLE)
    trusted = f"the CA in {given}" if given else "this machine's CAs"
    return (f"the TLS certificate of {uri} is not trusted by {trusted} ({err.verify_message}). If the server "
            "uses a private CA, give that CA's PEM file with tracking.server_cert=PATH (or "
            f"{CERT_VARIABLE}); if the name does not match, reach the server by the name in its certificate")
