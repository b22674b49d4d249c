"""MEANet's cloud path on loopback: a tiny CNN saved in MLflow's format (tracking.save_model_dir), served by
MLflow's own server (edgeflux.meanet.server.ModelServer), asked by the edge's client (edgeflux.meanet.cloud).

The real server starts once for the module (about 7 s); the client's retry logic is checked against
httpx.MockTransport, which needs no server."""
import json
import logging
import socket
import subprocess
import time

import httpx
import pytest
import torch
from torch import nn

from edgeflux.meanet.cloud import CloudClient, CloudUnavailable, parse_logits
from edgeflux.meanet.server import CloudServerError, ModelServer
from edgeflux.process import group_alive as _group_alive
from edgeflux.service import port_in_use as _port_in_use
from edgeflux.tracking import save_model_dir


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    net(torch.randn(32, 1, 8, 8) * 2 + 1)   # BatchNorm's running statistics away from (0, 1)
    return net


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """(model, its MLflow directory). Saved while in training mode: the served model must still be eval's."""
    net, path = tiny_cnn(), tmp_path_factory.mktemp("cloud") / "model"
    save_model_dir(net, path, torch.randn(2, 1, 8, 8))
    assert net.training, "save_model_dir must give the model back in the mode it had"
    return net.eval(), path


@pytest.fixture(scope="module")
def server(cnn, tmp_path_factory):
    # A PATH without the venv: ModelServer must put the venv's bin (uvicorn) on the server's own.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", "/usr/bin:/bin")
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.setenv("DO_NOT_TRACK", "true")
        mp.setenv("HTTP_PROXY", "http://127.0.0.1:9")   # a proxy for remote hosts: loopback must bypass it
        srv = ModelServer(cnn[1], log_path=tmp_path_factory.mktemp("serve") / "server.log")
        try:
            yield srv
        finally:
            srv.stop()


@pytest.fixture
def running(server):
    """The module's server, started (again, if a test before this one stopped it)."""
    if server.process is None:
        server.start()
    return server


def test_served_logits_equal_the_local_model(cnn, running, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")   # a proxy for remote hosts: loopback must bypass it
    net, _ = cnn
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with CloudClient(running.url) as client:
        logits = client(x)
        one = client(x[:1])   # the router's last chunk may hold one instance
    with torch.no_grad():
        expected = net(x)
    assert logits.shape == (16, 3) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(one, expected[:1], atol=1e-5, rtol=0)
    assert client.http.is_closed
    s = client.stats
    assert (s.requests, s.retries, s.failures, s.instances_sent) == (2, 0, 0, 17)
    assert s.bytes_sent == sum(len(json.dumps({"inputs": t.tolist()}).encode()) for t in (x, x[:1]))
    assert s.round_trip_s > 0


def test_stopped_server_makes_the_client_fail_then_skip(running):
    client = CloudClient(running.url, retries=2, backoff_s=0.01, cooldown_s=600)
    x = torch.zeros(4, 1, 8, 8)
    client(x)   # a kept-alive connection: the failure below must not hide behind it
    group = running.process.pid
    running.stop()
    assert not _group_alive(group), "stop() left a process of the server's group (uvicorn?) alive"
    assert not _port_in_use(running.host, running.port)
    running.stop()   # idempotent
    with pytest.raises(CloudUnavailable, match=rf"cloud at {running.url} did not answer after 3 tries"):
        client(x)
    s = client.stats
    assert (s.requests, s.retries, s.failures, s.skipped, s.instances_sent) == (4, 2, 1, 0, 4)
    with pytest.raises(CloudUnavailable, match="considered down"):
        client(x)
    assert (s.requests, s.failures, s.skipped) == (4, 1, 1), "a call in the cooldown must not touch the network"
    client.down_until = 0.0   # the cooldown is over: the cloud is asked again
    with pytest.raises(CloudUnavailable):
        client(x)
    assert (s.requests, s.failures, s.skipped) == (7, 2, 1)
    client.close()


def test_missing_or_foreign_model_fails_before_starting(tmp_path):
    with pytest.raises(CloudServerError, match=r"no MLflow model at .*nope: give a directory written by"):
        ModelServer(tmp_path / "nope").start()
    with pytest.raises(CloudServerError, match=r"no MLmodel file \(not an MLflow model\)"):
        ModelServer(tmp_path).start()


def test_port_in_use_is_named(cnn):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(CloudServerError, match=rf"port {port} on 127.0.0.1 is in use: .*choose another port"):
            ModelServer(cnn[1], port=port).start()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garble MLmodel", "no checksums"])
def test_a_damaged_model_directory_is_refused_before_it_is_served(cnn, tmp_path, damage):
    """A model with 16 bytes flipped would be served and answer wrongly (a measured cloud accuracy of 0.22
    instead of 0.90): the directory's checksums are checked first."""
    import shutil

    from edgeflux.tracking.models import MANIFEST
    model = tmp_path / "cloud"
    shutil.copytree(cnn[1], model)
    weights = max((p for p in model.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[len(data) // 2: len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 16])
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: int(len(data) * 0.8)]))
    elif damage == "garble MLmodel":
        (model / "MLmodel").write_text((model / "MLmodel").read_text().replace("flavors", "flavours"))
        weights = model / "MLmodel"
    else:
        (model / MANIFEST).unlink()
    server = ModelServer(model, log_path=tmp_path / "server.log")
    expected = rf"{model}: no readable {MANIFEST}" if damage == "no checksums" else \
        rf"{weights} differs from the file that was saved \(damaged or changed\)"
    with pytest.raises(CloudServerError, match=expected + r".*dvc checkout models/meanet/cloud.*dvc repro -f meanet_cloud"):
        server.start()
    assert server.process is None


def test_server_that_exits_early_is_reported_with_its_last_log_line(tmp_path):
    from edgeflux.tracking.models import MANIFEST, _digests
    (tmp_path / "MLmodel").write_text("flavors: {}\n")   # an MLmodel that MLflow cannot serve
    (tmp_path / MANIFEST).write_text(json.dumps({"sha256": _digests(tmp_path)}))   # intact, as saved
    server = ModelServer(tmp_path, log_path=tmp_path / "server.log")
    with pytest.raises(CloudServerError, match=r"exited with code 1 before it was ready \(last log line: Exception: "
                                               r"No suitable flavor backend.*\): fix that, see .*server.log"):
        server.start()
    assert server.process is None


def test_server_not_ready_in_time_is_stopped(cnn, tmp_path):
    server = ModelServer(cnn[1], ready_timeout_s=0.5, log_path=tmp_path / "server.log")
    started = []
    original = server._wait_ready

    def wait_ready():
        started.append(server.process.pid)
        original()

    server._wait_ready = wait_ready
    with pytest.raises(CloudServerError, match=r"was not ready after 0.5 s .*raise the ready timeout"):
        server.start()
    assert server.process is None and not _group_alive(started[0])


def test_stop_kills_a_group_that_ignores_sigterm(tmp_path, caplog):
    server = ModelServer(tmp_path)   # never started: a stand-in group, a shell and its child ignoring SIGTERM
    server.process = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & wait"], start_new_session=True)
    group = server.process.pid
    time.sleep(0.2)   # the trap is set
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="edgeflux.process"):
        server.stop(grace_s=0.3)
    assert time.monotonic() - started < 10, "stop() waited for the sleep instead of killing it"
    assert "ignored SIGTERM for 0.3 s: killing it" in caplog.text
    assert not _group_alive(group) and server.process is None


def mock_client(answers: list, **kwargs) -> tuple[CloudClient, list[httpx.Request]]:
    """A client whose server answers from ``answers`` in turn: an httpx.Response, or an exception to raise."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    kwargs = {"backoff_s": 0.0, **kwargs}
    return CloudClient("http://cloud.test", transport=httpx.MockTransport(handler), **kwargs), seen


def ok(rows: int, classes: int = 3) -> httpx.Response:
    return httpx.Response(200, json={"predictions": [[float(c) for c in range(classes)]] * rows})


def test_a_500_then_a_200_succeeds_after_one_retry():
    client, seen = mock_client([httpx.Response(500, json={"message": "boom"}), ok(2)], retries=2)
    logits = client(torch.zeros(2, 1, 8, 8))
    assert logits.tolist() == [[0.0, 1.0, 2.0]] * 2
    assert (client.stats.requests, client.stats.retries, client.stats.failures) == (2, 1, 0)
    assert len(seen) == 2 and seen[0].url == "http://cloud.test/invocations"


@pytest.mark.parametrize("answer, reason", [
    (httpx.Response(400, json={"message": "Failed to predict data '[[1.]]'. \nError: Shape of input (1, 1) "
                                          "does not match expected shape (-1, 1, 8, 8)."}),
     r"HTTP 400: Shape of input \(1, 1\) does not match"),
    (httpx.ConnectError("refused"), "ConnectError: refused"),
    (httpx.ReadTimeout("timed out"), "ReadTimeout: timed out"),
    (httpx.Response(200, content=b"<html>"), "not logits: JSONDecodeError"),
    (httpx.Response(200, json={"error": "x"}), "not logits: KeyError"),
    (httpx.Response(200, json={"predictions": [[1.0, 2.0], [3.0]]}), "not logits: ValueError"),
    (ok(3), r"expected 2 rows of logits, got shape \(3, 3\)"),
    (httpx.Response(200, json={"predictions": [1.0, 2.0]}), r"expected 2 rows of logits, got shape \(2,\)"),
])
def test_every_failure_is_retried_then_reported_in_one_line(answer, reason):
    client, seen = mock_client([answer], retries=3)
    with pytest.raises(CloudUnavailable, match=rf"cloud at http://cloud.test did not answer after 4 tries "
                                               rf"\({reason}") as info:
        client(torch.zeros(2, 1, 8, 8))
    assert "\n" not in str(info.value)
    assert len(seen) == 4 and (client.stats.retries, client.stats.failures) == (3, 1)
    assert (client.stats.instances_sent, client.stats.bytes_sent, client.stats.round_trip_s) == (0, 0, 0.0)


def test_features_are_sent_as_given():
    client, seen = mock_client([ok(3, classes=5)], retries=0)
    features = torch.arange(3 * 16, dtype=torch.float64).reshape(3, 16)   # model A's F, not an image
    assert client(features).shape == (3, 5)
    assert json.loads(seen[0].content) == {"inputs": features.float().tolist()}
    assert seen[0].headers["content-type"] == "application/json"


def test_parse_logits():
    assert parse_logits(b'{"predictions": [[1, 2], [3, 4]]}', 2).dtype == torch.float32
    with pytest.raises(ValueError, match="not logits"):
        parse_logits(b'{"predictions": [["a"]]}', 1)
