"""edgeflux.plan and `edgeflux plan`: every candidate measured under the budget as its run measures it, the
smallest feasible budget of those that do not fit, and what method: auto chooses."""
import json

import pytest
import torch

from edgeflux.backprop import fit_model_batch
from edgeflux.config import MemoryOptions, TrainBPParams
from edgeflux.data import save_prepared, tensors
from edgeflux.memory import BudgetTooSmallError
from edgeflux.models import build_model
from edgeflux.plan import NoFeasibleMethodError, PlanCache, PlanRow, fastest, plan_key, plan_training
from edgeflux.train import TrainRun
from edgeflux.tricks import TrickOptions
from edgeflux.tricks.options import backprop_label, backprop_options, parse_backprop

MODEL = {"name": "vgg11", "width": 0.25}


def section(budget: str, **extra) -> TrainBPParams:
    return TrainBPParams.model_validate({"model": MODEL, "budget": budget, "max_batch": 64, "lr": 0.05, **extra})


def test_a_budget_between_batch_one_of_backprop_and_of_the_step_in_backward(mnist_subset):
    """Batch 1 of plain backprop holds every gradient; the step in backward holds one at a time. A budget between
    the two: backprop is infeasible (its smallest budget is the measured batch-1 peak), the step in backward fits,
    and auto chooses it."""
    train = tensors(mnist_subset, "target_train", limit=256)
    model = build_model(**MODEL, seed=0)
    p = section("8MB")
    need = {}
    for name, tricks in (("plain", TrickOptions()), ("fused", TrickOptions(fused_step=True))):
        with pytest.raises(BudgetTooSmallError) as e:
            fit_model_batch(model, train, p, MemoryOptions(budget="1MB"), TrainRun(tricks=tricks))
        need[name] = e.value.min_feasible_bytes
    assert need["fused"] < need["plain"]
    budget = f"{(need['fused'] + need['plain']) // 2}B"
    rows = plan_training(model, train, section(budget), candidates=("backprop", "backprop-fused_step"), steps=2)
    plain, fused = rows
    assert not plain.feasible and plain.min_budget_bytes == need["plain"] and plain.batch is None
    assert fused.feasible and fused.peak_bytes <= int(budget[:-1]) and fused.batch >= 1
    assert fused.samples_per_s > 0 and fused.epoch_s == pytest.approx(256 / fused.samples_per_s)
    assert fastest(rows).method == "backprop-fused_step"


def test_each_row_is_the_batch_its_run_trains_at(mnist_subset):
    train = tensors(mnist_subset, "target_train", limit=256)
    model = build_model(**MODEL, seed=0)
    p = section("12MB", tricks={"effective_batch": 64})
    rows = plan_training(model, train, p, candidates=("backprop", "backprop-checkpoint", "backprop-accumulate"),
                         steps=1)
    for row in rows:
        o = backprop_options(row.method, p)
        batch, _, memory = fit_model_batch(model, train, o, o, TrainRun(context=o.bittrain.context, tricks=o.tricks))
        assert (row.batch, row.peak_bytes) == (batch, memory.peak_bytes), row.method
    accumulate = rows[2]
    assert accumulate.samples_per_update == accumulate.batch * (64 // accumulate.batch)


def test_a_batch_hint_is_confirmed_in_three_measurements_or_searched_as_without_it(mnist_subset):
    """method: auto hands the run the plan's batch (TrainRun.batch_hint): when it is the largest that fits (it
    fits, one more does not), batch 1, it and one more are all the search measures; any other hint (smaller,
    over the budget, over max_batch) ends where the search without it ends, the budget's record intact."""
    train = tensors(mnist_subset, "target_train", limit=256)
    model = build_model(**MODEL, seed=0)
    p = section("12MB")
    largest, searched, _ = fit_model_batch(model, train, p, p, TrainRun())
    assert 2 < largest < p.max_batch
    for hint in (largest // 2, p.max_batch, 10 * p.max_batch):   # not the largest, or over the budget
        batch, fit, memory = fit_model_batch(model, train, p, p, TrainRun(batch_hint=hint))
        assert batch == largest and memory.peak_bytes <= 12_000_000 and fit.budget_bytes == 12_000_000
    batch, fit, memory = fit_model_batch(model, train, p, p, TrainRun(batch_hint=largest))
    assert batch == largest and [b for b, _ in fit.measurements] == [1, largest, largest + 1]
    assert fit.min_feasible_bytes == searched.min_feasible_bytes and memory.peak_bytes <= 12_000_000


def test_the_candidates_are_timed_in_turn_at_their_median_round(mnist_subset, monkeypatch):
    """Each candidate is timed once per round, the candidates in turn (the machine's drift falls on all alike), and
    its row holds its median round: one slow round (a preempted core) does not carry it."""
    import edgeflux.plan.core as core

    train = tensors(mnist_subset, "target_train", limit=256)
    timed, rates = [], {False: iter([150.0, 10.0, 90.0]), True: iter([200.0, 190.0, 20.0])}   # by fused_step
    monkeypatch.setattr(core, "time_step", lambda model, data, opts, batch, run, steps:
                        timed.append(opts.tricks.fused_step) or next(rates[opts.tricks.fused_step]))
    rows = plan_training(build_model(**MODEL, seed=0), train, section("12MB"),
                         candidates=("backprop", "backprop-fused_step"))
    assert core.ROUNDS == 3 and timed == [False, True, True, False, False, True]   # each round one further along
    assert [r.samples_per_s for r in rows] == [90.0, 190.0] and rows[0].epoch_s == pytest.approx(256 / 90)
    assert [r.rounds for r in rows] == [3, 3]


def test_after_two_rounds_only_the_candidates_still_in_the_running_are_timed(monkeypatch):
    """A candidate auto could choose that two rounds found below CONTENDS of the fastest such candidate is timed no
    more (its row keeps those rounds); one stalled round does not put it out; one auto would not choose is timed
    every round (the user weighs its row)."""
    import edgeflux.plan.core as core

    rounds = {"a": [100.0] * 2, "b": [200.0] * 3, "c": [20.0, 180.0, 180.0],   # c: a stall, then as fast as b
              "d": [500.0] * 3, "e": [50.0] * 3, "f": [139.0] * 2}             # d, e train less; f: under 0.7 x b
    monkeypatch.setattr(core, "size_one", lambda spec, c, train: _row(spec, None, full=spec in "abcf"))
    rates, timed = {s: iter(r) for s, r in rounds.items()}, []
    monkeypatch.setattr(core, "time_step", lambda spec, *a: timed.append(spec) or next(rates[spec]))
    rows = core.plan_rows("abcdef", lambda spec: core.Candidate(spec, spec, None, None), ([0] * 80, [0] * 80), 3)
    assert (core.CONTENDS, core.DECIDES) == (0.7, 2) and timed == [*"abcdef", *"bcdefa", *"debc"]
    assert [r.rounds for r in rows] == [2, 3, 3, 3, 3, 2]
    assert [r.samples_per_s for r in rows] == [100, 200, 180, 500, 50, 139] and rows[0].epoch_s == pytest.approx(0.8)


def test_the_plans_table_marks_the_rows_timed_in_fewer_rounds(capsys):
    """`edgeflux plan`'s table: a row out of the running after two rounds is marked and the mark explained; a plan
    whose rows were all timed every round has neither."""
    from dataclasses import replace

    from pipeline.cli.plan import print_table

    rows = [replace(_row("backprop", 100.0), rounds=3), replace(_row("backprop-accumulate", 60.0), rounds=2)]
    print_table("train_bp", 8_000_000, rows, "backprop")
    out = capsys.readouterr().out
    assert "60*" in out and "100*" not in out and "* timed in fewer rounds than 3: below 70%" in out
    print_table("train_bp", 8_000_000, rows[:1], "backprop")
    assert "*" not in capsys.readouterr().out


def test_a_partly_stored_plan_sizes_and_times_only_what_it_lacks(mnist_subset, monkeypatch, tmp_path):
    """A stored plan that holds some candidates: only the others are sized and timed, an infeasible one is stored
    as soon as it is sized, and the rows come back in the candidates' order, the stored ones scaled to the data."""
    import edgeflux.plan.core as core

    train, model, p = tensors(mnist_subset, "target_train", limit=256), build_model(**MODEL, seed=0), section("12MB")
    cache = PlanCache(plan_key(model, train, p, "cpu"), root=tmp_path)
    monkeypatch.setattr(core, "time_step", lambda *a: 100.0)
    [stored] = plan_training(model, train, p, candidates=("backprop-fused_step",), cache=cache)
    sized, size_one = [], core.size_one
    monkeypatch.setattr(core, "size_one", lambda spec, *a: sized.append(spec) or size_one(spec, *a))
    monkeypatch.setattr(core, "time_step", lambda model, data, opts, *a: pytest.fail("timed a candidate") if
                        opts.tricks.fused_step else 50.0)
    more = tensors(mnist_subset, "target_train", limit=512)
    cache = PlanCache(plan_key(model, more, p, "cpu"), root=tmp_path)
    rows = plan_training(model, more, p, candidates=("backprop", "backprop-fused_step"), cache=cache)
    assert sized == ["backprop"] and [r.method for r in rows] == ["backprop", "backprop-fused_step"]
    assert rows[0].samples_per_s == 50.0 and rows[1].epoch_s == pytest.approx(2 * stored.epoch_s)
    monkeypatch.setattr(core, "time_step", lambda *a: pytest.fail("timed an infeasible candidate"))
    monkeypatch.setattr(core, "ROUNDS", 0)   # a plan cut short after sizing: the infeasible row is stored already
    cut = PlanCache(plan_key(model, train, section("1MB"), "cpu"), root=tmp_path)
    plan_training(model, train, section("1MB"), candidates=("backprop",), cache=cut)
    assert not PlanCache(cut.key, root=tmp_path).get("backprop").feasible


def test_a_timing_window_is_whole_updates_of_at_least_64_samples_after_the_warm_up(mnist_subset, monkeypatch):
    """A few small batches last milliseconds, less than the machine's jitter: the window grows to
    WINDOW_SAMPLES samples and ``steps`` steps, in whole groups (accumulation's micro-batches of one update), after
    WARMUP groups."""
    import edgeflux.plan.core as core

    train = tensors(mnist_subset, "target_train", limit=256)
    model, fit_step, seen = build_model(**MODEL, seed=0), core.fit_step, []

    class Counted:   # the step the plan times, counting the samples of each call
        def __init__(self, step):
            self.step, self.accumulation = step, step.accumulation

        def __call__(self, x, y):
            seen.append(len(y))
            return self.step(x, y)
    monkeypatch.setattr(core, "fit_step", lambda *a, **k: Counted(fit_step(*a, **k)))
    assert core.WARMUP == 1
    for spec, batch, steps, calls in (("backprop", 5, 1, [5] * (1 + 13)),    # 13 x 5 = 65 samples: the first >= 64
                                      ("backprop", 40, 3, [40] * (1 + 3)),     # 3 steps hold 120 already
                                      ("backprop-accumulate", 8, 1, [8] * (4 * (1 + 2))),   # updates of 4 x 8
                                      ("backprop-accumulate", 8, 9, [8] * (4 * (1 + 3)))):  # 9 steps: 3 updates
        o = backprop_options(spec, section("12MB", tricks={"effective_batch": 32}))
        seen.clear()
        per_s = core.time_step(model, train, o, batch, TrainRun(tricks=o.tricks), steps)
        assert seen == calls and per_s > 0, spec
    # 100 samples an epoch at micro-batch 8: 13 micro-batches, groups of 4, 4, 4 and 1 (a group never spans two
    # epochs); a group of warm-up, then 32 + 32 + 4 samples (under a window of 70), then the next epoch's first
    # group closes the window
    o = backprop_options("backprop-accumulate", section("12MB", tricks={"effective_batch": 32}))
    monkeypatch.setattr(core, "WINDOW_SAMPLES", 70)
    seen.clear()
    core.time_step(model, tensors(mnist_subset, "target_train", limit=100), o, 8, TrainRun(tricks=o.tricks), 1)
    assert seen == [8] * 12 + [4] + [8] * 4


def _row(method: str, per_s: float | None, feasible: bool = True, full: bool = True, need: int | None = None,
         update: int = 8):
    return PlanRow(method, method, feasible, 8 if feasible else None, update if feasible else None,
                   1 if feasible else None, need, per_s, 1.0, 10, "-", full)


def test_auto_is_the_fastest_full_method_and_the_simplest_within_timing_noise():
    rows = [_row("backprop", 100), _row("backprop-checkpoint", 103), _row("backprop-fused_step", 130),
            _row("ft_bias", 500, full=False)]
    assert fastest(rows).method == "backprop-fused_step"            # 30% faster: chosen; ft_bias trains less
    rows[2] = _row("backprop-fused_step", 104)
    assert fastest(rows).method == "backprop"                        # all within 5%: the plain one
    rows.append(_row("backprop-accumulate", 104.5, update=32))
    assert fastest(rows).method == "backprop"                        # as fast: the larger update does not count
    rows[0] = _row("backprop", 90)
    assert fastest(rows).method == "backprop-accumulate"             # 10% slower: plain is not as fast; of the
    rows[-1] = _row("backprop-accumulate", 103, update=32)           # rest within 5%, the fastest with one modifier
    assert fastest(rows).method == "backprop-fused_step"
    with pytest.raises(NoFeasibleMethodError, match=r"smallest budget any fits is 2\.0MiB: raise device.budget to "
                                                    r"it, or train block by block with NeuroFlux"):
        fastest([_row("backprop", None, feasible=False, need=2_000_000), _row("ft_bias", 500, full=False)])
    with pytest.raises(NoFeasibleMethodError, match="or fine-tune less: finetune.methods mobiletl or ft_bias"):
        fastest([_row("ft_all", None, feasible=False, need=2_000_000), _row("ft_bias", 500, full=False)])


def test_method_names_of_train_bp():
    assert parse_backprop("backprop-bittrain-checkpoint") == (True, ("checkpoint",))
    assert backprop_label("backprop-fused_step-checkpoint") == "backprop + checkpointing + step in backward"
    for bad in ("backprop-fused", "bp", "backprop-checkpoint-checkpoint"):
        with pytest.raises(ValueError, match="auto, or backprop optionally followed by -bittrain"):
            parse_backprop(bad)
    with pytest.raises(ValueError, match="train_bp method 'backprop-x' is unknown"):
        section("8MB", method="backprop-x")
    assert section("8MB", method="auto").method == "auto"


def test_the_plan_command_prints_and_writes_every_stage(mnist_subset, tmp_path, monkeypatch, capsys):
    """`edgeflux plan` on a project's prepared data: a row per candidate, the auto choice marked, JSON written."""
    from pathlib import Path

    from pipeline import cli

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((repo / "params.yaml").read_text())
    save_prepared(mnist_subset, tmp_path / "data/prepared")
    monkeypatch.setattr("edgeflux.plan.core.BACKPROP_CANDIDATES", ("backprop", "backprop-fused_step"))
    # the stage's last run: its curve reached 80% validation accuracy half-way through its first epoch
    Path("plots").mkdir()
    Path("plots/train_bp.csv").write_text("step,epoch,time_s,cpu_s,train_loss,val_acc\n"
                                          "5,0.25,1.0,2.0,1.2,0.70\n10,0.5,2.0,4.0,0.8,0.81\n20,1.0,4.0,8.0,0.5,0.85\n")
    torch.manual_seed(0)
    assert cli.main(["plan", "--stage", "train_bp", "--budget", "16MB", "--steps", "1", "--json", "plan.json",
                     "--target-acc", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "train_bp under 15.3 MiB" in out and "<- auto" in out and "NeuroFlux" in out and "(est.)" in out
    plan = json.loads((tmp_path / "plan.json").read_text())["train_bp"]
    assert plan["budget_bytes"] == 16_000_000
    assert [r["method"] for r in plan["rows"]] == ["backprop", "backprop-fused_step", "neuroflux"]
    assert plan["auto"] in ("backprop", "backprop-fused_step")
    assert all(r["peak_bytes"] <= 16_000_000 for r in plan["rows"] if r["feasible"])
    [stored] = Path(".edgeflux/plans").glob("*.json")       # what method: auto reuses: the candidates it runs
    assert [r["method"] for r in json.loads(stored.read_text())["rows"]] == ["backprop", "backprop-fused_step"]
    estimates = plan["target_estimates"]
    for r in plan["rows"][:2]:
        assert estimates[r["method"]]["seconds"] == pytest.approx(0.5 * r["epoch_s"])
    assert estimates["neuroflux"]["seconds"] is None
    from pipeline.cli.plan import epochs_to
    assert epochs_to(Path("plots/train_bp.csv"), 0.9) is None and epochs_to(Path("plots/train_bp.csv"), 0.85) == 1.0


def test_auto_in_the_stages_trains_with_the_plans_choice_and_logs_the_plan(mnist_subset, tmp_path, monkeypatch):
    """train_bp's method auto and finetune's auto entry, run as the stages run them (in this process, on a small
    project): each trains with the plan's fastest full candidate, says so in its metrics, and logs the table."""
    import argparse
    from pathlib import Path

    import mlflow
    import yaml

    from edgeflux.artifacts import save_model
    from edgeflux.config import validate
    from stages import finetune as finetune_stage
    from stages import train_bp as train_bp_stage

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    save_prepared(mnist_subset, tmp_path / "data/prepared")
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["device"]["budget"] = "12MB"
    raw["train_bp"].update(method="auto", max_train_samples=256, evals_per_epoch=1)
    raw["finetune"].update(methods=["auto"], max_train_samples=128, evals_per_epoch=1)
    params = validate(raw)
    monkeypatch.setattr("edgeflux.plan.core.BACKPROP_CANDIDATES", ("backprop", "backprop-fused_step"))
    monkeypatch.setattr("edgeflux.plan.core.FINETUNE_FULL", ("ft_all", "ft_all-fused_step"))
    monkeypatch.setattr("edgeflux.plan.FINETUNE_FULL", ("ft_all", "ft_all-fused_step"), raising=False)
    # the plan's last candidate, which the stage would never pick by itself: it must train what the plan chose
    monkeypatch.setattr("edgeflux.plan.core.fastest", lambda rows: rows[-1])
    # the runs start their batch search from the plan's batch: every search's hint, in order
    import edgeflux.backprop
    hints, choose = [], edgeflux.backprop.choose_batch
    monkeypatch.setattr("edgeflux.backprop.choose_batch", lambda *a, **k: hints.append(k.get("hint")) or choose(*a, **k))
    train_bp_stage.main(argparse.Namespace(params="params.yaml"), params)
    spec = dict(name="mobilenet_v2", num_classes=10, in_channels=1, width=0.5, image_size=32, seed=0)
    assert params.finetune.model == "mobilenet_v2-w0.5"
    save_model(Path(f"models/pretrained/{params.finetune.model}.pt"), build_model(**spec), spec)
    finetune_stage.main(argparse.Namespace(params="params.yaml", method="auto"), params)

    client, planned = mlflow.MlflowClient(), []
    for stage, metrics in (("train_bp", "details/train_bp.json"),
                           ("finetune@auto", "details/finetune/auto.json")):
        detail = json.loads(Path(metrics).read_text())
        run = client.search_runs([client.get_experiment_by_name("edgeflux").experiment_id],
                                 f"tags.edgeflux.stage = '{stage}'")[0]
        plan = json.loads(Path(client.download_artifacts(run.info.run_id, "plan.json", str(tmp_path))).read_text())
        assert detail["method"] == plan["auto"] == plan["rows"][-1]["method"] and detail["auto"] is True, stage
        assert detail["method"].endswith("-fused_step"), stage
        assert detail["batch_size"] == plan["rows"][-1]["batch"], stage
        assert [r["method"] for r in plan["rows"]] in (["backprop", "backprop-fused_step"],
                                                        ["ft_all", "ft_all-fused_step"])
        assert detail["peak_mem_bytes"] <= 12_000_000
        planned.append(plan["rows"][-1]["batch"])
    assert [h for h in hints if h is not None] == planned
    # run again, train_bp plans nothing: the stored rows of the same model, data shape, options and machine
    monkeypatch.setattr("edgeflux.plan.core.size_one", lambda *a: pytest.fail("measured a stored candidate"))
    train_bp_stage.main(argparse.Namespace(params="params.yaml"), params)
    run = client.search_runs([client.get_experiment_by_name("edgeflux").experiment_id],
                             "tags.edgeflux.stage = 'train_bp'", order_by=["attributes.start_time DESC"])[0]
    plan = json.loads(Path(client.download_artifacts(run.info.run_id, "plan.json", str(tmp_path / "2"))).read_text())
    assert plan["reused"] == ["backprop", "backprop-fused_step"] and Path(plan["stored"]).parent == Path(".edgeflux/plans")


def test_a_stored_plan_is_reused_for_the_same_model_shape_options_and_machine_only(mnist_subset, tmp_path,
                                                                                   monkeypatch, caplog):
    """PlanCache: a second plan of the same model layers, sample shape and step options (another seed, another
    learning rate, more data) measures nothing and scales the epoch time to its data; another budget measures
    afresh; a fresh cache (`edgeflux plan`) measures and overwrites; a damaged file is measured again, with a
    warning, and rewritten."""
    import edgeflux.plan.core as core

    train = tensors(mnist_subset, "target_train", limit=256)
    measured, size_one = [], core.size_one
    monkeypatch.setattr(core, "size_one", lambda spec, *a: measured.append(spec) or size_one(spec, *a))
    specs = ("backprop", "backprop-fused_step")

    def plan(p, seed=0, data=train, fresh=False):
        model = build_model(**MODEL, seed=seed)
        cache = PlanCache(plan_key(model, data, p, "cpu"), root=tmp_path, fresh=fresh)
        return plan_training(model, data, p, candidates=specs, steps=1, cache=cache), cache

    first, cache = plan(section("12MB"))
    assert measured == list(specs) and cache.path.exists() and cache.reused == set()
    again, cache = plan(section("12MB", lr=0.2, epochs=3), seed=1, data=tensors(mnist_subset, "target_train", limit=512))
    assert measured == list(specs) and cache.reused == set(specs)        # nothing measured again
    assert [(r.batch, r.samples_per_s) for r in again] == [(r.batch, r.samples_per_s) for r in first]
    assert again[0].epoch_s == pytest.approx(2 * first[0].epoch_s)       # 512 samples, not 256
    plan(section("10MB"))                                                # another budget: another plan
    assert measured == [*specs, *specs] and len(list(tmp_path.glob("*.json"))) == 2
    plan(section("12MB"), fresh=True)                                    # edgeflux plan: measured, stored
    assert measured == [*specs] * 3
    cache.path.write_text(cache.path.read_text()[:40])                   # cut short
    with caplog.at_level("WARNING"):
        plan(section("12MB"))
    assert measured == [*specs] * 4 and "a stored plan that cannot be read" in caplog.text
    assert PlanCache(cache.key, root=tmp_path).get("backprop").batch == first[0].batch    # rewritten whole
