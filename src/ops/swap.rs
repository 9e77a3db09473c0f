//! `imgbridge swap`: the drop-in socket swap (docs/socket-swap.md) as one
//! operation that can be undone. imgbridge takes containerd's default socket
//! and containerd moves to the real socket, so every client (kubelet
//! included) goes through imgbridge with no change of its own.
//!
//! The manual procedure dropped the default socket between its steps;
//! [`apply`] records what it replaces ([`state`]), edits containerd's config
//! ([`containerd_config`]), writes three drop-ins ([`dropins`]), then
//! restarts containerd and then imgbridge.socket (why that order:
//! [`systemd`]) and waits until both sockets answer. Any failure after the
//! first change is rolled back before apply returns. [`rollback`] undoes it from whatever is left,
//! [`status`] says which pieces are in place.

mod containerd_config;
mod dropins;
mod state;
mod systemd;

use std::fmt;
use std::fs::File;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context};
use nix::fcntl::{Flock, FlockArg};

use containerd_config::Placement;
use dropins::Found;
use state::State;
use systemd::Host;

pub use state::PATH as STATE_FILE;

/// How long apply and rollback wait for the sockets to answer after the
/// restart (containerd loads every plugin first; CRI takes longest).
const VERIFY_DEADLINE: Duration = Duration::from_secs(90);

/// What to swap, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwapOptions {
    /// Every file path is taken under this directory: `/` on a node, a
    /// temporary directory in tests.
    pub root: PathBuf,
    /// containerd's config file (created if missing).
    pub containerd_config: PathBuf,
    /// Where containerd moves to; its ttrpc socket is this + `.ttrpc`.
    pub real_socket: PathBuf,
    /// containerd's default socket, which imgbridge takes.
    pub default_socket: PathBuf,
    /// Run `systemctl` (reload, restart, checks). Off, only files change.
    pub systemctl: bool,
}

impl Default for SwapOptions {
    fn default() -> Self {
        SwapOptions {
            root: PathBuf::from("/"),
            containerd_config: PathBuf::from("/etc/containerd/config.toml"),
            real_socket: PathBuf::from("/run/containerd/containerd-real.sock"),
            default_socket: PathBuf::from("/run/containerd/containerd.sock"),
            systemctl: true,
        }
    }
}

/// What apply or rollback did, one line per change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Whether anything changed (false: already applied / nothing to roll back).
    pub changed: bool,
    pub lines: Vec<String>,
    /// What could not be done or restored, and why.
    pub warnings: Vec<String>,
}

impl Report {
    fn unchanged(line: impl Into<String>) -> Report {
        Report {
            changed: false,
            lines: vec![line.into()],
            warnings: Vec::new(),
        }
    }

    fn push(&mut self, line: impl Into<String>) {
        self.changed = true;
        self.lines.push(line.into());
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        Ok(())
    }
}

/// Overall verdict of [`status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Applied,
    NotApplied,
    Partial,
}

/// One piece of the swap and whether it is in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub what: String,
    pub in_place: bool,
    pub detail: String,
}

/// Which pieces of the swap are in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub verdict: Verdict,
    pub pieces: Vec<Piece>,
    /// Things worth knowing that are not pieces (a manual swap's files).
    pub notes: Vec<String>,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.verdict {
            Verdict::Applied => writeln!(f, "socket swap: applied")?,
            Verdict::NotApplied => writeln!(f, "socket swap: not applied")?,
            Verdict::Partial => {
                let missing: Vec<&str> = self
                    .pieces
                    .iter()
                    .filter(|p| !p.in_place)
                    .map(|p| p.what.as_str())
                    .collect();
                writeln!(
                    f,
                    "socket swap: partially applied (not in place: {}); `imgbridge swap apply` completes it, `imgbridge swap rollback` undoes it",
                    missing.join(", ")
                )?
            }
        }
        for p in &self.pieces {
            let mark = if p.in_place { '✓' } else { '✗' };
            writeln!(f, "  {mark} {}: {}", p.what, p.detail)?;
        }
        for n in &self.notes {
            writeln!(f, "  ! {n}")?;
        }
        Ok(())
    }
}

/// Moves containerd to the real socket and gives its default socket to
/// imgbridge, as one operation: refused with what to do on a node it is
/// not for, "already applied" when it is, rolled back on any failure.
pub fn apply(o: &SwapOptions) -> anyhow::Result<Report> {
    let host = systemd::Systemd {
        root: o.root.clone(),
    };
    Swap::new(o, &host).apply()
}

/// Undoes [`apply`] from whatever is left of it: containerd's config values
/// as they were, drop-ins gone, containerd back on its default socket.
pub fn rollback(o: &SwapOptions) -> anyhow::Result<Report> {
    let host = systemd::Systemd {
        root: o.root.clone(),
    };
    Swap::new(o, &host).rollback()
}

/// Which pieces of the swap are in place (files, and with `systemctl`
/// whether imgbridge.socket lists the default socket).
pub fn status(o: &SwapOptions) -> anyhow::Result<Status> {
    let host = systemd::Systemd {
        root: o.root.clone(),
    };
    Swap::new(o, &host).status()
}

/// `p` (a host path) under `root`.
fn under(root: &Path, p: &Path) -> PathBuf {
    let rel: PathBuf = p
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::Prefix(_)))
        .collect();
    root.join(rel)
}

fn read_optional(path: &Path) -> io::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn utf8(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .ok_or_else(|| anyhow!("{}: not UTF-8", p.display()))
}

/// Paths the swap writes into unit files and containerd's config, checked
/// before anything is written.
fn validate(o: &SwapOptions) -> anyhow::Result<()> {
    ensure!(
        o.containerd_config.is_absolute(),
        "containerd config {}: not an absolute path",
        o.containerd_config.display()
    );
    for (what, p) in [
        ("real socket", &o.real_socket),
        ("default socket", &o.default_socket),
    ] {
        let s = utf8(p)?;
        ensure!(p.is_absolute(), "{what} {s}: not an absolute path");
        ensure!(
            !s.chars().any(|c| c.is_whitespace()
                || c.is_control()
                || matches!(c, '%' | '"' | '\'' | '\\')),
            "{what} {s}: unit files cannot hold it as it is; choose a plain path"
        );
        // containerd refuses longer socket paths (pkg/sys/socket_unix.go).
        ensure!(
            s.len() + ".ttrpc".len() <= 104,
            "{what} {s}.ttrpc is longer than a Unix socket path may be (104 bytes)"
        );
    }
    ensure!(
        o.real_socket != o.default_socket,
        "the real and the default socket are the same path"
    );
    Ok(())
}

/// The directories between `dir` and its closest existing ancestor, outermost first.
fn missing_dirs(root: &Path, dir: &Path) -> Vec<PathBuf> {
    let mut missing: Vec<PathBuf> = dir
        .ancestors()
        .take_while(|d| !under(root, d).exists())
        .map(Path::to_path_buf)
        .collect();
    missing.reverse();
    missing
}

/// What apply will change; empty when everything is in place.
struct Plan {
    state: State,
    /// The new config and whether it creates the file.
    config: Option<(containerd_config::Edited, bool)>,
    dropins: Vec<dropins::DropIn>,
    /// Host paths, outermost first.
    dirs: Vec<PathBuf>,
}

impl Plan {
    fn is_empty(&self) -> bool {
        self.config.is_none() && self.dropins.is_empty() && self.dirs.is_empty()
    }
}

/// When rollback restarts the units.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Restart {
    /// Apply failed before any `systemctl` call: files only.
    Never,
    /// Apply failed after its `systemctl` calls began.
    Always,
    /// `imgbridge swap rollback`: if it changed files, or containerd is not
    /// on its default socket.
    IfNeeded,
}

/// One apply, rollback or status run.
struct Swap<'a> {
    o: &'a SwapOptions,
    /// `None` when `systemctl` is off.
    host: Option<&'a dyn Host>,
    deadline: Duration,
}

impl<'a> Swap<'a> {
    fn new(o: &'a SwapOptions, host: &'a dyn Host) -> Swap<'a> {
        Swap {
            o,
            host: o.systemctl.then_some(host),
            deadline: VERIFY_DEADLINE,
        }
    }

    fn under(&self, p: impl AsRef<Path>) -> PathBuf {
        under(&self.o.root, p.as_ref())
    }

    /// One swap at a time: an exclusive lock on imgbridge's state directory.
    fn lock(&self) -> anyhow::Result<Flock<File>> {
        let dir = self.under(Path::new(STATE_FILE).parent().unwrap_or(Path::new("/")));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let f = File::open(&dir).with_context(|| format!("cannot open {}", dir.display()))?;
        Flock::lock(f, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            anyhow!(
                "another `imgbridge swap` is running (lock on {}: {e})",
                dir.display()
            )
        })
    }

    fn state_path(&self) -> PathBuf {
        self.under(STATE_FILE)
    }

    fn apply(&self) -> anyhow::Result<Report> {
        validate(self.o)?;
        if let Some(h) = self.host {
            systemd::preconditions(h).map_err(anyhow::Error::msg)?;
        }
        let _lock = self.lock()?;
        let existing = State::load(&self.state_path())?;
        let plan = self.plan(existing.as_ref())?;
        if plan.is_empty() {
            return self.already_applied();
        }
        let mut report = Report::default();
        plan.state.save(&self.state_path())?;
        report.push(format!("recorded what it replaces in {STATE_FILE}"));
        let mut restarted = false;
        match self.change(&plan, &mut report, &mut restarted) {
            Ok(()) => Ok(report),
            Err(e) => {
                let restart = if restarted {
                    Restart::Always
                } else {
                    Restart::Never
                };
                match self.rollback_locked(restart) {
                    Ok(rb) => Err(anyhow!(
                        "{e:#}\nrolled back, as before `imgbridge swap apply`:\n{}",
                        rb.to_string().trim_end()
                    )),
                    Err(e2) => Err(anyhow!(
                        "{e:#}\nrolling back failed too: {e2:#}\nfix that, then run `imgbridge swap rollback`"
                    )),
                }
            }
        }
    }

    /// Everything is in place; with systemctl, make sure it is live too.
    fn already_applied(&self) -> anyhow::Result<Report> {
        let Some(h) = self.host else {
            return Ok(Report::unchanged("already applied: nothing changed"));
        };
        let (real, default) = (&self.o.real_socket, &self.o.default_socket);
        if let Ok(v) = systemd::check_applied(h, real, default) {
            return Ok(Report::unchanged(format!(
                "already applied: nothing changed ({v})"
            )));
        }
        // Files in place but not live: never restarted, or a failed restart.
        let mut report = Report::default();
        report.push("files already in place; restarting the units to use them");
        let live = systemd::run(h, systemd::APPLY, &mut report.lines)
            .and_then(|()| systemd::wait_applied(h, real, default, self.deadline));
        match live {
            Ok(v) => {
                report.push(format!("verified: {v}"));
                Ok(report)
            }
            Err(e) => Err(anyhow!(
                "{e}\nthe swap's files are in place but it is not live; `imgbridge swap rollback` undoes it"
            )),
        }
    }

    fn plan(&self, existing: Option<&State>) -> anyhow::Result<Plan> {
        let o = self.o;
        for m in dropins::MANUAL {
            if let Some(t) = read_optional(&self.under(m))? {
                if !dropins::is_ours(&t) {
                    bail!("{m} exists: the manual swap of docs/socket-swap.md is in place; undo it (its \"Roll back\" section) before `imgbridge swap apply`");
                }
            }
        }
        let (real, default) = (utf8(&o.real_socket)?, utf8(&o.default_socket)?);
        let real_ttrpc = format!("{real}.ttrpc");
        let mut state = existing
            .cloned()
            .unwrap_or_else(|| State::new(&o.containerd_config, &o.real_socket, &o.default_socket));
        let shown = o.containerd_config.display();

        let config = match read_optional(&self.under(&o.containerd_config))? {
            None => Some((containerd_config::new_file(real, &real_ttrpc), true)),
            Some(text) => {
                let a = containerd_config::read(&text)
                    .with_context(|| format!("containerd's config {shown}"))?;
                match a.placement(default, real) {
                    Placement::Default => {
                        let e = containerd_config::set(&text, real, &real_ttrpc)
                            .with_context(|| format!("containerd's config {shown}"))?;
                        Some((e, false))
                    }
                    Placement::Swapped if existing.is_some() => None,
                    Placement::Swapped => bail!(
                        "containerd's config {shown} already moves containerd to {real}, but there is no {STATE_FILE} saying `imgbridge swap` did it (the manual swap of docs/socket-swap.md?): undo that first (its \"Roll back\" section), then run `imgbridge swap apply` again"
                    ),
                    Placement::Elsewhere(what) => bail!(
                        "containerd's config {shown} already moves containerd away from {default} ({what}): someone else moved it, and the swap only moves containerd from its default socket. Point builders at /run/imgbridge/containerd.sock instead, or set containerd's addresses back to the defaults first"
                    ),
                }
            }
        };
        if let Some((e, created)) = &config {
            state.containerd_config = o.containerd_config.clone();
            state.config_created = *created;
            state.config_written_sha256 = Some(containerd_config::sha256(e.text.as_bytes()));
            state.config_before_sha256 = e.before_sha256.clone();
            state.grpc = Some(e.grpc.clone());
            state.ttrpc = Some(e.ttrpc.clone());
        }
        state.real_socket = o.real_socket.clone();
        state.default_socket = o.default_socket.clone();

        let mut writes = Vec::new();
        for d in dropins::all(&o.default_socket, &o.real_socket) {
            let path = self.under(d.path);
            match dropins::inspect(&path, &d.text)
                .with_context(|| format!("cannot read {}", d.path))?
            {
                Found::Current => {}
                Found::Absent | Found::Outdated => writes.push(d),
                Found::Foreign => bail!(
                    "{} exists and was not written by `imgbridge swap`; move it away first",
                    d.path
                ),
            }
        }

        let mut wanted: Vec<PathBuf> = writes
            .iter()
            .filter_map(|d| Path::new(d.path).parent().map(Path::to_path_buf))
            .collect();
        if let (Some((_, true)), Some(dir)) = (&config, o.containerd_config.parent()) {
            wanted.insert(0, dir.to_path_buf());
        }
        let mut dirs: Vec<PathBuf> = Vec::new();
        for d in wanted {
            for m in missing_dirs(&o.root, &d) {
                if !dirs.contains(&m) {
                    dirs.push(m);
                }
            }
        }
        for d in &dirs {
            if !state.created_dirs.contains(d) {
                state.created_dirs.push(d.clone());
            }
        }
        Ok(Plan {
            state,
            config,
            dropins: writes,
            dirs,
        })
    }

    /// Carries out `plan` (its state already saved); `restarted` tells
    /// the caller whether systemctl calls began.
    fn change(&self, plan: &Plan, report: &mut Report, restarted: &mut bool) -> anyhow::Result<()> {
        let o = self.o;
        for d in &plan.dirs {
            std::fs::create_dir(self.under(d))
                .with_context(|| format!("cannot create {}", d.display()))?;
            report.push(format!("created {}", d.display()));
        }
        if let Some((e, created)) = &plan.config {
            let shown = o.containerd_config.display();
            crate::atomic_file::write(&self.under(&o.containerd_config), e.text.as_bytes(), 0o644)
                .with_context(|| format!("cannot write {shown}"))?;
            let real = o.real_socket.display();
            if *created {
                report.push(format!(
                    "created {shown} (there was none): version = 2, [grpc] address = {real}, [ttrpc] address = {real}.ttrpc"
                ));
            } else {
                for (p, new) in [
                    (&e.grpc, real.to_string()),
                    (&e.ttrpc, format!("{real}.ttrpc")),
                ] {
                    let was = p.value.as_deref().unwrap_or("unset");
                    report.push(format!(
                        "{shown}: {} address = {new} (was {was})",
                        containerd_config::table_name(&p.table)
                    ));
                }
            }
        }
        for d in &plan.dropins {
            crate::atomic_file::write(&self.under(d.path), d.text.as_bytes(), 0o644)
                .with_context(|| format!("cannot write {}", d.path))?;
            report.push(format!("wrote {}", d.path));
        }
        let Some(h) = self.host else {
            report.push(format!(
                "systemctl not run: {} take it into use",
                systemd::commands(systemd::APPLY)
            ));
            return Ok(());
        };
        *restarted = true;
        systemd::run(h, systemd::APPLY, &mut report.lines).map_err(anyhow::Error::msg)?;
        let v = systemd::wait_applied(h, &o.real_socket, &o.default_socket, self.deadline)
            .map_err(anyhow::Error::msg)?;
        report.push(format!("verified: {v}"));
        Ok(())
    }

    fn rollback(&self) -> anyhow::Result<Report> {
        validate(self.o)?;
        if let Some(h) = self.host {
            ensure!(
                h.booted(),
                "systemd is not running as PID 1 (no /run/systemd/system): run the rollback without systemctl, then restart containerd and imgbridge yourself"
            );
        }
        let _lock = self.lock()?;
        self.rollback_locked(Restart::IfNeeded)
    }

    /// Rollback's work, the lock held.
    fn rollback_locked(&self, restart: Restart) -> anyhow::Result<Report> {
        let o = self.o;
        let state_path = self.state_path();
        let state = State::load(&state_path)?;
        let mut report = Report::default();
        let real = state.as_ref().map_or(&o.real_socket, |s| &s.real_socket);
        let default = state
            .as_ref()
            .map_or(&o.default_socket, |s| &s.default_socket);
        let config = state
            .as_ref()
            .map_or(&o.containerd_config, |s| &s.containerd_config);
        let config_file = self.under(config);
        let shown = config.display();
        let (real_s, default_s) = (utf8(real)?, utf8(default)?);

        match (&state, read_optional(&config_file)?) {
            (Some(s), None) => {
                if !s.config_created {
                    report.warnings.push(format!(
                        "containerd's config {shown} is gone: nothing to restore in it"
                    ));
                }
            }
            (Some(s), Some(now)) => {
                let untouched = s.config_created
                    && s.config_written_sha256.as_deref()
                        == Some(&containerd_config::sha256(now.as_bytes()));
                if untouched {
                    crate::atomic_file::remove(&config_file)
                        .with_context(|| format!("cannot remove {shown}"))?;
                    report.push(format!("removed {shown} (there was none before)"));
                } else if let (Some(g), Some(t)) = (&s.grpc, &s.ttrpc) {
                    let real_ttrpc = format!("{real_s}.ttrpc");
                    let r = containerd_config::restore(
                        &now,
                        &[(g, real_s), (t, &real_ttrpc)],
                        s.config_before_sha256.as_deref(),
                    )
                    .with_context(|| format!("containerd's config {shown}"))?;
                    if r.text != now {
                        crate::atomic_file::write(&config_file, r.text.as_bytes(), 0o644)
                            .with_context(|| format!("cannot write {shown}"))?;
                        report.push(format!("{shown}: {}", r.restored.join(", ")));
                    }
                    if s.config_created {
                        report.warnings.push(format!(
                            "kept {shown}: `imgbridge swap` created it, but it changed since"
                        ));
                    }
                    report
                        .warnings
                        .extend(r.left.into_iter().map(|l| format!("{shown}: {l}")));
                }
            }
            (None, Some(now)) => {
                let swapped = containerd_config::read(&now)
                    .map(|a| a.placement(default_s, real_s) == Placement::Swapped)
                    .unwrap_or(false);
                if swapped {
                    let (new, changed) = containerd_config::reset(&now, real_s, default_s)
                        .with_context(|| format!("containerd's config {shown}"))?;
                    crate::atomic_file::write(&config_file, new.as_bytes(), 0o644)
                        .with_context(|| format!("cannot write {shown}"))?;
                    report.push(format!("{shown}: {}", changed.join(", ")));
                    report.warnings.push(format!(
                        "{STATE_FILE} is missing, so the values {shown} had before the swap are unknown: set containerd's defaults instead; check the file"
                    ));
                }
            }
            (None, None) => {}
        }

        // With systemctl, the socket's drop-in goes only once containerd is
        // back on the default path (see `systemd::ROLLBACK`).
        let restarting = self.host.is_some() && restart != Restart::Never;
        let mut socket_dropin = None;
        for path in [dropins::SOCKET, dropins::SERVICE, dropins::KUBELET] {
            let file = self.under(path);
            match read_optional(&file).with_context(|| format!("cannot read {path}"))? {
                Some(t) if dropins::is_ours(&t) && restarting && path == dropins::SOCKET => {
                    socket_dropin = Some(file);
                }
                Some(t) if dropins::is_ours(&t) => {
                    crate::atomic_file::remove(&file)
                        .with_context(|| format!("cannot remove {path}"))?;
                    report.push(format!("removed {path}"));
                }
                Some(_) => report
                    .warnings
                    .push(format!("left {path}: not written by `imgbridge swap`")),
                None => {}
            }
        }
        // Without the state file it is unknown which directories apply
        // created: they stay (empty drop-in directories change nothing).
        let dirs = state
            .as_ref()
            .map(|s| s.created_dirs.as_slice())
            .unwrap_or_default();
        for d in dirs.iter().rev() {
            if std::fs::remove_dir(self.under(d)).is_ok() {
                report.push(format!("removed {}", d.display()));
            }
        }
        let files_changed = report.changed;
        if state.is_some() {
            crate::atomic_file::remove(&state_path)
                .with_context(|| format!("cannot remove {STATE_FILE}"))?;
            report.push(format!("removed {STATE_FILE}"));
        }

        match (self.host, restart) {
            (None, _) if files_changed => report.push(format!(
                "systemctl not run: {} put containerd back",
                systemd::commands(systemd::ROLLBACK)
            )),
            (None, _) | (Some(_), Restart::Never) => {}
            (Some(h), _) => {
                let needed = restart == Restart::Always
                    || files_changed
                    || socket_dropin.is_some()
                    || systemd::check_rolled_back(h, default).is_err();
                if needed {
                    // containerd back on its socket is what counts: a step
                    // that failed (imgbridge.service at its start limit) is
                    // a warning once that holds.
                    let mut ran = systemd::run(h, systemd::ROLLBACK, &mut report.lines);
                    if let Some(file) = socket_dropin.take() {
                        crate::atomic_file::remove(&file)
                            .with_context(|| format!("cannot remove {}", dropins::SOCKET))?;
                        report.push(format!("removed {}", dropins::SOCKET));
                        let then = systemd::run(h, systemd::ROLLBACK_SOCKET, &mut report.lines);
                        ran = ran.and(then);
                    }
                    let v = systemd::wait_rolled_back(h, default, self.deadline);
                    match (ran, v) {
                        (ran, Ok(v)) => {
                            report.warnings.extend(ran.err());
                            report.push(format!("verified: {v}"));
                        }
                        (Err(e), Err(v)) => bail!("{e}\n{v}"),
                        (Ok(()), Err(v)) => bail!("{v}"),
                    }
                    if let Some(why) = systemd::failed(h, &["imgbridge.socket"]) {
                        report.warnings.push(format!(
                            "{why}: builders' /run/imgbridge/containerd.sock is down; `systemctl restart imgbridge.socket` once imgbridge.service can start"
                        ));
                    }
                }
            }
        }
        if !report.changed {
            report
                .lines
                .push("not applied: nothing to roll back".into());
        }
        Ok(report)
    }

    fn status(&self) -> anyhow::Result<Status> {
        let o = self.o;
        let state = State::load(&self.state_path());
        let (real, default) = (utf8(&o.real_socket)?, utf8(&o.default_socket)?);
        let mut pieces = Vec::new();
        let mut notes = Vec::new();

        let config = match &state {
            Ok(Some(s)) => s.containerd_config.clone(),
            _ => o.containerd_config.clone(),
        };
        let what = format!("containerd config {}", config.display());
        pieces.push(match read_optional(&self.under(&config)) {
            Ok(None) => Piece {
                what,
                in_place: false,
                detail: "no file: containerd on its default socket".into(),
            },
            Ok(Some(t)) => match containerd_config::read(&t) {
                Ok(a) => {
                    let placement = a.placement(default, real);
                    if let Placement::Elsewhere(_) = placement {
                        notes.push(format!("containerd's config moves containerd neither to {real} nor leaves it on {default}"));
                    }
                    Piece {
                        what,
                        in_place: placement == Placement::Swapped,
                        detail: a.describe(default),
                    }
                }
                Err(e) => Piece {
                    what,
                    in_place: false,
                    detail: e.to_string(),
                },
            },
            Err(e) => Piece {
                what,
                in_place: false,
                detail: format!("cannot read it: {e}"),
            },
        });
        for d in dropins::all(&o.default_socket, &o.real_socket) {
            let (in_place, detail) = match dropins::inspect(&self.under(d.path), &d.text) {
                Ok(Found::Current) => (true, "in place".to_owned()),
                Ok(Found::Absent) => (false, "missing".to_owned()),
                Ok(Found::Outdated) => (
                    false,
                    "written by `imgbridge swap` for other paths".to_owned(),
                ),
                Ok(Found::Foreign) => (false, "not written by `imgbridge swap`".to_owned()),
                Err(e) => (false, format!("cannot read it: {e}")),
            };
            pieces.push(Piece {
                what: format!("drop-in {}", d.path),
                in_place,
                detail,
            });
        }
        pieces.push(match &state {
            Ok(Some(_)) => Piece {
                what: format!("state file {STATE_FILE}"),
                in_place: true,
                detail: "records the values before the swap".into(),
            },
            Ok(None) => Piece {
                what: format!("state file {STATE_FILE}"),
                in_place: false,
                detail: "missing".into(),
            },
            Err(e) => Piece {
                what: format!("state file {STATE_FILE}"),
                in_place: false,
                detail: e.to_string(),
            },
        });
        if let Some(h) = self.host.filter(|h| h.booted()) {
            let listed = h
                .systemctl(&["show", "-p", "Listen", "--value", "imgbridge.socket"])
                .map(|s| {
                    s.lines().any(|l| {
                        l.trim().trim_start_matches("Listen=").split(" (").next() == Some(default)
                    })
                });
            pieces.push(Piece {
                what: "imgbridge.socket".into(),
                in_place: listed == Ok(true),
                detail: match listed {
                    Ok(true) => format!("listens on {default}"),
                    Ok(false) => format!("does not listen on {default}"),
                    Err(e) => e,
                },
            });
        }
        for m in dropins::MANUAL {
            if self.under(m).exists() {
                notes.push(format!("{m} exists: a manual swap (docs/socket-swap.md)"));
            }
        }
        let verdict = if pieces.iter().all(|p| p.in_place) {
            Verdict::Applied
        } else if pieces.iter().any(|p| p.in_place) {
            Verdict::Partial
        } else {
            Verdict::NotApplied
        };
        Ok(Status {
            verdict,
            pieces,
            notes,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeMap;
    use std::os::unix::fs::PermissionsExt;

    use super::containerd_config::tests::{DEFAULT, REAL, REAL_TTRPC, SAMPLES};
    use super::*;

    const CONFIG: &str = "/etc/containerd/config.toml";

    /// A node's tree: `/etc/systemd/system` with the package's drop-in
    /// directory, imgbridge's state directory, and `config` if any.
    fn node(config: Option<&str>) -> (tempfile::TempDir, SwapOptions) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in [
            "etc/containerd",
            "etc/systemd/system/imgbridge.socket.d",
            "var/lib/imgbridge",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        if let Some(c) = config {
            std::fs::write(root.join("etc/containerd/config.toml"), c).unwrap();
        }
        let o = SwapOptions {
            root: root.to_path_buf(),
            systemctl: false,
            ..SwapOptions::default()
        };
        (dir, o)
    }

    /// Every path under `root` with its content (files) and mode.
    fn tree(root: &Path) -> BTreeMap<PathBuf, (Option<Vec<u8>>, u32)> {
        let mut out = BTreeMap::new();
        let mut todo = vec![root.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                let meta = e.metadata().unwrap();
                let mode = meta.permissions().mode();
                let rel = p.strip_prefix(root).unwrap().to_path_buf();
                if meta.is_dir() {
                    todo.push(p);
                    out.insert(rel, (None, mode));
                } else {
                    out.insert(rel, (Some(std::fs::read(&p).unwrap()), mode));
                }
            }
        }
        out
    }

    fn read(o: &SwapOptions, p: &str) -> String {
        std::fs::read_to_string(under(&o.root, Path::new(p))).unwrap()
    }

    fn exists(o: &SwapOptions, p: &str) -> bool {
        under(&o.root, Path::new(p)).exists()
    }

    #[test]
    fn apply_then_rollback_restores_every_byte() {
        let mut cases: Vec<(&str, Option<&str>)> =
            SAMPLES.iter().map(|(n, t)| (*n, Some(*t))).collect();
        cases.push(("no config file", None));
        cases.push((
            "no final newline",
            Some("version = 2\n[grpc]\n  address = \"/run/containerd/containerd.sock\""),
        ));
        for (name, config) in cases {
            let (_dir, o) = node(config);
            let before = tree(&o.root);
            let r = apply(&o).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(r.changed, "{name}");
            let a = containerd_config::read(&read(&o, CONFIG)).unwrap();
            assert_eq!(a.placement(DEFAULT, REAL), Placement::Swapped, "{name}");
            for d in [dropins::SOCKET, dropins::SERVICE, dropins::KUBELET] {
                assert!(exists(&o, d), "{name}: {d}");
            }
            assert!(exists(&o, STATE_FILE), "{name}");
            assert_eq!(status(&o).unwrap().verdict, Verdict::Applied, "{name}");

            let r = rollback(&o).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(r.warnings.is_empty(), "{name}: {r}");
            assert_eq!(tree(&o.root), before, "{name}: {r}");
            assert_eq!(status(&o).unwrap().verdict, Verdict::NotApplied, "{name}");
        }
    }

    #[test]
    fn apply_reports_each_change() {
        let (_dir, o) = node(Some(SAMPLES[1].1));
        let r = apply(&o).unwrap();
        let text = r.to_string();
        assert!(
            text.contains(&format!(
                "{CONFIG}: [grpc] address = {REAL} (was \"{DEFAULT}\")"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "{CONFIG}: [ttrpc] address = {REAL_TTRPC} (was \"\")"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("wrote {}", dropins::SOCKET)),
            "{text}"
        );
        assert!(
            text.contains("created /etc/systemd/system/kubelet.service.d"),
            "{text}"
        );
        assert!(text.contains("systemctl not run"), "{text}");
        // The state file records the values before, and what it created.
        let s = State::load(&under(&o.root, Path::new(STATE_FILE)))
            .unwrap()
            .unwrap();
        assert_eq!(
            s.grpc.unwrap().value.as_deref(),
            Some("\"/run/containerd/containerd.sock\"")
        );
        assert!(s
            .created_dirs
            .contains(&PathBuf::from("/etc/systemd/system/kubelet.service.d")));
        assert!(!s
            .created_dirs
            .contains(&PathBuf::from("/etc/systemd/system/imgbridge.socket.d")));
    }

    #[test]
    fn apply_twice_changes_nothing() {
        let (_dir, o) = node(Some(SAMPLES[2].1));
        apply(&o).unwrap();
        let after = tree(&o.root);
        let r = apply(&o).unwrap();
        assert!(!r.changed);
        assert_eq!(r.to_string(), "already applied: nothing changed\n");
        assert_eq!(tree(&o.root), after);
    }

    #[test]
    fn apply_completes_a_partial_swap() {
        let (_dir, o) = node(Some(SAMPLES[3].1));
        apply(&o).unwrap();
        let want = tree(&o.root);
        std::fs::remove_file(under(&o.root, Path::new(dropins::KUBELET))).unwrap();
        assert_eq!(status(&o).unwrap().verdict, Verdict::Partial);
        let r = apply(&o).unwrap();
        assert_eq!(r.lines[1], format!("wrote {}", dropins::KUBELET), "{r}");
        assert!(!r.to_string().contains(CONFIG), "{r}");
        assert_eq!(tree(&o.root), want);
    }

    #[test]
    fn refuses_containerd_moved_elsewhere() {
        let k3s = "version = 2\n[grpc]\n  address = \"/run/k3s/containerd/containerd.sock\"\n";
        let (_dir, o) = node(Some(k3s));
        let before = tree(&o.root);
        let e = apply(&o).unwrap_err().to_string();
        assert!(e.contains("someone else moved it"), "{e}");
        assert!(e.contains("/run/k3s/containerd/containerd.sock"), "{e}");
        assert!(e.contains("/run/imgbridge/containerd.sock"), "{e}");
        assert_eq!(tree(&o.root), before);
    }

    #[test]
    fn refuses_a_manual_swap() {
        let manual = format!(
            "version = 2\n[grpc]\n  address = \"{REAL}\"\n[ttrpc]\n  address = \"{REAL_TTRPC}\"\n"
        );
        let (_dir, o) = node(Some(&manual));
        let before = tree(&o.root);
        let e = apply(&o).unwrap_err().to_string();
        assert!(e.contains("manual swap"), "{e}");
        assert_eq!(tree(&o.root), before);

        let (_dir, o) = node(Some(SAMPLES[1].1));
        std::fs::write(
            under(&o.root, Path::new(dropins::MANUAL[0])),
            "[Socket]\nListenStream=\n",
        )
        .unwrap();
        let e = apply(&o).unwrap_err().to_string();
        assert!(e.contains("manual swap"), "{e}");
    }

    #[test]
    fn refuses_a_foreign_drop_in() {
        let (_dir, o) = node(Some(SAMPLES[1].1));
        std::fs::write(
            under(&o.root, Path::new(dropins::SOCKET)),
            "[Socket]\nBacklog=5\n",
        )
        .unwrap();
        let before = tree(&o.root);
        let e = apply(&o).unwrap_err().to_string();
        assert!(e.contains("not written by `imgbridge swap`"), "{e}");
        assert_eq!(tree(&o.root), before);
    }

    #[test]
    fn refuses_unit_file_hostile_paths() {
        let (_dir, mut o) = node(None);
        o.real_socket = "/run/containerd/with space.sock".into();
        assert!(apply(&o).unwrap_err().to_string().contains("plain path"));
        o.real_socket = o.default_socket.clone();
        assert!(apply(&o).is_err());
    }

    #[test]
    fn keeps_mode_of_the_config() {
        let (_dir, o) = node(Some(SAMPLES[1].1));
        let f = under(&o.root, Path::new(CONFIG));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        apply(&o).unwrap();
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        rollback(&o).unwrap();
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn rollback_twice_is_quiet() {
        let (_dir, o) = node(Some(SAMPLES[0].1));
        apply(&o).unwrap();
        rollback(&o).unwrap();
        let after = tree(&o.root);
        let r = rollback(&o).unwrap();
        assert!(!r.changed);
        assert_eq!(r.to_string(), "not applied: nothing to roll back\n");
        assert_eq!(tree(&o.root), after);
    }

    #[test]
    fn rollback_without_the_state_file() {
        let (_dir, o) = node(Some(SAMPLES[1].1));
        apply(&o).unwrap();
        std::fs::remove_file(under(&o.root, Path::new(STATE_FILE))).unwrap();
        let r = rollback(&o).unwrap();
        assert!(
            r.warnings
                .iter()
                .any(|w| w.contains("values") && w.contains("unknown")),
            "{r}"
        );
        let a = containerd_config::read(&read(&o, CONFIG)).unwrap();
        assert_eq!(a.placement(DEFAULT, REAL), Placement::Default);
        assert_eq!(a.grpc.as_deref(), Some(DEFAULT));
        for d in [dropins::SOCKET, dropins::SERVICE, dropins::KUBELET] {
            assert!(!exists(&o, d), "{d}");
        }
        // Which directories apply created is unknown: they stay.
        assert!(exists(&o, "/etc/systemd/system/kubelet.service.d"));
    }

    #[test]
    fn rollback_keeps_a_created_config_changed_since() {
        let (_dir, o) = node(None);
        apply(&o).unwrap();
        let f = under(&o.root, Path::new(CONFIG));
        let changed = read(&o, CONFIG) + "\n[debug]\n  level = \"debug\"\n";
        std::fs::write(&f, changed).unwrap();
        let r = rollback(&o).unwrap();
        assert!(
            r.warnings.iter().any(|w| w.contains("changed since")),
            "{r}"
        );
        let now = read(&o, CONFIG);
        assert!(now.contains("[debug]"), "{now}");
        assert_eq!(containerd_config::read(&now).unwrap().grpc, None, "{now}");
    }

    #[test]
    fn rollback_leaves_an_admins_drop_in() {
        let (_dir, o) = node(Some(SAMPLES[1].1));
        apply(&o).unwrap();
        std::fs::write(
            under(&o.root, Path::new(dropins::KUBELET)),
            "[Unit]\nAfter=x\n",
        )
        .unwrap();
        let r = rollback(&o).unwrap();
        assert!(
            r.warnings.iter().any(|w| w.contains(dropins::KUBELET)),
            "{r}"
        );
        assert!(exists(&o, dropins::KUBELET));
        assert_eq!(read(&o, CONFIG), SAMPLES[1].1);
    }

    #[test]
    fn status_names_the_pieces() {
        let (_dir, o) = node(Some(SAMPLES[1].1));
        let s = status(&o).unwrap();
        assert_eq!(s.verdict, Verdict::NotApplied);
        assert!(
            s.to_string().starts_with("socket swap: not applied\n"),
            "{s}"
        );
        apply(&o).unwrap();
        let s = status(&o).unwrap();
        assert_eq!(s.verdict, Verdict::Applied);
        assert!(
            s.to_string().contains(&format!(
                "✓ containerd config {CONFIG}: [grpc] address = {REAL}"
            )),
            "{s}"
        );
        std::fs::remove_file(under(&o.root, Path::new(dropins::SERVICE))).unwrap();
        let s = status(&o).unwrap().to_string();
        assert!(s.starts_with("socket swap: partially applied (not in place: drop-in /etc/systemd/system/imgbridge.service.d/50-swap.conf)"), "{s}");
        assert!(
            s.contains("✗ drop-in /etc/systemd/system/imgbridge.service.d/50-swap.conf: missing"),
            "{s}"
        );
    }

    /// A scripted systemd that follows the files as systemd would: after
    /// `daemon-reload` with the drop-ins, restarting containerd moves it to
    /// the real socket (unless `comes_up` is false) and restarting the socket
    /// binds the default path; after one without, the socket lets the
    /// default path go and containerd's restart takes it back.
    struct Fake {
        root: PathBuf,
        booted: bool,
        units: Vec<&'static str>,
        enabled: bool,
        comes_up: bool,
        /// The drop-ins as of the last daemon-reload.
        loaded: Cell<bool>,
        containerd_real: Cell<bool>,
        socket_default: Cell<bool>,
        calls: RefCell<Vec<String>>,
    }

    const CONTAINERD_PID: u32 = 4242;

    impl Fake {
        fn new(o: &SwapOptions) -> Fake {
            Fake {
                root: o.root.clone(),
                booted: true,
                units: vec!["containerd.service", "imgbridge.socket"],
                enabled: true,
                comes_up: true,
                loaded: Cell::new(false),
                containerd_real: Cell::new(false),
                socket_default: Cell::new(false),
                calls: RefCell::new(Vec::new()),
            }
        }

        /// The calls that change something.
        fn changes(&self) -> Vec<String> {
            self.calls
                .borrow()
                .iter()
                .filter(|c| c.starts_with("daemon-reload") || c.starts_with("restart"))
                .cloned()
                .collect()
        }
    }

    impl Host for Fake {
        fn booted(&self) -> bool {
            self.booted
        }

        fn systemctl(&self, args: &[&str]) -> Result<String, String> {
            self.calls.borrow_mut().push(args.join(" "));
            match args {
                ["cat", unit] if !self.units.contains(unit) => {
                    Err(format!("No files found for {unit}."))
                }
                ["is-enabled", ..] if !self.enabled => Err("disabled".into()),
                ["daemon-reload"] => {
                    let loaded = under(&self.root, Path::new(dropins::SOCKET)).exists();
                    self.loaded.set(loaded);
                    if !loaded {
                        self.socket_default.set(false);
                    }
                    Ok(String::new())
                }
                ["restart", units @ ..] => {
                    if units.contains(&"containerd.service") {
                        // containerd listens where its config says.
                        let moved = std::fs::read_to_string(under(&self.root, Path::new(CONFIG)))
                            .is_ok_and(|t| t.contains(REAL));
                        self.containerd_real.set(moved && self.comes_up);
                    }
                    if units.contains(&"imgbridge.socket") {
                        self.socket_default.set(self.loaded.get());
                    }
                    Ok(String::new())
                }
                ["show", "-p", "MainPID", ..] => Ok(format!("{CONTAINERD_PID}\n")),
                ["show", "-p", "ActiveState", "--value", units @ ..] => {
                    // containerd gives up when it cannot come up on the real socket.
                    let down = self.loaded.get() && !self.comes_up;
                    let states: Vec<&str> = units
                        .iter()
                        .map(|u| match (*u, down) {
                            ("containerd.service", true) => "failed",
                            _ => "active",
                        })
                        .collect();
                    Ok(states.join("\n\n") + "\n")
                }
                ["show", "-p", "Listen", ..] => Ok(if self.socket_default.get() {
                    format!("/run/imgbridge/containerd.sock (Stream)\n{DEFAULT} (Stream)\n{DEFAULT}.ttrpc (Stream)\n")
                } else {
                    "/run/imgbridge/containerd.sock (Stream)\n".into()
                }),
                _ => Ok(String::new()),
            }
        }

        fn version(&self, socket: &Path) -> Result<String, String> {
            self.listener_pid(socket).map(|_| "1.7.24".into())
        }

        fn listener_pid(&self, socket: &Path) -> Result<u32, String> {
            let on_real = socket == Path::new(REAL);
            match (
                on_real,
                self.containerd_real.get(),
                self.socket_default.get(),
            ) {
                (true, true, _) | (false, false, _) => Ok(CONTAINERD_PID),
                (false, true, true) => Ok(1),
                _ => Err("connection refused".into()),
            }
        }
    }

    fn with_systemd<'a>(o: &'a SwapOptions, host: &'a Fake) -> Swap<'a> {
        Swap {
            o,
            host: Some(host),
            deadline: Duration::from_millis(200),
        }
    }

    #[test]
    fn systemctl_sequence_and_checks() {
        let (_dir, mut o) = node(Some(SAMPLES[1].1));
        o.systemctl = true;
        let fake = Fake::new(&o);
        let r = with_systemd(&o, &fake).apply().unwrap();
        assert_eq!(
            fake.changes(),
            [
                "daemon-reload",
                "restart containerd.service",
                "restart imgbridge.socket"
            ]
        );
        let text = r.to_string();
        assert!(
            text.contains(&format!(
                "verified: containerd 1.7.24 answers on {REAL} and through imgbridge on {DEFAULT}"
            )),
            "{text}"
        );
        assert!(fake.calls.borrow().starts_with(&[
            "cat containerd.service".to_owned(),
            "cat imgbridge.socket".to_owned(),
            "is-enabled --quiet imgbridge.socket".to_owned(),
        ]));

        // Applied and live: nothing restarted.
        fake.calls.borrow_mut().clear();
        let r = with_systemd(&o, &fake).apply().unwrap();
        assert!(!r.changed, "{r}");
        assert!(fake.changes().is_empty());
        let s = with_systemd(&o, &fake).status().unwrap();
        assert_eq!(s.verdict, Verdict::Applied, "{s}");

        fake.calls.borrow_mut().clear();
        let r = with_systemd(&o, &fake).rollback().unwrap();
        assert_eq!(
            fake.changes(),
            [
                "daemon-reload",
                "restart containerd.service imgbridge.service",
                "daemon-reload",
                "restart imgbridge.service"
            ]
        );
        assert!(
            r.to_string().contains(&format!(
                "verified: containerd 1.7.24 answers on {DEFAULT} again"
            )),
            "{r}"
        );
        assert_eq!(read(&o, CONFIG), SAMPLES[1].1);

        // Nothing left: no restart.
        fake.calls.borrow_mut().clear();
        let r = with_systemd(&o, &fake).rollback().unwrap();
        assert!(!r.changed);
        assert!(fake.changes().is_empty());
    }

    #[test]
    fn a_failed_check_rolls_back() {
        let (_dir, mut o) = node(Some(SAMPLES[3].1));
        o.systemctl = true;
        let before = tree(&o.root);
        let fake = Fake {
            comes_up: false,
            ..Fake::new(&o)
        };
        // containerd.service failing ends the wait at once, not at the deadline.
        let swap = Swap {
            deadline: Duration::from_secs(60),
            ..with_systemd(&o, &fake)
        };
        let started = std::time::Instant::now();
        let e = format!("{:#}", swap.apply().unwrap_err());
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(
            e.contains(&format!("containerd does not answer on {REAL}")),
            "{e}"
        );
        assert!(e.contains("containerd.service failed"), "{e}");
        assert!(e.contains("rolled back"), "{e}");
        assert_eq!(
            fake.changes(),
            [
                "daemon-reload",
                "restart containerd.service",
                "restart imgbridge.socket",
                "daemon-reload",
                "restart containerd.service imgbridge.service",
                "daemon-reload",
                "restart imgbridge.service"
            ]
        );
        assert_eq!(tree(&o.root), before);
    }

    #[test]
    fn preconditions_say_what_to_do() {
        let (_dir, mut o) = node(Some(SAMPLES[1].1));
        o.systemctl = true;
        let before = tree(&o.root);
        let cases = [
            (
                Fake {
                    booted: false,
                    ..Fake::new(&o)
                },
                "k3s",
            ),
            (
                Fake {
                    units: vec!["imgbridge.socket"],
                    ..Fake::new(&o)
                },
                "containerd.service",
            ),
            (
                Fake {
                    units: vec!["containerd.service"],
                    ..Fake::new(&o)
                },
                "install imgbridge",
            ),
            (
                Fake {
                    enabled: false,
                    ..Fake::new(&o)
                },
                "systemctl enable --now imgbridge.socket",
            ),
        ];
        for (fake, says) in cases {
            let e = with_systemd(&o, &fake).apply().unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
            assert!(fake.changes().is_empty());
            assert_eq!(tree(&o.root), before);
        }
    }
}
