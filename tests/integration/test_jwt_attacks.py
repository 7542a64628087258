"""The JWT attack suite against a live gateway, over HTTP (both ingress engines) and gRPC.

Every token is minted by `tests.auth.mint` (hand-built JWS on `cryptography`), never by the code
under test. Each case names the HTTP status it must get; the gRPC code follows from it. Refusals
must be generic: the JSON error's type, `WWW-Authenticate`, never the token in the body or log.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from tests.auth import mint
from tests.auth.jwks_server import JwksServer
from tests.auth.live import ALT_ISSUER, GRPC_OF_HTTP, LiveGateway, policy, start
from tests.auth.mint import DROP, b64, b64json, claims, jws, raw
from tests.integration.conftest import Backend
from tests.support import free_port, wait_until

pytestmark = pytest.mark.integration

CORP_RSA = mint.rsa_key("corp-rsa", "RS256")
CORP_EC = mint.ec_key("corp-ec", "ES256")
ALT_PS = mint.rsa_key("alt-ps", "PS256")
ALT_NOALG = mint.rsa_key("alt-noalg", "PS256")  # published without `alg`
ALT_ES384 = mint.ec_key("alt-es384", "ES384")
EVIL = mint.rsa_key("evil", "RS256")  # the attacker's own key
JWKS_PORT = free_port()  # known before the cases are built: `jku` names a path on it
ATTACKER = f"http://127.0.0.1:{JWKS_PORT}/attacker"
P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


@dataclass(frozen=True)
class Case:
    name: str
    given: tuple[str, ...] | Callable[[], str]  # header values, or a token minted when sent
    status: int
    reason: str  # the refusal's reason class ("" when accepted)
    route: str = "v1"

    @property
    def values(self) -> tuple[str, ...]:
        """Authorization header values, in order (none: no header)."""
        if callable(self.given):
            return (f"Bearer {self.given()}",)
        return self.given


def _cases() -> list[Case]:
    now = int(time.time())
    out: list[Case] = []

    def add(
        name: str, token: str | list[str] | Callable[[], str], expect: str, route: str = "v1"
    ) -> None:
        """`expect`: the HTTP status, then the reason class the access log must give. A
        callable token is minted when the request is sent (times near the leeway)."""
        given = (
            token
            if callable(token)
            else tuple(token)
            if isinstance(token, list)
            else (f"Bearer {token}",)
        )
        status, _, reason = expect.partition(" ")
        out.append(Case(name, given, int(status), reason, route))

    def corp(**over: Any) -> str:
        return jws(claims(**over), CORP_RSA)

    def internal(**over: Any) -> str:
        return jws(claims(iss=mint.HS_ISSUER, **over), mint.HS_SECRET)

    def signed(header: dict[str, Any], payload: bytes | dict[str, Any], key: Any) -> str:
        return jws(payload, key, header=header, alg=header.get("alg", "RS256"))

    ok_h = b64json({"alg": "ES256", "kid": "corp-ec"})
    ok_p = b64json(claims())
    good_es = jws(claims(), CORP_EC).split(".")[2]

    # Controls: each provider, each algorithm family, accepted.
    add("valid RS256", corp(), "200")
    add("valid ES256", jws(claims(), CORP_EC), "200")
    add("valid HS256", internal(), "200")
    add("valid PS256 (alt)", jws(claims(iss=ALT_ISSUER), ALT_PS), "200")
    add("valid ES384 (alt)", jws(claims(iss=ALT_ISSUER), ALT_ES384), "200")
    add("alt key without alg, bound to PS256", jws(claims(iss=ALT_ISSUER), ALT_NOALG), "200")
    add("lower-case scheme", [f"bearer {corp()}"], "200")
    # 1. alg none, any case
    for alg in ("none", "None", "NONE", "nOnE"):
        for iss in (mint.ISSUER, mint.HS_ISSUER):
            hdr = b64json({"alg": alg, "kid": "corp-rsa"})
            add(
                f"alg {alg} ({iss}) empty sig",
                raw(hdr, b64json(claims(iss=iss)), ""),
                "401 malformed",
            )
            add(
                f"alg {alg} ({iss}) some sig",
                raw(hdr, b64json(claims(iss=iss)), b64(b"x")),
                "401 bad_header",
            )
    # 2. HS256 with the issuer's public key as the secret
    for label, secret in (
        ("PEM", CORP_RSA.public_pem()),
        ("EC PEM", CORP_EC.public_pem()),
        ("JWK JSON", json.dumps(CORP_RSA.jwk()).encode()),
    ):
        hdr = {"alg": "HS256", "kid": "corp-rsa"}
        add(f"HS256 keyed with corp {label}", signed(hdr, claims(), secret), "401 bad_header")
        add(
            f"HS256 keyed with corp {label}, iss internal",
            internal_with(secret),
            "401 bad_signature",
        )
    # 3. family / size swaps; keys bound to one algorithm
    add(
        "RS256 header, PS256 signature",
        jws(claims(), CORP_RSA, "RS256", sign_as="PS256"),
        "401 bad_signature",
    )
    add("PS256 with corp's RS256 key", jws(claims(), CORP_RSA, "PS256"), "401 bad_header")
    add("ES384 header, corp's P-256 key", jws(claims(), CORP_EC, "ES384"), "401 bad_header")
    add("alt PS256 key as RS256", jws(claims(iss=ALT_ISSUER), ALT_PS, "RS256"), "401 bad_header")
    add(
        "alt no-alg key as RS256", jws(claims(iss=ALT_ISSUER), ALT_NOALG, "RS256"), "401 bad_header"
    )
    add("alt P-384 key as ES256", jws(claims(iss=ALT_ISSUER), ALT_ES384, "ES256"), "401 bad_header")
    add(
        "RS256 header, EC key kid",
        signed({"alg": "RS256", "kid": "corp-ec"}, claims(), EVIL),
        "401 bad_header",
    )
    add(
        "corp kid, attacker's key",
        signed({"alg": "RS256", "kid": "corp-rsa"}, claims(), EVIL),
        "401 bad_signature",
    )
    # 4-5. ES256 psychic signatures and wrong shapes
    for label, sig in (
        ("r = s = 0", bytes(64)),
        ("DER r = s = 0", bytes.fromhex("3006020100020100")),
        ("r = s = n", P256_N.to_bytes(32, "big") * 2),
        ("63 bytes", mint.b64_decode(good_es)[:63]),
        ("65 bytes", mint.b64_decode(good_es) + b"\x00"),
        ("DER of a good signature", mint.der(mint.b64_decode(good_es))),
        ("6 KB", b"\x01" * 6000),
    ):
        add(f"ES256 signature {label}", raw(ok_h, ok_p, b64(sig)), "401 bad_signature")
    # 6. kid values are opaque map keys
    for kid in ("../../../../dev/null", "' OR 1=1--", "a\x00b", "k" * 10240, "/etc/passwd"):
        why = "401 bad_header" if len(kid) > 256 else "401 unknown_kid"  # long: not looked up
        add(f"kid {kid[:24]!r}", signed({"alg": "RS256", "kid": kid}, claims(), EVIL), why)
    add(
        "kid not a string", signed({"alg": "RS256", "kid": 7}, claims(), CORP_RSA), "401 bad_header"
    )
    # 7. jku / x5u / jwk / x5c: never fetched, never used (the URL counts hits)
    attacker = ATTACKER
    for member, value in (
        ("jku", attacker),
        ("x5u", attacker + "/cert.pem"),
        ("jku", "http://169.254.169.254/latest/meta-data/"),
        ("jku", "file:///etc/passwd"),
        ("jwk", EVIL.jwk()),
        ("x5c", ["MIIBszCCAVmgAwIBAgIU"]),
    ):
        hdr = {"alg": "RS256", "kid": "evil", member: value}
        add(f"{member} {str(value)[:30]}", signed(hdr, claims(), EVIL), "401 unknown_kid")
    hdr = {"alg": "RS256", "kid": "corp-rsa", "jwk": EVIL.jwk()}
    add("embedded jwk with corp's kid", signed(hdr, claims(), EVIL), "401 bad_signature")
    hdr = {"alg": "RS256", "kid": "corp-rsa", "jku": attacker}
    add("jku on a genuine token is ignored", signed(hdr, claims(), CORP_RSA), "200")
    # 8-9. crit
    for crit in (["x-policy"], [], ["alg"], ["b64"], "b64"):
        hdr = {"alg": "RS256", "kid": "corp-rsa", "crit": crit, "x-policy": 1}
        add(f"crit {crit!r}", signed(hdr, claims(), CORP_RSA), "401 bad_header")
    hdr = {"alg": "RS256", "kid": "corp-rsa", "b64": False, "crit": ["b64"]}
    add("b64 false", signed(hdr, claims(), CORP_RSA), "401 bad_header")

    # 10-11. exp / nbf / iat around the 60 s leeway
    def at(**offsets: int) -> Callable[[], str]:  # claims relative to the time of sending
        return lambda: corp(**{k: int(time.time()) + v for k, v in offsets.items()})

    add("exp 50 s ago (inside)", at(exp=-50), "200")
    add("exp 70 s ago (outside)", at(exp=-70), "401 expired")
    add("nbf 50 s ahead (inside)", at(nbf=50), "200")
    add("nbf 70 s ahead (outside)", at(nbf=70), "401 not_yet_valid")
    add("iat 10 s ahead", at(iat=10), "200")
    add("iat 70 s ahead", at(iat=70), "401 issued_in_future")
    add("no exp", corp(exp=DROP), "401 missing_exp")
    # 12. NumericDate must be a number
    for v in (str(now + 600), True, -1, 2**64, None, [now + 600], {"t": 1}):
        add(f"exp {v!r}", corp(exp=v), "401 expired" if v == -1 else "401 bad_claim")
    add("exp 1e309", jws(_with_raw(claims(), "exp", "1e309"), CORP_RSA), "401 bad_claim")
    # Minted when sent: a token minted at collection would expire in a suite over 10 min long.
    add("exp float", lambda: corp(exp=int(time.time()) + 600.5), "200")
    # 13. issuer matched exactly
    for iss in (
        "https://login.example.com/.evil",
        "https://login.example.com",
        "https://login.example.com/x",
        "HTTPS://LOGIN.EXAMPLE.COM/",
        "https://login.example.com/ ",
        ["https://login.example.com/"],
        None,
    ):
        add(f"iss {iss!r}", corp(iss=iss if iss is not None else DROP), "401 unknown_issuer")
    # 14. audience
    for aud in (DROP, "other", [], ["other"], [1], "", "sluicex"):
        add(f"aud {aud if aud is not DROP else 'missing'!r}", corp(aud=aud), "401 audience")
    add("aud list with ours", corp(aud=["other", "sluice"]), "200")
    # 17-18. malformed compact forms
    t = corp()
    h, p, s = t.split(".")
    add("padded header", f"{h}=.{p}.{s}", "401 malformed")
    add("padded signature", f"{h}.{p}.{s}==", "401 malformed")
    add("2 segments", f"{h}.{p}", "401 malformed")
    add("4 segments", f"{t}.{s}", "401 malformed")
    add("empty segments", "..", "401 malformed")
    add("empty header", f".{p}.{s}", "401 malformed")
    add("+ and /", f"{h}.{p}.{s[:-2]}+/", "401 malformed")
    add("whitespace inside", f"{h}. {p}.{s}", "401 malformed")
    add("not base64", "!!!.???.***", "401 malformed")
    add("non-UTF-8 header", raw(b64(b'{"alg":"RS256","kid":"\xff"}'), p, s), "401 malformed")
    add("BOM header", raw(b64(b'\xef\xbb\xbf{"alg":"RS256"}'), p, s), "401 malformed")
    add("header a JSON array", raw(b64json(["RS256"]), p, s), "401 malformed")
    add("payload a JSON string", jws(b'"hello"', CORP_RSA), "401 malformed")
    deep = b'{"iss":"' + mint.ISSUER.encode() + b'","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    add("deep JSON payload", jws(deep, CORP_RSA), "401 malformed")
    add("duplicate sub", jws(_dup(claims(), "sub", "admin"), CORP_RSA), "401 malformed")
    dup_alg = b'{"alg":"none","alg":"RS256","kid":"corp-rsa"}'
    add("duplicate alg", raw(b64(dup_alg), p, mint.resign(dup_alg, p, CORP_RSA)), "401 malformed")
    # 19-21. header shapes
    add("missing", [], "401 missing")
    add("empty bearer", ["Bearer "], "401 malformed")
    add("Basic scheme", ["Basic dXNlcjpwYXNz"], "401 malformed")
    add("no scheme", [t], "401 malformed")
    add(
        "two Authorization headers", [f"Bearer {t}", f"Bearer {corp(sub='admin')}"], "400 ambiguous"
    )
    add("two tokens in one header", [f"Bearer {t}, Bearer {t}"], "400 ambiguous")
    add("token over max_token_bytes", ["Bearer " + "a" * 40000], "431 too_large")
    # 15. routes: optional, claims, provider restriction, off
    add("optional, no token", [], "200", "optional")
    add("optional, expired token", corp(exp=now - 1000), "401 expired", "optional")
    add(
        "optional, other issuer's token",
        jws(claims(iss="https://x/"), EVIL),
        "401 unknown_issuer",
        "optional",
    )
    add("optional, valid", corp(), "200", "optional")
    add("optional, Basic", ["Basic dXNlcjpwYXNz"], "200", "optional")
    add("claims: tier gold", corp(tier="gold"), "200", "gold")
    add("claims: tier silver in a list", corp(tier=["x", "silver"]), "200", "gold")
    add("claims: tier bronze", corp(tier="bronze"), "403 claims", "gold")
    add("claims: no tier", corp(tier=DROP), "403 claims", "gold")
    add("claims: no token", [], "401 missing", "gold")
    add("providers: corp token on internal route", corp(), "401 provider_not_allowed", "internal")
    add("providers: internal token", internal(), "200", "internal")
    add("off: no token", [], "200", "open")
    add("off: garbage token", ["Bearer garbage"], "200", "open")
    return out


def internal_with(secret: bytes) -> str:
    return jws(claims(iss=mint.HS_ISSUER), secret, "HS256")


def _with_raw(doc: dict[str, Any], key: str, literal: str) -> bytes:
    text = json.dumps({**doc, key: "__RAW__"}, separators=(",", ":"))
    return text.replace('"__RAW__"', literal).encode()


def _dup(doc: dict[str, Any], key: str, value: str) -> bytes:
    text = json.dumps(doc, separators=(",", ":"))
    return (text[:-1] + f',"{key}":"{value}"}}').encode()


CASES = _cases()


@pytest.fixture(scope="module")
def jwks_server() -> Iterator[JwksServer]:
    s = JwksServer(JWKS_PORT)
    s.serve(mint.jwks(CORP_RSA, CORP_EC))
    try:
        yield s
    finally:
        s.close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records the header values of each request (a test backend; the simulated one keeps
    header names only, by design)."""

    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        _Recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
        body = b'{"object":"list","data":[]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def recorder() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def gateways(
    backend: Backend,
    jwks_server: JwksServer,
    recorder: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, LiveGateway]]:
    alt = tmp_path_factory.mktemp("alt") / "alt-jwks.json"
    doc = {"keys": [ALT_PS.jwk(), ALT_NOALG.jwk(with_alg=False), ALT_ES384.jwk()]}
    alt.write_text(json.dumps(doc))
    out: dict[str, LiveGateway] = {}
    try:
        for engine in ("aiohttp", "native"):
            tmp = tmp_path_factory.mktemp(f"gw-{engine}")
            out[engine] = start(
                tmp,
                lambda ports, e=engine: policy(
                    backend, ports, jwks_server.url, alt, e, recorder=recorder
                ),
            )
        yield out
    finally:
        logs = [gw.stop() for gw in out.values()]
        for log in logs:  # no token, signature or secret ever reaches the log
            for case in CASES:
                for v in case.values:
                    token = v.partition(" ")[2]
                    if token.count(".") == 2 and len(token.split(".")[2]) > 16:
                        assert token.split(".")[2] not in log, case.name
            assert mint.HS_SECRET.decode() not in log
            assert "Traceback" not in log, log[-3000:]


def _check_refusal(
    case: Case, values: tuple[str, ...], status: int, headers: dict[str, str], body: bytes
) -> None:
    assert status == case.status, (case.name, status, body[:300])
    if status == 200:
        return
    err = json.loads(body)["error"]
    assert set(err) == {"type", "message"}, err
    for v in values:  # the token is never echoed
        token = v.partition(" ")[2]
        if len(token) > 8:
            assert token[-8:].encode() not in body, case.name
    if status == 401:
        assert headers.get("www-authenticate") == 'Bearer error="invalid_token"', headers
        assert err["type"] == "unauthenticated"
    elif status == 403:
        assert headers.get("www-authenticate") == 'Bearer error="insufficient_scope"'
        assert err["type"] == "forbidden"


@pytest.mark.parametrize("engine", ["aiohttp", "native"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_http(
    case: Case, engine: str, gateways: dict[str, LiveGateway], jwks_server: JwksServer
) -> None:
    gw = gateways[engine]
    path = "/v1/models" if case.route == "v1" else f"/{case.route}/v1/models"
    values = case.values
    status, headers, body = gw.http(path, [("authorization", v) for v in values])
    _check_refusal(case, values, status, headers, body)
    assert jwks_server.count("/attacker") == 0 and jwks_server.count("/attacker/cert.pem") == 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_grpc(case: Case, gateways: dict[str, LiveGateway], jwks_server: JwksServer) -> None:
    md = [("authorization", v) for v in case.values]
    if case.route != "v1":
        md.append(("x-route", case.route))
    for engine, gw in gateways.items():  # gRPC on grpcio (aiohttp's gateway) and h2 (native's)
        code, trailers = gw.grpc(md)
        assert code == GRPC_OF_HTTP[case.status], (engine, case.name, code)
        if case.status == 401:
            assert trailers.get("www-authenticate") == 'Bearer error="invalid_token"', trailers
    assert jwks_server.count("/attacker") == 0


def test_each_refusal_has_its_reason(gateways: dict[str, LiveGateway]) -> None:
    """The access log's reason class of every case: a 401 for an unintended reason (a minting
    slip that makes every token malformed) would hide a hole."""
    gw = gateways["native"]
    for i, c in enumerate(CASES):
        path = "/v1/models" if c.route == "v1" else f"/{c.route}/v1/models"
        gw.http(path, [("authorization", v) for v in c.values] + [("x-request-id", f"case-{i}")])

    def logged() -> dict[int, str]:
        got: dict[int, str] = {}
        for line in gw.proc.output().splitlines():
            if '"request_id":"case-' in line:
                doc = json.loads(line)
                detail = doc.get("detail", "")
                got[int(doc["request_id"][5:])] = detail.split(" ")[1] if detail else ""
        return got

    got = wait_until(logged, ok=lambda g: len(g) >= len(CASES), interval=0.1,
                     what="an access-log line for every case")  # fmt: skip
    wrong = {c.name: got.get(i) for i, c in enumerate(CASES) if got.get(i) != c.reason}
    assert not wrong, wrong


def test_a_1mib_header_is_refused_before_decoding(gateways: dict[str, LiveGateway]) -> None:
    big = "Bearer " + "A" * (1024 * 1024)
    for gw in gateways.values():
        status, _, _ = gw.http("/v1/models", [("authorization", big)])
        assert status == 431
    code, _ = gateways["aiohttp"].grpc([("authorization", big)])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code  # over grpcio's metadata cap
    # The h2 engine cuts a header block at limits.http2.max_header_list_bytes before decoding
    # it: the connection gets GOAWAY (its HPACK state cannot be kept without the block), so
    # the call fails as UNAVAILABLE, and the next connection is served.
    code, _ = gateways["native"].grpc([("authorization", big)])
    assert code == grpc.StatusCode.UNAVAILABLE, code
    good = [("authorization", f"Bearer {jws(claims(), CORP_RSA)}")]
    for gw in gateways.values():
        assert gw.grpc(good)[0] == grpc.StatusCode.OK
    for gw in gateways.values():
        assert (
            gw.http("/v1/models", [("authorization", f"Bearer {jws(claims(), CORP_RSA)}")])[0]
            == 200
        )


def test_spoofed_claim_headers_never_reach_the_backend(
    gateways: dict[str, LiveGateway], backend: Backend
) -> None:
    spoof = [("x-sluice-user", "admin"), ("X-Sluice-Tenant", "evil")]
    internal = jws(claims(iss=mint.HS_ISSUER), mint.HS_SECRET)  # forwards sub only
    corp = jws(claims(sub="alice", tenant="t-1"), CORP_RSA)
    for gw in gateways.values():
        for path, token, user, tenant in (
            ("/rec/v1/models", corp, "alice", "t-1"),
            ("/rec/v1/models", internal, "user-1", None),
            ("/rec-open/v1/models", None, None, None),
            ("/rec-optional/v1/models", None, None, None),
        ):
            _Recorder.seen.clear()
            auth = [("authorization", f"Bearer {token}")] if token else []
            assert gw.http(path, auth + spoof)[0] == 200, path
            seen = _Recorder.seen[-1]
            assert seen.get("x-sluice-user") == user and seen.get("x-sluice-tenant") == tenant
            assert "authorization" not in seen or token is None  # the token is not forwarded
    gw = gateways["aiohttp"]
    # gRPC: the simulated backend records metadata names (never values): the client's copies
    # are gone, the gateway's own are there only for claims the token has.
    backend.reset()
    md = [("authorization", f"Bearer {corp}"), ("x-sluice-user", "admin")]
    assert gw.grpc([*md, ("x-sluice-tenant", "evil")])[0] == grpc.StatusCode.OK
    names = backend.stats()["seen"][-1]["names"]
    assert "x-sluice-user" in names and "x-sluice-tenant" in names
    assert "authorization" not in names
    backend.reset()
    internal_md = [("authorization", f"Bearer {internal}"), ("x-route", "internal")]
    assert gw.grpc([*internal_md, ("x-sluice-tenant", "evil")])[0] == grpc.StatusCode.OK
    names = backend.stats()["seen"][-1]["names"]
    assert "x-sluice-user" in names and "x-sluice-tenant" not in names
    backend.reset()
    md = [("x-route", "open"), ("x-sluice-user", "admin"), ("x-sluice-tenant", "evil")]
    assert gw.grpc(md)[0] == grpc.StatusCode.OK
    names = backend.stats()["seen"][-1]["names"]
    assert "x-sluice-user" not in names and "x-sluice-tenant" not in names


def test_access_log_records_provider_and_reason(gateways: dict[str, LiveGateway]) -> None:
    gw = gateways["aiohttp"]
    now = int(time.time())
    expired_token = jws(claims(exp=now - 999), CORP_RSA)
    for rid, path, token in (
        ("log-expired", "/v1/models", expired_token),
        ("log-claims", "/gold/v1/models", jws(claims(tier="x"), CORP_RSA)),
        ("log-ok", "/v1/models", jws(claims(), CORP_RSA)),
    ):
        gw.http(path, [("authorization", f"Bearer {token}"), ("x-request-id", rid)])

    def logged() -> dict[str, dict[str, Any]]:
        lines: dict[str, dict[str, Any]] = {}
        for x in gw.proc.output().splitlines():
            if x.startswith('{"ts"') and '"request_id":"log-' in x:
                doc = json.loads(x)
                lines[doc["request_id"]] = doc
        return lines

    lines = wait_until(logged, ok=lambda got: len(got) >= 3, interval=0.1,
                       what="the three access-log lines")  # fmt: skip
    e, c, ok = lines["log-expired"], lines["log-claims"], lines["log-ok"]
    assert (e["status"], e["rejected"], e["detail"]) == (
        401,
        "unauthenticated",
        "auth expired (corp)",
    )
    assert "auth" not in e  # no principal: the token did not verify
    assert (c["status"], c["rejected"], c["auth"]) == (403, "forbidden", "corp")
    assert c["detail"] == "auth claims (corp)"
    assert ok["status"] == 200 and ok["auth"] == "corp" and "detail" not in ok
    assert expired_token.split(".")[2] not in gw.proc.output()
    assert gw.metric("sluice_auth_total", provider="corp", result="expired") >= 1
