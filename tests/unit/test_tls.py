"""TLS (--ssl-certfile / --ssl-keyfile on serve and on superfluid fleet, --ssl-cafile on fleet):
the startup errors (one file without the other, missing, unreadable, not PEM, a key of another
pair, an encrypted key) and a real HTTPS exchange with the context the servers listen with. The
real `superfluid serve` over HTTPS is tests/server/test_cors_tls.py."""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl

import aiohttp
import pytest
from aiohttp import web

from superfluid.core.cli import load
from superfluid.core.errors import ConfigError
from superfluid.core.tls import client_context, server_context
from superfluid.plugins.fleet import config as fleet_config
from tests.tls_certs import _with_cryptography, _with_openssl, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_a_matching_pair_serves(certs):
    ctx = server_context(str(certs.cert), str(certs.key))
    assert isinstance(ctx, ssl.SSLContext) and ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert server_context(None, None) is None
    assert client_context(None) is None
    assert isinstance(client_context(str(certs.ca)), ssl.SSLContext)


def test_an_unreadable_key_file_is_named(certs, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("runs as root, and root reads a mode-000 file anyway: needs a user without root")
    locked = tmp_path / "locked.pem"
    locked.write_bytes(certs.key.read_bytes())
    locked.chmod(0)
    with pytest.raises(ConfigError, match="cannot read it"):
        server_context(str(certs.cert), str(locked))


def test_errors_name_the_flag_and_the_file(certs, tmp_path):
    cert, key = str(certs.cert), str(certs.key)
    with pytest.raises(ConfigError, match="--ssl-certfile needs --ssl-keyfile"):
        server_context(cert, None)
    with pytest.raises(ConfigError, match="--ssl-keyfile needs --ssl-certfile"):
        server_context(None, key)
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=f"--ssl-certfile {missing}: cannot read it"):
        server_context(missing, key)
    with pytest.raises(ConfigError, match=f"--ssl-keyfile {missing}: cannot read it"):
        server_context(cert, missing)
    with pytest.raises(ConfigError, match="is a directory"):
        server_context(str(tmp_path), key)
    with pytest.raises(ConfigError, match=f"--ssl-certfile {key}: not a PEM certificate"):
        server_context(key, key)  # the files swapped
    with pytest.raises(ConfigError, match=f"--ssl-keyfile {cert}: not a PEM private key"):
        server_context(cert, cert)
    with pytest.raises(ConfigError, match="does not match the certificate"):
        server_context(cert, str(certs.other_key))
    with pytest.raises(ConfigError, match=f"--ssl-cafile {key}: not a PEM certificate"):
        client_context(key)
    with pytest.raises(ConfigError, match="--ssl-cafile .*cannot read it"):
        client_context(missing)


def test_an_encrypted_key_is_refused_without_a_prompt(certs, tmp_path):
    from cryptography.hazmat.primitives import serialization
    key = serialization.load_pem_private_key(certs.key.read_bytes(), None)
    locked = tmp_path / "encrypted.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ConfigError, match="encrypted"):
        server_context(str(certs.cert), str(locked))


def test_serve_and_fleet_check_before_starting(certs, tmp_path):
    with pytest.raises(ConfigError, match="--ssl-certfile needs --ssl-keyfile"):
        load(["serve", "--ssl-certfile", str(certs.cert)])
    with pytest.raises(ConfigError, match="does not match"):
        load(["serve", "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.other_key)])
    load(["serve", "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)])

    def fleet(*argv):
        parser = argparse.ArgumentParser()
        fleet_config.add_arguments(parser)
        return fleet_config.from_args(parser.parse_args(["--node", "https://127.0.0.1:9001", *argv]))

    c = fleet("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key), "--ssl-cafile", str(certs.ca))
    assert (c.ssl_certfile, c.ssl_keyfile, c.ssl_cafile) == (str(certs.cert), str(certs.key), str(certs.ca))
    with pytest.raises(ConfigError, match="flags: --ssl-keyfile needs --ssl-certfile"):
        fleet("--ssl-keyfile", str(certs.key))
    with pytest.raises(ConfigError, match="--ssl-cafile"):
        fleet("--ssl-cafile", str(tmp_path / "none.pem"))
    toml = tmp_path / "fleet.toml"
    toml.write_text(f'[fleet]\nnodes = ["https://127.0.0.1:9001"]\nssl-certfile = "{certs.cert}"\n')
    with pytest.raises(ConfigError, match=f"{toml}: --ssl-certfile needs --ssl-keyfile"):
        fleet("--config", str(toml))


def _exchange(certs) -> tuple[int, str]:
    """One HTTPS request to an aiohttp site listening with server_context, verified with the CA;
    then plain HTTP to the same port, which must fail."""

    async def go():
        async def hello(request):
            return web.Response(text="over tls")

        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context(str(certs.cert), str(certs.key)))
        await site.start()
        port = runner.addresses[0][1]
        try:
            connector = aiohttp.TCPConnector(ssl=client_context(str(certs.ca)))
            async with aiohttp.ClientSession(connector=connector) as http:
                async with http.get(f"https://localhost:{port}/") as r:
                    out = r.status, await r.text()
                with pytest.raises(aiohttp.ClientError):  # the system's CAs do not know the test CA
                    async with aiohttp.ClientSession() as untrusting:
                        await untrusting.get(f"https://127.0.0.1:{port}/")
                with pytest.raises((aiohttp.ClientError, asyncio.TimeoutError)):
                    async with http.get(f"http://127.0.0.1:{port}/", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        await r.read()
            return out
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_https_with_certificates_from_either_generator(tmp_path):
    assert _exchange(_with_cryptography(tmp_path / "c")) == (200, "over tls")
    assert _exchange(_with_openssl(tmp_path / "o")) == (200, "over tls")
