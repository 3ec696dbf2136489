"""Tenants and API keys for the edge: who a request belongs to, and whether it may run now.

Keys live in the config only as sha256 hashes, so a leaked config file or log line never
hands out a working key; nothing here writes a key (or a config `keys` entry, which might be
a key pasted in clear) into a message or a log. Errors carry status/message/code so the HTTP
layer can answer them as OpenAI-style errors without this module knowing about HTTP.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import logging
import math
import re
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEY_HASH = re.compile(r"sha256:[0-9a-f]{64}")
# Tenant names travel in a header (X-Omni-Tenant) and in metric labels: keep them plain.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_FIELDS = {"name", "weight", "requests_per_minute", "tokens_per_minute", "keys"}
TOP_FIELDS = {"tenants", "allow_anonymous", "anonymous_tenant"}
# Slack for float rounding (a later `now` minus an earlier one can come out a hair short), so
# waiting exactly Retry-After seconds is always enough. In seconds: it must not depend on the rate.
SLACK_S = 1e-6


def hash_key(token: str) -> str:
    """A key as the config stores it. surrogatepass: no UnicodeEncodeError can carry the key."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class TenantConfigError(ValueError):
    """A config problem, naming the offending key (never its value: it may be a secret)."""


class TenantError(Exception):
    """A refusal the HTTP layer turns into an ApiError(status, message, code, retry_after)."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class AuthError(TenantError):
    status = 401
    code = "invalid_api_key"


class RateLimited(TenantError):
    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int, limit: str):
        super().__init__(message, retry_after_s)
        self.limit = limit  # "requests_per_minute" or "tokens_per_minute", for metrics


MISSING_KEY = "Missing API key: send Authorization: Bearer <key>."
INVALID_KEY = "Invalid API key provided."


@dataclass
class TokenBucket:
    """Holds up to one minute's worth, refilled continuously; may go negative (debt)."""

    per_minute: float
    level: float = field(init=False)
    updated: float | None = field(default=None, init=False)  # None: starts full at first use

    def __post_init__(self) -> None:
        self.level = self.per_minute

    def refill(self, now: float) -> float:
        if self.updated is not None:
            elapsed = max(0.0, now - self.updated)
            self.level = min(self.per_minute, self.level + elapsed * self.per_minute / 60)
        self.updated = now
        return self.level

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until `cost` fits. A cost above capacity waits for a full bucket only."""
        need = min(cost, self.per_minute)
        wait = (need - self.refill(now)) * 60 / self.per_minute
        return wait if wait > SLACK_S else 0.0


@dataclass
class Tenant:
    """Who a request is for: its share under contention, and the limits it runs under."""

    name: str
    weight: float = 1.0
    requests: TokenBucket | None = field(default=None, repr=False)
    tokens: TokenBucket | None = field(default=None, repr=False)

    def check_rate(self, cost_tokens: float, now: float | None = None) -> None:
        """Admit one request of `cost_tokens` estimated tokens, or raise RateLimited.

        A refusal consumes nothing, so a client that honours Retry-After gets through.
        """
        now = time.monotonic() if now is None else now
        limits = [
            (bucket, cost, limit)
            for bucket, cost, limit in (
                (self.requests, 1.0, "requests per minute"),
                (self.tokens, max(0.0, cost_tokens), "tokens per minute"),
            )
            if bucket is not None
        ]
        wait, limit, per_minute = max(
            ((b.wait_s(cost, now), limit, b.per_minute) for b, cost, limit in limits),
            default=(0.0, "", 0.0),
        )
        if wait > 0:
            retry_after = math.ceil(wait)  # whole seconds, at least 1, never too early
            log.debug("tenant %s over its %s", self.name, limit)
            raise RateLimited(
                f"Rate limit reached for tenant '{self.name}' on {limit}: limit {per_minute:g}. "
                f"Please try again in {retry_after}s.",
                retry_after,
                limit.replace(" ", "_"),
            )
        for bucket, cost, _ in limits:
            bucket.level -= cost

    def correct_tokens(self, estimated: float, actual: float, now: float | None = None) -> None:
        """Settle a finished request: refund an overestimate, charge an underestimate."""
        if self.tokens is None:
            return
        self.tokens.refill(time.monotonic() if now is None else now)
        self.tokens.level += estimated - actual  # the next refill caps it at one minute's worth


def parse_tenant(
    entry: Any, at: str, fail: Callable[[str, str], Exception]
) -> tuple[Tenant, list[str]]:
    """One [[tenants]] table: the Tenant, and its normalised key hashes."""
    if not isinstance(entry, dict):
        raise fail(at, "must be a table")
    if unknown := sorted(entry.keys() - TENANT_FIELDS):
        raise fail(f"{at}.{unknown[0]}", "unknown key")
    name = entry.get("name")
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise fail(f"{at}.name", "must be a name of letters, digits, '.', '_', '-'")
    numbers: dict[str, float | None] = {}
    for key in ("weight", "requests_per_minute", "tokens_per_minute"):
        value = entry.get(key, 1 if key == "weight" else None)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and value > 0):
            raise fail(f"{at}.{key}", "must be a positive number")
        numbers[key] = None if value is None else float(value)
    rpm, tpm = numbers["requests_per_minute"], numbers["tokens_per_minute"]
    keys = entry.get("keys", [])
    if not isinstance(keys, list):
        raise fail(f"{at}.keys", "must be an array of 'sha256:<hex>' strings")
    key_hashes = []
    for j, key_hash in enumerate(keys):
        # Never echo the value: it may be a key pasted in clear.
        normal = key_hash.lower() if isinstance(key_hash, str) else ""
        if not KEY_HASH.fullmatch(normal):
            hint = "must be 'sha256:<64 hex digits>' (python -m edge.tenants hash-key)"
            raise fail(f"{at}.keys[{j}]", hint)
        key_hashes.append(normal)
    tenant = Tenant(
        name,
        numbers["weight"] or 1.0,
        TokenBucket(rpm) if rpm else None,
        TokenBucket(tpm) if tpm else None,
    )
    return tenant, key_hashes


class Tenants:
    """Every tenant of one config, and the key hashes that lead to them."""

    def __init__(
        self, tenants: list[Tenant], by_hash: dict[str, Tenant], anonymous: Tenant | None = None
    ):
        self.tenants = {t.name: t for t in tenants}
        self._by_hash = by_hash
        self.anonymous = anonymous

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise TenantConfigError(f"{path}: {e}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<config>") -> Tenants:
        def fail(key: str, problem: str) -> TenantConfigError:
            return TenantConfigError(f"{source}: {key}: {problem}")

        if unknown := sorted(data.keys() - TOP_FIELDS):
            raise fail(unknown[0], "unknown key")
        allow_anonymous = data.get("allow_anonymous", False)
        if not isinstance(allow_anonymous, bool):
            raise fail("allow_anonymous", "must be true or false")
        anonymous_name = data.get("anonymous_tenant", "anonymous")
        if not isinstance(anonymous_name, str) or not TENANT_NAME.fullmatch(anonymous_name):
            raise fail("anonymous_tenant", "must be a name of letters, digits, '.', '_', '-'")
        entries = data.get("tenants", [])
        if not isinstance(entries, list):
            raise fail("tenants", "must be an array of tables ([[tenants]])")
        if not entries and not allow_anonymous:
            raise fail("tenants", "no tenants, and allow_anonymous is false: nobody could log in")

        tenants: list[Tenant] = []
        by_hash: dict[str, Tenant] = {}
        for i, entry in enumerate(entries):
            tenant, key_hashes = parse_tenant(entry, f"tenants[{i}]", fail)
            if any(t.name == tenant.name for t in tenants):
                raise fail(f"tenants[{i}].name", f"duplicate tenant name '{tenant.name}'")
            for j, key_hash in enumerate(key_hashes):
                if key_hash in by_hash:
                    owner = by_hash[key_hash].name
                    raise fail(f"tenants[{i}].keys[{j}]", f"key already given to '{owner}'")
                by_hash[key_hash] = tenant
            tenants.append(tenant)

        anonymous = None
        if allow_anonymous:
            # Listed: its weight and limits apply; not listed: an unlimited tenant of weight 1.
            anonymous = next((t for t in tenants if t.name == anonymous_name), None)
            if anonymous is None:
                anonymous = Tenant(anonymous_name)
                tenants.append(anonymous)
        log.info("%s: %d tenants, %d keys", source, len(tenants), len(by_hash))
        return cls(tenants, by_hash, anonymous)

    def authenticate(self, authorization_header: str | None) -> Tenant:
        """The tenant behind `Authorization: Bearer <key>`, or raise AuthError (401).

        A wrong key is refused even when anonymous access is allowed: it is a client's
        mistake (or a revoked key) that falling back to anonymous would hide. The lookup is
        by sha256, so its timing tells an attacker nothing about a stored key.
        """
        header = (authorization_header or "").strip()
        if not header:
            if self.anonymous is not None:
                return self.anonymous
            raise AuthError(MISSING_KEY)
        scheme, *rest = header.split(None, 1)
        if scheme.lower() != "bearer":
            raise AuthError(MISSING_KEY)
        if not rest:  # "Bearer" alone: no key, as if no header
            return self.authenticate(None)
        token = rest[0].strip()
        tenant = self._by_hash.get(hash_key(token))
        if tenant is None:
            log.debug("rejected a request with an unknown API key")
            raise AuthError(INVALID_KEY)
        return tenant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edge.tenants", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("hash-key", help="read a key on stdin, print its config form")
    parser.parse_args(argv)
    token = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.read()
    token = token.strip()
    if not token:
        print("no key on stdin", file=sys.stderr)
        return 2
    print(hash_key(token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
