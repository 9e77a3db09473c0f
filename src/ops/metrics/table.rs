//! Every metric imgbridge exports, written once: [`super::Metrics::new`]
//! registers them from [`METRICS`], and docs/operations.md's list is
//! [`readme_list`] (a test fails when docs/operations.md's copy differs).

use prometheus_client::registry::Unit;

/// Every metric name starts with this (and `_`).
pub const PREFIX: &str = "imgbridge";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    /// A constant 1 whose labels carry the facts (`_info`).
    Info,
}

/// The unit a metric's name ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricUnit {
    Bytes,
    Seconds,
}

/// One exported metric.
#[derive(Debug)]
pub struct MetricDef {
    /// As registered: without the prefix, the unit or the type's suffix.
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Option<MetricUnit>,
    /// Its label names (none for a single series).
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

impl MetricDef {
    /// The name as a scrape shows it (`imgbridge_proxy_relayed_bytes_total`).
    pub fn exposed(&self) -> String {
        let unit = match self.unit {
            Some(MetricUnit::Bytes) => "_bytes",
            Some(MetricUnit::Seconds) => "_seconds",
            None => "",
        };
        let suffix = match self.kind {
            Kind::Counter => "_total",
            Kind::Info => "_info",
            Kind::Gauge | Kind::Histogram => "",
        };
        format!("{PREFIX}_{}{unit}{suffix}", self.name)
    }

    pub(super) fn unit(&self) -> Option<Unit> {
        self.unit.map(|u| match u {
            MetricUnit::Bytes => Unit::Bytes,
            MetricUnit::Seconds => Unit::Seconds,
        })
    }
}

const fn def(
    name: &'static str,
    kind: Kind,
    unit: Option<MetricUnit>,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricDef {
    MetricDef {
        name,
        kind,
        unit,
        labels,
        help,
    }
}

use Kind::{Counter, Gauge, Histogram, Info};
use MetricUnit::{Bytes, Seconds};

/// Every metric, in the order a scrape lists them.
#[rustfmt::skip]
pub const METRICS: &[MetricDef] = &[
    def("registry_requests", Counter, None, &["method", "route", "status"],
        "Requests the registry endpoint answered, by method, route (blob, upload, manifest, tags, referrers, ping) and HTTP status"),
    def("registry_blob_received", Counter, Some(Bytes), &[],
        "Blob bytes clients uploaded to the registry endpoint (written into containerd)"),
    def("broken_calls", Counter, None, &["outcome"],
        "Writes of imgbridge's own during which containerd's connection broke (did containerd crash?), by what followed: held_back (retried later) or stopped (not sent again)"),
    def("proxy_calls", Counter, None, &["method", "grpc_status"],
        "gRPC calls relayed, by method and final grpc-status (\"none\": the stream ended without one)"),
    def("hpack_desync", Counter, None, &[],
        "Client connections closed because imgbridge could no longer decode their request headers (HPACK state diverged), so could not tell which calls to intercept"),
    def("pings_answered", Counter, None, &[],
        "Client PINGs imgbridge answered itself because a held reply reached the client late (containerd would have counted them as too many pings)"),
    def("proxy_streams_in_flight", Gauge, None, &[],
        "gRPC calls (HTTP/2 streams) currently being relayed"),
    def("tasks_alive", Gauge, None, &[],
        "Tokio tasks alive in the process, read at each scrape (one that only rises is a leak: docs/reliability.md)"),
    def("proxy_relayed", Counter, Some(Bytes), &[],
        "Response DATA bytes relayed from containerd to clients"),
    def("replications", Counter, None, &["outcome", "target"],
        "Replications of one image into one target namespace, by outcome"),
    def("replication_duration", Histogram, Some(Seconds), &[],
        "Time to replicate one image into one target (all outcomes)"),
    def("cri_wait_duration", Histogram, Some(Seconds), &[],
        "Time until CRI ImageStatus resolved a new replica"),
    def("pending_blobs", Gauge, None, &[],
        "Blobs replicas are waiting for (not yet present in the source namespace)"),
    def("reconcile_passes", Counter, None, &["outcome"],
        "Full reconcile passes (source namespaces → targets), by outcome"),
    def("imported_files", Counter, None, &["outcome"],
        "Archives and pull lists processed from watched directories, by outcome"),
    def("pins", Counter, None, &[],
        "Images labelled io.cri-containerd.pinned by imgbridge"),
    def("unpins", Counter, None, &[], "Pins removed by imgbridge"),
    def("build", Info, None, &["version", "commit"],
        "imgbridge version and git commit"),
];

/// The entry of `name` (as registered). Panics on a name not in the table:
/// [`super::Metrics::new`] runs in every test, so a metric registered
/// without an entry fails them all.
pub fn find(name: &str) -> &'static MetricDef {
    (METRICS.iter().find(|d| d.name == name))
        .unwrap_or_else(|| panic!("metric {name} is not in METRICS"))
}

/// The documented metric list (docs/operations.md): a Markdown table, one row per metric.
pub fn readme_list() -> String {
    let mut out = String::from("| metric | type | labels | what it counts |\n|---|---|---|---|\n");
    for d in METRICS {
        let kind = match d.kind {
            Counter => "counter",
            Gauge => "gauge",
            Histogram => "histogram",
            Info => "info",
        };
        let labels = (d.labels.iter().map(|l| format!("`{l}`")))
            .collect::<Vec<_>>()
            .join(", ");
        let help = d.help.replace('|', "\\|");
        out += &format!("| `{}` | {kind} | {labels} | {help} |\n", d.exposed());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::metrics::Metrics;

    const BEGIN: &str = "<!-- metrics:begin (generated from src/ops/metrics/table.rs) -->\n";
    const END: &str = "<!-- metrics:end -->";

    /// What a scrape says of each metric family (name as in `# HELP`, help,
    /// type) is what the table says. Families with labels show only once
    /// they have a series, so those missing must be the labelled ones.
    #[test]
    fn every_metric_is_registered_from_the_table() {
        let text = Metrics::new().encode();
        let mut scraped: Vec<(String, String, String)> = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                let help = help.strip_suffix('.').unwrap_or(help);
                scraped.push((name.into(), help.into(), String::new()));
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                let last = scraped.last_mut().unwrap();
                assert_eq!(last.0, name, "TYPE follows its HELP");
                last.2 = kind.into();
            }
        }
        let mut table = Vec::new();
        for d in METRICS {
            let exposed = d.exposed();
            let family = (exposed.strip_suffix("_total"))
                .or_else(|| exposed.strip_suffix("_info"))
                .unwrap_or(&exposed)
                .to_string();
            if !scraped.iter().any(|(n, ..)| *n == family) {
                assert!(!d.labels.is_empty(), "{family} is not registered");
                continue;
            }
            let kind = format!("{:?}", d.kind).to_lowercase();
            table.push((family, d.help.to_string(), kind));
        }
        assert_eq!(scraped, table);
    }

    /// docs/operations.md's metric list is the table's. To refresh it after a change
    /// to [`METRICS`]: `IMGBRIDGE_BLESS_README=1 cargo test --lib readme_lists`.
    #[test]
    fn readme_lists_every_metric() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md");
        let readme = std::fs::read_to_string(&path).unwrap();
        let start = readme
            .find(BEGIN)
            .expect("docs/operations.md has the metrics:begin marker")
            + BEGIN.len();
        let end = start
            + readme[start..]
                .find(END)
                .expect("docs/operations.md has the metrics:end marker");
        let want = readme_list();
        if readme[start..end] != want && std::env::var_os("IMGBRIDGE_BLESS_README").is_some() {
            std::fs::write(
                &path,
                format!("{}{want}{}", &readme[..start], &readme[end..]),
            )
            .unwrap();
            return;
        }
        assert_eq!(
            readme[start..end],
            want,
            "docs/operations.md's metric list differs from src/ops/metrics/table.rs: \
             run IMGBRIDGE_BLESS_README=1 cargo test --lib readme_lists"
        );
    }
}
