"""Test certificates: a throwaway CA and a server certificate it signed for localhost, 127.0.0.1
and ::1 (proper extensions, so strict verifiers such as Python's and rustls' accept the chain).
Made with the ``cryptography`` package when it is installed, else with the ``openssl`` command."""

from __future__ import annotations

import datetime
import shutil
import subprocess
from pathlib import Path

import attrs


@attrs.define(frozen=True)
class Certs:
    ca: Path        # the CA's certificate (what a client trusts)
    cert: Path      # the server's certificate
    key: Path       # its private key (unencrypted PEM)
    other_key: Path  # a key of another pair (does not match ``cert``)


def make_certs(where: Path) -> Certs:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return _with_openssl(where)
    return _with_cryptography(where)


def _with_cryptography(where: Path) -> Certs:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    where.mkdir(parents=True, exist_ok=True)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key, other = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superfluid test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = Certs(where / "ca.pem", where / "cert.pem", where / "key.pem", where / "other-key.pem")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(pem_key(key))
    out.other_key.write_bytes(pem_key(other))
    return out


def _with_openssl(where: Path) -> Certs:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("neither the cryptography package nor the openssl command is installed")
    where.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=where)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=superfluid test CA", "-keyout", "ca-key.pem", "-out", "ca.pem",
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=localhost",
        "-keyout", "key.pem", "-out", "cert.csr")
    (where / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n"
                                   "basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n"
                                   "authorityKeyIdentifier=keyid\n")
    run("x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
        "-days", "2", "-extfile", "ext.cnf", "-out", "cert.pem")
    run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "other-key.pem")
    return Certs(where / "ca.pem", where / "cert.pem", where / "key.pem", where / "other-key.pem")
