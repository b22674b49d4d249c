"""The cloud model server's command line: MEANet's cloud model served by `mlflow models serve` until Ctrl-C.

    python -m pipeline.cloud --model models/meanet/cloud --port 5001    # = edgeflux serve-cloud ...

The server itself (start, readiness, stop) is edgeflux.meanet.server.ModelServer.
"""
from __future__ import annotations

import argparse

from edgeflux.meanet.server import CloudServerError, ModelServer
from pipeline import cli_logging


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve MEANet's cloud model (an MLflow model: the meanet_cloud "
                                     "stage's models/meanet/cloud) over HTTP with MLflow's model server, until "
                                     "Ctrl-C; devices POST instances to /invocations.")
    parser.add_argument("--model", default="models/meanet/cloud",
                        help="an MLflow model directory or URI (default: the meanet_cloud stage's models/meanet/cloud)")
    parser.add_argument("--port", type=int, default=5001, help="port to listen on (default: 5001; 0: a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback; devices reach it through the reverse proxy "
                             "of docs/cli.md, Security: the model server has no authentication of its own)")
    parser.add_argument("--ready-timeout-s", type=float, default=120.0,
                        help="seconds to wait for the server to answer /ping (default: 120)")
    parser.add_argument("--log", default=None, help="the server's output goes here (default: a temp file)")
    args = parser.parse_args()
    cli_logging()
    try:
        with ModelServer(args.model, args.port or None, args.host, args.ready_timeout_s, args.log) as server:
            print(f"serving {args.model} on {server.url} (POST /invocations); Ctrl-C stops it")
            server.process.wait()
            raise CloudServerError(f"the model server exited with code {server.process.returncode} "
                                   f"({server.last_log_line()}): see {server.log_path}")
    except CloudServerError as exc:
        parser.exit(1, f"error: {exc}\n")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
