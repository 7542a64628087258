"""Every Kubernetes manifest under deploy/k8s validates against the Kubernetes schemas (strict:
unknown fields are errors), every policy in a ConfigMap passes Sluice's own loader, and the
pieces agree with each other: probes on /readyz, preStop shorter than the drain, grace period
longer than both, selectors that match, the image's user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.policy.loader import load_policy
from tests.support import ROOT, require

try:
    import kubernetes_validate
except ImportError:  # a dev dependency; require() below skips, or fails under SLUICE_STRICT
    kubernetes_validate = None

K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
IMAGE_USER = 10001  # deploy/Dockerfile: USER 10001:10001


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in MANIFESTS for d in docs(p) if d["kind"] == kind]


def test_the_edge_layout_is_all_there() -> None:
    kinds = {d["kind"] for p in MANIFESTS if "edge" in p.parts for d in docs(p)}
    assert {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
        "NetworkPolicy",
    } <= kinds
    assert (K8S / "sidecar.yaml") in MANIFESTS


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_kubernetes_schemas(path: Path) -> None:
    require(kubernetes_validate is not None, "needs kubernetes-validate (pip install -e .[dev])")
    version = kubernetes_validate.latest_version()
    for doc in docs(path):
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def _policy_of(deployment: dict[str, Any], tmp_path: Path) -> Any:
    pod = deployment["spec"]["template"]["spec"]
    name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
    ((_, cm),) = [(p, d) for p, d in by_kind("ConfigMap") if d["metadata"]["name"] == name]
    f = tmp_path / f"{name}.yaml"
    f.write_text(cm["data"]["policy.yaml"])
    return load_policy(f)  # PolicyError (FILE:LINE:COL) if the embedded policy is wrong


@pytest.mark.parametrize(
    "deployment",
    [d for _, d in by_kind("Deployment") if d["metadata"]["name"] != "sluice-redis"],
    ids=lambda d: d["metadata"]["name"],
)
def test_sluice_deployment_timings_probes_and_user(
    deployment: dict[str, Any], tmp_path: Path
) -> None:
    policy = _policy_of(deployment, tmp_path)
    pod = deployment["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "sluice"]
    sleep_s = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain_s = policy.timeouts.drain_s
    assert 0 < sleep_s < drain_s, "the preStop pause must be shorter than the drain"
    assert sleep_s + drain_s < pod["terminationGracePeriodSeconds"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["readinessProbe"]["httpGet"]["port"] == "admin"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["admin"] == policy.listeners.admin.port
    assert policy.listeners.admin.host == "0.0.0.0"  # probes come from the kubelet, not loopback
    assert ports["http"] == policy.listeners.http.port
    user = c["securityContext"].get("runAsUser", pod.get("securityContext", {}).get("runAsUser"))
    assert user == IMAGE_USER
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def test_edge_spreads_replicas_and_the_budgets_point_at_it() -> None:
    ((_, dep),) = [x for x in by_kind("Deployment") if x[1]["metadata"]["name"] == "sluice-edge"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["replicas"] >= 3
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == labels
    assert dep["spec"]["selector"]["matchLabels"] == labels
    ((_, pdb),) = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    assert pdb["spec"]["maxUnavailable"] < dep["spec"]["replicas"]
    ((_, hpa),) = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "sluice-edge"
    assert hpa["spec"]["minReplicas"] >= dep["spec"]["replicas"] - 1
    selectors = [s["spec"]["selector"] for p, s in by_kind("Service") if "edge" in p.parts]
    assert labels in selectors
    redis = [s for _, s in by_kind("Service") if s["metadata"]["name"] == "sluice-redis"]
    assert redis and redis[0]["spec"]["ports"][0]["port"] == 6379
