//! `scripts/build-image.sh` against a Debian repository of its own: a
//! flat `file:` repository of small packages named like the image's
//! (`dpkg-deb --build`), read by the machine's apt through `APT_CONFIG`, so
//! candidates change when the test adds a version, and no network is used.
//! The binary is a Go program built for the machine's architecture or
//! another one.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use sha2::{Digest, Sha256};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn host_arch() -> String {
    let out = Command::new("dpkg")
        .arg("--print-architecture")
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// An architecture other than the machine's, for a binary built for it.
fn foreign_arch() -> &'static str {
    if host_arch() == "arm64" {
        "amd64"
    } else {
        "arm64"
    }
}

fn hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A flat apt repository and the apt configuration that reads only it.
struct Repo {
    dir: tempfile::TempDir,
    /// (package, version, architecture, file name, sha256, size)
    entries: Vec<(String, String, String, String, String, u64)>,
}

impl Repo {
    /// The image's packages, one version each: libc6 and libgcc-s1 for
    /// the machine's architecture and another, the rest for all.
    fn new(libc6: &str) -> Repo {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in [
            "repo",
            "lists/partial",
            "cache/archives/partial",
            "etc/parts",
            "etc/prefs",
        ] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        std::fs::write(d.join("status"), "").unwrap();
        std::fs::write(
            d.join("etc/sources.list"),
            format!("deb [trusted=yes] file:{} ./\n", d.join("repo").display()),
        )
        .unwrap();
        let host = host_arch();
        std::fs::write(
            d.join("apt.conf"),
            format!(
                "Dir::Etc::SourceList \"{0}/etc/sources.list\";\n\
                 Dir::Etc::SourceParts \"{0}/etc/parts\";\n\
                 Dir::Etc::Preferences \"{0}/etc/preferences\";\n\
                 Dir::Etc::PreferencesParts \"{0}/etc/prefs\";\n\
                 Dir::State::Lists \"{0}/lists\";\n\
                 Dir::State::status \"{0}/status\";\n\
                 Dir::Cache \"{0}/cache\";\n\
                 APT::Architecture \"{host}\";\n\
                 APT::Architectures {{ \"{host}\"; \"{1}\"; }};\n",
                d.display(),
                foreign_arch()
            ),
        )
        .unwrap();
        let mut repo = Repo {
            dir,
            entries: Vec::new(),
        };
        for arch in [host.as_str(), foreign_arch()] {
            repo.add("libc6", libc6, arch);
            repo.add("libgcc-s1", "12.2.0-14+deb12u1", arch);
        }
        repo.add("ca-certificates", "20250419~deb12u2", "all");
        repo.add("netbase", "6.4", "all");
        repo
    }

    fn apt_config(&self) -> PathBuf {
        self.dir.path().join("apt.conf")
    }

    /// Builds `package` `version` for `arch` into the repository and lets
    /// apt read the new index.
    fn add(&mut self, package: &str, version: &str, arch: &str) {
        let d = self.dir.path();
        let tree = d.join(format!("build/{package}-{version}-{arch}"));
        std::fs::create_dir_all(tree.join("DEBIAN")).unwrap();
        std::fs::write(
            tree.join("DEBIAN/control"),
            format!(
                "Package: {package}\nVersion: {version}\nArchitecture: {arch}\n\
                 Maintainer: pinswap <pinswap@example.com>\nDescription: {package} for the image test\n"
            ),
        )
        .unwrap();
        let data = tree.join(format!("usr/share/{package}"));
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("version"), format!("{version} {arch}\n")).unwrap();
        if package == "ca-certificates" {
            let certs = tree.join("usr/share/ca-certificates/test");
            std::fs::create_dir_all(&certs).unwrap();
            std::fs::write(certs.join("test.crt"), "not a certificate\n").unwrap();
        }
        let file = format!("{package}_{version}_{arch}.deb");
        let deb = d.join("repo").join(&file);
        run_ok(
            Command::new("dpkg-deb")
                .args(["--root-owner-group", "--build"])
                .arg(&tree)
                .arg(&deb),
        );
        let bytes = std::fs::read(&deb).unwrap();
        self.entries.push((
            package.into(),
            version.into(),
            arch.into(),
            file,
            hex(&bytes),
            bytes.len() as u64,
        ));
        let mut index = String::new();
        for (p, v, a, f, sum, size) in &self.entries {
            index.push_str(&format!(
                "Package: {p}\nVersion: {v}\nArchitecture: {a}\nMaintainer: pinswap <pinswap@example.com>\n\
                 Filename: ./{f}\nSize: {size}\nSHA256: {sum}\nDescription: {p} for the image test\n\n"
            ));
        }
        std::fs::write(d.join("repo/Packages"), index).unwrap();
        run_ok(
            Command::new("apt-get")
                .args(["update", "-qq"])
                .env("APT_CONFIG", self.apt_config()),
        );
    }
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A small static Go program for `arch`, standing in for pinswap's binary.
fn go_binary(dir: &Path, arch: &str) -> PathBuf {
    let src = dir.join(format!("bin-{arch}"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("go.mod"), "module imagetest\n\ngo 1.22\n").unwrap();
    std::fs::write(src.join("main.go"), "package main\n\nfunc main() {}\n").unwrap();
    let bin = dir.join(format!("pinswap-{arch}"));
    run_ok(
        Command::new("go")
            .args(["build", "-o"])
            .arg(&bin)
            .arg(".")
            .current_dir(&src)
            .env("GOOS", "linux")
            .env("GOARCH", arch)
            .env("CGO_ENABLED", "0")
            .env("GOFLAGS", "-mod=mod")
            .env("GOTOOLCHAIN", "local"),
    );
    bin
}

/// How a run of the script is set up.
struct Build<'a> {
    repo: &'a Repo,
    debs: PathBuf,
    offline: bool,
    /// A directory put first on PATH (an apt-get that records or refuses).
    path_first: Option<PathBuf>,
}

impl Build<'_> {
    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(root().join("scripts/build-image.sh"));
        cmd.args(args)
            .env("APT_CONFIG", self.repo.apt_config())
            .env("PINSWAP_IMAGE_DEBS", &self.debs)
            .env("SOURCE_DATE_EPOCH", "0")
            .env_remove("PINSWAP_IMAGE_OFFLINE");
        if self.offline {
            cmd.env("PINSWAP_IMAGE_OFFLINE", "1");
        }
        if let Some(dir) = &self.path_first {
            let path = std::env::var("PATH").unwrap_or_default();
            cmd.env("PATH", format!("{}:{path}", dir.display()));
        }
        cmd.output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "build-image.sh {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// The file tree for `binary`.
    fn rootfs(&self, binary: &Path, into: &Path) -> PathBuf {
        self.ok(&[
            "--binary",
            binary.to_str().unwrap(),
            "--rootfs",
            into.to_str().unwrap(),
        ]);
        into.to_path_buf()
    }
}

fn status_field(rootfs: &Path, package: &str, field: &str) -> String {
    let control =
        std::fs::read_to_string(rootfs.join("var/lib/dpkg/status.d").join(package)).unwrap();
    control
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}: ")))
        .unwrap_or_else(|| panic!("{package}'s control has no {field}: {control}"))
        .to_owned()
}

/// The `.deb` files in the cache directory, sorted.
fn cached(debs: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(debs)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".deb"))
        .collect();
    v.sort();
    v
}

/// An `apt-get` first on PATH that appends `ARGS | mode of the cache | mode
/// of its working directory` to `log`, then runs the real one (or, with
/// `refuse`, fails).
fn apt_spy(dir: &Path, debs: &Path, log: &Path, refuse: bool) -> PathBuf {
    let bin = dir.join("spy");
    std::fs::create_dir_all(&bin).unwrap();
    let real =
        String::from_utf8(run_ok(Command::new("sh").args(["-c", "command -v apt-get"])).stdout)
            .unwrap();
    let tail = if refuse {
        "exit 100".to_owned()
    } else {
        format!("exec {} \"$@\"", real.trim())
    };
    std::fs::write(
        bin.join("apt-get"),
        format!(
            "#!/bin/sh\necho \"$* | $(stat -c %a '{}') | $(stat -c %a .)\" >>'{}'\n{tail}\n",
            debs.display(),
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(bin.join("apt-get"), std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// The image says its lookup order: /etc/hosts (where the kubelet writes
/// hostAliases) before DNS, and the users and groups from files.
#[test]
fn the_file_tree_reads_etc_hosts_first_and_knows_nonroot() {
    let repo = Repo::new("2.36-9+deb12u14");
    let dir = tempfile::tempdir().unwrap();
    let bin = go_binary(dir.path(), host_arch_go());
    let build = Build {
        repo: &repo,
        debs: dir.path().join("debs"),
        offline: false,
        path_first: None,
    };
    let tree = build.rootfs(&bin, &dir.path().join("rootfs"));
    let nsswitch = std::fs::read_to_string(tree.join("etc/nsswitch.conf"))
        .expect("the image has /etc/nsswitch.conf");
    let hosts: Vec<&str> = nsswitch
        .lines()
        .find_map(|l| l.strip_prefix("hosts:"))
        .expect("a hosts: line")
        .split_whitespace()
        .collect();
    assert_eq!(hosts, ["files", "dns"], "{nsswitch}");
    for (db, line) in [
        (
            "passwd",
            "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin",
        ),
        ("group", "nonroot:x:65532:"),
    ] {
        let text = std::fs::read_to_string(tree.join("etc").join(db)).unwrap();
        assert!(text.lines().any(|l| l == line), "/etc/{db}: {text}");
        let s = format!("{}:", db);
        assert!(
            nsswitch
                .lines()
                .any(|l| l.starts_with(&s) && l.ends_with("files"))
        );
    }
}

fn host_arch_go() -> &'static str {
    if host_arch() == "arm64" {
        "arm64"
    } else {
        "amd64"
    }
}

/// The image's config and index say the binary's architecture, and its
/// packages are that architecture's.
#[test]
fn the_image_is_the_binarys_architecture() {
    let repo = Repo::new("2.36-9+deb12u14");
    let dir = tempfile::tempdir().unwrap();
    let arch = foreign_arch();
    let bin = go_binary(dir.path(), arch);
    let build = Build {
        repo: &repo,
        debs: dir.path().join("debs"),
        offline: false,
        path_first: None,
    };
    let layout = dir.path().join("layout");
    build.ok(&[
        "--binary",
        bin.to_str().unwrap(),
        "--out",
        layout.to_str().unwrap(),
    ]);
    let read =
        |p: PathBuf| -> Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    let blob = |d: &Value| {
        read(
            layout
                .join("blobs/sha256")
                .join(d.as_str().unwrap().trim_start_matches("sha256:")),
        )
    };
    let index = read(layout.join("index.json"));
    assert_eq!(index["manifests"][0]["platform"]["architecture"], arch);
    let manifest = blob(&index["manifests"][0]["digest"]);
    let config = blob(&manifest["config"]["digest"]);
    assert_eq!(config["architecture"], arch, "{config}");

    let tree = build.rootfs(&bin, &dir.path().join("rootfs"));
    assert_eq!(status_field(&tree, "libc6", "Architecture"), arch);
    assert_eq!(status_field(&tree, "libgcc-s1", "Architecture"), arch);
    assert_eq!(status_field(&tree, "netbase", "Architecture"), "all");

    // An architecture the binary is not: refused, naming both.
    let out = build.run(&[
        "--binary",
        bin.to_str().unwrap(),
        "--arch",
        &host_arch(),
        "--out",
        layout.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(arch), "{err}");
}

/// apt-get download runs in a directory of its own, and the cache is never
/// writable by others, while it downloads or after, even when a run before
/// left it so.
#[test]
fn the_package_cache_is_never_world_writable() {
    let repo = Repo::new("2.36-9+deb12u14");
    let dir = tempfile::tempdir().unwrap();
    let bin = go_binary(dir.path(), host_arch_go());
    let debs = dir.path().join("debs");
    std::fs::create_dir_all(&debs).unwrap();
    std::fs::set_permissions(&debs, std::fs::Permissions::from_mode(0o755)).unwrap();
    let log = dir.path().join("apt.log");
    let build = Build {
        repo: &repo,
        debs: debs.clone(),
        offline: false,
        path_first: Some(apt_spy(dir.path(), &debs, &log, false)),
    };
    build.rootfs(&bin, &dir.path().join("rootfs"));
    let seen = std::fs::read_to_string(&log).unwrap();
    let downloads: Vec<&str> = seen.lines().filter(|l| l.starts_with("download")).collect();
    assert!(!downloads.is_empty(), "apt-get download ran: {seen}");
    let world_writable = |mode: &str| u32::from_str_radix(mode.trim(), 8).unwrap() & 0o002 != 0;
    for l in &downloads {
        let parts: Vec<&str> = l.split(" | ").collect();
        assert!(!world_writable(parts[1]), "the cache during {l}");
        assert!(!world_writable(parts[2]), "apt-get's directory during {l}");
    }
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode();
    assert_eq!(mode(&debs) & 0o022, 0, "the cache after the build");

    // A cache an earlier run left writable by all is closed again.
    std::fs::set_permissions(&debs, std::fs::Permissions::from_mode(0o777)).unwrap();
    build.rootfs(&bin, &dir.path().join("rootfs2"));
    assert_eq!(mode(&debs) & 0o022, 0, "the cache after a second build");
    for f in cached(&debs) {
        assert_eq!(mode(&debs.join(&f)) & 0o022, 0, "{f}");
    }
}

/// The version used is apt's candidate, compared as Debian versions
/// (deb12u14 after deb12u7): a cached older one is replaced when online,
/// and kept and used offline, where apt is never run.
#[test]
fn a_new_candidate_replaces_the_cached_package_and_offline_keeps_it() {
    let old = "2.36-9+deb12u7";
    let new = "2.36-9+deb12u14";
    let arch = host_arch();
    let mut repo = Repo::new(old);
    let dir = tempfile::tempdir().unwrap();
    let bin = go_binary(dir.path(), host_arch_go());
    let debs = dir.path().join("debs");
    let online = Build {
        repo: &repo,
        debs: debs.clone(),
        offline: false,
        path_first: None,
    };
    let tree = online.rootfs(&bin, &dir.path().join("first"));
    assert_eq!(status_field(&tree, "libc6", "Version"), old);
    let old_file = format!("libc6_{old}_{arch}.deb");
    assert!(cached(&debs).contains(&old_file));

    // Offline before anything was fetched: a clear error, no apt.
    let empty = dir.path().join("empty");
    let log = dir.path().join("apt.log");
    let refusing = apt_spy(dir.path(), &empty, &log, true);
    let out = Build {
        repo: &repo,
        debs: empty.clone(),
        offline: true,
        path_first: Some(refusing.clone()),
    }
    .run(&[
        "--binary",
        bin.to_str().unwrap(),
        "--rootfs",
        dir.path().join("none").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--fetch"), "{err}");

    repo.add("libc6", new, &arch);
    // Offline: the cached version, and apt is not asked.
    let offline = Build {
        repo: &repo,
        debs: debs.clone(),
        offline: true,
        path_first: Some(refusing),
    };
    let tree = offline.rootfs(&bin, &dir.path().join("offline"));
    assert_eq!(status_field(&tree, "libc6", "Version"), old);
    assert!(
        !log.exists(),
        "apt-get ran offline: {:?}",
        std::fs::read_to_string(&log)
    );

    // Online: apt's candidate, the older file gone.
    let online = Build {
        repo: &repo,
        debs: debs.clone(),
        offline: false,
        path_first: None,
    };
    let tree = online.rootfs(&bin, &dir.path().join("online"));
    assert_eq!(status_field(&tree, "libc6", "Version"), new);
    let files = cached(&debs);
    assert!(
        files.contains(&format!("libc6_{new}_{arch}.deb")),
        "{files:?}"
    );
    assert!(!files.contains(&old_file), "{files:?}");

    // Both versions cached (another tool's file beside pinswap's): the
    // manifest's is used, and the other is left alone.
    std::fs::copy(
        repo.dir.path().join("repo").join(&old_file),
        debs.join(&old_file),
    )
    .unwrap();
    let tree = offline.rootfs(&bin, &dir.path().join("both"));
    assert_eq!(status_field(&tree, "libc6", "Version"), new);
    assert!(cached(&debs).contains(&old_file));

    // A package for all architectures that another architecture's
    // manifest still names stays when this one's moves on.
    online.ok(&["--fetch", "--arch", foreign_arch()]);
    repo.add("netbase", "6.5", "all");
    let online = Build {
        repo: &repo,
        debs: debs.clone(),
        offline: false,
        path_first: None,
    };
    let tree = online.rootfs(&bin, &dir.path().join("netbase"));
    assert_eq!(status_field(&tree, "netbase", "Version"), "6.5");
    let files = cached(&debs);
    assert!(
        files.contains(&"netbase_6.4_all.deb".to_owned()),
        "{files:?}"
    );
    let foreign = go_binary(dir.path(), foreign_arch());
    let offline = Build {
        repo: &repo,
        debs: debs.clone(),
        offline: true,
        path_first: None,
    };
    let tree = offline.rootfs(&foreign, &dir.path().join("foreign"));
    assert_eq!(status_field(&tree, "netbase", "Version"), "6.4");
}

/// `--rootfs` and `--out` are replaced whole, so a directory holding
/// anything but an earlier run's output is refused and left as it was.
#[test]
fn a_directory_it_did_not_write_is_not_replaced() {
    let repo = Repo::new("2.36-9+deb12u14");
    let dir = tempfile::tempdir().unwrap();
    let bin = go_binary(dir.path(), host_arch_go());
    let build = Build {
        repo: &repo,
        debs: dir.path().join("debs"),
        offline: false,
        path_first: None,
    };
    let (tree, layout) = (dir.path().join("tree"), dir.path().join("layout"));
    for (flag, d) in [("--rootfs", &tree), ("--out", &layout)] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("notes.txt"), "someone's\n").unwrap();
        let out = build.run(&["--binary", bin.to_str().unwrap(), flag, d.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(flag), "{flag}: {err}");
        assert_eq!(
            std::fs::read_to_string(d.join("notes.txt")).unwrap(),
            "someone's\n"
        );
        // Emptied, it is written; written, it is written again.
        std::fs::remove_file(d.join("notes.txt")).unwrap();
        build.ok(&["--binary", bin.to_str().unwrap(), flag, d.to_str().unwrap()]);
        build.ok(&["--binary", bin.to_str().unwrap(), flag, d.to_str().unwrap()]);
    }
    assert!(tree.join("etc/nsswitch.conf").exists());
    assert!(layout.join("oci-layout").exists());
}
