"""Runs that share an id, or ids that differ only in characters a name cannot take, stay apart.

A run's Kubernetes objects and labels are named per run, so one run never replaces or admits
another's: ``exp.1``, ``Exp-1`` and ``exp_1``.
"""

from __future__ import annotations

from pathlib import Path

from conftest import write_spec
from distlaunch.launcher import k8s
from distlaunch.launcher.spec import load_spec


def test_kubernetes_names_and_labels_of_look_alike_run_ids_differ(tmp: Path) -> None:
    (tmp / "task.py").write_text("print('hi')\n")
    loaded = load_spec(write_spec(tmp))
    made = {
        run_id: k8s.manifests(loaded, run_id, "img", None, False)
        for run_id in ("exp.1", "Exp-1", "exp_1", "exp-1")
    }
    names = {m.name for m in made.values()}
    assert len(names) == 4, names
    for run_id, m in made.items():
        service, policy = m.objects[0], m.objects[1]
        assert policy["kind"] == "NetworkPolicy"
        admitted = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert admitted == policy["spec"]["podSelector"]["matchLabels"] == {k8s.RUN_LABEL: m.name}
        assert service["metadata"]["name"] == policy["metadata"]["name"] == m.name
        for job in m.objects[2:]:
            assert job["metadata"]["name"].startswith(f"{m.name}-"), run_id
            labels = job["spec"]["template"]["metadata"]["labels"]
            assert labels[k8s.RUN_LABEL] == m.name
    assert made["exp-1"].name == "exp-1"  # a run id that is a DNS label already is kept
