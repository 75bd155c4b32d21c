"""TLS for the servers superfluid runs (``serve``, ``superfluid fleet``: ``--ssl-certfile`` and
``--ssl-keyfile``) and for the fleet head's own calls to HTTPS nodes (``--ssl-cafile``).

Every problem is a :class:`~.errors.ConfigError` raised at startup, before a model loads or a
port opens, naming the flag and the file: one of the pair without the other, a file that is
missing or unreadable, a certificate or key that is not PEM, a key that does not match the
certificate, an encrypted key (there is no way to type its passphrase into a daemon)."""

from __future__ import annotations

import ssl

from .errors import ConfigError


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except IsADirectoryError:
        raise ConfigError(f"{flag} {path}: is a directory, not a PEM file") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def check_pair(certfile: str | None, keyfile: str | None) -> bool:
    """Whether TLS is asked for; raises if only one of the two files is given."""
    if bool(certfile) != bool(keyfile):
        given, missing = (("--ssl-certfile", "--ssl-keyfile") if certfile else ("--ssl-keyfile", "--ssl-certfile"))
        raise ConfigError(f"{given} needs {missing} too: give both (the certificate and its private key) "
                          f"or neither")
    return bool(certfile)


def server_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The context a listening socket serves HTTPS with (None: plain HTTP, neither file given)."""
    if not check_pair(certfile, keyfile):
        return None
    _readable("--ssl-certfile", certfile)
    _readable("--ssl-keyfile", keyfile)
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:  # the certificate alone first, so an error can say which file is wrong
        probe.load_verify_locations(cafile=certfile)
    except ssl.SSLError as exc:
        raise ConfigError(f"--ssl-certfile {certfile}: not a PEM certificate ({exc.reason or exc})") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    asked = []

    def password() -> bytes:  # an encrypted key would otherwise prompt on the terminal
        asked.append(True)
        return b""

    try:
        ctx.load_cert_chain(certfile, keyfile, password=password)
    except ssl.SSLError as exc:
        text = f"{exc.reason or ''} {exc}"
        if "KEY_VALUES_MISMATCH" in text:
            raise ConfigError(f"--ssl-keyfile {keyfile} does not match the certificate in --ssl-certfile "
                              f"{certfile} (a key from another pair?)") from None
        if asked:
            raise ConfigError(f"--ssl-keyfile {keyfile}: the key is encrypted; give it unencrypted (mode 0600), "
                              f"e.g. `openssl pkey -in {keyfile} -out key.pem`") from None
        raise ConfigError(f"--ssl-keyfile {keyfile}: not a PEM private key for {certfile} "
                          f"({exc.reason or exc})") from None
    return ctx


def client_context(cafile: str | None) -> ssl.SSLContext | None:
    """The context the fleet head verifies HTTPS nodes with: the system's CAs, and with
    ``--ssl-cafile`` that file's too (None: no file, aiohttp's default verification)."""
    if not cafile:
        return None
    _readable("--ssl-cafile", cafile)
    try:
        return ssl.create_default_context(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(f"--ssl-cafile {cafile}: not a PEM certificate ({exc.reason or exc})") from None
