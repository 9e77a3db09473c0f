//! The containerd facts that change imgbridge's behaviour, as pure
//! functions of a release number: which lines the tests run on, whether the
//! pinned label is honoured, whether Transfer ships, which config `version`
//! is native. Doctor's checks ask these; the tests' flavours do too.

pub use crate::containerd::node_config::parse_version;

/// containerd release lines imgbridge's test suite runs against, with the
/// exact release tested on each: `(major, minor, release)`. The one place
/// the matrix is written down; doctor warns outside it.
pub const TESTED: &[(u64, u64, &str)] = &[
    (1, 6, "1.6.20"),
    (1, 7, "1.7.24"),
    (2, 1, "2.1.9"),
    (2, 4, "2.4.2"),
];

/// A containerd release, `major.minor.patch` (what [`Version::parse`] makes
/// of `1.7.24~ds1-5`, `v2.4.2`, `2.1.9+unknown`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

impl From<(u64, u64, u64)> for Version {
    fn from((major, minor, patch): (u64, u64, u64)) -> Version {
        Version {
            major,
            minor,
            patch,
        }
    }
}

impl Version {
    /// The release in a version string as containerd reports it; `None`
    /// for a development build (`dev`, empty).
    pub fn parse(version: &str) -> Option<Version> {
        parse_version(version).map(Version::from)
    }

    /// Its release line (`(1, 7)`).
    pub fn line(self) -> (u64, u64) {
        (self.major, self.minor)
    }

    /// Whether CRI honours `io.cri-containerd.pinned`.
    pub fn pinned_support(self) -> PinnedSupport {
        match (self.major, self.minor) {
            (0, _) => PinnedSupport::No,
            (1, m) if m < 6 => PinnedSupport::No,
            (1, 6) if self.patch >= 25 => PinnedSupport::Full,
            (1, 6) if self.patch >= 22 => PinnedSupport::Partial,
            (1, 6) => PinnedSupport::No,
            (1, 7) if self.patch >= 10 => PinnedSupport::Full,
            (1, 7) if self.patch >= 3 => PinnedSupport::Partial,
            (1, 7) => PinnedSupport::No,
            _ => PinnedSupport::Full,
        }
    }

    /// Where it stands against [`TESTED`].
    pub fn matrix(self) -> Matrix {
        if TESTED.iter().any(|&(ma, mi, _)| (ma, mi) == self.line()) {
            Matrix::Tested
        } else if self.line() < (1, 6) {
            Matrix::TooOld
        } else {
            Matrix::Untested
        }
    }

    /// The release of its line the tests run on, if they run on its line.
    pub fn tested_release(self) -> Option<&'static str> {
        (TESTED.iter().find(|t| (t.0, t.1) == self.line())).map(|t| t.2)
    }

    /// Out of upstream support while still in [`TESTED`] (1.6: Debian 12
    /// ships it, but it gets no more fixes since August 2025).
    pub fn end_of_life(self) -> bool {
        self.line() == (1, 6)
    }

    /// Whether it ships the Transfer service (1.7 and later).
    pub fn ships_transfer(self) -> bool {
        self.line() >= (1, 7)
    }

    /// Whether its Transfer service publishes image events (1.7's does not).
    pub fn transfer_publishes_events(self) -> bool {
        self.line() != (1, 7)
    }

    /// The config `version` it reads without migrating it: 2 for 1.x (1
    /// still loads there, deprecated), 3 for 2.0–2.2, 4 from 2.3 (server
    /// settings moved into plugins). `None` for releases newer than known.
    pub fn native_config_version(self) -> Option<i64> {
        match self.line() {
            (0 | 1, _) => Some(2),
            (2, m) if m < 3 => Some(3),
            (2, _) => Some(4),
            _ => None,
        }
    }
}

/// Whether a containerd version makes CRI honour `io.cri-containerd.pinned`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinnedSupport {
    /// 1.6.25+, 1.7.10+, 2.x: pinned on any reference of an image counts.
    Full,
    /// 1.6.22–1.6.24, 1.7.3–1.7.9: honoured, but CRI's per-image cache did
    /// not merge the label across references (fixed by 7f7ba31b6).
    Partial,
    /// Before 1.6.22 / 1.7.3: the label is ignored.
    No,
}

/// Where a containerd version stands against [`TESTED`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matrix {
    /// Its minor line is in [`TESTED`].
    Tested,
    /// 1.6 or newer, but a line the tests do not run on (2.0, 2.2, 2.5, 3.x…).
    Untested,
    /// 1.5 or older: no CRI `runtime.v1` API (imgbridge confirms replicas
    /// with it; kubelet ≥ 1.26 needs it), and long out of upstream support.
    TooOld,
}

/// [`Version::pinned_support`] of a parsed version.
pub fn pinned_support(v: impl Into<Version>) -> PinnedSupport {
    v.into().pinned_support()
}

/// [`Version::matrix`] of a parsed version.
pub fn matrix(v: impl Into<Version>) -> Matrix {
    v.into().matrix()
}

/// [`Version::ships_transfer`] of a parsed version.
pub fn ships_transfer(v: impl Into<Version>) -> bool {
    v.into().ships_transfer()
}

/// [`Version::native_config_version`] of a parsed version.
pub fn native_config_version(v: impl Into<Version>) -> Option<i64> {
    v.into().native_config_version()
}

/// `1.6, 1.7, 2.1, 2.4` (lines) or `1.6.20, 1.7.24, …` (releases).
pub(super) fn tested_list(releases: bool) -> String {
    TESTED
        .iter()
        .map(|&(ma, mi, rel)| {
            if releases {
                rel.to_string()
            } else {
                format!("{ma}.{mi}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        assert_eq!(parse_version("1.6.20~ds1"), Some((1, 6, 20)));
        assert_eq!(parse_version("v1.7.3"), Some((1, 7, 3)));
        assert_eq!(parse_version("2.0.0-rc.1"), Some((2, 0, 0)));
        assert_eq!(parse_version("1.7.27-k3s1"), Some((1, 7, 27)));
        assert_eq!(parse_version("1.7"), Some((1, 7, 0)));
        assert_eq!(parse_version("v2.4.2"), Some((2, 4, 2)));
        assert_eq!(parse_version("2.1.9~ds1"), Some((2, 1, 9)));
        assert_eq!(parse_version("2.1.9+unknown"), Some((2, 1, 9)));
        assert_eq!(parse_version("1.7.24~ds1-5"), Some((1, 7, 24)));
        assert_eq!(parse_version("2.4.0-beta+unknown"), Some((2, 4, 0)));
        assert_eq!(parse_version("dev"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn classifies_versions_against_the_tested_matrix() {
        let m = |v| matrix(parse_version(v).unwrap());
        for v in [
            "1.6.20~ds1",
            "1.6.39",
            "v1.7.24",
            "1.7.0",
            "2.1.9+unknown",
            "v2.4.2",
            "2.4.0",
        ] {
            assert_eq!(m(v), Matrix::Tested, "{v}");
        }
        for v in ["2.0.0", "2.2.1", "v2.3.4", "2.5.0", "3.0.0", "1.8.0"] {
            assert_eq!(m(v), Matrix::Untested, "{v}");
        }
        for v in ["1.5.18", "1.4.13", "1.0.0", "0.2.9"] {
            assert_eq!(m(v), Matrix::TooOld, "{v}");
        }
        // Each tested release belongs to its own line.
        for &(ma, mi, rel) in TESTED {
            let v = parse_version(rel).unwrap();
            assert_eq!((v.0, v.1), (ma, mi), "{rel}");
        }
        assert_eq!(tested_list(false), "1.6, 1.7, 2.1, 2.4");
        assert_eq!(tested_list(true), "1.6.20, 1.7.24, 2.1.9, 2.4.2");
    }

    #[test]
    fn transfer_ships_from_1_7() {
        let s = |v| ships_transfer(parse_version(v).unwrap());
        assert!(!s("1.6.20~ds1"));
        assert!(s("1.7.0"));
        assert!(s("2.1.9"));
        assert!(s("v2.4.2"));
    }

    #[test]
    fn native_config_version_by_release() {
        let n = |v| native_config_version(parse_version(v).unwrap());
        assert_eq!(n("1.6.20~ds1"), Some(2));
        assert_eq!(n("1.7.24~ds1-5"), Some(2));
        assert_eq!(n("2.0.0"), Some(3));
        assert_eq!(n("2.1.9~ds1"), Some(3));
        assert_eq!(n("2.2.1"), Some(3));
        assert_eq!(n("2.3.0"), Some(4));
        assert_eq!(n("v2.4.2"), Some(4));
        assert_eq!(n("3.0.0"), None);
    }

    #[test]
    fn pinned_support_by_version() {
        let s = |v| pinned_support(parse_version(v).unwrap());
        assert_eq!(s("1.6.20~ds1"), PinnedSupport::No);
        assert_eq!(s("1.6.21"), PinnedSupport::No);
        assert_eq!(s("1.6.22"), PinnedSupport::Partial);
        assert_eq!(s("1.6.25"), PinnedSupport::Full);
        assert_eq!(s("1.7.2"), PinnedSupport::No);
        assert_eq!(s("1.7.3"), PinnedSupport::Partial);
        assert_eq!(s("1.7.10"), PinnedSupport::Full);
        assert_eq!(s("1.5.18"), PinnedSupport::No);
        assert_eq!(s("2.0.0"), PinnedSupport::Full);
        assert_eq!(s("2.2.1"), PinnedSupport::Full);
    }

    /// Every fact of a release, in one row: the table to extend when a
    /// containerd release changes one.
    #[test]
    fn facts_by_release() {
        use Matrix::{Tested, TooOld, Untested};
        use PinnedSupport::{Full, No, Partial};
        /// Release, matrix, pinned label, Transfer, native config, end of life.
        type Row = (&'static str, Matrix, PinnedSupport, bool, Option<i64>, bool);
        #[rustfmt::skip]
        let table: &[Row] = &[
            // release     matrix     pinned   transfer config  end of life
            ("1.5.18",     TooOld,    No,      false,   Some(2), false),
            ("1.6.20~ds1", Tested,    No,      false,   Some(2), true),
            ("1.6.22",     Tested,    Partial, false,   Some(2), true),
            ("1.6.25",     Tested,    Full,    false,   Some(2), true),
            ("1.7.2",      Tested,    No,      true,    Some(2), false),
            ("1.7.3",      Tested,    Partial, true,    Some(2), false),
            ("1.7.24",     Tested,    Full,    true,    Some(2), false),
            ("2.0.0",      Untested,  Full,    true,    Some(3), false),
            ("2.1.9",      Tested,    Full,    true,    Some(3), false),
            ("2.2.1",      Untested,  Full,    true,    Some(3), false),
            ("2.3.0",      Untested,  Full,    true,    Some(4), false),
            ("v2.4.2",     Tested,    Full,    true,    Some(4), false),
            ("3.0.0",      Untested,  Full,    true,    None,    false),
        ];
        for &(release, m, pinned, transfer, config, eol) in table {
            let v = Version::parse(release).unwrap();
            let got = (v.matrix(), v.pinned_support(), v.ships_transfer());
            assert_eq!(got, (m, pinned, transfer), "{release}");
            assert_eq!(v.native_config_version(), config, "{release}");
            assert_eq!(v.end_of_life(), eol, "{release}");
            assert_eq!(
                v.transfer_publishes_events(),
                v.line() != (1, 7),
                "{release}"
            );
        }
        assert_eq!(Version::parse("dev"), None);
        assert_eq!(
            Version::parse("v2.4.2").unwrap().tested_release(),
            Some("2.4.2")
        );
        assert_eq!(Version::parse("2.2.1").unwrap().tested_release(), None);
    }
}
