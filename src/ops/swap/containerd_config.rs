//! containerd's config file, edited for the socket swap: only the gRPC and
//! ttrpc `address` keys change; every other byte (comments, order, quoting,
//! indentation) stays, so rollback can give the file back exactly as it was.
//!
//! Where containerd reads the addresses depends on the file's `version`
//! (containerd's cmd/containerd/server/config/config.go):
//! - 1 (or no `version`), 2, 3: `[grpc] address` and `[ttrpc] address`. An
//!   unset ttrpc address is the gRPC one + `.ttrpc` (1.x and 2.0-2.2:
//!   cmd/containerd/command/main.go; ≥ 2.3: `serviceMigrate`, which moves
//!   both into the server plugins when it migrates a file to version 4).
//! - 4 (containerd ≥ 2.3): `[plugins."io.containerd.server.v1.grpc"]` and
//!   `[plugins."io.containerd.server.v1.ttrpc"]`. `[grpc]` is no longer read,
//!   and an unset ttrpc address is containerd's own default whatever the gRPC
//!   one is (plugins/server/ttrpc/plugin.go).
//!
//! So both addresses are always written, each where this file's version
//! reads it.

use serde::{Deserialize, Serialize};
use toml_edit::{DocumentMut, Item, Key, Table, TableLike, Value};

/// The key holding a server's socket path in its table.
const ADDRESS: &str = "address";
/// containerd ≥ 2.3's gRPC server plugin (config version 4).
pub(super) const GRPC_PLUGIN: &str = "io.containerd.server.v1.grpc";
/// containerd ≥ 2.3's ttrpc server plugin (config version 4).
pub(super) const TTRPC_PLUGIN: &str = "io.containerd.server.v1.ttrpc";
/// The newest config version whose layout is known here.
const NEWEST: i64 = 4;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("not valid TOML: {0}")]
    Parse(String),
    #[error("`version` is not an integer: {0}")]
    BadVersion(String),
    #[error("config `version = {0}` is newer than imgbridge knows (1-{NEWEST}); move containerd's gRPC and ttrpc addresses by hand (docs/socket-swap.md)")]
    UnknownVersion(i64),
    #[error("{0} is not a table")]
    NotATable(String),
    #[error("{0} address is not a string")]
    NotAString(String),
    #[error("the file is `version = {version}` but has [plugins.\"{plugin}\"]: containerd ≥ 2.3 then ignores [grpc]/[ttrpc]; run `containerd config migrate` and save its output as this file (version 4), then try again")]
    Mixed { version: i64, plugin: &'static str },
    #[error("the state file's previous value {0:?} is not a TOML value")]
    BadPrevious(String),
}

/// Where one config `version` keeps the two addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    pub version: i64,
    pub grpc: &'static [&'static str],
    pub ttrpc: &'static [&'static str],
}

impl Layout {
    fn of(version: i64) -> Result<Layout, ConfigError> {
        match version {
            ..=3 => Ok(Layout {
                version,
                grpc: &["grpc"],
                ttrpc: &["ttrpc"],
            }),
            4 => Ok(Layout {
                version,
                grpc: &["plugins", GRPC_PLUGIN],
                ttrpc: &["plugins", TTRPC_PLUGIN],
            }),
            v => Err(ConfigError::UnknownVersion(v)),
        }
    }

    /// Below version 4 an unset ttrpc address follows the gRPC one.
    fn ttrpc_follows_grpc(self) -> bool {
        self.version < 4
    }
}

/// `[grpc]` or `[plugins."io.containerd.server.v1.grpc"]`, for messages.
pub(super) fn table_name(path: &[impl AsRef<str>]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|p| {
            let p = p.as_ref();
            if p.contains('.') {
                format!("\"{p}\"")
            } else {
                p.to_owned()
            }
        })
        .collect();
    format!("[{}]", parts.join("."))
}

/// The two addresses as the file sets them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Addresses {
    pub layout: Layout,
    /// `None`: not set.
    pub grpc: Option<String>,
    pub ttrpc: Option<String>,
}

/// Where containerd listens with this file, against the swap's two places.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Placement {
    /// On `default_socket` (and its `.ttrpc`): not swapped.
    Default,
    /// On the real socket (and its `.ttrpc`): swapped.
    Swapped,
    /// Anywhere else: someone else moved containerd.
    Elsewhere(String),
}

impl Addresses {
    /// The addresses containerd listens on with this file (unset and empty
    /// values take containerd's defaults, as containerd does).
    pub fn effective(&self, default_socket: &str) -> (String, String) {
        let set = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
        let grpc = set(&self.grpc).unwrap_or_else(|| default_socket.to_owned());
        let ttrpc = set(&self.ttrpc).unwrap_or_else(|| {
            if self.layout.ttrpc_follows_grpc() {
                format!("{grpc}.ttrpc")
            } else {
                format!("{default_socket}.ttrpc")
            }
        });
        (grpc, ttrpc)
    }

    pub fn placement(&self, default_socket: &str, real_socket: &str) -> Placement {
        let (grpc, ttrpc) = self.effective(default_socket);
        if grpc == default_socket && ttrpc == format!("{default_socket}.ttrpc") {
            Placement::Default
        } else if grpc == real_socket && ttrpc == format!("{real_socket}.ttrpc") {
            Placement::Swapped
        } else {
            Placement::Elsewhere(self.describe(default_socket))
        }
    }

    /// `[grpc] address = …, [ttrpc] address = …` as containerd reads them.
    pub fn describe(&self, default_socket: &str) -> String {
        let (grpc, ttrpc) = self.effective(default_socket);
        let shown = |v: &Option<String>, eff: String| match v.as_deref() {
            Some(s) if !s.is_empty() => eff,
            _ => format!("{eff} (unset: containerd's default)"),
        };
        format!(
            "{} address = {}, {} address = {}",
            table_name(self.layout.grpc),
            shown(&self.grpc, grpc),
            table_name(self.layout.ttrpc),
            shown(&self.ttrpc, ttrpc)
        )
    }
}

/// One address as it was before apply, so rollback can put it back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Previous {
    /// The table that holds `address`, e.g. `["grpc"]`.
    pub table: Vec<String>,
    /// How many of the innermost tables of `table` apply created (0: the
    /// table existed); rollback removes them again if they are empty.
    pub created_tables: usize,
    /// The value's TOML source (with its quotes) before apply; `None`: the
    /// key was not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// The file after apply's edit, and what it replaced.
#[derive(Clone, Debug)]
pub(super) struct Edited {
    pub text: String,
    pub grpc: Previous,
    pub ttrpc: Previous,
    /// SHA-256 of the file before the edit (`None`: there was no file).
    pub before_sha256: Option<String>,
}

/// The file after rollback's edit.
#[derive(Clone, Debug, Default)]
pub(super) struct Restored {
    pub text: String,
    /// Keys put back, one line each (`[grpc] address = "…"`, `[ttrpc] address unset`).
    pub restored: Vec<String>,
    /// Keys not put back because they changed after apply, one line each.
    pub left: Vec<String>,
}

fn parse(text: &str) -> Result<DocumentMut, ConfigError> {
    text.parse::<DocumentMut>()
        .map_err(|e| ConfigError::Parse(crate::ops::doctor::report::one_line(&e.to_string())))
}

fn layout(doc: &DocumentMut) -> Result<Layout, ConfigError> {
    let version = match doc.get("version") {
        None => 1,
        Some(item) => item
            .as_integer()
            .ok_or_else(|| ConfigError::BadVersion(item.to_string().trim().to_owned()))?,
    };
    let layout = Layout::of(version)?;
    if layout.version < 4 {
        // containerd ≥ 2.3 migrates [grpc]/[ttrpc] into the plugins only
        // where the file does not configure the plugin itself.
        for plugin in [GRPC_PLUGIN, TTRPC_PLUGIN] {
            if table(doc, &["plugins", plugin]).is_some() {
                return Err(ConfigError::Mixed { version, plugin });
            }
        }
    }
    Ok(layout)
}

/// The addresses `text` sets.
pub(super) fn read(text: &str) -> Result<Addresses, ConfigError> {
    let doc = parse(text)?;
    let layout = layout(&doc)?;
    Ok(Addresses {
        grpc: address(&doc, layout.grpc)?,
        ttrpc: address(&doc, layout.ttrpc)?,
        layout,
    })
}

fn table<'d>(doc: &'d DocumentMut, path: &[&str]) -> Option<&'d dyn TableLike> {
    let mut cur: &dyn TableLike = doc.as_table();
    for seg in path {
        cur = cur.get(seg)?.as_table_like()?;
    }
    Some(cur)
}

fn table_mut<'d>(doc: &'d mut DocumentMut, path: &[&str]) -> Option<&'d mut dyn TableLike> {
    let mut cur: &mut dyn TableLike = doc.as_table_mut();
    for seg in path {
        cur = cur.get_mut(seg)?.as_table_like_mut()?;
    }
    Some(cur)
}

fn address(doc: &DocumentMut, path: &[&str]) -> Result<Option<String>, ConfigError> {
    let Some(item) = table(doc, path).and_then(|t| t.get(ADDRESS)) else {
        return Ok(None);
    };
    item.as_str()
        .map(|s| Some(s.to_owned()))
        .ok_or_else(|| ConfigError::NotAString(table_name(path)))
}

/// `edited` with the line ends of `original`: toml_edit writes `\n`, and a
/// file written with `\r\n` keeps them.
fn line_ends_of(original: &str, edited: String) -> String {
    if original.contains("\r\n") {
        edited.replace("\r\n", "\n").replace('\n', "\r\n")
    } else {
        edited
    }
}

/// A value's TOML source without the whitespace around it.
fn source(v: &Value) -> String {
    let mut v = v.clone();
    v.decor_mut().clear();
    v.to_string()
}

/// Replaces `slot` by `new`, keeping the whitespace and comment around it.
fn replace_keeping_decor(slot: &mut Value, mut new: Value) {
    *new.decor_mut() = slot.decor().clone();
    *slot = new;
}

/// The highest table position in the document, so a new table is written
/// after every existing one.
fn last_position(t: &Table) -> isize {
    t.iter()
        .filter_map(|(_, item)| item.as_table())
        .map(|sub| sub.position().unwrap_or(0).max(last_position(sub)))
        .max()
        .unwrap_or(0)
}

/// Creates the tables of `path` that are missing (the outer ones implicit,
/// so `[plugins."…"]` gets no `[plugins]` header); how many it created.
fn ensure_tables(doc: &mut DocumentMut, path: &[&str]) -> Result<usize, ConfigError> {
    let position = last_position(doc.as_table()) + 1;
    let mut created = 0;
    let mut cur: &mut dyn TableLike = doc.as_table_mut();
    for (i, seg) in path.iter().enumerate() {
        if !cur.contains_key(seg) {
            let mut t = Table::new();
            if i + 1 == path.len() {
                t.set_position(Some(position));
            } else {
                t.set_implicit(true);
            }
            cur.insert(seg, Item::Table(t));
            created += 1;
        }
        cur = cur
            .get_mut(seg)
            .and_then(Item::as_table_like_mut)
            .ok_or_else(|| ConfigError::NotATable(table_name(&path[..=i])))?;
    }
    Ok(created)
}

/// The indentation of the table's existing keys, for a key added to it.
fn sibling_indent(t: &dyn TableLike) -> Option<String> {
    let (first, _) = t.iter().next()?;
    let prefix = t.key(first)?.leaf_decor().prefix()?.as_str()?;
    let indent = prefix.rsplit('\n').next().unwrap_or(prefix);
    indent
        .chars()
        .all(|c| c == ' ' || c == '\t')
        .then(|| indent.to_owned())
}

/// Sets `path`'s `address` to `new`; what it was before.
fn set_one(doc: &mut DocumentMut, path: &[&str], new: &str) -> Result<Previous, ConfigError> {
    let created_tables = ensure_tables(doc, path)?;
    let t = table_mut(doc, path).ok_or_else(|| ConfigError::NotATable(table_name(path)))?;
    let value = match t.get_mut(ADDRESS) {
        Some(item) => {
            let slot = item
                .as_value_mut()
                .filter(|v| v.is_str())
                .ok_or_else(|| ConfigError::NotAString(table_name(path)))?;
            let old = source(slot);
            replace_keeping_decor(slot, Value::from(new));
            Some(old)
        }
        None => {
            let mut key = Key::new(ADDRESS);
            if let Some(indent) = sibling_indent(t) {
                key.leaf_decor_mut().set_prefix(indent);
            }
            t.entry_format(&key).or_insert(toml_edit::value(new));
            None
        }
    };
    Ok(Previous {
        table: path.iter().map(|s| s.to_string()).collect(),
        created_tables,
        value,
    })
}

/// `text` with containerd moved to `grpc` and `ttrpc`, wherever its
/// version reads them. The caller has checked [`Addresses::placement`].
pub(super) fn set(text: &str, grpc: &str, ttrpc: &str) -> Result<Edited, ConfigError> {
    let mut doc = parse(text)?;
    let layout = layout(&doc)?;
    let grpc = set_one(&mut doc, layout.grpc, grpc)?;
    let ttrpc = set_one(&mut doc, layout.ttrpc, ttrpc)?;
    Ok(Edited {
        text: line_ends_of(text, doc.to_string()),
        grpc,
        ttrpc,
        before_sha256: Some(sha256(text.as_bytes())),
    })
}

/// A config for a node that had none: `version = 2`, which every
/// containerd from 1.6 on reads (2.x migrates it, 2.3+ into the server
/// plugins, with a warning at each start). Everything else keeps
/// containerd's defaults, as with no file.
pub(super) fn new_file(grpc: &str, ttrpc: &str) -> Edited {
    let quoted = |s: &str| Value::from(s).to_string();
    let text = format!(
        "# Written by `imgbridge swap` (there was no containerd config): containerd\n\
         # listens on {grpc}, imgbridge on containerd's default socket.\n\
         # `imgbridge swap rollback` removes this file unless it was changed since.\n\
         version = 2\n\
         \n\
         [grpc]\n  address = {}\n\
         \n\
         [ttrpc]\n  address = {}\n",
        quoted(grpc),
        quoted(ttrpc)
    );
    let created = |table: &str| Previous {
        table: vec![table.to_owned()],
        created_tables: 1,
        value: None,
    };
    Edited {
        text,
        grpc: created("grpc"),
        ttrpc: created("ttrpc"),
        before_sha256: None,
    }
}

/// Puts each `(previous, wrote)` back, last first (the reverse of [`set`]):
/// the key is restored only while it still holds what apply wrote, and the
/// tables apply created are removed if nothing else was added to them.
/// `before_sha256` ([`Edited::before_sha256`]) gives back the one byte the
/// edit cannot undo by itself: a missing final newline (toml_edit ends the
/// line before a table it appends).
pub(super) fn restore(
    text: &str,
    keys: &[(&Previous, &str)],
    before_sha256: Option<&str>,
) -> Result<Restored, ConfigError> {
    let mut doc = parse(text)?;
    let mut out = Restored::default();
    for (prev, wrote) in keys.iter().rev() {
        let path: Vec<&str> = prev.table.iter().map(String::as_str).collect();
        let name = table_name(&path);
        let current = table_mut(&mut doc, &path).and_then(|t| match t.get_mut(ADDRESS) {
            Some(Item::Value(v)) => Some((v.as_str() == Some(wrote), t)),
            _ => None,
        });
        match current {
            Some((true, t)) => match &prev.value {
                Some(src) => {
                    let old: Value = src
                        .parse()
                        .map_err(|_| ConfigError::BadPrevious(src.clone()))?;
                    if let Some(slot) = t.get_mut(ADDRESS).and_then(Item::as_value_mut) {
                        replace_keeping_decor(slot, old);
                    }
                    out.restored.push(format!("{name} address = {src}"));
                }
                None => {
                    t.remove(ADDRESS);
                    out.restored.push(format!("{name} address unset"));
                }
            },
            _ => {
                let now = address(&doc, &path)?.unwrap_or_else(|| "unset".into());
                out.left.push(format!(
                    "{name} address left as it is ({now}): it changed after `imgbridge swap`"
                ));
            }
        }
        let created = prev.created_tables.min(path.len());
        for depth in (path.len() - created..path.len()).rev() {
            let empty = table(&doc, &path[..=depth]).is_some_and(|t| t.is_empty());
            if let (true, Some(parent)) = (empty, table_mut(&mut doc, &path[..depth])) {
                parent.remove(path[depth]);
            }
        }
    }
    out.text = line_ends_of(text, doc.to_string());
    if let Some(before) = before_sha256 {
        if sha256(out.text.as_bytes()) != before {
            if let Some(t) = out.text.strip_suffix('\n') {
                if sha256(t.as_bytes()) == before {
                    out.text.truncate(t.len());
                }
            }
        }
    }
    Ok(out)
}

/// For a rollback without its state file: the addresses that still name
/// the real socket are set to containerd's defaults (the values they had
/// before are unknown). Returns the new text and one line per key changed.
pub(super) fn reset(
    text: &str,
    real_socket: &str,
    default_socket: &str,
) -> Result<(String, Vec<String>), ConfigError> {
    let mut doc = parse(text)?;
    let layout = layout(&doc)?;
    let mut changed = Vec::new();
    for (path, from, to) in [
        (
            layout.grpc,
            real_socket.to_owned(),
            default_socket.to_owned(),
        ),
        (
            layout.ttrpc,
            format!("{real_socket}.ttrpc"),
            format!("{default_socket}.ttrpc"),
        ),
    ] {
        let slot = table_mut(&mut doc, path)
            .and_then(|t| t.get_mut(ADDRESS))
            .and_then(Item::as_value_mut)
            .filter(|v| v.as_str() == Some(from.as_str()));
        if let Some(slot) = slot {
            replace_keeping_decor(slot, Value::from(to.as_str()));
            changed.push(format!("{} address = {to}", table_name(path)));
        }
    }
    Ok((line_ends_of(text, doc.to_string()), changed))
}

/// SHA-256 of `bytes`, hex: how the state file remembers a config's
/// content (to restore it exactly, or to see that it changed since).
pub(super) fn sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub const REAL: &str = "/run/containerd/containerd-real.sock";
    pub const REAL_TTRPC: &str = "/run/containerd/containerd-real.sock.ttrpc";
    pub const DEFAULT: &str = "/run/containerd/containerd.sock";

    /// containerd 1.x without a `version` header (version 1).
    pub const V1: &str = r#"# containerd 1.x config without a version header
root = "/var/lib/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"  # the default
  uid = 0

[plugins.cri]
  sandbox_image = "registry.k8s.io/pause:3.9"
"#;

    /// As `containerd config default` (1.6) writes it: `[ttrpc] address = ""`.
    pub const V2: &str = r#"disabled_plugins = []
imports = []
oom_score = 0
plugin_dir = ""
required_plugins = []
root = "/var/lib/containerd"
state = "/run/containerd"
temp = ""
version = 2

[cgroup]
  path = ""

[debug]
  address = ""
  format = ""
  gid = 0
  level = ""
  uid = 0

[grpc]
  address = "/run/containerd/containerd.sock"
  gid = 0
  max_recv_message_size = 16777216
  max_send_message_size = 16777216
  tcp_address = ""
  tcp_tls_ca = ""
  tcp_tls_cert = ""
  tcp_tls_key = ""
  uid = 0

[plugins]

  # CRI: keep SystemdCgroup in step with kubelet's cgroupDriver.
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = true

[ttrpc]
  address = ""
  gid = 0
  uid = 0
"#;

    /// containerd 2.0-2.2, literal strings, no `[ttrpc]`.
    pub const V3: &str = "version = 3\nroot = '/var/lib/containerd'\n\n# gRPC server\n[grpc]\n  address = '/run/containerd/containerd.sock'\n  uid = 0\n  gid = 0\n\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n";

    /// containerd ≥ 2.3: the servers are plugins; no ttrpc table.
    pub const V4: &str = "version = 4\nroot = '/var/lib/containerd'\n\n[plugins]\n  [plugins.'io.containerd.cri.v1.images']\n    snapshotter = 'overlayfs'\n\n  [plugins.'io.containerd.server.v1.grpc']\n    address = '/run/containerd/containerd.sock'\n    max_recv_message_size = 16777216\n\n# end of file\n";

    /// Every sample, named.
    pub const SAMPLES: &[(&str, &str)] = &[("v1", V1), ("v2", V2), ("v3", V3), ("v4", V4)];

    fn values(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    fn at<'t>(t: &'t toml::Table, path: &[&str]) -> Option<&'t str> {
        let (last, tables) = path.split_last().unwrap();
        let mut cur = t;
        for p in tables {
            cur = cur.get(*p)?.as_table()?;
        }
        cur.get(*last)?.as_str()
    }

    #[test]
    fn each_version_sets_its_own_keys() {
        for (name, text, grpc, ttrpc) in [
            (
                "v1",
                V1,
                &["grpc", "address"][..],
                &["ttrpc", "address"][..],
            ),
            ("v2", V2, &["grpc", "address"], &["ttrpc", "address"]),
            ("v3", V3, &["grpc", "address"], &["ttrpc", "address"]),
            (
                "v4",
                V4,
                &["plugins", GRPC_PLUGIN, "address"],
                &["plugins", TTRPC_PLUGIN, "address"],
            ),
        ] {
            let before = read(text).unwrap();
            assert_eq!(
                before.placement(DEFAULT, REAL),
                Placement::Default,
                "{name}"
            );
            let e = set(text, REAL, REAL_TTRPC).unwrap();
            let v = values(&e.text);
            assert_eq!(at(&v, grpc), Some(REAL), "{name}: {}", e.text);
            assert_eq!(at(&v, ttrpc), Some(REAL_TTRPC), "{name}: {}", e.text);
            assert_eq!(
                read(&e.text).unwrap().placement(DEFAULT, REAL),
                Placement::Swapped,
                "{name}"
            );
            // Everything else parses to the same values.
            let mut a = values(text);
            let mut b = v;
            for t in [&mut a, &mut b] {
                for key in ["grpc", "ttrpc"] {
                    if let Some(tbl) = t.get_mut(key).and_then(|v| v.as_table_mut()) {
                        tbl.remove("address");
                        if tbl.is_empty() {
                            t.remove(key);
                        }
                    }
                }
                if let Some(p) = t.get_mut("plugins").and_then(|v| v.as_table_mut()) {
                    for plugin in [GRPC_PLUGIN, TTRPC_PLUGIN] {
                        if let Some(tbl) = p.get_mut(plugin).and_then(|v| v.as_table_mut()) {
                            tbl.remove("address");
                            if tbl.is_empty() {
                                p.remove(plugin);
                            }
                        }
                    }
                }
            }
            assert_eq!(a, b, "{name}");
        }
    }

    #[test]
    fn edits_only_the_address_lines() {
        let e = set(V2, REAL, REAL_TTRPC).unwrap();
        let want = V2
            .replace(
                "[grpc]\n  address = \"/run/containerd/containerd.sock\"",
                &format!("[grpc]\n  address = \"{REAL}\""),
            )
            .replace(
                "[ttrpc]\n  address = \"\"",
                &format!("[ttrpc]\n  address = \"{REAL_TTRPC}\""),
            );
        assert_eq!(e.text, want);
        assert_eq!(
            e.grpc.value.as_deref(),
            Some("\"/run/containerd/containerd.sock\"")
        );
        assert_eq!(e.ttrpc.value.as_deref(), Some("\"\""));

        // The trailing comment on the address line stays; [ttrpc] is added
        // last, indented like the file's keys.
        let e = set(V1, REAL, REAL_TTRPC).unwrap();
        let want = V1.replace(
            "  address = \"/run/containerd/containerd.sock\"  # the default",
            &format!("  address = \"{REAL}\"  # the default"),
        ) + &format!("\n[ttrpc]\naddress = \"{REAL_TTRPC}\"\n");
        assert_eq!(e.text, want);
        assert_eq!(e.ttrpc.created_tables, 1);

        // Version 4: the new ttrpc plugin table goes after the last table.
        let e = set(V4, REAL, REAL_TTRPC).unwrap();
        let want = V4
            .replace(
                "    address = '/run/containerd/containerd.sock'",
                &format!("    address = \"{REAL}\""),
            )
            .replace(
                "\n# end of file\n",
                &format!(
                    "\n[plugins.\"{TTRPC_PLUGIN}\"]\naddress = \"{REAL_TTRPC}\"\n\n# end of file\n"
                ),
            );
        assert_eq!(e.text, want);
    }

    #[test]
    fn restore_gives_back_the_original_bytes() {
        let extra = [
            ("no trailing newline", "version = 2\n[grpc]\n  address = \"/run/containerd/containerd.sock\""),
            ("empty", ""),
            ("comments only", "# nothing here\n"),
            ("v4 without plugins", "version = 4\n"),
            ("v4 with other plugins", "version = 4\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'native'\n"),
            ("inline table", "version = 2\ngrpc = { address = \"/run/containerd/containerd.sock\", uid = 0 }\n"),
            ("dotted keys", "version = 2\ngrpc.address = '/run/containerd/containerd.sock'\nttrpc.address = ''\n"),
            ("crlf", "version = 2\r\n\r\n[grpc]\r\n  address = \"/run/containerd/containerd.sock\" # x\r\n"),
            ("ttrpc follows", "version = 3\n[ttrpc]\n  address = '/run/containerd/containerd.sock.ttrpc'\n  uid = 0\n"),
        ];
        for (name, text) in SAMPLES.iter().chain(extra.iter()) {
            let e = set(text, REAL, REAL_TTRPC).unwrap_or_else(|err| panic!("{name}: {err}"));
            assert_ne!(&e.text, text, "{name}");
            let r = restore(
                &e.text,
                &[(&e.grpc, REAL), (&e.ttrpc, REAL_TTRPC)],
                e.before_sha256.as_deref(),
            )
            .unwrap();
            assert_eq!(&r.text, text, "{name}: edited was\n{}", e.text);
            assert!(r.left.is_empty(), "{name}: {:?}", r.left);
            assert_eq!(r.restored.len(), 2, "{name}");
        }
    }

    #[test]
    fn restore_leaves_what_changed_after_apply() {
        let e = set(V3, REAL, REAL_TTRPC).unwrap();
        let changed = e.text.replace(REAL_TTRPC, "/run/other.ttrpc");
        let r = restore(&changed, &[(&e.grpc, REAL), (&e.ttrpc, REAL_TTRPC)], None).unwrap();
        assert_eq!(
            r.restored,
            ["[grpc] address = '/run/containerd/containerd.sock'"]
        );
        assert_eq!(r.left.len(), 1);
        assert!(r.left[0].contains("/run/other.ttrpc"), "{:?}", r.left);
        let a = read(&r.text).unwrap();
        assert_eq!(a.grpc.as_deref(), Some(DEFAULT));
        assert_eq!(a.ttrpc.as_deref(), Some("/run/other.ttrpc"));

        // A table apply created but someone added to stays.
        let e = set("version = 2\n", REAL, REAL_TTRPC).unwrap();
        let changed = e.text.replace("[ttrpc]\n", "[ttrpc]\nuid = 5\n");
        let r = restore(&changed, &[(&e.grpc, REAL), (&e.ttrpc, REAL_TTRPC)], None).unwrap();
        assert_eq!(r.text, "version = 2\n\n[ttrpc]\nuid = 5\n");
    }

    #[test]
    fn a_new_file_is_version_2_with_both_tables() {
        let e = new_file(REAL, REAL_TTRPC);
        let a = read(&e.text).unwrap();
        assert_eq!(a.layout.version, 2);
        assert_eq!(a.grpc.as_deref(), Some(REAL));
        assert_eq!(a.ttrpc.as_deref(), Some(REAL_TTRPC));
        assert!(e.text.starts_with("# Written by `imgbridge swap`"));
        let r = restore(&e.text, &[(&e.grpc, REAL), (&e.ttrpc, REAL_TTRPC)], None).unwrap();
        assert!(read(&r.text).unwrap().grpc.is_none(), "{}", r.text);
    }

    #[test]
    fn placement_tells_who_moved_containerd() {
        let p = |text: &str| read(text).unwrap().placement(DEFAULT, REAL);
        assert_eq!(p(""), Placement::Default);
        assert_eq!(
            p("[grpc]\naddress = ''\n[ttrpc]\naddress = ''\n"),
            Placement::Default
        );
        // Below version 4 an unset ttrpc address follows the gRPC one.
        assert_eq!(
            p(&format!("version = 3\n[grpc]\naddress = '{REAL}'\n")),
            Placement::Swapped
        );
        // From version 4 it does not.
        let v4 = format!("version = 4\n[plugins.'{GRPC_PLUGIN}']\naddress = '{REAL}'\n");
        assert!(matches!(p(&v4), Placement::Elsewhere(_)));
        let k3s = "version = 2\n[grpc]\n  address = \"/run/k3s/containerd/containerd.sock\"\n";
        match p(k3s) {
            Placement::Elsewhere(d) => {
                assert!(d.contains("/run/k3s/containerd/containerd.sock"), "{d}")
            }
            other => panic!("{other:?}"),
        }
        let ttrpc = "version = 2\n[ttrpc]\n  address = \"/run/elsewhere.ttrpc\"\n";
        assert!(matches!(p(ttrpc), Placement::Elsewhere(_)));
        // Version 4 ignores [grpc].
        assert_eq!(
            p(&format!("version = 4\n[grpc]\naddress = '{REAL}'\n")),
            Placement::Default
        );
    }

    #[test]
    fn refuses_what_it_cannot_edit_safely() {
        assert!(matches!(
            set("version = 5\n", REAL, REAL_TTRPC),
            Err(ConfigError::UnknownVersion(5))
        ));
        assert!(matches!(
            set("version = '2'\n", REAL, REAL_TTRPC),
            Err(ConfigError::BadVersion(_))
        ));
        assert!(matches!(
            set("[grpc\n", REAL, REAL_TTRPC),
            Err(ConfigError::Parse(_))
        ));
        assert!(matches!(
            set("grpc = 1\n", REAL, REAL_TTRPC),
            Err(ConfigError::NotATable(_))
        ));
        assert!(matches!(
            set("[grpc]\naddress = 1\n", REAL, REAL_TTRPC),
            Err(ConfigError::NotAString(_))
        ));
        let mixed = format!("version = 3\n[plugins.'{GRPC_PLUGIN}']\nmax_recv_message_size = 1\n");
        assert!(matches!(
            set(&mixed, REAL, REAL_TTRPC),
            Err(ConfigError::Mixed { version: 3, .. })
        ));
    }

    #[test]
    fn reset_without_state_sets_the_defaults() {
        let e = set(V4, REAL, REAL_TTRPC).unwrap();
        let (text, changed) = reset(&e.text, REAL, DEFAULT).unwrap();
        assert_eq!(changed.len(), 2, "{changed:?}");
        assert_eq!(
            read(&text).unwrap().placement(DEFAULT, REAL),
            Placement::Default
        );
        let (_, none) = reset(V2, REAL, DEFAULT).unwrap();
        assert!(none.is_empty());
    }

    /// containerd binaries on this machine: Debian's (1.6) and the test
    /// matrix's cache (scripts/containerd-matrix.sh), one per version.
    fn containerd_binaries() -> Vec<(std::path::PathBuf, String)> {
        let mut candidates = vec![std::path::PathBuf::from("/usr/bin/containerd")];
        if let Ok(dir) = std::fs::read_dir("/var/cache/imgbridge-test/containerd") {
            let mut more: Vec<_> = dir
                .flatten()
                .map(|e| e.path().join("bin/containerd"))
                .collect();
            more.sort();
            candidates.extend(more);
        }
        let mut found: Vec<(std::path::PathBuf, String)> = Vec::new();
        for bin in candidates.into_iter().filter(|p| p.is_file()) {
            let Ok(out) = std::process::Command::new(&bin).arg("--version").output() else {
                continue;
            };
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let Some(version) = text.split_whitespace().nth(2).map(str::to_owned) else {
                continue;
            };
            if !found.iter().any(|(_, v)| *v == version) {
                found.push((bin, version));
            }
        }
        found
    }

    /// The sample of each config version, and a file created from nothing.
    fn config_of_version(v: i64) -> &'static str {
        match v {
            1 => V1,
            2 => V2,
            3 => V3,
            _ => V4,
        }
    }

    #[test]
    fn containerd_reads_the_edited_addresses() {
        let bins = containerd_binaries();
        if bins.is_empty() {
            println!("note: no containerd binary (/usr/bin/containerd, /var/cache/imgbridge-test/containerd/*/bin/containerd); skipped");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for (bin, version) in bins {
            let native = crate::ops::doctor::Version::parse(&version)
                .and_then(|v| v.native_config_version())
                .unwrap_or(2);
            let mut inputs: Vec<(String, Edited)> =
                vec![("no file".into(), new_file(REAL, REAL_TTRPC))];
            for v in 1..=native {
                let e = set(config_of_version(v), REAL, REAL_TTRPC).unwrap();
                inputs.push((format!("version {v}"), e));
            }
            for (what, e) in inputs {
                let file = dir.path().join("config.toml");
                std::fs::write(&file, &e.text).unwrap();
                let out = std::process::Command::new(&bin)
                    .arg("--config")
                    .arg(&file)
                    .args(["config", "dump"])
                    .output()
                    .unwrap();
                let ctx = format!("containerd {version} ({}), {what}", bin.display());
                assert!(
                    out.status.success(),
                    "{ctx}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let dump = values(&String::from_utf8_lossy(&out.stdout));
                let plugins = dump
                    .get("version")
                    .and_then(|v| v.as_integer())
                    .unwrap_or(1)
                    >= 4;
                let (grpc, ttrpc) = if plugins {
                    (
                        at(&dump, &["plugins", GRPC_PLUGIN, "address"]),
                        at(&dump, &["plugins", TTRPC_PLUGIN, "address"]),
                    )
                } else {
                    (
                        at(&dump, &["grpc", "address"]),
                        at(&dump, &["ttrpc", "address"]),
                    )
                };
                assert_eq!(grpc, Some(REAL), "{ctx}");
                // 1.x dumps the ttrpc address as written; an empty one would
                // be derived from the gRPC address at start.
                assert_eq!(ttrpc, Some(REAL_TTRPC), "{ctx}");
                println!("{ctx}: gRPC {REAL}, ttrpc {REAL_TTRPC}");
            }
        }
    }
}
