"""`edgeflux plan`: what a memory budget buys, measured: every candidate method's step under it, and its speed."""
from __future__ import annotations

import argparse
import csv
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
  edgeflux plan --target-acc 0.85                # and the seconds to 85% validation accuracy (an estimate)

Each row's batch and peak are measured as the run measures them, its samples/s timed on a few batches of the
training data (training only: evaluation excluded), its epoch time predicted from that. --target-acc: the
epochs the stage's last run took to reach that validation accuracy (its curve, plots/...csv; in finetune each
method's own) times the row's epoch time: an estimate, labelled so, since another batch or method may need
more or fewer epochs than the run that made the curve. `method: auto` in
train_bp (or `auto` in finetune.methods) trains with the marked row: the fastest that trains every parameter.
The rows are stored in .edgeflux/plans; `auto` reuses them (same model, sample shape, options and machine)
instead of planning again, so running this command re-times the plan the next run trains by.
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


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: a whole number of steps, 1 or more")
    return int(text)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: an accuracy between 0 and 1, e.g. 0.85")
    return value


def _model_spec(text: str) -> dict:
    """'vgg11-w0.25' or 'vgg11' (the zoo) or 'tv-resnet18' (torchvision's) as a train_bp.model mapping."""
    if text.startswith("tv-"):
        return {"arch": "torchvision", "name": text[3:]}
    name, _, width = text.partition("-w")
    return {"name": name, **({"width": float(width)} if width else {})}


def plan_rows(params, stage: str, steps: int | None) -> list:
    from edgeflux.artifacts import load_model
    from edgeflux.data import load_prepared, tensors
    from edgeflux.models import build_model
    from edgeflux.plan import STEPS, PlanCache, plan_finetune, plan_key, plan_neuroflux, plan_training
    from edgeflux.train import resolve_device

    steps = STEPS if steps is None else steps
    data = load_prepared(Path("data/prepared"))
    if stage == "train_bp":
        p = params.train_bp
        train = tensors(data, "target_train", limit=p.max_train_samples)
        spec = p.model.build_args(len(data.classes), train[0].shape[1], train[0].shape[-1], p.seed)
        device = resolve_device(p.device)
        model = build_model(**spec, pretrained_path=p.model.weights_path())
        rows = plan_training(model, train, p, steps=steps, device=device,
                             cache=PlanCache(plan_key(model, train, p, device), fresh=True))
        nf = params.neuroflux.model_copy(update={"budget": p.budget, "max_batch": p.max_batch})
        return rows + [plan_neuroflux(spec, train, nf, steps=steps, device=device)]
    p = params.finetune
    source = Path("models/pretrained") / f"{p.model}.pt"
    if not source.exists():
        raise UsageError(f"{source}: no pretrained model to plan fine-tuning on; run `edgeflux run pretrain` first")
    model, _ = load_model(source)
    train, device = tensors(data, "target_train", limit=p.max_train_samples), resolve_device(p.device)
    return plan_finetune(model, train, p, steps=steps, device=device,
                         cache=PlanCache(plan_key(model, train, p, device), fresh=True))


def curve_of(stage: str, method: str) -> Path | None:
    """The accuracy curve of the stage's last run whose epochs estimate ``method``'s (None: none would); in
    finetune the method's own, or auto's when auto chose that method."""
    if stage != "finetune":
        return None if method == "neuroflux" else Path("plots/train_bp.csv")
    own, auto = Path("plots/finetune") / f"{method}.csv", Path("details/finetune/auto.json")
    if not own.exists() and auto.exists() and json.loads(auto.read_text()).get("method") == method:
        return Path("plots/finetune/auto.csv")
    return own


def epochs_to(curve: Path | None, target: float) -> float | None:
    """The (fractional) epochs after which the curve's validation accuracy first reached ``target``; None when it
    never did or there is no curve (the stage has not run)."""
    if curve is None or not curve.exists():
        return None
    with curve.open(newline="") as f:
        return next((float(r["epoch"]) for r in csv.DictReader(f) if float(r["val_acc"]) >= target), None)


def target_estimates(stage: str, rows: list, target: float) -> dict[str, dict]:
    """Per row: the epochs its curve took to ``target`` and those epochs at the row's measured epoch time."""
    out = {}
    for r in rows:
        curve = curve_of(stage, r.method)
        epochs = epochs_to(curve, target)
        out[r.method] = {"curve": str(curve) if curve else None, "epochs": epochs,
                         "seconds": epochs * r.epoch_s if epochs is not None and r.epoch_s else None}
    return out


def print_table(stage: str, budget: int | None, rows: list, chosen: str | None,
                estimates: dict[str, dict] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from edgeflux.memory.sizes import budget_at_least, format_bytes
    from edgeflux.plan.core import CONTENDS, ROUNDS

    table = Table(title=f"{stage} under {format_bytes(budget)}: measured step peak, timed samples/s", title_justify="left")
    for name, justify in (("method", "left"), ("fits", "left"), ("batch", "right"), ("peak", "right"),
                          ("samples/s", "right"), ("epoch s", "right"), ("trains", "right"), ("trades", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    if estimates is not None:
        table.add_column("s to target (est.)", justify="right")
    for r in rows:
        fits = "yes" if r.feasible else f"no: needs {budget_at_least(r.min_budget_bytes)}"
        batch = "-" if r.batch is None else (f"{r.batch}x{r.samples_per_update // r.batch}"
                                             if r.samples_per_update and r.samples_per_update > r.batch else str(r.batch))
        table.add_row(r.label + ("  <- auto" if r.method == chosen else ""), fits, batch,
                      format_bytes(r.peak_bytes) if r.peak_bytes else "-",
                      f"{r.samples_per_s:.0f}{'*' * _once(r, ROUNDS)}" if r.samples_per_s else "-",
                      f"{r.epoch_s:.1f}" if r.epoch_s else "-",
                      f"{r.trainable_params:,}", r.trades,
                      *([_estimate(estimates[r.method])] if estimates is not None else []))
    Console(width=160).print(table)
    if any(_once(r, ROUNDS) for r in rows):
        print(f"* timed in fewer rounds than {ROUNDS}: below {CONTENDS:.0%} of the fastest full method's samples/s in "
              "each round before, out of the running")


def _once(row, rounds: int) -> bool:
    return row.rounds is not None and row.rounds < rounds


def _estimate(e: dict) -> str:
    if e["epochs"] is not None and e["seconds"] is None:    # reached on the curve; the row cannot train here
        return "-"
    if e["seconds"] is not None:
        return f"{e['seconds']:.0f} ({e['epochs']:.2g} ep)"
    return "no curve" if e["curve"] is None or not Path(e["curve"]).exists() else "not reached"


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
        estimates = target_estimates(stage, rows, args.target_acc) if args.target_acc else None
        print_table(stage, section.budget, rows, chosen, estimates)
        if estimates is not None:
            curves = sorted({e["curve"] for e in estimates.values() if e["epochs"] is not None})
            print(f"s to target (est.): the epochs the stage's last run took to {args.target_acc:.0%} validation "
                  f"accuracy ({', '.join(curves) or 'no curve reached it'}, at that run's params) x each row's "
                  f"epoch s; no curve: run the stage once with that method (`edgeflux run {stage}`)")
        out[stage] = {"budget_bytes": section.budget, "auto": chosen, "rows": [r.to_dict() for r in rows],
                      **({"target_acc": args.target_acc, "target_estimates": estimates} if estimates else {})}
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
    p.add_argument("--steps", type=_positive, help="timed steps per candidate and round (at least 64 samples), after a "
                                             "warm-up step; three rounds take the candidates in turn, the median "
                                             "counts, the clearly slower out after the first (default: "
                                             "edgeflux.plan.STEPS)")
    p.add_argument("--target-acc", type=_fraction, metavar="A", help="also estimate each row's seconds to validation "
                                                                     "accuracy A (0-1) from the stage's last curve")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    p.set_defaults(func=cmd_plan)
