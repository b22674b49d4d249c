"""`edgeflux servers`, `worker` and `serve-cloud`: the command lines of pipeline.servers and pipeline.cloud,
forwarded under this command's name."""
from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import redirect_stdout
from io import StringIO
from typing import Any


def _help_of(main: Callable[[], Any], rename: tuple[str, str], epilog: str) -> int:
    """Another module's --help, under this command's name, with this command's examples after it."""
    buffer = StringIO()
    with redirect_stdout(buffer):
        try:
            main()
        except SystemExit:
            pass
    text, (old, new) = buffer.getvalue(), rename
    if old:   # the usage's continuation lines are aligned under the old name: shift them by the difference
        usage, _, rest = text.partition("\n\n")
        shift = len(old) - len(new)
        usage = "\n".join(ln[shift:] if ln.startswith(" " * (shift + 1)) else ln for ln in usage.splitlines())
        text = f"{usage}\n\n{rest}".replace(old, new)
    print(text.rstrip() + "\n\n" + epilog.strip())
    return 0


def forward_servers(command: str, name: str, argv: list[str], epilog: str) -> int:
    """`edgeflux <name> ARGS` is `python -m pipeline.servers <command> ARGS` (its parser, its run_worker)."""
    from pipeline import servers

    if {"-h", "--help"} & set(argv):
        return _help_of(lambda: servers.main([command, "-h"]),
                        (f"python -m pipeline.servers {command}", f"edgeflux {name}"), epilog)
    return servers.main([command, *argv])


def forward_cloud(argv: list[str]) -> int:
    """`edgeflux serve-cloud ARGS` is `python -m pipeline.cloud ARGS`. Its main() parses sys.argv, so that is
    what it gets (argparse's prog is sys.argv[0]: the usage then reads `edgeflux serve-cloud`)."""
    from pipeline import cloud

    saved = sys.argv
    sys.argv = ["edgeflux serve-cloud", *argv]
    try:
        if {"-h", "--help"} & set(argv):
            return _help_of(cloud.main, ("", ""), SERVE_CLOUD_EXAMPLES)
        cloud.main()
        return 0
    finally:
        sys.argv = saved


SERVERS_EXAMPLES = """\
examples:
  edgeflux servers                               # on loopback: Prefect :4200, MLflow :5000
  edgeflux servers --host 0.0.0.0 --public-host cloud.lan --init-auth --deploy
                                                 # for devices: a password (made once), deployments created
"""
WORKER_EXAMPLES = """\
examples:
  edgeflux worker --pool pi --device-id pi-01 --api-url http://cloud.lan:4200/api \\
      --tracking-uri http://cloud.lan:5000
  PREFECT_API_URL=http://cloud.lan:4200/api edgeflux worker --pool jetson
"""
SERVE_CLOUD_EXAMPLES = """\
examples:
  edgeflux serve-cloud                           # models/meanet/cloud on 127.0.0.1:5001 until Ctrl-C
  edgeflux serve-cloud --port 5001               # devices: through the reverse proxy of docs/cli.md (Security)
"""


FORWARDED = {   # name: (one-line help, how it runs)
    "servers": ("the cloud host's Prefect and MLflow servers (pipeline.servers cloud)",
                lambda argv: forward_servers("cloud", "servers", argv, SERVERS_EXAMPLES)),
    "worker": ("a Prefect worker for a device pool: --pool pi|jetson|cloud (pipeline.servers worker)",
               lambda argv: forward_servers("worker", "worker", argv, WORKER_EXAMPLES)),
    "serve-cloud": ("MEANet's cloud model server: MLflow's model server on models/meanet/cloud (pipeline.cloud)",
                    forward_cloud),
}
