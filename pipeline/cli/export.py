"""`edgeflux export`: one trained model exported again (ONNX + TorchScript or torch.export), checked, into a folder."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import RAW, wrap

EXPORT_EXAMPLES = """\
examples:
  edgeflux export finetune-mobiletl              # models/export/finetune-mobiletl.{onnx,ts,json}
  edgeflux export train_bp --exporter dynamo --out /tmp/ship   # ONNX + torch.export's .pt2, elsewhere
  edgeflux export --list                         # the models the params train

The export stage (`dvc repro export`) exports every model and registers each in MLflow; this re-exports
one, e.g. with the other exporter, without touching the stage's outputs when --out is elsewhere.
"""


def cmd_export(args: argparse.Namespace) -> int:
    from edgeflux.config import load_params
    from stages.export import OUT, export_one, trained_models

    params = load_params(args.params)
    if args.list or not args.name:
        print("\n".join(trained_models(params)))
        return 0
    out = Path(args.out) if args.out else OUT
    checks = export_one(args.name, params, out, args.exporter)
    print(f"{out / args.name}.onnx: max |Δlogit| {checks['onnx_max_abs_diff']:.2g} in onnxruntime; "
          f"{checks['exporter']} file: {checks['trace_max_abs_diff']:.2g} (tolerance {checks['tolerance']:g}, "
          f"on the test split's first {checks['batch']} images); {out / args.name}.json says how to feed it")
    return 0


def add_export(sub) -> None:
    p = sub.add_parser("export", help="export one trained model as ONNX + TorchScript/torch.export, checked",
                       description=wrap("Export one trained model (from its file under models/) as ONNX and "
                                        "TorchScript or torch.export files, each checked against the PyTorch "
                                        "model in onnxruntime / PyTorch, with a JSON that says how to feed it."),
                       epilog=EXPORT_EXAMPLES, formatter_class=RAW)
    p.add_argument("name", nargs="?", help="the model: train_bp, neuroflux_exit, finetune-<method>, meanet_edge")
    p.add_argument("--exporter", choices=("torchscript", "dynamo"), default=None,
                   help="the file beside the ONNX: torchscript (.ts) or dynamo (torch.export's .pt2); "
                        "default: params.yaml's export.exporter")
    p.add_argument("--out", help="the folder to write to (default: models/export, the stage's output)")
    p.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    p.add_argument("--list", action="store_true", help="list the models the params train, and exit")
    p.set_defaults(func=cmd_export)
