//! An installed binary (`cargo install --path .`) works away from its source checkout: it
//! unpacks the default fixture, its golden and the Python scripts from itself
//! (src/cli/assets.rs). `PARITY_NO_CHECKOUT=1` makes the binary behave as if the checkout were
//! gone.

use crate::common;
use common::*;
use std::process::Command;

fn installed(
    args: &[&str],
    cwd: &std::path::Path,
    cache: &std::path::Path,
) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_parity"))
        .args(args)
        .current_dir(cwd)
        .env("PARITY_NO_CHECKOUT", "1")
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run parity")
}

#[test]
fn the_default_check_runs_away_from_the_checkout() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let o = installed(&["check"], tmp.path(), &cache);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        stdout(&o).contains(&common::default_verdict()),
        "{}",
        show(&o)
    );
    let unpacked = cache
        .join("parity")
        .join(env!("CARGO_PKG_VERSION"))
        .join("fixtures/tiny-llama-q8_0.gguf");
    assert_eq!(
        std::fs::read(&unpacked).unwrap(),
        std::fs::read(root().join("fixtures/tiny-llama-q8_0.gguf")).unwrap()
    );
}

#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn golden_runs_away_from_the_checkout() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = root().join("fixtures/tiny-llama-q4_0.gguf");
    let out = tmp.path().join("g");
    let o = installed(
        &[
            "golden",
            model.to_str().unwrap(),
            "-p",
            "Once upon a time",
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ],
        tmp.path(),
        &tmp.path().join("cache"),
    );
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(out.join("manifest.json").exists());
}

/// `parity golden MODEL` without --out keeps the golden in the user's golden folder (never the
/// repository's golden/), and `parity check MODEL` finds it there by sha256.
#[test]
#[cfg_attr(
    not(parity_llama_cpp),
    ignore = "needs llama-cpp-python (.ci/run installs it; then touch build.rs)"
)]
fn a_user_golden_goes_to_the_user_folder_and_check_finds_it() {
    if !llama_cpp_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("mine.gguf");
    let gd = tmp.path().join("goldens");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_parity"))
            .args(args)
            .current_dir(tmp.path())
            .env("PARITY_GOLDEN_DIR", &gd)
            .output()
            .unwrap()
    };
    let o = run(&["fixture", "--seed", "9", "--out", m.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let o = run(&[
        "golden",
        m.to_str().unwrap(),
        "-p",
        "Once upon a time",
        "--steps",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    let made: Vec<_> = std::fs::read_dir(&gd).unwrap().flatten().collect();
    assert_eq!(made.len(), 1);
    assert!(
        made[0].file_name().to_string_lossy().starts_with("mine-"),
        "{:?}",
        made[0].file_name()
    );
    let o = run(&["check", m.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!("golden: {}", gd.display())),
        "{}",
        show(&o)
    );
}

/// What crates.io would serve installs and runs: the three packaged crates (parity and the
/// parity-trace and parity-quant it depends on) are unpacked, installed from there (`--locked`,
/// the two libraries resolved to their packaged copies as the registry would), their sources
/// deleted, and the installed binary runs the default check from an empty folder.
/// parity first, then the libraries it depends on by path in the repository.
const CRATES: [&str; 3] = ["parity", "parity-trace", "parity-quant"];

#[test]
fn the_packaged_crates_install_and_run_away_from_their_sources() {
    // A fixed place under the target folder (not a fresh temporary one): the packaged sources'
    // path is part of what cargo hashes, so a second run rebuilds incrementally.
    let exe = std::env::current_exe().unwrap();
    let target = exe.ancestors().nth(3).unwrap().to_path_buf();
    let work = target.join("package-check");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let tmp = tempfile::tempdir_in(&work).unwrap();
    let cargo = |args: &[&str], cwd: &std::path::Path| {
        let o = Command::new(env!("CARGO"))
            .args(args)
            .envs(common::dev_profile_as_test())
            .current_dir(cwd)
            .output()
            .expect("run cargo");
        assert!(o.status.success(), "cargo {}\n{}", args.join(" "), show(&o));
    };
    let pkg = tmp.path().join("pkg");
    cargo(
        &[
            "package",
            "-p",
            "parity",
            "-p",
            "parity-trace",
            "-p",
            "parity-quant",
            "--no-verify",
            "--allow-dirty",
            "--target-dir",
            pkg.to_str().unwrap(),
        ],
        &root(),
    );
    let src = work.join("src");
    std::fs::create_dir(&src).unwrap();
    let version = env!("CARGO_PKG_VERSION");
    for name in CRATES {
        let krate = pkg.join(format!("package/{name}-{version}.crate"));
        let size = std::fs::metadata(&krate).unwrap().len();
        // crates.io refuses a crate over 10 MB.
        assert!(size < 10 << 20, "{name}: {size} bytes");
        // `-m`: the sources dated now, not as packaged. They are unpacked at a fixed path
        // into the shared build directory, where an rlib built from an earlier version of them
        // would otherwise look newer than its sources and be linked (a stale parity-trace).
        let o = Command::new("tar")
            .args(["-x", "-z", "-m", "-f"])
            .arg(&krate)
            .current_dir(&src)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
    }
    // Unpacked under the repository's target folder, the crates would count as this workspace's
    // members; from the registry they are crates of their own.
    for name in CRATES {
        let toml = src.join(format!("{name}-{version}/Cargo.toml"));
        let text = std::fs::read_to_string(&toml).unwrap();
        std::fs::write(&toml, text + "\n[workspace]\n").unwrap();
    }
    // Built in this target folder's build directory with the dev profile set as the test
    // profile (`dev_profile_as_test`), as tests/kit_python.rs builds its wheel: the
    // dependencies are what `cargo test` compiled (Cargo.toml turns on the features the
    // dev-dependencies would add), and only the unpacked crates compile. The binary itself
    // lands in a folder of its own, never over target/debug/parity, which the other tests run.
    let build_dir = format!("build.build-dir={:?}", target.to_str().unwrap());
    let patches: Vec<String> = CRATES[1..]
        .iter()
        .map(|name| {
            format!(
                "patch.crates-io.{name}.path={:?}",
                src.join(format!("{name}-{version}"))
            )
        })
        .collect();
    let inst = tmp.path().join("root");
    cargo(
        &[
            "install",
            "--locked",
            "--debug",
            "--path",
            src.join(format!("parity-{version}")).to_str().unwrap(),
            "--config",
            &patches[0],
            "--config",
            &patches[1],
            "--config",
            &build_dir,
            "--root",
            inst.to_str().unwrap(),
            "--target-dir",
            tmp.path().join("target").to_str().unwrap(),
        ],
        tmp.path(),
    );
    std::fs::remove_dir_all(&src).unwrap();
    let cwd = tmp.path().join("empty");
    std::fs::create_dir(&cwd).unwrap();
    let o = Command::new(inst.join("bin/parity"))
        .arg("check")
        .current_dir(&cwd)
        .env("XDG_CACHE_HOME", tmp.path().join("cache"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", show(&o));
    assert!(
        stdout(&o).contains(&common::default_verdict()),
        "{}",
        show(&o)
    );
}
