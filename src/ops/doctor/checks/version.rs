//! The running containerd's release: against the tested matrix, whether it
//! honours the pinned label, and its Transfer service.

use crate::config::Config;
use crate::containerd::introspect::PluginState;
use crate::containerd::Containerd;
use crate::ops::doctor::report::Report;
use crate::ops::doctor::timed;
use crate::ops::doctor::versions::{tested_list, Matrix, PinnedSupport, Version};

/// Where the running version stands against [`TESTED`], plus 1.6's end of
/// upstream support (tested, because Debian 12 ships it, but unpatched).
pub(in crate::ops::doctor) fn version_matrix(
    version: &str,
    parsed: Option<Version>,
    r: &mut Report,
) {
    let what = "containerd version";
    let Some(v) = parsed else {
        r.warn(
            what,
            format!(
                "cannot parse {version:?}; imgbridge is tested on {}",
                tested_list(true)
            ),
            "report issues with this output",
        );
        return;
    };
    match v.matrix() {
        Matrix::Tested => {
            let rel = v.tested_release().unwrap_or("");
            r.pass(
                what,
                format!("{version} is in imgbridge's tested matrix ({}; tested on {rel})", tested_list(false)),
            );
        }
        Matrix::Untested => r.warn(
            what,
            format!("{version} is not in imgbridge's tested matrix ({}); expected to work", tested_list(false)),
            format!("report issues with this output; tested releases: {}", tested_list(true)),
        ),
        Matrix::TooOld => r.warn(
            what,
            format!("{version} predates imgbridge's tested matrix ({}): it has no CRI runtime.v1 API, which imgbridge confirms replicas with (and kubelet ≥ 1.26 needs), and is long out of upstream support", tested_list(false)),
            "upgrade containerd to 1.7 or 2.x",
        ),
    }
    if v.end_of_life() {
        r.warn(
            "containerd support",
            format!("1.6 is out of support upstream (end of life August 2025): {version} gets no more fixes"),
            "upgrade containerd to 1.7 or 2.x",
        );
    }
}

/// The Transfer gRPC service (`io.containerd.grpc.v1` `transfer`, backed by
/// `io.containerd.transfer.v1` `local`): clients that use it write images
/// server-side, with no Images call on the wire.
pub(in crate::ops::doctor) async fn transfer(
    c: &Containerd,
    version: &str,
    parsed: Option<Version>,
    r: &mut Report,
) {
    let what = "Transfer service";
    let uses = "ctr 2.x and nerdctl ≥ 2.3 import, pull and tag through Transfer";
    match timed(c.plugin_state("io.containerd.grpc.v1", "transfer")).await {
        Ok(PluginState::Loaded) => {
            // 1.7's Transfer stores images without publishing events.
            let events = if parsed.is_some_and(|v| !v.transfer_publishes_events()) {
                "; containerd 1.7 publishes no image events for it, so a Transfer that bypasses imgbridge is only caught at its next start"
            } else {
                ""
            };
            r.pass(what, format!("present: {uses}; imgbridge intercepts it{events}"));
        }
        Ok(PluginState::Absent) if parsed.is_some_and(Version::ships_transfer) => r.warn(
            what,
            format!("absent although containerd {version} ships it (disabled_plugins?): {uses} by default"),
            "remove io.containerd.grpc.v1.transfer and io.containerd.transfer.v1.local from disabled_plugins, or use ctr --local",
        ),
        Ok(PluginState::Absent) => r.pass(
            what,
            format!("absent (containerd {version}; it arrived in 1.7): clients write images through the Images API, which imgbridge intercepts"),
        ),
        Ok(PluginState::Failed(e)) => r.warn(
            what,
            format!("failed to load: {e}"),
            "see containerd's log; ctr --local avoids Transfer",
        ),
        Err(e) => r.warn(
            what,
            format!("could not tell: {e}"),
            "check that the Introspection service is enabled",
        ),
    }
}

pub(in crate::ops::doctor) fn pinned(config: &Config, version: &str, r: &mut Report) {
    let wanted = config.replication.pin || config.import.pin;
    let what = "pinned label";
    let Some(v) = Version::parse(version) else {
        r.warn(
            what,
            format!("cannot parse containerd version {version:?}"),
            "io.cri-containerd.pinned is honoured from 1.6.22 / 1.7.3 (fully from 1.6.25 / 1.7.10) and by 2.x",
        );
        return;
    };
    let upgrade = "upgrade containerd to ≥ 1.6.25, ≥ 1.7.10 or 2.x";
    match (v.pinned_support(), wanted) {
        (PinnedSupport::Full, _) => r.pass(
            what,
            format!("containerd {version} honours io.cri-containerd.pinned"),
        ),
        (_, false) => r.pass(
            what,
            format!("containerd {version} would not fully honour io.cri-containerd.pinned, but pinning is off (replication.pin, import.pin)"),
        ),
        (PinnedSupport::Partial, true) => r.warn(
            what,
            format!("containerd {version} honours io.cri-containerd.pinned only when every reference of the image carries it (CRI cache merge fixed in 1.6.25 / 1.7.10)"),
            upgrade,
        ),
        (PinnedSupport::No, true) => r.warn(
            what,
            format!("containerd {version} ignores io.cri-containerd.pinned (added in 1.6.22 / 1.7.3): kubelet image GC may delete pinned replicas and imports under disk pressure"),
            upgrade,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(r: &Report) -> Vec<String> {
        r.checks.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn version_lines() {
        let run = |v: &str| {
            let mut r = Report::default();
            version_matrix(v, Version::parse(v), &mut r);
            lines(&r)
        };
        let l = run("1.6.20~ds1");
        assert_eq!(l.len(), 2, "{l:?}");
        assert!(l[0].starts_with("✓ containerd version: 1.6.20~ds1 is in imgbridge's tested matrix (1.6, 1.7, 2.1, 2.4; tested on 1.6.20)"), "{l:?}");
        assert!(
            l[1].starts_with("! containerd support: 1.6 is out of support upstream")
                && l[1].contains("fix: upgrade containerd to 1.7 or 2.x"),
            "{l:?}"
        );
        let l = run("v2.4.2");
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(l[0].contains("tested on 2.4.2"), "{l:?}");
        let l = run("2.2.1");
        assert_eq!(l, vec!["! containerd version: 2.2.1 is not in imgbridge's tested matrix (1.6, 1.7, 2.1, 2.4); expected to work — fix: report issues with this output; tested releases: 1.6.20, 1.7.24, 2.1.9, 2.4.2".to_string()]);
        let l = run("1.5.18");
        assert!(
            l[0].starts_with("! containerd version: 1.5.18 predates")
                && l[0].contains("runtime.v1")
                && l[0].ends_with("fix: upgrade containerd to 1.7 or 2.x"),
            "{l:?}"
        );
        let l = run("dev");
        assert!(
            l[0].starts_with("! containerd version: cannot parse \"dev\""),
            "{l:?}"
        );
    }
}
