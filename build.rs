//! Stamps the git commit into `imgbridge --version`.
fn main() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=IMGBRIDGE_GIT_COMMIT={commit}");
    // Where HEAD and the branch refs really are: in a `git worktree` .git is
    // a file, and a path that does not exist would rerun this script (and
    // rebuild the crate) on every build.
    // Only this checkout's HEAD and branch: other worktrees' commits leave
    // the stamp as it is.
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let branch = branch
        .as_deref()
        .map(|b| git(&["rev-parse", "--git-path", b]));
    for path in [
        git(&["rev-parse", "--git-path", "HEAD"]),
        branch.flatten(),
        git(&["rev-parse", "--git-path", "packed-refs"]),
    ]
    .into_iter()
    .flatten()
    .filter(|p| std::path::Path::new(p).exists())
    {
        println!("cargo:rerun-if-changed={path}");
    }
}
