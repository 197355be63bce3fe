"""HTTPS with vLLM's flags: --ssl-certfile (PEM; it may hold the key too), --ssl-keyfile,
--ssl-ca-certs and --ssl-cert-reqs (0: clients show no certificate, 1: optional, 2: required),
handed to uvicorn. The files are loaded once before the weights, so a missing file, a key that does
not match its certificate or a PEM that is not one is one line, not a traceback after minutes of
loading."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from ..errors import AtlasError

CERT_REQS = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)  # --ssl-cert-reqs 0, 1, 2


@dataclass(frozen=True)
class TlsFiles:
    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def check(self) -> None:
        """AtlasError (one line) unless the files make a server context uvicorn can use."""
        if self.certfile is None:
            for flag, value in (("--ssl-keyfile", self.keyfile), ("--ssl-ca-certs", self.ca_certs)):
                if value is not None:
                    raise AtlasError(f"{flag} needs --ssl-certfile (the server's certificate); give both")
            if self.cert_reqs:
                raise AtlasError("--ssl-cert-reqs needs --ssl-certfile (the server's certificate); give both")
            return
        if self.cert_reqs and self.ca_certs is None:
            raise AtlasError("--ssl-cert-reqs 1 or 2 checks client certificates against --ssl-ca-certs; give it")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # an encrypted key would have OpenSSL prompt for its passphrase on the terminal
            context.load_cert_chain(self.certfile, self.keyfile, password=encrypted_key)
        except OSError as err:  # ssl.SSLError is one
            named = f"--ssl-certfile {self.certfile}" + (f" with --ssl-keyfile {self.keyfile}" if self.keyfile else "")
            raise AtlasError(f"{named} cannot be used ({reason(err)}); give a PEM certificate and its private key") from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except OSError as err:  # ssl.SSLError is one
                raise AtlasError(f"--ssl-ca-certs {self.ca_certs} cannot be used ({reason(err)}); give PEM "
                                 "CA certificates") from None

    def uvicorn_options(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": CERT_REQS[self.cert_reqs]}


def encrypted_key() -> bytes:
    raise AtlasError("the private key is encrypted (it asks for a passphrase); give an unencrypted key "
                     "(`openssl pkey -in KEY -out PLAIN`), readable only by the server's user")


def reason(err: OSError) -> str:
    """The error's words without its errno or library prefix."""
    if isinstance(err, ssl.SSLError):
        return err.reason or str(err)
    return err.strerror or str(err)
