"""Every rendering of the chart's values matrix applied to a real
kube-apiserver (the cluster suite's harness, tests/cluster/, built by
scripts/build-cluster.sh) with server-side apply and strict field validation,
as `kubectl apply --server-side --validate=strict` does. The CRDs of
cert-manager and the Prometheus Operator are installed first from their
published definitions (tests/data/crds/), so their objects are validated too.
"""

import pathlib
import subprocess

import pytest
import yaml

from test_chart import MATRIX, REPO, chart, render  # noqa: F401 (chart is a fixture)

CRDS = REPO / "tests" / "data" / "crds"


@pytest.fixture(scope="module")
def kubeconfig():
    build = subprocess.run(
        [str(REPO / "scripts" / "build-cluster.sh")], capture_output=True, text=True, check=False
    )
    assert build.returncode == 0, build.stderr
    binary = REPO / build.stdout.strip()
    proc = subprocess.Popen(
        [str(binary), "-exit-on-stdin-eof"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    fields = {}
    for line in proc.stdout:
        k, _, v = line.strip().partition(" ")
        fields[k] = v
        if k == "dir":
            break
    assert "kubeconfig" in fields, f"the cluster harness did not start: {fields}"
    try:
        yield fields["kubeconfig"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def kubectl(kubeconfig, *args, stdin=None):
    return subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, *args], input=stdin, capture_output=True, text=True, check=False
    )


@pytest.fixture(scope="module")
def crds(kubeconfig):
    out = kubectl(kubeconfig, "apply", "--server-side", "--validate=strict", "-f", str(CRDS))
    assert out.returncode == 0, out.stderr
    names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in sorted(CRDS.glob("*.yaml"))]
    out = kubectl(kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names])
    assert out.returncode == 0, out.stderr
    return names


@pytest.mark.parametrize("case,values,name,namespace", MATRIX, ids=[m[0] for m in MATRIX])
def test_every_rendering_is_accepted_by_kube_apiserver(chart, kubeconfig, crds, case, values, name, namespace):
    objects = render(chart, values, name, namespace)
    kinds = {o["kind"] for o in objects}
    # Helm does not own the release's namespace, nor those RoleBindings go to.
    for ns in {namespace} | {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]}:
        kubectl(kubeconfig, "create", "namespace", ns)
    text = yaml.safe_dump_all(objects)
    out = kubectl(
        kubeconfig,
        "apply",
        "--server-side",
        "--force-conflicts",
        "--validate=strict",
        "--field-manager=pinswap-chart-suite",
        "-f",
        "-",
        stdin=text,
    )
    assert out.returncode == 0, f"{case}: {out.stderr}"
    # Each object is stored: read every one back.
    applied = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(applied) == len(objects), out.stdout
    for o in objects:
        ns = ["-n", o["metadata"].get("namespace", namespace)]
        got = kubectl(kubeconfig, "get", *ns, o["kind"], o["metadata"]["name"], "-o", "name")
        assert got.returncode == 0, f"{case}: {o['kind']}/{o['metadata']['name']}: {got.stderr}"
    if case == "observability":
        assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    if case.startswith("cert-manager"):
        assert "Certificate" in kinds


def test_the_crds_are_the_published_ones(crds):
    assert sorted(crds) == [
        "certificates.cert-manager.io",
        "issuers.cert-manager.io",
        "prometheusrules.monitoring.coreos.com",
        "servicemonitors.monitoring.coreos.com",
    ]


def test_a_field_the_schema_lacks_is_refused(chart, kubeconfig, crds):
    """Strict validation is on: an unknown field fails the apply, so the
    acceptances above mean something."""
    objects = render(chart, {})
    dep = next(o for o in objects if o["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    kubectl(kubeconfig, "create", "namespace", "pinswap")
    out = kubectl(
        kubeconfig, "apply", "--server-side", "--validate=strict", "--dry-run=server", "-f", "-",
        stdin=yaml.safe_dump(dep),
    )
    assert out.returncode != 0
    assert "imagePullPolicyy" in out.stderr, out.stderr


def test_crd_objects_are_validated_against_their_schema(chart, kubeconfig, crds):
    objects = render(chart, MATRIX[[m[0] for m in MATRIX].index("observability")][1])
    sm = next(o for o in objects if o["kind"] == "ServiceMonitor")
    sm["spec"]["endpoints"][0]["interval"] = "often"
    out = kubectl(
        kubeconfig, "apply", "--server-side", "--force-conflicts", "--validate=strict", "--dry-run=server", "-f", "-",
        stdin=yaml.safe_dump(sm),
    )
    assert out.returncode != 0, out.stdout
    assert "interval" in out.stderr, out.stderr


assert pathlib.Path(CRDS).is_dir()
