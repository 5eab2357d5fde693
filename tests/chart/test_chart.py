"""The Helm chart, through Helm's own engine (helm-python-sdk embeds Helm v4's
Go SDK): lint, a matrix of values rendered and validated against the
Kubernetes schemas of every supported minor version, the values schema's
refusals, and the default install compared object by object, field by field,
with what `pinswap manifests` prints for the same config.

Run by scripts/test-chart.sh, which installs the pinned tools and builds the
binary; PINSWAP_BIN names another binary.
"""

import copy
import json
import os
import pathlib
import re
import subprocess

import helm_python
import kubernetes_validate
import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pinswap"
BIN = pathlib.Path(os.environ.get("PINSWAP_BIN", REPO / "target" / "debug" / "pinswap"))
VERSIONS = ["1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35", "1.36", "1.37"]
# Labels only a Helm release carries; everything else must equal `pinswap manifests`.
CHART_ONLY_LABELS = {
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
}
# Kinds kubernetes-validate has no schema for (CRDs of cert-manager and the
# Prometheus Operator); tests/install.rs checks cert-manager's fields.
CRD_KINDS = {"Issuer", "Certificate", "ServiceMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def chart():
    c = helm_python.Chart.load(str(CHART))
    yield c
    c.close()


def render(chart, values, name="pinswap", namespace="pinswap"):
    """The rendered objects, NOTES.txt apart."""
    out = chart.render(copy.deepcopy(values), name=name, namespace=namespace)
    objects = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        objects.extend(o for o in yaml.safe_load_all(text) if o)
    return objects


def notes(chart, values, name="pinswap", namespace="pinswap"):
    out = chart.render(copy.deepcopy(values), name=name, namespace=namespace)
    return out["pinswap/templates/NOTES.txt"]


def key(o):
    m = o["metadata"]
    return (o["kind"], m.get("namespace", ""), m["name"])


def find(objects, kind, name):
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found in {[key(o) for o in objects]}"
    return hits[0]


def kinds(objects):
    return sorted(o["kind"] for o in objects)


def pod_spec(objects, name="pinswap"):
    return find(objects, "Deployment", name)["spec"]["template"]["spec"]


def rules_of(objects):
    """(kind, namespace, name) -> ["group/resources verbs names", ...] for every role."""
    out = {}
    for o in objects:
        if o["kind"] in ("Role", "ClusterRole"):
            out[key(o)] = [
                "{}/{} {} {}".format(
                    ",".join(r["apiGroups"]),
                    ",".join(r["resources"]),
                    ",".join(r["verbs"]),
                    ",".join(r.get("resourceNames", [])),
                )
                for r in o["rules"]
            ]
    return out


def test_lint_is_clean():
    runs = [{"namespace": n} for n in (None, "pinswap", "mirror")]
    runs += [{"namespace": "pinswap", "kube_version": f"v{v}.0"} for v in VERSIONS]
    for run in runs:
        report = helm_python.lint(str(CHART), strict=True, **run)
        assert report["total_charts_linted"] == 1
        assert report["errors"] == [], report
        # Severity 1 is informational ("icon is recommended").
        assert [m for m in report["messages"] if m["severity"] > 1] == [], report


PULL_SECRETS_CONFIG = {
    "target": {"registry": "mirror.example.com/cache"},
    "source": {"imagePullSecrets": True},
    "recovery": {"namespaces": ["apps", "web"]},
}

# Every prewarm key, as a user would set them.
PREWARM_CONFIG = {
    "enabled": True,
    "namespaces": ["apps", "web"],
    "podSelector": {"matchLabels": {"tier": "frontend"}, "matchExpressions": [{"key": "app", "operator": "Exists"}]},
    "daemonSets": False,
    "top": 100,
    "concurrency": 4,
    "maxBytes": "10Gi",
    "freeSpaceFloor": 2147483648,
    "deadline": "5m",
    "startupTaint": "pinswap.dev/warming",
}

# (id, values, release name, namespace)
MATRIX = [
    ("defaults", {}, "pinswap", "pinswap"),
    ("cert-manager", {"certManager": {"enabled": True}}, "pinswap", "pinswap"),
    ("cert-manager-own-issuer", {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}}}, "pinswap", "pinswap"),
    ("self-signed-renamed", {"certManager": {"enabled": False}}, "mirror", "tools"),
    ("failure-closed", {"config": {"target": {"registry": "m.example.com"}, "failurePolicy": "closed"}}, "pinswap", "pinswap"),
    ("image-pull-secrets", {"imagePullSecrets": [{"name": "regcred"}], "config": PULL_SECRETS_CONFIG}, "pinswap", "pinswap"),
    ("recovery-off", {"config": {"target": {"registry": "m.example.com"}, "recovery": {"enabled": False}}}, "pinswap", "pinswap"),
    ("backfill-off", {"config": {"target": {"registry": "m.example.com"}, "backfill": {"enabled": False}}}, "pinswap", "pinswap"),
    ("evict", {"config": {"target": {"registry": "m.example.com"}, "recovery": {"evict": {"enabled": True}}}}, "pinswap", "pinswap"),
    ("evict-namespaces", {"config": {"target": {"registry": "m.example.com"}, "recovery": {"namespaces": ["apps"], "evict": {"enabled": True, "after": "1m", "perMinute": 5}}}}, "pinswap", "pinswap"),
    (
        "observability",
        {
            "metrics": {
                "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                "prometheusRule": {"enabled": True},
                "dashboard": {"enabled": True},
            },
            "networkPolicy": {"enabled": True, "webhookFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
            "config": {"target": {"registry": "m.example.com"}, "cache": {"purgeEndpoint": True}},
        },
        "pinswap",
        "pinswap",
    ),
    ("another-namespace", {}, "pinswap", "mirror"),
    (
        "customised",
        {
            "replicaCount": 3,
            "image": {"repository": "registry.example.com/pinswap", "tag": "0.1.0-dev", "pullPolicy": "Always"},
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "256Mi"}},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "node-role", "operator": "In", "values": ["infra"]}]}]
                    }
                }
            },
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "pinswap"}},
                }
            ],
            "priorityClassName": "system-cluster-critical",
            "hostAliases": [{"ip": "10.0.0.7", "hostnames": ["mirror.corp.internal"]}],
            "podAnnotations": {"example.com/team": "platform"},
            "podLabels": {"example.com/tier": "infra"},
            "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/pinswap"}},
            "webhook": {
                "timeoutSeconds": 5,
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "namespaceSelector": {"matchLabels": {"pinswap.dev/enabled": "true"}},
                "objectSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]},
            },
            "podDisruptionBudget": {"minAvailable": 1},
            "terminationGracePeriodSeconds": 45,
            "extraEnv": [{"name": "AWS_REGION", "value": "eu-west-1"}],
            "extraVolumes": [{"name": "ecr", "secret": {"secretName": "ecr-credentials"}}],
            "extraVolumeMounts": [{"name": "ecr", "mountPath": "/var/run/secrets/ecr", "readOnly": True}],
            "config": {
                "target": {"registry": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/mirror"},
                "server": {"listen": "0.0.0.0:9443", "healthListen": "0.0.0.0:9090", "admissionBudget": "2s"},
            },
        },
        "pinswap",
        "pinswap",
    ),
    ("no-rbac-existing-account", {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}}, "pinswap", "pinswap"),
    ("node-agent", {"nodeAgent": {"enabled": True, "runtime": "cri-o", "interval": "1m", "nodeSelector": {"kubernetes.io/os": "linux"},
                                  "priorityClassName": "system-node-critical"}}, "mirror", "mirror-system"),
    ("node-agent-star", {"nodeAgent": {"enabled": True},
                         "config": {"target": {"registry": "m.example.com"}, "source": {"registries": [{"registry": "*"}]}}}, "pinswap", "pinswap"),
    ("node-agent-star-secret", {"nodeAgent": {"enabled": True, "registryAuthSecret": "node-agent-pull"},
                                "config": {"target": {"registry": "m.example.com"}, "source": {"registries": [{"registry": "*"}]}}}, "pinswap", "pinswap"),
    ("node-agent-prewarm", {"nodeAgent": {"enabled": True, "runtime": "cri-o"},
                            "config": {"target": {"registry": "m.example.com"}, "prewarm": PREWARM_CONFIG}}, "mirror", "mirror-system"),
]


@pytest.mark.parametrize("case,values,name,namespace", MATRIX, ids=[m[0] for m in MATRIX])
def test_every_rendering_validates_strictly_for_each_kubernetes_version(chart, tmp_path, case, values, name, namespace):
    objects = render(chart, values, name, namespace)
    assert objects, case
    unvalidated = set()
    for version in VERSIONS:
        for o in objects:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unvalidated.add(o["kind"])
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{case}: {key(o)} invalid for Kubernetes {version}: {e.message} at {list(e.path)}")
    assert unvalidated <= CRD_KINDS, unvalidated
    # The config file the Pods get loads in pinswap itself.
    config = tmp_path / "config.yaml"
    config.write_text(next(o for o in objects if o["kind"] == "ConfigMap" and "config.yaml" in o["data"])["data"]["config.yaml"])
    checked = subprocess.run([BIN, "config", "validate", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, f"{case}: {checked.stdout}{checked.stderr}"
    # Everything namespaced lives in the release's namespace, except the
    # Roles that recovery.namespaces asks for.
    for o in objects:
        if o["kind"] != "MutatingWebhookConfiguration" and not o["kind"].startswith("Cluster"):
            if not o["metadata"]["name"].endswith("-recovery"):
                assert o["metadata"]["namespace"] == namespace, key(o)


def test_the_matrix_renders_what_each_value_asks_for(chart):
    by = {m[0]: render(chart, m[1], m[2], m[3]) for m in MATRIX}

    d = by["defaults"]
    assert kinds(d) == sorted(
        ["ClusterRole", "ClusterRoleBinding", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment",
         "MutatingWebhookConfiguration", "PodDisruptionBudget", "Role", "RoleBinding", "Role", "RoleBinding",
         "Service", "Service", "ServiceAccount"]
    )
    hook = find(d, "MutatingWebhookConfiguration", "pinswap")["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["timeoutSeconds"] == 10
    assert find(d, "Deployment", "pinswap")["spec"]["replicas"] == 2
    assert pod_spec(d)["terminationGracePeriodSeconds"] == 30
    assert pod_spec(d)["containers"][0]["image"] == "ghcr.io/pinswap/pinswap:" + chart.metadata["appVersion"]
    ports = [p["port"] for p in find(d, "Service", "pinswap")["spec"]["ports"]]
    assert ports == [443], "only the webhook port on the webhook's Service"

    cm = by["cert-manager"]
    assert {"Issuer", "Certificate"} <= set(kinds(cm))
    assert "--self-signed" not in pod_spec(cm)["containers"][0]["args"]
    assert not any(o["metadata"]["name"].startswith("pinswap-self-signed") for o in cm)

    own = by["cert-manager-own-issuer"]
    assert [key(o) for o in own if o["apiVersion"].startswith("cert-manager.io/")] == [("Certificate", "pinswap", "pinswap-webhook")]
    assert find(own, "Certificate", "pinswap-webhook")["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "corp-ca"}
    assert find(own, "MutatingWebhookConfiguration", "pinswap")["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "pinswap/pinswap-webhook"}

    renamed = by["self-signed-renamed"]
    args = pod_spec(renamed, "mirror-pinswap")["containers"][0]["args"]
    flags = dict(zip(args[8::2], args[9::2]))
    assert args[7] == "--self-signed"
    assert flags == {
        "--self-signed-secret": "mirror-pinswap-tls",
        "--webhook-configuration": "mirror-pinswap-tools",
        "--webhook-service": "mirror-pinswap",
    }
    find(renamed, "MutatingWebhookConfiguration", "mirror-pinswap-tools")
    role = find(renamed, "ClusterRole", "mirror-pinswap-self-signed:tools")
    assert role["rules"][0]["resourceNames"] == ["mirror-pinswap-tools"]

    assert find(by["failure-closed"], "MutatingWebhookConfiguration", "pinswap")["webhooks"][0]["failurePolicy"] == "Fail"

    ps = by["image-pull-secrets"]
    assert pod_spec(ps)["imagePullSecrets"] == [{"name": "regcred"}]
    r = rules_of(ps)
    assert r[("ClusterRole", "", "pinswap")] == ["/namespaces list,watch apps,web", "/secrets,serviceaccounts get "]
    for ns in ("apps", "web"):
        assert r[("Role", ns, "pinswap-recovery")] == ["/pods get,list,watch ", "events.k8s.io/events create,patch ", "apps/daemonsets,deployments,replicasets,statefulsets list,watch ", "batch/cronjobs,jobs list,watch "]
    assert rules_of(by["defaults"])[("ClusterRole", "", "pinswap")] == ["/namespaces list,watch ", "/pods get,list,watch ", "events.k8s.io/events create,patch ", "apps/daemonsets,deployments,replicasets,statefulsets list,watch ", "batch/cronjobs,jobs list,watch "]
    assert rules_of(by["backfill-off"])[("ClusterRole", "", "pinswap")] == ["/namespaces list,watch ", "/pods get,list,watch ", "events.k8s.io/events create,patch "]

    # Evicting only when the config turns it on, beside the Pod rules.
    assert "/pods/eviction create " not in rules_of(by["defaults"])[("ClusterRole", "", "pinswap")]
    assert rules_of(by["evict"])[("ClusterRole", "", "pinswap")] == [
        "/namespaces list,watch ", "/pods get,list,watch ", "events.k8s.io/events create,patch ",
        "apps/daemonsets,deployments,replicasets,statefulsets list,watch ", "batch/cronjobs,jobs list,watch ", "/pods/eviction create ", "batch/jobs get "]
    assert rules_of(by["evict-namespaces"])[("Role", "apps", "pinswap-recovery")] == [
        "/pods get,list,watch ", "events.k8s.io/events create,patch ",
        "apps/daemonsets,deployments,replicasets,statefulsets list,watch ", "batch/cronjobs,jobs list,watch ", "/pods/eviction create ", "batch/jobs get "]

    off = rules_of(by["recovery-off"])
    assert sorted(off) == [("ClusterRole", "", "pinswap-self-signed"), ("Role", "pinswap", "pinswap-self-signed")], off

    obs = by["observability"]
    sm = find(obs, "ServiceMonitor", "pinswap")
    metrics = find(obs, "Service", "pinswap-metrics")
    assert sm["metadata"]["labels"]["release"] == "kps"
    assert all(metrics["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert not all(find(obs, "Service", "pinswap")["metadata"]["labels"].get(k) == v
                   for k, v in sm["spec"]["selector"]["matchLabels"].items()), "the webhook's Service is not scraped"
    assert sm["spec"]["endpoints"][0]["port"] == metrics["spec"]["ports"][0]["name"] == "http"
    policy = find(obs, "NetworkPolicy", "pinswap")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert [rule["ports"][0]["port"] for rule in policy["ingress"]] == ["webhook", "http"]
    assert policy["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert policy["ingress"][1]["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    board = find(obs, "ConfigMap", "pinswap-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["pinswap.json"])["uid"] == "pinswap"
    find(obs, "PrometheusRule", "pinswap")

    other = by["another-namespace"]
    assert find(other, "MutatingWebhookConfiguration", "pinswap-mirror")["webhooks"][0]["clientConfig"]["service"] == {
        "name": "pinswap", "namespace": "mirror", "path": "/mutate", "port": 443}
    find(other, "ClusterRole", "pinswap:mirror")

    c = by["customised"]
    spec = pod_spec(c)
    container = spec["containers"][0]
    assert find(c, "Deployment", "pinswap")["spec"]["replicas"] == 3
    assert container["image"] == "registry.example.com/pinswap:0.1.0-dev"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "256Mi"}
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"][0]["key"] == "infra"
    assert list(spec["affinity"]) == ["nodeAffinity"], "a given affinity replaces the default"
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["hostAliases"] == [{"ip": "10.0.0.7", "hostnames": ["mirror.corp.internal"]}]
    assert "hostAliases" not in pod_spec(by["defaults"])
    aliased = render(chart, {"nodeAgent": {"enabled": True}, "hostAliases": [{"ip": "10.0.0.7", "hostnames": ["m.internal"]}]})
    agent = find(aliased, "DaemonSet", "pinswap-node-agent")["spec"]["template"]["spec"]
    assert agent["hostAliases"] == pod_spec(aliased)["hostAliases"] == [{"ip": "10.0.0.7", "hostnames": ["m.internal"]}]
    assert spec["terminationGracePeriodSeconds"] == 45
    template = find(c, "Deployment", "pinswap")["spec"]["template"]["metadata"]
    assert template["annotations"]["example.com/team"] == "platform"
    assert template["annotations"]["prometheus.io/port"] == "9090"
    assert template["labels"]["example.com/tier"] == "infra"
    assert container["env"][-1] == {"name": "AWS_REGION", "value": "eu-west-1"}
    assert spec["volumes"][-1]["name"] == container["volumeMounts"][-1]["name"] == "ecr"
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("webhook", 9443), ("http", 9090)]
    assert find(c, "Service", "pinswap-metrics")["spec"]["ports"][0]["port"] == 9090
    account = find(c, "ServiceAccount", "pinswap")
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/pinswap"}
    hook = find(c, "MutatingWebhookConfiguration", "pinswap")["webhooks"][0]
    assert (hook["timeoutSeconds"], hook["failurePolicy"], hook["reinvocationPolicy"]) == (5, "Fail", "Never")
    assert hook["namespaceSelector"]["matchLabels"] == {"pinswap.dev/enabled": "true"}
    assert [e["key"] for e in hook["namespaceSelector"]["matchExpressions"]] == [
        "kubernetes.io/metadata.name", "pinswap.dev/ignore"], "the built-in exclusions stay"
    assert [e["key"] for e in hook["objectSelector"]["matchExpressions"]] == ["pinswap.dev/ignore", "app"]
    # The same selectors reach the config, where the leader applies them.
    scope = yaml.safe_load(find(c, "ConfigMap", "pinswap")["data"]["config.yaml"])["scope"]
    assert scope == {
        "namespaceSelector": {"matchLabels": {"pinswap.dev/enabled": "true"}},
        "objectSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]},
    }
    assert find(c, "PodDisruptionBudget", "pinswap")["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in find(c, "PodDisruptionBudget", "pinswap")["spec"]

    # The pre-warm: the leader writes the warm set, the node agent reads it
    # and patches Nodes; the ConfigMap keeps the name pinswap looks for.
    pw = by["node-agent-prewarm"]
    r = rules_of(pw)
    assert r[("Role", "mirror-system", "mirror-pinswap-warm-set")] == ["/configmaps get,update pinswap-warm-set"]
    assert r[("Role", "mirror-system", "mirror-pinswap-node-agent")] == [
        "apps/daemonsets get mirror-pinswap-node-agent", "/configmaps get pinswap-warm-set"]
    assert r[("ClusterRole", "", "mirror-pinswap-node-agent:mirror-system")] == ["/nodes get,patch "]
    binding = find(pw, "ClusterRoleBinding", "mirror-pinswap-node-agent:mirror-system")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mirror-pinswap-node-agent", "namespace": "mirror-system"}]
    assert find(pw, "RoleBinding", "mirror-pinswap-warm-set")["subjects"][0]["name"] == "mirror-pinswap"
    warm = find(pw, "ConfigMap", "pinswap-warm-set")
    assert warm["metadata"]["annotations"] == {"pinswap.dev/warm-set": "written by the leader"} and "data" not in warm
    agent = find(pw, "DaemonSet", "mirror-pinswap-node-agent")["spec"]["template"]["spec"]
    container = agent["containers"][0]
    assert container["args"][-6:] == ["--cri-endpoint", "unix:///var/run/pinswap/cri.sock", "--image-fs", "/host-image-fs",
                                      "--metrics-address", "0.0.0.0:9091"]
    assert [e["name"] for e in container["env"]] == ["POD_NAMESPACE", "NODE_NAME", "HOME"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9091}]
    hosts = {v["name"]: v["hostPath"] for v in agent["volumes"] if "hostPath" in v}
    assert hosts["cri-socket"] == {"path": "/var/run/crio/crio.sock", "type": "Socket"}
    assert hosts["image-fs"] == {"path": "/var/lib/containers/storage", "type": "Directory"}
    assert {"name": "image-fs", "mountPath": "/host-image-fs", "readOnly": True} in container["volumeMounts"]
    # Without it, none of that.
    plain = by["node-agent"]
    assert "warm-set" not in json.dumps(plain) and "cri-socket" not in json.dumps(plain)
    assert not [k for k in rules_of(plain) if k[0] == "ClusterRole" and "node-agent" in k[2]]

    n = by["no-rbac-existing-account"]
    assert not {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ServiceAccount"} & set(kinds(n))
    assert pod_spec(n)["serviceAccountName"] == "ops"


def test_a_config_change_rolls_the_pods_and_a_tls_change_too(chart):
    def annotations(values):
        return find(render(chart, values), "Deployment", "pinswap")["spec"]["template"]["metadata"]["annotations"]

    base = annotations({})
    config = annotations({"config": {"target": {"registry": "other.example.com"}}})
    tls = annotations({"certManager": {"enabled": True}})
    assert config["checksum/config"] != base["checksum/config"]
    assert config["checksum/tls"] == base["checksum/tls"]
    assert tls["checksum/tls"] != base["checksum/tls"]
    cm = find(render(chart, {}), "ConfigMap", "pinswap")["data"]["config.yaml"]
    assert yaml.safe_load(cm) == {"target": {"registry": "mirror.example.com/cache"}}


SCHEMA_REFUSALS = [
    ({"replicaCount": "2"}, "/replicaCount': got string, want integer"),
    ({"replicaCount": 0}, "/replicaCount': minimum"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"image": {"tag": 1}}, "/image/tag': got number, want string"),
    ({"image": {"pullpolicy": "Always"}}, "/image': additional properties 'pullpolicy' not allowed"),
    ({"imagePullSecrets": ["regcred"]}, "/imagePullSecrets/0': got string, want object"),
    ({"webhook": {"failurePolicy": "ignore"}}, "/webhook/failurePolicy'"),
    ({"webhook": {"timeoutSeconds": 31}}, "/webhook/timeoutSeconds': maximum: got 31, want 30"),
    ({"webhook": {"namespaceSelector": {"matchLabel": {}}}}, "/webhook/namespaceSelector': additional properties 'matchLabel' not allowed"),
    ({"certManager": {"enabled": "yes"}}, "/certManager/enabled': got string, want boolean"),
    ({"networkPolicy": {"enable": True}}, "/networkPolicy': additional properties 'enable' not allowed"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval'"),
    ({"nodeSelector": {"zone": 1}}, "/nodeSelector/zone': got number, want string"),
    ({"hostAliases": [{"ip": "10.0.0.7", "hostname": ["m.internal"]}]}, "/hostAliases/0'"),
    # null removes a default, as on helm's command line.
    ({"config": {"target": {"registry": None}}}, "/config/target': missing property 'registry'"),
    ({"config": {"target": {"registry": "m.example.com"}, "copyPolicy": "later"}}, "/config/copyPolicy'"),
    ({"config": {"target": {"registry": "m.example.com"}, "failurepolicy": "open"}}, "/config': additional properties 'failurepolicy' not allowed"),
    ({"config": {"target": {"registry": "m.example.com"}, "mirrorOnly": {"profiles": ["mysql"]}}}, "/config/mirrorOnly/profiles/0'"),
    ({"nodeAgent": {"interval": "500ms"}}, "/nodeAgent/interval'"),
    ({"nodeAgent": {"mode": "digestOnly"}}, "/nodeAgent/mode'"),
    ({"nodeAgent": {"registryAuthSecret": "Node_Pull"}}, "/nodeAgent/registryAuthSecret'"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": "yes"}}}, "/config/prewarm/enabled': got string, want boolean"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"startupTaints": ["a"]}}}, "/config/prewarm': additional properties 'startupTaints' not allowed"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"top": 0}}}, "/config/prewarm/top': minimum"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"concurrency": 17}}}, "/config/prewarm/concurrency': maximum"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"namespaces": ["Apps"]}}}, "/config/prewarm/namespaces/0'"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"podSelector": {"matchLabel": {}}}}},
     "/config/prewarm/podSelector': additional properties 'matchLabel' not allowed"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"deadline": 600}}}, "/config/prewarm/deadline': got number, want string"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"maxBytes": "10%"}}}, "/config/prewarm/maxBytes'"),
]


@pytest.mark.parametrize("values,message", SCHEMA_REFUSALS, ids=[m[1] for m in SCHEMA_REFUSALS])
def test_the_values_schema_refuses_wrong_types_and_unknown_keys(chart, values, message):
    with pytest.raises(helm_python.HelmValuesError) as checked:
        chart.validate_schema(copy.deepcopy(values))
    assert message in str(checked.value)
    # An install meets the same refusal, before anything renders.
    with pytest.raises(helm_python.HelmValuesError) as rendered:
        chart.render(copy.deepcopy(values), name="pinswap", namespace="pinswap")
    assert message in str(rendered.value)


def test_the_schema_knows_every_top_level_config_key():
    default = yaml.safe_load(subprocess.run([BIN, "config", "default"], check=True, capture_output=True, text=True).stdout)
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert sorted(schema["properties"]["config"]["properties"]) == sorted(default)


def manifests(args):
    p = subprocess.run([BIN, "manifests", *args], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return [o for o in yaml.safe_load_all(p.stdout) if o]


def is_label_map(k, v):
    """metadata.labels, matchLabels, and a Service's flat selector."""
    return isinstance(v, dict) and (
        k in ("labels", "matchLabels") or (k == "selector" and all(isinstance(x, str) for x in v.values()))
    )


def without_chart_labels(value):
    if isinstance(value, dict):
        return {
            k: ({l: x for l, x in v.items() if l not in CHART_ONLY_LABELS} if is_label_map(k, v) else without_chart_labels(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [without_chart_labels(v) for v in value]
    return value


# The webhook's credentials in its Secret, and "*": the node agent lists the target.
STAR_CONFIG = {
    "target": {"registry": "m.example.com", "auth": {"username": "u", "passwordFile": "/var/run/secrets/pinswap/pw"}},
    "source": {"registries": [{"registry": "*"}, {"registry": "quay.io"}]},
}

# (values, namespace, extra `pinswap manifests` flags)
EQUIVALENT = [
    # Both defaults: the self-signed bootstrap, with nothing to name.
    ({}, "pinswap", []),
    ({}, "pinswap", ["--tls", "self-signed"]),
    ({"certManager": {"enabled": True}}, "pinswap", ["--tls", "cert-manager"]),
    ({}, "mirror", ["--tls", "self-signed"]),
    ({"certManager": {"enabled": True}}, "mirror", ["--tls", "cert-manager"]),
    ({"config": PULL_SECRETS_CONFIG, "imagePullSecrets": [{"name": "regcred"}]}, "pinswap", ["--tls", "self-signed", "--image-pull-secret", "regcred"]),
    (
        {"certManager": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "recovery": {"enabled": False}, "failurePolicy": "closed"}},
        "pinswap",
        ["--tls", "cert-manager"],
    ),
    ({"config": {"target": {"registry": "m.example.com"}, "server": {"listen": "0.0.0.0:9443", "healthListen": "0.0.0.0:9090"}}}, "pinswap", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "platforms": ["linux/amd64"], "recovery": {"namespaces": ["apps"]}}}, "pinswap", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "backfill": {"enabled": False}}}, "pinswap", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "copyPolicy": "none"}}, "pinswap", ["--tls", "self-signed"]),
    # The webhook's selectors, given as chart values or in the config: rendered from the same scope.
    ({"webhook": {"namespaceSelector": {"matchLabels": {"mirror": "enabled"}, "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["db"]}]},
                  "objectSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]}}}, "pinswap", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "scope": {"objectSelector": {"matchLabels": {"team": "a"}}}},
      "webhook": {"namespaceSelector": {"matchLabels": {"mirror": "enabled"}}}}, "mirror", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "recovery": {"evict": {"enabled": True}}}}, "pinswap", ["--tls", "self-signed"]),
    ({"certManager": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "recovery": {"namespaces": ["apps", "web"], "evict": {"enabled": True, "perMinute": 5}}}}, "pinswap", ["--tls", "cert-manager"]),
    ({"certManager": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "retention": {"enabled": True, "unusedFor": "240h"}}}, "mirror", ["--tls", "cert-manager"]),
    # Custom resources: exactly the kinds turned on, a rule per group, cluster-wide or per watched namespace.
    ({"config": {"target": {"registry": "m.example.com"}, "customResources": {"profiles": ["tekton", "argo-workflows", "flux"], "kinds": [
        {"group": "example.com", "kind": "Widget", "resource": "widgets", "paths": ["spec.image"]},
        {"group": "argoproj.io", "kind": "Sensor", "resource": "sensors", "paths": ["spec.template.container.image"]}]}}}, "pinswap", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "recovery": {"namespaces": ["ci"]}, "customResources": {"profiles": ["knative-serving", "kubevirt"]}}}, "mirror", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "backfill": {"enabled": False}, "customResources": {"profiles": ["kubevirt"]}}}, "pinswap", ["--tls", "self-signed"]),
    # The node agent, in each runtime and mode.
    ({"nodeAgent": {"enabled": True}}, "pinswap", ["--tls", "self-signed", "--node-agent"]),
    ({"nodeAgent": {"enabled": True, "runtime": "cri-o", "mode": "digest-only", "hostPath": "/etc/crio/mirrors.d"}}, "mirror",
     ["--tls", "self-signed", "--node-agent", "--node-agent-runtime", "cri-o", "--node-agent-mode", "digest-only", "--node-agent-dir", "/etc/crio/mirrors.d"]),
    # A "*" allowlist: anonymous, or with the read-only Secret named for it.
    ({"nodeAgent": {"enabled": True}, "config": STAR_CONFIG}, "pinswap", ["--tls", "self-signed", "--node-agent"]),
    ({"nodeAgent": {"enabled": True, "registryAuthSecret": "node-agent-pull"}, "config": STAR_CONFIG}, "pinswap",
     ["--tls", "self-signed", "--node-agent", "--node-agent-registry-auth-secret", "node-agent-pull"]),
    # Pre-warm: the warm set's ConfigMap and grants, the Node grant, and the
    # agent's CRI socket and image store, for each runtime; with a "*"
    # allowlist beside it, and with the backfill off (the leader still
    # watches workloads for the warm set).
    ({"nodeAgent": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True, "startupTaint": "pinswap.dev/warming"}}},
     "pinswap", ["--tls", "self-signed", "--node-agent"]),
    ({"nodeAgent": {"enabled": True, "runtime": "cri-o"}, "config": {"target": {"registry": "m.example.com"}, "prewarm": PREWARM_CONFIG}},
     "pinswap", ["--tls", "self-signed", "--node-agent", "--node-agent-runtime", "cri-o"]),
    ({"nodeAgent": {"enabled": True, "runtime": "cri-o"}, "config": {**STAR_CONFIG, "prewarm": {"enabled": True}}},
     "pinswap", ["--tls", "self-signed", "--node-agent", "--node-agent-runtime", "cri-o"]),
    ({"nodeAgent": {"enabled": True, "mode": "digest-only", "registryAuthSecret": "node-agent-pull"}, "certManager": {"enabled": True},
      "config": {**STAR_CONFIG, "backfill": {"enabled": False}, "recovery": {"namespaces": ["apps"]}, "prewarm": {"enabled": True}}},
     "pinswap", ["--tls", "cert-manager", "--node-agent", "--node-agent-mode", "digest-only", "--node-agent-registry-auth-secret", "node-agent-pull"]),
    # Pre-warm without the node agent: no warm set, no Node grant; the
    # leader's workload watches only. The same for the shared usage record.
    ({"config": {"target": {"registry": "m.example.com"}, "backfill": {"enabled": False}, "prewarm": {"enabled": True}}}, "pinswap", ["--tls", "self-signed"]),
    ({"config": {"target": {"registry": "m.example.com"}, "backfill": {"enabled": False}, "cluster": "eu-west-1", "sharing": {"enabled": True}}},
     "pinswap", ["--tls", "self-signed"]),
]


@pytest.mark.parametrize("values,namespace,flags", EQUIVALENT, ids=[f"{n}-{' '.join(f)}-{sorted(v)}" for v, n, f in EQUIVALENT])
def test_the_chart_and_pinswap_manifests_build_the_same_objects(chart, tmp_path, values, namespace, flags):
    rendered = render(chart, values, "pinswap", namespace)
    # The same config text, so the ConfigMap and its checksum can match too.
    config = tmp_path / "config.yaml"
    config.write_text(find(rendered, "ConfigMap", "pinswap")["data"]["config.yaml"])
    image = pod_spec(rendered)["containers"][0]["image"]
    printed = manifests(["--namespace", namespace, "--config", str(config), "--image", image, *flags])
    chart_objects = {key(o): without_chart_labels(o) for o in rendered}
    # Helm installs into a namespace it is given (--create-namespace); the
    # chart does not own it.
    cli_objects = {key(o): o for o in printed if o["kind"] != "Namespace"}
    assert sorted(chart_objects) == sorted(cli_objects)
    for k, want in cli_objects.items():
        assert chart_objects[k] == want, f"{k} differs between the chart and pinswap manifests"


def test_prewarm_without_the_node_agent_renders_no_warm_set(chart):
    values = {"config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True}}}
    objects = render(chart, values)
    text = json.dumps(objects)
    assert "warm-set" not in text and "node-agent" not in text
    assert not [r for rules in rules_of(objects).values() for r in rules if r.startswith("/nodes ")]
    assert "DaemonSet" not in kinds(objects)
    # The config still carries it: the leader chooses the set all the same.
    assert yaml.safe_load(find(objects, "ConfigMap", "pinswap")["data"]["config.yaml"])["prewarm"] == {"enabled": True}
    # With the node agent on, and prewarm off, neither.
    agent_only = render(chart, {"nodeAgent": {"enabled": True}, "config": {**values["config"], "prewarm": {"enabled": False}}})
    assert "warm-set" not in json.dumps(agent_only) and "NODE_NAME" not in json.dumps(agent_only)


def test_the_node_agents_node_grant_is_named_per_namespace_as_pinswap_manifests_names_it(chart, tmp_path):
    values = {"nodeAgent": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True}}}
    rendered = render(chart, values, "pinswap", "mirror")
    config = tmp_path / "config.yaml"
    config.write_text(find(rendered, "ConfigMap", "pinswap")["data"]["config.yaml"])
    printed = manifests(["--namespace", "mirror", "--config", str(config), "--tls", "self-signed", "--node-agent"])
    assert sorted(key(o) for o in rendered) == sorted(key(o) for o in printed if o["kind"] != "Namespace")


def test_the_prometheus_rule_carries_the_documented_alerts(chart):
    doc = (REPO / "docs" / "operations.md").read_text()
    block = doc.split("## Suggested alerts", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    documented = yaml.safe_load(block)["spec"]
    values = {"metrics": {"prometheusRule": {"enabled": True}}}
    default = find(render(chart, values), "PrometheusRule", "pinswap")
    assert default["spec"] == documented
    moved = find(render(chart, values, "mirror", "tools"), "PrometheusRule", "mirror-pinswap")
    text = json.dumps(moved["spec"])
    assert 'namespace=\\"tools\\"' in text and 'pod=~\\"mirror-pinswap-.*\\"' in text
    assert 'namespace=\\"pinswap\\"' not in text
    alerts = [r["alert"] for g in moved["spec"]["groups"] for r in g["rules"]]
    assert alerts == [r["alert"] for g in documented["groups"] for r in g["rules"]]


def test_the_dashboard_queries_only_documented_metrics_and_covers_each_area():
    board = json.loads((CHART / "files" / "dashboard.json").read_text())
    doc = (REPO / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(pinswap_[a-z_]+)`", doc, re.M))
    assert len(documented) > 10
    used = set()
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            for metric in re.findall(r"\bpinswap_[a-z_]+", target["expr"]):
                used.add(re.sub(r"_(bucket|sum|count)$", "", metric))
    assert used - documented == set()
    assert documented - used == set(), "every metric has a panel"
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Admissions and decisions", "Copies", "Caches", "Recovery", "Identity findings", "Source and target health", "Webhook listener", "Retention"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    made = subprocess.run(["python3", REPO / "scripts" / "make-dashboard.py", "-"], check=True, capture_output=True, text=True)
    assert made.stdout == (CHART / "files" / "dashboard.json").read_text(), "run scripts/make-dashboard.py"


def leaf_paths(values, prefix=""):
    for k, v in values.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v and k not in ("config", "resources", "podSecurityContext", "securityContext", "labels"):
            yield from leaf_paths(v, path + ".")
        else:
            yield path


def test_the_readme_lists_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    listed = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", readme, re.M))
    assert set(leaf_paths(values)) - listed == set()
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]) - {"global"} == set(values), "values.yaml and the schema list the same keys"


def test_notes_say_what_fail_means_for_availability(chart):
    closed = notes(chart, {"config": {"target": {"registry": "m.example.com"}, "failurePolicy": "closed"}})
    assert "failurePolicy: Fail" in closed and "no Pod can be created" in closed
    open_ = notes(chart, {"config": {"target": {"registry": "m.example.com"}}})
    assert "failurePolicy: Ignore" in open_ and "no Pod can be created" not in open_
    assert "placeholder" in notes(chart, {}) and "placeholder" not in open_
    # What is mirrored is what the config says, not "every Pod".
    assert "Images from docker.io (config.source.registries" in open_
    assert "first Pod to name an image keeps its" in open_
    two = notes(chart, {"config": {"target": {"registry": "m.example.com"}, "copyPolicy": "immediate",
                                   "source": {"registries": [{"registry": "ghcr.io"}, {"registry": "quay.io"}]}}})
    assert "Images from ghcr.io, quay.io (" in two and "copyPolicy immediate, swapPolicy exists" in two
    scoped = notes(chart, {"config": {"target": {"registry": "m.example.com"}, "scope": {"namespaceSelector": {"matchLabels": {"a": "b"}}}}})
    assert "only\nwhere config.scope selects" in scoped and "config.scope" not in open_
    purge = {"config": {"target": {"registry": "m.example.com"}, "cache": {"purgeEndpoint": True}}}
    assert "networkPolicy.enabled=true" in notes(chart, purge)
    assert "networkPolicy.enabled=true" not in notes(chart, {**purge, "networkPolicy": {"enabled": True}})
    # Pre-warm: what to look for on the nodes, or that nothing pulls the set.
    prewarm = {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True, "startupTaint": "pinswap.dev/warming"}}
    warm = notes(chart, {"nodeAgent": {"enabled": True}, "config": prewarm})
    assert "kubectl get nodes -L pinswap.dev/warm" in warm and "removes the taint pinswap.dev/warming" in warm
    assert "without nodeAgent.enabled" not in warm
    assert "config.prewarm.enabled without nodeAgent.enabled" in notes(chart, {"config": prewarm})
    assert "pinswap.dev/warm" not in open_ and "pinswap.dev/warm" not in notes(chart, {"nodeAgent": {"enabled": True}})


RENDER_REFUSALS = [
    ({"webhook": {"timeoutSeconds": 2}}, "config.server.admissionBudget: 2s must be below webhook.timeoutSeconds (2s)"),
    ({"config": {"target": {"registry": "m.example.com"}, "server": {"admissionBudget": "1m"}}}, "config.server.admissionBudget: 1m must be below"),
    ({"config": {"target": {"registry": "m.example.com"}, "server": {"admissionBudget": "1s500ms"}}, "webhook": {"timeoutSeconds": 1}},
     "config.server.admissionBudget: 1s500ms must be below webhook.timeoutSeconds (1s)"),
    ({"config": {"target": {"registry": "m.example.com"}, "server": {"listen": "127.0.0.1:8443"}}},
     "config.server.listen: 127.0.0.1:8443 is not reachable from the Service"),
    ({"config": {"target": {"registry": "m.example.com"}, "server": {"healthListen": "0.0.0.0:80"}}},
     "config.server.healthListen: port 80 needs a capability the Pod drops"),
    ({"config": {"target": {"registry": "m.example.com"}, "server": {"listen": "8443"}}}, "config.server.listen: \"8443\" is not IP:PORT"),
    ({"config": {"target": {"registry": "m.example.com"}, "scope": {"objectSelector": {"matchLabels": {"a": "b"}}}},
      "webhook": {"objectSelector": {"matchLabels": {"c": "d"}}}},
     "webhook.objectSelector and config.scope.objectSelector: set one"),
    ({"nodeAgent": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "source": {"imagePullSecrets": True}}},
     "nodeAgent.enabled: config.source.imagePullSecrets is true"),
    ({"nodeAgent": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "platforms": ["linux/amd64"]}},
     "nodeAgent.enabled: config.platforms is set"),
    ({"nodeAgent": {"enabled": True, "mode": "digest-only"}, "config": {"target": {"registry": "m.example.com"}, "identity": {"collisions": "repair"}}},
     "nodeAgent.mode: digest-only with config.identity.collisions repair"),
    ({"nodeAgent": {"enabled": True, "registryAuthSecret": "pinswap-registry-auth"}, "config": STAR_CONFIG},
     "nodeAgent.registryAuthSecret: pinswap-registry-auth is the webhook's Secret"),
    ({"nodeAgent": {"enabled": True, "registryAuthSecret": "node-agent-pull"}, "config": {"target": {"registry": "m.example.com"}}},
     "nodeAgent.registryAuthSecret: config.source.registries has no \"*\""),
    ({"nodeAgent": {"enabled": True, "registryAuthSecret": "node-agent-pull"},
      "config": {"target": {"aws": {"accountId": "123456789012", "region": "eu-west-1"}}, "source": {"registries": [{"registry": "*"}]}}},
     "nodeAgent.registryAuthSecret: config.target.aws"),
    ({"nodeAgent": {"enabled": True}, "config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True}, "recovery": {"enabled": False}}},
     "config.prewarm.enabled: true with config.recovery.enabled false"),
    ({"config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True}, "recovery": {"enabled": False}}},
     "config.prewarm.enabled: true with config.recovery.enabled false"),
    # A new node keeps a startup taint the agent cannot run under.
    ({"nodeAgent": {"enabled": True, "tolerations": [{"key": "infra", "operator": "Exists"}]},
      "config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True, "startupTaint": "pinswap.dev/warming"}}},
     "nodeAgent.tolerations: no toleration for config.prewarm.startupTaint pinswap.dev/warming"),
]


@pytest.mark.parametrize("values,message", RENDER_REFUSALS, ids=[m[1] for m in RENDER_REFUSALS])
def test_settings_the_pod_cannot_honour_are_refused_by_key(chart, values, message):
    with pytest.raises(helm_python.HelmRenderError) as refused:
        chart.render(copy.deepcopy(values), name="pinswap", namespace="pinswap")
    assert message in str(refused.value)


def test_settings_near_the_limits_render(chart):
    for values in (
        {"webhook": {"timeoutSeconds": 3}},
        {"config": {"target": {"registry": "m.example.com"}, "server": {"admissionBudget": "1500ms"}}, "webhook": {"timeoutSeconds": 2}},
        {"config": {"target": {"registry": "m.example.com"}, "server": {"listen": "[::]:9443", "healthListen": "0.0.0.0:1024"}}},
        {"nodeAgent": {"enabled": True, "tolerations": [{"key": "pinswap.dev/warming", "operator": "Exists", "effect": "NoSchedule"}]},
         "config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True, "startupTaint": "pinswap.dev/warming"}}},
        {"nodeAgent": {"enabled": True, "tolerations": []}, "config": {"target": {"registry": "m.example.com"}, "prewarm": {"enabled": True}}},
    ):
        assert render(chart, values)


# Durations as pinswap reads them (humantime), including the forms its own
# messages suggest (5sec) and docs/configuration.md lists (1h 30m)...
DURATIONS_READ = ["8s", "500ms", "1500ms", "5sec", "1h 30m", "1h30m", "2 hours", "1.5m", "1d", "3M", "10µs", "0", 0, " 30s ", "1m 30s 500ms"]
# ...and what it refuses: bare numbers, ISO 8601, signs, unknown units, and
# fractions of a nanosecond.
DURATIONS_REFUSED = ["8", "PT30S", "-5s", "1h-30m", "1.s", ".5s", "s", "30S", "5 s m", "1.5ns", "", "00", 8, 1.5]


def binary_reads_duration(value, tmp_path):
    """Whether pinswap itself parses `value` as a duration (cache.ttl takes any)."""
    config = tmp_path / "duration.yaml"
    config.write_text(yaml.safe_dump({"target": {"registry": "r.internal"}, "cache": {"ttl": value}}))
    checked = subprocess.run([BIN, "config", "validate", str(config)], capture_output=True, text=True)
    return checked.returncode == 0


@pytest.mark.parametrize("value", DURATIONS_READ + DURATIONS_REFUSED, ids=repr)
def test_the_schema_takes_exactly_the_durations_pinswap_reads(chart, tmp_path, value):
    read = binary_reads_duration(value, tmp_path)
    assert read == (value in DURATIONS_READ), f"pinswap {'reads' if read else 'refuses'} {value!r}"
    for config in ({"copyDeadline": value}, {"recovery": {"evict": {"after": value}}}):
        values = {"config": {"target": {"registry": "m.example.com"}, **config}}
        if read:
            chart.validate_schema(copy.deepcopy(values))
        else:
            with pytest.raises(helm_python.HelmValuesError):
                chart.validate_schema(copy.deepcopy(values))


# Byte sizes as pinswap reads them (prewarm.maxBytes, prewarm.freeSpaceFloor)...
SIZES_READ = ["20Gi", "512Mi", "64Ki", "500M", "1G", "1k", "1048576", 1048576, "007"]
# ...and what it refuses: other units and cases, fractions, signs, spaces, percentages.
SIZES_REFUSED = ["1Ti", "1K", "20GB", "20gi", "1.5Gi", "-1", -1, "+5", " 1Gi", "10%", "", 1.5, True]


@pytest.mark.parametrize("value", SIZES_READ + SIZES_REFUSED + ["0", 0, "0Gi"], ids=repr)
def test_the_schema_takes_exactly_the_sizes_pinswap_reads(chart, tmp_path, value):
    for key in ("maxBytes", "freeSpaceFloor"):
        config = tmp_path / "size.yaml"
        config.write_text(yaml.safe_dump({"target": {"registry": "r.internal"}, "prewarm": {key: value}}))
        read = subprocess.run([BIN, "config", "validate", str(config)], capture_output=True, text=True).returncode == 0
        # Zero is no growth at all: refused for maxBytes only.
        zero = value in ("0", 0, "0Gi")
        assert read == (value in SIZES_READ or (zero and key == "freeSpaceFloor")), f"pinswap {'reads' if read else 'refuses'} {key}: {value!r}"
        values = {"config": {"target": {"registry": "m.example.com"}, "prewarm": {key: value}}}
        if read:
            chart.validate_schema(copy.deepcopy(values))
        else:
            with pytest.raises(helm_python.HelmValuesError):
                chart.validate_schema(copy.deepcopy(values))


def test_the_schema_takes_pinswaps_default_config(chart):
    default = yaml.safe_load(subprocess.run([BIN, "config", "default"], check=True, capture_output=True, text=True).stdout)
    chart.validate_schema({"config": default})
    chart.validate_schema({"config": {**default, "prewarm": PREWARM_CONFIG}})


def secrets_of(pod):
    """Every Secret a Pod template reaches: volumes (plain and projected) and environment."""
    out = []
    for v in pod.get("volumes", []):
        if "secret" in v:
            out.append(v["secret"]["secretName"])
        for p in v.get("projected", {}).get("sources", []):
            if "secret" in p:
                out.append(p["secret"]["name"])
    for c in pod["containers"]:
        for e in c.get("env", []):
            if "secretKeyRef" in e.get("valueFrom", {}):
                out.append(e["valueFrom"]["secretKeyRef"]["name"])
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                out.append(e["secretRef"]["name"])
    return out


def agent_objects(objects, name="pinswap-node-agent"):
    return [o for o in objects if o["metadata"]["name"] == name]


@pytest.mark.parametrize("release", ["pinswap", "mirror"])
def test_the_node_agent_gets_no_secret_unless_a_read_only_one_is_named_for_star(chart, release):
    agent = f"{release}-pinswap-node-agent" if release != "pinswap" else "pinswap-node-agent"
    webhook_secret = f"{release}-pinswap-registry-auth" if release != "pinswap" else "pinswap-registry-auth"
    named = {"target": STAR_CONFIG["target"], "source": {"registries": [{"registry": "quay.io"}]}}
    for config in (None, named, STAR_CONFIG):
        values = {"nodeAgent": {"enabled": True}}
        if config:
            values["config"] = config
        objects = render(chart, values, release)
        ds = find(objects, "DaemonSet", agent)
        assert secrets_of(ds["spec"]["template"]["spec"]) == [], config
        text = json.dumps(agent_objects(objects, agent))
        assert "registry-auth" not in text and "/var/run/secrets/pinswap" not in text, config
        # The webhook keeps its own.
        assert secrets_of(pod_spec(objects, "pinswap" if release == "pinswap" else f"{release}-pinswap")) == [webhook_secret]

    objects = render(chart, {"nodeAgent": {"enabled": True, "registryAuthSecret": "node-agent-pull"}, "config": STAR_CONFIG}, release)
    pod = find(objects, "DaemonSet", agent)["spec"]["template"]["spec"]
    assert secrets_of(pod) == ["node-agent-pull"]
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"] == {"secretName": "node-agent-pull"}
    container = pod["containers"][0]
    mounts = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mounts == [{"name": "registry-auth", "mountPath": "/var/run/secrets/pinswap-node-agent", "readOnly": True}]
    assert container["args"][-2:] == ["--target-auth", "/var/run/secrets/pinswap-node-agent/.dockerconfigjson"]
    assert webhook_secret not in json.dumps(agent_objects(objects, agent))
