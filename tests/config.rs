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
