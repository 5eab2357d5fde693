"""Writes charts/pinswap/files/dashboard.json, the chart's Grafana dashboard
(one row per area, a panel per metric family of docs/operations.md).
Usage: python3 scripts/make-dashboard.py [-]   (- prints it instead)."""
import json
import pathlib
import sys

panels=[]; y=0; pid=0
def row(title):
    global y,pid
    pid+=1
    panels.append({"type":"row","id":pid,"title":title,"collapsed":False,"gridPos":{"h":1,"w":24,"x":0,"y":y},"panels":[]})
    y+=1
DS={"type":"prometheus","uid":"${datasource}"}
def ts(title, targets, unit="short", w=8, x=0, desc=""):
    global pid
    pid+=1
    panels.append({"type":"timeseries","id":pid,"title":title,"description":desc,"datasource":DS,
       "fieldConfig":{"defaults":{"unit":unit},"overrides":[]},
       "options":{"legend":{"displayMode":"list","placement":"bottom"},"tooltip":{"mode":"multi"}},
       "gridPos":{"h":8,"w":w,"x":x,"y":y},
       "targets":[{"refId":chr(65+i),"expr":e,"legendFormat":l,"datasource":DS} for i,(e,l) in enumerate(targets)]})
def line(items):
    global y
    x=0
    for it in items:
        ts(it[0], it[1], it[2], w=24//len(items), x=x, desc=it[3] if len(it)>3 else "")
        x+=24//len(items)
    y+=8
def sel(extra=""):
    return '{namespace=~"$namespace", pod=~"$pod"%s}' % (", "+extra if extra else "")
S=sel(); RES=sel('cache="resolution"'); ERR=sel('outcome="error"')
R="[$__rate_interval]"
def rate(m, by=None, s=S):
    return (f"sum by ({by}) " if by else "sum") + f"(rate({m}{s}{R}))"
def q(p, m):
    return f"histogram_quantile({p}, sum by (le) (rate({m}_bucket{S}{R})))"
row("Admissions and decisions")
line([
 ("Admissions by outcome",[(rate("pinswap_admissions_total","outcome"),"{{outcome}}")],"reqps","rewritten; unchanged (fail-open errors included); skipped; denied; invalid. Per-slot causes are in the pinswap.dev/decisions annotation."),
 ("Images rewritten by reason",[(rate("pinswap_rewrites_total","reason"),"{{reason}}")],"ops","present, copied, always; source_down: the source could not answer and the target's copy stood in."),
 ("Admission latency",[(q(0.5,"pinswap_admission_duration_seconds"),"p50"),(q(0.99,"pinswap_admission_duration_seconds"),"p99")],"s","Keep p99 well under server.admissionBudget (2 s by default)."),
])
line([
 ("Admission errors by cause",[(rate("pinswap_admission_errors_total","cause"),"{{cause}}")],"ops","Image slots that failed (left unchanged, or denied under failurePolicy: closed): credentials, source, target, budget, filter, reference."),
 ("Replicas by version",[(f"count by (version, commit) (pinswap_build_info{S})","{{version}} {{commit}}")],"short","pinswap_build_info: two lines during a rollout, one after it."),
 ("Private images denied; pull secrets unusable",[(rate("pinswap_private_image_denials_total","reason"),"denied: {{reason}}"),(rate("pinswap_pull_secret_errors_total","reason"),"pull secret: {{reason}}")],"ops","Private images left unchanged for a Pod that did not prove access (no_credentials, refused, unverified); pull secrets that could not be used (forbidden, missing, malformed, unreadable)."),
])
row("Copies")
line([
 ("Copies",[(rate("pinswap_copies_started_total"),"started"),(rate("pinswap_copies_succeeded_total"),"succeeded"),(rate("pinswap_copies_failed_total"),"failed")],"ops"),
 ("Bytes copied",[(rate("pinswap_copy_bytes_total"),"blob bytes")],"Bps"),
 ("Copy duration",[(q(0.5,"pinswap_copy_duration_seconds"),"p50"),(q(0.99,"pinswap_copy_duration_seconds"),"p99")],"s"),
 ("Referrers by outcome",[(rate("pinswap_referrers_copied_total","outcome"),"{{outcome}}")],"ops","Signatures, attestations and SBOMs following their images in the background; failed ones are retried."),
 ("Copies cut short",[(rate("pinswap_copies_cut_total","reason"),"{{reason}}")],"ops","Copies pinswap stopped: past copy.timeout (deadline), or a blob below copy.minTransferRate (transfer_rate). A steady rate is a source that answers too slowly."),
])
row("Caches")
hits=rate("pinswap_cache_hits_total","cache"); miss=rate("pinswap_cache_misses_total","cache")
line([
 ("Cache hit ratio",[(f"{hits} / ({hits} + {miss})","{{cache}}")],"percentunit"),
 ("Cache entries",[(f"sum by (cache) (pinswap_cache_entries{S})","{{cache}}")],"short"),
 ("Cache invalidations",[(rate("pinswap_cache_invalidations_total","cache, cause"),"{{cache}} {{cause}}")],"ops"),
])
row("Recovery")
line([
 ("Pull failures seen",[(rate("pinswap_pull_failures_total"),"pull failures")],"ops","Leader only: ErrImagePull and ImagePullBackOff on target images."),
 ("Re-mirrors by outcome",[(rate("pinswap_remirrors_total","outcome"),"{{outcome}}")],"ops"),
 ("Re-verification by outcome",[(rate("pinswap_reverifications_total","outcome"),"{{outcome}}")],"ops"),
 ("Evictions by outcome",[(rate("pinswap_evictions_total","outcome"),"{{outcome}}")],"ops","Leader only, with recovery.evict.enabled: Pods still in pull back-off after a re-mirror."),
 ("Leader",[(f"max by (pod) (pinswap_leader{S})","{{pod}}")],"short","1 on the replica holding the Lease."),
 ("Watched Pods and nodes left out",[(f"max(pinswap_watched_pods{S})","Pods in the leader's index"),(f"max(pinswap_nodes_without_platform{S})","nodes the platforms filter leaves out")],"short","Leader only. Nodes left out: their os/arch is not in platforms."),
])
line([
 ("Backfill images by state",[(f"max by (state) (pinswap_backfill_images{S})","{{state}}")],"short","Leader only: images running Pods and workload templates name that admission would mirror. pending: not tried yet or waiting for the source; denied: private, no proof."),
 ("Images the cluster names",[(f"max(pinswap_usage_images{S})","distinct references"),(rate("pinswap_usage_images_dropped_total"),"dropped past the bound"),(f"max(pinswap_usage_synced{S})","synced (1)")],"short","Leader only: distinct image references of watched Pods and templates."),
])
row("Identity findings")
line([
 ("Image-ID findings",[(f"sum by (kind) (increase(pinswap_identity_findings_total{S}[$__range]))","{{kind}}")],"short","non_unique and collision findings in the time range; see ImageIdentityNotUnique Events."),
])
row("Source and target health")
line([
 ("Source breakers open",[(f"max by (registry) (pinswap_source_breaker_open{S})","{{registry}}")],"short","Open circuit breakers of a source registry: 1 while a registry the config names is open, how many are open for registry=other. Admissions use the target's copies, copies wait."),
 ("Source failures",[(rate("pinswap_source_failures_total","registry, cause"),"{{registry}} {{cause}}")],"ops","Requests to a source registry that met an outage: unreachable, timeout, rate_limited, server_error, unauthorized."),
 ("Tag resolutions at the source",[(rate("pinswap_cache_misses_total",s=RES),"resolutions")],"ops","Resolution-cache misses: lookups that went to a source registry."),
])
line([
 ("Ready replicas",[('sum(kube_pod_status_ready{namespace=~"$namespace", pod=~"$pod", condition="true"})',"ready")],"short","/readyz is 503 while the target registry does not answer GET /v2/. Needs kube-state-metrics."),
 ("Failed share of copies",[(f'{rate("pinswap_copies_failed_total")} / {rate("pinswap_copies_started_total")}',"failed")],"percentunit","A source or target problem; each cause is in the log (mirror copy failed)."),
 ("Target re-verification errors",[(rate("pinswap_reverifications_total",s=ERR),"HEAD errors")],"ops","The target did not answer a re-verification HEAD."),
 ("ECR policy failures",[(rate("pinswap_ecr_policy_failures_total","action"),"{{action}}")],"ops","ecrOptions' access or lifecycle policy not applied to a repository pinswap created; pushes into it retry it first. Usually a missing IAM permission (the log names it)."),
])
row("Webhook listener")
line([
 ("Open connections",[(f"sum by (listener) (pinswap_connections{S})","{{listener}}")],"short","Bounded by server.maxConnections; at the limit the idlest connection is closed."),
 ("Connections closed by pinswap",[(rate("pinswap_connections_closed_total","listener, reason"),"{{listener}} {{reason}}")],"ops","Handshake, header and idle timeouts, evictions at the connection limit, refusals, drains."),
 ("Requests refused",[(rate("pinswap_requests_refused_total","reason"),"{{reason}}")],"reqps","413, 503 when the body budget is full, 408 for late bodies."),
 ("Request bodies in memory",[(f"sum(pinswap_body_bytes_in_flight{S})","in flight"),(f"max(pinswap_body_budget_bytes{S})","budget")],"bytes","Bytes held for request bodies, against server.bodyMemory."),
])
row("Retention")
line([
 ("Retention images by state",[(f"max by (state) (pinswap_retention_images{S})","{{state}}"),(f"max(pinswap_retention_unrecoverable{S})","kept: unrecoverable")],"short","Leader only, as of the last pass: in_use, unused (for less than unusedFor), kept, candidate (dry run, or a source could not answer), removed. Unrecoverable: the source no longer serves them."),
 ("Retention removals and passes",[(rate("pinswap_retention_removed_total","outcome"),"removed: {{outcome}}"),(rate("pinswap_retention_passes_total","outcome"),"pass: {{outcome}}")],"ops","Images removed, that a dry run would remove, or whose removal failed; passes done, skipped (not_synced, source_down) or failed (error; with sharing: records_unreadable, record_incomplete, record_not_published)."),
])
line([
 ("Usage records by cluster",[(f"max by (cluster) (pinswap_usage_record_images{S})","entries: {{cluster}}"),(f"max by (cluster) (time() - pinswap_usage_record_updated_seconds{S})","age s: {{cluster}}"),(f"max by (cluster) (pinswap_usage_record_stale{S})","stale: {{cluster}}"),(f"max(pinswap_usage_record_overdue{S})","this cluster's record overdue")],"short","Several clusters, one mirror: each cluster's usage record at the target as this leader last read or wrote it, its entries and age; a stale one keeps everything it lists until forgotten; overdue: the leader has published nothing for three sharing.interval."),
 ("Usage record publications",[(rate("pinswap_usage_record_publishes_total","outcome"),"{{outcome}}"),(f"max by (cluster) (pinswap_cluster_info{S})","cluster {{cluster}}"),(rate("pinswap_usage_record_versions_total","outcome"),"earlier version {{outcome}}")],"ops","This cluster's record published, incomplete (more images than a record holds: every cluster's retention stops), failed or not synced; this cluster's name; each replaced version removed, or kept by a registry that refuses deletes."),
])
var=lambda n,label,query: {"name":n,"type":"query","label":label,"datasource":DS,"query":{"query":query,"refId":n},"definition":query,"refresh":2,"includeAll":True,"multi":True,"current":{}}
dash={"title":"pinswap","uid":"pinswap","description":"pinswap admission webhook: admissions and decisions, copies, caches, recovery, identity findings, source and target health, the webhook listener, retention.",
 "tags":["pinswap","admission"],"schemaVersion":39,"version":1,"editable":True,"graphTooltip":1,"refresh":"30s",
 "time":{"from":"now-6h","to":"now"},
 "templating":{"list":[
   {"name":"datasource","type":"datasource","query":"prometheus","label":"Data source","current":{}},
   var("namespace","Namespace","label_values(pinswap_leader, namespace)"),
   var("pod","Pod",'label_values(pinswap_leader{namespace=~"$namespace"}, pod)')]},
 "panels":panels}
text = json.dumps(dash, indent=2) + "\n"
if sys.argv[1:] == ["-"]:
    sys.stdout.write(text)
else:
    out = pathlib.Path(__file__).resolve().parents[1] / "charts" / "pinswap" / "files" / "dashboard.json"
    out.write_text(text)
