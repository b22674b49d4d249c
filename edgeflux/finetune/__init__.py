"""Fine-tuning a pretrained model on the device: one harness, one ``method`` per run.

    model, _ = load_model("models/pretrained/mobilenet_v2-w0.5.pt")
    run = finetune(model, "mobiletl", opts, train, val, test, device)    # opts: FinetuneOptions
    run.metrics()        # test accuracy, measured peak and saved bytes, trainable params, counted FLOPs, step time

A method only decides what trains and how (``METHODS``: model in, ``Prepared`` out); everything else is
shared, so the methods compare under the same budget: the batch is the largest whose measured step fits
``budget`` (``edgeflux.backprop.train_under_budget``, the one training loop), BitTrain and fp16 storage
apply to whatever the method still saves, and the accounting is the same for all.

Methods (the paper's baselines, Table 3, beside MobileTL):

* ``ft_all``: every parameter trains, BatchNorm statistics update.
* ``ft_last``: the classifier only; the rest frozen (eval mode, no graph).
* ``ft_bn``: BatchNorm scales and shifts (statistics update) and the classifier.
* ``ft_bn_bias``: BatchNorm scales and shifts, every conv/linear bias and the classifier (ElasticTrainer's
  "BN+Bias" baseline, an offline selection).
* ``ft_bias``: biases only (TinyTL-B): every BatchNorm shift-only (nothing saved, edgeflux.mobiletl.ops),
  conv/linear biases, and the classifier.
* ``ft_blocks``: the top ``blocks`` blocks, the last conv and the classifier, vanilla; the bottom frozen.
* ``mobiletl``: the same top blocks with the MobileTL transform, the bottom frozen in int8
  (``quantize_bottom``).
* ``elastic``: ElasticTrainer (edgeflux.elastic): the trainable tensors of ``elastic.base`` (ft_all, or
  mobiletl's transformed top, ...), of which the ones that fit the time objective ``elastic.rho`` train,
  re-selected by importance every ``elastic.interval`` epochs. The batch is measured with every tensor
  training, so whatever is selected stays within the budget.

In every setting the classifier trains; in the block-wise ones the last 1x1 conv (the paper's "feature
fusion layer") does too.

Compositions are named ``<method>-<modifier>...`` (``parse_method``): ``-bittrain`` turns BitTrain on for
that run (``bittrain``'s other settings apply), and ``elastic-<base>`` selects among ``<base>``'s tensors
(ElasticTrainer on a MobileTL model: ``elastic-mobiletl``). ``-`` because no method name has one and DVC
takes it in a matrix stage's name.
"""
from edgeflux.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "options": ["METHOD_HELP", "METHOD_LABELS", "METHOD_NAMES", "MODIFIERS", "FinetuneOptions", "finetune_label",
                "parse_method"],
    "methods": ["METHODS", "FinetuneRun", "Prepared", "calibration_batches", "count_flops", "finetune",
                "method_options", "prepare"],
})
