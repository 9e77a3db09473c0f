//! Where the repository and the binary under test are.
//!
//! This crate lives at `tests/support`, so its `CARGO_MANIFEST_DIR` is not
//! the repository's; and `env!("CARGO_BIN_EXE_imgbridge")` is defined only
//! when compiling the integration tests of the package that owns the
//! binary, never for a library they depend on.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository's root (where `scripts/` and `Cargo.toml` are): two
/// levels above this crate's manifest.
pub fn repo_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        root.canonicalize()
            .unwrap_or_else(|e| panic!("repository root {}: {e}", root.display()))
    })
}

/// `scripts/<name>` of the repository.
pub fn script(name: &str) -> PathBuf {
    repo_root().join("scripts").join(name)
}

/// The `imgbridge` binary under test, the one cargo built for this run.
///
/// `CARGO_BIN_EXE_imgbridge` in the environment if set (cargo sets it at
/// run time too when it runs an integration test), else the binary next to
/// the test executable's directory: cargo puts integration tests in
/// `target/<profile>/deps/` and the package's binaries, which it builds
/// before running any integration test, in `target/<profile>/`. Either way
/// it is the same profile and target dir as the test itself.
pub fn imgbridge_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = match std::env::var_os("CARGO_BIN_EXE_imgbridge") {
            Some(p) => PathBuf::from(p),
            None => {
                let exe = std::env::current_exe().expect("the test executable's path");
                let profile_dir = exe
                    .parent()
                    .and_then(Path::parent)
                    .unwrap_or_else(|| panic!("{} is not in target/<profile>/deps", exe.display()));
                profile_dir.join("imgbridge")
            }
        };
        assert!(
            bin.is_file(),
            "no imgbridge binary at {} (run the tests with cargo test, which builds it)",
            bin.display()
        );
        bin
    })
}
