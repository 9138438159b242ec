"""`ObjectStorage`: a `Storage` on S3 and anything else obstore supports (`gs://`, `az://`,
`memory://` …), with the mapping of Lance `storage_options` onto obstore's configuration.

`put_if_not_exists` is a conditional PUT (`If-None-Match: *`, obstore `mode="create"`). `memory://`
stores are process-wide, one per authority. `storage_options` are Lance's (the dict given to
`lance.dataset` / `lance.write_dataset`); see `obstore_options` for how they map onto obstore's
configuration. Without a configured region, an S3 bucket's region is found the way Lance finds it.
"""

from __future__ import annotations

import builtins
import functools
import logging
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection
from datetime import timedelta
from typing import Any

import obstore as obs
from obstore.exceptions import AlreadyExistsError, PreconditionError, UnknownConfigurationKeyError
from obstore.store import MemoryStore, from_url

from memwal_df.errors import NotFoundError, StorageError
from memwal_df.format.storage import (
    CREATED,
    EXISTED,
    LANDED,
    Blob,
    Storage,
    check_path,
    check_prefix,
    option_str,
)

__all__ = ["ObjectStorage", "obstore_options", "open_object_storage"]

_log = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    """obstore messages carry a multi-line debug dump; the first line says what happened."""
    text = str(exc).strip()
    return text.split("\n", 1)[0] if text else type(exc).__name__


def _as_bytes(data: Blob) -> bytes:
    """obstore takes bytes only."""
    return data if isinstance(data, bytes) else bytes(data)


# obstore `ClientConfig` keys (HTTP client); object_store also accepts them with a provider prefix.
_CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_ca_certificate",
        "proxy_excludes",
        "proxy_url",
        "randomize_addresses",
        "read_timeout",
        "timeout",
        "user_agent",
    }
)
_CLIENT_PREFIXES = ("aws_", "google_", "azure_")
_S3_SCHEMES = frozenset({"s3", "s3a"})
_S3_REGION_KEYS = ("aws_region", "region", "aws_default_region", "default_region")
_S3_ENDPOINT_KEYS = ("aws_endpoint", "aws_endpoint_url", "endpoint", "endpoint_url", "aws_endpoint_url_s3")
_LANCE_DEFAULT_REGION = "us-west-2"  # Lance's fallback when an endpoint is set and no region is known


@functools.cache
def _config_key_known(scheme: str, key: str) -> bool:
    """Whether obstore's store for `scheme` accepts config key `key` (object_store's own key parser,
    the one Lance uses). Lance silently ignores keys its store does not know; so do we."""
    try:
        # obstore types `config` per literal scheme; this scheme is known at run time only
        from_url(f"{scheme}://memwal-probe", config={key: "x"})  # type: ignore[call-overload]
    except UnknownConfigurationKeyError:
        return False
    except Exception:  # known key, probe value or missing settings rejected: fine
        return True
    return True


def _resolve_bucket_region(bucket: str) -> str | None:
    """The region of an AWS bucket, from the `x-amz-bucket-region` header (what Lance does when no
    region and no endpoint is configured). None if it cannot be found."""
    req = urllib.request.Request(f"https://{bucket}.s3.amazonaws.com", method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as e:  # 301/403 still carry the header
        return e.headers.get("x-amz-bucket-region")
    except OSError as e:
        _log.debug("could not resolve the region of bucket %s: %s", bucket, e)
        return None


def obstore_options(
    scheme: str, storage_options: dict[str, str] | None
) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """Map Lance `storage_options` to obstore's (config, client_options, retry_config).

    * keys are case-insensitive (lower-cased, as Lance does); empty values are dropped;
    * HTTP client keys (`allow_http`, `timeout`, `connect_timeout`, `proxy_url`, … also with an
      `aws_`/`google_`/`azure_` prefix, e.g. `aws_allow_http`) → client_options;
    * Lance's `client_max_retries` / `client_retry_timeout` (seconds) → retry_config;
    * every other key that object_store knows for the scheme (`aws_endpoint`, `aws_access_key_id`,
      `aws_secret_access_key`, `aws_session_token`, `aws_region`, `aws_virtual_hosted_style_request`,
      and their aliases `endpoint`, `access_key_id`, `token`, `region` …) → config unchanged;
    * anything else (Lance-only keys such as `download_retry_count`, `use_opendal`,
      `expires_at_millis`, `lance_*`) is ignored, as Lance's object store ignores it.
    """
    config: dict[str, str] = {}
    client: dict[str, str] = {}
    retry: dict[str, Any] = {}
    for raw_key, raw_value in (storage_options or {}).items():
        key = str(raw_key).lower()
        value = option_str(raw_value)
        if value == "":
            continue
        stripped = key
        for p in _CLIENT_PREFIXES:
            if key.startswith(p) and key[len(p) :] in _CLIENT_KEYS:
                stripped = key[len(p) :]
                break
        if stripped in _CLIENT_KEYS:
            client[stripped] = value
        elif key == "client_max_retries":
            retry["max_retries"] = int(value)
        elif key == "client_retry_timeout":
            retry["retry_timeout"] = timedelta(seconds=float(value))
        elif scheme != "memory" and _config_key_known(scheme, key):
            config[key] = value
        else:
            _log.debug("storage option %r is not used by memwal_df's %s store", raw_key, scheme)
    return config, client, retry


_MEMORY_STORES: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _memory_store(name: str) -> Any:
    """memory:// stores are process-wide, one per authority, so that two opens see the same objects."""
    with _MEMORY_LOCK:
        store = _MEMORY_STORES.get(name)
        if store is None:
            store = _MEMORY_STORES[name] = MemoryStore()
        return store


_RETRIED_RE = re.compile(r"(?<![a-z_])retries: ([1-9]\d*)")  # not "max_retries: 10"


class ObjectStorage(Storage):
    """Storage on an object store through obstore. `prefix` is the root's key prefix inside `store`."""

    def __init__(self, uri: str, store: Any, prefix: str, storage_options: dict[str, str] | None) -> None:
        super().__init__(uri, storage_options)
        self.store = store
        self.prefix = prefix
        self._base = prefix + "/" if prefix else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (open_object_storage, (self.uri, self.storage_options or None))

    def _key(self, path: str) -> str:
        return self._base + check_path(path)

    def _prefix_key(self, prefix: str) -> str | None:
        prefix = check_prefix(prefix)
        key = self._base + prefix if prefix else self.prefix
        return key or None

    def _rel(self, key: str) -> str:
        return key[len(self._base) :]

    def _error(self, op: str, path: str, exc: Exception) -> StorageError:
        # NotFoundError means "the object does not exist": only a read can say that (a PUT into a
        # missing bucket is a 404 too, but it is a StorageError).
        cls = NotFoundError if op == "get" and isinstance(exc, FileNotFoundError) else StorageError
        return cls(f"{op} {path!r} in {self.uri}: {_first_line(exc)}")

    def put_if_not_exists(self, path: str, data: Blob) -> bool:
        return self.create(path, data) != EXISTED

    def create(self, path: str, data: Blob) -> str:
        key = self._key(path)
        data = _as_bytes(data)
        for attempt in range(4):
            try:
                obs.put(self.store, key, data, mode="create", use_multipart=False)
                return CREATED
            except (AlreadyExistsError, PreconditionError) as e:
                # A PUT that object_store retried (e.g. after a timeout) may have been our own write
                # landing the first time: the 412 may then be about ourselves, or about someone who
                # wrote the same bytes meanwhile. Only the caller can tell those apart.
                if _RETRIED_RE.search(str(e)) and self._get_or_none(key) == data:
                    return LANDED
                return EXISTED
            except Exception as e:
                # S3 answers 409 ConditionalRequestConflict when a conditional write overlaps a
                # concurrent one or a delete; AWS documents it as retryable.
                msg = str(e)
                if attempt < 3 and ("409 Conflict" in msg or "ConditionalRequestConflict" in msg):
                    continue
                # No answer (a timeout, a reset connection) says nothing about whether the PUT
                # landed: what the store holds now does. Nothing readable there: the error stands.
                existing = self._get_or_none(key)
                if existing is None:
                    raise self._error("put_if_not_exists", path, e) from e
                return LANDED if existing == data else EXISTED
        raise AssertionError("unreachable")

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return bytes(obs.get(self.store, key).bytes())
        except Exception:
            return None

    def put(self, path: str, data: Blob) -> None:
        key = self._key(path)
        try:
            obs.put(self.store, key, _as_bytes(data), use_multipart=False)
        except Exception as e:
            raise self._error("put", path, e) from e

    def sync_tree(self, prefix: str, skip: Collection[str] = ()) -> None:
        """Nothing to do: a PUT is durable when it returns."""

    def get(self, path: str) -> bytes:
        key = self._key(path)
        try:
            return bytes(obs.get(self.store, key).bytes())
        except Exception as e:
            raise self._error("get", path, e) from e

    def head(self, path: str) -> int | None:
        key = self._key(path)
        try:
            return int(obs.head(self.store, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._error("head", path, e) from e

    def _list_keys(self, prefix: str) -> builtins.list[str]:
        key = self._prefix_key(prefix)
        try:
            return [m["path"] for chunk in obs.list(self.store, key, chunk_size=1000) for m in chunk]
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list", prefix, e) from e

    def list(self, prefix: str) -> builtins.list[str]:
        return sorted(self._rel(k) for k in self._list_keys(prefix))

    def list_dir(self, prefix: str) -> builtins.list[str]:
        key = self._prefix_key(prefix)
        try:
            res = obs.list_with_delimiter(self.store, key)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list_dir", prefix, e) from e
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]}
        names.update(m["path"].rsplit("/", 1)[-1] for m in res["objects"])
        return sorted(names)

    def delete(self, path: str) -> None:
        key = self._key(path)
        try:
            obs.delete(self.store, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error("delete", path, e) from e

    def delete_prefix(self, prefix: str) -> int:
        keys = self._list_keys(prefix)
        if not keys:
            return 0
        try:
            obs.delete(self.store, keys)  # bulk (DeleteObjects on S3)
        except Exception:
            # Some stores fail a bulk delete when one object is already gone: fall back to one by one.
            for key in keys:
                self.delete(self._rel(key))
        return len(keys)

    def child_uri(self, path: str) -> str:
        return f"{self.uri}/{check_path(path)}"


def open_object_storage(uri: str, storage_options: dict[str, str] | None = None) -> ObjectStorage:
    """Open the ObjectStorage rooted at `uri` (`s3://`, `memory://`, … any obstore scheme) with
    Lance-style `storage_options` (values as text, see `option_str`). Raises `StorageError` when
    obstore cannot open a store for `uri` with these options."""
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    options = dict(storage_options or {})
    path = parts.path.strip("/")
    norm_uri = f"{scheme}://{parts.netloc}" + (f"/{path}" if path else "")
    if scheme == "memory":
        return ObjectStorage(norm_uri, _memory_store(parts.netloc), path, options)

    config, client, retry = obstore_options(scheme, options)
    if scheme in _S3_SCHEMES:
        _default_s3_region(parts.netloc, config)
    try:
        # obstore types its options as TypedDicts per scheme; these are Lance-style text options
        store = from_url(
            f"{scheme}://{parts.netloc}",
            config=config or None,  # type: ignore[arg-type]
            client_options=client or None,  # type: ignore[arg-type]
            retry_config=retry or None,  # type: ignore[arg-type]
        )
    except Exception as e:
        raise StorageError(f"cannot open storage at {norm_uri}: {_first_line(e)}") from e
    return ObjectStorage(norm_uri, store, path, options)


def _default_s3_region(bucket: str, config: dict[str, str]) -> None:
    """Pick the region the way Lance does when none is configured (options or AWS_REGION /
    AWS_DEFAULT_REGION): with a custom endpoint, us-west-2; on AWS, the bucket's own region."""
    if any(k in config for k in _S3_REGION_KEYS):
        return
    if os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        return
    if any(k in config for k in _S3_ENDPOINT_KEYS) or any(
        os.environ.get(k) for k in ("AWS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    ):
        config["region"] = _LANCE_DEFAULT_REGION
        return
    region = _resolve_bucket_region(bucket)
    if region:
        config["region"] = region
