"""The edge's tenants: config loading, bearer auth, rate limits, and keys that never leak."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from edge.tenants import (
    AuthError,
    RateLimited,
    Tenant,
    TenantConfigError,
    Tenants,
    TokenBucket,
    hash_key,
)

REPO = Path(__file__).resolve().parents[2]
ACME_KEY = "sk-acme-0123456789"
BETA_KEY = "sk-beta-abcdef"
CONFIG = f"""
[[tenants]]
name = "acme"
weight = 3
requests_per_minute = 600
tokens_per_minute = 200000
keys = ["{hash_key(ACME_KEY)}"]

[[tenants]]
name = "beta"
weight = 0.5
keys = ["{hash_key(BETA_KEY).upper().replace("SHA256:", "sha256:")}"]
"""


def tenant(name: str = "t", rpm: float | None = None, tpm: float | None = None) -> Tenant:
    return Tenant(name, 1.0, TokenBucket(rpm) if rpm else None, TokenBucket(tpm) if tpm else None)


def config(*tenants: dict, **top) -> dict:
    return {"tenants": list(tenants), **top}


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    path = tmp_path / "tenants.toml"
    path.write_text(CONFIG)
    return Tenants.from_file(path)


def test_hash_key_is_sha256_hex():
    assert hash_key("abc") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_valid_config_loads(tenants: Tenants):
    assert sorted(tenants.tenants) == ["acme", "beta"]
    acme, beta = tenants.tenants["acme"], tenants.tenants["beta"]
    assert (acme.weight, beta.weight) == (3.0, 0.5)
    assert acme.requests.per_minute == 600 and acme.tokens.per_minute == 200000
    assert beta.requests is None and beta.tokens is None
    assert tenants.anonymous is None
    assert tenants.authenticate(f"Bearer {ACME_KEY}") is acme
    # Hashes written in upper-case hex still match.
    assert tenants.authenticate(f"Bearer {BETA_KEY}") is beta


KEY = hash_key("k")
INVALID = [
    (config({"name": "a", "weight": 0}), "tenants[0].weight: must be a positive number"),
    (config({"name": "a", "weight": -1}), "tenants[0].weight: must be a positive number"),
    (config({"name": "a", "weight": "3"}), "tenants[0].weight: must be a positive number"),
    (config({"name": "a", "weight": True}), "tenants[0].weight: must be a positive number"),
    (
        config({"name": "a"}, {"name": "b", "weight": float("inf")}),
        "tenants[1].weight: must be a positive number",
    ),
    (
        config({"name": "a", "requests_per_minute": 0}),
        "tenants[0].requests_per_minute: must be a positive number",
    ),
    (
        config({"name": "a", "tokens_per_minute": "lots"}),
        "tenants[0].tokens_per_minute: must be a positive number",
    ),
    (config({"weight": 1}), "tenants[0].name: must be a name"),
    (config({"name": "a b"}), "tenants[0].name: must be a name"),
    (config({"name": "a"}, {"name": "a"}), "tenants[1].name: duplicate tenant name 'a'"),
    (
        config({"name": "a", "keys": [KEY]}, {"name": "b", "keys": [hash_key("x"), KEY]}),
        "tenants[1].keys[1]: key already given to 'a'",
    ),
    (config({"name": "a", "keys": KEY}), "tenants[0].keys: must be an array"),
    (config({"name": "a", "keys": ["sha256:abc"]}), "tenants[0].keys[0]: must be 'sha256:"),
    (config({"name": "a", "keys": [42]}), "tenants[0].keys[0]: must be 'sha256:"),
    (config({"name": "a", "request_per_minute": 5}), "tenants[0].request_per_minute: unknown key"),
    (config("acme"), "tenants[0]: must be a table"),
    (config({"name": "a"}, allow_anonymous="yes"), "allow_anonymous: must be true or false"),
    (config({"name": "a"}, anonymous_tenant=""), "anonymous_tenant: must be a name"),
    (config({"name": "a"}, allow_anon=True), "allow_anon: unknown key"),
    ({"tenants": {"name": "a"}}, "tenants: must be an array of tables"),
    ({}, "tenants: no tenants, and allow_anonymous is false"),
]


@pytest.mark.parametrize(("data", "message"), INVALID)
def test_invalid_config_names_the_key(data: dict, message: str):
    with pytest.raises(TenantConfigError) as exc:
        Tenants.from_dict(data, source="tenants.toml")
    assert str(exc.value).startswith("tenants.toml: ")
    assert message in str(exc.value)


def test_bad_toml_names_the_file(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[[tenants]\nname = 'a'\n")
    with pytest.raises(TenantConfigError, match=r"tenants\.toml: .*line 1"):
        Tenants.from_file(path)
    with pytest.raises(TenantConfigError, match=r"missing\.toml"):
        Tenants.from_file(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "Missing API key: send Authorization: Bearer <key>."),
        ("", "Missing API key: send Authorization: Bearer <key>."),
        ("Bearer", "Missing API key: send Authorization: Bearer <key>."),
        ("Bearer   ", "Missing API key: send Authorization: Bearer <key>."),
        (f"Basic {ACME_KEY}", "Missing API key: send Authorization: Bearer <key>."),
        (ACME_KEY, "Missing API key: send Authorization: Bearer <key>."),
        ("Bearer sk-wrong", "Invalid API key provided."),
        (f"Bearer {ACME_KEY}x", "Invalid API key provided."),
    ],
)
def test_bad_credentials_are_401(tenants: Tenants, header: str | None, message: str):
    with pytest.raises(AuthError) as exc:
        tenants.authenticate(header)
    assert (exc.value.status, exc.value.code, exc.value.message) == (
        401,
        "invalid_api_key",
        message,
    )
    assert exc.value.retry_after_s is None


@pytest.mark.parametrize(
    "header", [f"Bearer {ACME_KEY}", f"bearer {ACME_KEY}", f" BEARER\t{ACME_KEY} "]
)
def test_bearer_scheme_is_case_insensitive(tenants: Tenants, header: str):
    assert tenants.authenticate(header).name == "acme"


def test_anonymous_mode():
    tenants = Tenants.from_dict(config({"name": "a", "keys": [KEY]}, allow_anonymous=True))
    assert tenants.authenticate(None).name == "anonymous"
    assert tenants.authenticate("Bearer ").name == "anonymous"
    assert tenants.authenticate("Bearer k").name == "a"
    # A wrong key is still refused, not downgraded to anonymous.
    with pytest.raises(AuthError, match="Invalid API key"):
        tenants.authenticate("Bearer nope")
    with pytest.raises(AuthError, match="Missing API key"):
        tenants.authenticate("Basic k")


def test_listed_anonymous_tenant_keeps_its_weight_and_limits():
    data = config(
        {"name": "dev", "weight": 2, "requests_per_minute": 1},
        allow_anonymous=True,
        anonymous_tenant="dev",
    )
    tenants = Tenants.from_dict(data)
    anonymous = tenants.authenticate(None)
    assert anonymous is tenants.tenants["dev"] and anonymous.weight == 2
    anonymous.check_rate(0, now=0)
    with pytest.raises(RateLimited):
        anonymous.check_rate(0, now=0)
    # Anonymous with no tenants at all: the all-in-one dev setup.
    assert Tenants.from_dict({"allow_anonymous": True}).authenticate(None).name == "anonymous"


def test_keys_never_appear_in_errors_or_logs(tenants: Tenants, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-key-a1b2c3d4e5"
    raised = []
    for header in (f"Bearer {wrong}", f"Basic {wrong}", wrong, f"Bearer {wrong}\udcff"):
        with pytest.raises(AuthError) as exc:
            tenants.authenticate(header)
        raised.append(exc.value)
    # A key pasted into the config in clear is refused without being echoed.
    with pytest.raises(TenantConfigError) as exc:
        Tenants.from_dict(config({"name": "a", "keys": [wrong]}))
    raised.append(exc.value)
    for error in raised:
        text = f"{error} {error!r} {error.args} {getattr(error, 'message', '')}"
        assert wrong not in text
        assert error.__cause__ is None and error.__context__ is None
    assert caplog.records, "expected the rejections to be logged (without the key)"
    assert wrong not in caplog.text and ACME_KEY not in caplog.text


def test_request_rate_limit_refuses_then_recovers():
    t = tenant(rpm=6)  # one request per 10 s, six at once
    for _ in range(6):
        t.check_rate(0, now=100.0)
    with pytest.raises(RateLimited) as exc:
        t.check_rate(0, now=100.0)
    e = exc.value
    assert (e.status, e.code, e.limit, e.retry_after_s) == (
        429,
        "rate_limit_exceeded",
        "requests_per_minute",
        10,
    )
    assert "requests per minute" in e.message and "limit 6" in e.message
    with pytest.raises(RateLimited) as exc:
        t.check_rate(0, now=109.5)
    assert exc.value.retry_after_s == 1  # 0.5 s left: rounded up, never 0
    t.check_rate(0, now=110.0)


def test_token_rate_limit_refuses_then_recovers():
    t = tenant(tpm=1000)
    t.check_rate(800, now=0)
    with pytest.raises(RateLimited) as exc:
        t.check_rate(500, now=0)
    # 300 tokens missing at 1000/min: 18 s.
    assert (exc.value.limit, exc.value.retry_after_s) == ("tokens_per_minute", 18)
    assert "tokens per minute" in exc.value.message
    t.check_rate(500, now=18)


@pytest.mark.parametrize("tpm", [60, 600_000])
def test_waiting_retry_after_is_enough_despite_float_rounding(tpm: float):
    # With this monotonic clock reading, (start + 19) - start == 18.999999999999886.
    start = 1012.7930964535236
    t = tenant(tpm=tpm)
    t.check_rate(tpm, now=start)
    with pytest.raises(RateLimited) as exc:
        t.check_rate(tpm * 19 / 60, now=start)
    assert exc.value.retry_after_s == 19
    t.check_rate(tpm * 19 / 60, now=start + exc.value.retry_after_s)


def test_refusal_consumes_nothing():
    t = tenant(rpm=2, tpm=1000)
    t.check_rate(900, now=0)
    with pytest.raises(RateLimited):
        t.check_rate(500, now=0)  # refused on tokens: must not take a request slot
    t.check_rate(100, now=0)  # the second request and the last 100 tokens are still there
    with pytest.raises(RateLimited) as exc:
        t.check_rate(0, now=0)
    assert exc.value.limit == "requests_per_minute"


def test_request_larger_than_the_bucket_waits_for_a_full_bucket_then_owes():
    t = tenant(tpm=1000)
    t.check_rate(3000, now=0)  # admitted on a full bucket, leaving a 2000-token debt
    with pytest.raises(RateLimited) as exc:
        t.check_rate(1, now=0)
    assert exc.value.retry_after_s == 121  # 2001 tokens at 1000/min: 120.06 s


def test_correct_tokens_refunds_and_charges():
    t = tenant(tpm=1000)
    t.check_rate(1000, now=0)
    with pytest.raises(RateLimited):
        t.check_rate(1, now=0)
    t.correct_tokens(estimated=1000, actual=100, now=0)  # 900 back
    t.check_rate(900, now=0)
    t.correct_tokens(estimated=0, actual=600, now=0)  # 600 more than estimated: a debt
    with pytest.raises(RateLimited) as exc:
        t.check_rate(1, now=0)
    assert exc.value.retry_after_s == 37  # 601 tokens at 1000/min: 36.06 s


def test_refund_never_overfills_the_bucket():
    t = tenant(tpm=1000)
    t.correct_tokens(estimated=500, actual=0, now=0)
    t.check_rate(1000, now=0)
    with pytest.raises(RateLimited):
        t.check_rate(1, now=0)


def test_tenant_without_limits_is_never_limited():
    t = tenant()
    for i in range(10_000):
        t.check_rate(1e9, now=i * 1e-6)
    t.correct_tokens(estimated=0, actual=1e12)
    t.check_rate(1e9)


def test_errors_map_onto_api_error():
    from omni.api.errors import ApiError

    t = tenant(rpm=1)
    t.check_rate(0, now=0)
    with pytest.raises(RateLimited) as exc:
        t.check_rate(0, now=0)
    e = exc.value
    response = ApiError(e.status, e.message, code=e.code, retry_after=e.retry_after_s).response()
    assert response.status == 429 and response.headers["Retry-After"] == "60"


def test_hash_key_cli_round_trip():
    run = subprocess.run(
        [sys.executable, "-m", "edge.tenants", "hash-key"],
        input=f"{ACME_KEY}\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == hash_key(ACME_KEY) + "\n"
    tenants = Tenants.from_dict(config({"name": "a", "keys": [run.stdout.strip()]}))
    assert tenants.authenticate(f"Bearer {ACME_KEY}").name == "a"
    empty = subprocess.run(
        [sys.executable, "-m", "edge.tenants", "hash-key"],
        input="\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert empty.returncode == 2 and empty.stdout == ""
