"""MEANet (Long et al., "Complexity-aware Adaptive Training and Inference for Edge-Cloud Distributed AI
Systems"): a main block trained at the cloud, adaptive and extension blocks trained on the edge for the
hard classes, and inference that exits at the main block, the extension block or the cloud.

One module per job:

* ``model``: the main, adaptive and extension blocks (models A and B, sum or concatenation), saving;
* ``hard``: hard classes by validation precision and the class map (Algorithm 1), entropies;
* ``train``: the main block at the cloud (model A), the edge's training, joint optimisation's step;
* ``router``: Algorithm 2 with a cloud that may fail (fallbacks counted, nothing dropped);
* ``cloud``: the HTTP client of the cloud model server; ``server``: that server (MLflow's), started and stopped;
* ``cost``: Table I's energy and latency model; ``evaluate``: Tables II-III, VI and the threshold sweep;
* ``plot``: Figs. 7-8.
"""
