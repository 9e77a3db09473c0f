//! Command line: parse, load configuration, run.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, CommandFactory, Parser, Subcommand};
use imgbridge::config::Config;
use imgbridge::listener::{self, SocketFile, SocketPerms};

/// jemalloc instead of glibc's malloc, which kept what connections freed:
/// after 2500 idle connections closed, VmRSS stayed at 2.2x its baseline
/// even with the read buffers given back (9.9x before that, docs/performance.md;
/// tests/conns.rs); jemalloc: 1.1x within about a second. mimalloc gave it
/// back only when told to purge with no delay (its delayed purges wait for
/// later allocations, which an idle daemon does not make) and started
/// 15 MiB larger (arenas committed up front, as huge pages).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main`. A background thread returns
/// freed pages to the system about a second after they were last used, idle
/// or not; until then they are reused at no cost (no page faults). One such
/// thread, not one per CPU: it only sleeps and purges.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: &u8 =
    &b"background_thread:true,max_background_threads:1,dirty_decay_ms:1000,muzzy_decay_ms:0\0"[0];

#[derive(Parser)]
#[command(name = "imgbridge", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("IMGBRIDGE_GIT_COMMIT"), ")"), about = "containerd proxy shim: build-namespace images appear in k8s.io before the write returns")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Proxy containerd's socket, replicating source-namespace images.
    Serve(ServeArgs),
    /// Run one reconcile pass (repair every target), then exit 0, or 1 listing what could not be repaired.
    Sync(SyncArgs),
    /// Check this node (containerd, CRI, sockets, directories) and say what to fix; exits 1 on any ✗.
    Doctor(DoctorArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff) to stdout, or write one page per command into a directory.
    Man {
        /// Write imgbridge.8 and imgbridge-<command>.8 here instead.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Import image archives and pull lists once, then exit (1 on failures).
    Import(ImportArgs),
    /// The drop-in socket swap: imgbridge on containerd's default socket too (docs/socket-swap.md).
    Swap(SwapArgs),
}

#[derive(Args)]
struct SwapArgs {
    #[command(subcommand)]
    action: SwapAction,
    /// containerd's configuration file.
    #[arg(long, global = true, default_value = "/etc/containerd/config.toml")]
    containerd_config: PathBuf,
    /// Where containerd moves to.
    #[arg(
        long,
        global = true,
        default_value = "/run/containerd/containerd-real.sock"
    )]
    real_socket: PathBuf,
}

#[derive(Subcommand)]
enum SwapAction {
    /// Move containerd aside and serve its default socket, in one step (rolled back if it fails).
    Apply,
    /// Put containerd back on its default socket, as it was before apply.
    Rollback,
    /// Say which pieces of the swap are in place.
    Status,
}

#[derive(Args)]
struct DoctorArgs {
    #[command(flatten)]
    common: Common,
    /// The proxy socket to check (default: listen from the configuration).
    #[arg(long)]
    listen: Option<PathBuf>,
}

#[derive(Args)]
struct SyncArgs {
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct ImportArgs {
    /// TOML configuration file (for import.max_decompressed_bytes, import.pin).
    #[arg(long, env = "IMGBRIDGE_CONFIG")]
    config: Option<PathBuf>,
    /// containerd's gRPC socket.
    #[arg(long)]
    upstream: Option<PathBuf>,
    /// Namespace to import archives into (pull lists always go to k8s.io).
    #[arg(long, default_value = "k8s.io")]
    namespace: String,
    /// Do not pin the imported images.
    #[arg(long)]
    no_pin: bool,
    /// Archives (.tar, .tar.gz, .tar.zst; docker-archive or OCI) and .txt pull lists.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

#[derive(Args)]
struct Common {
    /// TOML configuration file (default /etc/imgbridge/config.toml if present).
    #[arg(long, env = "IMGBRIDGE_CONFIG")]
    config: Option<PathBuf>,
    /// containerd's gRPC socket. The variable is how `imgbridge swap`'s
    /// service drop-in moves it without editing the configuration file.
    #[arg(long, env = "IMGBRIDGE_UPSTREAM")]
    upstream: Option<PathBuf>,
    /// Namespace replicated from (repeatable).
    #[arg(long = "source-namespace")]
    source_namespace: Vec<String>,
    /// Namespace replicated into (repeatable).
    #[arg(long = "target-namespace")]
    target_namespace: Vec<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    common: Common,
    /// Socket to listen on.
    #[arg(long)]
    listen: Option<PathBuf>,
    /// Octal mode of the created socket (default 0660).
    #[arg(long)]
    socket_mode: Option<String>,
    /// Group owning the socket (name or gid; default root).
    #[arg(long)]
    socket_group: Option<String>,
    /// Serve /metrics, /healthz, /readyz, /status on ADDR: TCP host:port, or a Unix socket path (contains '/').
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Log format.
    #[arg(long, value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// Log filter, RUST_LOG syntax (the RUST_LOG variable wins when set).
    #[arg(long, value_name = "FILTER")]
    log_filter: Option<String>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
    /// Watch this directory for image archives and pull lists, importing
    /// into k8s.io (repeatable; adds to config `[[import.dirs]]`).
    #[arg(long = "watch-dir")]
    watch_dir: Vec<PathBuf>,
}

impl Common {
    /// The configuration file with these flags (and `more`) applied.
    fn load(&self, more: Overrides) -> anyhow::Result<Config> {
        let mut c = Config::load(self.config.as_deref())?;
        self.overrides(more).apply(&mut c);
        Ok(c)
    }

    /// These flags, with a command's own (`more`).
    fn overrides(&self, more: Overrides) -> Overrides {
        Overrides {
            upstream: self.upstream.clone(),
            source_namespaces: self.source_namespace.clone(),
            target_namespaces: self.target_namespace.clone(),
            ..more
        }
    }
}

impl ServeArgs {
    /// `serve`'s own flags that override the file.
    fn flags(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            socket_mode: self.socket_mode.clone(),
            socket_group: self.socket_group.clone(),
            metrics_listen: self.metrics_listen.clone(),
            log_format: self.log_format.clone(),
            log_filter: self.log_filter.clone(),
            watch_dirs: self.watch_dir.clone(),
            ..Overrides::default()
        }
    }
}

/// Command-line flags that override the configuration file. Every command
/// gathers its flags here, and [`Overrides::apply`] is the one place where
/// they replace what the file says (a flag not given leaves the file's
/// value; `--watch-dir` adds to the file's directories).
#[derive(Default)]
struct Overrides {
    upstream: Option<PathBuf>,
    source_namespaces: Vec<String>,
    target_namespaces: Vec<String>,
    listen: Option<PathBuf>,
    socket_mode: Option<String>,
    socket_group: Option<String>,
    metrics_listen: Option<String>,
    log_format: Option<String>,
    log_filter: Option<String>,
    watch_dirs: Vec<PathBuf>,
}

impl Overrides {
    fn apply(self, c: &mut Config) {
        if let Some(u) = self.upstream {
            c.upstream = u;
        }
        if !self.source_namespaces.is_empty() {
            c.replication.source_namespaces = self.source_namespaces;
        }
        if !self.target_namespaces.is_empty() {
            c.replication.target_namespaces = self.target_namespaces;
        }
        if let Some(l) = self.listen {
            c.listen = l;
        }
        if let Some(m) = self.socket_mode {
            c.socket_mode = m;
        }
        if let Some(g) = self.socket_group {
            c.socket_group = g;
        }
        if let Some(m) = self.metrics_listen {
            c.metrics.listen = m;
        }
        if let Some(f) = self.log_format {
            c.log.format = f;
        }
        if let Some(f) = self.log_filter {
            c.log.filter = f;
        }
        for path in self.watch_dirs {
            c.import.dirs.push(imgbridge::config::ImportDir {
                path: std::path::absolute(&path).unwrap_or(path),
                namespace: "k8s.io".into(),
            });
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(a) => serve(a),
        Command::Sync(a) => sync(a),
        Command::Import(a) => import(a),
        Command::Doctor(a) => doctor(a),
        Command::Swap(a) => swap(a),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "imgbridge",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Man { dir } => man(dir),
    }
}

fn man(dir: Option<PathBuf>) -> anyhow::Result<()> {
    let cmd = Cli::command();
    let Some(dir) = dir else {
        clap_mangen::Man::new(cmd)
            .section("8")
            .render(&mut std::io::stdout())?;
        return Ok(());
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut pages = vec![cmd.clone()];
    pages.extend(
        cmd.get_subcommands()
            .filter(|c| c.get_name() != "help")
            .map(|c| {
                c.clone()
                    .display_name(format!("imgbridge-{}", c.get_name()))
                    .bin_name(format!("imgbridge {}", c.get_name()))
            }),
    );
    for page in pages {
        let name = page.get_display_name().unwrap_or(page.get_name());
        let path = dir.join(format!("{name}.8"));
        let mut out =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        clap_mangen::Man::new(page).section("8").render(&mut out)?;
    }
    Ok(())
}

fn doctor(a: DoctorArgs) -> anyhow::Result<()> {
    let flags = a.common.overrides(Overrides {
        listen: a.listen,
        ..Overrides::default()
    });
    // A file that does not load is reported; the checks go on with the
    // defaults and the flags.
    let (mut c, load_error) = match Config::load(a.common.config.as_deref()) {
        Ok(c) => (c, None),
        Err(e) => (Config::default(), Some(e)),
    };
    flags.apply(&mut c);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let load_error = load_error.map(|e| e.to_string());
    let report = rt.block_on(imgbridge::ops::doctor::run(
        &c,
        load_error.as_ref().map(|e| e as &dyn std::fmt::Display),
    ));
    let _ = write!(std::io::stdout(), "{report}");
    if report.failed() {
        std::process::exit(1);
    }
    Ok(())
}

fn swap(a: SwapArgs) -> anyhow::Result<()> {
    use imgbridge::ops::swap;
    let o = swap::SwapOptions {
        containerd_config: a.containerd_config,
        real_socket: a.real_socket,
        ..swap::SwapOptions::default()
    };
    match a.action {
        SwapAction::Apply => print!("{}", swap::apply(&o)?),
        SwapAction::Rollback => print!("{}", swap::rollback(&o)?),
        SwapAction::Status => print!("{}", swap::status(&o)?),
    }
    Ok(())
}

fn import(a: ImportArgs) -> anyhow::Result<()> {
    let mut c = Config::load(a.config.as_deref())?;
    let flags = Overrides {
        upstream: a.upstream,
        ..Overrides::default()
    };
    flags.apply(&mut c);
    if !imgbridge::config::valid_namespace(&a.namespace) {
        anyhow::bail!(
            "--namespace {:?} is not a valid containerd namespace",
            a.namespace
        );
    }
    imgbridge::ops::logging::init(&c.log)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(async {
        imgbridge::import::import_files_with(
            imgbridge::containerd::Containerd::new(&c.upstream),
            &a.namespace,
            &a.files,
            imgbridge::import::OneShot {
                pin: c.import.pin && !a.no_pin,
                limits: imgbridge::import::archive::Limits {
                    max_decompressed: c.import.max_decompressed_bytes,
                    max_ratio: c.import.max_decompression_ratio,
                    ..Default::default()
                },
                hosts: imgbridge::import::pull::HostPolicy {
                    allow: c.import.pull_hosts_allow.clone(),
                    deny: c.import.pull_hosts_deny.clone(),
                },
            },
        )
        .await
    });
    let failures = report.failures();
    if failures.is_empty() {
        return Ok(());
    }
    eprintln!("{} failure(s):", failures.len());
    for f in &failures {
        eprintln!("  {f}");
    }
    std::process::exit(1);
}

/// Every proxied connection costs two descriptors (client and containerd):
/// the soft limit (often 1024) would cap imgbridge at ~500 clients while the
/// hard limit allows far more, so it is raised to the hard limit.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => tracing::warn!(soft, hard, error = %e, "could not raise the open-file limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "could not read the open-file limit"),
    }
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let c = a.common.load(a.flags())?;
    c.validate()?;
    if a.print_config {
        print!("{}", c.to_toml());
        return Ok(());
    }
    imgbridge::ops::logging::init(&c.log)?;
    raise_fd_limit();
    // Before any thread starts: this reads and clears LISTEN_* variables.
    let activated = imgbridge::ops::activation::from_env()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let perms = SocketPerms {
            mode: c.socket_mode()?,
            gid: c.socket_gid()?,
        };
        // Socket activation: systemd owns the sockets (and their files).
        let owned = activated.is_none();
        // Files of the sockets bound here, removed however this block ends.
        let mut files = Vec::new();
        let (grpc, ttrpc) = match activated {
            Some(a) => {
                imgbridge::ops::activation::check_settings(&a, &c.listen, perms);
                let (g, t) = a.split();
                let tokio = |v: Vec<std::os::unix::net::UnixListener>| {
                    v.into_iter()
                        .map(tokio::net::UnixListener::from_std)
                        .collect::<std::io::Result<Vec<_>>>()
                };
                (tokio(g)?, tokio(t)?)
            }
            None => {
                // ttrpc first: once the gRPC socket accepts, both are up
                // (clients, and the tests, wait for that one).
                let bind = if c.socket_handover {
                    listener::bind_or_take_over
                } else {
                    listener::bind
                };
                let mut ttrpc = Vec::new();
                if c.ttrpc {
                    let path = imgbridge::app::ttrpc_path(&c.listen);
                    ttrpc.push(bind(&path, perms)?);
                    files.push(SocketFile::new(&path));
                }
                let l = bind(&c.listen, perms)?;
                files.push(SocketFile::new(&c.listen));
                (vec![l], ttrpc)
            }
        };
        // On the signal, the socket files go first: a new instance can bind
        // them at once while this one drains. (They are dropped with the
        // future, before the listeners close, however `serve` ends.)
        let shutdown = {
            let signal = shutdown_signal();
            async move {
                signal.await;
                drop(files);
            }
        };
        tracing::info!(listen = %c.listen.display(), socket_activated = !owned, upstream = %c.upstream.display(), "imgbridge serving");
        for (l, role) in grpc.iter().map(|l| (l, "grpc")).chain(ttrpc.iter().map(|l| (l, "ttrpc"))) {
            let path = l
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(|p| p.display().to_string()))
                .unwrap_or_else(|| "(unnamed)".into());
            tracing::info!("serving socket={path} role={role}");
        }
        let res = imgbridge::serve(
            grpc,
            imgbridge::app::Listeners { ttrpc },
            Arc::new(c.clone()),
            shutdown,
        )
        .await;
        tracing::info!("imgbridge stopped");
        res.map_err(anyhow::Error::from)
    })
}

fn sync(a: SyncArgs) -> anyhow::Result<()> {
    let c = a.common.load(Overrides::default())?;
    c.validate()?;
    imgbridge::ops::logging::init(&c.log)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let containerd = imgbridge::containerd::Containerd::new(&c.upstream);
        containerd
            .version()
            .await
            .with_context(|| format!("containerd at {} is not reachable", c.upstream.display()))?;
        let r = imgbridge::replicate::Replicator::new(containerd, (&c.replication).into());
        anyhow::Ok(imgbridge::reconcile::pass(&r).await)
    })?;
    println!("checked {} images, {} writes", report.images, report.writes);
    if report.failed.is_empty() {
        return Ok(());
    }
    for (img, e) in &report.failed {
        println!("could not repair {img}: {e}");
    }
    std::process::exit(1);
}

/// Installs the SIGTERM/SIGINT handlers now (so a stop right after start is
/// graceful too) and resolves on the first signal.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    }
}
