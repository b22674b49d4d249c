"""MEANet: architectures, hard classes and the class map, the edge's training with a fixed main block, the
router (Algorithm 2) against a literal per-instance reading of the paper, fallbacks, Table I's numbers."""
import copy

import pytest
import torch

from edgeflux.artifacts import CorruptFileError
from edgeflux.data import tensors
from edgeflux.meanet.cloud import CloudUnavailable
from edgeflux.meanet.cost import CostModel, inference_costs
from edgeflux.meanet.hard import entropy, entropy_range, hard_classes, per_class_precision, select_hard
from edgeflux.meanet.model import (MEANetConfigError, MEANetSpec, TwoExits, build_meanet, exits_loss, fix_main,
                                   load_meanet, main_block, save_meanet)
from edgeflux.meanet.router import EXITS, Router, confidence
from edgeflux.meanet.train import edge_step_memory, joint_step_memory, train_edge
from edgeflux.models import build_model
from edgeflux.memory.options import MemoryOptions
from edgeflux.options import TrainOptions

WIDTH = {"resnet18": 0.25, "mobilenet_v2": 0.25}


def small(name="resnet18", seed=0):
    model = build_model(name, 10, 1, WIDTH[name], 32, seed=seed)
    model.build_args = dict(name=name, num_classes=10, in_channels=1, width=WIDTH[name], image_size=32,
                            batch_norm=True, seed=seed)
    return model


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
@pytest.mark.parametrize("variant", ["A", "B"])
@pytest.mark.parametrize("fusion", ["sum", "concat"])
def test_blocks_have_the_shapes_of_the_paper(name, variant, fusion):
    model = small(name)
    net = build_meanet(model, MEANetSpec(variant=variant, fusion=fusion, n_hard=4), model.build_args)
    x = torch.randn(3, 1, 32, 32)
    net.eval()
    y1, features = net.main_exit(x)
    assert net.adaptive(x).shape == features.shape             # the adaptive block mirrors the main block to F
    assert y1.shape == (3, 10) and net(x).shape == (3, 4)      # main exit: all classes; extension: the hard ones
    if variant == "B":
        assert net.main is model and torch.equal(y1, model(x))   # the whole CNN is the main block
    else:
        assert all(a is b for a, b in zip(net.main.units[:-1], model.units[:net.split]))
        assert len(net.main.units) == net.split + 1             # units before the split + a new exit
    first = net.extension[0][0] if fusion == "concat" else None
    assert first is None or first.in_channels == 2 * features.shape[1]   # concatenation: more input channels


def test_a_fusion_point_that_is_not_a_unit_boundary_and_a_bad_n_hard_are_one_line_errors():
    model = small()
    for split in ("block9.9", "classifier"):
        with pytest.raises(MEANetConfigError, match="split_after") as err:
            build_meanet(model, MEANetSpec(variant="B", split_after=split, n_hard=5))
        assert "\n" not in str(err.value) and "block4.1" in str(err.value)   # names the units to use
    with pytest.raises(MEANetConfigError, match="leaves no extension"):
        build_meanet(model, MEANetSpec(variant="A", split_after="block4.1", n_hard=5))
    for n_hard in (0, 10, 11):
        with pytest.raises(MEANetConfigError, match="n_hard"):
            build_meanet(model, MEANetSpec(n_hard=n_hard))
        with pytest.raises(MEANetConfigError, match="n_hard"):
            hard_classes(torch.randn(20, 10), torch.randint(0, 10, (20,)), n_hard)


def test_hard_classes_are_the_lowest_precision_and_the_class_map_is_algorithm_1s():
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    pred = torch.tensor([0, 0, 1, 0, 1, 2, 3, 3])   # precision: 0 -> 2/3, 1 -> 1/2, 2 -> 1, 3 -> 1
    logits = torch.nn.functional.one_hot(pred, 4).float()
    precision, recall = per_class_precision(pred, labels, 4)
    assert precision == pytest.approx([2 / 3, 1 / 2, 1.0, 1.0]) and recall == pytest.approx([1, .5, .5, 1])
    hard = hard_classes(logits, labels, n_hard=2)
    assert hard.hard == [1, 0] and hard.class_map == {0: 0, 1: 1} and hard.easy == [2, 3]
    hard = hard_classes(logits, labels, n_hard=2, choose=[3, 1])   # the random-selection baseline
    assert hard.class_map == {1: 0, 3: 1}
    x = torch.arange(8.0)
    x_h, y_h = select_hard(x, labels, hard)
    assert x_h.tolist() == [2, 3, 6, 7] and y_h.tolist() == [0, 0, 1, 1]
    assert hard.originals()[y_h].tolist() == labels[[2, 3, 6, 7]].tolist()
    mutated = hard_classes(logits, labels, n_hard=1)
    assert mutated.hard == [1]


def test_entropy_range_is_the_mean_entropy_of_right_and_wrong_predictions():
    logits = torch.tensor([[5.0, 0, 0], [0, 4.0, 0], [1.0, 1.1, 0.9], [0.2, 0, 0.1]])
    labels = torch.tensor([0, 1, 2, 1])
    h = entropy(logits)
    p = torch.softmax(logits, 1)
    assert torch.allclose(h, -(p * p.log()).sum(1))
    mu_c, mu_w = entropy_range(logits, labels)
    assert mu_c == pytest.approx(h[:2].mean().item()) and mu_w == pytest.approx(h[2:].mean().item())
    assert mu_c < mu_w


def reference_algorithm_2(net, hard, threshold, cloud_answer, x):
    """The paper's Algorithm 2, one instance at a time, read literally."""
    preds, exits = [], []
    net.eval()
    with torch.no_grad():
        for i in range(len(x)):
            xi = x[i:i + 1]
            y1, features = net.main_exit(xi)
            if cloud_answer is not None and entropy(y1).item() > threshold:
                preds.append(cloud_answer(xi).argmax(1).item())
                exits.append("cloud")
            elif y1.argmax(1).item() in hard.class_map:
                y2 = net.extension_exit(xi, features)
                if confidence(y1).item() > confidence(y2).item():
                    preds.append(y1.argmax(1).item())
                    exits.append("main")
                else:
                    preds.append(hard.originals()[y2.argmax(1)].item())
                    exits.append("extension")
            else:
                preds.append(y1.argmax(1).item())
                exits.append("main")
    return preds, exits


class EdgeOptions(TrainOptions, MemoryOptions):
    pass


def trained_net(data, variant="B"):
    """A small MEANet whose main block and extension learnt a little (so every exit answers some instances)."""
    from edgeflux.backprop import train_under_budget

    model = small()
    opts = EdgeOptions(epochs=2, batch_size=32, lr=0.05, evals_per_epoch=1)
    train_under_budget(model, tensors(data, "source_train"), tensors(data, "source_val", limit=256),
                       tensors(data, "source_test", limit=64), opts, memory=opts)
    net = build_meanet(model, MEANetSpec(variant=variant, n_hard=5), model.build_args)
    val = tensors(data, "source_val")
    net.eval()
    with torch.no_grad():
        logits = net.main_exit(val[0][:])[0]
    hard = hard_classes(logits, val[1], 5)
    train_edge(net, hard, tensors(data, "target_train"), tensors(data, "target_val", limit=256),
               tensors(data, "target_test", limit=64), opts.model_copy(update={"lr": 0.01, "epochs": 1}), "cpu")
    return net, hard, entropy_range(logits, val[1])


@pytest.fixture(scope="module")
def routed_setup(mnist_subset):
    return trained_net(mnist_subset)


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_router_matches_algorithm_2_instance_by_instance(routed_setup, mnist_subset):
    net, hard, (mu_c, mu_w) = routed_setup
    x = tensors(mnist_subset, "target_test")[0][:96]
    cloud_model = copy.deepcopy(net.main).eval()
    torch.manual_seed(1)
    for p in cloud_model.parameters():   # a different classifier, so the cloud's answers are visible
        p.data.add_(0.05 * torch.randn_like(p))
    threshold = (mu_c + mu_w) / 2
    for cloud in (None, cloud_model):
        routed = Router(net, hard, threshold if cloud else None, cloud, cloud_batch=16)(x)
        preds, exits = reference_algorithm_2(net, hard, threshold, cloud, x)
        assert routed.pred.tolist() == preds
        assert [EXITS[e] for e in routed.exit.tolist()] == exits
    counts = routed.counts()
    assert counts["cloud"] > 0 and counts["main"] > 0 and counts["extension"] > 0, counts


def test_a_cloud_that_fails_mid_batch_drops_nothing_and_counts_every_fallback(routed_setup, mnist_subset):
    net, hard, _ = routed_setup
    x = tensors(mnist_subset, "target_test")[0][:128]
    calls = []

    def flaky(batch):
        calls.append(len(batch))
        if len(calls) > 1:
            raise CloudUnavailable("cloud at http://127.0.0.1:1 did not answer (test)")
        return torch.zeros(len(batch), 10).index_fill_(1, torch.tensor([7]), 1.0)   # always class 7

    routed = Router(net, hard, 0.0, flaky, cloud_batch=8)(x)
    alone = Router(net, hard)(x)
    counts = routed.counts()
    assert len(routed.pred) == len(x) and sum(counts.values()) == len(x)
    assert counts["cloud"] == calls[0] and counts["fallback"] == sum(calls[1:]) > 0
    fallback = routed.exit == EXITS.index("fallback")
    assert torch.equal(routed.pred[fallback], alone.pred[fallback])    # the edge answered them alone
    assert (routed.pred[routed.exit == EXITS.index("cloud")] == 7).all()
    assert len(routed.cloud_errors) == len(calls) - 1


def test_cloud_accuracy_counts_the_clouds_answers_only_and_a_mostly_dead_cloud_is_no_measurement(routed_setup,
                                                                                                   mnist_subset):
    """A cloud that answers its first request with the true labels and then dies: the routed accuracy mixes
    its answers with the edge's fallbacks, the cloud's own accuracy is over what it answered (1.0 here), and
    check_answered refuses the run when the cloud answered less than the stated share of what was sent."""
    from edgeflux.meanet.evaluate import CloudAnswerError, check_answered, route_once

    net, hard, _ = routed_setup
    x, y = tensors(mnist_subset, "target_test", limit=128)
    x, y = x[:], y[:]
    sent = []

    def dies_after_one(batch):
        sent.append(len(batch))
        if len(sent) > 1:
            raise CloudUnavailable("cloud at http://127.0.0.1:1 did not answer (test)")
        return torch.nn.functional.one_hot(y[:len(batch)], 10).float()   # cloud-only sends in order: the first batch's labels

    row = route_once(net, hard, dies_after_one, -1.0, x, y, cloud_batch=16)
    assert row["exit_cloud"] == 16 and row["fallbacks"] == 112 and row["answered_acc"] == 1.0
    assert row["acc"] < 1.0
    report = {"cloud_only": row, "sweep": [{"exit_cloud": 0, "fallbacks": 0}]}
    with pytest.raises(CloudAnswerError, match=r"^the cloud answered 16 of the 128 instances sent to it \(12.5%; "
                                              r"meanet.client.min_answered is 99%\)"):
        check_answered(report, 0.99)
    assert check_answered(report, 0.125) == {"sent": 128, "answered": 16}


@pytest.mark.slow   # tens of seconds: make test-fast leaves it out
def test_edge_training_keeps_the_main_block_fixed_and_needs_less_memory_than_joint(mnist_subset, tmp_path):
    model = small("mobilenet_v2")
    net = build_meanet(model, MEANetSpec(variant="B", n_hard=5), model.build_args)
    main_before = copy.deepcopy(net.main.state_dict())          # weights and BatchNorm running statistics
    ext_before = copy.deepcopy(net.extension.state_dict())
    val = tensors(mnist_subset, "source_val")
    net.eval()
    with torch.no_grad():
        hard = hard_classes(net.main_exit(val[0][:])[0], val[1], 5)
    opts = EdgeOptions(epochs=1, evals_per_epoch=1, max_batch=32, batch_size=32, lr=0.01)
    train = tensors(mnist_subset, "target_train", limit=256)
    run = train_edge(net, hard, train, tensors(mnist_subset, "target_val", limit=128),
                     tensors(mnist_subset, "target_test", limit=128), opts, torch.device("cpu"))
    assert run.train.steps > 0
    for key, value in net.main.state_dict().items():
        assert torch.equal(value, main_before[key]), key          # no gradient step, no statistics update
    assert any(not torch.equal(v, ext_before[k]) for k, v in net.extension.state_dict().items())
    assert all(p.grad is None for p in net.main.parameters())
    edge = edge_step_memory(net, hard, 32, train, opts, "cpu")
    joint = joint_step_memory(net, hard, 32, train, opts, "cpu")
    assert edge.peak_bytes < 0.8 * joint.peak_bytes and edge.saved_bytes < joint.saved_bytes
    assert net.main.training is False or all(not m.training for m in net.main.modules())


def test_model_a_trains_its_main_block_jointly_with_the_cnn_and_saves_and_loads(tmp_path):
    model = small()
    spec = MEANetSpec(variant="A", n_hard=5)
    main, k = main_block(model, spec)
    two = TwoExits(model, main, k).train()
    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 10, (4,))
    early, final = two(x)
    assert early.shape == final.shape == (4, 10)
    exits_loss((early, final), y).backward()
    assert main.units[-1][-1].weight.grad is not None and model.units[-1][-1].weight.grad is not None
    assert two.eval()(x).shape == (4, 10)
    net = fix_main(build_meanet(model, spec, model.build_args, main=main))
    path = tmp_path / "meanet.pt"
    save_meanet(path, net)
    loaded, _ = load_meanet(path)
    net.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(net(x), loaded(x)) and torch.equal(net.main_exit(x)[0], loaded.main_exit(x)[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="dvc"):
        load_meanet(path)


def test_cost_model_reproduces_the_papers_table_vii_upload_figures():
    cost = CostModel()
    assert cost.upload_power_w == pytest.approx(5.48, abs=0.005)              # Section IV.B
    cifar = 32 * 32 * 3
    assert cost.upload_s(cifar) * 1e3 == pytest.approx(1.3, abs=0.05)          # t_cu, ms
    assert cost.upload_j(cifar) * 1e3 == pytest.approx(7.12, abs=0.05)         # E_cu, mJ
    assert cost.upload_s(224 * 224 * 3) * 1e3 == pytest.approx(63.7, abs=0.1)
    edge, cloud, both = inference_costs(cost, 1e-3, 8e-4, 2e-3, 0.25, cifar, 1000)
    assert edge["edge_energy_j"] == pytest.approx(1000 * 10.0 * 1e-3)
    assert cloud["edge_energy_j"] == pytest.approx(1000 * cost.upload_j(cifar))
    assert both["edge_energy_j"] == pytest.approx(1000 * (10.0 * 8e-4 + 0.25 * cost.upload_j(cifar)))
    assert both["latency_s"] == pytest.approx(1000 * (8e-4 + 0.25 * (cost.upload_s(cifar) + 2e-3)))


def test_features_mode_sends_f_and_the_cloud_continues_the_cnn(routed_setup, mnist_subset):
    """Model A with send=features: the cloud is the CNN's tail after the fusion point, fed the edge's F."""
    model = small()
    net = build_meanet(model, MEANetSpec(variant="A", n_hard=5), model.build_args)
    _, hard, _ = routed_setup
    tail = model.head(net.split).eval()
    seen = []

    def cloud(features):
        seen.append(features.shape)
        return tail(features)

    x = tensors(mnist_subset, "target_test")[0][:40]
    routed = Router(net, hard, 0.0, cloud, send="features", cloud_batch=16)(x)
    net.eval()
    with torch.no_grad():
        expected = tail(net.features(x)).argmax(1)
    sent = routed.exit == EXITS.index("cloud")
    assert sent.sum() > 0 and all(s[1:] == net.features(x[:1]).shape[1:] for s in seen)
    assert torch.equal(routed.pred[sent], expected[sent])


@pytest.mark.slow   # MLflow's model server
def test_the_real_cloud_server_stopped_mid_batch_leaves_every_instance_answered(routed_setup, mnist_subset, tmp_path):
    """MLflow's model server on loopback as the cloud; it is stopped after the first request: the rest of the
    instances sent are answered on the edge (fallback), none is dropped, and the cloud's answers are its model's."""
    from edgeflux.meanet.cloud import CloudClient
    from edgeflux.meanet.server import ModelServer
    from edgeflux.process import group_alive as _group_alive
    from edgeflux.tracking import save_model_dir

    net, hard, _ = routed_setup
    cloud_model = small("mobilenet_v2", seed=3).eval()
    x = tensors(mnist_subset, "target_test")[0][:96]
    save_model_dir(cloud_model, tmp_path / "cloud", x[:2])
    with ModelServer(tmp_path / "cloud", log_path=tmp_path / "server.log") as server, \
            CloudClient(server.url, timeout_s=5.0, retries=1, backoff_s=0.05, cooldown_s=60.0) as client:
        pid = server.process.pid

        def cloud_then_down(batch):
            logits = client(batch)
            server.stop()                      # the cloud goes away after answering one request
            return logits

        routed = Router(net, hard, -1.0, cloud_then_down, cloud_batch=32)(x)
    counts = routed.counts()
    assert counts == {"main": 0, "extension": 0, "cloud": 32, "fallback": 64}, counts
    assert client.stats.failures == 1 and client.stats.skipped == 1 and len(routed.cloud_errors) == 2
    with torch.no_grad():
        assert torch.equal(routed.pred[:32], cloud_model(x[:32]).argmax(1))
    alone = Router(net, hard)(x)
    assert torch.equal(routed.pred[32:], alone.pred[32:])
    assert not _group_alive(pid)                      # mlflow and its uvicorn worker are gone


def test_a_cloud_answering_for_other_classes_is_a_fallback_not_a_wrong_answer(routed_setup, mnist_subset):
    net, hard, _ = routed_setup
    x = tensors(mnist_subset, "target_test")[0][:20]
    routed = Router(net, hard, -1.0, lambda batch: torch.zeros(len(batch), 3))(x)
    assert routed.counts()["fallback"] == 20 and "3 classes" not in routed.cloud_errors[0]
    assert "10 classes" in routed.cloud_errors[0]
