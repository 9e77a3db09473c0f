//! Command line: parse, load configuration, run.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use imgbridge::config::Config;
use imgbridge::proxy::listener::{self, SocketPerms};

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
    /// Import image archives and pull lists once, then exit (1 on failures).
    Import(ImportArgs),
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
    /// containerd's gRPC socket.
    #[arg(long)]
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
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
    /// Watch this directory for image archives and pull lists, importing
    /// into k8s.io (repeatable; adds to config `[[import.dirs]]`).
    #[arg(long = "watch-dir")]
    watch_dir: Vec<PathBuf>,
}

impl Common {
    fn load(&self) -> anyhow::Result<Config> {
        let mut c = Config::load(self.config.as_deref())?;
        if let Some(u) = &self.upstream {
            c.upstream = u.clone();
        }
        if !self.source_namespace.is_empty() {
            c.replication.source_namespaces = self.source_namespace.clone();
        }
        if !self.target_namespace.is_empty() {
            c.replication.target_namespaces = self.target_namespace.clone();
        }
        Ok(c)
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(a) => serve(a),
        Command::Import(a) => import(a),
    }
}

fn import(a: ImportArgs) -> anyhow::Result<()> {
    let mut c = Config::load(a.config.as_deref())?;
    if let Some(u) = a.upstream {
        c.upstream = u;
    }
    if !imgbridge::config::valid_namespace(&a.namespace) {
        anyhow::bail!(
            "--namespace {:?} is not a valid containerd namespace",
            a.namespace
        );
    }
    init_logging(&c);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(async {
        imgbridge::import::import_files_with(
            imgbridge::containerd::Containerd::new(&c.upstream),
            &a.namespace,
            &a.files,
            c.import.pin && !a.no_pin,
            imgbridge::import::archive::Limits {
                max_decompressed: c.import.max_decompressed_bytes,
                ..Default::default()
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

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let mut c = a.common.load()?;
    if let Some(l) = a.listen {
        c.listen = l;
    }
    if let Some(m) = a.socket_mode {
        c.socket_mode = m;
    }
    if let Some(g) = a.socket_group {
        c.socket_group = g;
    }
    for path in a.watch_dir {
        c.import.dirs.push(imgbridge::config::ImportDir {
            path: std::path::absolute(&path).unwrap_or(path),
            namespace: "k8s.io".into(),
        });
    }
    c.validate()?;
    if a.print_config {
        print!("{}", c.to_toml());
        return Ok(());
    }
    init_logging(&c);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let perms = SocketPerms {
            mode: c.socket_mode()?,
            gid: c.socket_gid()?,
        };
        let l = listener::bind(&c.listen, perms)?;
        let ttrpc = if c.ttrpc {
            Some(listener::bind(&imgbridge::app::ttrpc_path(&c.listen), perms)?)
        } else {
            None
        };
        tracing::info!(listen = %c.listen.display(), upstream = %c.upstream.display(), "imgbridge serving");
        let listen = c.listen.clone();
        let res = imgbridge::serve(
            l,
            imgbridge::app::Listeners { ttrpc },
            Arc::new(c.clone()),
            shutdown_signal(),
        )
        .await;
        let _ = std::fs::remove_file(&listen);
        if c.ttrpc {
            let _ = std::fs::remove_file(imgbridge::app::ttrpc_path(&listen));
        }
        tracing::info!("imgbridge stopped");
        res.map_err(anyhow::Error::from)
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

fn init_logging(c: &Config) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(if c.log.filter.is_empty() {
            "info"
        } else {
            &c.log.filter
        })
    });
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if c.log.format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}
