//! What doctor found and how it is shown: each check gives a typed
//! [`Verdict`] with its detail; the [`Report`] renders them, one line each,
//! `✓` fine, `!` works but worth fixing, `✗` broken (exit status 1).

use std::fmt::{self, Display};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Pass,
    Warn,
    Fail,
}

impl Level {
    pub fn mark(self) -> char {
        match self {
            Level::Pass => '✓',
            Level::Warn => '!',
            Level::Fail => '✗',
        }
    }
}

/// What a check concluded; a warning or failure says what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Warn { fix: String },
    Fail { fix: String },
}

impl Verdict {
    pub fn level(&self) -> Level {
        match self {
            Verdict::Pass => Level::Pass,
            Verdict::Warn { .. } => Level::Warn,
            Verdict::Fail { .. } => Level::Fail,
        }
    }

    pub fn fix(&self) -> Option<&str> {
        match self {
            Verdict::Pass => None,
            Verdict::Warn { fix } | Verdict::Fail { fix } => Some(fix),
        }
    }
}

/// One checked fact.
#[derive(Clone, Debug)]
pub struct Check {
    /// Short name of what was checked (`upstream`, `proxy socket`, …).
    pub what: String,
    pub detail: String,
    pub verdict: Verdict,
}

impl Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = self.verdict.level().mark();
        write!(f, "{mark} {}: {}", self.what, self.detail)?;
        if let Some(fix) = self.verdict.fix() {
            write!(f, " — fix: {fix}")?;
        }
        Ok(())
    }
}

/// All checks, in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// True when any check is `✗` (doctor then exits 1).
    pub fn failed(&self) -> bool {
        (self.checks.iter()).any(|c| c.verdict.level() == Level::Fail)
    }

    pub(crate) fn pass(&mut self, what: &str, detail: impl Into<String>) {
        self.push(what, detail.into(), Verdict::Pass);
    }

    pub(crate) fn warn(&mut self, what: &str, detail: impl Into<String>, fix: impl Into<String>) {
        self.push(what, detail.into(), Verdict::Warn { fix: fix.into() });
    }

    pub(crate) fn fail(&mut self, what: &str, detail: impl Into<String>, fix: impl Into<String>) {
        self.push(what, detail.into(), Verdict::Fail { fix: fix.into() });
    }

    /// Adds a check's verdict on `what`, its detail folded into one line.
    pub fn push(&mut self, what: &str, detail: String, verdict: Verdict) {
        self.checks.push(Check {
            what: what.into(),
            detail: one_line(&detail),
            verdict,
        });
    }
}

impl Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            writeln!(f, "{c}")?;
        }
        let n = |l| {
            (self.checks.iter())
                .filter(|c| c.verdict.level() == l)
                .count()
        };
        writeln!(
            f,
            "{} ok, {} warnings, {} failed",
            n(Level::Pass),
            n(Level::Warn),
            n(Level::Fail)
        )
    }
}

/// Folds a multi-line message (toml quotes the offending line with `|` and
/// `^` markers) into one line.
pub(crate) fn one_line(s: &str) -> String {
    s.lines()
        .map(|l| {
            let l = l.trim();
            // Only a `12 | ` gutter is dropped: details may start with digits.
            let rest = l
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start();
            match rest.strip_prefix('|') {
                Some(quoted) => quoted.trim(),
                None => l,
            }
        })
        .filter(|l| !l.is_empty() && !l.chars().all(|c| c == '^'))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;

    #[test]
    fn multi_line_errors_become_one_line() {
        let e = Config::from_toml("[replication]\npinn = true\n", Path::new("c.toml")).unwrap_err();
        let l = one_line(&e.to_string());
        assert!(!l.contains('\n'), "{l}");
        assert!(
            l.contains("pinn = true") && l.contains("unknown field `pinn`"),
            "{l}"
        );
        assert_eq!(one_line("1.6 is old\n2 | quoted\n"), "1.6 is old quoted");
    }

    #[test]
    fn renders_one_line_per_check() {
        let mut r = Report::default();
        r.pass("a", "fine");
        r.warn("b", "meh", "do x");
        assert!(!r.failed());
        r.fail("c", "broken", "do y");
        assert!(r.failed());
        let s = r.to_string();
        assert!(
            s.contains("✓ a: fine\n! b: meh — fix: do x\n✗ c: broken — fix: do y\n"),
            "{s}"
        );
        assert!(s.ends_with("1 ok, 1 warnings, 1 failed\n"));
    }
}
