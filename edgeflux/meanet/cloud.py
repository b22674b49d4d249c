"""The edge's HTTP client of the cloud model (MLflow's model server, started by
``edgeflux.meanet.server.ModelServer``).

    with CloudClient("http://127.0.0.1:5001", timeout_s=5.0, retries=2) as cloud:
        logits = cloud(x)          # one POST /invocations {"inputs": x.tolist()} -> [N, classes]

Whatever tensor it is given is sent (images, or the features F of model A): the served model's signature
decides what it accepts. A request that fails (refused, reset, timed out, an HTTP error, an answer that is
not N rows of logits) is retried ``retries`` times after a pause that doubles from ``backoff_s``; then
``CloudUnavailable`` is raised and the cloud is considered down for ``cooldown_s``: calls in that window
raise at once, without touching the network, so a dead or slow cloud costs one timeout, not one per batch.
The router answers those instances on the edge. ``timeout_s`` is httpx's, per phase (connect, write, read).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import httpx
import torch
from torch import Tensor

from edgeflux.auth import USER, load_password

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request otherwise


class CloudUnavailable(RuntimeError):
    """The cloud could not answer a request (after its retries, or while it is considered down)."""


class _BadAnswer(ValueError):
    """The server answered, but not with N rows of logits (or not with 200)."""


@dataclass
class ClientStats:
    requests: int = 0          # HTTP requests sent (retries included)
    failures: int = 0          # calls that raised CloudUnavailable after every retry
    retries: int = 0
    skipped: int = 0           # calls refused during a cooldown, without a request
    instances_sent: int = 0    # instances the cloud answered
    bytes_sent: int = 0        # request bodies of answered calls (once each, as the upload a device would pay)
    round_trip_s: float = 0.0  # wall time of answered calls: JSON, HTTP, the model, parsing (their retries too)


class CloudClient:
    """POSTs batches to ``url/invocations`` and returns the cloud's logits; see the module docstring.
    ``transport``: httpx's, for tests (httpx.MockTransport)."""

    def __init__(self, url: str, timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 0.2,
                 cooldown_s: float = 5.0, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries, self.backoff_s, self.cooldown_s = retries, backoff_s, cooldown_s
        self.stats = ClientStats()
        self.down_until = 0.0   # time.monotonic() before which calls raise without a request
        # One connection, kept alive. A proxy from the environment (HTTP_PROXY) is for a remote cloud only: httpx
        # would send loopback requests through it too unless NO_PROXY names 127.0.0.1.
        # Beyond loopback the model server sits behind a reverse proxy that checks the fleet's password
        # (docs/cli.md, Security): send it when one is set.
        password = None if _loopback(self.url) else load_password()
        self.http = httpx.Client(timeout=timeout_s, transport=transport, trust_env=not _loopback(self.url),
                                 auth=(USER, password) if password else None)

    def __call__(self, x: Tensor) -> Tensor:
        if time.monotonic() < self.down_until:
            self.stats.skipped += 1
            left = self.down_until - time.monotonic()
            raise CloudUnavailable(f"cloud at {self.url} is considered down for {left:.1f} s more (a request failed "
                                   "every retry): the edge answers")
        start = time.perf_counter()
        body = json.dumps({"inputs": x.detach().cpu().float().tolist()}).encode()
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            self.stats.requests += 1
            try:
                logits = self._post(body, len(x))
            except (httpx.HTTPError, _BadAnswer) as exc:
                reason = str(exc) if isinstance(exc, _BadAnswer) else _one_line(exc)
                log.debug("cloud request %d/%d failed: %s", attempt + 1, self.retries + 1, reason)
                continue
            self.stats.instances_sent += len(x)
            self.stats.bytes_sent += len(body)
            self.stats.round_trip_s += time.perf_counter() - start
            return logits
        self.stats.failures += 1
        self.down_until = time.monotonic() + self.cooldown_s
        raise CloudUnavailable(f"cloud at {self.url} did not answer after {self.retries + 1} tries ({reason}): "
                               f"check the model server; the edge answers for the next {self.cooldown_s:g} s")

    def _post(self, body: bytes, rows: int) -> Tensor:
        response = self.http.post(f"{self.url}/invocations", content=body,
                                  headers={"Content-Type": "application/json"})
        if response.status_code != 200:
            raise _BadAnswer(f"HTTP {response.status_code}: {_server_message(response)}")
        return parse_logits(response.content, rows)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> CloudClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_logits(content: bytes, rows: int) -> Tensor:
    """MLflow's answer ``{"predictions": [[...], ...]}`` as float32 logits [rows, classes]; _BadAnswer otherwise."""
    try:
        logits = torch.tensor(json.loads(content)["predictions"], dtype=torch.float32)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:   # not JSON, no predictions, ragged, strings
        raise _BadAnswer(f"not logits: {_one_line(exc)}") from None
    if logits.dim() != 2 or len(logits) != rows:
        raise _BadAnswer(f"expected {rows} rows of logits, got shape {tuple(logits.shape)}")
    return logits


def _server_message(response: httpx.Response) -> str:
    """MLflow's error answers are {"error_code": ..., "message": "Failed to predict data '<the whole input>'.
    Error: <what is wrong>"}: the part after the last "Error:" (the input would drown it)."""
    try:
        message = str(response.json().get("message", ""))
    except (ValueError, AttributeError):   # not JSON, or not an object
        message = response.text
    message = " ".join(message.rsplit("Error:", 1)[-1].split())
    return message[:200] or response.reason_phrase


def _loopback(url: str) -> bool:
    host = httpx.URL(url).host
    return host in ("localhost", "::1") or host.startswith("127.")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
