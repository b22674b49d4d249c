"""`edgeflux plan`: what a memory budget buys, measured: every candidate method's step under it, and its speed."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import RAW, UsageError, wrap
from .run import BUDGET_KEY, _budget

PLAN_EXAMPLES = """\
examples:
  edgeflux plan                                  # the params' budget, both stages, on data/prepared
  edgeflux plan --budget 16MB --stage train_bp   # from scratch only, at 16 MB
  edgeflux plan --preset realistic-128 --budget 256MB --stage finetune
  edgeflux plan --model resnet18-w0.25 --json plan.json

Each row's batch and peak are measured as the run measures them, its samples/s timed on a few batches of the
training data (training only: evaluation excluded), its epoch time predicted from that. `method: auto` in
train_bp (or `auto` in finetune.methods) trains with the marked row: the fastest that trains every parameter.
"""
STAGES = ("train_bp", "finetune")


def load_checked_params(args: argparse.Namespace) -> dict:
    """params.yaml with the preset's and --budget's values, validated."""
    import yaml

    from edgeflux.config import validate
    from edgeflux.presets import load_preset, merge

    raw = yaml.safe_load(Path(args.params).read_text()) or {}
    overrides = dict(load_preset(args.preset).params) if args.preset else {}
    if args.budget:
        overrides[BUDGET_KEY] = args.budget
    if args.model:
        key = "finetune.model" if args.stage == "finetune" else "train_bp.model"
        overrides[key] = args.model if args.stage == "finetune" else _model_spec(args.model)
    return validate(merge(raw, overrides), where=f"{args.params} + overrides")


def _model_spec(text: str) -> dict:
    """'vgg11-w0.25' or 'vgg11' (the zoo) or 'tv-resnet18' (torchvision's) as a train_bp.model mapping."""
    if text.startswith("tv-"):
        return {"arch": "torchvision", "name": text[3:]}
    name, _, width = text.partition("-w")
    return {"name": name, **({"width": float(width)} if width else {})}


def plan_rows(params, stage: str, steps: int) -> list:
    from edgeflux.artifacts import load_model
    from edgeflux.data import load_prepared, tensors
    from edgeflux.models import build_model
    from edgeflux.plan import plan_finetune, plan_neuroflux, plan_training
    from edgeflux.train import resolve_device

    data = load_prepared(Path("data/prepared"))
    if stage == "train_bp":
        p = params.train_bp
        train = tensors(data, "target_train", limit=p.max_train_samples)
        spec = p.model.build_args(len(data.classes), train[0].shape[1], train[0].shape[-1], p.seed)
        device = resolve_device(p.device)
        rows = plan_training(build_model(**spec, pretrained_path=p.model.weights_path()), train, p, steps=steps,
                             device=device)
        nf = params.neuroflux.model_copy(update={"budget": p.budget, "max_batch": p.max_batch})
        return rows + [plan_neuroflux(spec, train, nf, steps=steps, device=device)]
    p = params.finetune
    source = Path("models/pretrained") / f"{p.model}.pt"
    if not source.exists():
        raise UsageError(f"{source}: no pretrained model to plan fine-tuning on; run `edgeflux run pretrain` first")
    model, _ = load_model(source)
    return plan_finetune(model, tensors(data, "target_train", limit=p.max_train_samples), p, steps=steps,
                         device=resolve_device(p.device))


def print_table(stage: str, budget: int | None, rows: list, chosen: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from edgeflux.memory.sizes import budget_at_least, format_bytes

    table = Table(title=f"{stage} under {format_bytes(budget)}: measured step peak, timed samples/s", title_justify="left")
    for name, justify in (("method", "left"), ("fits", "left"), ("batch", "right"), ("peak", "right"),
                          ("samples/s", "right"), ("epoch s", "right"), ("trains", "right"), ("trades", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for r in rows:
        fits = "yes" if r.feasible else f"no: needs {budget_at_least(r.min_budget_bytes)}"
        batch = "-" if r.batch is None else (f"{r.batch}x{r.samples_per_update // r.batch}"
                                             if r.samples_per_update and r.samples_per_update > r.batch else str(r.batch))
        table.add_row(r.label + ("  <- auto" if r.method == chosen else ""), fits, batch,
                      format_bytes(r.peak_bytes) if r.peak_bytes else "-",
                      f"{r.samples_per_s:.0f}" if r.samples_per_s else "-", f"{r.epoch_s:.1f}" if r.epoch_s else "-",
                      f"{r.trainable_params:,}", r.trades)
    Console(width=160).print(table)


def cmd_plan(args: argparse.Namespace) -> int:
    from edgeflux.plan import NoFeasibleMethodError, fastest

    params = load_checked_params(args)
    out = {}
    for stage in STAGES if args.stage == "all" else (args.stage,):
        section = getattr(params, stage)
        if section is None:
            continue
        rows = plan_rows(params, stage, args.steps)
        try:
            chosen = fastest(rows).method
        except NoFeasibleMethodError as exc:
            chosen = None
            print(f"{stage}: {exc}")
        print_table(stage, section.budget, rows, chosen)
        out[stage] = {"budget_bytes": section.budget, "auto": chosen, "rows": [r.to_dict() for r in rows]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="what a budget buys: every method's measured peak, batch and speed",
                       description=wrap("For the prepared data and every candidate method (plain backprop, BitTrain, "
                                        "the memory tricks, NeuroFlux; the fine-tuning methods, MobileTL, "
                                        "ElasticTrainer), measure the training step's peak at the largest batch "
                                        "that fits the budget and time a few steps: one table per stage."),
                       epilog=PLAN_EXAMPLES, formatter_class=RAW)
    p.add_argument("--budget", type=_budget, metavar="SIZE", help=f"the budget ({BUDGET_KEY}); default: the params'")
    p.add_argument("--preset", metavar="NAME", help="a device preset's params first (presets/NAME.yaml)")
    p.add_argument("--stage", choices=(*STAGES, "all"), default="all", help="which stage's candidates (default: all)")
    p.add_argument("--model", metavar="M", help="the model: train_bp: a zoo name with its width (vgg11-w0.25) or "
                                                "tv-<torchvision name>; finetune: a key of pretrain.models")
    p.add_argument("--steps", type=int, default=4, help="timed steps per candidate, after one warm-up (default: 4)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    p.set_defaults(func=cmd_plan)
