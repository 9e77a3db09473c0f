//! Fast, clean restarts: on SIGTERM imgbridge releases
//! both sockets at once, so a new instance binds them while the old one
//! drains; open-ended subscriptions are ended with UNAVAILABLE instead of
//! holding the drain; calls that end on their own (a held write, a content
//! write mid-transfer) still finish.
//!
//! Every wait is a poll with a deadline; times are measured from the moment
//! the signal was sent.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use containerd_client::services::v1 as api;
use http_body_util::{BodyExt, Full};
use imgbridge::proxy::intercept::{typed, CallInfo, Hook, Interceptor};
use imgbridge_test_support::flavor::parse_semver;
use imgbridge_test_support::grpc::{
    content_client, content_info, h2_connect, placeholder_manifest, try_containerd_channel,
};
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::util::{itoa, READY_TIMEOUT};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use prost::Message;

const NS: &str = "dev";
/// The deadline for what a shutdown does without waiting for the drain
/// (sockets freed, subscriptions ended, exit): half of `drain_timeout`
/// (10 s), all of which a shutdown held by the drain waits out (before the
/// fix exit took 10.0 s). A loaded machine passes; how fast a restart is,
/// the tests print.
const AT_ONCE: Duration = Duration::from_secs(5);
/// Subscriptions that see the images the tests create.
const IMAGES: &str = "namespace==dev,topic~=\"^/images/\"";
/// Matches nothing: the subscription never gets an event, so containerd
/// never sends its response headers.
const NEVER: &str = "topic==\"/imgbridge/never\"";

/// Polls `f` every 2 ms until it returns `Some` or `timeout` passes: fine
/// enough to measure sub-second shutdowns.
async fn until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn sigterm(pid: u32) -> Instant {
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM).expect("SIGTERM");
    Instant::now()
}

/// Waits (up to 15 s, to report how long it really took) for `p` to exit;
/// returns its status and the time since `sent`.
async fn exit_of(p: &mut Imgbridge, sent: Instant) -> (ExitStatus, Duration) {
    let st = until(Duration::from_secs(15), || p.try_exit_status()).await;
    let took = sent.elapsed();
    let st = st.unwrap_or_else(|| panic!("no exit {took:?} after SIGTERM:\n{}", p.log_tail()));
    (st, took)
}

/// That the drain of the log's imgbridge ended because its calls did, not
/// at `drain_timeout`.
fn assert_drained(log: &str) {
    assert!(
        log.contains("drained") && !log.contains("still running at drain timeout"),
        "the drain did not end on its own:\n{log}"
    );
}

/// Starts another imgbridge on `sock` (and `<sock>.ttrpc`) and waits until
/// it has bound both: a start that fails ("in use") panics with its log.
async fn start_second(sock: &Path, upstream: &Path) -> Imgbridge {
    let (sock, upstream) = (sock.to_path_buf(), upstream.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let mut p = Imgbridge::start_at(&sock, &upstream, &[]);
        // Ready means a connect succeeded; make sure it was this one's.
        let up = poll(READY_TIMEOUT, || {
            if let Some(st) = p.try_exit_status() {
                return Some(Err(st));
            }
            p.log().contains("imgbridge serving").then_some(Ok(()))
        });
        match up {
            Some(Ok(())) => p,
            Some(Err(st)) => panic!("second imgbridge failed to start ({st}):\n{}", p.log()),
            None => panic!("second imgbridge not serving:\n{}", p.log()),
        }
    })
    .await
    .unwrap()
}

/// The pid of the process that accepts on `sock`.
async fn server_pid(sock: &Path) -> Option<i32> {
    let s = tokio::net::UnixStream::connect(sock).await.ok()?;
    s.peer_cred().ok()?.pid()
}

/// `Version` through `sock`, answered by process `pid`.
async fn version_from(sock: &Path, pid: u32) {
    assert_eq!(
        server_pid(sock).await,
        Some(pid as i32),
        "{} is not served by pid {pid}",
        sock.display()
    );
    let mut v = api::version_client::VersionClient::new(containerd_channel(sock).await);
    let r = v
        .version(())
        .await
        .expect("Version through the new instance");
    let version = r.into_inner().version;
    assert!(is_containerd_version(&version), "{version}");
}

/// What a subscriber has seen: events, and how its stream ended (gRPC
/// status code and message; code -1 when it ended without a status).
#[derive(Clone, Default)]
struct Sub(Arc<Mutex<Seen>>);

#[derive(Default)]
struct Seen {
    events: usize,
    end: Option<(i32, String)>,
}

impl Sub {
    fn event(&self) {
        self.0.lock().unwrap().events += 1;
    }
    fn end(&self, code: i32, message: impl Into<String>) {
        let mut seen = self.0.lock().unwrap();
        seen.end.get_or_insert((code, message.into()));
    }
    fn events(&self) -> usize {
        self.0.lock().unwrap().events
    }
    fn ended(&self) -> Option<(i32, String)> {
        self.0.lock().unwrap().end.clone()
    }

    /// Asserts that the stream ended with UNAVAILABLE saying why.
    fn assert_restarting(&self, who: &str) {
        let end = self.ended();
        let Some((code, msg)) = end else {
            panic!("{who}: stream still open");
        };
        assert_eq!(code, tonic::Code::Unavailable as i32, "{who}: {msg}");
        assert!(msg.contains("restarting"), "{who}: {msg}");
    }
}

/// An `Events.Subscribe` through `channel` (tonic), recorded in a [`Sub`].
fn tonic_subscribe(channel: tonic::transport::Channel, filter: &str) -> Sub {
    let sub = Sub::default();
    let (out, filter) = (sub.clone(), filter.to_string());
    tokio::spawn(async move {
        let mut events = api::events_client::EventsClient::new(channel);
        let req = api::SubscribeRequest {
            filters: vec![filter],
        };
        let mut stream = match events.subscribe(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => return out.end(s.code() as i32, s.message()),
        };
        loop {
            match stream.message().await {
                Ok(Some(_)) => out.event(),
                Ok(None) => return out.end(-1, "ended with status OK"),
                Err(s) => return out.end(s.code() as i32, s.message()),
            }
        }
    });
    sub
}

type H2 = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// An `Events.Subscribe` on a bare HTTP/2 connection, recorded in a
/// [`Sub`]: the exact frames show whether the end is a gRPC status
/// (Trailers-Only before any reply, trailers after the reply's DATA).
/// The request is queued at once, so calls made in order get their stream
/// ids, and reach the wire, in that order.
fn h2_subscribe(h2: &mut H2, filter: &str) -> Sub {
    let msg = api::SubscribeRequest {
        filters: vec![filter.into()],
    }
    .encode_to_vec();
    let mut body = vec![0];
    body.extend((msg.len() as u32).to_be_bytes());
    body.extend(msg);
    let req = http::Request::builder()
        .method("POST")
        .uri("http://imgbridge/containerd.services.events.v1.Events/Subscribe")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("containerd-namespace", NS)
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = h2.send_request(req);
    let sub = Sub::default();
    let out = sub.clone();
    tokio::spawn(async move {
        let status = |h: &http::HeaderMap| {
            let code = h.get("grpc-status")?.to_str().ok()?.parse().ok()?;
            let msg = h.get("grpc-message").map_or(String::new(), |m| {
                percent_encoding::percent_decode(m.as_bytes())
                    .decode_utf8_lossy()
                    .into_owned()
            });
            Some((code, msg))
        };
        let resp = match response.await {
            Ok(r) => r,
            Err(e) => return out.end(-1, format!("no response: {e}")),
        };
        if let Some((code, msg)) = status(resp.headers()) {
            return out.end(code, msg); // Trailers-Only
        }
        let mut body = resp.into_body();
        loop {
            match body.frame().await {
                Some(Ok(f)) if f.is_data() => out.event(),
                Some(Ok(f)) => {
                    let t = f.into_trailers().unwrap_or_default();
                    return match status(&t) {
                        Some((code, msg)) => out.end(code, msg),
                        None => out.end(-1, format!("trailers without status: {t:?}")),
                    };
                }
                Some(Err(e)) => return out.end(-1, format!("body error: {e}")),
                None => return out.end(-1, "body ended without trailers"),
            }
        }
    });
    sub
}

/// `ctr events` as a child process; killed on drop.
struct CtrEvents {
    child: Child,
    out: PathBuf,
    err: PathBuf,
    _dir: tempfile::TempDir,
}

impl CtrEvents {
    fn start(sock: &Path) -> CtrEvents {
        let dir = tempdir("ctr-events-");
        let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
        let mut cmd = Command::new("ctr");
        // SAFETY: one async-signal-safe call between fork and exec.
        unsafe {
            cmd.pre_exec(
                || match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                },
            );
        }
        let child = cmd
            .arg("-a")
            .arg(sock)
            .args(["-n", NS, "events"])
            .env_remove("CONTAINERD_ADDRESS")
            .env_remove("CONTAINERD_NAMESPACE")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("spawn ctr events");
        CtrEvents {
            child,
            out,
            err,
            _dir: dir,
        }
    }

    fn saw(&self, topic: &str) -> bool {
        std::fs::read_to_string(&self.out).is_ok_and(|s| s.contains(topic))
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

impl Drop for CtrEvents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates image records in [`NS`] straight on containerd until `seen`
/// holds (every subscriber has an event), for up to 10 s.
async fn events_until(containerd: &Path, what: &str, mut seen: impl FnMut() -> bool) {
    let mut images = images_client(containerd).await;
    let target = placeholder_manifest('0');
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen() {
        assert!(Instant::now() < deadline, "{what}: no event within 10 s");
        let name = unique_name("restart-evt");
        images
            .create(create_image_req(NS, &name, &target))
            .await
            .unwrap();
        let _ = until(Duration::from_millis(100), || seen().then_some(())).await;
    }
}

/// With `ctr events`, a tonic subscriber and two bare HTTP/2 subscribers
/// (one that has had a reply, one still waiting for its first) attached,
/// and a shim's connection on the ttrpc socket: SIGTERM frees both socket
/// paths at once, a second imgbridge binds them, the old one exits without
/// waiting out the drain, and every subscriber's stream ends with
/// UNAVAILABLE (the clients reconnect, through the new instance).
///
/// Before the fix: exit took 10.0 s (drain timeout), and the second start
/// failed with "…/imgbridge.sock.ttrpc is in use".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_subscribers_exits_at_once_and_frees_both_sockets() {
    let (c, mut p) = Scenario::plain().start();
    let sock = p.socket().to_path_buf();
    let ttrpc = imgbridge::app::ttrpc_path(&sock);

    let ctr_events = CtrEvents::start(&sock);
    let channel = containerd_channel(&sock).await;
    let tonic_sub = tonic_subscribe(channel.clone(), IMAGES);
    let mut h2: H2 = h2_connect(&sock).await;
    // In this order: once `replied` has an event, `waiting` (the lower
    // stream id) has reached containerd too.
    let waiting = h2_subscribe(&mut h2, NEVER);
    let replied = h2_subscribe(&mut h2, IMAGES);
    let mut shim = tokio::net::UnixStream::connect(&ttrpc).await.unwrap();
    events_until(c.socket(), "subscribers", || {
        ctr_events.saw("/images/create") && tonic_sub.events() > 0 && replied.events() > 0
    })
    .await;
    assert_eq!(waiting.ended(), None);

    let sent = sigterm(p.pid());
    let freed = until(AT_ONCE, || {
        (!sock.exists() && !ttrpc.exists()).then(|| sent.elapsed())
    })
    .await;
    let exit = tokio::spawn(async move {
        let r = exit_of(&mut p, sent).await;
        (r, p)
    });
    let p2 = start_second(&sock, c.socket()).await;
    let ((status, took), p) = exit.await.unwrap();
    eprintln!("SIGTERM -> sockets freed {freed:?}, exit {took:?}");
    assert!(
        freed.is_some(),
        "socket files still there {AT_ONCE:?} after SIGTERM"
    );
    assert!(
        took < AT_ONCE,
        "exit took {took:?} with subscribers attached:\n{}",
        p.log_tail()
    );
    assert!(status.success(), "{status:?}\n{}", p.log_tail());
    assert_drained(&p.log());

    // Every subscription ended with a status, none hangs.
    let all = [
        ("tonic", &tonic_sub),
        ("h2 after a reply", &replied),
        ("h2 before any reply", &waiting),
    ];
    let done = until(AT_ONCE, || {
        all.iter().all(|(_, s)| s.ended().is_some()).then_some(())
    })
    .await;
    assert!(done.is_some(), "a subscription is still open");
    for (who, s) in all {
        s.assert_restarting(who);
    }
    let mut ctr_events = ctr_events;
    let ctr_exit = until(AT_ONCE, || ctr_events.child.try_wait().unwrap()).await;
    assert!(ctr_exit.is_some(), "ctr events still running");
    let err = ctr_events.stderr();
    eprintln!("ctr events ended: {}", err.trim());
    assert!(
        err.contains("Unavailable") && err.contains("restarting"),
        "ctr events: {err}"
    );
    // The shim's ttrpc connection was closed (shims reconnect).
    let mut buf = [0u8; 16];
    let eof =
        tokio::time::timeout(AT_ONCE, tokio::io::AsyncReadExt::read(&mut shim, &mut buf)).await;
    assert!(
        matches!(eof, Ok(Ok(0)) | Ok(Err(_))),
        "ttrpc connection still open: {eof:?}"
    );

    // The new instance serves, and a client of the old one reconnects
    // through it: its channel subscribes again and sees an event.
    version_from(&sock, p2.pid()).await;
    assert_eq!(server_pid(&ttrpc).await, Some(p2.pid() as i32));
    let again = tonic_subscribe(channel, IMAGES);
    events_until(c.socket(), "resubscribed", || again.events() > 0).await;
}

/// A content write mid-transfer at SIGTERM finishes after it, while the
/// sockets are already free and a second imgbridge serves on them; the
/// subscription on the old instance does not wait for the write. The old
/// instance, exiting after the write, leaves the new one's sockets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_in_flight_at_sigterm_completes_while_a_new_instance_serves() {
    let (c, mut p) = Scenario::plain().start();
    let sock = p.socket().to_path_buf();
    let ttrpc = imgbridge::app::ttrpc_path(&sock);
    let sub = tonic_subscribe(containerd_channel(&sock).await, IMAGES);
    events_until(c.socket(), "subscriber", || sub.events() > 0).await;

    let data: Vec<u8> = (0..(256u32 << 10)).map(|i| (i % 251) as u8).collect();
    let (first, rest) = data.split_at(data.len() / 2);
    let digest = sha256_digest(&data);
    let reference = unique_name("restart-write");
    let mut content = content_client(&sock).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Write as i32,
        r#ref: reference.clone(),
        total: data.len() as i64,
        data: first.to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    let req = with_ns(tokio_stream::wrappers::ReceiverStream::new(rx), NS);
    let mut replies = content.write(req).await.expect("write").into_inner();
    let ack = replies.message().await.unwrap().expect("first write acked");
    assert_eq!(ack.offset, first.len() as i64);

    let sent = sigterm(p.pid());
    let freed = until(AT_ONCE, || {
        (!sock.exists() && !ttrpc.exists()).then(|| sent.elapsed())
    })
    .await;
    assert!(freed.is_some(), "sockets not freed while a write is open");
    let ended = until(AT_ONCE, || sub.ended().map(|_| sent.elapsed())).await;
    assert!(ended.is_some(), "the subscription waits for the write");
    sub.assert_restarting("tonic");
    let p2 = start_second(&sock, c.socket()).await;
    version_from(&sock, p2.pid()).await;
    assert!(
        p.try_exit_status().is_none(),
        "the old instance must still be draining the write:\n{}",
        p.log_tail()
    );
    eprintln!(
        "SIGTERM -> sockets freed {freed:?}, subscription ended {ended:?}, new instance serving {:?}",
        sent.elapsed()
    );

    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Commit as i32,
        r#ref: reference.clone(),
        offset: first.len() as i64,
        total: data.len() as i64,
        expected: digest.clone(),
        data: rest.to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    let done = replies
        .message()
        .await
        .unwrap_or_else(|e| panic!("write after SIGTERM: {e}\n{}", p.log_tail()))
        .expect("commit acked");
    assert_eq!(done.digest, digest);
    drop(tx);
    while replies
        .message()
        .await
        .expect("write ends cleanly")
        .is_some()
    {}
    let committed = Instant::now();
    let (status, _) = exit_of(&mut p, sent).await;
    let after = committed.elapsed();
    eprintln!(
        "write committed {:?} after SIGTERM; exit {after:?} after the commit",
        committed - sent
    );
    assert!(status.success(), "{status:?}\n{}", p.log_tail());
    assert!(after < AT_ONCE, "exit {after:?} after the last call ended");
    assert_drained(&p.log());
    assert!(content_info(c.socket(), NS, &digest).await.is_some());

    // The old one's exit removed nothing of the new one's.
    assert!(
        sock.exists() && ttrpc.exists(),
        "the new instance's sockets were removed"
    );
    version_from(&sock, p2.pid()).await;
    assert_eq!(server_pid(&ttrpc).await, Some(p2.pid() as i32));
}

/// Holds `Images/Create` until `open` is set.
struct Gate {
    entered: Arc<AtomicBool>,
    open: Arc<tokio::sync::Notify>,
}

impl Interceptor for Gate {
    fn select(&self, call: &CallInfo) -> Option<Box<dyn Hook>> {
        if &*call.method != "/containerd.services.images.v1.Images/Create" {
            return None;
        }
        let (entered, open) = (self.entered.clone(), self.open.clone());
        Some(typed(
            move |_: api::CreateImageRequest, _: api::CreateImageResponse| async move {
                let opened = open.notified();
                entered.store(true, Ordering::SeqCst);
                opened.await;
                Ok(())
            },
        ))
    }
}

/// A call a hook holds (as a replication does) when shutdown starts is let
/// finish within the drain timeout, while the subscription on the same
/// connection is ended at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_call_finishes_in_the_drain_while_the_subscription_ends_at_once() {
    let c = Containerd::start(ContainerdOpts::default());
    let dir = tempdir("held-");
    let sock = dir.path().join("p.sock");
    let listener = imgbridge::proxy::listener::bind(&sock, Default::default()).unwrap();
    let gate = Gate {
        entered: Arc::new(AtomicBool::new(false)),
        open: Arc::new(tokio::sync::Notify::new()),
    };
    let (entered, open) = (gate.entered.clone(), gate.open.clone());
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(imgbridge::proxy::serve(
        vec![listener],
        imgbridge::proxy::ProxyConfig::new(c.socket()),
        Arc::new(gate),
        stop.clone().cancelled_owned(),
    ));
    let channel = containerd_channel(&sock).await;
    let sub = tonic_subscribe(channel.clone(), IMAGES);
    events_until(c.socket(), "subscriber", || sub.events() > 0).await;
    let mut images = api::images_client::ImagesClient::new(channel);
    let target = placeholder_manifest('1');
    let create =
        tokio::spawn(async move { images.create(create_image_req(NS, "held:1", &target)).await });
    let held = until(Duration::from_secs(10), || {
        entered.load(Ordering::SeqCst).then_some(())
    })
    .await;
    assert!(held.is_some(), "the hook never ran");

    let stopped = Instant::now();
    stop.cancel();
    let ended = until(AT_ONCE, || sub.ended().map(|_| stopped.elapsed())).await;
    assert!(ended.is_some(), "the subscription waits for the held call");
    sub.assert_restarting("tonic");
    assert!(!create.is_finished() && !server.is_finished());

    open.notify_one();
    let r = tokio::time::timeout(Duration::from_secs(5), create)
        .await
        .expect("held create finishes")
        .unwrap();
    assert_eq!(
        r.expect("held create").into_inner().image.unwrap().name,
        "held:1"
    );
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("serve returns once the held call is answered")
        .unwrap()
        .unwrap();
    eprintln!(
        "subscription ended {ended:?} after shutdown; serve returned {:?} after",
        stopped.elapsed()
    );
}

/// Under socket activation the sockets are systemd's: SIGTERM with a
/// subscriber attached exits at once and leaves both files (and
/// listening sockets) in place; a connection made meanwhile is served by
/// the next instance, started on the same sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_activated_restart_keeps_the_sockets_and_exits_at_once() {
    let c = Containerd::start(ContainerdOpts::default());
    let dir = tempdir("activated-");
    let sock = dir.path().join("activated.sock");
    let ttrpc = imgbridge::app::ttrpc_path(&sock);
    // systemd's part: bind both and keep them for every instance.
    let grpc_l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let ttrpc_l = std::os::unix::net::UnixListener::bind(&ttrpc).unwrap();

    let mut first = Activated::start(&grpc_l, &ttrpc_l, c.socket(), dir.path(), "first");
    let channel = poll_async(READY_TIMEOUT, || async {
        let ch = try_containerd_channel(&sock).await.ok()?;
        let mut v = api::version_client::VersionClient::new(ch.clone());
        let r = tokio::time::timeout(Duration::from_secs(1), v.version(())).await;
        r.ok()?.ok().map(|_| ch)
    })
    .await
    .expect("first instance serves");
    let sub = tonic_subscribe(channel, IMAGES);
    events_until(c.socket(), "subscriber", || sub.events() > 0).await;

    let sent = sigterm(first.0.id());
    let exited = until(Duration::from_secs(15), || first.0.try_wait().unwrap()).await;
    let took = sent.elapsed();
    eprintln!("socket-activated: SIGTERM -> exit {took:?}");
    let status = exited.expect("first instance exits");
    assert!(took < AT_ONCE, "exit took {took:?}");
    assert!(status.success(), "{status:?}");
    assert_drained(&std::fs::read_to_string(dir.path().join("first.log")).unwrap());
    sub.assert_restarting("tonic");
    assert!(
        sock.exists() && ttrpc.exists(),
        "systemd's socket files must stay"
    );

    // Queued by the kernel while no instance runs, served by the next one.
    let queued = tokio::spawn({
        let sock = sock.clone();
        async move {
            let mut v = api::version_client::VersionClient::new(containerd_channel(&sock).await);
            v.version(()).await.map(|r| r.into_inner().version)
        }
    });
    let _second = Activated::start(&grpc_l, &ttrpc_l, c.socket(), dir.path(), "second");
    let v = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("queued connection served by the next instance")
        .unwrap()
        .expect("Version");
    assert!(is_containerd_version(&v), "{v}");
}

/// The drop-in socket swap under systemd passes four sockets, all named
/// `imgbridge.socket`: the builders' path, containerd's default path and a
/// ttrpc socket beside each. Every one of them is served, each by the
/// server its path says (docs/socket-swap.md); before, only fds 3 and 4
/// were taken and the default path was a dead socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn socket_activated_serves_every_passed_socket() {
    let c = Containerd::start(ContainerdOpts::default());
    let dir = tempdir("activated-many-");
    let builders = dir.path().join("imgbridge.sock");
    let default = dir.path().join("containerd.sock");
    let bind = |p: &Path| std::os::unix::net::UnixListener::bind(p).unwrap();
    let (b, bt) = (
        bind(&builders),
        bind(&imgbridge::app::ttrpc_path(&builders)),
    );
    let (d, dt) = (bind(&default), bind(&imgbridge::app::ttrpc_path(&default)));
    let names = c"imgbridge.socket:imgbridge.socket:imgbridge.socket:imgbridge.socket";
    let _one = Activated::start_with(&[&b, &bt, &d, &dt], names, c.socket(), dir.path(), "many");
    for sock in [&builders, &default] {
        let v = poll_async(READY_TIMEOUT, || async {
            let ch = try_containerd_channel(sock).await.ok()?;
            let mut v = api::version_client::VersionClient::new(ch);
            let r = tokio::time::timeout(Duration::from_secs(1), v.version(())).await;
            r.ok()?.ok().map(|r| r.into_inner().version)
        })
        .await
        .unwrap_or_else(|| panic!("{} is served", sock.display()));
        assert!(is_containerd_version(&v), "{v}");
    }
    let log = std::fs::read_to_string(dir.path().join("many.log")).unwrap();
    for (sock, role) in [
        (&default, "grpc"),
        (&imgbridge::app::ttrpc_path(&default), "ttrpc"),
    ] {
        let line = format!("socket={} role={role}", sock.display());
        assert!(
            log.contains(&line),
            "the log names every socket it serves ({line}):\n{log}"
        );
    }
    // The test bound them with the umask's mode, not socket_mode's 0660:
    // said, not silently ignored.
    assert!(
        log.contains("are not applied under socket activation"),
        "socket_mode that differs from systemd's socket is flagged:\n{log}"
    );
}

/// The version the containerd under test reports (`1.7.24~ds1`, `v2.4.2`).
fn is_containerd_version(v: &str) -> bool {
    parse_semver(v) == Some(flavor().semver)
}

/// imgbridge started as systemd does with the given sockets passed as fd 3,
/// 4, … (in that order, `LISTEN_FDNAMES` as given); killed on drop.
struct Activated(Child);

impl Activated {
    fn start(
        grpc: &std::os::unix::net::UnixListener,
        ttrpc: &std::os::unix::net::UnixListener,
        upstream: &Path,
        dir: &Path,
        name: &str,
    ) -> Activated {
        Activated::start_with(&[grpc, ttrpc], c"grpc:ttrpc", upstream, dir, name)
    }

    fn start_with(
        sockets: &[&std::os::unix::net::UnixListener],
        names: &'static std::ffi::CStr,
        upstream: &Path,
        dir: &Path,
        name: &str,
    ) -> Activated {
        use std::os::fd::AsRawFd;
        let fds: Vec<i32> = sockets.iter().map(|l| l.as_raw_fd()).collect();
        let count = std::ffi::CString::new(fds.len().to_string()).unwrap();
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbridge"));
        cmd.args(["serve", "--config", "/dev/null", "--upstream"])
            .arg(upstream)
            .arg("--listen")
            .arg(dir.join("not-bound.sock"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // The environment is set in the child (the pid is known only
        // there), so none is set on `cmd`: that would replace it.
        // SAFETY: only async-signal-safe calls plus setenv (glibc resets
        // its locks in the child) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Dies with the test thread that started it, even when the
                // test process is killed before `Drop` runs.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Out of the way of 3, 4, … first, then into place (dup2
                // clears close-on-exec).
                for (i, &fd) in fds.iter().enumerate() {
                    let hi = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100 + i as i32);
                    if hi < 0 || libc::dup2(hi, 3 + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                let mut buf = [0u8; 24];
                let pid = itoa(libc::getpid() as u32, &mut buf);
                libc::setenv(c"LISTEN_PID".as_ptr(), pid.as_ptr().cast(), 1);
                libc::setenv(c"LISTEN_FDS".as_ptr(), count.as_ptr(), 1);
                libc::setenv(c"LISTEN_FDNAMES".as_ptr(), names.as_ptr(), 1);
                libc::setenv(c"RUST_LOG".as_ptr(), c"imgbridge=debug,info".as_ptr(), 1);
                Ok(())
            });
        }
        Activated(cmd.spawn().expect("spawn imgbridge"))
    }
}

impl Drop for Activated {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
