//! `payonce simulate`: the simulator is its own binary (`payonce-sim`, in
//! sim/, tested there); `payonce simulate ARGS` runs it from the payonce
//! binary's directory with the same arguments and exit status, and says how
//! to build it when it is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A directory under Cargo's target tmp dir holding a copy of the payonce
/// binary (a hard link where possible), so the test decides what is next to it.
fn lone_payonce(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("simulate-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create dir");
    let exe = dir.join("payonce");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_payonce"), &exe).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_payonce"), &exe).expect("copy payonce");
    }
    dir
}

fn run(dir: &Path, args: &[&str]) -> Output {
    Command::new(dir.join("payonce")).arg("simulate").args(args).output().expect("run payonce")
}

#[test]
fn without_payonce_sim_next_to_it_simulate_says_how_to_build_it() {
    let dir = lone_payonce("missing");
    let out = run(&dir, &["--help"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("payonce-sim not found next to payonce"), "{stderr}");
    assert!(stderr.contains("cargo build --workspace"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn simulate_runs_payonce_sim_with_its_arguments_and_exit_status() {
    use std::os::unix::fs::PermissionsExt;
    let dir = lone_payonce("present");
    let sim = dir.join("payonce-sim");
    std::fs::write(&sim, "#!/bin/sh\necho \"payonce-sim got: $*\"\nexit 7\n").expect("write stand-in");
    std::fs::set_permissions(&sim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = run(&dir, &["--channel", "all", "--orders", "5"]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "payonce-sim got: --channel all --orders 5\n");
    let _ = std::fs::remove_dir_all(&dir);
}
