//! Log set-up: human (`text`) or JSON lines on stderr, with a
//! `RUST_LOG`-style filter from `log.filter`; the `RUST_LOG` variable wins.

use tracing_subscriber::EnvFilter;

use crate::config::Log;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{origin} {filter:?} is not a valid log filter: {reason}")]
    Filter {
        origin: &'static str,
        filter: String,
        reason: String,
    },
    #[error("log.format {0:?}: expected \"text\" or \"json\"")]
    Format(String),
    #[error("a global logger is already installed")]
    AlreadySet,
}

/// The filter in effect: `RUST_LOG` when set (and not empty), else
/// `log.filter` (empty means `info`).
pub fn filter(config_filter: &str, rust_log: Option<&str>) -> Result<EnvFilter, LogError> {
    let (origin, f) = match rust_log.filter(|v| !v.trim().is_empty()) {
        Some(v) => ("RUST_LOG", v),
        None if config_filter.trim().is_empty() => ("log.filter", "info"),
        None => ("log.filter", config_filter),
    };
    EnvFilter::builder().parse(f).map_err(|e| LogError::Filter {
        origin,
        filter: f.into(),
        reason: e.to_string(),
    })
}

/// Installs the global subscriber described by `log` (stderr).
pub fn init(log: &Log) -> Result<(), LogError> {
    let env = std::env::var("RUST_LOG").ok();
    let filter = filter(&log.filter, env.as_deref())?;
    // Colour codes only for a person at a terminal: journald and log files
    // got raw escape sequences.
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match log.format.as_str() {
        "json" => b.json().try_init(),
        "text" => b.try_init(),
        other => return Err(LogError::Format(other.into())),
    }
    .map_err(|_| LogError::AlreadySet)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_wins_and_errors_name_their_origin() {
        assert_eq!(filter("debug", None).unwrap().to_string(), "debug");
        assert_eq!(
            filter("debug", Some("imgbridge=trace"))
                .unwrap()
                .to_string(),
            "imgbridge=trace"
        );
        assert_eq!(filter("", Some(" ")).unwrap().to_string(), "info");
        let e = filter("imgbridge=loud", None).unwrap_err().to_string();
        assert!(e.starts_with("log.filter"), "{e}");
        let e = filter("info", Some("x=loud")).unwrap_err().to_string();
        assert!(e.starts_with("RUST_LOG"), "{e}");
    }
}
