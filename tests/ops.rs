//! Operability, end to end through the built binary: metrics after real calls
//! through the proxy against a real containerd, /healthz /readyz /status,
//! doctor, systemd socket activation, logs, CLI surface.
//!
//! Each test starts its own containerd from a temporary directory (killed by
//! pid on drop) and waits for it by polling with a deadline.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use imgbridge::containerd::{request, Containerd};
use imgbridge_test_support as support;
use imgbridge_test_support::cri::cri_image_client;
use imgbridge_test_support::ctr::ctr_ingest;
use imgbridge_test_support::flavor::{flavor, parse_semver};
use imgbridge_test_support::grpc::sha256_digest;
use imgbridge_test_support::images::TestImage;
use imgbridge_test_support::registry::Registry;
use imgbridge_test_support::util::{itoa, run_ok};

const BIN: &str = env!("CARGO_BIN_EXE_imgbridge");
const DEADLINE: Duration = Duration::from_secs(30);

/// Polls `f` until it returns `Some`, failing the test at the deadline.
fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20)); // poll interval, not a wait
    }
}

/// A private containerd (the harness's, so the version under test) on
/// sockets in a temp dir.
struct Ctrd {
    inner: support::containerd::Containerd,
    sock: PathBuf,
}

impl Ctrd {
    fn start(cri: bool) -> Ctrd {
        let inner = support::containerd::Containerd::start(support::containerd::ContainerdOpts {
            cri,
            ..Default::default()
        });
        let sock = inner.socket().to_path_buf();
        Ctrd { inner, sock }
    }

    fn dir(&self) -> &Path {
        self.inner.dir()
    }
}

fn ctr(sock: &Path, args: &[&str]) -> Output {
    flavor()
        .command("ctr")
        .arg("-a")
        .arg(sock)
        .args(args)
        .output()
        .unwrap()
}

/// `imgbridge serve` in front of `upstream`, with the ops endpoint on TCP.
struct Proxy {
    child: Child,
    sock: PathBuf,
    metrics: String,
    _dir: tempfile::TempDir,
}

impl Proxy {
    fn start(upstream: &Path, extra: &[&str]) -> Proxy {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ib.sock");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let metrics = format!("127.0.0.1:{port}");
        let child = Command::new(BIN)
            .args(["serve", "--config", "/dev/null", "--listen"])
            .arg(&sock)
            .arg("--upstream")
            .arg(upstream)
            .args(["--metrics-listen", &metrics])
            .args(extra)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let p = Proxy {
            child,
            sock,
            metrics,
            _dir: dir,
        };
        poll("imgbridge /healthz", || {
            http_get(&p.metrics, "/healthz")
                .filter(|(code, _)| *code == 200)
                .map(|_| ())
        });
        poll("imgbridge socket", || {
            std::os::unix::net::UnixStream::connect(&p.sock).ok()
        });
        p
    }

    fn scrape(&self) -> String {
        let (code, body) = http_get(&self.metrics, "/metrics").expect("scrape");
        assert_eq!(code, 200);
        body
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 GET; `None` if nothing listens yet.
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.get(9..12)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    Some((code, body))
}

/// The value of the sample line starting with `series` (0 if absent).
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

const VERSION_OK: &str = "imgbridge_proxy_calls_total{method=\"/containerd.services.version.v1.Version/Version\",grpc_status=\"0\"}";
const GET_NOT_FOUND: &str = "imgbridge_proxy_calls_total{method=\"/containerd.services.images.v1.Images/Get\",grpc_status=\"5\"}";
const BYTES: &str = "imgbridge_proxy_relayed_bytes_total";

#[test]
fn metrics_count_real_calls_through_the_proxy() {
    let c = Ctrd::start(false);
    let p = Proxy::start(&c.sock, &[]);
    let rt = rt();
    let _enter = rt.enter();
    let via = Containerd::new(&p.sock);

    let before = p.scrape();
    assert!(before.contains("imgbridge_build_info{"), "{before}");
    let v0 = sample(&before, VERSION_OK);
    let version = rt.block_on(via.version()).unwrap();
    assert_eq!(parse_semver(&version), Some(flavor().semver), "{version}");
    poll("Version/Version status 0 counted", || {
        (sample(&p.scrape(), VERSION_OK) == v0 + 1.0).then_some(())
    });

    let nf0 = sample(&p.scrape(), GET_NOT_FOUND);
    let err = rt
        .block_on(via.images().get(request(
            "default",
            None,
            containerd_client::services::v1::GetImageRequest {
                name: "docker.io/library/nope:none".into(),
            },
        )))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    poll("Images/Get status 5 counted", || {
        (sample(&p.scrape(), GET_NOT_FOUND) == nf0 + 1.0).then_some(())
    });

    // A 1 MiB blob, read back through the proxy with ctr.
    let blob: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let digest = sha256_digest(&blob);
    let blob_file = c.dir().join("test-blob");
    std::fs::write(&blob_file, &blob).unwrap();
    ctr_ingest(&c.sock, "default", &digest, &blob_file);
    let b0 = sample(&p.scrape(), BYTES);
    let got = ctr(&p.sock, &["content", "get", &digest]);
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert_eq!(got.stdout, blob);
    let b1 = poll("relayed bytes to grow by the blob", || {
        let b = sample(&p.scrape(), BYTES);
        (b >= b0 + blob.len() as f64).then_some(b)
    });
    assert!(b1 < b0 + 2.0 * blob.len() as f64, "{b0} → {b1}");
    poll("no stream left in flight", || {
        (sample(&p.scrape(), "imgbridge_proxy_streams_in_flight") == 0.0).then_some(())
    });

    // Health, readiness, status.
    assert_eq!(
        http_get(&p.metrics, "/healthz").unwrap(),
        (200, "ok\n".into())
    );
    let (code, body) = http_get(&p.metrics, "/readyz").unwrap();
    assert_eq!(code, 200, "{body}");
    let (code, body) = http_get(&p.metrics, "/status").unwrap();
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["ready"], true);
    assert_eq!(status["upstream"]["version"], version.as_str());
    assert_eq!(status["config"]["upstream"], c.sock.to_str().unwrap());
    assert_eq!(status["config"]["metrics"]["listen"], p.metrics.as_str());
    assert!(status["pending"]["blobs"].is_u64());
    assert!(status["last_errors"]["images"].is_object());
    assert!(status["last_errors"]["files"].is_object());

    // Doctor against this containerd (CRI disabled): a warning, not a failure.
    let out = Command::new(BIN)
        .args(["doctor", "--config", "/dev/null", "--upstream"])
        .arg(&c.sock)
        .arg("--listen")
        .arg(&p.sock)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("! CRI plugin: not loaded"), "{text}");
    assert!(text.contains("✓ proxy: answers on"), "{text}");
}

#[test]
fn readyz_fails_while_containerd_is_down() {
    let dir = tempfile::tempdir().unwrap();
    let p = Proxy::start(&dir.path().join("gone.sock"), &[]);
    let (code, body) = http_get(&p.metrics, "/readyz").unwrap();
    assert_eq!(code, 503);
    assert!(body.contains("gone.sock"), "{body}");
    let (_, body) = http_get(&p.metrics, "/status").unwrap();
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["ready"], false);
    assert!(status["upstream"]["error"].is_string());
    // The proxy answers its clients with UNAVAILABLE, counted as status 14.
    let rt = rt();
    let _enter = rt.enter();
    let err = rt.block_on(Containerd::new(&p.sock).version()).unwrap_err();
    assert!(err.is(tonic::Code::Unavailable), "{err}");
    poll("status 14 counted", || {
        (sample(
            &p.scrape(),
            "imgbridge_proxy_calls_total{method=\"/containerd.services.version.v1.Version/Version\",grpc_status=\"14\"}",
        ) == 1.0)
            .then_some(())
    });
}

#[test]
fn doctor_passes_on_a_healthy_node() {
    use imgbridge::ops::doctor::{self, parse_version, pinned_support, PinnedSupport};
    let c = Ctrd::start(true);
    assert!(ctr(&c.sock, &["namespaces", "create", "buildkit"])
        .status
        .success());
    // (k8s.io exists already: the harness seeds CRI's pause image there.)
    let p = Proxy::start(&c.sock, &[]);
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"{}\"\n[import]\nstate_file = \"{}\"\n[[import.dirs]]\npath = \"{}\"\n",
            p.sock.display(),
            dir.path().join("state.json").display(),
            images.display()
        ),
    )
    .unwrap();
    // containerd's config file is named explicitly: the host's own
    // /etc/containerd/config.toml must not decide the result.
    let ctd_config = c.dir().join("config.toml");
    let run_doctor = || {
        let out = Command::new(BIN)
            .args(["doctor", "--config"])
            .arg(&cfg)
            .arg("--upstream")
            .arg(&c.sock)
            .env(doctor::CONFIG_ENV, &ctd_config)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}");
        text
    };
    // The line of one check, whatever its mark.
    let line_of = |text: &str, what: &str| -> String {
        text.lines()
            .find(|l| {
                l.split_once(' ')
                    .is_some_and(|(_, rest)| rest.starts_with(&format!("{what}: ")))
            })
            .unwrap_or_else(|| panic!("no {what:?} line in\n{text}"))
            .to_string()
    };
    let text = run_doctor();
    for line in [
        "✓ configuration: valid; replicating buildkit → k8s.io",
        "✓ upstream: containerd ",
        "✓ content sharing: policy \"shared\"",
        "✓ CRI plugin: loaded",
        "✓ source namespaces: buildkit",
        "✓ target namespaces: k8s.io",
        "✓ proxy socket:",
        "mode 0660",
        "✓ proxy: answers on",
        "✓ watched directory:",
        "✓ import state:",
        "0 failed",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    // containerd 1.6.20 predates the pinned label; import.pin is on by default.
    let rt = rt();
    let _enter = rt.enter();
    let version = rt.block_on(Containerd::new(&c.sock).version()).unwrap();
    let v = parse_version(&version).unwrap();
    let pinned = text
        .lines()
        .find(|l| l.contains(" pinned label: "))
        .unwrap();
    match pinned_support(v) {
        PinnedSupport::Full => assert!(pinned.starts_with("✓"), "{pinned}"),
        PinnedSupport::Partial => assert!(pinned.starts_with("!"), "{pinned}"),
        PinnedSupport::No => {
            assert!(pinned.starts_with("! pinned label"), "{pinned}");
            assert!(
                pinned.contains("ignores io.cri-containerd.pinned"),
                "{pinned}"
            );
        }
    }

    // The version against the tested matrix.
    let l = line_of(&text, "containerd version");
    match doctor::matrix(v) {
        doctor::Matrix::Tested => assert!(
            l.starts_with(&format!(
                "✓ containerd version: {version} is in imgbridge's tested matrix"
            )),
            "{l}"
        ),
        _ => assert!(
            l.starts_with(&format!("! containerd version: {version} ")),
            "{l}"
        ),
    }
    assert_eq!(
        text.contains("! containerd support: 1.6 is out of support upstream"),
        (v.0, v.1) == (1, 6),
        "{text}"
    );

    // Transfer: found over Introspection, present from 1.7 on.
    let l = line_of(&text, "Transfer service");
    if doctor::ships_transfer(v) {
        assert!(l.starts_with("✓ Transfer service: present: "), "{l}");
        assert!(l.contains("imgbridge intercepts it"), "{l}");
    } else {
        assert!(l.starts_with("✓ Transfer service: absent "), "{l}");
    }

    // The config file's version against what this containerd reads natively.
    let written = std::fs::read_to_string(&ctd_config).unwrap();
    let file = doctor::config_file_version(&written).unwrap();
    let native = doctor::native_config_version(v).unwrap();
    let l = line_of(&text, "containerd config");
    let head = format!(
        "containerd config: {} has version = {file}",
        ctd_config.display()
    );
    if file == native {
        assert!(
            l.starts_with(&format!("✓ {head}, which containerd {version} reads as is")),
            "{l}"
        );
    } else {
        assert!(l.starts_with(&format!("! {head}")), "{l}");
        assert!(
            l.contains(&format!("migrates it to version {native}")),
            "{l}"
        );
    }

    // Snapshotters: CRI's (from Status or ImageFsInfo) against buildkit's.
    assert!(
        text.contains(
            "✓ snapshotters: CRI overlayfs, buildkit overlayfs (containerd's default): the same"
        ),
        "{text}"
    );
    // A namespace default that differs from CRI's is a warning with a fix.
    assert!(ctr(
        &c.sock,
        &[
            "namespaces",
            "label",
            "buildkit",
            "containerd.io/defaults/snapshotter=native"
        ]
    )
    .status
    .success());
    let text = run_doctor();
    let l = line_of(&text, "snapshotters");
    assert!(
        l.starts_with("! snapshotters: CRI overlayfs, buildkit native (namespace label): "),
        "{l}"
    );
    assert!(l.contains("— fix: "), "{l}");
}

#[test]
fn doctor_fails_on_missing_socket_and_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["doctor", "--config", "/dev/null", "--upstream"])
        .arg(dir.path().join("missing.sock"))
        .arg("--listen")
        .arg(dir.path().join("ib.sock"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let line = text.lines().find(|l| l.starts_with("✗ upstream:")).unwrap();
    assert!(
        line.contains("missing.sock") && line.contains("— fix: start containerd"),
        "{line}"
    );
    assert!(text.contains("! proxy socket:"), "{text}");

    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[replication]\npinn = true\n").unwrap();
    let out = Command::new(BIN)
        .args(["doctor", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("✗ configuration:"))
        .unwrap();
    assert!(line.contains("pinn"), "{line}");
}

/// containerd's config as the harness wrote it, with CRI's registry
/// `config_path`, `discard_unpacked_layers` and (2.x) `use_local_image_pull`
/// set as given, in the layout of the version under test.
fn with_cri_registry(base: &str, config_path: &str, discard: bool, local_pull: bool) -> String {
    if flavor().is_v2() {
        let images = "  [plugins.\"io.containerd.cri.v1.images\"]\n";
        assert!(base.contains(images), "{base}");
        let mut out = String::new();
        for line in base.lines() {
            if line.trim_start().starts_with("config_path = ") {
                out.push_str(&format!("      config_path = \"{config_path}\"\n"));
                continue;
            }
            out.push_str(line);
            out.push('\n');
            if format!("{line}\n") == images {
                out.push_str(&format!(
                    "    discard_unpacked_layers = {discard}\n    use_local_image_pull = {local_pull}\n"
                ));
            }
        }
        out
    } else {
        let ctd = "    [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n";
        assert!(base.contains(ctd), "{base}");
        let mut out = base.replace(
            ctd,
            &format!("{ctd}      discard_unpacked_layers = {discard}\n"),
        );
        out.push_str(&format!(
            "    [plugins.\"io.containerd.grpc.v1.cri\".registry]\n      config_path = \"{config_path}\"\n"
        ));
        out
    }
}

/// Whether CRI pulls `image` within a deadline (a pull that would go to the
/// internet fails, or is cut off here).
fn cri_pulls(sock: &Path, image: &str) -> Result<(), String> {
    let rt = rt();
    rt.block_on(async {
        let mut images = cri_image_client(sock).await;
        let req = k8s_cri::v1::PullImageRequest {
            image: Some(k8s_cri::v1::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        match tokio::time::timeout(DEADLINE, images.pull_image(req)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.message().to_string()),
            Err(_) => Err(format!("no answer within {DEADLINE:?}")),
        }
    })
}

/// Doctor's image-sharing checks against a real containerd whose config the
/// test rewrites, with a real registry in the mirror's place: like spegel's
/// mirror it answers `/v2/` and serves `docker.io/...` pulls routed to it by
/// `hosts.toml`. Each verdict doctor gives is checked against a real CRI pull.
#[test]
fn doctor_checks_a_node_for_image_sharing() {
    let mut c = support::containerd::Containerd::start(support::containerd::ContainerdOpts {
        cri: true,
        ..Default::default()
    });
    let sock = c.socket().to_path_buf();
    let ctd_config = c.config_path().to_path_buf();
    let base = std::fs::read_to_string(&ctd_config).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let run_doctor = || {
        let out = Command::new(BIN)
            .args(["doctor", "--config", "/dev/null", "--upstream"])
            .arg(&sock)
            .arg("--listen")
            .arg(dir.path().join("ib.sock"))
            .env(imgbridge::ops::doctor::CONFIG_ENV, &ctd_config)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        // A node not set up for sharing, or set up badly, still passes.
        assert!(out.status.success(), "{text}");
        assert!(text.contains(" 0 failed"), "{text}");
        text
    };
    let line_of = |text: &str, what: &str| -> Option<String> {
        text.lines()
            .find(|l| {
                l.split_once(' ')
                    .is_some_and(|(_, rest)| rest.starts_with(&format!("{what}: ")))
            })
            .map(String::from)
    };
    let sharing_lines = [
        "registry config_path",
        "mirror hosts.toml",
        "unpacked layers",
        "CRI pull path",
        "mirror",
    ];

    // A single node (the harness's config: no config_path on 1.x, an empty
    // certs.d on 2.x): one warning that says so, none of the other lines.
    let text = run_doctor();
    let l = line_of(&text, "image sharing").unwrap_or_else(|| panic!("{text}"));
    assert!(l.starts_with("! image sharing: single node: "), "{l}");
    assert!(l.contains("docs/multi-node.md"), "{l}");
    for what in sharing_lines {
        assert_eq!(line_of(&text, what), None, "{text}");
    }

    // A mirror on this node for docker.io, in the layout spegel writes
    // (with an unreachable server: nothing here may reach the internet).
    let registry = Registry::start();
    let image = TestImage::hello("imgbridge-test/doctor-mirror:dev");
    image.push(&registry.addr());
    let certs = dir.path().join("certs.d");
    let hosts_dir = certs.join("docker.io");
    std::fs::create_dir_all(&hosts_dir).unwrap();
    let mirror = format!("http://{}", registry.addr());
    std::fs::write(
        hosts_dir.join("hosts.toml"),
        format!("server = 'https://upstream.invalid'\n\n[host.'{mirror}']\ncapabilities = ['pull', 'resolve']\ndial_timeout = '200ms'\n"),
    )
    .unwrap();
    let certs_s = certs.display().to_string();
    let reconfigure =
        |c: &mut support::containerd::Containerd, config_path: &str, discard: bool, local: bool| {
            std::fs::write(
                &ctd_config,
                with_cri_registry(&base, config_path, discard, local),
            )
            .unwrap();
            c.restart();
        };
    reconfigure(&mut c, &certs_s, true, false);
    let text = run_doctor();
    assert_eq!(line_of(&text, "image sharing"), None, "{text}");
    let l = line_of(&text, "registry config_path").unwrap();
    assert!(
        l.starts_with(&format!("✓ registry config_path: {certs_s} (from ")),
        "{l}"
    );
    let l = line_of(&text, "mirror hosts.toml").unwrap();
    assert!(
        l.starts_with("✓ mirror hosts.toml: ")
            && l.contains(&format!(
                "docker.io → {mirror} (pull, resolve), then https://upstream.invalid"
            )),
        "{l}"
    );
    let l = line_of(&text, "unpacked layers").unwrap();
    assert!(
        l.starts_with("! unpacked layers: discard_unpacked_layers = true"),
        "{l}"
    );
    assert!(l.contains("fix: [plugins.\""), "{l}");
    let l = line_of(&text, "CRI pull path").unwrap();
    assert!(l.starts_with("✓ CRI pull path: "), "{l}");
    let l = line_of(&text, "mirror").unwrap();
    assert_eq!(l, format!("✓ mirror: {mirror} answers GET /v2/ (HTTP 200)"));
    // What doctor calls set up is: CRI pulls the image through the mirror.
    cri_pulls(&sock, &image.normalized()).unwrap();

    // Layers kept, which on 2.1+ also puts CRI on the Transfer path: with
    // one directory it still pulls through the mirror.
    reconfigure(&mut c, &certs_s, false, false);
    let text = run_doctor();
    let l = line_of(&text, "unpacked layers").unwrap();
    assert!(l.starts_with("✓ unpacked layers: kept"), "{l}");
    let l = line_of(&text, "CRI pull path").unwrap();
    if flavor().semver >= (2, 1, 0) {
        assert_eq!(
            l,
            "✓ CRI pull path: Transfer service, config_path is one directory: honoured"
        );
    } else {
        assert!(l.starts_with("✓ CRI pull path: client pull ("), "{l}");
    }
    let third = TestImage::hello("imgbridge-test/doctor-mirror:one");
    third.push(&registry.addr());
    cri_pulls(&sock, &third.normalized()).unwrap();

    // The Transfer trap: a config_path list (2.2+'s default shape).
    let other = dir.path().join("docker-certs.d").display().to_string();
    let list = format!("{certs_s}:{other}");
    let second = TestImage::hello("imgbridge-test/doctor-mirror:list");
    second.push(&registry.addr());
    reconfigure(&mut c, &list, false, false);
    let text = run_doctor();
    let l = line_of(&text, "CRI pull path").unwrap();
    let v = flavor().semver;
    if v >= (2, 1, 0) {
        assert!(
            l.starts_with("! CRI pull path: CRI pulls through the Transfer service")
                && l.contains(&format!("[plugins.\"io.containerd.cri.v1.images\".registry] config_path = \"{certs_s}\""))
                && l.contains("use_local_image_pull = true"),
            "{l}"
        );
        // As doctor says: the mirror is skipped.
        let e = cri_pulls(&sock, &second.normalized()).unwrap_err();
        eprintln!("pull with a config_path list through Transfer: {e}");
        // The client pull reads the list.
        reconfigure(&mut c, &list, false, true);
        let text = run_doctor();
        let l = line_of(&text, "CRI pull path").unwrap();
        assert!(
            l.starts_with("✓ CRI pull path: client pull (use_local_image_pull = true)"),
            "{l}"
        );
    } else {
        assert!(l.starts_with("✓ CRI pull path: client pull ("), "{l}");
    }
    cri_pulls(&sock, &second.normalized()).unwrap();

    // `_default/hosts.toml`, which spegel writes when it mirrors every
    // registry (its Helm chart's default), serves docker.io too.
    let default_dir = certs.join("_default");
    std::fs::rename(&hosts_dir, &default_dir).unwrap();
    let text = run_doctor();
    let l = line_of(&text, "mirror hosts.toml").unwrap();
    assert!(
        l.starts_with(&format!(
            "✓ mirror hosts.toml: {}: docker.io → {mirror} (pull, resolve)",
            default_dir.join("hosts.toml").display()
        )),
        "{l}"
    );
    let fourth = TestImage::hello("imgbridge-test/doctor-mirror:default");
    fourth.push(&registry.addr());
    cri_pulls(&sock, &fourth.normalized()).unwrap();

    // The mirror down: a warning, the rest unchanged.
    drop(registry);
    let text = run_doctor();
    let l = line_of(&text, "mirror").unwrap();
    assert!(
        l.starts_with(&format!("! mirror: {mirror} does not answer: ")),
        "{l}"
    );
    assert!(l.contains("fix: start the mirror"), "{l}");
    assert!(
        line_of(&text, "mirror hosts.toml")
            .unwrap()
            .starts_with("✓"),
        "{text}"
    );
}

#[test]
fn socket_activation_serves_the_passed_listener() {
    let c = Ctrd::start(false);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("activated.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--config", "/dev/null", "--upstream"])
        .arg(&c.sock)
        // Never bound under activation: the passed socket is used instead.
        .arg("--listen")
        .arg(dir.path().join("not-bound.sock"))
        .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls plus setenv (glibc resets its
    // locks in the child) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 3 {
                let flags = libc::fcntl(3, libc::F_GETFD);
                libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            } else if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut buf = [0u8; 24];
            let pid = itoa(libc::getpid() as u32, &mut buf);
            libc::setenv(c"LISTEN_PID".as_ptr(), pid.as_ptr().cast(), 1);
            libc::setenv(c"LISTEN_FDS".as_ptr(), c"1".as_ptr(), 1);
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Kill(child);
    drop(listener); // the child holds its copy (fd 3)
    let rt = rt();
    let version = rt
        .block_on(async { tokio::time::timeout(DEADLINE, Containerd::new(&sock).version()).await })
        .expect("answer through the activated socket")
        .unwrap();
    assert_eq!(parse_semver(&version), Some(flavor().semver), "{version}");
    assert!(!dir.path().join("not-bound.sock").exists());
    drop(rt); // close the client connection, so shutdown has nothing to drain
              // On exit imgbridge leaves systemd's socket file alone.
    nix_kill_term(child.0.id());
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(sock.exists());
}

fn nix_kill_term(pid: u32) {
    // SAFETY: plain kill(2) on our own child.
    unsafe {
        libc::kill(pid as i32, libc::SIGTERM);
    }
}

#[test]
fn json_logs_and_flags_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        "[log]\nformat = \"text\"\nfilter = \"warn\"\n[metrics]\nlisten = \"127.0.0.1:1\"\n",
    )
    .unwrap();
    let mut print = Command::new(BIN);
    print
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .args([
            "--log-format",
            "json",
            "--metrics-listen",
            "/run/x/metrics.sock",
        ]);
    let out = run_ok(print);
    let eff: imgbridge::Config = toml::from_str(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(eff.log.format, "json");
    assert_eq!(eff.log.filter, "warn");
    assert_eq!(eff.metrics.listen, "/run/x/metrics.sock");

    // Logs as JSON lines on stderr (RUST_LOG wins over log.filter = "warn").
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&cfg)
        .args(["--log-format", "json", "--metrics-listen", "", "--listen"])
        .arg(dir.path().join("ib.sock"))
        .arg("--upstream")
        .arg(dir.path().join("none.sock"))
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let first = rx.recv_timeout(DEADLINE).expect("a log line");
    nix_kill_term(child.id());
    let v: serde_json::Value = serde_json::from_str(&first).expect("JSON log line");
    assert_eq!(v["level"], "INFO", "{first}");
    assert_eq!(v["fields"]["message"], "imgbridge serving", "{first}");
    assert!(child.wait().unwrap().success());
    let rest: Vec<String> = rx.iter().collect();
    assert!(
        rest.iter()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
        "{rest:?}"
    );
}

#[test]
fn print_config_rejects_unknown_keys_and_bad_values() {
    let dir = tempfile::tempdir().unwrap();
    for (text, key) in [
        ("[metrics]\nlisten_on = \"x\"\n", "listen_on"),
        ("[log]\nformat = \"xml\"\n", "log.format"),
        ("[metrics]\nlisten = \"nope\"\n", "metrics.listen"),
    ] {
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, text).unwrap();
        let out = Command::new(BIN)
            .args(["serve", "--print-config", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text:?} accepted");
        assert!(err.contains(key), "{text:?}: {err}");
    }
    let out = Command::new(BIN)
        .args([
            "serve",
            "--print-config",
            "--config",
            "/dev/null",
            "--log-format",
            "xml",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--log-format"));
}

#[test]
fn version_completions_and_man_page() {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    let v = String::from_utf8(out.stdout).unwrap();
    assert!(
        v.starts_with(&format!("imgbridge {} (", env!("CARGO_PKG_VERSION"))),
        "{v}"
    );
    let commit = v.trim().rsplit_once('(').unwrap().1.trim_end_matches(')');
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{v}"
    );
    for (shell, marker) in [
        ("bash", "_imgbridge()"),
        ("zsh", "#compdef imgbridge"),
        ("fish", "complete -c imgbridge"),
    ] {
        let out = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success());
        let s = String::from_utf8(out.stdout).unwrap();
        assert!(s.contains(marker), "{shell}: {s}");
        assert!(s.contains("metrics-listen"), "{shell}");
    }
    let out = Command::new(BIN).arg("man").output().unwrap();
    let man = String::from_utf8(out.stdout).unwrap();
    assert!(man.contains(".TH imgbridge 8"), "{man}");
    assert!(man.contains("doctor"));
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["man", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    for page in ["imgbridge", "imgbridge-serve", "imgbridge-doctor"] {
        let text = std::fs::read_to_string(dir.path().join(format!("{page}.8"))).unwrap();
        assert!(text.contains(&format!(".TH {page} 8")), "{page}");
    }
    let serve = std::fs::read_to_string(dir.path().join("imgbridge-serve.8")).unwrap();
    assert!(serve.contains("metrics\\-listen"), "{serve}");
}
