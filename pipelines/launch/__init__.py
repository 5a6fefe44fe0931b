"""Launching ranks: what runs a module on every rank a job spec asks for, here or on Kubernetes. The train stage,
evaluation, serving and preflight use it; it imports no stage.

| module | job |
|---|---|
| ``ranks`` | :func:`~pipelines.launch.ranks.run_ranks`: torchrun here (one per node, notices forwarded), a Kubeflow job there; its errors (exit 2 / 75) |
| ``outcomes`` | what a rank that stops early says (outcome files, attempts), and the preemption notices |
| ``k8s`` | Kubeflow TrainJob / PyTorchJob: rendered, checked, submitted, adopted, watched, deleted |
| ``admission`` | what the cluster's admission would refuse: the CRD's schema and CEL rules, the operator's webhook |

``python -m pipelines.train.k8s`` prints the train stage's job (the CLI stays with the stage whose job it prints).
"""
