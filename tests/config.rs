//! `pinswap config default|validate` through the binary.

mod common;

use common::pinswap_bin;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(pinswap_bin())
        .args(args)
        .output()
        .expect("run pinswap");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn default_config_validates() {
    let (code, yaml, _) = run(&["config", "default"]);
    assert_eq!(code, 0);
    assert!(
        yaml.contains("swapPolicy: exists") && yaml.contains("# "),
        "commented YAML"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pinswap.yaml");
    std::fs::write(&file, &yaml).unwrap();
    let (code, out, err) = run(&["config", "validate", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{}: ok", file.display()));
}

#[test]
fn invalid_config_lists_every_problem_and_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        "target: {registry: mirror.example.com, auth: {username: u, password: Sup3rSecret}}\n\
         source: {registries: [{registry: \"*\"}], filters: [{jmespath: \"obj.[\"}]}\n\
         copyDeadline: 0s\n",
    )
    .unwrap();
    let (code, out, err) = run(&["config", "validate", file.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    let f = file.display();
    for want in [
        format!("{f}: target.auth.password: inline secrets are not accepted"),
        format!("{f}: source.filters[0].jmespath: not a valid JMESPath expression"),
        format!("{f}: copyDeadline: found 0s, expected more than 0s and at most 30s"),
    ] {
        assert!(err.contains(&want), "want {want:?} in {err}");
    }
    assert!(!err.contains("Sup3rSecret"), "secret echoed: {err}");

    std::fs::write(
        &file,
        "target: {registry: m.example.com}\nswapPolicy: never\n",
    )
    .unwrap();
    let (code, _, err) = run(&["config", "validate", file.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_eq!(
        err.trim(),
        format!("{f}:2:13: swapPolicy: unknown variant `never`, expected `exists` or `always`")
    );
}

fn validate(yaml: &str, flags: &[&str]) -> (i32, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pinswap.yaml");
    std::fs::write(&file, yaml).unwrap();
    let f = file.to_str().unwrap().to_owned();
    let mut args = vec!["config", "validate"];
    args.extend(flags);
    args.push(&f);
    let (code, out, err) = run(&args);
    (code, out, err, f)
}

#[test]
fn validate_warns_about_what_serve_and_manifests_would_say() {
    let yaml = "target: {registry: mirror.example.com/cache, auth: {username: u, passwordEnv: TOKEN}}\n\
                copyPolicy: immediate\n\
                copyDeadline: 12s\n\
                server: {admissionBudget: 11s, listen: \"127.0.0.1:8443\", tlsCert: /etc/tls.crt, tlsKey: /etc/tls.key}\n";
    let (code, out, err, f) = validate(yaml, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{f}: ok"));
    let want = [
        format!(
            "warning: {f}: target.registry: mirror.example.com/cache is the placeholder `pinswap config default` writes; set the registry to mirror into, HOST[:PORT][/prefix]"
        ),
        format!(
            "warning: {f}: copyDeadline: found 12s with copyPolicy immediate, longer than server.admissionBudget (11s): an admission waits for a copy at most the budget; raise server.admissionBudget too, or lower copyDeadline"
        ),
        format!(
            "warning: {f}: server.admissionBudget: 11s must be below the webhook's timeoutSeconds (10s), or the API server gives up first (`pinswap manifests` refuses this)"
        ),
        format!(
            "warning: {f}: server.listen: 127.0.0.1:8443 is not reachable from the Service and the kubelet's probes; listen on 0.0.0.0:8443 (`pinswap manifests` refuses this)"
        ),
        format!(
            "warning: {f}: target.auth.passwordEnv: the generated Deployment sets no such variable; use passwordFile under /var/run/secrets/pinswap/ (Secret pinswap-registry-auth) (`pinswap manifests` refuses this)"
        ),
        format!(
            "warning: {f}: server.tlsCert: read by `pinswap serve` alone; an install from `pinswap manifests` or the Helm chart passes its own --tls-cert and --tls-key instead (`pinswap manifests` warns)"
        ),
    ];
    let got: Vec<&str> = err.lines().collect();
    assert_eq!(got, want.iter().map(String::as_str).collect::<Vec<_>>());

    // --strict: the same warnings, then exit 1 and no "ok".
    let (code, out, err, f) = validate(yaml, &["--strict"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty(), "{out}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("warning: ")).count(),
        want.len()
    );
    assert_eq!(
        err.lines().last().unwrap(),
        format!("{f}: 6 warning(s), refused with --strict")
    );

    // Nothing to warn about: --strict passes.
    let (code, out, err, f) = validate(
        "target: {registry: registry.internal:5000/mirror}\n",
        &["--strict"],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(out.trim(), format!("{f}: ok"));
}

#[test]
fn a_default_config_fails_strict_validation_until_its_target_is_set() {
    let (_, yaml, _) = run(&["config", "default"]);
    let (code, _, err, f) = validate(&yaml, &["--strict"]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with(&format!(
            "warning: {f}: target.registry: mirror.example.com/cache is the placeholder"
        )),
        "{err}"
    );
    let (code, _, err, _) = validate(
        &yaml.replace(
            "registry: mirror.example.com/cache",
            "registry: registry.internal/cache",
        ),
        &["--strict"],
    );
    assert_eq!(code, 0, "{err}");
}

#[test]
fn schema_errors_say_what_to_write_and_keep_their_position() {
    for (yaml, want) in [
        (
            "target: {registry: r.internal}\nsource: {registries: [docker.io]}\n",
            ":2:23: source.registries[0]: invalid type: string \"docker.io\", expected a mapping such as {registry: docker.io}",
        ),
        (
            "target: {registry: r.internal}\ncopyDeadline: PT30S\n",
            ": copyDeadline: found \"PT30S\" (ISO 8601 durations are not read), expected a duration such as 30s, 500ms, 5m or 1h 30m (a number and a unit: ms, s, m, h, d; several add up)",
        ),
        (
            "target: {registry: r.internal}\ncopyPolicyy: force\n",
            ":2:1: copyPolicyy: unknown field `copyPolicyy` (did you mean `copyPolicy`?), expected one of `target`,",
        ),
        (
            "target: {registry: r.internal}\nswapPolicy: [exists]\n",
            ":2:13: swapPolicy: invalid type: list, expected `exists` or `always`",
        ),
    ] {
        let (code, out, err, f) = validate(yaml, &[]);
        assert_eq!(code, 1, "{yaml}");
        assert!(out.is_empty());
        assert!(err.starts_with(&format!("{f}{want}")), "{yaml}: {err}");
    }
}

#[test]
fn a_k8s_image_swapper_config_is_sent_to_config_convert() {
    let yaml = "dryRun: true\nlogLevel: debug\nlogFormat: console\nimageSwapPolicy: exists\nimageCopyPolicy: delayed\n\
                source: {filters: [{jmespath: \"obj.metadata.namespace == 'kube-system'\"}]}\n\
                target: {aws: {accountId: \"123456789012\", region: eu-west-1}}\n";
    let (code, out, err, f) = validate(yaml, &[]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert_eq!(
        err.trim(),
        format!(
            "{f}: a k8s-image-swapper config (it has dryRun, logLevel, logFormat, imageSwapPolicy, imageCopyPolicy), not a pinswap one; convert it with `pinswap config convert {f} > pinswap.yaml` and check the result with `pinswap config validate pinswap.yaml`"
        )
    );
}
