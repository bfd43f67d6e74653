//! No import circles inside any crate: `scripts/import-circles.py` over this workspace must find
//! none, and (so that the check itself can fail) it must find the circles of small made-up crates
//! and leave alone what is not a circle (a child using its parent, a `pub use` re-export, tests).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn check(dir: &Path) -> Output {
    Command::new("python3")
        .arg(workspace().join("scripts/import-circles.py"))
        .arg(dir)
        .output()
        .expect("python3 runs scripts/import-circles.py (install python3)")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A one-crate workspace in a fresh directory, from (path under src/, contents) pairs.
fn crate_of(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "seqpipe-import-circles-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("fixture/src")).unwrap();
    std::fs::write(
        dir.join("fixture/Cargo.toml"),
        "[package]\nname = \"fixture\"\n",
    )
    .unwrap();
    for (path, contents) in files {
        let path = dir.join("fixture/src").join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }
    dir
}

#[test]
fn no_crate_of_the_workspace_has_an_import_circle() {
    let out = check(&workspace());
    let report = text(&out);
    assert!(
        out.status.success(),
        "import circles inside crates (move the shared type to a leaf module):\n{report}"
    );
    assert!(report.contains("total: 0 import circle(s)"), "{report}");
    for krate in [
        "ops",
        "model",
        "checkpoint",
        "elastic",
        "gpu",
        "trainer",
        "seqpipe",
    ] {
        assert!(
            report.contains(&format!("{krate} (")),
            "{krate} was not checked:\n{report}"
        );
    }
    assert!(report.contains("largest file:") && report.contains("longest function"));
}

#[test]
fn a_circle_through_a_moved_error_type_is_found_and_named() {
    // The shape of issue 30's model circle: the error type lives in a file that uses the others.
    let dir = crate_of(
        "found",
        &[
            ("lib.rs", "pub mod params;\npub mod stage;\nmod nested;\n"),
            (
                "params.rs",
                "use crate::stage::ModelError;\npub struct Params;\npub fn load() -> Result<Params, ModelError> { Ok(Params) }\n",
            ),
            (
                "stage.rs",
                "use super::params::Params;\npub enum ModelError { Shape }\npub struct Stage(Params);\n",
            ),
            // Inline paths count too, here through a nested module.
            ("nested/mod.rs", "mod a;\nmod b;\n"),
            (
                "nested/a.rs",
                "pub struct A;\npub fn f() -> super::b::B { super::b::B }\n",
            ),
            (
                "nested/b.rs",
                "pub struct B;\npub fn g() { let _ = crate::nested::a::A; }\n",
            ),
        ],
    );
    let out = check(&dir);
    let report = text(&out);
    assert_eq!(out.status.code(), Some(1), "{report}");
    assert!(report.contains("2 import circle(s)"), "{report}");
    assert!(
        report.contains("circle: fixture/src/params.rs <-> fixture/src/stage.rs"),
        "{report}"
    );
    assert!(
        report.contains("fixture/src/params.rs -> fixture/src/stage.rs: crate::stage::ModelError"),
        "{report}"
    );
    assert!(
        report.contains("circle: fixture/src/nested/a.rs <-> fixture/src/nested/b.rs"),
        "{report}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn parents_re_exports_and_tests_are_not_circles() {
    let dir = crate_of(
        "clean",
        &[
            // The facade re-exports its children; a child uses its parent's items.
            (
                "lib.rs",
                "pub mod error;\npub mod params;\npub mod stage;\npub use error::ModelError;\npub use stage::Stage;\npub struct Shared;\n",
            ),
            ("error.rs", "pub enum ModelError { Shape }\n"),
            (
                "params.rs",
                "use crate::ModelError;\nuse crate::Shared;\npub struct Params(pub Shared);\npub fn load() -> Result<(), ModelError> { Ok(()) }\n\n#[cfg(test)]\nmod tests {\n    use crate::stage::Stage;\n    #[test]\n    fn t() { let _ = Stage; }\n}\n",
            ),
            (
                "stage.rs",
                "use super::params::Params;\nuse crate::error::ModelError;\npub struct Stage;\npub fn f(_: Params) -> Option<ModelError> { None }\n// crate::params::load() in a comment is no import.\nconst S: &str = \"crate::params::load\";\n",
            ),
        ],
    );
    let out = check(&dir);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(report.contains("total: 0 import circle(s)"), "{report}");
    let _ = std::fs::remove_dir_all(dir);
}
