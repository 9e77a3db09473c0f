//! The names replicas never replace in a target, as doctor lists them
//! ([`crate::replicate::protect`]): CRI's sandbox image, the images pinned
//! in each target by others, and the configured globs.

use super::{timed, Report};
use crate::config::Config;
use crate::containerd::{node_config, Containerd};
use crate::labels::{PINNED, PINNED_VALUE};
use crate::replicate::protect::pinned_by_others;

/// One line: what is protected now, and the setting that lifts it.
pub(in crate::ops::doctor) async fn check(config: &Config, c: &Containerd, r: &mut Report) {
    let what = "protected names";
    let file = node_config::locate_for(&config.upstream);
    let sandbox = match timed(c.cri_sandbox_image(file.as_deref())).await {
        Ok(Some(s)) => format!("CRI's sandbox image {s}"),
        Ok(None) => "no CRI sandbox image".to_string(),
        Err(e) => format!("CRI's sandbox image unknown ({e})"),
    };
    let mut parts = vec![sandbox];
    let filter = format!("labels.\"{PINNED}\"==\"{PINNED_VALUE}\"");
    for target in &config.replication.target_namespaces {
        match timed(c.list_images(target, vec![filter.clone()])).await {
            Ok(images) => {
                let n = images.iter().filter(|i| pinned_by_others(i)).count();
                parts.push(format!("{n} image(s) pinned by others in {target}"));
            }
            Err(e) => {
                r.warn(
                    what,
                    format!("could not list pinned images in {target}: {e}"),
                    "check containerd's logs",
                );
                return;
            }
        }
    }
    let rep = &config.replication;
    let list = |g: &[String]| match g.is_empty() {
        true => "none".to_string(),
        false => g.join(", "),
    };
    parts.push(format!("replication.protect: {}", list(&rep.protect)));
    parts.push(format!("replication.overwrite: {}", list(&rep.overwrite)));
    r.pass(what, parts.join("; "));
}
