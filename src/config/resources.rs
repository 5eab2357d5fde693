//! `customResources`: the image fields of custom resources whose
//! controllers make Pods from them or read the image themselves (Argo
//! Workflows, Tekton, Knative Serving, KubeVirt, Flux), and the user's own
//! kinds (docs/configuration.md#customresources). The leader copies what
//! they name without rewriting them (src/watch/resources.rs); `pinswap
//! mutate` rewrites them on request.
//!
//! A field is a path: names joined by `.` and `[*]` for every item of a
//! list, such as `spec.steps[*].image`. It is JSONPath (with or without the
//! leading `$.`) and JMESPath at once, and, unlike a JMESPath expression,
//! it says where the image is, so `pinswap mutate` can rewrite it. A kind
//! may also list JMESPath expressions, read but never rewritten.

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Paths per kind at most, and steps per path: what a config names, so
/// bounded by its author; the bounds keep a typo from costing much.
const MAX_FIELDS: usize = 64;
const MAX_STEPS: usize = 32;

/// The `customResources` block.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {profiles: [argo-workflows, tekton]}"
)]
pub struct CustomResources {
    /// Built-in kinds, by project.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<ResourceProfile>,
    /// The user's own kinds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kinds: Vec<CustomKind>,
    /// How often the leader asks the API server which of these kinds it
    /// serves, so a CRD installed later is watched.
    #[serde(default = "d_1m", with = "super::duration")]
    pub discovery_interval: Duration,
    /// `pinswap mutate` rewrites these fields too (admission never does:
    /// the webhook is sent Pods only).
    #[serde(default)]
    pub rewrite: bool,
}

fn d_1m() -> Duration {
    Duration::from_secs(60)
}

impl Default for CustomResources {
    fn default() -> Self {
        Self {
            profiles: Vec::new(),
            kinds: Vec::new(),
            discovery_interval: d_1m(),
            rewrite: false,
        }
    }
}

/// A project whose custom resources name images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResourceProfile {
    /// Argo Workflows: Workflow, WorkflowTemplate, CronWorkflow.
    ArgoWorkflows,
    /// Tekton Pipelines: Task, Pipeline, TaskRun, PipelineRun, StepAction.
    Tekton,
    /// Knative Serving: Service, Configuration.
    KnativeServing,
    /// KubeVirt: the `containerDisk` volumes of VirtualMachine and
    /// VirtualMachineInstance.
    Kubevirt,
    /// Flux: OCIRepository, whose artifacts are OCI too.
    Flux,
}

impl<'de> Deserialize<'de> for ResourceProfile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const WORDS: &[&str] = &[
            "argo-workflows",
            "tekton",
            "knative-serving",
            "kubevirt",
            "flux",
        ];
        Ok(Self::ALL[super::word(d, WORDS)?])
    }
}

/// One user kind: where its objects name images.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(
    rename_all = "camelCase",
    deny_unknown_fields,
    expecting = "a mapping such as {group: example.com, kind: Widget, resource: widgets, paths: [spec.image]}"
)]
pub struct CustomKind {
    /// The API group (`example.com`); the core group's kinds are not
    /// custom resources.
    pub group: String,
    /// The kind, as in `kind:`.
    pub kind: String,
    /// Its plural resource name, as RBAC names it (`widgets`).
    pub resource: String,
    /// Paths to image references (JSONPath or JMESPath: `spec.image`,
    /// `$.spec.steps[*].image`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<String>,
    /// JMESPath expressions giving image references (a string or a list
    /// of them); read, never rewritten.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jmespath: Vec<String>,
    /// Paths to pull secrets: a list of `{name: ...}`, one, or a name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<String>,
    /// Path to the ServiceAccount its Pods run as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
}

impl ResourceProfile {
    /// Every profile, in the order the docs list them.
    pub const ALL: [ResourceProfile; 5] = [
        Self::ArgoWorkflows,
        Self::Tekton,
        Self::KnativeServing,
        Self::Kubevirt,
        Self::Flux,
    ];

    /// As the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ArgoWorkflows => "argo-workflows",
            Self::Tekton => "tekton",
            Self::KnativeServing => "knative-serving",
            Self::Kubevirt => "kubevirt",
            Self::Flux => "flux",
        }
    }

    /// Its kinds, with the paths each names images at. Sources: Argo's
    /// `Template` (container, script, containerSet, init containers,
    /// sidecars), Tekton's `TaskSpec` (steps, sidecars, stepTemplate),
    /// Knative's `RevisionTemplateSpec` (a PodSpec), KubeVirt's
    /// `ContainerDiskSource`, Flux's `OCIRepositorySpec`.
    pub fn kinds(self) -> Vec<CustomKind> {
        let k = |group: &str, kind: &str, resource: &str, paths: Vec<String>, pull: &[&str], sa| {
            CustomKind {
                group: group.into(),
                kind: kind.into(),
                resource: resource.into(),
                paths,
                jmespath: Vec::new(),
                image_pull_secrets: pull.iter().map(|p| (*p).to_owned()).collect(),
                service_account_name: sa,
            }
        };
        let under = |base: &str, leaves: &[&str]| -> Vec<String> {
            leaves.iter().map(|l| format!("{base}.{l}")).collect()
        };
        match self {
            Self::ArgoWorkflows => {
                const T: &[&str] = &[
                    "container.image",
                    "script.image",
                    "containerSet.containers[*].image",
                    "initContainers[*].image",
                    "sidecars[*].image",
                ];
                let g = "argoproj.io";
                let sa = |b: &str| Some(format!("{b}.serviceAccountName"));
                // Every template, and the defaults merged into each.
                let templates = |b: &str| {
                    let mut p = under(&format!("{b}.templates[*]"), T);
                    p.extend(under(&format!("{b}.templateDefaults"), T));
                    p
                };
                vec![
                    k(
                        g,
                        "Workflow",
                        "workflows",
                        templates("spec"),
                        &["spec.imagePullSecrets"],
                        sa("spec"),
                    ),
                    k(
                        g,
                        "WorkflowTemplate",
                        "workflowtemplates",
                        templates("spec"),
                        &["spec.imagePullSecrets"],
                        sa("spec"),
                    ),
                    k(
                        g,
                        "CronWorkflow",
                        "cronworkflows",
                        templates("spec.workflowSpec"),
                        &["spec.workflowSpec.imagePullSecrets"],
                        sa("spec.workflowSpec"),
                    ),
                ]
            }
            Self::Tekton => {
                const T: &[&str] = &["steps[*].image", "sidecars[*].image", "stepTemplate.image"];
                let g = "tekton.dev";
                let pipeline = |base: &str| {
                    let mut p = under(&format!("{base}.tasks[*].taskSpec"), T);
                    p.extend(under(&format!("{base}.finally[*].taskSpec"), T));
                    p
                };
                vec![
                    k(g, "Task", "tasks", under("spec", T), &[], None),
                    k(g, "Pipeline", "pipelines", pipeline("spec"), &[], None),
                    k(
                        g,
                        "TaskRun",
                        "taskruns",
                        under("spec.taskSpec", T),
                        &["spec.podTemplate.imagePullSecrets"],
                        Some("spec.serviceAccountName".into()),
                    ),
                    k(
                        g,
                        "PipelineRun",
                        "pipelineruns",
                        pipeline("spec.pipelineSpec"),
                        &[
                            "spec.taskRunTemplate.podTemplate.imagePullSecrets",
                            "spec.taskRunSpecs[*].podTemplate.imagePullSecrets",
                        ],
                        Some("spec.taskRunTemplate.serviceAccountName".into()),
                    ),
                    k(
                        g,
                        "StepAction",
                        "stepactions",
                        vec!["spec.image".into()],
                        &[],
                        None,
                    ),
                ]
            }
            Self::KnativeServing => {
                let p = under(
                    "spec.template.spec",
                    &["containers[*].image", "initContainers[*].image"],
                );
                let pull = &["spec.template.spec.imagePullSecrets"];
                let sa = || Some("spec.template.spec.serviceAccountName".into());
                let g = "serving.knative.dev";
                vec![
                    k(g, "Service", "services", p.clone(), pull, sa()),
                    k(g, "Configuration", "configurations", p, pull, sa()),
                ]
            }
            Self::Kubevirt => {
                let g = "kubevirt.io";
                // Container disks, and the kernel and initrd a VM boots
                // from a container image.
                let vmi = |b: &str| {
                    vec![
                        format!("{b}.volumes[*].containerDisk.image"),
                        format!("{b}.domain.firmware.kernelBoot.container.image"),
                    ]
                };
                // A VM's DataVolume templates importing from a registry
                // (CDI's `docker://` URL; its secretRef is not a pull
                // secret).
                let mut vm = vmi("spec.template.spec");
                vm.push("spec.dataVolumeTemplates[*].spec.source.registry.url".into());
                vec![
                    k(
                        g,
                        "VirtualMachine",
                        "virtualmachines",
                        vm,
                        &[
                            "spec.template.spec.volumes[*].containerDisk.imagePullSecret",
                            "spec.template.spec.domain.firmware.kernelBoot.container.imagePullSecret",
                        ],
                        None,
                    ),
                    k(
                        g,
                        "VirtualMachineInstance",
                        "virtualmachineinstances",
                        vmi("spec"),
                        &[
                            "spec.volumes[*].containerDisk.imagePullSecret",
                            "spec.domain.firmware.kernelBoot.container.imagePullSecret",
                        ],
                        None,
                    ),
                ]
            }
            // The reference is `spec.url` with `spec.ref`; see
            // `ImageFields::oci_repository`.
            Self::Flux => vec![k(
                "source.toolkit.fluxcd.io",
                "OCIRepository",
                "ocirepositories",
                Vec::new(),
                &["spec.secretRef"],
                Some("spec.serviceAccountName".into()),
            )],
        }
    }
}

/// One step of a [`FieldPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A mapping's key.
    Key(String),
    /// Every item of a list.
    Each,
}

/// A parsed path: `a.b[*].c`, optionally after `$.`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldPath {
    text: String,
    steps: Vec<Step>,
}

impl FieldPath {
    /// Parses `text`, or says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest = text.strip_prefix("$.").unwrap_or(text);
        let mut steps = Vec::new();
        for part in rest.split('.') {
            let (name, mut tail) = part.split_at(part.find('[').unwrap_or(part.len()));
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(format!(
                    "{text:?} is not a path: expected names joined by `.`, each optionally followed by `[*]`, e.g. spec.steps[*].image"
                ));
            }
            steps.push(Step::Key(name.to_owned()));
            while let Some(t) = tail.strip_prefix("[*]") {
                steps.push(Step::Each);
                tail = t;
            }
            if !tail.is_empty() {
                return Err(format!(
                    "{text:?}: only `[*]` may follow a name (every item of a list), found {tail:?}"
                ));
            }
        }
        if steps.len() > MAX_STEPS {
            return Err(format!("{text:?} has more than {MAX_STEPS} steps"));
        }
        Ok(Self {
            text: text.to_owned(),
            steps,
        })
    }

    /// As written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Its steps.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Every value it reaches in `obj`, in document order.
    pub fn values<'a>(&self, obj: &'a Value) -> Vec<&'a Value> {
        let mut at = vec![obj];
        for step in &self.steps {
            at = at
                .into_iter()
                .flat_map(|v| -> Vec<&Value> {
                    match step {
                        Step::Key(k) => v.get(k).into_iter().collect(),
                        Step::Each => v.as_array().map(|a| a.iter().collect()).unwrap_or_default(),
                    }
                })
                .collect();
        }
        at
    }

    /// Every concrete location it reaches in `obj`, as keys and list
    /// indexes, with the string there.
    pub fn locations(&self, obj: &Value) -> Vec<(Vec<Location>, String)> {
        let mut at: Vec<(Vec<Location>, &Value)> = vec![(Vec::new(), obj)];
        for step in &self.steps {
            let mut next = Vec::new();
            for (path, v) in at {
                match step {
                    Step::Key(k) => {
                        if let Some(c) = v.get(k) {
                            let mut p = path.clone();
                            p.push(Location::Key(k.clone()));
                            next.push((p, c));
                        }
                    }
                    Step::Each => {
                        for (i, c) in v.as_array().into_iter().flatten().enumerate() {
                            let mut p = path.clone();
                            p.push(Location::Index(i));
                            next.push((p, c));
                        }
                    }
                }
            }
            at = next;
        }
        at.into_iter()
            .filter_map(|(p, v)| v.as_str().map(|s| (p, s.to_owned())))
            .collect()
    }
}

/// One step of a concrete location in an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A mapping's key.
    Key(String),
    /// A list's item.
    Index(usize),
}

/// `loc` as a JSON pointer (RFC 6901).
pub fn pointer(loc: &[Location]) -> String {
    let mut out = String::new();
    for l in loc {
        match l {
            Location::Key(k) => {
                out.push('/');
                out.push_str(&k.replace('~', "~0").replace('/', "~1"));
            }
            Location::Index(i) => out.push_str(&format!("/{i}")),
        }
    }
    out
}

/// `loc` as a field is reported and keyed in annotations:
/// `spec.steps[0].image`.
pub fn shown(loc: &[Location]) -> String {
    let mut out = String::new();
    for l in loc {
        match l {
            Location::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Location::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// Where one kind's objects name images, compiled.
#[derive(Debug, Clone)]
pub struct ImageFields {
    /// The API group.
    pub group: String,
    /// The kind.
    pub kind: String,
    /// The plural resource, as RBAC names it.
    pub resource: String,
    paths: Vec<FieldPath>,
    jmespath: Vec<(String, jmespath::Expression<'static>)>,
    pull_secrets: Vec<FieldPath>,
    service_account: Option<FieldPath>,
    /// Flux's OCIRepository: `spec.url` (`oci://`) with `spec.ref`.
    oci_repository: bool,
}

impl ImageFields {
    /// `group/Kind`, as logs and metrics name it.
    pub fn name(&self) -> String {
        format!("{}/{}", self.group, self.kind)
    }

    /// The paths a rewrite edits.
    pub fn paths(&self) -> &[FieldPath] {
        &self.paths
    }

    /// Whether it is Flux's OCIRepository, whose reference is two fields.
    pub fn is_oci_repository(&self) -> bool {
        self.oci_repository
    }

    /// The image references `obj` names, as written (an `oci://` or
    /// `docker://` scheme dropped), deduplicated, in document order, at most
    /// `max`. Values with a parameter (`$(params.image)`, Argo's
    /// `{{inputs.parameters.image}}`) name nothing until their controller
    /// fills them in.
    pub fn images(&self, obj: &Value, max: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut add = |s: &str| {
            let s = strip_scheme(s.trim());
            if out.len() < max && !s.is_empty() && !is_parameter(s) && seen.insert(s.to_owned()) {
                out.push(s.to_owned());
            }
        };
        for p in &self.paths {
            for v in p.values(obj) {
                if let Some(s) = v.as_str() {
                    add(s);
                }
            }
        }
        if !self.jmespath.is_empty()
            && let Ok(var) = jmespath::Variable::from_serializable(obj)
        {
            let var = jmespath::Rcvar::new(var);
            for (text, e) in &self.jmespath {
                let mut ctx = jmespath::Context::new(text, &jmespath::DEFAULT_RUNTIME);
                match jmespath::interpret(&var, e.as_ast(), &mut ctx) {
                    Ok(v) => strings(&v, &mut add, 0),
                    Err(e) => {
                        tracing::debug!(expression = %text, error = %e, "image expression failed on an object; it names nothing there")
                    }
                }
            }
        }
        if self.oci_repository
            && let Some(r) = oci_repository_ref(obj)
        {
            add(&r);
        }
        out
    }

    /// The fields (as [`shown`] writes them) where `obj` names a string
    /// at one of the paths now.
    pub fn field_keys(&self, obj: &Value) -> HashSet<String> {
        self.paths
            .iter()
            .flat_map(|p| p.locations(obj))
            .map(|(loc, _)| shown(&loc))
            .collect()
    }

    #[cfg(test)]
    fn images_all(&self, obj: &Value) -> Vec<String> {
        self.images(obj, usize::MAX)
    }

    /// The object's pull settings as a Pod spec has them:
    /// `{"imagePullSecrets": [{"name": ..}], "serviceAccountName": ..}`.
    pub fn pull(&self, obj: &Value) -> Value {
        let mut secrets = Vec::new();
        let mut names = HashSet::new();
        for p in &self.pull_secrets {
            for v in p.values(obj) {
                let items: Vec<&Value> = match v {
                    Value::Array(a) => a.iter().collect(),
                    v => vec![v],
                };
                for i in items {
                    let name = i.as_str().or_else(|| i.get("name").and_then(Value::as_str));
                    if let Some(n) = name
                        && names.insert(n)
                    {
                        secrets.push(json!({"name": n}));
                    }
                }
            }
        }
        let sa = self
            .service_account
            .as_ref()
            .and_then(|p| p.values(obj).into_iter().find_map(Value::as_str));
        json!({
            "imagePullSecrets": (!secrets.is_empty()).then_some(secrets),
            "serviceAccountName": sa,
        })
    }
}

/// A JMESPath result's strings, through nested lists.
fn strings(v: &jmespath::Variable, add: &mut impl FnMut(&str), depth: usize) {
    match v {
        jmespath::Variable::String(s) => add(s),
        jmespath::Variable::Array(a) if depth < 4 => {
            for i in a {
                strings(i, add, depth + 1)
            }
        }
        _ => {}
    }
}

/// A value its controller fills in: Tekton's `$(params.x)`, Argo's
/// `{{inputs.parameters.x}}`.
pub fn is_parameter(s: &str) -> bool {
    s.contains("$(") || s.contains("{{")
}

/// `oci://host/repo` and `docker://host/repo` name `host/repo`.
pub fn strip_scheme(s: &str) -> &str {
    s.strip_prefix("oci://")
        .or_else(|| s.strip_prefix("docker://"))
        .unwrap_or(s)
}

/// The reference an OCIRepository names, as Flux chooses it: `ref.digest`
/// first, then a semver range (a tag only the source's listing decides:
/// none here), then `ref.tag`, else `latest`.
fn oci_repository_ref(obj: &Value) -> Option<String> {
    let spec = obj.get("spec")?;
    let url = spec.get("url")?.as_str()?.strip_prefix("oci://")?;
    let r = spec.get("ref");
    let field = |k: &str| r.and_then(|r| r.get(k)).and_then(Value::as_str);
    if let Some(d) = field("digest") {
        return Some(format!("{url}@{d}"));
    }
    if field("semver").is_some() {
        return None;
    }
    Some(format!("{url}:{}", field("tag").unwrap_or("latest")))
}

impl CustomResources {
    /// Whether any kind is turned on.
    pub fn is_empty(&self) -> bool {
        self.profiles.is_empty() && self.kinds.is_empty()
    }

    /// Every kind turned on, a profile's first, one entry per group and
    /// kind (a user kind naming a built-in one adds to its fields).
    pub fn kinds(&self) -> Vec<CustomKind> {
        let mut out: Vec<CustomKind> = Vec::new();
        let all = self
            .profiles
            .iter()
            .flat_map(|p| p.kinds())
            .chain(self.kinds.iter().cloned());
        for k in all {
            match out
                .iter_mut()
                .find(|o| o.group == k.group && o.kind == k.kind)
            {
                Some(o) => {
                    for (mine, theirs) in [
                        (&mut o.paths, k.paths),
                        (&mut o.jmespath, k.jmespath),
                        (&mut o.image_pull_secrets, k.image_pull_secrets),
                    ] {
                        for t in theirs {
                            if !mine.contains(&t) {
                                mine.push(t);
                            }
                        }
                    }
                    o.service_account_name =
                        o.service_account_name.take().or(k.service_account_name);
                }
                None => out.push(k),
            }
        }
        out
    }

    /// [`CustomResources::kinds`] compiled. A config that loaded compiles.
    pub fn fields(&self) -> Vec<ImageFields> {
        self.kinds()
            .into_iter()
            .filter_map(|k| compile(&k).ok())
            .collect()
    }

    /// The problems of this block, at key path `path`.
    pub(super) fn problems(&self, path: &str, bad: &mut impl FnMut(String, String)) {
        let i = self.discovery_interval;
        if i < Duration::from_secs(1) || i > Duration::from_secs(86_400) {
            bad(
                format!("{path}.discoveryInterval"),
                format!(
                    "found {}, expected 1s to 24h, e.g. 1m",
                    humantime::format_duration(i)
                ),
            );
        }
        let profiled: Vec<(ResourceProfile, CustomKind)> = self
            .profiles
            .iter()
            .flat_map(|p| p.kinds().into_iter().map(move |k| (*p, k)))
            .collect();
        for (n, k) in self.kinds.iter().enumerate() {
            let at = format!("{path}.kinds[{n}]");
            // One resource per kind: RBAC and the watch name it.
            if let Some((p, o)) = profiled
                .iter()
                .find(|(_, o)| o.group == k.group && o.kind == k.kind && o.resource != k.resource)
            {
                bad(
                    format!("{at}.resource"),
                    format!(
                        "profile {} names {}/{} with resource {:?}",
                        p.as_str(),
                        o.group,
                        o.kind,
                        o.resource
                    ),
                );
            }
            if !k.group.contains('.') || !super::is_dns_subdomain(&k.group) {
                bad(
                    format!("{at}.group"),
                    format!(
                        "{:?} is not a custom resource's API group, a DNS subdomain such as example.com",
                        k.group
                    ),
                );
            }
            if k.kind.is_empty()
                || !k.kind.starts_with(|c: char| c.is_ascii_uppercase())
                || !k.kind.chars().all(|c| c.is_ascii_alphanumeric())
            {
                bad(
                    format!("{at}.kind"),
                    format!("{:?} is not a kind, such as Widget", k.kind),
                );
            }
            if !super::is_dns_label(&k.resource) {
                bad(
                    format!("{at}.resource"),
                    format!(
                        "{:?} is not a plural resource name, such as widgets",
                        k.resource
                    ),
                );
            }
            if k.paths.is_empty() && k.jmespath.is_empty() {
                bad(
                    format!("{at}.paths"),
                    "a kind needs at least one of paths and jmespath, e.g. paths: [spec.image]"
                        .into(),
                );
            }
            let lists = [
                ("paths", &k.paths),
                ("jmespath", &k.jmespath),
                ("imagePullSecrets", &k.image_pull_secrets),
            ];
            for (key, list) in lists {
                if list.len() > MAX_FIELDS {
                    bad(
                        format!("{at}.{key}"),
                        format!("{} entries, expected at most {MAX_FIELDS}", list.len()),
                    );
                }
            }
            for (j, p) in k.paths.iter().enumerate() {
                if let Err(why) = FieldPath::parse(p) {
                    bad(format!("{at}.paths[{j}]"), why);
                }
            }
            for (j, p) in k.image_pull_secrets.iter().enumerate() {
                if let Err(why) = FieldPath::parse(p) {
                    bad(format!("{at}.imagePullSecrets[{j}]"), why);
                }
            }
            if let Some(p) = &k.service_account_name
                && let Err(why) = FieldPath::parse(p)
            {
                bad(format!("{at}.serviceAccountName"), why);
            }
            for (j, e) in k.jmespath.iter().enumerate() {
                if let Some(why) = super::jmespath_problem(e) {
                    bad(format!("{at}.jmespath[{j}]"), why);
                }
            }
            if let Some(d) = self.kinds[..n]
                .iter()
                .position(|o| o.group == k.group && o.kind == k.kind && o.resource != k.resource)
            {
                bad(
                    format!("{at}.resource"),
                    format!(
                        "kinds[{d}] names {}/{} with resource {:?}",
                        k.group, k.kind, self.kinds[d].resource
                    ),
                );
            }
        }
    }
}

fn compile(k: &CustomKind) -> Result<ImageFields, String> {
    let paths = |ps: &[String]| {
        ps.iter()
            .map(|p| FieldPath::parse(p))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(ImageFields {
        group: k.group.clone(),
        kind: k.kind.clone(),
        resource: k.resource.clone(),
        paths: paths(&k.paths)?,
        jmespath: k
            .jmespath
            .iter()
            .map(|e| {
                jmespath::compile(e)
                    .map(|c| (e.clone(), c))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?,
        pull_secrets: paths(&k.image_pull_secrets)?,
        service_account: k
            .service_account_name
            .as_deref()
            .map(FieldPath::parse)
            .transpose()?,
        oci_repository: k.group == "source.toolkit.fluxcd.io" && k.kind == "OCIRepository",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn fields(profile: ResourceProfile, kind: &str) -> ImageFields {
        let c = CustomResources {
            profiles: vec![profile],
            ..Default::default()
        };
        c.fields().into_iter().find(|f| f.kind == kind).unwrap()
    }

    #[test]
    fn every_profile_compiles() {
        let c = CustomResources {
            profiles: ResourceProfile::ALL.to_vec(),
            ..Default::default()
        };
        assert_eq!(c.fields().len(), c.kinds().len());
        assert_eq!(c.kinds().len(), 13);
    }

    #[test]
    fn argo_templates_name_every_container_kind() {
        let wf = json!({"spec": {"serviceAccountName": "runner", "imagePullSecrets": [{"name": "reg"}], "templates": [
            {"name": "a", "container": {"image": "alpine:3"}, "sidecars": [{"image": "envoy:1"}]},
            {"name": "b", "script": {"image": "python:3"}, "initContainers": [{"image": "busybox"}]},
            {"name": "c", "containerSet": {"containers": [{"image": "alpine:3"}, {"image": "redis:7"}]}},
            {"name": "d", "steps": [[{"name": "x", "template": "a"}]]}
        ]}});
        let f = fields(ResourceProfile::ArgoWorkflows, "Workflow");
        assert_eq!(
            f.images_all(&wf),
            ["alpine:3", "python:3", "redis:7", "busybox", "envoy:1"]
        );
        assert_eq!(
            f.pull(&wf),
            json!({"imagePullSecrets": [{"name": "reg"}], "serviceAccountName": "runner"})
        );
        let cron = json!({"spec": {"workflowSpec": {"templates": [{"container": {"image": "alpine:3"}}]}}});
        assert_eq!(
            fields(ResourceProfile::ArgoWorkflows, "CronWorkflow").images_all(&cron),
            ["alpine:3"]
        );
    }

    #[test]
    fn tekton_pipelines_name_their_inline_tasks_and_finally() {
        let pr = json!({"spec": {"taskRunTemplate": {"serviceAccountName": "build"}, "pipelineSpec": {
            "tasks": [{"taskSpec": {"steps": [{"image": "golang:1.23"}], "stepTemplate": {"image": "alpine"}}}, {"taskRef": {"name": "t"}}],
            "finally": [{"taskSpec": {"sidecars": [{"image": "docker:dind"}]}}]
        }}});
        let f = fields(ResourceProfile::Tekton, "PipelineRun");
        assert_eq!(f.images_all(&pr), ["golang:1.23", "alpine", "docker:dind"]);
        assert_eq!(f.pull(&pr)["serviceAccountName"], "build");
    }

    #[test]
    fn kubevirt_container_disks_and_their_single_pull_secret() {
        let vm = json!({"spec": {"template": {"spec": {"volumes": [
            {"name": "root", "containerDisk": {"image": "quay.io/containerdisks/fedora:40", "imagePullSecret": "disks"}},
            {"name": "cloudinit", "cloudInitNoCloud": {"userData": "x"}}
        ]}}}});
        let f = fields(ResourceProfile::Kubevirt, "VirtualMachine");
        assert_eq!(f.images_all(&vm), ["quay.io/containerdisks/fedora:40"]);
        assert_eq!(f.pull(&vm)["imagePullSecrets"], json!([{"name": "disks"}]));
    }

    #[test]
    fn flux_oci_repositories_choose_as_flux_does() {
        let f = fields(ResourceProfile::Flux, "OCIRepository");
        let o = |r: Value| json!({"spec": {"url": "oci://ghcr.io/org/manifests", "ref": r}});
        assert_eq!(
            f.images_all(&o(json!({"tag": "v1"}))),
            ["ghcr.io/org/manifests:v1"]
        );
        assert_eq!(
            f.images_all(&o(json!({"tag": "v1", "digest": "sha256:ab"}))),
            ["ghcr.io/org/manifests@sha256:ab"]
        );
        assert!(f.images_all(&o(json!({"semver": ">=1.0"}))).is_empty());
        assert_eq!(
            f.images_all(&json!({"spec": {"url": "oci://r.example/m"}})),
            ["r.example/m:latest"]
        );
        assert!(
            f.images_all(&json!({"spec": {"url": "https://r.example/m"}}))
                .is_empty()
        );
    }

    #[test]
    fn user_kinds_read_paths_and_jmespath_and_merge_with_a_profile() {
        let yaml = "target: {registry: m.example}\ncustomResources:\n  profiles: [knative-serving]\n  kinds:\n  - {group: example.com, kind: Widget, resource: widgets, paths: [\"$.spec.image\", \"spec.extra[*].ref\"], jmespath: [\"spec.more[?enabled].image\"]}\n  - {group: serving.knative.dev, kind: Service, resource: services, paths: [spec.template.metadata.annotations.extra]}\n";
        let c = Config::from_yaml(yaml, "c.yaml").unwrap();
        let fs = c.custom_resources.fields();
        let w = fs.iter().find(|f| f.kind == "Widget").unwrap();
        let obj = json!({"spec": {"image": "docker://a:1", "extra": [{"ref": "b:2"}, {"ref": 3}], "more": [{"enabled": true, "image": "c:3"}, {"enabled": false, "image": "d:4"}]}});
        assert_eq!(w.images_all(&obj), ["a:1", "b:2", "c:3"]);
        let svc = fs
            .iter()
            .filter(|f| f.kind == "Service")
            .collect::<Vec<_>>();
        assert_eq!(svc.len(), 1, "one entry per kind");
        assert_eq!(svc[0].paths().len(), 3);
    }

    #[test]
    fn locations_name_keys_and_indexes() {
        let p = FieldPath::parse("spec.steps[*].image").unwrap();
        let obj = json!({"spec": {"steps": [{"image": "a"}, {"name": "x"}, {"image": "b"}]}});
        assert_eq!(
            p.locations(&obj),
            vec![
                (
                    vec![
                        Location::Key("spec".into()),
                        Location::Key("steps".into()),
                        Location::Index(0),
                        Location::Key("image".into())
                    ],
                    "a".into()
                ),
                (
                    vec![
                        Location::Key("spec".into()),
                        Location::Key("steps".into()),
                        Location::Index(2),
                        Location::Key("image".into())
                    ],
                    "b".into()
                ),
            ]
        );
    }

    #[test]
    fn each_bad_entry_is_named_by_its_key() {
        let yaml = "target: {registry: m.example}\ncustomResources:\n  profiles: [tekton]\n  discoveryInterval: 0s\n  kinds:\n  - {group: core, kind: widget, resource: Widgets, paths: [\"spec..image\", \"spec.steps[0].image\"], jmespath: [\"spec.[[\"], imagePullSecrets: [\"a b\"], serviceAccountName: \"\"}\n  - {group: example.com, kind: Widget, resource: widgets}\n  - {group: example.com, kind: Widget, resource: gadgets, paths: [spec.image]}\n  - {group: tekton.dev, kind: Task, resource: tekton-tasks, paths: [spec.image]}\n";
        let err = Config::from_yaml(yaml, "c.yaml").unwrap_err().to_string();
        for key in [
            "customResources.discoveryInterval",
            "customResources.kinds[0].group",
            "customResources.kinds[0].kind",
            "customResources.kinds[0].resource",
            "customResources.kinds[0].paths[0]",
            "customResources.kinds[0].paths[1]",
            "customResources.kinds[0].jmespath[0]",
            "customResources.kinds[0].imagePullSecrets[0]",
            "customResources.kinds[0].serviceAccountName",
            "customResources.kinds[1].paths",
            "customResources.kinds[2].resource",
            "customResources.kinds[3].resource: profile tekton names tekton.dev/Task with resource \"tasks\"",
        ] {
            assert!(err.contains(key), "{key} not named: {err}");
        }
        let unknown = Config::from_yaml(
            "target: {registry: m.example}\ncustomResources: {profiles: [argo]}\n",
            "c.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(unknown.contains("customResources.profiles[0]"), "{unknown}");
        assert!(unknown.contains("argo-workflows"), "{unknown}");
    }
}
